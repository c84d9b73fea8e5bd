"""What the commands share: the model options, the generation options (generated from fsd_local.settings),
loading a pair, and the one-line summary after a reply. Nothing here imports Numba or llama.cpp at module level."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING
from typing import Any

import click

from fsd_local.llama.options import KV_TYPES, SPLIT_MODES
from fsd_local.pairs.demo import PRECISIONS
from fsd_local.settings import FIELDS, Settings, field_type, spec

KV_CHOICES = list(KV_TYPES)


def say(msg: str) -> None:
    """Progress and summaries go to standard error: standard output carries only the model's text (or JSON)."""
    click.echo(msg, err=True)


def summary_line(stats: dict, finish: str | None, detail: str | None = None) -> str:
    """The line after every reply (generate, chat): speed (and against the target's measured one-token decode
    rate: what plain decoding would do here), acceptance, the loss a lossy rule spent, and what the prefix cache
    saved."""
    vs_plain = stats.get("speedup_vs_plain_est")
    plain = f"{vs_plain:.2f}x plain decoding, " if vs_plain else ""
    b, loss = stats.get("quality_budget"), stats.get("loss_per_token")
    if b is not None:
        budget = f"budget spent {loss:.3f} of {b:g} nats/token, "
    else:  # a lossy rule's loss (docs/generation.md): what the speed cost in fidelity to the target
        budget = f"loss {loss:.3f} nats/token, " if loss else ""
    why = ", the context is full" if detail == "context_full" else ""
    return (
        f"[{finish}{why}] {stats['tokens']} tokens, {stats['tokens_per_second']:.1f} tok/s, "
        f"acceptance {stats['acceptance_rate']:.0%}, {stats['mean_tokens_per_round']:.2f} tokens/round, "
        f"fuzzy {stats['fuzzy_share']:.0%}, {budget}{plain}prompt {stats['prompt_evaluated']}/{stats['prompt_tokens']} "
        "tokens evaluated"
    )


def _apply(f: Callable, opts: list) -> Callable:
    for opt in reversed(opts):
        f = opt(f)
    return f


# ------------------------------------------------------------------ generation settings
def _int_bound(x: float | None) -> int | None:
    """An integer field's bound for click.IntRange (Spec declares bounds as numbers)."""
    return None if x is None else int(x)


def _read_text(ctx, param, value: str | None) -> str | None:
    """A setting given as a file (--grammar-file, --json-schema): the file's text, or a usage error naming it."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as fh:
            return fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise click.BadParameter(f"cannot read {value!r}: {why}") from None


def _setting_option(f, chat: bool = False, unset: bool = False) -> Callable:
    """The click option of one Settings field (with `fsd-local chat`'s default if `chat`; with `unset`, no default).
    Settings validates the value; integers also get click's range, so --help shows it."""
    s, kind = spec(f), field_type(f)
    cli = s.cli
    assert cli is not None, f"setting {f.name} has no command-line flag"
    default = None if f.name == "seed" else (f.default if f.default is not MISSING else None)
    if chat and s.chat_default is not None:
        default = s.chat_default
    if unset:
        default = None
    if kind is bool:  # a setting on by default is turned off with --no-...
        flag = f"{cli}/--no-{cli[2:]}" if f.default else cli
        return click.option(flag, f.name, is_flag=True, default=default, help=s.help)
    if kind is tuple:
        return click.option(cli, f.name, multiple=True, metavar=s.metavar, help=s.help)
    if s.cli_file:
        path = click.Path(dir_okay=False)
        return click.option(cli, f.name, type=path, callback=_read_text, metavar=s.metavar, help=s.help)
    if s.choices:
        return click.option(cli, f.name, type=click.Choice(s.choices), default=default, show_default=True, help=s.help)
    if kind is int:
        typ: Any = click.IntRange(_int_bound(s.lo), _int_bound(s.hi), min_open=s.lo_open, max_open=s.hi_open)
    else:
        typ = float
    return click.option(cli, f.name, type=typ, default=default, show_default=default is not None, help=s.help)


SETTING_OPTIONS = [_setting_option(f) for f in FIELDS if spec(f).cli]
CHAT_SETTING_OPTIONS = [_setting_option(f, chat=True) for f in FIELDS if spec(f).cli]
SETTING_NAMES = tuple(f.name for f in FIELDS if spec(f).cli)


# the sampling chain's settings a benchmark may fix for every configuration it runs (bench --chat-sampling sets
# chat's values of them at once)
BENCH_SAMPLING = ("top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty")
BENCH_SAMPLING_OPTIONS = [_setting_option(f, unset=True) for f in FIELDS if f.name in BENCH_SAMPLING]


def bench_sampling_options(f: Callable) -> Callable:
    return _apply(f, BENCH_SAMPLING_OPTIONS)


def settings_options(f: Callable) -> Callable:
    return _apply(f, SETTING_OPTIONS)


def chat_settings_options(f: Callable) -> Callable:
    """The generation options with chat's defaults (settings.CHAT_DEFAULTS)."""
    return _apply(f, CHAT_SETTING_OPTIONS)


def pop_settings(kwargs: dict) -> Settings:
    """Take the generation settings out of a command's keyword arguments, as one validated Settings."""
    return Settings(**{k: kwargs.pop(k) for k in SETTING_NAMES if k in kwargs})


# ------------------------------------------------------------------ models
class GpuLayers(click.ParamType):
    """N >= 0 layers, -1 = all, or 'auto' (fsd_local.llama.placement decides from free GPU memory)."""

    name = "N|-1|auto"

    def convert(self, value, param, ctx):
        if value == "auto" or isinstance(value, int):
            return value
        try:
            n = int(value)
        except ValueError:
            self.fail(f"{value!r} is not a layer count, -1 or auto", param, ctx)
        if n < -1:
            self.fail(f"{n} layers: use -1 for all, 0 for none", param, ctx)
        return n


GPU_LAYERS = GpuLayers()


def _parse_split(ctx, param, value):
    if value is None:
        return None
    try:
        return [float(x) for x in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"{value!r}: give proportions like 3,1") from None


MODEL_OPTIONS = [
    click.option(
        "--target",
        metavar="NAME|PATH",
        help="target (large) model: a GGUF file, or a name from `fsd-local models --local` (qwen2.5:7b from Ollama, "
        "org/name/file.gguf from the Hugging Face cache or LM Studio)",
    ),
    click.option(
        "--draft",
        metavar="NAME|PATH|none",
        help="draft (small) model, any GGUF (another tokenizer drafts through the vocabulary map or as text), a "
        "file or a name; default with --target: the best ranked local draft (`models --local`; else prompt "
        "lookup); none = the target alone",
    ),
    click.option("--pair", help="a pair from models.toml (see `fsd-local models`)"),
    click.option(
        "--demo",
        "demo_precision",
        type=click.Choice(PRECISIONS),
        default="q4_1",
        show_default=True,
        help="without model arguments, the offline demo pair: q4_1 (small, compute-bound on a CPU), f16 (F16 copies: "
        "memory-bound like a large model on a laptop, where speculation pays), q4_0 (what --repack changes), wide "
        "(SmolLM2's function at a ~1.4B model's cost: the trade-off a real pair shows, 1.44 GB written once)",
    ),
    click.option(
        "--ctx",
        "n_ctx",
        type=click.IntRange(16),
        default=4096,
        show_default=True,
        help="context size of the target (and of the draft unless --draft-ctx)",
    ),
    click.option("--draft-ctx", "draft_n_ctx", type=click.IntRange(16), help="context size of the draft"),
    click.option("--threads", "n_threads", type=click.IntRange(1), help="CPU threads (default: all)"),
    click.option(
        "--ngl",
        "n_gpu_layers",
        type=GPU_LAYERS,
        default="auto",
        show_default=True,
        help="target layers on the GPU: N, -1 = all, auto = what free GPU memory holds after the draft",
    ),
    click.option(
        "--draft-ngl",
        "draft_n_gpu_layers",
        type=GPU_LAYERS,
        default="auto",
        show_default=True,
        help="draft layers on the GPU: N, -1 = all, auto = all if they fit (placed before the target)",
    ),
    click.option(
        "--flash-attn",
        type=click.Choice(["on", "off", "auto"]),
        default="auto",
        show_default=True,
        help="flash attention for both models (a quantised V cache needs it)",
    ),
    click.option(
        "--cache-type-k",
        type=click.Choice(KV_CHOICES),
        default="f16",
        show_default=True,
        help="target KV cache type for keys (q8_0 halves the cache, q4_0 quarters it)",
    ),
    click.option(
        "--cache-type-v",
        type=click.Choice(KV_CHOICES),
        default="f16",
        show_default=True,
        help="target KV cache type for values (quantised needs flash attention)",
    ),
    click.option(
        "--draft-cache-type-k", type=click.Choice(KV_CHOICES), help="draft K cache type (default: the target's)"
    ),
    click.option(
        "--draft-cache-type-v", type=click.Choice(KV_CHOICES), help="draft V cache type (default: the target's)"
    ),
    click.option("--no-mmap", is_flag=True, help="read the model files into memory instead of mapping them"),
    click.option("--mlock", is_flag=True, help="lock the models in RAM (no swapping)"),
    click.option(
        "--split-mode",
        type=click.Choice(list(SPLIT_MODES)),
        default="layer",
        show_default=True,
        help="how the target spreads over several GPUs (none = all on --main-gpu); the draft always stays on one GPU",
    ),
    click.option(
        "--main-gpu",
        type=click.IntRange(0),
        default=0,
        show_default=True,
        help="GPU for the draft, and for the target with --split-mode none",
    ),
    click.option(
        "--tensor-split",
        callback=_parse_split,
        metavar="P0,P1,...",
        help="share of the target per GPU, e.g. 3,1 (default: by free memory)",
    ),
    click.option(
        "--rpc",
        "rpc_servers",
        metavar="HOST:PORT,...",
        help="ggml-rpc-server machines that hold part of the target (needs an RPC build)",
    ),
    click.option(
        "--repack/--no-repack",
        "repack",
        default=None,
        help="target: load weights into llama.cpp's repacked CPU layouts (AMX, AVX2/AVX-512 "
        "interleaving). Default: on, except where the CPU backend has AMX kernels and the CPU "
        "has AMX (they crash there; see `fsd-local doctor`)",
    ),
    click.option(
        "--draft-repack/--draft-no-repack",
        "draft_repack",
        default=None,
        help="the same for the draft (default: as for the target)",
    ),
]
MODEL_KEYS = ("target", "draft", "pair")


def model_options(f: Callable) -> Callable:
    """--target/--draft/--pair and how to load them; no model arguments = the offline demo pair."""
    return _apply(f, MODEL_OPTIONS)


def resolve_models(target, draft, pair, say=None, demo_precision: str = "q4_1") -> tuple[str, str | None]:
    """Model files from --target/--draft (paths, or names of models in the local stores: pairs/names.py; the
    draft None for --draft none), --pair, or (no model arguments) the offline demo pair."""
    if pair:
        if target or draft:
            raise click.UsageError("give either --pair or --target/--draft, not both")
        from fsd_local.pairs.registry import local_pair_paths  # the model registry (models.toml)

        return local_pair_paths(pair)
    if target is None and draft is None:
        from fsd_local.pairs.demo import DEMO_NOTE, demo_pair

        d, t = demo_pair(progress=say, precision=demo_precision)
        if say:
            from fsd_local.pairs.wide import WIDE_NOTE

            say(WIDE_NOTE if demo_precision == "wide" else DEMO_NOTE)
        return str(t), str(d)
    if target is None:
        raise click.UsageError("--draft given without --target")
    from fsd_local.pairs.names import NONE, resolve

    return resolve(target, "target"), None if draft in (None, NONE) else resolve(draft, "draft")


def models_and_settings(target, draft, pair, settings: Settings, say, demo_precision: str):
    """(target path, draft path or None, settings): resolve_models, then for a target given alone the draft
    chosen by cli/drafts.py (which may switch the settings to prompt lookup, or to plain decoding)."""
    t, d = resolve_models(target, draft, pair, say=say, demo_precision=demo_precision)
    if d is None and target is not None and settings.needs_draft:
        from fsd_local.cli.drafts import auto_draft

        d, settings = auto_draft(t, target, draft, settings, say)
    if d is None and settings.needs_draft:
        raise click.UsageError(f"mode {settings.mode} needs --draft (or use --mode ar)")
    return t, d, settings


def load_engine(
    target,
    draft,
    pair,
    n_ctx,
    n_threads,
    n_gpu_layers,
    draft_n_gpu_layers,
    settings: Settings,
    say=None,
    *,
    draft_n_ctx=None,
    flash_attn="auto",
    cache_type_k="f16",
    cache_type_v="f16",
    draft_cache_type_k=None,
    draft_cache_type_v=None,
    no_mmap=False,
    mlock=False,
    split_mode="layer",
    main_gpu=0,
    tensor_split=None,
    rpc_servers=None,
    repack=None,
    draft_repack=None,
    engine_class=None,
    demo_precision="q4_1",
    parallel: int | None = 1,
):
    """The Engine (or `engine_class`: serve's Supervisor) for the command's options; parallel None: serve's default."""
    from fsd_local.engine import Engine
    from fsd_local.kernels.jit_cache import is_warm
    from fsd_local.llama.options import ModelOptions
    from fsd_local.llama.placement import resolve
    from fsd_local.round import rewind_options
    from fsd_local.server.worker import default_parallel

    t, d, settings = models_and_settings(target, draft, pair, settings, say, demo_precision)
    parallel = parallel or default_parallel(n_ctx)
    rs, draft_rs = rewind_options(settings)  # as the Engine asks: the placement counts their state copies
    both = dict(n_threads=n_threads, n_seq=parallel, use_mmap=not no_mmap, use_mlock=mlock, main_gpu=main_gpu)
    both["flash_attn"] = {"on": True, "off": False, "auto": None}[flash_attn]
    target_auto, draft_auto = n_gpu_layers == "auto", draft_n_gpu_layers in (None, "auto")
    t_opts = ModelOptions(
        t,
        n_ctx=n_ctx,
        n_gpu_layers=-1 if target_auto else n_gpu_layers,
        split_mode=split_mode,
        tensor_split=tensor_split,
        cache_type_k=cache_type_k,
        cache_type_v=cache_type_v,
        rpc_servers=rpc_servers,
        repack=repack,
        **rs,
        **both,
    )
    # the draft decodes one token at a time: spreading it over GPUs would only add transfers
    d_opts = (
        ModelOptions(
            d,
            n_ctx=draft_n_ctx or n_ctx,
            n_gpu_layers=-1 if draft_auto else draft_n_gpu_layers,
            split_mode="none",
            cache_type_k=draft_cache_type_k or cache_type_k,
            cache_type_v=draft_cache_type_v or cache_type_v,
            repack=repack if draft_repack is None else draft_repack,
            **draft_rs,
            **both,
        )
        if d is not None
        else None
    )
    t_opts, d_opts, placed = resolve(t_opts, d_opts, target_auto=target_auto, draft_auto=draft_auto)
    if placed and say:
        say(placed)
    if say and not is_warm():
        say("compiling fsd-local's kernels with Numba (first run only, about 20 s on 2 cores)...")
    eng = (engine_class or Engine)(target=t_opts, draft=d_opts, settings=settings, parallel=parallel)
    say_pairing(eng, say)
    return eng


def say_pairing(eng, say) -> None:
    """A pair of two tokenizers' path, and any warning about the pair (Engine.notes), one line each (say None:
    nothing)."""
    if say is None:
        return
    pairing = getattr(eng, "pairing", None)
    if pairing is not None and pairing.path != "same":
        say(f"draft and target have different tokenizers ({pairing.reason}): {pairing.describe()}")
    for note in getattr(eng, "notes", ()):
        say(f"warning: {note}")
