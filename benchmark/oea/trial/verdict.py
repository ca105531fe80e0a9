"""The trial's verdict (trial.py): one cell per (concurrency, k0), the recommendation, and the
report files results.md, results.json and results.png.

A cell's throughput verdict, from the paired per-repeat ratios OEA / off (common/report):
- "gate closed": OEA's gate cannot open at that concurrency (trial_preflight); not run;
- "faster by X% [lo, hi]" / "slower by ...": resolved (min and max within +-5% of the median,
  at least 3 repeats) and the whole min-max above (below) 1;
- "no change beyond +-5%": resolved, and the min-max includes 1;
- "not resolved": too few repeats or too wide a spread for the budget, with the spread.

The recommendation is the k0 to leave on, or 0 (keep OEA off). A k0 qualifies when it is resolved
faster at one open concurrency at least, resolved slower at none, its quality comparison is within
its bound (when one ran), and under speculative decoding its accept length is non-inferior at every
open concurrency. Among those, the highest geometric mean of the median ratios over the open
concurrencies wins; a larger k0 (it changes less of the routing) is taken instead when its min-max
overlaps the winner's at every open concurrency.
"""

import json
import math
import os
from typing import Dict, List, Optional, Sequence

from common import report
from serving.oea_metrics import ACCEPT_DEFINITION, APPLIED_DEFINITION, KEPT_MASS_NOTE


def cell_verdict(gate_open: bool, ratio: Optional[report.Spread]) -> str:
    """The throughput verdict of one cell (see the module doc)."""
    if not gate_open:
        return "gate closed"
    if ratio is None:
        return "not measured (no paired runs)"
    span = f"[{ratio.lo - 1:+.0%}, {ratio.hi - 1:+.0%}]"
    if not report.resolved(ratio):
        return f"not resolved ({report.spread_text(ratio)})"
    if ratio.lo > 1:
        return f"faster by {ratio.median - 1:.0%} {span}"
    if ratio.hi < 1:
        return f"slower by {1 - ratio.median:.0%} {span}"
    return f"no change beyond ±{report.RESOLVED_WITHIN:.0%} ({ratio.median:.2f}x {span})"


def build_cells(pre, k0s: Sequence[int], summary: report.Summary, rows: Dict, quality: Optional[Dict],
                accept: Optional[Dict]) -> List[Dict]:
    """results.json's cells: one per (concurrency, k0), gate-closed ones included."""
    cells = []
    for gate in pre.gates:
        for k0 in k0s:
            ratio = summary.ratios.get((gate.concurrency, report.arm_name(k0))) if gate.open else None
            q = (quality or {}).get("per_k0", {}).get(k0)
            cells.append({
                "concurrency": gate.concurrency, "k0": k0, "gate_open": gate.open, "gate": gate.why,
                "ratio": ratio.median if ratio else None, "ratio_low": ratio.lo if ratio else None,
                "ratio_high": ratio.hi if ratio else None, "repeats": ratio.n if ratio else 0,
                "resolved": bool(ratio and report.resolved(ratio)), "verdict": cell_verdict(gate.open, ratio),
                "off": rows.get((gate.concurrency, report.BASELINE)), "oea": rows.get((gate.concurrency,
                                                                                       report.arm_name(k0))),
                "accept_length": ((accept or {}).get(gate.concurrency) or {}).get(k0),
                "quality_delta": q["delta"] if q else None, "quality_low": q["low"] if q else None,
                "quality_high": q["high"] if q else None, "quality_within": q["within"] if q else None})
    return cells


def k0_problems(k0: int, cells: Sequence[Dict], quality: Optional[Dict], speculative: bool) -> List[str]:
    """Why k0 does not qualify for the recommendation ([] when it does)."""
    mine = [c for c in cells if c["k0"] == k0 and c["gate_open"]]
    problems = [f"slower at C={c['concurrency']}" for c in mine if c["resolved"] and c["ratio_high"] < 1]
    if not any(c["resolved"] and c["ratio_low"] > 1 for c in mine):
        problems.append("not resolved faster at any concurrency")
    q = (quality or {}).get("per_k0", {}).get(k0)
    if quality is not None and (q is None or not q["within"]):
        problems.append("quality not within its bound" if q else "quality not measured")
    if speculative:
        bad = [c["concurrency"] for c in mine if not (c["accept_length"] or {}).get("non_inferior")]
        if bad:
            problems.append(f"accept length not shown non-inferior at C={', '.join(map(str, bad))}")
    return problems


def mean_log_ratio(k0: int, cells: Sequence[Dict]) -> float:
    logs = [math.log(c["ratio"]) for c in cells if c["k0"] == k0 and c["gate_open"] and c["ratio"]]
    return sum(logs) / len(logs) if logs else -math.inf


def overlaps(a: int, b: int, cells: Sequence[Dict]) -> bool:
    """Whether k0 a's min-max overlaps k0 b's at every open concurrency."""
    by = {(c["k0"], c["concurrency"]): c for c in cells if c["gate_open"] and c["ratio"]}
    shared = {conc for k, conc in by if k == a} & {conc for k, conc in by if k == b}
    return bool(shared) and all(by[(a, conc)]["ratio_low"] <= by[(b, conc)]["ratio_high"]
                                and by[(b, conc)]["ratio_low"] <= by[(a, conc)]["ratio_high"] for conc in shared)


def recommend(k0s: Sequence[int], cells: Sequence[Dict], quality: Optional[Dict], speculative: bool) -> Dict:
    """{"k0": the k0 to leave on (0 = keep OEA off), "reason": one paragraph} (see the module doc)."""
    problems = {k0: k0_problems(k0, cells, quality, speculative) for k0 in k0s}
    good = [k0 for k0 in k0s if not problems[k0]]
    if not good:
        why = "; ".join(f"k0={k0}: {', '.join(p)}" for k0, p in problems.items())
        return {"k0": 0, "reason": f"no k0 qualifies ({why})", "problems": problems}
    best = max(good, key=lambda k: mean_log_ratio(k, cells))
    larger = [k for k in good if k > best and overlaps(k, best, cells)]
    chosen = max(larger) if larger else best
    gains = ", ".join(f"C={c['concurrency']}: {c['verdict']}" for c in cells if c["k0"] == chosen and c["gate_open"])
    reason = f"k0={chosen} qualifies, with the best throughput: {gains}"
    if chosen != best:
        reason += f" (k0={best} was not clearly faster, and a larger k0 changes less of the routing)"
    if quality is None:
        reason += "; quality was not measured by this trial (--quality none): compare it before leaving OEA on"
    return {"k0": chosen, "reason": reason, "problems": problems}


def fmt(value, spec: str = ".1f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def arm_table(rows: Dict, speculative: bool) -> List[str]:
    """Markdown: one row per (concurrency, arm)."""
    head = ["C", "arm", "repeats", "out tok/s", "median TPOT ms", "T before -> after", "OEA applied",
            "kept router mass"]
    head += ["accept len"] if speculative else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (conc, arm), r in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[1]["k0"] or 0)):
        t = (f"{fmt(r['t_before'])} -> {fmt(r['t_after'])}" if r["t_after"] is not None else "-")
        applied = "-" if r["applied_share"] is None else f"{r['applied_share']:.0%}"
        cells = [str(conc), arm, str(r["repeats"]), fmt(r["output_throughput"]), fmt(r["median_tpot_ms"], ".2f"), t,
                 applied, report.kept_text(r.get("kept_router_mass"))]
        cells += [fmt(r["accept_length"], ".2f")] if speculative else []
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def cell_table(cells: Sequence[Dict], quality: Optional[Dict], speculative: bool) -> List[str]:
    """Markdown: one row per cell, its verdicts."""
    head = ["C", "k0", "throughput (OEA / off)"] + (["accept length, OEA vs off"] if speculative else [])
    head += [f"quality, OEA - off (at C={quality['concurrency']})"] if quality else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells:
        row = [str(c["concurrency"]), str(c["k0"]), c["verdict"] + ("" if c["gate_open"] else f" ({c['gate']})")]
        if speculative:
            a = c["accept_length"]
            row.append("-" if not a else f"{a['change']:+.1%} [{a['low']:+.1%}, {a['high']:+.1%}] "
                                         f"{'non-inferior' if a['non_inferior'] else 'NOT shown non-inferior'}")
        if quality:  # measured per k0 at one concurrency: shown where the gate opens
            row.append("-" if c["quality_delta"] is None or not c["gate_open"] else
                       f"{c['quality_delta']:+.3f} [{c['quality_low']:+.3f}, {c['quality_high']:+.3f}] "
                       f"{'within' if c['quality_within'] else 'NOT within'} ±{quality_margin(quality)}")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def quality_margin(quality: Dict) -> str:
    first = next(iter(quality["per_k0"].values()), {})
    return f"{first.get('margin', '?')}"


def quality_lines(quality: Optional[Dict]) -> List[str]:
    """Markdown: what the quality comparison was, and each k0's figures."""
    if quality is None:
        return ["Not measured (--quality none)."]
    what = (f"lm-eval task `{quality['task']}`, metric `{quality['metric']}` (filter `{quality['filter']}`)"
            if quality["tool"] == "lm-eval" else f"quality_ab prompts `{quality['prompts']}`, {quality['metric']}")
    lines = [f"{what}, {quality['concurrency']} requests in flight, greedy; OEA - off per sample, paired, "
             "95% percentile bootstrap interval.", ""]
    for k0, q in quality["per_k0"].items():
        applied = q.get("oea_applied") or {}
        share = "-" if applied.get("share") is None else f"{applied['share']:.0%}"
        kept = applied.get("kept_router_mass")
        lines.append(f"- k0={k0}: off {fmt(q['baseline'], '.3f')}, OEA {fmt(q['oea'], '.3f')} over {q['n']} samples; "
                     f"OEA - off {q['delta']:+.3f} [{q['low']:+.3f}, {q['high']:+.3f}]: "
                     f"{'within' if q['within'] else 'NOT within'} its bound of {q['margin']}; OEA applied in {share} "
                     "of the arm's decode steps" + ("" if kept is None else f", kept router mass {kept:.3f}")
                     + (f". {q['note']}" if q.get("note") else ""))
    return lines


def render_markdown(result: Dict) -> str:
    """results.md from results.json's content."""
    pre, spec = result["preflight"], bool(result["preflight"]["speculative"])
    lines = [f"# OEA trial: {result['model']}", ""]
    lines += [f"**{result['label']}**", ""] if result.get("label") else []
    lines += [f"Server {result['url']}; {result['started']} to {result['finished']}; status: {result['status']}.",
              f"Prompts: {result['prompts']}.", "", "## Preflight", ""]
    lines += [f"- {line}" for line in pre["lines"]] + [f"- warning: {w}" for w in pre["warnings"]]
    lines += ["", "Batch gate per concurrency:", "", "| C | gate | why |", "|---|---|---|"]
    lines += [f"| {g['concurrency']} | {'open' if g['open'] else 'closed'} | {g['why']} |" for g in pre["gates"]]
    lines += ["", "## Throughput: one server, arms interleaved, k0 set live", "",
              "Medians over repeats. T: distinct experts per MoE layer per routed step, the router's own -> after "
              "OEA (gauges after each run in which OEA applied). OEA applied: " + APPLIED_DEFINITION + "."
              + (" Accept len: " + ACCEPT_DEFINITION + "." if spec else ""), "", KEPT_MASS_NOTE + ".", ""]
    lines += arm_table({(r["concurrency"], r["arm"]): r for r in result["arms"]}, spec)
    lines += ["", "## Quality", ""] + quality_lines(result["quality"])
    lines += ["", "## Verdict", ""] + cell_table(result["cells"], result["quality"], spec)
    rec = result["recommendation"]
    lines += ["", f"**Recommendation: {'keep OEA off' if not rec['k0'] else 'leave k0 = ' + str(rec['k0']) + ' on'}.** "
              f"{rec['reason'][0].upper() + rec['reason'][1:]}.", ""]
    lines += [f"Routing kernel after the trial: {'; '.join(result['kernel_after'])}.", ""] \
        if result.get("kernel_after") else []
    lines += [f"Settings put back: {json.dumps(result['restored'])} ({result['restore_note']})."]
    return "\n".join(lines) + "\n"


def write_outputs(out_dir: str, result: Dict, records: Sequence[dict]) -> None:
    """results.json, results.md (printed too) and, when anything was measured, results.png."""
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    markdown = render_markdown(result)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(markdown)
    summary = report.summarize(records)
    if summary.concurrencies:
        report.plot(summary, os.path.join(out_dir, "results.png"), f"OEA trial: {result['model']}"
                    + (f" ({result['label']})" if result.get("label") else ""))
    print("\n" + markdown, flush=True)
