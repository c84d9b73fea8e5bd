"""The options and body of `fsd-local calibrate`: the tau (or quality budget) that meets a quality or speed goal on
the user's prompts (registered in cli/main.py; the search itself is bench/calibrate.py)."""

from __future__ import annotations

import click

from fsd_local.cli.bench import engine, given, say
from fsd_local.cli.bench_options import CommaList, run_options
from fsd_local.kernels.names import DIVERGENCES, TAU_MODES


def calibrate_options(f):
    opts = [
        click.option("--divergence", type=click.Choice(DIVERGENCES), default="js", show_default=True),
        click.option("--mode", type=click.Choice(TAU_MODES), default="fsd", show_default=True),
        click.option(
            "--modes",
            type=CommaList(str, "mode", TAU_MODES),
            help="search several modes, comma separated (e.g. fsd,typical,cascade,relaxed) and answer the "
            "fastest (mode, tau) within the budget; replaces --mode",
        ),
        click.option(
            "--draft-max", type=click.IntRange(1, 64), default=4, show_default=True, help="tokens drafted per round (k)"
        ),
        click.option("--temp", "temperature", type=click.FloatRange(0), default=0.0, show_default=True),
        click.option(
            "--min-agreement",
            type=click.FloatRange(0, 1),
            help="budget: agreement with the target's greedy output at least this (temperature 0)",
        ),
        click.option(
            "--max-logprob-drop",
            type=click.FloatRange(0),
            help="budget: target log-prob per token at most this much below sd's",
        ),
        click.option(
            "--target-acceptance",
            type=click.FloatRange(0, 1),
            help="goal: the smallest tau whose acceptance rate reaches this",
        ),
        click.option(
            "--target-speed",
            type=click.FloatRange(1),
            help="goal: the smallest quality budget B whose runs reach this many tokens per target call",
        ),
        click.option(
            "--tau-max",
            type=click.FloatRange(0, min_open=True),
            help="upper end of the search [default: ln 2 for js, 1 for tv, 2 otherwise; twice that for "
            "fsd-entropy; 1 for cascade and relaxed, 1/(1 - eps) for typical]",
        ),
        click.option(
            "--steps",
            type=click.IntRange(1, 20),
            default=6,
            show_default=True,
            help="bisection steps: the answer is within tau-max / 2**steps",
        ),
        click.option(
            "--repeats",
            type=click.IntRange(1),
            default=3,
            show_default=True,
            help="timed passes at the chosen tau (interleaved with ar and sd)",
        ),
        click.option("--json", "as_json", is_flag=True, help="print one JSON object"),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return run_options(f)


def calibrate_command(
    *,
    prompts_file,
    limit,
    chat,
    max_tokens,
    seed,
    ignore_eos,
    divergence,
    mode,
    modes,
    draft_max,
    temperature,
    min_agreement,
    max_logprob_drop,
    target_acceptance,
    target_speed,
    tau_max,
    steps,
    repeats,
    as_json,
    **model_kwargs,
):
    import json

    from fsd_local.bench.calibrate import calibrate, format_report
    from fsd_local.bench.prompts import load_prompts

    budget = _budget(min_agreement, max_logprob_drop, target_acceptance, target_speed, temperature)
    prompts = load_prompts(prompts_file)[:limit]
    if modes and given("mode"):
        raise click.UsageError("give --mode or --modes, not both")
    searched = modes or [mode]
    with engine(model_kwargs) as eng:
        say(
            f"calibrating {','.join(searched)} ({divergence} where a divergence applies) k={draft_max} at "
            f"temperature {temperature:g} on "
            f"{len(prompts)} prompts, {max_tokens} tokens each: {budget.describe()}"
        )
        result = calibrate(
            eng,
            prompts,
            budget=budget,
            divergence=divergence,
            modes=searched,
            draft_max=draft_max,
            temperature=temperature,
            tau_max=tau_max,
            steps=steps,
            max_tokens=max_tokens,
            repeats=repeats,
            seed=seed,
            chat=chat,
            ignore_eos=ignore_eos,
            on_step=_step_reporter(budget),
        )
    click.echo(json.dumps(result, indent=1) if as_json else format_report(result, budget))


def _budget(min_agreement, max_logprob_drop, target_acceptance, target_speed, temperature):
    """The one budget or goal given (bench/calibrate.py Budget), checked before any model is loaded."""
    from fsd_local.bench.calibrate import Budget

    named = (
        ("agreement", min_agreement),
        ("logprob_drop", max_logprob_drop),
        ("acceptance", target_acceptance),
        ("speed", target_speed),
    )
    given_ = [(k, v) for k, v in named if v is not None]
    if len(given_) != 1:
        raise click.UsageError(
            "give exactly one of --min-agreement, --max-logprob-drop, --target-acceptance, --target-speed"
        )
    budget = Budget(*given_[0])
    if budget.kind == "agreement" and temperature > 0:
        raise click.UsageError("--min-agreement needs --temp 0 (agreement is with the target's greedy output)")
    return budget


def _step_reporter(budget):
    """What the search says on standard error at every tau (or budget) it measures."""

    def step(tau, row):
        agree = "" if row["agreement"] is None else f"agreement {row['agreement']:.3f}, "
        say(
            f"{row['mode']} {'B' if budget.kind == 'speed' else 'tau'} {tau:.4f}: {agree}"
            f"{row['tokens_per_target_call']:.2f} tokens/call, log-prob drop {row['logprob_drop']:+.3f}, acceptance "
            f"{row['acceptance_rate']:.0%} -> {'meets' if row['meets'] else 'misses'} the budget"
        )

    return step
