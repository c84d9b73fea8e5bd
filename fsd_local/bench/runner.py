"""`fsd-local bench`: every configuration of one loaded pair on the same prompts and seeds, interleaved in a seeded
shuffled order per repeat and prompt, each from an empty cache and a cold or warm policy state, the costs measured
once first and kept; the summary's definitions are in docs/benchmarking.md."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fsd_local.bench.oracle import oracle, position_totals, verify_curve
from fsd_local.bench.prompts import Prompt
from fsd_local.errors import ConfigError
from fsd_local.kernels.names import DIVERGENCE_MODES, DIVERGENCES, MODES, TAU_MODES
from fsd_local.settings import Settings


@dataclass(frozen=True)
class Config:
    mode: str
    temperature: float
    divergence: str | None = None
    tau: float | None = None
    draft_max: int | None = None
    drafter: str | None = None  # speculative modes only: model | ngram | ngram+model
    policy: str | None = None  # speculative modes only: fixed | adaptive | auto
    budget: float | None = None  # a quality budget instead of tau (the lossy modes)
    # what the auto policy knows when a run starts: "cold" (nothing: a freshly loaded engine, every run), "warm"
    # (what this configuration's own earlier runs taught it: the later replies of a session); None otherwise
    state: str | None = None

    def settings(self, max_tokens: int, seed: int) -> dict:
        s = {"mode": self.mode, "temperature": self.temperature, "max_tokens": max_tokens, "seed": seed}
        if self.mode != "draft-only":  # the target's log-probability of every token: the logp/tok column
            s["logprobs"] = True
        if self.draft_max is not None:
            s.update(draft_max=self.draft_max, drafter=self.drafter or "model", draft_policy=self.policy or "fixed")
        if self.tau is not None:
            s["tau"] = self.tau
        if self.budget is not None:
            s["quality_budget"] = self.budget
        if self.divergence is not None:
            s["divergence"] = self.divergence
        return s


STATES = ("cold", "warm")  # what the auto policy knows when a run starts (Config.state)


def build_configs(
    modes,
    divergences,
    taus,
    draft_maxes,
    temperatures,
    drafters=("model",),
    policies=("auto",),
    budgets=(),
    states=STATES,
) -> list[Config]:
    """Every combination the axes make, without multiplying modes over axes they ignore: ar and sd first at each
    temperature (sd once per drafter, policy and k), each lossy mode at every tau and every quality budget, and the
    auto policy in each of `states` (Config.state)."""
    for m in modes:
        if m not in MODES:
            raise ConfigError(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    for d in divergences:
        if d not in DIVERGENCES:
            raise ConfigError(f"unknown divergence {d!r}; choose from {', '.join(DIVERGENCES)}")
    for st in states:
        if st not in STATES:
            raise ConfigError(f"unknown policy state {st!r}; choose from {', '.join(STATES)}")
    for name, values in (
        ("--taus", taus),
        ("--policy-state", states),
        ("--divergence", divergences),
        ("--draft-max", draft_maxes),
        ("--temp", temperatures),
        ("--modes", modes),
        ("--drafter", drafters),
        ("--draft-policy", policies),
    ):
        if not values and not (name == "--taus" and budgets):
            raise ConfigError(f"{name} is empty")
    configs = []
    for t in _unique(temperatures):
        configs.append(Config("ar", t))
        drafting = [
            (dr, p, k, st)
            for dr in _unique(drafters)
            for p in _unique(policies)
            for k in _unique(draft_maxes)
            for st in (_unique(states) if p == "auto" else (None,))
        ]
        configs += [Config("sd", t, draft_max=k, drafter=dr, policy=p, state=st) for dr, p, k, st in drafting]
        for m in _unique(modes):
            if m in TAU_MODES:
                divs = _unique(divergences) if m in DIVERGENCE_MODES else [None]
                configs += [
                    Config(m, t, d, tau, k, dr, p, state=st)
                    for d in divs
                    for tau in _unique(taus)
                    for dr, p, k, st in drafting
                ]
                configs += [
                    Config(m, t, d, None, k, dr, p, b, st)
                    for d in divs
                    for b in _unique(budgets)
                    for dr, p, k, st in drafting
                ]
            elif m == "draft-only":
                configs.append(Config(m, t))
    for c in configs:  # reject bad values before loading anything
        Settings(**c.settings(1, 0))
    return configs


def _unique(values):
    return list(dict.fromkeys(values))


# ---------------------------------------------------------------------------------------------- running
@dataclass
class Run:
    """One timed generation."""

    repeat: int
    prompt: int
    token_ids: list[int]
    stats: dict
    correct: bool | None


@dataclass
class BenchData:
    configs: list[Config]
    prompts: list[Prompt]
    repeats: int
    runs: list[list[Run]] = field(default_factory=list)  # runs[config index], in (repeat, prompt) order


def prompt_tokens(engine, prompts: list[Prompt], chat: bool) -> list[list[int]]:
    if chat:
        return [engine.chat_prompt([{"role": "user", "content": p.text}]) for p in prompts]
    return [engine.tokenize(p.text) for p in prompts]


def run_bench(
    engine,
    prompts: list[Prompt],
    configs: list[Config],
    *,
    common: dict | None = None,
    max_tokens: int,
    repeats: int,
    seed: int = 0,
    chat: bool = False,
    ignore_eos: bool = False,
    progress=None,
) -> BenchData:
    """Run every configuration on every prompt `repeats` times, interleaved; `progress()` after each run; `common`:
    settings every run shares. A generation's seed depends on (repeat, prompt) only, so configurations share it;
    ignore_eos runs every generation to max_tokens."""
    if repeats < 1:
        raise ConfigError("--repeats must be >= 1")
    tokens = prompt_tokens(engine, prompts, chat)
    _warm_up(engine, tokens[0], configs)
    engine.measure_costs(max((c.draft_max or 0 for c in configs), default=0))  # every size the policy may price
    data = BenchData(configs, prompts, repeats, [[] for _ in configs])
    learned: dict[int, dict] = {}  # what each "warm" configuration's runs taught the policy so far
    for r in range(repeats):
        for pi, (prompt, toks) in enumerate(zip(prompts, tokens)):
            order = np.random.default_rng([seed, r, pi]).permutation(len(configs))
            for ci in order:
                engine.reset()  # every configuration starts from the same (empty) cache
                # and from a freshly loaded engine's policy state, or its own (the machine's costs stay)
                engine.set_policy_state(learned.get(ci))
                settings = {**configs[ci].settings(max_tokens, seed + r * len(prompts) + pi), **(common or {})}
                out = engine.generate(toks, ignore_eos=ignore_eos, **settings)
                if configs[ci].state == "warm":
                    learned[ci] = engine.policy_state()
                data.runs[ci].append(Run(r, pi, out.token_ids, out.stats, prompt.is_correct(out.text)))
                if progress:
                    progress()
    for runs in data.runs:
        runs.sort(key=lambda run: (run.repeat, run.prompt))
    return data


def _warm_up(engine, tokens, configs):
    """One short untimed generation per distinct code path: loads the jitted kernels from numba's cache
    and touches both models, so the first timed run pays for nothing the others do not."""
    seen = set()
    for c in configs:
        key = (c.mode, c.divergence, c.temperature > 0)
        if key not in seen:
            seen.add(key)
            engine.reset()
            engine.generate(tokens, **c.settings(4, 0))


# ---------------------------------------------------------------------------------------------- statistics
def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def spread(values) -> float | None:
    """Half the range: with the few repeats a benchmark affords, the honest summary of dispersion."""
    values = [v for v in values if v is not None]
    return (max(values) - min(values)) / 2 if values else None


def paired_ratio(num: list[float | None], den: list[float | None]) -> float | None:
    """Median over repeats of num[r] / den[r]: both measured in the same repeat, under the same noise."""
    return median([a / b if a is not None and b else None for a, b in zip(num, den)])


def prefix_agreement(out, ref) -> float:
    """Common prefix of out and ref over the longer length; 1.0 iff identical (both empty included)."""
    longest = max(len(out), len(ref))
    if longest == 0:
        return 1.0
    n = 0
    for a, b in zip(out, ref):
        if a != b:
            break
        n += 1
    return n / longest


def positionwise_agreement(out, ref) -> float:
    longest = max(len(out), len(ref))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(out, ref)) / longest


def throughput_by_repeat(runs: list[Run], repeats: int) -> list[float | None]:
    """Output tokens over generation seconds, summed over the prompts of each repeat."""
    toks, secs = [0] * repeats, [0.0] * repeats
    for run in runs:
        toks[run.repeat] += len(run.token_ids)
        secs[run.repeat] += run.stats["seconds_total"]
    return [t / s if s > 0 else None for t, s in zip(toks, secs)]


def _sum(runs, key):
    return sum(run.stats[key] for run in runs)


def _div(a, b):
    return a / b if b else None


def summarise(data: BenchData) -> list[dict]:
    """One row per configuration: the JSON objects of `bench --json`."""
    tps = [throughput_by_repeat(runs, data.repeats) for runs in data.runs]
    index = {c: i for i, c in enumerate(data.configs)}
    curve = verify_curve(data.runs, max((c.draft_max or 0 for c in data.configs), default=0) + 1)
    rows = []
    for ci, (c, runs) in enumerate(zip(data.configs, data.runs)):
        ar = index[Config("ar", c.temperature)]
        sd = (
            index.get(
                Config("sd", c.temperature, draft_max=c.draft_max, drafter=c.drafter, policy=c.policy, state=c.state)
            )
            if c.draft_max
            else None
        )
        drafted = _sum(runs, "drafted")
        accepted = _sum(runs, "accepted_sd") + _sum(runs, "accepted_fuzzy")
        tokens = _sum(runs, "tokens")
        secs = {k: sum(run.stats["seconds"][k] for run in runs) for k in ("draft", "target", "other")}
        total = sum(secs.values())
        row = {
            "mode": c.mode,
            "divergence": c.divergence,
            "tau": c.tau,
            "draft_max": c.draft_max,
            "drafter": c.drafter,
            "draft_policy": c.policy,
            "policy_state": c.state,
            "temperature": c.temperature,
            "tokens_per_second": median(tps[ci]),
            "tokens_per_second_spread": spread(tps[ci]),
            "speedup_vs_ar": paired_ratio(tps[ci], tps[ar]),
            "speedup_vs_sd": paired_ratio(tps[ci], tps[sd]) if sd is not None else None,
            "acceptance_rate": _div(accepted, drafted),
            "mean_tokens_per_round": _div(tokens, _sum(runs, "rounds")),
            "fuzzy_share": (_div(_sum(runs, "accepted_fuzzy"), accepted) or 0.0) if drafted else None,
            "acceptance_by_position": _by_position(runs),
            "target_logprob_mean": (
                _div(sum(run.stats["target_logprob_sum"] for run in runs), tokens) if c.mode != "draft-only" else None
            ),
            **_budget_columns(c, runs, tokens),
            "agreement": None,
            "agreement_positionwise": None,
            "accuracy": None,
            "time_share": {k: _div(v, total) for k, v in secs.items()},
            "k_histogram": _k_histogram(runs),
            **_oracle_fields(oracle(runs, curve) if c.draft_max else None),
            "plain_tokens_per_second_est": median([run.stats.get("plain_tokens_per_second_est") for run in runs]),
            "speedup_vs_plain_est": median([run.stats.get("speedup_vs_plain_est") for run in runs]),
            "prompt_seconds_mean": _sum(runs, "prompt_seconds") / len(runs),
            "output_tokens": sum(len(run.token_ids) for run in runs),
            "runs": len(runs),
        }
        if c.temperature == 0:
            refs = data.runs[ar]  # same (repeat, prompt) order
            row["agreement"] = mean(prefix_agreement(a.token_ids, b.token_ids) for a, b in zip(runs, refs))
            row["agreement_positionwise"] = mean(
                positionwise_agreement(a.token_ids, b.token_ids) for a, b in zip(runs, refs)
            )
        graded = [run.correct for run in runs if run.correct is not None]
        if graded:
            row["accuracy"] = sum(graded) / len(graded)
        rows.append(row)
    return rows


def _budget_columns(c: Config, runs: list[Run], tokens: int) -> dict:
    """The quality budget (None: a fixed tau or none), the loss per token over all replies and the worst reply's,
    the share of tokens the target would not have chosen, tokens per target call, and the budget's threshold.
    (Statistics recorded before the budget existed have no losses: those columns are then null.)"""
    measured = c.mode != "draft-only" and all(run.stats.get("loss_sum") is not None for run in runs)
    per_reply = [run.stats["loss_per_token"] for run in runs if measured and run.stats["tokens"]]
    thresholds = [run.stats["threshold"]["mean"] for run in runs if run.stats.get("threshold")]
    not_chosen = sum(run.stats["not_chosen_share"] * run.stats["tokens"] for run in runs) if measured else None
    return {
        "quality_budget": c.budget,
        "loss_per_token": _div(_sum(runs, "loss_sum"), tokens) if measured else None,
        "loss_worst_reply": max(per_reply) if per_reply else None,
        "not_chosen_share": _div(not_chosen, tokens) if measured else None,
        "tokens_per_target_call": _div(tokens, sum(run.stats.get("target_calls", 0) for run in runs)),
        "threshold_mean": mean(thresholds) if thresholds else None,
    }


def _oracle_fields(o: dict | None) -> dict:
    """The best fixed k with this configuration's acceptance and the bench's costs (bench/oracle.py)."""
    return {
        "oracle_k": o["k"] if o else None,
        "oracle_tokens_per_second": o["tokens_per_second"] if o else None,
        "oracle_tokens_per_second_by_k": o["by_k"] if o else [],
    }


def _k_histogram(runs: list[Run]) -> list[int]:
    """Rounds by the draft length chosen, over all runs (0 = a plain target step)."""
    out: list[int] = []
    for run in runs:
        for k, n in enumerate(run.stats.get("k_histogram", [])):
            if k == len(out):
                out.append(0)
            out[k] += n
    return out


def _by_position(runs: list[Run]) -> list[float]:
    drafted, accepted = position_totals(runs)
    return [a / d if d else 0.0 for a, d in zip(accepted, drafted)]
