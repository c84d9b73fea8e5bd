"""The `fsd-local` command: thin click wrappers over the library API (fsd_local.Engine)."""
from __future__ import annotations

import json
import sys

import click

from .accept import MODES
from .divergence import DIVERGENCES
from .errors import FSDError
from .model import KV_TYPES, SPLIT_MODES

TAU_HELP = ("divergence threshold for fuzzy acceptance. 0 = standard speculative decoding (output exactly the "
            "target's); larger = more draft tokens accepted, faster, further from the target. "
            "With js, tau above ~0.35 can accept tokens the target would essentially never emit")
MODE_HELP = ("fsd: SD test first, fuzzy rescue when divergence <= tau (default). fsd-paper: the paper's rule "
             "(divergence only). sd: lossless speculative decoding. ar: target alone. draft-only: draft alone")
DIV_HELP = ("js (Jensen-Shannon, <= ln2), kl KL(target||draft), rkl KL(draft||target), tv total variation, "
            "topk-js/topk-kl/topk-tv over the target's top-k tokens + one rest bin, paper-js (the reference "
            "code's JS formula, to reproduce the paper's taus)")
EXAMPLES = """
\b
Examples:
  fsd-local generate "The capital of France is" --tau 0.3
  fsd-local generate --target big.gguf --draft small.gguf --mode sd --json < prompt.txt
"""


class FriendlyGroup(click.Group):
    """Every FSDError becomes one line on stderr and exit code 1; --debug shows the traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except FSDError as exc:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            sys.exit(130)


@click.group(cls=FriendlyGroup, help="Fuzzy Speculative Decoding for local GGUF models.\n\n" + TAU_HELP)
@click.version_option(package_name="fsd-local")
@click.option("--debug", is_flag=True, help="show Python tracebacks on errors")
@click.pass_context
def cli(ctx, debug):
    ctx.obj = {"debug": debug}


def model_options(f):
    """--target/--draft/--pair and how to load them; no model arguments = the offline demo pair."""
    opts = [
        click.option("--target", type=click.Path(dir_okay=False), help="target (large) GGUF file"),
        click.option("--draft", type=click.Path(dir_okay=False), help="draft (small) GGUF file, same tokenizer"),
        click.option("--pair", help="a pair from models.toml (see `fsd-local models`)"),
        click.option("--ctx", "n_ctx", type=click.IntRange(16), default=4096, show_default=True,
                     help="context size of the target (and of the draft unless --draft-ctx)"),
        click.option("--draft-ctx", "draft_n_ctx", type=click.IntRange(16), help="context size of the draft"),
        click.option("--threads", "n_threads", type=click.IntRange(1), help="CPU threads (default: all)"),
        click.option("--ngl", "n_gpu_layers", type=GPU_LAYERS, default="auto", show_default=True,
                     help="target layers on the GPU: N, -1 = all, auto = what free GPU memory holds after the draft"),
        click.option("--draft-ngl", "draft_n_gpu_layers", type=GPU_LAYERS, default="auto", show_default=True,
                     help="draft layers on the GPU: N, -1 = all, auto = all if they fit (placed before the target)"),
        click.option("--flash-attn", type=click.Choice(["on", "off", "auto"]), default="auto", show_default=True,
                     help="flash attention for both models (a quantised V cache needs it)"),
        click.option("--cache-type-k", type=click.Choice(KV_CHOICES), default="f16", show_default=True,
                     help="target KV cache type for keys (q8_0 halves the cache, q4_0 quarters it)"),
        click.option("--cache-type-v", type=click.Choice(KV_CHOICES), default="f16", show_default=True,
                     help="target KV cache type for values (quantised needs flash attention)"),
        click.option("--draft-cache-type-k", type=click.Choice(KV_CHOICES), help="draft K cache type (default: the target's)"),
        click.option("--draft-cache-type-v", type=click.Choice(KV_CHOICES), help="draft V cache type (default: the target's)"),
        click.option("--no-mmap", is_flag=True, help="read the model files into memory instead of mapping them"),
        click.option("--mlock", is_flag=True, help="lock the models in RAM (no swapping)"),
        click.option("--split-mode", type=click.Choice(list(SPLIT_MODES)), default="layer", show_default=True,
                     help="how the target spreads over several GPUs (none = all on --main-gpu); the draft always "
                          "stays on one GPU"),
        click.option("--main-gpu", type=click.IntRange(0), default=0, show_default=True,
                     help="GPU for the draft, and for the target with --split-mode none"),
        click.option("--tensor-split", callback=_parse_split, metavar="P0,P1,...",
                     help="share of the target per GPU, e.g. 3,1 (default: by free memory)"),
        click.option("--rpc", "rpc_servers", metavar="HOST:PORT,...",
                     help="ggml-rpc-server machines that hold part of the target (needs an RPC build)"),
        click.option("--repack/--no-repack", "repack", default=None,
                     help="target: load weights into llama.cpp's repacked CPU layouts (AMX, AVX2/AVX-512 "
                          "interleaving). Default: on, except where the CPU backend has AMX kernels and the CPU "
                          "has AMX (they crash there; see `fsd-local doctor`)"),
        click.option("--draft-repack/--draft-no-repack", "draft_repack", default=None,
                     help="the same for the draft (default: as for the target)"),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


class GpuLayers(click.ParamType):
    """N >= 0 layers, -1 = all, or 'auto' (fsd_local.placement decides from free GPU memory)."""
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
KV_CHOICES = list(KV_TYPES)


def _parse_split(ctx, param, value):
    if value is None:
        return None
    try:
        return [float(x) for x in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"{value!r}: give proportions like 3,1") from None


def generation_options(f):
    opts = [
        click.option("--tau", type=float, default=0.0, show_default=True, help=TAU_HELP),
        click.option("--mode", type=click.Choice(MODES), default="fsd", show_default=True, help=MODE_HELP),
        click.option("--divergence", type=click.Choice(DIVERGENCES), default="js", show_default=True,
                     help=DIV_HELP),
        click.option("--draft-max", type=click.IntRange(1, 64), default=4, show_default=True,
                     help="tokens drafted per round (k)"),
        click.option("--draft-min", type=click.IntRange(1, 64), default=1, show_default=True,
                     help="smallest k with --adaptive"),
        click.option("--draft-p-min", type=click.FloatRange(0, 1, max_open=True), default=0.0, show_default=True,
                     help="stop drafting when the draft's top probability falls below this"),
        click.option("--adaptive", is_flag=True, help="grow k by 2 after a fully accepted round, shrink by 1 after a rejection"),
        click.option("--temp", "temperature", type=float, default=0.0, show_default=True, help="0 = greedy"),
        click.option("--top-k", type=click.IntRange(0), default=0, show_default=True, help="0 = off"),
        click.option("--top-p", type=float, default=1.0, show_default=True, help="1 = off"),
        click.option("--min-p", type=float, default=0.0, show_default=True, help="0 = off"),
        click.option("--seed", type=click.IntRange(0), help="makes sampled runs reproducible"),
        click.option("--max-tokens", type=click.IntRange(0), default=256, show_default=True),
        click.option("--ignore-eos", is_flag=True, help="keep going past end-of-generation tokens (benchmarks)"),
        click.option("--stop", multiple=True, help="stop string (repeatable)"),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


SETTING_KEYS = ("tau", "mode", "divergence", "draft_max", "draft_min", "draft_p_min", "adaptive", "ignore_eos", "temperature",
                "top_k", "top_p", "min_p", "seed", "max_tokens", "stop")


def split_settings(kwargs: dict) -> dict:
    """Pop the generation settings out of a command's keyword arguments."""
    return {k: kwargs.pop(k) for k in SETTING_KEYS if k in kwargs}


def resolve_models(target, draft, pair, say=None) -> tuple[str, str | None]:
    """Model files from --target/--draft, --pair, or (no model arguments) the offline demo pair."""
    if pair:
        if target or draft:
            raise click.UsageError("give either --pair or --target/--draft, not both")
        from .registry import local_pair_paths  # the model registry (models.toml)

        return local_pair_paths(pair)
    if target is None and draft is None:
        from .demo import DEMO_NOTE, demo_pair

        d, t = demo_pair(progress=say)
        if say:
            say(DEMO_NOTE)
        return str(t), str(d)
    if target is None:
        raise click.UsageError("--draft given without --target")
    return target, draft


def load_engine(target, draft, pair, n_ctx, n_threads, n_gpu_layers, draft_n_gpu_layers, settings, say=None, *,
                draft_n_ctx=None, flash_attn="auto", cache_type_k="f16", cache_type_v="f16", draft_cache_type_k=None,
                draft_cache_type_v=None, no_mmap=False, mlock=False, split_mode="layer", main_gpu=0,
                tensor_split=None, rpc_servers=None, repack=None, draft_repack=None, engine_class=None):
    """The Engine (or `engine_class`, e.g. serve's Supervisor: same arguments) for the command's options."""
    from .config import Settings
    from .engine import Engine
    from .model import ModelOptions
    from .placement import resolve

    s = Settings(**{k: (tuple(v) if k == "stop" else v) for k, v in settings.items()})  # validates first
    t, d = resolve_models(target, draft, pair, say=say)
    if d is None and s.mode not in ("ar",):
        raise click.UsageError(f"mode {s.mode} needs --draft (or use --mode ar)")
    both = dict(n_threads=n_threads, flash_attn={"on": True, "off": False, "auto": None}[flash_attn],
                use_mmap=not no_mmap, use_mlock=mlock, main_gpu=main_gpu)
    target_auto, draft_auto = n_gpu_layers == "auto", draft_n_gpu_layers in (None, "auto")
    t_opts = ModelOptions(t, n_ctx=n_ctx, n_gpu_layers=-1 if target_auto else n_gpu_layers, split_mode=split_mode,
                          tensor_split=tensor_split, cache_type_k=cache_type_k, cache_type_v=cache_type_v,
                          rpc_servers=rpc_servers, repack=repack, **both)
    # the draft decodes one token at a time: spreading it over GPUs would only add transfers
    d_opts = d and ModelOptions(d, n_ctx=draft_n_ctx or n_ctx, n_gpu_layers=-1 if draft_auto else draft_n_gpu_layers,
                                split_mode="none", cache_type_k=draft_cache_type_k or cache_type_k,
                                cache_type_v=draft_cache_type_v or cache_type_v,
                                repack=repack if draft_repack is None else draft_repack, **both)
    t_opts, d_opts, placed = resolve(t_opts, d_opts, target_auto=target_auto, draft_auto=draft_auto)
    if placed and say:
        say(placed)
    from .jit_cache import is_warm

    if say and not is_warm():
        say("compiling fsd-local's kernels with Numba (first run only, about 20 s on 2 cores)...")
    return (engine_class or Engine)(target=t_opts, draft=d_opts, settings=s)


def _say(msg):
    click.echo(msg, err=True)


@cli.command(epilog=EXAMPLES)
@click.argument("prompt", required=False)
@model_options
@generation_options
@click.option("--json", "as_json", is_flag=True, help="print one JSON object: text, token_ids, finish_reason, stats")
def generate(prompt, as_json, **kwargs):
    """Complete PROMPT (read from standard input when omitted) with a draft/target pair. Raw completion: no
    chat template is applied (see `fsd-local chat`)."""
    settings = split_settings(kwargs)
    if prompt is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise click.UsageError("give a PROMPT argument or pipe the prompt on standard input")
        prompt = sys.stdin.read()
    with load_engine(**kwargs, settings=settings, say=_say) as engine:
        if as_json:
            result = engine.generate(prompt)
            click.echo(json.dumps(result.to_dict()))
            return
        completion = None
        for piece in engine.stream(prompt):
            if piece.text:
                click.echo(piece.text, nl=False)
            completion = piece.completion or completion
        click.echo()
        st = completion.stats
        _say(f"[{completion.finish_reason}] {st['tokens']} tokens, {st['tokens_per_second']:.1f} tok/s, "
             f"acceptance {st['acceptance_rate']:.0%}, {st['mean_tokens_per_round']:.2f} tokens/round, "
             f"fuzzy {st['fuzzy_share']:.0%}")


@cli.command()
@click.option("--target", type=click.Path(dir_okay=False), help="a target GGUF file to describe")
@click.option("--draft", type=click.Path(dir_okay=False), help="a draft GGUF file; with --target: are they compatible?")
@click.option("--pair", help="a pair from models.toml instead of --target/--draft")
@click.option("--ctx", "n_ctx", type=click.IntRange(16), default=4096, show_default=True,
              help="context size the automatic GPU placement is computed for")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def doctor(target, draft, pair, n_ctx, as_json):
    """What this installation runs on: llama-cpp-python and llama.cpp versions, compiled-in backends (CPU, CUDA,
    Metal, Vulkan...), devices and free memory, GPU offload, RPC, threads. With model files: architecture, size,
    quantisation, layers, vocabulary, chat template, whether the draft can draft for the target, and the
    automatic GPU placement. Exit code 1 when the draft and target are incompatible."""
    from .doctor import render, report

    if pair:
        target, draft = resolve_models(target, draft, pair)
    elif draft and not target:
        raise click.UsageError("--draft given without --target")
    r = report(target=target, draft=draft, n_ctx=n_ctx)
    click.echo(json.dumps(r, indent=2) if as_json else render(r))
    if r.get("compatible") is False:
        sys.exit(1)


@cli.command()
@model_options
@generation_options
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on (loopback = this machine only)")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option("--api-key", envvar="FSD_LOCAL_API_KEY", help="require 'Authorization: Bearer KEY' (env FSD_LOCAL_API_KEY)")
@click.option("--max-queue", type=click.IntRange(0), default=16, show_default=True,
              help="requests that may wait behind the running one; more get 503")
@click.option("--model-name", help="model id reported by /v1/models (default: the pair's name or the target's file name)")
@click.option("--in-process", is_flag=True,
              help="run the models inside the server process (no restart after a crash in llama.cpp; for debugging)")
def serve(host, port, api_key, max_queue, model_name, in_process, **kwargs):
    """An OpenAI-compatible HTTP server (POST /v1/chat/completions, /v1/completions; GET /v1/models, /health,
    /metrics). The generation options are the defaults; requests override them, including fsd-local's own
    (tau, mode, divergence, draft_max...) as extra body fields. One pair answers whatever `model` a request names.
    The models run in a child process that is restarted if it crashes (the request it was running fails)."""
    try:
        from .server import serve as run_server
        from .supervisor import Supervisor
    except ImportError as exc:  # the server's packages are an optional extra
        raise click.UsageError(f"the server needs FastAPI, uvicorn and prometheus_client: "
                               f"pip install 'fsd-local[server]' ({exc})") from None

    settings = split_settings(kwargs)
    with load_engine(**kwargs, settings=settings, say=_say, engine_class=None if in_process else Supervisor) as engine:
        _say(f"serving the OpenAI API on http://{host}:{port}/v1")
        run_server(engine, host=host, port=port, api_key=api_key, max_queue=max_queue,
                   model_name=model_name or kwargs["pair"])


CHAT_EXAMPLES = """
\b
Examples:
  fsd-local chat --tau 0.3                       (the offline demo pair)
  fsd-local chat --pair qwen2.5-0.5b-7b --tau 0.1 --color
  fsd-local chat --target big.gguf --draft small.gguf --mode sd --temp 0.7
  printf 'Hi\\n/tau 0.2\\nAnd now?\\n' | fsd-local chat --json
"""
PAIR_EPILOG = f"""
A pair is a small draft model and a large target model with the same tokenizer; fsd-local runs them with
Fuzzy Speculative Decoding. tau: {TAU_HELP}. Modes: {MODE_HELP}. Divergences: {DIV_HELP}. The suggested tau per
divergence is a starting point; calibrate it with `fsd-local bench`.

\b
Examples:
  fsd-local models
  fsd-local pull qwen2.5-0.5b-7b
  fsd-local chat --pair qwen2.5-0.5b-7b --tau 0.1 --divergence js
"""


@cli.command(epilog=CHAT_EXAMPLES)
@model_options
@generation_options
@click.option("--system", help="system prompt for the conversation")
@click.option("--color", is_flag=True, help="colour each token by origin: green = draft token that passed the SD "
              "test, yellow = draft token rescued by tau (fuzzy), plain = the target's own token")
@click.option("--json", "as_json", is_flag=True,
              help="print one JSON object per reply (text, finish_reason, stats) instead of streaming text")
def chat(system, color, as_json, **kwargs):
    """Chat with a draft/target pair, using the target's own chat template. Replies stream as tokens are
    accepted; earlier turns stay in both KV caches and are not evaluated again. After each reply a summary
    line shows tokens/s, acceptance rate, tokens per round and the share rescued by tau (fuzzy). Slash
    commands change settings live: /tau 0.2, /mode sd, /divergence kl, /temp 0.7, /stats, /reset, /help,
    /quit. Ctrl-C stops a reply, Ctrl-D leaves. When standard input is not a terminal, each line is one
    message and replies are plain text."""
    from .chat import ChatSession, run_chat

    settings = split_settings(kwargs)
    with load_engine(**kwargs, settings=settings, say=_say) as engine:
        run_chat(ChatSession(engine, engine.defaults, system=system), color=color, as_json=as_json)


@cli.command(epilog=PAIR_EPILOG)
@click.option("--json", "as_json", is_flag=True, help="print the pairs as one JSON object")
def models(as_json):
    """List the curated draft/target pairs of models.toml and which of their files are already in the local
    Hugging Face cache (FSD_LOCAL_MODELS=FILE reads your own models.toml instead)."""
    import dataclasses

    from .registry import format_pairs, load_registry

    registry = load_registry()
    if as_json:
        click.echo(json.dumps({name: {**dataclasses.asdict(p), "present": {
            role: f.cached_path() for role, f in p.files()}} for name, p in registry.items()}, indent=2))
    else:
        click.echo(format_pairs(registry))


@cli.command(epilog=PAIR_EPILOG)
@click.argument("pair")
def pull(pair):
    """Download PAIR's draft and target into the Hugging Face cache (progress bars, HF_HUB_OFFLINE, HF_ENDPOINT
    and HF_HUB_CACHE as usual; files already there are reused) and check each file's SHA-256."""
    from .registry import pull as pull_pair

    target, draft = pull_pair(pair, say=_say)
    click.echo(f"target {target}\ndraft  {draft}")
    _say(f"ready: fsd-local chat --pair {pair} --tau 0.1")


from . import bench_cli  # noqa: E402  (bench / calibrate: options and bodies live there)

BENCH_EXAMPLES = """
\b
Examples:
  fsd-local bench --taus 0,0.1,0.2 --divergence js,kl --draft-max 2,4 --temp 0,0.7 --plot bench.png
  fsd-local bench --pair qwen2.5-0.5b-7b --prompts my.jsonl --max-tokens 128 --json > bench.json
  fsd-local bench --kernels
"""


@cli.command(epilog=BENCH_EXAMPLES)
@model_options
@bench_cli.bench_options
def bench(**kwargs):
    """Measure the speed / quality trade-off of a pair: every combination of modes, divergences, taus, draft
    lengths and temperatures on the same prompts and seeds, interleaved, with the ar and sd baselines. Reports
    tokens/s, speed-ups, acceptance, target log-prob, agreement with the target's greedy output and task accuracy
    (JSON Lines prompts with answers). --kernels times the divergence kernels against NumPy instead."""
    bench_cli.bench_command(**kwargs)


@cli.command()
@model_options
@bench_cli.calibrate_options
def calibrate(**kwargs):
    """Find tau for a budget on your prompts: the largest tau whose agreement with the target's greedy output
    (--min-agreement) or target log-prob drop per token vs sd (--max-logprob-drop) stays within budget, or the
    smallest tau reaching an acceptance rate (--target-acceptance). Bisection over [0, --tau-max], assuming
    quality falls and acceptance rises with tau; prints every tau tried and the speed at the answer."""
    bench_cli.calibrate_command(**kwargs)


def main():  # console-script entry point
    cli()


if __name__ == "__main__":
    main()
