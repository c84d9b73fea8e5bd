"""`fsd-local bench`'s sweep and what its measurements share: progress, the models loaded from the options (its
options: cli/bench_options.py; which measurement a run makes and the others: cli/bench_modes.py; `fsd-local
calibrate`, which shares these too: cli/calibrate.py)."""

from __future__ import annotations

import sys

import click

from fsd_local.cli.drafts import bench_drafters, require_draft

MODEL_KEYS = ("target", "draft", "pair")


def say(msg):
    click.echo(msg, err=True)


class _Lines:
    """Progress for a log file: click's bar draws nothing when standard error is not a terminal."""

    def __init__(self, length, label):
        self.length, self.label, self.done, self.shown = length, label, 0, -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def update(self, n):
        self.done += n
        tenth = self.done * 10 // self.length
        if tenth > self.shown:
            self.shown = tenth
            say(f"{self.label}: {self.done}/{self.length}")


def progress(length, label):
    if not sys.stderr.isatty():
        return _Lines(length, label)
    return click.progressbar(length=length, label=label, file=sys.stderr, show_pos=True, show_eta=True)


def sweep(a: dict) -> None:
    """The default measurement: every configuration on the same prompts and seeds, interleaved (bench/runner.py)."""
    from fsd_local.bench.frontier import mark_frontier
    from fsd_local.bench.prompts import load_prompts
    from fsd_local.bench.report import format_table, to_csv, to_json
    from fsd_local.bench.runner import run_bench, summarise

    if a["plot_path"]:
        from fsd_local.bench.plot import require_matplotlib

        require_matplotlib()  # before the long run, not after it
    kwargs = model_kwargs(a)
    drafters = bench_drafters(kwargs, a["drafters"], say)  # a target alone: its draft (in kwargs), or prompt lookup
    configs = configs_of(a, drafters, a["states"])
    prompts = load_prompts(a["prompts_file"])[: a["limit"]]
    repeats = a["repeats"] or 3
    with engine(kwargs, needs_draft=any(d != "ngram" for d in drafters)) as eng:
        total = len(configs) * len(prompts) * repeats
        say(
            f"{len(configs)} configurations x {len(prompts)} prompts x {repeats} repeats, {a['max_tokens']} tokens each"
        )
        if any(c.state for c in configs):
            say(
                "each run starts from a freshly loaded engine's policy state; auto runs cold (every run from "
                "nothing) and warm (from its own earlier runs); the machine's costs are measured once first and "
                "kept throughout, as an engine keeps them on disk"
            )
        with progress(total, "bench") as bar:
            data = run_bench(
                eng,
                prompts,
                configs,
                common=sampling_of(a)[0],
                max_tokens=a["max_tokens"],
                repeats=repeats,
                seed=a["seed"],
                chat=a["chat"],
                ignore_eos=a["ignore_eos"],
                progress=lambda: bar.update(1),
            )
    rows_out = mark_frontier(summarise(data))
    if a["as_json"]:
        click.echo(to_json(rows_out))
    elif a["as_csv"]:
        click.echo(to_csv(rows_out), nl=False)
    else:
        click.echo(format_table(rows_out))
    if a["plot_path"]:
        from fsd_local.bench.plot import plot

        plot(rows_out, a["plot_path"], title=f"{len(prompts)} prompts, {a['max_tokens']} tokens, {repeats} repeats")
        say(f"plot written to {a['plot_path']}")


def configs_of(a: dict, drafters: list[str], states) -> list:
    """The sweep's configurations: every combination of the options that apply (bench/runner.py)."""
    from fsd_local.bench.runner import build_configs

    temperatures = sampling_of(a)[1]
    axes = (a["modes"], a["divergences"], a["taus"], a["draft_maxes"], temperatures, drafters, a["policies"])
    return build_configs(*axes, a["budgets"] or (), states)


def sampling_of(a: dict) -> tuple[dict, list[float]]:
    """The sampling settings every configuration of a run shares (--chat-sampling and the chain options), and the
    temperatures to run (chat's with --chat-sampling unless --temp was given)."""
    from fsd_local.cli.options import BENCH_SAMPLING
    from fsd_local.settings import CHAT_DEFAULTS

    chat = a["chat_sampling"]
    common = {k: v for k, v in CHAT_DEFAULTS.items() if k != "temperature"} if chat else {}
    common.update({k: a[k] for k in BENCH_SAMPLING if a[k] is not None})
    temperatures = [CHAT_DEFAULTS["temperature"]] if chat and not given("temperatures") else a["temperatures"]
    return common, temperatures


def model_kwargs(a: dict) -> dict:
    """The model-loading options among all of a command's (cli/options.py's)."""
    from fsd_local.cli.bench_options import OWN_KEYS

    return {k: v for k, v in a.items() if k not in OWN_KEYS}


def given(param: str) -> bool:
    ctx = click.get_current_context()
    return ctx.get_parameter_source(param) != click.core.ParameterSource.DEFAULT


def engine(kwargs: dict, needs_draft: bool = True, **defaults):
    """The pair the model-loading options `kwargs` name, loaded (`defaults`: settings every generation starts from)."""
    from fsd_local.cli.options import load_engine
    from fsd_local.settings import Settings

    if needs_draft:
        require_draft(kwargs, say)
    settings = Settings(drafter="model" if needs_draft else "ngram", **defaults)
    return load_engine(**kwargs, settings=settings, say=say)
