"""The `fsd-local` command: thin click wrappers over the library API (fsd_local.Engine)."""

from __future__ import annotations

import json
import sys

import click

from fsd_local.cli import bench_modes, bench_options
from fsd_local.cli import calibrate as calibrate_cli
from fsd_local.cli.options import (
    chat_settings_options,
    load_engine,
    model_options,
    pop_settings,
    resolve_models,
    say,
    settings_options,
    summary_line,
)
from fsd_local.errors import FSDError
from fsd_local.settings import DIVERGENCE_HELP, MODE_HELP, SERVER_MAX_QUEUE, TAU_HELP

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


@cli.command(epilog=EXAMPLES)
@click.argument("prompt", required=False)
@model_options
@settings_options
@click.option("--json", "as_json", is_flag=True, help="print one JSON object: text, token_ids, finish_reason, stats")
def generate(prompt, as_json, **kwargs):
    """Complete PROMPT (read from standard input when omitted) with a draft/target pair. Raw completion: no
    chat template is applied (see `fsd-local chat`)."""
    settings = pop_settings(kwargs)
    if prompt is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise click.UsageError("give a PROMPT argument or pipe the prompt on standard input")
        prompt = sys.stdin.read()
    with load_engine(**kwargs, settings=settings, say=say) as engine:
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
        say(summary_line(completion.stats, completion.finish_reason, completion.finish_detail))


@cli.command()
@click.option("--target", metavar="NAME|PATH", help="a target GGUF file (or local model name) to describe")
@click.option("--draft", metavar="NAME|PATH", help="a draft GGUF file or name; with --target: are they compatible?")
@click.option("--pair", help="a pair from models.toml instead of --target/--draft")
@click.option(
    "--ctx",
    "n_ctx",
    type=click.IntRange(16),
    default=4096,
    show_default=True,
    help="context size the automatic GPU placement is computed for",
)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option(
    "--clear-kernel-cache", is_flag=True, help="delete the compiled kernels of every version (they compile again)"
)
def doctor(target, draft, pair, n_ctx, as_json, clear_kernel_cache):
    """What this installation runs on (llama.cpp, backends, devices, memory, the kernel cache) and, given model
    files, what they are and whether the draft can draft for the target. Exit code 1 when they are incompatible."""
    from fsd_local.kernels import jit_cache
    from fsd_local.llama.doctor import render, report
    from fsd_local.round import rewind_options
    from fsd_local.settings import Settings

    if clear_kernel_cache:
        freed = jit_cache.clear()
        click.echo(f"kernel cache cleared: {freed / 2**20:.1f} MiB freed under {jit_cache.cache_root()}")
        return
    if pair or target:  # a pair, or names from `fsd-local models --local`, to files
        target, draft = resolve_models(target, draft, pair)
    elif draft:
        raise click.UsageError("--draft given without --target")
    rewind = rewind_options(Settings())  # as a chat or a server with the default settings asks
    r = report(target=target, draft=draft, n_ctx=n_ctx, rewind=rewind) | {"kernel_cache": jit_cache.state()}
    click.echo(json.dumps(r, indent=2) if as_json else render(r))
    if r.get("compatible") is False:
        sys.exit(1)


@cli.command()
@model_options
@settings_options
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="address to listen on (loopback = this machine only)"
)
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@click.option(
    "--api-key", envvar="FSD_LOCAL_API_KEY", help="require 'Authorization: Bearer KEY' (env FSD_LOCAL_API_KEY)"
)
@click.option(
    "--max-queue",
    type=click.IntRange(0),
    default=SERVER_MAX_QUEUE,
    show_default=True,
    help="requests that may wait behind the running ones; more get 503 with Retry-After",
)
@click.option(
    "--parallel",
    type=click.IntRange(1, 64),
    help="requests generated at once, batched in each round (slots; they share --ctx) [default: 4, fewer where "
    "--ctx gives a slot under 1024 tokens]",
)
@click.option(
    "--model-name", help="model id reported by /v1/models (default: the pair's name or the target's file name)"
)
@click.option(
    "--in-process",
    is_flag=True,
    help="run the models inside the server process (no restart after a crash in llama.cpp; for debugging)",
)
@click.option(
    "--allow-origin",
    "allow_origins",
    multiple=True,
    metavar="ORIGIN",
    help="let web pages of this origin use the server from a browser (repeatable; * globs, e.g. "
    "http://localhost:*; env FSD_LOCAL_ORIGINS, comma-separated). The server's own page always may",
)
@click.option(
    "--allow-host",
    "allow_hosts",
    multiple=True,
    metavar="NAME",
    help="also answer requests that name the server NAME in their Host header (repeatable; * globs, * = any; env "
    "FSD_LOCAL_HOSTS). Loopback names and the --host address always work; others are refused against DNS rebinding",
)
def serve(host, port, api_key, max_queue, parallel, model_name, in_process, allow_origins, allow_hosts, **kwargs):
    """An OpenAI-compatible HTTP server, Ollama's API on the same port and a chat page at /. The options are
    defaults that requests override; one pair answers whatever `model` a request names; the models run in a child
    process restarted if it crashes. docs/server.md has the details."""
    run_server, Supervisor = _server_part("running").serve, _server_part("supervisor").Supervisor
    security = _server_part("security")
    origins = [*allow_origins, *security.env_list(security.ORIGINS_ENV)]
    hosts = [*allow_hosts, *security.env_list(security.HOSTS_ENV)]
    settings = pop_settings(kwargs)
    supervisor = None if in_process else Supervisor
    with load_engine(**kwargs, settings=settings, say=say, engine_class=supervisor, parallel=parallel) as engine:
        base = f"http://{host}:{port}"
        say(f"serving the OpenAI API on {base}/v1, Ollama's API on {base}/api and the chat page on {base}/")
        say(f"{engine.parallel} requests at once (--parallel), {max_queue} more may wait (--max-queue)")
        from fsd_local.pairs.names import given_name  # --target qwen2.5:7b is served as "qwen2.5:7b"

        run_server(
            engine,
            host=host,
            port=port,
            api_key=api_key,
            max_queue=max_queue,
            model_name=model_name or kwargs["pair"] or given_name(kwargs["target"]),
            allow_hosts=hosts,
            allow_origins=origins,
        )


def _server_part(name: str):
    """A module of fsd_local.server, imported when a command needs it (its packages are an optional extra)."""
    import importlib

    try:
        return importlib.import_module(f"fsd_local.server.{name}")
    except ImportError as exc:
        raise click.UsageError(
            f"the server needs FastAPI, uvicorn and prometheus_client: pip install 'fsd-local[server]' ({exc})"
        ) from None


CHAT_EXAMPLES = """
\b
Examples:
  fsd-local chat --tau 0.3                       (the offline demo pair)
  fsd-local chat --pair qwen2.5-0.5b-7b --tau 0.1 --color
  fsd-local chat --target big.gguf --draft small.gguf --mode sd --temp 0.7
  fsd-local chat --web --tau 0.2                 (the chat page in the browser)
  printf 'Hi\\n/tau 0.2\\nAnd now?\\n' | fsd-local chat --json
"""
PAIR_EPILOG = f"""
A pair is a small draft model and a large target model with the same tokenizer; fsd-local runs them with
Fuzzy Speculative Decoding. tau: {TAU_HELP}. Modes: {MODE_HELP}. Divergences: {DIVERGENCE_HELP}. The suggested tau per
divergence is a starting point; `fsd-local calibrate` finds one for a budget on your prompts.

\b
Examples:
  fsd-local models
  fsd-local pull qwen2.5-0.5b-7b
  fsd-local chat --pair qwen2.5-0.5b-7b --tau 0.1 --divergence js
"""


@cli.command(epilog=CHAT_EXAMPLES)
@model_options
@chat_settings_options
@click.option("--system", help="system prompt for the conversation")
@click.option(
    "--color",
    is_flag=True,
    help="colour each token by origin: green = draft token that passed the SD "
    "test, yellow = draft token rescued by tau (fuzzy), plain = the target's own token",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="print one JSON object per reply (text, finish_reason, stats) instead of streaming text",
)
@click.option(
    "--web",
    is_flag=True,
    help="chat in the browser instead: serve the chat page (and the OpenAI API) on a free loopback port and open it",
)
def chat(system, color, as_json, web, **kwargs):
    """Chat with a draft/target pair in the target's chat template; earlier turns stay in both KV caches. Slash
    commands change settings live (/help lists them); Ctrl-C stops a reply, Ctrl-D leaves; without a terminal,
    each input line is one message. --web: the same conversation on a page, tau on a slider."""
    from fsd_local.cli.chat import ChatSession, run_chat

    settings = pop_settings(kwargs)
    if web:
        if as_json or color or system:
            raise click.UsageError("--web opens the chat page: --json, --color and --system apply to the terminal chat")
        open_page = _server_part("running").open_page
        with load_engine(**kwargs, settings=settings, say=say) as engine:
            open_page(engine, say)
        return
    with load_engine(**kwargs, settings=settings, say=say) as engine:
        run_chat(ChatSession(engine, engine.defaults, system=system), color=color, as_json=as_json)


@cli.command(epilog=PAIR_EPILOG)
@click.option("--json", "as_json", is_flag=True, help="print the pairs as one JSON object")
@click.option(
    "--local",
    is_flag=True,
    help="list the GGUF models already on this disk instead (Ollama, the Hugging Face cache, LM Studio, "
    "llama.cpp's cache), with what can draft for what",
)
def models(as_json, local):
    """List the curated pairs of models.toml and which of their files are in the local Hugging Face cache
    (FSD_LOCAL_MODELS=FILE: your own models.toml). --local: every GGUF model on this disk, its name for
    --target/--draft, what it is and which models can draft for it (docs/models.md)."""
    import dataclasses

    from fsd_local.pairs.registry import format_pairs, load_registry

    if local:
        from fsd_local.pairs.local import format_listing, list_local_models
        from fsd_local.pairs.ranking import add_ranking

        listing = add_ranking(list_local_models())
        click.echo(json.dumps(listing.to_dict(), indent=2) if as_json else format_listing(listing))
        return
    registry = load_registry()
    if as_json:
        click.echo(
            json.dumps(
                {
                    name: {**dataclasses.asdict(p), "present": {role: f.cached_path() for role, f in p.files()}}
                    for name, p in registry.items()
                },
                indent=2,
            )
        )
    else:
        click.echo(format_pairs(registry))


@cli.command(epilog=PAIR_EPILOG)
@click.argument("pair")
def pull(pair):
    """Download PAIR's draft and target into the Hugging Face cache (progress bars, HF_HUB_OFFLINE, HF_ENDPOINT
    and HF_HUB_CACHE as usual; files already there are reused) and check each file's SHA-256."""
    from fsd_local.pairs.registry import pull as pull_pair

    target, draft = pull_pair(pair, say=say)
    click.echo(f"target {target}\ndraft  {draft}")
    say(f"ready: fsd-local chat --pair {pair} --tau 0.1")


BENCH_EXAMPLES = """
\b
Examples:
  fsd-local bench --taus 0,0.1,0.2 --divergence js,kl --draft-max 2,4 --temp 0,0.7 --plot bench.png
  fsd-local bench --pair qwen2.5-0.5b-7b --prompts my.jsonl --max-tokens 128 --json > bench.json
  fsd-local bench --kernels
  fsd-local bench --costs --sizes 1,2,4,8,16
  fsd-local bench --serve --clients 8 --requests 64 --max-tokens 32
"""


@cli.command(epilog=BENCH_EXAMPLES)
@model_options
@bench_options.bench_options
def bench(**kwargs):
    """Measure a pair's speed / quality trade-off over modes, divergences, taus, draft lengths and temperatures on the
    same prompts and seeds, with the ar and sd baselines. Instead: --kernels the kernels against NumPy, --overhead the
    loop's own time, --costs one decode of each batch size on both models, --serve the server under load."""
    bench_modes.bench_command(**kwargs)


@cli.command()
@model_options
@calibrate_cli.calibrate_options
def calibrate(**kwargs):
    """Find tau for a budget on your prompts by bisection over [0, --tau-max]: the largest tau within
    --min-agreement or --max-logprob-drop, or the smallest reaching --target-acceptance. Prints every tau
    tried and the speed at the answer."""
    calibrate_cli.calibrate_command(**kwargs)


def main():  # console-script entry point
    cli()


if __name__ == "__main__":
    main()
