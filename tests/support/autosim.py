"""Drive the `auto` policy (drafting/length.py) like the engine does, on recorded or generated acceptance traces
and per-batch costs, without models: what it chooses and the tokens per second it would reach, side by side with
every fixed k on the same trace.

A trace is one reply's per-position outcomes: trace[i] says whether the rule accepts the draft model's proposal
at text position i (given the text before it). A round of k drafts starting at position i accepts the leading
run of trace[i:i + k] and emits one token more; a plain step emits position i. As in the engine, the draft model
falls behind during plain steps, the target's rows of the last ROWS_KEPT plain steps are kept, and catching up
(before drafting, or as a probe the policy asks for) scores the kept positions: their outcomes feed the policy
as teacher-forced evidence (`DraftLength.observe_stream`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from fsd_local.drafting.calibration import CATCH_UP_BATCH
from fsd_local.drafting.length import PENDING_MAX, CostTable, DraftLength
from fsd_local.drafting.proposer import MODEL, ROWS_KEPT
from fsd_local.settings import Settings

Costs = CostTable  # seconds of a target batch of n (verify[n]), per drafted token, per caught-up token


def interpolated(points: dict[int, float], n_max: int = 17) -> list[float]:
    """A per-batch cost curve (index n) through measured sizes, linear between them."""
    known = sorted(points)
    out = [0.0] * (n_max + 1)
    for n in range(1, n_max + 1):
        lo = max((k for k in known if k <= n), default=known[0])
        hi = min((k for k in known if k >= n), default=known[-1])
        out[n] = points[lo] if hi == lo else points[lo] + (n - lo) / (hi - lo) * (points[hi] - points[lo])
    return out


@dataclass
class Result:
    tokens: int = 0
    seconds: float = 0.0
    ks: list[int] = field(default_factory=list)
    probed: int = 0  # positions scored by catch-ups

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def trace(a: float, n: int, seed: int, repeat: float = 0.3) -> list[bool]:
    """Outcomes accepted with chance a; with chance `repeat` a position repeats the one before (easy and hard
    stretches, as real text has)."""
    rng = random.Random(seed)
    out: list[bool] = []
    for _ in range(n):
        out.append(out[-1] if out and rng.random() < repeat else rng.random() < a)
    return out


# the rule a run drafts under, unless told: sd's (fsd at tau 0); a lossy rule starts from a higher acceptance prior
SD = Settings(draft_policy="auto")
FSD = Settings(draft_policy="auto", mode="fsd", tau=0.2)


def measured(costs: Costs, k_max: int = 16, rule: Settings = SD) -> DraftLength:
    """A fresh engine's policy after Engine.measure_costs (every batch size, the draft's token and a catch-up)."""
    dl = DraftLength()
    dl.start(rule.with_(draft_max=k_max))
    for n in range(1, k_max + 2):
        dl.verify.observe(n, costs.v(n))
    dl.cost(MODEL).observe_draft(1, costs.draft)
    dl.observe_catch_up(CATCH_UP_BATCH, CATCH_UP_BATCH * costs.catch_up)
    return dl


def run_auto(
    outcomes,
    costs: Costs,
    n_tokens: int,
    k_max: int = 16,
    lengths: DraftLength | None = None,
    prompt=0,
    rule: Settings = SD,
):
    """One reply of n_tokens on `outcomes` (at least n_tokens + k_max long) under `rule`, the policy `lengths`
    (default: a freshly measured one) carried in. The draft model evaluates the prompt's `prompt` tokens in one
    batch where the policy asks for it (a catch-up the policy sees), or starts behind by them."""
    dl = lengths or measured(costs, k_max, rule)
    dl.start(rule.with_(draft_max=k_max))
    res, behind, kept = Result(), 1, []
    if prompt > 1 and dl.follows_prompt(MODEL):
        dl.observe_catch_up(prompt, prompt * costs.catch_up)
    elif prompt > 1:  # the draft skipped the prompt: a round that drafts, or a probe, catches up on it first
        behind = prompt + 1

    def catch_up() -> None:
        nonlocal behind
        t = costs.catch_up * behind
        res.seconds += t
        dl.observe_catch_up(behind, t)
        scored = [p for p in kept if p > res.tokens - behind]
        dl.observe_stream(MODEL, [outcomes[p] for p in scored])
        res.probed += len(scored)
        behind = 0

    while res.tokens < n_tokens:
        limit = n_tokens - res.tokens - 1
        if behind > PENDING_MAX and dl.probe(
            MODEL, behind, len([p for p in kept if p > res.tokens - behind]), limit + 1
        ):
            catch_up()
        k = dl.choose(MODEL, limit, behind=behind)
        res.ks.append(k)
        if k:
            if behind > PENDING_MAX:
                catch_up()
            acc = 0
            while acc < k and outcomes[res.tokens + acc]:
                acc += 1
            dl.observe(MODEL, k, acc, k * costs.draft, k + 1, costs.v(k + 1))
            res.seconds += k * costs.draft + costs.v(k + 1)
            res.tokens += acc + 1
            behind = 1 if acc < k else 2  # the draft evaluated d_1..d_{k-1}; the replacement, or d_k and the bonus
        else:
            dl.observe(None, 0, 0, 0.0, 1, costs.v(1))
            res.seconds += costs.v(1)
            kept = [*kept[-(ROWS_KEPT - 1) :], res.tokens]
            res.tokens += 1
            behind += 1
    return res, dl


def run_fixed(outcomes, costs: Costs, n_tokens: int, k: int) -> Result:
    res = Result()
    while res.tokens < n_tokens:
        kk = min(k, n_tokens - res.tokens - 1)
        acc = 0
        while acc < kk and outcomes[res.tokens + acc]:
            acc += 1
        res.seconds += kk * costs.draft + costs.v(kk + 1)
        res.tokens += acc + 1
        res.ks.append(kk)
    return res


def session(
    traces, costs: Costs, n_tokens: int, k_max: int = 16, stored: bool = True, prompt: int = 0, rule: Settings = SD
) -> tuple[list[Result], dict[int, list[Result]]]:
    """One fresh engine replying to each trace in turn with auto, and every fixed k 0..k_max (0 = ar) on the
    same traces: (auto's replies, {k: fixed k's replies}). stored: the engine starts with every cost measured
    (bench's measure_costs, or a store that holds them all); else with none (an empty store: a new install)."""
    lengths = measured(costs, k_max, rule) if stored else DraftLength()
    auto = []
    for t in traces:
        res, lengths = run_auto(t, costs, n_tokens, k_max, lengths, prompt, rule)
        auto.append(res)
    return auto, {k: [run_fixed(t, costs, n_tokens, k) for t in traces] for k in range(k_max + 1)}


def rate(results: list[Result]) -> float:
    return sum(r.tokens for r in results) / sum(r.seconds for r in results)


def orders(traces, costs: Costs, rule: Settings, n: int = 20, seed: int = 7, n_tokens: int = 64):
    """Sessions from an EMPTY store over `n` random orders of 6 of `traces` (a 40-token prompt each): per order,
    (auto / best fixed k over the session, auto's first reply / that k's first reply)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        auto, fixed = session(rng.sample(traces, 6), costs, n_tokens, stored=False, prompt=40, rule=rule)
        best = max(fixed, key=lambda k: rate(fixed[k]))
        out.append((rate(auto) / rate(fixed[best]), auto[0].rate / fixed[best][0].rate))
    return out


if __name__ == "__main__":  # cd tests && python -m support.autosim [orders]: the table in auto-cold.md
    import sys

    import test_auto_policy as t

    n_orders = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    near = {f"WIDE_17, plain {ms} ms": t.near(ms) for ms in (52, 58, 62)}
    tables = {"WIDE_17": t.WIDE_17, "WIDE_AMD": t.WIDE_AMD, "WIDE (Intel)": t.WIDE, **near}
    for rule_name, rule in (("fsd js 0.2", FSD), ("sd", SD)):
        everything = []
        for name, costs in tables.items():
            res = orders([x for x in t.recorded(rule_name.split()[0]) if len(x) >= 84], costs, rule, n_orders)
            everything += res
            s, f = [r[0] for r in res], [r[1] for r in res]
            line = f"session {sum(s) / len(s):.3f} (worst {min(s):.3f})  first {sum(f) / len(f):.3f}"
            print(f"{rule_name:10s} {name:22s} {line}")
        s = [r[0] for r in everything]
        print(f"{rule_name:10s} {'all':22s} session {sum(s) / len(s):.3f} (worst {min(s):.3f})")
