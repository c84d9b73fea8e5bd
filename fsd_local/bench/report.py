"""What `fsd-local bench` prints of runner.py's rows: the table, JSON and CSV."""

from __future__ import annotations

import csv
import io
import json


def _f(v, fmt):
    return "-" if v is None else format(v, fmt)


TABLE_COLUMNS = (
    # header, width, cell
    ("temp", 4, lambda r: f"{r['temperature']:g}"),
    ("mode", 9, lambda r: r["mode"]),
    ("div", 8, lambda r: r["divergence"] or "-"),
    ("drafter", 11, lambda r: r["drafter"] or "-"),
    ("policy", 8, lambda r: r["draft_policy"] or "-"),
    ("state", 5, lambda r: r["policy_state"] or "-"),
    ("k", 2, lambda r: _f(r["draft_max"], "d")),
    ("tau", 5, lambda r: _f(r["tau"], "g")),
    ("B", 5, lambda r: _f(r["quality_budget"], "g")),
    ("tok/s", 13, lambda r: f"{_f(r['tokens_per_second'], '.1f')} ±{_f(r['tokens_per_second_spread'], '.1f')}"),
    ("x ar", 5, lambda r: _f(r["speedup_vs_ar"], ".2f")),
    ("x sd", 5, lambda r: _f(r["speedup_vs_sd"], ".2f")),
    ("accept", 6, lambda r: _f(r["acceptance_rate"], ".0%")),
    ("tok/rnd", 7, lambda r: _f(r["mean_tokens_per_round"], ".2f")),
    ("fuzzy", 5, lambda r: _f(r["fuzzy_share"], ".0%")),
    ("logp/tok", 8, lambda r: _f(r["target_logprob_mean"], ".3f")),
    ("loss/tok", 8, lambda r: _f(r["loss_per_token"], ".4f")),
    ("worst", 6, lambda r: _f(r["loss_worst_reply"], ".4f")),
    ("tok/call", 8, lambda r: _f(r["tokens_per_target_call"], ".3f")),
    ("thr", 5, lambda r: _f(r["threshold_mean"], ".3f")),
    ("agree", 5, lambda r: _f(r["agreement"], ".2f")),
    ("task", 4, lambda r: _f(r["accuracy"], ".0%")),
    ("draft/target/other", 18, lambda r: "/".join(_f(r["time_share"][k], ".0%") for k in ("draft", "target", "other"))),
    ("front", 5, lambda r: _front(r)),
    (
        "oracle k: tok/s",
        15,
        lambda r: f"{r['oracle_k']}: {r['oracle_tokens_per_second']:.1f}" if r["oracle_k"] is not None else "-",
    ),
    ("k histogram (0..)", 24, lambda r: " ".join(map(str, r["k_histogram"])) if r["draft_policy"] == "auto" else "-"),
    ("accept by position", 0, lambda r: " ".join(f"{a:.0%}" for a in r["acceptance_by_position"])),
)


def _front(r) -> str:
    """* on the speed / log-prob frontier, a on the speed / agreement frontier, l on the speed / loss frontier
    (bench/frontier.py)."""
    marks = ("*" if r.get("on_frontier") else "") + ("a" if r.get("on_frontier_agreement") else "")
    return marks + ("l" if r.get("on_frontier_loss") else "") or "-"


def format_table(rows: list[dict]) -> str:
    has_answers = any(r["accuracy"] is not None for r in rows)
    cols = [c for c in TABLE_COLUMNS if has_answers or c[0] != "task"]
    lines = ["  ".join(h.rjust(w) for h, w, _ in cols)]
    prev_temp = None
    for r in rows:
        if prev_temp is not None and r["temperature"] != prev_temp:
            lines.append("")
        prev_temp = r["temperature"]
        lines.append("  ".join(cell(r).rjust(w) for _, w, cell in cols))
    return "\n".join(line.rstrip() for line in lines)


def to_json(rows: list[dict]) -> str:
    return json.dumps(rows, indent=1)


def to_csv(rows: list[dict]) -> str:
    """Flat columns: time_share becomes time_share_draft/..., lists become space-separated values."""
    flat = []
    for r in rows:
        f = {}
        for k, v in r.items():
            if isinstance(v, dict):
                f.update({f"{k}_{sub}": x for sub, x in v.items()})
            elif isinstance(v, list):
                f[k] = " ".join(f"{x:.4f}" for x in v)
            else:
                f[k] = "" if v is None else v
        flat.append(f)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(flat[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(flat)
    return buf.getvalue()
