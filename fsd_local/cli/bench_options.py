"""The options of `fsd-local bench` (its body: cli/bench.py and cli/bench_modes.py; registered in cli/main.py), and
those `fsd-local calibrate` shares with it (cli/calibrate.py)."""

from __future__ import annotations

import click

from fsd_local.cli.options import bench_sampling_options
from fsd_local.kernels.names import DIVERGENCES, DRAFT_POLICIES, DRAFTERS, MODES, TAU_MODES


def _apply(f, *opts):
    for opt in reversed(opts):
        f = opt(f)
    return f


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
    return _apply(f, *opts)


def sweep_options(f):
    """What a benchmark sweeps: every combination of these runs, interleaved."""
    return _apply(
        f,
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
            help="quality budgets B (nats per token, docs/generation.md): every mode with a tau also runs at "
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
    )


def output_options(f):
    """How often each run is timed and how the results are written."""
    return _apply(
        f,
        click.option(
            "--repeats",
            type=click.IntRange(1),
            help="timed repeats per (configuration, prompt) [default: 3; 7 with --kernels; with --costs, the passes "
            "per batch size: 3]",
        ),
        click.option("--json", "as_json", is_flag=True, help="print a JSON list, one object per configuration"),
        click.option("--csv", "as_csv", is_flag=True, help="print CSV, one row per configuration"),
        click.option(
            "--plot",
            "plot_path",
            type=click.Path(dir_okay=False),
            help="write a PNG: tokens/s and quality against tau (needs the `plot` extra: matplotlib)",
        ),
    )


def mode_options(f):
    """The other measurements `bench` makes in place of the sweep, and their own options."""
    return _apply(
        f,
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
        click.option(
            "--costs",
            is_flag=True,
            help="time one decode of each batch size instead, on the target and the draft: ms and the ratio to one "
            "token (what a verification of n - 1 drafts costs; the shape the auto policy prices)",
        ),
        click.option(
            "--serve",
            is_flag=True,
            help="load the server instead: --clients concurrent clients send --requests chat requests to the OpenAI "
            "route in front of the pair; requests/s, latency, tokens/s, 503s and memory",
        ),
        click.option(
            "--sizes",
            type=CommaList(int, "batch size", minimum=1),
            help="with --costs: batch sizes [default: 1,2,3,4,5,6,8,9,12,16]",
        ),
        click.option("--clients", type=click.IntRange(1), help="with --serve: clients sending at once [default: 8]"),
        click.option("--requests", type=click.IntRange(1), help="with --serve: requests sent in all [default: 64]"),
    )


def sampling_options(f):
    """How every configuration of a run samples: chat's way (--chat-sampling), and the chain's options one by one
    (cli/options.py; unset unless given)."""
    f = bench_sampling_options(f)
    return click.option(
        "--chat-sampling",
        is_flag=True,
        help="sample as `fsd-local chat` does: its top-k, top-p, min-p and repeat penalty in every run, and its "
        "temperature when --temp is not given (each of them can still be set on its own)",
    )(f)


def bench_options(f):
    return run_options(sweep_options(sampling_options(output_options(mode_options(f)))))


def _param_names(decorator) -> frozenset[str]:
    """The names of the parameters a decorator of options adds."""
    return frozenset(p.name for p in decorator(lambda: None).__click_params__)


OWN_KEYS = _param_names(bench_options)  # bench's own options; the rest of its arguments load the models
