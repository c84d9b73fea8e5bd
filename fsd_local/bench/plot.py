"""`bench --plot`: tokens/s and quality against tau and the speed / quality frontier panels, for every temperature
(a grid two panels wide, one legend under it), and with quality budgets a loss-per-token panel. Needs matplotlib."""

from __future__ import annotations

import math

from fsd_local.bench.frontier import QUALITIES, SPEED, mark_frontier
from fsd_local.bench.runner import TAU_MODES
from fsd_local.errors import ConfigError


def require_matplotlib():
    """Fail before a long benchmark, not after it."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib, which is not installed: pip install 'fsd-local[plot]'") from None
    matplotlib.use("Agg")  # files only: never needs a display
    return matplotlib


COLUMNS = 2  # panels side by side: the figure stays readable where a README or a page shows it (about 900 px)
WIDTH_IN, PANEL_HEIGHT_IN, DPI = 9.0, 3.4, 110  # 990 px wide
LEGEND_COLUMNS = 3
PANELS = (
    ("tokens_per_second", "tokens/s"),
    ("target_logprob_mean", "target log-prob / token"),
    ("agreement", "agreement with target greedy"),
)
FRONTIER_PANELS = (
    ("target_logprob_mean", "frontier: tokens/s by target log-prob / token"),
    ("agreement", "frontier: tokens/s by agreement"),
)
MARKERS = "osD^vP*X"


def plot(rows: list[dict], path: str, title: str = "") -> None:
    """Write `figure(rows, title)` as a PNG at DPI."""
    require_matplotlib()
    import matplotlib.pyplot as plt

    fig = figure(rows, title)
    fig.savefig(path, format="png", dpi=DPI)
    plt.close(fig)


def figure(rows: list[dict], title: str = ""):
    """Every temperature's panels in a grid COLUMNS wide (its tau panels, its frontiers, its budgets), one legend
    for the tau panels' lines under them all."""
    require_matplotlib()
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in rows})
    if any("on_frontier" not in r for r in rows):
        rows = mark_frontier([dict(r) for r in rows])
    budgets = any(r.get("quality_budget") is not None for r in rows)
    per_temp = math.ceil((len(PANELS) + len(FRONTIER_PANELS) + budgets) / COLUMNS)
    fig, axes = plt.subplots(
        per_temp * len(temps), COLUMNS, figsize=(WIDTH_IN, PANEL_HEIGHT_IN * per_temp * len(temps)), squeeze=False
    )
    ks = sorted({r["draft_max"] for r in rows if r["draft_max"] is not None})
    colour = {k: f"C{i}" for i, k in enumerate(ks)}
    styles: dict[tuple[str, str], str] = {}  # (mode, divergence) -> marker, the same in every panel
    for ti, temp in enumerate(temps):
        at = [r for r in rows if r["temperature"] == temp]
        cells = list(axes[ti * per_temp : (ti + 1) * per_temp].ravel())
        for key, label in PANELS:
            _tau_panel(cells.pop(0), at, key, f"{label}, temperature {temp:g}", temp, colour, styles)
        for key, label in FRONTIER_PANELS:
            _frontier_panel(cells.pop(0), at, key, f"{label}, temperature {temp:g}")
        if budgets:
            _budget_panel(cells.pop(0), at, f"tokens/s by loss per token (budgets), temperature {temp:g}")
        for ax in cells:
            ax.axis("off")
    # one legend under the panels, where it hides no data; the first panel holds every line
    handles, labels = axes[0][0].get_legend_handles_labels()
    height = fig.get_size_inches()[1]
    legend_rows = math.ceil(len(labels) / LEGEND_COLUMNS)
    fig.legend(handles, labels, loc="lower center", ncol=LEGEND_COLUMNS, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, (0.18 * legend_rows + 0.15) / height, 1, 1))
    return fig


def _tau_panel(ax, rows: list[dict], key: str, title: str, temp: float, colour: dict, styles: dict) -> None:
    """`key` against tau: one line per (mode, divergence, draft length), the baselines as horizontal lines."""
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("tau")
    if key == "agreement" and temp > 0:
        _not_defined(ax, "not defined at temperature > 0\n(outputs are samples)")
        return
    curves: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    for r in rows:
        if r["mode"] in TAU_MODES and r[key] is not None and r["tau"] is not None:
            curves.setdefault((r["mode"], r["divergence"], r["draft_max"]), []).append((r["tau"], r[key]))
    for (mode, div, k), pts in sorted(curves.items()):
        pts.sort()
        m = styles.setdefault((mode, div), MARKERS[len(styles) % len(MARKERS)])
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        ax.plot(
            xs, ys, marker=m, color=colour[k], linestyle="-" if mode == "fsd" else "-.", label=f"{mode} {div} k={k}"
        )
    for r in rows:
        if r[key] is None:
            continue
        if r["mode"] == "ar":
            ax.axhline(r[key], color="black", linestyle="--", linewidth=1, label="ar (target alone)")
        elif r["mode"] == "sd":
            ax.axhline(
                r[key], color=colour[r["draft_max"]], linestyle=":", linewidth=1.2, label=f"sd k={r['draft_max']}"
            )
        elif r["mode"] == "draft-only":
            ax.axhline(r[key], color="grey", linestyle="-.", linewidth=1, label="draft alone")
    ax.grid(alpha=0.3)


def _not_defined(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=9, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


def _frontier_panel(ax, rows: list[dict], quality: str, title: str) -> None:
    ax.set_title(title, fontsize=9)
    pts = [r for r in rows if r[quality] is not None and r[SPEED] is not None]
    if not pts:
        _not_defined(ax, "not defined here")
        return
    flag = dict((q, f) for f, q in QUALITIES)[quality]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    for i, mode in enumerate(modes):
        mine = [r for r in pts if r["mode"] == mode]
        if mine:
            ax.scatter([r[quality] for r in mine], [r[SPEED] for r in mine], s=14, color=f"C{i}", label=mode)
    front = sorted((r for r in pts if r.get(flag)), key=lambda r: r[quality])
    ax.plot([r[quality] for r in front], [r[SPEED] for r in front], color="black", linewidth=1, marker="o", mfc="none")
    for r in front:
        tau = "" if r["tau"] is None else f" {r['tau']:g}"
        ax.annotate(f"{r['mode']}{tau}", (r[quality], r[SPEED]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel(quality.replace("_", " "))
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(alpha=0.3)


def _budget_panel(ax, rows: list[dict], title: str) -> None:
    """Budgeted runs beside fixed-tau runs of the same mode, on (loss per token, tokens/s)."""
    ax.set_title(title, fontsize=9)
    modes = list(dict.fromkeys(r["mode"] for r in rows if r["mode"] in TAU_MODES))
    for i, mode in enumerate(modes):
        fixed = sorted((r for r in rows if r["mode"] == mode and r["tau"] is not None), key=lambda r: r["tau"])
        budgeted = sorted(
            (r for r in rows if r["mode"] == mode and r.get("quality_budget") is not None),
            key=lambda r: r["quality_budget"],
        )
        for group, style, marker, label in ((fixed, "-", "o", "tau"), (budgeted, "--", "s", "budget")):
            pts = [r for r in group if r.get("loss_per_token") is not None and r[SPEED] is not None]
            if pts:
                xs, ys = [r["loss_per_token"] for r in pts], [r[SPEED] for r in pts]
                ax.plot(xs, ys, linestyle=style, marker=marker, color=f"C{i}", label=f"{mode} {label}")
        for r in budgeted:
            if r.get("loss_per_token") is None or r[SPEED] is None:
                continue
            at = (r["loss_per_token"], r[SPEED])
            ax.annotate(f"B {r['quality_budget']:g}", at, fontsize=6, xytext=(3, -8), textcoords="offset points")
            worst = r.get("loss_worst_reply")
            if worst is not None:
                ax.plot([r["loss_per_token"], worst], [r[SPEED]] * 2, color=f"C{i}", linewidth=0.6, alpha=0.6)
    for r in rows:
        if r["mode"] in ("ar", "sd") and r[SPEED] is not None:
            ax.scatter([0.0], [r[SPEED]], s=18, color="black", marker="x" if r["mode"] == "ar" else "+")
            ax.annotate(r["mode"], (0.0, r[SPEED]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("loss per token (nats of target log-prob given up)")
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
