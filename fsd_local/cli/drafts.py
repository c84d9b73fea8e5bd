"""A target given without a draft (chat, generate, serve, bench, calibrate): the smallest local model that can
draft for it is chosen and named on stderr; when none can, prompt lookup (--drafter ngram) drafts instead, with a
note on what to pull. `--draft none` keeps plain decoding (the target alone)."""

from __future__ import annotations

from collections.abc import Callable

import click

from fsd_local.pairs.names import NONE
from fsd_local.settings import Settings


def _explicit(param: str) -> bool:
    ctx = click.get_current_context(silent=True)
    if ctx is None or param not in ctx.params:
        return False
    return ctx.get_parameter_source(param) not in (click.core.ParameterSource.DEFAULT, None)


def auto_draft(
    target_path: str, target_arg: str, draft_arg: str | None, settings: Settings, say: Callable | None
) -> tuple[str | None, Settings]:
    """(draft path or None, the settings to run with) for a target whose settings need a draft model."""
    from fsd_local.pairs.names import choose_draft

    say = say or (lambda msg: None)
    if draft_arg == NONE:
        if _explicit("mode"):
            raise click.UsageError(
                f"mode {settings.mode} drafts with a draft model, and --draft none gives none: add --drafter ngram "
                "(prompt lookup) or use --mode ar"
            )
        say("--draft none: plain decoding, the target alone (mode ar)")
        return None, settings.with_(mode="ar")
    choice = choose_draft(target_path)
    if choice.draft is not None:
        say(choice.chosen_note(target_arg))
        return choice.draft.path, settings
    fallback = settings.with_(drafter="ngram")
    if choice.target.problem and not fallback.needs_draft:  # the loader says what is wrong with the target
        return None, fallback
    if fallback.needs_draft:  # draft-only: prompt lookup cannot stand in for the draft model
        raise click.UsageError(f"mode {settings.mode} needs --draft: {choice.missing_note(target_arg)}")
    say(f"{choice.missing_note(target_arg)}. Meanwhile prompt lookup drafts (--drafter ngram).")
    return None, fallback


def bench_drafters(model_kwargs: dict, drafters: list[str], say: Callable) -> list[str]:
    """bench given a target alone: sets model_kwargs['draft'] to the chosen draft, or benchmarks prompt lookup
    (the drafters it returns) when none fits or with --draft none."""
    if not model_kwargs.get("target") or model_kwargs.get("pair") or all(d == "ngram" for d in drafters):
        return drafters
    if model_kwargs.get("draft") not in (None, NONE):
        return drafters
    if model_kwargs.get("draft") == NONE:
        say("--draft none: no draft model, so the speculative rows draft by prompt lookup (--drafter ngram)")
        return ["ngram"]
    from fsd_local.pairs.names import resolve

    target = resolve(model_kwargs["target"], "target")  # a path, or a model of the local stores
    path, settings = auto_draft(target, model_kwargs["target"], None, Settings(), say)
    model_kwargs["draft"] = path
    return drafters if path else ["ngram"]


def require_draft(model_kwargs: dict, say: Callable) -> None:
    """calibrate given a target alone: the chosen draft, or the usage error naming what was searched."""
    if not model_kwargs.get("target") or model_kwargs.get("pair") or model_kwargs.get("draft") not in (None, NONE):
        return
    if model_kwargs.get("draft") == NONE:
        raise click.UsageError("calibrate compares against speculative decoding: it needs a draft (drop --draft none)")
    from fsd_local.pairs.names import choose_draft, resolve

    target = resolve(model_kwargs["target"], "target")
    choice = choose_draft(target)
    if choice.draft is None:
        raise click.UsageError(
            f"give --draft too: calibrate compares against speculative decoding, and "
            f"{choice.missing_note(model_kwargs['target'])}"
        )
    say(choice.chosen_note(model_kwargs["target"]))
    model_kwargs["draft"] = choice.draft.path
