"""moe_premise.py's fit, verdicts and report: markdown, JSON and a plot of MoE time against T.

Per batch size (rows), a least-squares line time = fixed + per_expert * T over the synthetic points
(ids that touch exactly T experts). The predicted MoE-layer ratio of OEA at k0 is
line(mean T of OEA's routing) / line(mean T of plain top-k), both on the same uniform random scores;
the measured ratio times those routings themselves (median over draws, paired by draw).

A verdict per judged row count (--rows; the default sweep when absent), with its thresholds:
    pass        the slope's one-sided 95% lower bound is > 0 us per expert AND the predicted ratio
                at the headline k0 (5, else the largest swept) is <= 0.95 (a saving of at least 5%);
    fail        otherwise;
    not judged  fewer than 3 values of T or no OEA routing timed at that row count (--budget-s).
Caveats are added when R^2 < 0.9 (time is not linear in T: read the measured ratios) and when the
measured ratio differs from the predicted one by more than 0.1; they do not change the verdict.

The overall line and the exit code:
    0  GO: at least one judged row count passes; the line names them and the largest, a value
       for --oea-max-batch (OEA is skipped above it);
    3  NO-GO: every judged row count that could be judged fails;
    4  DRY RUN: the CPU stand-in ran and judged at least one row count; never a GPU verdict;
    2  no row count could be judged (moe_premise.py also exits 2 on bad arguments and errors).
"""

import json
import math
import statistics
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

MIN_SAVING = 0.05  # predicted ratio <= 1 - MIN_SAVING at the headline k0
SLOPE_CONFIDENCE = 0.95  # one-sided, on the slope's lower bound
MIN_R2 = 0.9  # below it the verdict carries a linearity caveat
MAX_GAP = 0.10  # |measured - predicted| above it: a caveat
HEADLINE_K0 = 5
SYNTHETIC, TOPK, OEA = "synthetic", "top-k", "oea"
PASS, FAIL, NOT_JUDGED = "pass", "fail", "not judged"
EXIT_GO, EXIT_ERROR, EXIT_NO_GO, EXIT_DRY_RUN = 0, 2, 3, 4  # 1 stays Python's own for a crash


@dataclass
class Point:
    """One timed batch: `rows` rows touching T distinct experts."""

    rows: int
    kind: str  # SYNTHETIC, TOPK or OEA
    k0: Optional[int]
    draw: int
    T: int
    median_us: float
    p20_us: float
    p80_us: float
    mode: str  # "graph" (CUDA-graph replay), "eager" (capture failed) or "cpu" (dry run)


@dataclass
class Fit:
    """time = intercept + slope * T over one batch size's synthetic points."""

    rows: int
    n: int
    slope: float  # us per extra expert
    intercept: float  # us, the fixed part
    r2: float
    slope_low: float  # one-sided 95% lower bound of the slope (nan for n < 3)

    def at(self, T: float) -> float:
        return self.intercept + self.slope * T


@dataclass
class Prediction:
    rows: int
    k0: int
    topk_T: float
    oea_T: float
    predicted: float  # line(oea_T) / line(topk_T)
    measured: float  # median of the per-draw ratios
    measured_lo: float
    measured_hi: float


@dataclass
class RowVerdict:
    """The verdict at one judged row count."""

    rows: int
    status: str  # PASS, FAIL or NOT_JUDGED
    line: str
    caveats: List[str]
    k0: Optional[int] = None  # the headline k0 judged
    predicted: Optional[float] = None  # its predicted MoE-layer ratio


@dataclass
class Judgement:
    """All judged row counts together: what the command prints last and exits with."""

    per_rows: List[RowVerdict]
    passing: List[int]  # the judged row counts that pass, ascending
    go: Optional[bool]  # None on a dry run and when nothing could be judged
    line: str
    exit_code: int


def fit_line(rows: int, points: Sequence[Point]) -> Fit:
    """Least squares of median_us on T (scipy.stats.linregress), with the slope's lower bound."""
    from scipy import stats

    xs, ys = [p.T for p in points], [p.median_us for p in points]
    if len(set(xs)) < 2:
        return Fit(rows, len(xs), math.nan, statistics.fmean(ys) if ys else math.nan, math.nan, math.nan)
    got = stats.linregress(xs, ys)
    low = got.slope - stats.t.ppf(SLOPE_CONFIDENCE, len(xs) - 2) * got.stderr if len(xs) > 2 else math.nan
    return Fit(rows, len(xs), float(got.slope), float(got.intercept), float(got.rvalue ** 2), float(low))


def fit_all(points: Sequence[Point]) -> Dict[int, Fit]:
    rows = sorted({p.rows for p in points})
    return {r: fit_line(r, [p for p in points if p.rows == r and p.kind == SYNTHETIC]) for r in rows}


def predict(points: Sequence[Point], fits: Dict[int, Fit]) -> List[Prediction]:
    """Per batch size and k0: OEA against plain top-k on the same draws."""
    out = []
    for rows, fit in fits.items():
        topk = {p.draw: p for p in points if p.rows == rows and p.kind == TOPK}
        for k0 in sorted({p.k0 for p in points if p.rows == rows and p.kind == OEA}):
            oea = [p for p in points if p.rows == rows and p.kind == OEA and p.k0 == k0 and p.draw in topk]
            if not oea:
                continue
            topk_T = statistics.fmean(topk[p.draw].T for p in oea)
            oea_T = statistics.fmean(p.T for p in oea)
            ratios = [p.median_us / topk[p.draw].median_us for p in oea]
            out.append(Prediction(rows, k0, topk_T, oea_T, fit.at(oea_T) / fit.at(topk_T),
                                  statistics.median(ratios), min(ratios), max(ratios)))
    return out


def judge_rows(rows: int, fits: Dict[int, Fit], preds: Sequence[Prediction], prefix: str) -> RowVerdict:
    """The verdict at one judged row count: PASS, FAIL or NOT_JUDGED, its line and caveats."""
    fit = fits.get(rows)
    if fit is None:
        return RowVerdict(rows, NOT_JUDGED, f"{prefix}at {rows} rows: not judged: not timed (out of --budget-s)", [])
    if fit.n < 3 or math.isnan(fit.slope_low):
        return RowVerdict(rows, NOT_JUDGED, f"{prefix}at {rows} rows: not judged: {fit.n} value(s) of T timed, "
                                            f"the fit needs 3", [])
    at_rows = [p for p in preds if p.rows == rows]
    head = next((p for p in at_rows if p.k0 == HEADLINE_K0), max(at_rows, key=lambda p: p.k0) if at_rows else None)
    caveats = []
    if not math.isnan(fit.r2) and fit.r2 < MIN_R2:
        caveats.append(f"R^2 = {fit.r2:.2f} at {rows} rows: time is not linear in T, read the measured ratios")
    if head is not None and abs(head.measured - head.predicted) > MAX_GAP:
        caveats.append(f"at {rows} rows, k0={head.k0}: measured {head.measured:.2f} vs predicted "
                       f"{head.predicted:.2f}: the line misses, trust the measured ratio")
    start = f"{prefix}at {rows} rows: "
    if not fit.slope_low > 0:
        why = (f"the slope is {fit.slope:.2f} us per expert and its one-sided 95% lower bound "
               f"{fit.slope_low:.2f} is not above 0")
    elif head is None:
        return RowVerdict(rows, NOT_JUDGED, f"{start}not judged: no OEA routing was timed (out of --budget-s)",
                          caveats)
    elif head.predicted > 1 - MIN_SAVING:
        why = f"OEA k0={head.k0} would save {1 - head.predicted:.0%} of this MoE layer, under {MIN_SAVING:.0%}"
    else:
        return RowVerdict(rows, PASS, f"{start}pass: time falls with T; OEA k0={head.k0} should cut this MoE layer "
                                      f"to about {head.predicted:.2f} of its time (T {head.oea_T:.1f} vs "
                                      f"{head.topk_T:.1f}; measured on its own routing: {head.measured:.2f})",
                          caveats, head.k0, head.predicted)
    return RowVerdict(rows, FAIL, f"{start}fail: OEA will not speed up this MoE layer ({why})", caveats,
                      head.k0 if head else None, head.predicted if head else None)


def judge(fits: Dict[int, Fit], preds: Sequence[Prediction], judged: Sequence[int], dry_run: bool) -> Judgement:
    """A verdict per judged row count, the overall line and the exit code (see the module docstring)."""
    prefix = "DRY RUN (CPU stand-in, not a GPU result): " if dry_run else ""
    per_rows = [judge_rows(r, fits, preds, prefix) for r in sorted(set(judged))]
    passing = [v.rows for v in per_rows if v.status == PASS]
    failing = [v.rows for v in per_rows if v.status == FAIL]
    skipped = [v.rows for v in per_rows if v.status == NOT_JUDGED]
    of = f"of {_rows(judged)} rows judged"
    unjudged = f"; not judged: {_rows(skipped)}" if skipped else ""
    if not passing and not failing:
        return Judgement(per_rows, passing, None, f"NO VERDICT: no row count could be judged ({of}{unjudged}): "
                                                  f"see the lines above (exit {EXIT_ERROR})", EXIT_ERROR)
    if dry_run:
        return Judgement(per_rows, passing, None,
                         f"{prefix}no go/no-go; the stand-in passes at {_rows(passing) or 'none'} {of}{unjudged}. "
                         f"Run it on the GPU for a verdict (exit {EXIT_DRY_RUN})", EXIT_DRY_RUN)
    if not passing:
        return Judgement(per_rows, passing, False,
                         f"NO-GO: OEA is not predicted to save >= {MIN_SAVING:.0%} of the MoE layer at any "
                         f"{of}{unjudged}: keep OEA off for this configuration (exit {EXIT_NO_GO})", EXIT_NO_GO)
    below = [r for r in failing if r < max(passing)]
    fails = f"; fails at {_rows(failing)}" if failing else ""
    return Judgement(per_rows, passing, True,
                     f"GO: OEA is predicted to save >= {MIN_SAVING:.0%} of the MoE layer at {_rows(passing)} {of}"
                     f"{fails}{unjudged}. Largest passing: {max(passing)} rows: --oea-max-batch {max(passing)}"
                     + (f" (it fails at {_rows(below)}, below that)" if below else "") + f" (exit {EXIT_GO})",
                     EXIT_GO)


def _rows(rows: Sequence[int]) -> str:
    return ", ".join(str(r) for r in sorted(set(rows)))


THRESHOLDS = (f"Thresholds: a judged row count passes when the slope's one-sided {SLOPE_CONFIDENCE:.0%} lower "
              f"bound is > 0 us per expert and OEA k0={HEADLINE_K0} (else the largest k0 swept) is predicted "
              f"to save >= {MIN_SAVING:.0%} of the MoE layer. GO (exit {EXIT_GO}) when at least one judged row "
              f"count passes, NO-GO (exit {EXIT_NO_GO}) when none does; a dry run exits {EXIT_DRY_RUN}, no "
              f"verdict {EXIT_ERROR}. Caveats at R^2 < {MIN_R2} and at |measured - predicted| > {MAX_GAP}.")


def markdown(meta: dict, points: Sequence[Point], fits: Dict[int, Fit], preds: Sequence[Prediction],
             judgement: Judgement) -> str:
    lines = ["# OEA premise: MoE-layer time against distinct experts T", ""]
    if meta["dry_run"]:
        lines += ["**DRY RUN on the CPU: a plain-torch stand-in, not SGLang's kernel and not a GPU result. "
                  "It tests the command's pipeline only.**", ""]
    lines += [f"- {key}: {meta[key]}" for key in ("machine", "date", "versions", "command", "function",
                                                  "call_site", "shape", "timing", "tuning") if meta.get(key)]
    lines += [f"- note: {n}" for n in meta.get("notes", [])]
    lines += ["", "## Verdict", "", f"**{judgement.line}**", ""]
    for v in judgement.per_rows:
        lines += [f"- {v.line}"] + [f"  - caveat: {c}" for c in v.caveats]
    lines += ["", THRESHOLDS, "", "## Fit per batch (synthetic ids, exactly T experts)", "",
              "| rows | points | fixed us | us per extra expert | 95% lower bound | R^2 |", "|---|---|---|---|---|---|"]
    lines += [f"| {f.rows} | {f.n} | {f.intercept:.1f} | {f.slope:.3f} | {f.slope_low:.3f} | {f.r2:.3f} |"
              for f in fits.values()]
    lines += ["", "## OEA / plain top-k, MoE layer (uniform random scores)", "",
              "| rows | k0 | mean T top-k | mean T OEA | predicted ratio (fit) | measured ratio (min-max) |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {p.rows} | {p.k0} | {p.topk_T:.1f} | {p.oea_T:.1f} | {p.predicted:.3f} | {p.measured:.3f} "
              f"({p.measured_lo:.3f}-{p.measured_hi:.3f}) |" for p in preds]
    lines += ["", "## Points", "", "| rows | kind | k0 | draw | T | median us | p20-p80 us | mode |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {p.rows} | {p.kind} | {'' if p.k0 is None else p.k0} | {p.draw} | {p.T} | {p.median_us:.2f} "
              f"| {p.p20_us:.2f}-{p.p80_us:.2f} | {p.mode} |" for p in points]
    return "\n".join(lines) + "\n"


def plot(path: Path, meta: dict, points: Sequence[Point], fits: Dict[int, Fit]) -> Optional[str]:
    """Time against T per batch size, synthetic points with their p20-p80 and the fitted line,
    real-routing points as markers; None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no plot"
    fig, ax = plt.subplots(figsize=(8, 5))
    markers = {TOPK: "s", OEA: "^"}
    for i, (rows, fit) in enumerate(fits.items()):
        color = f"C{i}"
        syn = [p for p in points if p.rows == rows and p.kind == SYNTHETIC]
        ax.errorbar([p.T for p in syn], [p.median_us for p in syn],
                    yerr=[[p.median_us - p.p20_us for p in syn], [p.p80_us - p.median_us for p in syn]],
                    fmt="o", ms=3, color=color, label=f"{rows} rows: {fit.intercept:.1f} us + {fit.slope:.2f} us x T, "
                                                      f"R^2 {fit.r2:.2f}")
        if not math.isnan(fit.slope):
            ts = [min(p.T for p in syn), max(p.T for p in syn)]
            ax.plot(ts, [fit.at(t) for t in ts], "-", color=color, lw=1)
        for kind, marker in markers.items():
            real = [p for p in points if p.rows == rows and p.kind == kind]
            ax.scatter([p.T for p in real], [p.median_us for p in real], marker=marker, color=color,
                       edgecolors="black", s=30, zorder=3)
    ax.scatter([], [], marker="s", color="white", edgecolors="black", label="plain top-k (uniform scores)")
    ax.scatter([], [], marker="^", color="white", edgecolors="black", label="OEA k0 3-6 (uniform scores)")
    ax.set_xlabel("distinct experts T")
    ax.set_ylabel("MoE-layer time, us (median)")
    title = ("DRY RUN, CPU stand-in, not a GPU result. " if meta["dry_run"] else "") + meta["shape"]
    ax.set_title("\n".join(textwrap.wrap(title, 110) + [f"{meta['machine']}, {meta['date']}"]), fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write_report(out_dir: Path, meta: dict, points: Sequence[Point]) -> Tuple[Dict[str, Path], Judgement]:
    """moe_premise.md, .json and .png in out_dir, judged at meta["judged_rows"]; returns (paths
    written, the judgement)."""
    fits = fit_all(points)
    preds = predict(points, fits)
    judgement = judge(fits, preds, meta["judged_rows"], meta["dry_run"])
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"md": out_dir / "moe_premise.md", "json": out_dir / "moe_premise.json", "png": out_dir / "moe_premise.png"}
    why_no_plot = plot(paths["png"], meta, points, fits)
    if why_no_plot:
        meta.setdefault("notes", []).append(why_no_plot)
        del paths["png"]
    paths["md"].write_text(markdown(meta, points, fits, preds, judgement))
    record = dict(meta=meta, points=[asdict(p) for p in points], fits=[asdict(f) for f in fits.values()],
                  predictions=[asdict(p) for p in preds],
                  verdict=dict(asdict(judgement), thresholds=THRESHOLDS))
    paths["json"].write_text(json.dumps(record, indent=1, allow_nan=True) + "\n")
    return paths, judgement
