"""The options and body of `fsd-local bench` (registered in cli/main.py; `fsd-local calibrate` is cli/calibrate.py)."""

from __future__ import annotations

import sys

import click

from fsd_local.cli.drafts import bench_drafters, require_draft
from fsd_local.cli.options import BENCH_SAMPLING, bench_sampling_options
from fsd_local.kernels.names import DIVERGENCES, DRAFT_POLICIES, DRAFTERS, MODES, TAU_MODES

MODEL_KEYS = ("target", "draft", "pair")


class CommaList(click.ParamType):
    """'0,0.05,0.1' -> [0.0, 0.05, 0.1], each item converted and checked."""

    def __init__(self, convert, what, choices=None, minimum=None):
        self._convert, self._choices, self._minimum = convert, choices, minimum
        self.name = what

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        items = [v.strip() for v in str(value).split(",") if v.strip()]
        if not items:
            self.fail("give at least one value", param, ctx)
        out = []
        for v in items:
            try:
                x = self._convert(v)
            except ValueError:
                self.fail(f"{v!r} is not a valid {self.name} value", param, ctx)
            if self._choices and x not in self._choices:
                self.fail(f"{v!r}: choose from {', '.join(self._choices)}", param, ctx)
            if self._minimum is not None and x < self._minimum:
                self.fail(f"{v!r} must be >= {self._minimum}", param, ctx)
            out.append(x)
        return out


def run_options(f):
    """What bench and calibrate share: the prompts and how each generation runs."""
    opts = [
        click.option(
            "--prompts",
            "prompts_file",
            type=click.Path(exists=True, dir_okay=False),
            help="prompts file: one prompt per line, or JSON Lines (.jsonl) with optional answers "
            "(default: the shipped example file)",
        ),
        click.option("--limit", type=click.IntRange(1), help="use only the first N prompts of the file", metavar="N"),
        click.option("--chat", is_flag=True, help="wrap each prompt in the target's chat template as a user turn"),
        click.option(
            "--max-tokens", type=click.IntRange(1), default=64, show_default=True, help="tokens generated per prompt"
        ),
        click.option(
            "--seed",
            type=click.IntRange(0),
            default=0,
            show_default=True,
            help="base seed: every configuration gets the same seed for the same (repeat, prompt)",
        ),
        click.option(
            "--ignore-eos",
            is_flag=True,
            help="generate --max-tokens every time, past end-of-generation tokens (fixed-length timing)",
        ),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def bench_options(f):
    opts = [
        click.option(
            "--taus",
            type=CommaList(float, "tau", minimum=0.0),
            default="0,0.1,0.2,0.4",
            show_default=True,
            help="tau values (every mode with a tau: " + ", ".join(TAU_MODES) + ")",
        ),
        click.option(
            "--budgets",
            type=CommaList(float, "quality budget", minimum=0.0),
            help="quality budgets B (nats per token, README 'Quality budget'): every mode with a tau also runs at "
            "each B in place of a tau, side by side with the fixed taus",
        ),
        click.option(
            "--divergence",
            "divergences",
            type=CommaList(str, "divergence", DIVERGENCES),
            default="js",
            show_default=True,
            help="divergences, comma separated: " + ", ".join(DIVERGENCES),
        ),
        click.option(
            "--modes",
            type=CommaList(str, "mode", MODES),
            default="fsd",
            show_default=True,
            help="modes, comma separated; the ar and sd baselines always run",
        ),
        click.option(
            "--draft-max",
            "draft_maxes",
            type=CommaList(int, "draft length", minimum=1),
            default="16",
            show_default=True,
            help="draft lengths k (auto's upper bound); the table's oracle column prices every fixed k up to it",
        ),
        click.option(
            "--drafter",
            "drafters",
            type=CommaList(str, "drafter", DRAFTERS),
            default="model",
            show_default=True,
            help="who drafts, comma separated: " + ", ".join(DRAFTERS) + " (ngram alone needs no --draft)",
        ),
        click.option(
            "--draft-policy",
            "policies",
            type=CommaList(str, "draft policy", DRAFT_POLICIES),
            default="auto",
            show_default=True,
            help="draft-length policies, comma separated: fixed, adaptive, auto (--draft-max is auto's upper bound)",
        ),
        click.option(
            "--chat-sampling",
            is_flag=True,
            help="sample as `fsd-local chat` does: its top-k, top-p, min-p and repeat penalty in every run, and its "
            "temperature when --temp is not given (each of them can still be set on its own)",
        ),
        click.option(
            "--policy-state",
            "states",
            type=CommaList(str, "policy state", ("cold", "warm")),
            default="cold,warm",
            show_default=True,
            help="what the auto policy knows when a run starts: cold (nothing, as a freshly loaded engine: a first "
            "reply), warm (what the configuration's own earlier runs taught it: the later replies of a session)",
        ),
        click.option(
            "--temp",
            "temperatures",
            type=CommaList(float, "temperature", minimum=0.0),
            default="0",
            show_default=True,
            help="temperatures (0 = greedy; agreement is only defined there)",
        ),
        click.option(
            "--repeats",
            type=click.IntRange(1),
            help="timed repeats per (configuration, prompt) [default: 3; 7 with --kernels]",
        ),
        click.option("--json", "as_json", is_flag=True, help="print a JSON list, one object per configuration"),
        click.option("--csv", "as_csv", is_flag=True, help="print CSV, one row per configuration"),
        click.option(
            "--plot",
            "plot_path",
            type=click.Path(dir_okay=False),
            help="write a PNG: tokens/s and quality against tau (needs the `plot` extra: matplotlib)",
        ),
        click.option(
            "--kernels",
            is_flag=True,
            help="benchmark the divergence kernels against vectorised NumPy instead (no models)",
        ),
        click.option(
            "--overhead",
            is_flag=True,
            help="measure the loop's own time instead: per round and per draft token, by phase, as wall time minus "
            "the time inside llama.cpp's decodes (what a GPU round cannot afford)",
        ),
        click.option(
            "--vocab",
            "vocabs",
            type=CommaList(int, "vocabulary size", minimum=2),
            help="with --kernels: vocabulary sizes [default: 32000,49152,151936,262144]",
        ),
        click.option(
            "--rows",
            type=CommaList(int, "row count", minimum=1),
            help="with --kernels: rows per call [default: 1,2,4,8]",
        ),
    ]
    for opt in reversed(opts):
        f = opt(f)
    f = run_options(f)
    return bench_sampling_options(f)


def sampling_of(kwargs: dict, temperatures: list[float]) -> tuple[dict, list[float]]:
    """The sampling settings every configuration of a bench run shares (--chat-sampling and the chain options),
    popped from the command's arguments, and the temperatures to run (chat's with --chat-sampling unless --temp
    was given)."""
    from fsd_local.settings import CHAT_DEFAULTS

    chat = kwargs.pop("chat_sampling")
    common = {k: v for k, v in CHAT_DEFAULTS.items() if k != "temperature"} if chat else {}
    given = {k: kwargs.pop(k) for k in BENCH_SAMPLING}
    common.update({k: v for k, v in given.items() if v is not None})
    if chat and not _given("temperatures"):
        temperatures = [CHAT_DEFAULTS["temperature"]]
    return common, temperatures


def _say(msg):
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
            _say(f"{self.label}: {self.done}/{self.length}")


def _progress(length, label):
    if not sys.stderr.isatty():
        return _Lines(length, label)
    return click.progressbar(length=length, label=label, file=sys.stderr, show_pos=True, show_eta=True)


def bench_command(
    *,
    prompts_file,
    limit,
    chat,
    max_tokens,
    seed,
    ignore_eos,
    taus,
    budgets,
    divergences,
    modes,
    draft_maxes,
    drafters,
    policies,
    states,
    temperatures,
    repeats,
    as_json,
    as_csv,
    plot_path,
    kernels,
    overhead,
    vocabs,
    rows,
    **model_kwargs,
):
    if as_json and as_csv:
        raise click.UsageError("choose one of --json and --csv")
    common, temperatures = sampling_of(model_kwargs, temperatures)
    if kernels:
        return _kernels_command(model_kwargs, divergences, vocabs, rows, repeats or 7, as_json, as_csv)
    if vocabs or rows:
        raise click.UsageError("--vocab and --rows only apply to --kernels")
    if overhead:
        return _overhead_command(model_kwargs, locals(), common, as_json)
    from fsd_local.bench.frontier import mark_frontier
    from fsd_local.bench.prompts import load_prompts
    from fsd_local.bench.report import format_table, to_csv, to_json
    from fsd_local.bench.runner import build_configs, run_bench, summarise

    if plot_path:
        from fsd_local.bench.plot import require_matplotlib

        require_matplotlib()  # before the long run, not after it
    drafters = bench_drafters(model_kwargs, drafters, _say)  # a target alone: its draft, or prompt lookup
    configs = build_configs(
        modes, divergences, taus, draft_maxes, temperatures, drafters, policies, budgets or (), states
    )
    prompts = load_prompts(prompts_file)[:limit]
    repeats = repeats or 3
    with _engine(model_kwargs, needs_draft=any(d != "ngram" for d in drafters)) as engine:
        total = len(configs) * len(prompts) * repeats
        _say(f"{len(configs)} configurations x {len(prompts)} prompts x {repeats} repeats, {max_tokens} tokens each")
        if any(c.state for c in configs):
            _say(
                "each run starts from a freshly loaded engine's policy state; auto runs cold (every run from "
                "nothing) and warm (from its own earlier runs); the machine's costs are measured once first and "
                "kept throughout, as an engine keeps them on disk"
            )
        with _progress(total, "bench") as bar:
            data = run_bench(
                engine,
                prompts,
                configs,
                common=common,
                max_tokens=max_tokens,
                repeats=repeats,
                seed=seed,
                chat=chat,
                ignore_eos=ignore_eos,
                progress=lambda: bar.update(1),
            )
    rows_out = mark_frontier(summarise(data))
    if as_json:
        click.echo(to_json(rows_out))
    elif as_csv:
        click.echo(to_csv(rows_out), nl=False)
    else:
        click.echo(format_table(rows_out))
    if plot_path:
        from fsd_local.bench.plot import plot

        plot(rows_out, plot_path, title=f"{len(prompts)} prompts, {max_tokens} tokens, {repeats} repeats")
        _say(f"plot written to {plot_path}")


def _kernels_command(model_kwargs, divergences, vocabs, rows, repeats, as_json, as_csv):
    import json

    from fsd_local.bench.kernels import ROWS, VOCABS, bench_kernels, format_table

    if any(model_kwargs.get(k) for k in MODEL_KEYS):
        raise click.UsageError("--kernels measures the divergence kernels alone: it takes no model arguments")
    if as_csv:
        raise click.UsageError("--kernels prints a table or --json")
    # the default is every divergence; a user who named some gets those
    names = divergences if _given("divergences") else list(DIVERGENCES)
    vocabs, rows = vocabs or list(VOCABS), rows or list(ROWS)
    with _progress(len(names) * len(vocabs) * len(rows), "kernels") as bar:
        results = bench_kernels(names, vocabs, rows, repeats, progress=lambda: bar.update(1))
    click.echo(json.dumps(results, indent=1) if as_json else format_table(results))


def _overhead_command(model_kwargs, a: dict, common: dict, as_json: bool) -> None:
    import json

    from fsd_local.bench.overhead import format_rows, measure
    from fsd_local.bench.prompts import load_prompts
    from fsd_local.bench.runner import build_configs, prompt_tokens

    if a["as_csv"]:
        raise click.UsageError("--overhead prints a table or --json")
    axes = ("modes", "divergences", "taus", "draft_maxes", "temperatures", "drafters", "policies")
    configs = build_configs(**{k: a[k] for k in axes}, budgets=a["budgets"] or (), states=["cold"])
    # what a request costs that asks for no log-probabilities (bench's own runs ask: its logp/tok column)
    labelled = [(_label(c), {**c.settings(a["max_tokens"], a["seed"]), **common, "logprobs": False}) for c in configs]
    prompts = load_prompts(a["prompts_file"])[: a["limit"]]
    with _engine(model_kwargs, needs_draft=any(d != "ngram" for d in a["drafters"])) as engine:
        tokens = prompt_tokens(engine, prompts, a["chat"])
        _say(f"the loop's own time: {len(labelled)} configurations x {len(prompts)} prompts, {a['max_tokens']} tokens")
        out = measure(engine, tokens, labelled, a["max_tokens"], a["repeats"] or 1)
    click.echo(json.dumps(out, indent=1) if as_json else format_rows(out))


def _label(c) -> str:
    parts = [c.mode] + ([c.divergence] if c.divergence else []) + ([f"tau {c.tau:g}"] if c.tau is not None else [])
    parts += [f"B {c.budget:g}"] if c.budget is not None else []
    parts += [f"{c.policy} k {c.draft_max}"] if c.draft_max else []
    return " ".join(parts + [f"T {c.temperature:g}"])


def _given(param: str) -> bool:
    ctx = click.get_current_context()
    return ctx.get_parameter_source(param) != click.core.ParameterSource.DEFAULT


def _engine(model_kwargs: dict, needs_draft: bool = True):
    from fsd_local.cli.options import load_engine
    from fsd_local.settings import Settings

    if needs_draft:
        require_draft(model_kwargs, _say)
    return load_engine(**model_kwargs, settings=Settings(drafter="model" if needs_draft else "ngram"), say=_say)
