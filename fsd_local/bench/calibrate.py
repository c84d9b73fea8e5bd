"""`fsd-local calibrate`: the tau (for a speed goal, the quality budget B) that meets a goal on given prompts.
Each mode's knob is bisected over [0, tau_max], assuming acceptance does not fall and quality does not rise as it
grows; each mode's answer is then timed in the same passes, interleaved with ar and sd, and the fastest is chosen."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fsd_local.bench.runner import TAU_MODES, BenchData, Config, run_bench, summarise
from fsd_local.errors import ConfigError
from fsd_local.kernels.names import DIVERGENCE_MODES, TYPICAL_EPS_DEFAULT

BUDGETS = ("agreement", "logprob_drop", "acceptance", "speed")
BUDGET_MAX = 1.0  # nats per token: where the search for the quality budget that reaches a speed ends
# the largest value each divergence can take (ln 2 for JS, 1 for TV); the unbounded ones get a generous cap
TAU_CEILING = {"js": math.log(2), "topk-js": math.log(2), "tv": 1.0, "topk-tv": 1.0}
TAU_CEILING_UNBOUNDED = 2.0
# the target-only rules take every unmasked token at these taus (typical: 1 / (1 - m), m <= eps)
MODE_TAU_CEILING = {"typical": 1.0 / (1.0 - TYPICAL_EPS_DEFAULT), "cascade": 1.0, "relaxed": 1.0}
TIMED_KEYS = (
    "tokens_per_second",
    "tokens_per_second_spread",
    "speedup_vs_ar",
    "speedup_vs_sd",
    "acceptance_rate",
    "mean_tokens_per_round",
    "fuzzy_share",
    "target_logprob_mean",
    "agreement",
    "accuracy",
    "tokens_per_target_call",
    "loss_per_token",
    "loss_worst_reply",
)


VISITED_KEYS = (
    "agreement",
    "target_logprob_mean",
    "logprob_drop",
    "acceptance_rate",
    "tokens_per_target_call",
    "loss_per_token",
    "loss_worst_reply",
    "meets",
)


def default_tau_max(mode: str, divergence: str) -> float:
    """Where the search ends: the tau that accepts (nearly) everything. fsd-entropy's threshold is tau times a
    factor below 1, so it gets twice the divergence's ceiling."""
    if mode in MODE_TAU_CEILING:
        return MODE_TAU_CEILING[mode]
    ceiling = TAU_CEILING.get(divergence, TAU_CEILING_UNBOUNDED)
    return 2 * ceiling if mode == "fsd-entropy" else ceiling


@dataclass(frozen=True)
class Budget:
    kind: str  # one of BUDGETS
    value: float

    def meets(self, row: dict, sd_row: dict) -> bool:
        if self.kind == "agreement":
            return row["agreement"] >= self.value
        if self.kind == "logprob_drop":
            return logprob_drop(row, sd_row) <= self.value
        if self.kind == "speed":
            return row["tokens_per_target_call"] >= self.value
        return row["acceptance_rate"] >= self.value

    def describe(self) -> str:
        return {
            "agreement": f"agreement >= {self.value:g}",
            "logprob_drop": f"target log-prob drop <= {self.value:g} per token (vs sd)",
            "acceptance": f"acceptance >= {self.value:g}",
            "speed": f"tokens per target call >= {self.value:g}",
        }[self.kind]

    @property
    def knob(self) -> str:
        """What the search moves: the quality budget for a speed goal, tau otherwise."""
        return "quality_budget" if self.kind == "speed" else "tau"


def logprob_drop(row: dict, sd_row: dict) -> float:
    return sd_row["target_logprob_mean"] - row["target_logprob_mean"]


def calibrate(
    engine,
    prompts,
    *,
    budget: Budget,
    divergence: str = "js",
    mode: str = "fsd",
    modes: list[str] | None = None,
    draft_max: int = 4,
    temperature: float = 0.0,
    tau_max: float | None = None,
    steps: int = 6,
    max_tokens: int = 64,
    repeats: int = 3,
    seed: int = 0,
    chat: bool = False,
    ignore_eos: bool = False,
    on_step=None,
) -> dict:
    """Search tau for `mode` (or each of `modes`); returns the chosen (mode, tau) with its measured quality and
    speed, every point visited and, with several modes, each mode's own answer (`candidates`, fastest first).
    `on_step(tau, row)` is called after each tau is measured (row["mode"] says for which mode)."""
    modes = list(dict.fromkeys(modes)) if modes else [mode]
    _check(budget, modes, temperature, steps, tau_max)
    run: dict[str, Any] = dict(max_tokens=max_tokens, repeats=1, seed=seed, chat=chat, ignore_eos=ignore_eos)
    ar, sd = Config("ar", temperature), Config("sd", temperature, draft_max=draft_max)
    base = run_bench(engine, prompts, [ar, sd], **run)
    sd_row = summarise(base)[1]

    def config(m: str, x: float) -> Config:
        div = divergence if m in DIVERGENCE_MODES else None
        if budget.kind == "speed":  # x is the quality budget
            return Config(m, temperature, div, None, draft_max, budget=x)
        return Config(m, temperature, div, x, draft_max)

    searched = {}
    for m in modes:
        top = (BUDGET_MAX if budget.kind == "speed" else default_tau_max(m, divergence)) if tau_max is None else tau_max
        visited: dict[float, dict] = {}

        def measure(tau: float, m=m, visited=visited) -> dict:
            if tau not in visited:
                cand = config(m, tau)
                runs = run_bench(engine, prompts, [cand], **run).runs
                # judged against the baselines' outputs for the same prompts and seeds
                row = summarise(BenchData(base.configs + [cand], prompts, 1, base.runs + runs))[-1]
                visited[tau] = dict(row, meets=budget.meets(row, sd_row), logprob_drop=logprob_drop(row, sd_row))
                if on_step:
                    on_step(tau, visited[tau])
            return visited[tau]

        if budget.kind in ("acceptance", "speed"):
            best = _smallest_reaching(measure, top, steps, budget)
        else:
            best = _largest_within(measure, top, steps)
        searched[m] = (best, top, visited)
    chosen = [config(m, best) for m, (best, _, _) in searched.items()]
    timed = summarise(run_bench(engine, prompts, [ar, sd, *chosen], **dict(run, repeats=repeats)))[2:]
    candidates = [_candidate(c, row, *searched[c.mode]) for c, row in zip(chosen, timed)]
    candidates.sort(key=lambda r: -(r["tokens_per_second"] or 0.0))
    result = _result(candidates[0], budget, draft_max, temperature)
    if len(modes) > 1:
        result["candidates"] = candidates
    return result


def _check(budget: Budget, modes: list[str], temperature: float, steps: int, tau_max: float | None) -> None:
    """The search's arguments, refused before anything runs."""
    if budget.kind == "agreement" and temperature > 0:
        raise ConfigError(
            "--min-agreement compares with the target's greedy output: use it with --temp 0, "
            "or budget the log-prob drop (--max-logprob-drop) instead"
        )
    if budget.kind not in BUDGETS:
        raise ConfigError(f"unknown budget {budget.kind!r}")
    for m in modes:
        if m not in TAU_MODES:
            raise ConfigError(f"calibrate searches tau, which only {', '.join(TAU_MODES)} use (not {m!r})")
    if steps < 1:
        raise ConfigError("--steps must be >= 1")
    if tau_max is not None and tau_max <= 0:
        raise ConfigError("--tau-max must be > 0")


def _candidate(c: Config, row: dict, best: float, top: float, visited: dict[float, dict]) -> dict[str, Any]:
    """One mode's answer: its tau (with a speed goal, its quality budget), as timed, and every point visited."""
    return {
        "mode": c.mode,
        "tau": best,  # with a speed goal: the quality budget
        "divergence": c.divergence,
        "tau_max": top,
        **{k: row.get(k) for k in TIMED_KEYS},
        "visited": [{"tau": t, **{k: r.get(k) for k in VISITED_KEYS}} for t, r in sorted(visited.items())],
    }


def _result(pick: dict[str, Any], budget: Budget, draft_max: int, temperature: float) -> dict[str, Any]:
    return {
        "tau": pick["tau"] if budget.knob == "tau" else None,
        "quality_budget": pick["tau"] if budget.knob == "quality_budget" else None,
        "budget": {budget.kind: budget.value},
        "mode": pick["mode"],
        "divergence": pick["divergence"],
        "draft_max": draft_max,
        "temperature": temperature,
        "tau_max": pick["tau_max"],
        **{k: pick[k] for k in TIMED_KEYS},
        "visited": pick["visited"],
    }


def _bisect(below, lo: float, hi: float, steps: int) -> tuple[float, float]:
    """Narrow [lo, hi] around where `below(tau)` turns from True (at lo) to False (at hi)."""
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if below(mid) else (lo, mid)
    return lo, hi


def _largest_within(measure, tau_max, steps) -> float:
    if measure(tau_max)["meets"]:
        return tau_max
    # tau = 0 (sd) meets the budget, tau_max does not
    return _bisect(lambda t: measure(t)["meets"], 0.0, tau_max, steps)[0]


def _smallest_reaching(measure, tau_max, steps, budget) -> float:
    if measure(0.0)["meets"]:
        return 0.0
    top = measure(tau_max)
    if not top["meets"]:
        key, what, flag = (
            ("tokens_per_target_call", "tokens per target call", "--target-speed")
            if budget.kind == "speed"
            else ("acceptance_rate", "acceptance", "--target-acceptance")
        )
        raise ConfigError(
            f"{what} reaches only {top[key]:.2f} at {budget.knob} = {tau_max:g}, below the "
            f"target {budget.value:g}: raise --tau-max or lower {flag}"
        )
    # tau = 0 does not reach the target acceptance, tau_max does
    return _bisect(lambda t: not measure(t)["meets"], 0.0, tau_max, steps)[1]


def _visited_lines(visited: list[dict], knob: str = "tau") -> list[str]:
    lines = [
        f"{knob:>8}  {'agree':>6}  {'logp/tok':>8}  {'drop':>7}  {'accept':>6}  {'loss/tok':>8}  {'tok/call':>8}  meets"
    ]
    for v in visited:
        agree = "-" if v["agreement"] is None else f"{v['agreement']:.3f}"
        lines.append(
            f"{v['tau']:>8.4f}  {agree:>6}  {v['target_logprob_mean']:>8.3f}  {v['logprob_drop']:>7.3f}  "
            f"{v['acceptance_rate']:>6.0%}  {_f(v['loss_per_token'], '.4f'):>8}  "
            f"{_f(v['tokens_per_target_call'], '.3f'):>8}  {'yes' if v['meets'] else 'no'}"
        )
    return lines


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def format_report(result: dict, budget: Budget) -> str:
    knob = "B" if budget.kind == "speed" else "tau"
    which = f"smallest {knob} reaching" if budget.kind in ("acceptance", "speed") else f"largest {knob} within"
    lines: list[str] = []
    if "candidates" in result:
        lines.append(f"each mode's {which} {budget.describe()}, timed side by side (fastest first):")
        lines.append(
            f"{'mode':>12}  {knob:>8}  {'tok/s':>13}  {'x ar':>5}  {'accept':>6}  {'logp/tok':>8}  {'agree':>6}"
        )
        for c in result["candidates"]:
            lines.append(
                f"{c['mode']:>12}  {c['tau']:>8.4f}  "
                f"{_f(c['tokens_per_second'], '.1f'):>6} ±{_f(c['tokens_per_second_spread'], '.1f'):<5}  "
                f"{_f(c['speedup_vs_ar'], '.2f'):>5}  {_f(c['acceptance_rate'], '.0%'):>6}  "
                f"{_f(c['target_logprob_mean'], '.3f'):>8}  {_f(c['agreement'], '.3f'):>6}"
            )
        lines.append("")
        lines.append(f"visited by {result['mode']}:")
    lines += _visited_lines(result["visited"], knob)
    r = result
    lines.append("")
    head = "fastest within the budget: " if "candidates" in r else ""
    div = f", {r['divergence']}" if r["divergence"] else ""
    lines.append(
        f"{head}{which} {budget.describe()}: {knob} = {r[budget.knob]:.4f} ({r['mode']}{div}, "
        f"k={r['draft_max']}, temperature {r['temperature']:g})"
    )
    lines.append(
        f"  {r['tokens_per_second']:.1f} ±{r['tokens_per_second_spread']:.1f} tok/s, "
        f"{r['speedup_vs_ar']:.2f}x ar, {r['speedup_vs_sd']:.2f}x sd, acceptance {r['acceptance_rate']:.0%}, "
        f"{r['mean_tokens_per_round']:.2f} tokens/round, fuzzy {r['fuzzy_share']:.0%}"
    )
    return "\n".join(lines)
