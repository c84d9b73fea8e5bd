"""The body of `fsd-local bench` (registered in cli/main.py): which measurement a run makes, and those it makes in
place of its sweep (cli/bench.py), one function per flag: --kernels (bench/kernels.py), --overhead
(bench/overhead.py), --costs (bench/costs.py), --serve (bench/serve.py). Each takes every option of the command,
as a dict."""

from __future__ import annotations

import json

import click

from fsd_local.cli.bench import MODEL_KEYS, configs_of, engine, given, model_kwargs, progress, sampling_of, say, sweep
from fsd_local.cli.drafts import bench_drafters
from fsd_local.kernels.names import DIVERGENCES

MODE_FLAGS = ("kernels", "overhead", "costs", "serve")
MODE_OPTIONS = {"vocabs": "kernels", "rows": "kernels", "sizes": "costs", "clients": "serve", "requests": "serve"}
MODE_OPTIONS_NOTE = {
    "kernels": "--vocab and --rows only apply to --kernels",
    "costs": "--sizes only applies to --costs",
    "serve": "--clients and --requests only apply to --serve",
}


def bench_command(**a):
    """`a`: every option of bench (cli/bench_options.py) and of model loading (cli/options.py)."""
    if a["as_json"] and a["as_csv"]:
        raise click.UsageError("choose one of --json and --csv")
    chosen = [m for m in MODE_FLAGS if a[m]]
    if len(chosen) > 1:
        raise click.UsageError("choose one of " + ", ".join(f"--{m}" for m in chosen))
    mode = chosen[0] if chosen else None
    for key, owner in MODE_OPTIONS.items():
        if a[key] and owner != mode:
            raise click.UsageError(MODE_OPTIONS_NOTE[owner])
    if mode is None:
        return sweep(a)
    return MODES[mode](a)


def _no_csv(a: dict, flag: str) -> None:
    if a["as_csv"]:
        raise click.UsageError(f"--{flag} prints a table or --json")


def kernels(a: dict) -> None:
    from fsd_local.bench.kernels import ROWS, VOCABS, bench_kernels, format_table

    if any(a.get(k) for k in MODEL_KEYS):
        raise click.UsageError("--kernels measures the divergence kernels alone: it takes no model arguments")
    _no_csv(a, "kernels")
    # the default is every divergence; a user who named some gets those
    names = a["divergences"] if given("divergences") else list(DIVERGENCES)
    vocabs, rows = a["vocabs"] or list(VOCABS), a["rows"] or list(ROWS)
    with progress(len(names) * len(vocabs) * len(rows), "kernels") as bar:
        results = bench_kernels(names, vocabs, rows, a["repeats"] or 7, progress=lambda: bar.update(1))
    click.echo(json.dumps(results, indent=1) if a["as_json"] else format_table(results))


def overhead(a: dict) -> None:
    from fsd_local.bench.overhead import format_rows, measure
    from fsd_local.bench.prompts import load_prompts
    from fsd_local.bench.runner import prompt_tokens

    _no_csv(a, "overhead")
    configs = configs_of(a, a["drafters"], ["cold"])
    # what a request costs that asks for no log-probabilities (bench's own runs ask: its logp/tok column)
    labelled = [
        (_label(c, case), {**c.settings(a["max_tokens"], a["seed"]), **sampling, "logprobs": False})
        for case, sampling in _sampling_cases(a)
        for c in configs
    ]
    prompts = load_prompts(a["prompts_file"])[: a["limit"]]
    with engine(model_kwargs(a), needs_draft=any(d != "ngram" for d in a["drafters"])) as eng:
        tokens = prompt_tokens(eng, prompts, a["chat"])
        say(f"the loop's own time: {len(labelled)} configurations x {len(prompts)} prompts, {a['max_tokens']} tokens")
        out = measure(eng, tokens, labelled, a["max_tokens"], a["repeats"] or 1)
    click.echo(json.dumps(out, indent=1) if a["as_json"] else format_rows(out))


def costs(a: dict) -> None:
    from fsd_local.bench import costs as bench_costs
    from fsd_local.bench.prompts import load_prompts
    from fsd_local.bench.runner import prompt_tokens

    _no_csv(a, "costs")
    kwargs = model_kwargs(a)
    drafters = bench_drafters(kwargs, ["model"], say)  # a target alone: its draft if one fits, else none to time
    prompts = load_prompts(a["prompts_file"])[:1]
    with engine(kwargs, needs_draft=drafters == ["model"]) as eng:
        context = prompt_tokens(eng, prompts, a["chat"])[0]
        say(f"timing batch sizes after a prompt of {len(context)} tokens")
        rows = bench_costs.measure(eng, context, a["sizes"] or bench_costs.SIZES, a["repeats"] or bench_costs.PASSES)
    click.echo(json.dumps(rows, indent=1) if a["as_json"] else bench_costs.format_rows(rows))


def serve(a: dict) -> None:
    from fsd_local.bench.prompts import load_prompts

    try:
        from fsd_local.bench import serve as bench_serve
    except ImportError as exc:
        raise click.UsageError(f"--serve needs the server: pip install 'fsd-local[server]' ({exc})") from None
    _no_csv(a, "serve")
    kwargs = model_kwargs(a)
    drafters = bench_drafters(kwargs, a["drafters"], say)
    prompts = [p.text for p in load_prompts(a["prompts_file"])]
    clients, requests = a["clients"] or 8, a["requests"] or 64
    with engine(kwargs, needs_draft=any(d != "ngram" for d in drafters), ignore_eos=a["ignore_eos"]) as eng:
        say(f"{clients} clients, {requests} requests of {a['max_tokens']} tokens, {len(prompts)} prompts in turn")
        out = bench_serve.measure(eng, prompts, clients, requests, a["max_tokens"])
    click.echo(json.dumps(out, indent=1) if a["as_json"] else bench_serve.format_result(out))


# --overhead with no sampling option: the three ways a user's requests sample, each at the pair's vocabulary
SAMPLING_CASES: tuple[tuple[str, dict], ...] = (
    ("greedy", {"temperature": 0.0}),
    ("T 0.7 alone (API default)", {"temperature": 0.7}),  # OpenAI's API: a temperature, no top-k, top-p 1
    ("chat defaults", {}),  # settings.CHAT_DEFAULTS, filled in below
)


def _sampling_cases(a: dict) -> list[tuple[str | None, dict]]:
    """(name, settings) of each sampling the configurations run under: what the options ask (name None: the
    configuration's own temperature), or with none of them the three SAMPLING_CASES."""
    from fsd_local.cli.options import BENCH_SAMPLING
    from fsd_local.settings import CHAT_DEFAULTS

    if a["chat_sampling"] or given("temperatures") or any(a[k] is not None for k in BENCH_SAMPLING):
        return [(None, sampling_of(a)[0])]
    return [(name, s or dict(CHAT_DEFAULTS)) for name, s in SAMPLING_CASES]


def _label(c, case: str | None = None) -> str:
    parts = [c.mode] + ([c.divergence] if c.divergence else []) + ([f"tau {c.tau:g}"] if c.tau is not None else [])
    parts += [f"B {c.budget:g}"] if c.budget is not None else []
    parts += [f"{c.policy} k {c.draft_max}"] if c.draft_max else []
    return " ".join(parts + [case or f"T {c.temperature:g}"])


MODES = {"kernels": kernels, "overhead": overhead, "costs": costs, "serve": serve}
