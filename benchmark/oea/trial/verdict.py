"""The trial's verdict (trial.py): one cell per (concurrency, k0), the recommendation, and the
report files results.md, results.json and results.png.

A cell's throughput verdict, from the paired per-repeat ratios OEA / off (common/report):
- "gate closed": OEA's gate cannot open at that concurrency (preflight.py); not run;
- "faster by X% [lo, hi]" / "slower by ...": resolved (min and max within +-5% of the median,
  at least 3 repeats) and the whole min-max above (below) 1;
- "no change beyond +-5%": resolved, and the min-max includes 1;
- "not resolved": too few repeats or too wide a spread for the budget, with the spread.

The recommendation is the k0 to leave on, or 0 (keep OEA off), with the flags to keep it. A k0's
window is the open concurrencies it may run at: all of them, unless it is resolved slower at some
concurrencies that all lie above every one where it is resolved faster; then the cap that keeps it
to those (cap_for: --oea-max-batch = the token rows of the pass OEA routes at the largest
concurrency where it is faster: one replica's, or under DP attention every group's gathered) is
suggested instead of rejecting it. A k0 qualifies when, in its window, it is resolved faster at one
concurrency at least, resolved slower at none, its quality comparisons are within their bound
(every quality concurrency in the window, when quality was measured), and under speculative
decoding its accept length is shown non-inferior at every concurrency. Among those, the highest
geometric mean of the median ratios over the window wins; a larger k0 (it changes less of the
routing) is taken instead when its min-max overlaps the winner's at every open concurrency. The
launch flags to keep are `--oea-k0 K --oea-min-batch M --oea-max-batch R` (M the server's floor,
R the cap: suggested, else the server's; under DP attention both count the gathered batch); "keep
OEA off" says how to take OEA off the routing path and what arming costs meanwhile (ARMING_COST).
"""

import json
import math
import os
from typing import Dict, List, Optional, Sequence

from common import report
from common.oea_metrics import ACCEPT_DEFINITION, APPLIED_DEFINITION, KEPT_MASS_NOTE

# What an armed server (--oea-k0 0) costs while OEA is off: no GPU figure exists yet; the CPU one is
# labelled as such (benchmark/oea/results/cpu-2026-12-03-kept-mass-cost/).
ARMING_COST = ("not measured on a GPU yet (an armed server's CUDA graphs hold the routing kernel's two launches "
               "per MoE layer, with the gate closed, while k0 is 0); on the CPU engine OEA's host code took 28.3 us "
               "(15.9-35.6) per eager decode pass at k0 0 (16 rows, 4 MoE layers; a 2-core CPU machine, 2026-12-03, "
               "benchmark/oea/results/cpu-2026-12-03-kept-mass-cost/): a CPU figure, it says nothing about a GPU")
ACCEPT_CONTEXT_NOTE = (
    "The throughput table's accept length is context: each arm's bench runs pooled (completion tokens over verify "
    "passes, so long requests weigh more), on that arm's own prompts and batches, at other times. The paired probe "
    "below decides: the same prompts through every arm at the same concurrency, per request, paired by prompt, with "
    "an interval. The two can differ, even in sign, when the probe's prompts or the batches' mix differ from the "
    "runs', or when the table's difference is inside the probe's interval")


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


def build_cells(pre, k0s: Sequence[int], summary: report.Summary, rows: Dict, quality: Optional[List[Dict]],
                accept: Optional[Dict]) -> List[Dict]:
    """results.json's cells: one per (concurrency, k0), gate-closed ones included; a cell's quality
    fields are those of the quality run at its concurrency, if one ran there."""
    cells = []
    for gate in pre.gates:
        run = next((r for r in quality or [] if r["concurrency"] == gate.concurrency), None)
        for k0 in k0s:
            ratio = summary.ratios.get((gate.concurrency, report.arm_name(k0))) if gate.open else None
            q = (run or {}).get("per_k0", {}).get(k0)
            cells.append({
                "concurrency": gate.concurrency, "k0": k0, "gate_open": gate.open, "gate": gate.why,
                "requests": gate.requests, "rows": gate.rows, "above_limit": gate.above_limit,
                "ratio": ratio.median if ratio else None, "ratio_low": ratio.lo if ratio else None,
                "ratio_high": ratio.hi if ratio else None, "repeats": ratio.n if ratio else 0,
                "resolved": bool(ratio and report.resolved(ratio)), "verdict": cell_verdict(gate.open, ratio),
                "off": rows.get((gate.concurrency, report.BASELINE)), "oea": rows.get((gate.concurrency,
                                                                                       report.arm_name(k0))),
                "accept_length": ((accept or {}).get(gate.concurrency) or {}).get(k0),
                "quality_delta": q["delta"] if q else None, "quality_low": q["low"] if q else None,
                "quality_high": q["high"] if q else None, "quality_within": q["within"] if q else None})
    return cells


def rows_of(cell: Dict) -> int:
    """The token rows of the pass OEA routes at the cell's concurrency (one replica's, or under DP
    attention every attention-DP group's gathered: the units of --oea-max-batch)."""
    return cell.get("rows") or cell["concurrency"]


def cap_for(k0: int, cells: Sequence[Dict]) -> Optional[Dict]:
    """The cap that keeps k0 to the concurrencies where it is faster, when it is resolved slower only
    above all of them: {"max_batch": rows at the largest faster concurrency, "faster_up_to": that C,
    "slower": [C, ...]}; None when k0 is slower nowhere, faster nowhere, or slower below a faster C."""
    mine = [c for c in cells if c["k0"] == k0 and c["gate_open"]]
    slow = [c for c in mine if c["resolved"] and c["ratio_high"] < 1]
    fast = [c for c in mine if c["resolved"] and c["ratio_low"] > 1]
    if not slow or not fast:
        return None
    top = max(fast, key=lambda c: c["concurrency"])
    if rows_of(top) >= min(map(rows_of, slow)):  # slower at a batch no larger than one where it is faster
        return None
    return {"max_batch": rows_of(top), "faster_up_to": top["concurrency"],
            "slower": sorted(c["concurrency"] for c in slow)}


def window(k0: int, cells: Sequence[Dict], cap: Optional[Dict]) -> List[Dict]:
    """k0's open cells that its cap (if any) leaves open."""
    return [c for c in cells if c["k0"] == k0 and c["gate_open"] and (cap is None or rows_of(c) <= cap["max_batch"])]


def k0_problems(k0: int, cells: Sequence[Dict], quality: Optional[List[Dict]], speculative: bool,
                cap: Optional[Dict] = None) -> List[str]:
    """Why k0 does not qualify for the recommendation ([] when it does), within its window."""
    mine = window(k0, cells, cap)
    problems = [f"slower at C={c['concurrency']}" for c in mine if c["resolved"] and c["ratio_high"] < 1]
    if not any(c["resolved"] and c["ratio_low"] > 1 for c in mine):
        problems.append("not resolved faster at any concurrency")
    if quality is not None:
        runs = [r for r in quality if cap is None or r.get("rows", r["concurrency"]) <= cap["max_batch"]]
        for run in runs:
            q = run["per_k0"].get(k0)
            if q is None or not q["within"]:
                problems.append(f"quality {'not within its bound' if q else 'not measured'} at C={run['concurrency']}")
        if not runs:
            problems.append("quality not measured")
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


def recommend(k0s: Sequence[int], cells: Sequence[Dict], quality: Optional[List[Dict]], speculative: bool,
              settings: Optional[Dict[str, int]] = None, rows_per_request: int = 1) -> Dict:
    """{"k0": the k0 to leave on (0 = keep OEA off), "reason": one paragraph, "problems": {k0: [...]},
    "cap": cap_for's dict or None, "flags": the launch flags to keep (None when off), "settings":
    what --apply sets live, "off": how to take OEA off and what arming costs (None when on)}.
    settings: the server's gate in force (oea_min_batch, oea_max_batch, oea_k0)."""
    settings = settings or {}
    caps = {k0: cap_for(k0, cells) for k0 in k0s}
    problems = {k0: k0_problems(k0, cells, quality, speculative, caps[k0]) for k0 in k0s}
    good = [k0 for k0 in k0s if not problems[k0]]
    if not good:
        why = "; ".join(f"k0={k0}: {', '.join(p)}" for k0, p in problems.items())
        return {"k0": 0, "reason": f"no k0 qualifies ({why})", "problems": problems, "cap": None, "flags": None,
                "settings": {"oea_k0": 0}, "off": off_advice(settings.get("oea_k0", 0))}
    in_window = {k0: window(k0, cells, caps[k0]) for k0 in good}
    best = max(good, key=lambda k: mean_log_ratio(k, in_window[k]))
    larger = [k for k in good if k > best and overlaps(k, best, cells) and caps[k] == caps[best]]
    chosen = max(larger) if larger else best
    cap = caps[chosen]
    gains = ", ".join(f"C={c['concurrency']}: {c['verdict']}" for c in in_window[chosen])
    reason = f"k0={chosen} qualifies, with the best throughput: {gains}"
    if chosen != best:
        reason += f" (k0={best} was not clearly faster, and a larger k0 changes less of the routing)"
    if cap:
        rows = rows_text(cap["max_batch"], rows_per_request)
        reason += (f"; it is slower at C={', '.join(map(str, cap['slower']))}, above every concurrency where it is "
                   f"faster: the cap --oea-max-batch {cap['max_batch']} ({rows}) keeps it to C <= "
                   f"{cap['faster_up_to']} and closes the gate above")
    if quality is None:
        reason += "; quality was not measured by this trial (--quality none): compare it before leaving OEA on"
    max_batch = cap["max_batch"] if cap else settings.get("oea_max_batch", 0)
    flags = f"--oea-k0 {chosen} --oea-min-batch {settings.get('oea_min_batch', 1)} --oea-max-batch {max_batch}"
    applied = {"oea_k0": chosen, **({"oea_max_batch": cap["max_batch"]} if cap else {})}
    return {"k0": chosen, "reason": reason, "problems": problems, "cap": cap, "flags": flags, "settings": applied,
            "off": None}


def rows_text(rows: int, rows_per_request: int) -> str:
    """'128 token rows: 32 requests x 4 draft tokens' (one pass OEA routes: a replica's, or the
    gathered batch under DP attention), or 'N requests'."""
    if rows_per_request > 1:
        return f"{rows} token rows: {rows // rows_per_request} requests x {rows_per_request} draft tokens"
    return f"{rows} token rows: {rows} requests"


def off_advice(k0_found: int) -> str:
    """How to take OEA off the routing path after a "keep OEA off", and what arming costs meanwhile."""
    now = ("The server is left armed and off (k0 0)" if not k0_found else
           f"The trial put back the k0 {k0_found} it found: set k0 0 live now (POST /set_internal_state "
           '{"server_args": {"oea_k0": 0}} with the header "Authorization: Bearer $OEA_ADMIN_API_KEY" when '
           'the server has an admin key, docs/live-settings.md), which leaves it armed and off')
    return (f"{now}. To take OEA off the routing path, restart the server without --oea-k0 (and without "
            f"SGLANG_OEA_K0 in its environment). What arming costs meanwhile: {ARMING_COST}")


def fmt(value, spec: str = ".1f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def arm_table(rows: Dict, speculative: bool) -> List[str]:
    """Markdown: one row per (concurrency, arm)."""
    head = ["C", "arm", "repeats", "out tok/s", "median TPOT ms", "T before -> after", "OEA applied",
            "kept router mass"]
    head += ["accept len (context)"] if speculative else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (conc, arm), r in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[1]["k0"] or 0)):
        t = (f"{fmt(r['t_before'])} -> {fmt(r['t_after'])}" if r["t_after"] is not None else "-")
        applied = "-" if r["applied_share"] is None else f"{r['applied_share']:.0%}"
        cells = [str(conc), arm, str(r["repeats"]), fmt(r["output_throughput"]), fmt(r["median_tpot_ms"], ".2f"), t,
                 applied, report.kept_text(r.get("kept_router_mass"))]
        cells += [fmt(r["accept_length"], ".2f")] if speculative else []
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def cell_table(cells: Sequence[Dict], quality: Optional[List[Dict]], speculative: bool) -> List[str]:
    """Markdown: one row per cell, its verdicts (quality where a quality run had that concurrency)."""
    head = ["C", "k0", "throughput (OEA / off)"] + (["accept length, OEA vs off (paired probe)"] if speculative else [])
    head += ["quality, OEA - off (at this C)"] if quality else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells:
        row = [str(c["concurrency"]), str(c["k0"]), c["verdict"] + ("" if c["gate_open"] else f" ({c['gate']})")]
        if speculative:
            a = c["accept_length"]
            row.append("-" if not a else f"{a['change']:+.1%} [{a['low']:+.1%}, {a['high']:+.1%}] "
                                         f"{'non-inferior' if a['non_inferior'] else 'NOT shown non-inferior'}")
        if quality:
            row.append("-" if c["quality_delta"] is None or not c["gate_open"] else
                       f"{c['quality_delta']:+.3f} [{c['quality_low']:+.3f}, {c['quality_high']:+.3f}] "
                       f"{'within' if c['quality_within'] else 'NOT within'} its bound ({quality_margin(quality[0])})")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def quality_margin(quality: Dict) -> str:
    """The quality bound, one-sided: '-0.02' (OEA - off may lose at most 0.02), '+0.02' where lower is better."""
    first = next(iter(quality["per_k0"].values()), {})
    return f"{'-' if first.get('higher_is_better', True) else '+'}{first.get('margin', '?')}"


def quality_lines(quality: Optional[Dict]) -> List[str]:
    """Markdown: what one quality run was (its concurrency and why), and each k0's figures."""
    if quality is None:
        return ["Not measured (--quality none)."]
    what = (f"lm-eval task `{quality['task']}`, metric `{quality['metric']}` (filter `{quality['filter']}`)"
            if quality["tool"] == "lm-eval" else f"quality_ab prompts `{quality['prompts']}`, {quality['metric']}")
    why = f" ({quality['why']})" if quality.get("why") else ""
    lines = [f"{what}, at C={quality['concurrency']}{why}: {quality['concurrency']} requests in flight, greedy; "
             "OEA - off per sample, paired, 95% percentile bootstrap interval.", ""]
    for k0, q in quality["per_k0"].items():
        bound = f"{'-' if q.get('higher_is_better', True) else '+'}{q['margin']}"
        applied = q.get("oea_applied") or {}
        share = "-" if applied.get("share") is None else f"{applied['share']:.0%}"
        kept = applied.get("kept_router_mass")
        lines.append(f"- k0={k0}: off {fmt(q['baseline'], '.3f')}, OEA {fmt(q['oea'], '.3f')} over {q['n']} samples; "
                     f"OEA - off {q['delta']:+.3f} [{q['low']:+.3f}, {q['high']:+.3f}]: "
                     f"{'within' if q['within'] else 'NOT within'} its bound ({bound}); OEA applied in {share} "
                     "of the arm's decode steps" + ("" if kept is None else f", kept router mass {kept:.3f}")
                     + (f". {q['note']}" if q.get("note") else ""))
    return lines


def accept_lines(accept: Optional[Dict]) -> List[str]:
    """Markdown: the paired accept-length probe, per concurrency and k0, and how far it ran."""
    if not accept:
        return ["Not run (the trial stopped before it)."]
    lines = []
    for conc, per_k0 in accept.items():
        for k0, a in per_k0.items():
            lines.append(f"- C={conc}, k0={k0}: off {a['off']:.2f}, OEA {a['oea']:.2f} over {a['n']} prompts; "
                         f"{a['change']:+.1%} [{a['low']:+.1%}, {a['high']:+.1%}]: "
                         f"{'non-inferior' if a['non_inferior'] else 'NOT shown non-inferior'} "
                         f"(bound {a['bound']:+.0%})"
                         + (f"; {a['rounds']} round(s) from a floor of {a['floor']}: {a['sized']}" if a.get("sized")
                            else ""))
    return lines


def budget_lines(budget: Optional[Dict]) -> List[str]:
    """Markdown: the plan as printed, what was cut, and the time each phase took."""
    if not budget:
        return []
    lines = ["## Budget", ""] + [f"- {line}" for line in budget["plan"]] + [""]
    lines.append("Cut: " + ("; ".join(budget["cuts"]) + "." if budget["cuts"] else "nothing."))
    spent = ", ".join(f"{name} {m:.1f} min" for name, m in budget["phases"].items())
    lines += ["", f"Time: {spent or 'no phase ran'}; {budget['used_minutes']:.1f} of {budget['minutes']:g} min used.",
              ""]
    return lines


def recommendation_lines(rec: Dict) -> List[str]:
    """Markdown: the recommendation, and the flags to keep (or how to take OEA off)."""
    cap = rec.get("cap")
    head = ("keep OEA off" if not rec["k0"] else f"leave k0 = {rec['k0']} on"
            + (f", capped at --oea-max-batch {cap['max_batch']}" if cap else ""))
    lines = [f"**Recommendation: {head}.** {rec['reason'][0].upper() + rec['reason'][1:]}.", ""]
    if rec.get("flags"):
        lines += ["Live settings are lost at a restart: to keep them, launch with", "", f"    {rec['flags']}", ""]
    if rec.get("off"):
        lines += [rec["off"] + ".", ""]
    return lines


def render_markdown(result: Dict) -> str:
    """results.md from results.json's content."""
    pre, spec = result["preflight"], bool(result["preflight"]["speculative"])
    quality = result["quality"]
    lines = [f"# OEA trial: {result['model']}", ""]
    lines += [f"**{result['label']}**", ""] if result.get("label") else []
    lines += [f"Server {result['url']}; {result['started']} to {result['finished']}; status: {result['status']}.",
              f"Prompts: {result['prompts']}.", "", "## Preflight", ""]
    lines += [f"- {line}" for line in pre["lines"]] + [f"- warning: {w}" for w in pre["warnings"]]
    lines += ["", "Batch gate per concurrency:", "", "| C | gate | why |", "|---|---|---|"]
    lines += [f"| {g['concurrency']} | {'open' if g['open'] else 'closed'} | {g['why']} |" for g in pre["gates"]]
    lines += [""] + budget_lines(result.get("budget"))
    lines += ["## Throughput: one server, arms interleaved, k0 set live", "",
              "Medians over repeats. T: distinct experts per MoE layer per routed step, the router's own -> after "
              "OEA (gauges after each run in which OEA applied). OEA applied: " + APPLIED_DEFINITION + "."
              + (" Accept len (context): " + ACCEPT_DEFINITION + "." if spec else ""), "", KEPT_MASS_NOTE + ".", ""]
    lines += arm_table({(r["concurrency"], r["arm"]): r for r in result["arms"]}, spec)
    if spec:
        lines += ["", "## Accept length: the paired probe decides", "", ACCEPT_CONTEXT_NOTE + ".", ""]
        lines += accept_lines(result.get("accept_length_probe"))
    lines += ["", "## Quality", ""]
    for run in quality if quality is not None else [None]:
        lines += quality_lines(run) + [""]
    if quality == []:
        lines += ["Not measured (the trial stopped before it).", ""]
    lines += ["## Verdict", ""] + cell_table(result["cells"], quality, spec)
    lines += [""] + recommendation_lines(result["recommendation"])
    lines += [f"Routing kernel after the trial: {'; '.join(result['kernel_after'])}.", ""] \
        if result.get("kernel_after") else []
    lines += [f"Settings put back: {json.dumps(result['restored'])} ({result['restore_note']})."
              if (result.get("restore") or {}).get("ok", True) else f"**Settings NOT put back.** {result['restore_note']}."]
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
