"""Table, ratio and plot logic for the OEA A/B serving harness (serving/ab_serving.py, serving/demo.py).

Kept apart from the server-driving code so that it can be tested on recorded JSONL with no server,
and so that a report can be rebuilt from an existing JSONL (`ab_serving.py --from-jsonl FILE`).

A record is one bench_serving run: {"arm", "k0", "concurrency", "repeat", "seed", "num_prompts",
"input_len", "output_len", "prompts" (the prompt source: "random-ids", or the prompt file's name and
hash), ...bench_serving metrics}. The arm named "baseline" is the reference.

Pairing rule: the OEA/baseline throughput ratio at concurrency C is computed per repeat, pairing
repeat r of the OEA arm with repeat r of the baseline at the same C; we report its median and its
min-max. Runs that cannot be paired (no baseline at that C, a repeat missing on one side, or a
workload that differs between the two runs) are not compared: they are listed as warnings.

Kept router mass per (concurrency, arm) is read from the runs' counter deltas (`oea_metrics_delta`,
common/oea_metrics.kept_mass_in_runs); the table shows its column only when some run has them.
"""

import json
import math
import statistics
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from common.oea_metrics import KEPT_MASS_NOTE, kept_mass_in_runs

BASELINE = "baseline"

# (column title, record key) for the metrics summarised per (concurrency, arm).
METRICS: Tuple[Tuple[str, str], ...] = (
    ("out tok/s", "output_throughput"),
    ("median TPOT ms", "median_tpot_ms"),
    ("median ITL ms", "median_itl_ms"),
    ("p99 TTFT ms", "p99_ttft_ms"),
)

# A paired ratio is resolved when it has at least RESOLVED_MIN_REPEATS per-repeat ratios and their
# min and max both lie within RESOLVED_WITHIN of their median (e.g. 1.12 (1.08-1.16) at 5%).
RESOLVED_WITHIN = 0.05
RESOLVED_MIN_REPEATS = 3

# Keys that must agree between two runs for their throughputs to be compared.
WORKLOAD_KEYS: Tuple[str, ...] = ("num_prompts", "input_len", "output_len", "seed", "prompts")


def arm_name(k0: Optional[int]) -> str:
    """Label of an arm: "baseline" for OEA off, "oea-k0=K" otherwise."""
    return BASELINE if k0 is None else f"oea-k0={k0}"


def load_jsonl(path: str) -> List[dict]:
    """Records of a JSONL file; blank lines are skipped."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: str, records: Iterable[dict]) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r, sort_keys=True) + "\n")


@dataclass
class Spread:
    """Median and range of a list of values (repeats)."""

    median: float
    lo: float
    hi: float
    n: int

    @staticmethod
    def of(values: Sequence[float]) -> Optional["Spread"]:
        vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
        if not vals:
            return None
        return Spread(statistics.median(vals), min(vals), max(vals), len(vals))


@dataclass
class Summary:
    """Everything the table and the plot show, plus the pairing problems found."""

    arms: List[str]  # baseline first, then OEA arms by k0
    concurrencies: List[int]
    # (concurrency, arm) -> metric key -> Spread over repeats
    stats: Dict[Tuple[int, str], Dict[str, Spread]]
    # (concurrency, OEA arm) -> Spread of per-repeat throughput ratios OEA/baseline
    ratios: Dict[Tuple[int, str], Spread]
    warnings: List[str] = field(default_factory=list)
    # (concurrency, arm) -> mean kept router mass pooled over its runs (only where counted)
    kept_mass: Dict[Tuple[int, str], float] = field(default_factory=dict)


def _arm_sort_key(arm: str, k0_of: Dict[str, Optional[int]]):
    k0 = k0_of.get(arm)
    return (arm != BASELINE, k0 if k0 is not None else math.inf, arm)


def summarize(records: Sequence[dict]) -> Summary:
    """Medians over repeats per (concurrency, arm) and paired throughput ratios."""
    k0_of: Dict[str, Optional[int]] = {}
    runs: Dict[Tuple[int, str], Dict[int, dict]] = {}
    warnings: List[str] = []
    for r in records:
        arm, conc, rep = r["arm"], int(r["concurrency"]), int(r.get("repeat", 0))
        k0_of.setdefault(arm, r.get("k0"))
        if r.get("error"):
            warnings.append(f"{arm} C={conc} repeat {rep}: run failed ({r['error']})")
            continue
        cell = runs.setdefault((conc, arm), {})
        if rep in cell:
            warnings.append(f"{arm} C={conc}: repeat {rep} recorded twice; the later run is used")
        cell[rep] = r
        reported = r.get("max_concurrency")
        if reported is not None and int(reported) != conc:
            warnings.append(f"{arm} C={conc} repeat {rep}: bench_serving reports max_concurrency={reported}")
        if r.get("completed") is not None and r.get("num_prompts") is not None and r["completed"] < r["num_prompts"]:
            warnings.append(f"{arm} C={conc} repeat {rep}: only {r['completed']} of {r['num_prompts']} requests completed")

    arms = sorted({a for _, a in runs}, key=lambda a: _arm_sort_key(a, k0_of))
    concurrencies = sorted({c for c, _ in runs})
    stats = {
        key: {m: s for _, m in METRICS if (s := Spread.of([run.get(m) for run in cell.values()])) is not None}
        for key, cell in runs.items()
    }

    ratios: Dict[Tuple[int, str], Spread] = {}
    for conc in concurrencies:
        base = runs.get((conc, BASELINE))
        for arm in arms:
            if arm == BASELINE or (conc, arm) not in runs:
                continue
            if base is None:
                warnings.append(f"{arm} C={conc}: no baseline run at this concurrency; not compared")
                continue
            oea = runs[(conc, arm)]
            per_repeat = []
            for rep in sorted(set(oea) | set(base)):
                if rep not in oea or rep not in base:
                    side = arm if rep not in oea else BASELINE
                    warnings.append(f"{arm} C={conc}: repeat {rep} missing from {side}; that repeat is not compared")
                    continue
                diff = [k for k in WORKLOAD_KEYS if oea[rep].get(k) != base[rep].get(k)]
                if diff:
                    detail = ", ".join(f"{k} {base[rep].get(k)} vs {oea[rep].get(k)}" for k in diff)
                    warnings.append(f"{arm} C={conc} repeat {rep}: workload differs from baseline ({detail}); not compared")
                    continue
                b, o = base[rep].get("output_throughput"), oea[rep].get("output_throughput")
                if not b or o is None:
                    warnings.append(f"{arm} C={conc} repeat {rep}: missing or zero throughput; not compared")
                    continue
                per_repeat.append(o / b)
            spread = Spread.of(per_repeat)
            if spread is not None:
                ratios[(conc, arm)] = spread
    for arm in arms:
        if arm == BASELINE:
            continue
        for conc in concurrencies:
            if (conc, BASELINE) in runs and (conc, arm) not in runs:
                warnings.append(f"{arm} C={conc}: baseline has runs at this concurrency, {arm} has none")
    kept = {key: m for key, cell in runs.items() if (m := kept_mass_in_runs(list(cell.values()))) is not None}
    return Summary(arms, concurrencies, stats, ratios, warnings, kept)


def resolved(ratio: Spread, within: float = RESOLVED_WITHIN, min_repeats: int = RESOLVED_MIN_REPEATS) -> bool:
    """Whether a paired ratio is resolved: n >= min_repeats and max(median - lo, hi - median) <=
    within * median (the spread of the per-repeat ratios is small next to their median)."""
    return ratio.n >= min_repeats and max(ratio.median - ratio.lo, ratio.hi - ratio.median) <= within * ratio.median


def spread_text(ratio: Spread) -> str:
    """'lo-hi, n repeats, +-X%' of a ratio: its min-max, and the larger side as a share of the median."""
    half = max(ratio.median - ratio.lo, ratio.hi - ratio.median) / ratio.median
    return f"{ratio.lo:.2f}-{ratio.hi:.2f}, {ratio.n} repeat{'s' if ratio.n != 1 else ''}, ±{100 * half:.0f}%"


def unresolved_note(summary: "Summary", within: float = RESOLVED_WITHIN) -> str:
    """One line naming the ratios that are not resolved (see resolved), or '' when all are."""
    cells = [f"{arm} at C={conc} ({spread_text(r)})" for (conc, arm), r in sorted(summary.ratios.items())
             if not resolved(r, within)]
    if not cells:
        return ""
    return (f"Not resolved (fewer than {RESOLVED_MIN_REPEATS} repeats, or min-max beyond ±{100 * within:.0f}% "
            f"of the median): " + "; ".join(cells) + ".")


def _fmt(x: float) -> str:
    if abs(x) >= 100:
        return f"{x:.1f}"
    if abs(x) >= 10:
        return f"{x:.2f}"
    return f"{x:.3f}"


def _cell(s: Optional[Spread], spread: bool = False) -> str:
    if s is None:
        return "-"
    if spread and s.n > 1:
        return f"{_fmt(s.median)} ({_fmt(s.lo)}-{_fmt(s.hi)})"
    return _fmt(s.median)


def kept_text(kept: Optional[float]) -> str:
    """A kept router mass for a table: '0.873', or '-' when not counted."""
    return "-" if kept is None else f"{kept:.3f}"


def markdown_table(summary: Summary, title: Optional[str] = None) -> str:
    """One row per (concurrency, arm): medians over repeats, throughput with its min-max, ratio."""
    lines = []
    if title:
        lines += [f"## {title}", ""]
    lines.append(
        "Medians over repeats; throughput and ratio show (min-max). Ratio = OEA / baseline output "
        "throughput, paired by repeat."
    )
    lines.append("")
    header = ["C", "arm", "n"] + [t for t, _ in METRICS] + ["ratio vs baseline"]
    header += ["kept router mass"] if summary.kept_mass else []
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(["---"] * len(header)) + "|")
    for conc in summary.concurrencies:
        for arm in summary.arms:
            st = summary.stats.get((conc, arm))
            if st is None:
                continue
            n = max((s.n for s in st.values()), default=0)
            cells = [str(conc), arm, str(n)]
            for _, key in METRICS:
                cells.append(_cell(st.get(key), spread=(key == "output_throughput")))
            if arm == BASELINE:
                cells.append("1 (ref)")
            elif (conc, arm) in summary.ratios:
                cells.append(_cell(summary.ratios[(conc, arm)], spread=True))
            else:
                cells.append("not compared")
            if summary.kept_mass:
                cells.append(kept_text(summary.kept_mass.get((conc, arm))))
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", KEPT_MASS_NOTE + "."] if summary.kept_mass else []
    note = unresolved_note(summary)
    if note:
        lines += ["", note]
    if summary.warnings:
        lines += ["", "**Warnings** (runs listed here were not compared):", ""]
        lines += [f"- {w}" for w in summary.warnings]
    return "\n".join(lines) + "\n"


def side_by_side_table(summary: Summary, resolve_within: Optional[float] = None) -> str:
    """One row per concurrency, the arms side by side: output tok/s (OEA arms: with the median
    paired ratio vs baseline), then median TPOT ms. Medians over repeats; no min-max (see
    markdown_table for the spreads and the warnings). With resolve_within, a ratio that is not
    resolved within that share (see resolved) shows as "not resolved" with its spread instead."""
    arms = summary.arms
    header = ["C"] + [f"{a} tok/s" for a in arms] + [f"{a} TPOT ms" for a in arms]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    for conc in summary.concurrencies:
        tput, tpot = [], []
        for arm in arms:
            st = summary.stats.get((conc, arm), {})
            cell = _cell(st.get("output_throughput"))
            if arm != BASELINE and "output_throughput" in st:
                ratio = summary.ratios.get((conc, arm))
                cell += f" ({ratio_text(ratio, resolve_within)})" if ratio is not None else " (not compared)"
            tput.append(cell)
            tpot.append(_cell(st.get("median_tpot_ms")))
        lines.append("| " + " | ".join([str(conc)] + tput + tpot) + " |")
    return "\n".join(lines) + "\n"


def ratio_text(ratio: Spread, resolve_within: Optional[float] = None) -> str:
    """'1.12x', or with resolve_within and a ratio not resolved: 'not resolved: 0.95-1.18, 3 repeats, +-12%'."""
    if resolve_within is None or resolved(ratio, resolve_within):
        return f"{ratio.median:.2f}x"
    return f"not resolved: {spread_text(ratio)}"


def plot(summary: Summary, path: str, title: Optional[str] = None) -> str:
    """PNG: output throughput, median TPOT and the OEA/baseline ratio against concurrency (log2 x).

    Points are medians over repeats; bars span min-max.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    color = {arm: cycle[i % len(cycle)] for i, arm in enumerate(summary.arms)}
    panels = (("output_throughput", "output tok/s"), ("median_tpot_ms", "median TPOT (ms)"))
    for ax, (key, label) in zip(axes[:2], panels):
        for arm in summary.arms:
            pts = [(c, summary.stats[(c, arm)][key]) for c in summary.concurrencies
                   if key in summary.stats.get((c, arm), {})]
            if not pts:
                continue
            xs = [c for c, _ in pts]
            ys = [s.median for _, s in pts]
            err = [[s.median - s.lo for _, s in pts], [s.hi - s.median for _, s in pts]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=arm, color=color[arm])
        ax.set_ylabel(label)
    ax = axes[2]
    for arm in summary.arms:
        pts = [(c, summary.ratios[(c, arm)]) for c in summary.concurrencies if (c, arm) in summary.ratios]
        if not pts:
            continue
        ys = [s.median for _, s in pts]
        err = [[s.median - s.lo for _, s in pts], [s.hi - s.median for _, s in pts]]
        ax.errorbar([c for c, _ in pts], ys, yerr=err, marker="o", capsize=3, label=arm, color=color[arm])
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_ylabel("throughput ratio OEA / baseline")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(summary.concurrencies, [str(c) for c in summary.concurrencies])
        ax.set_xlabel("max concurrency")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
