"""The CPU demo's cost section: OEA's own work per decode step next to the MoE work it saved, beside
what the server measured.

For each (concurrency C, OEA arm) where OEA applied, from the demo's records:
  - T: distinct experts per MoE layer and decode step, the router's own and after OEA (the server's
    gauges after each run whose counters show OEA applied; medians over repeats);
  - the TPOT the server measured: baseline minus the arm's median TPOT, paired by repeat;
and from cost/step_cost.py (micro-benchmarks on this machine, after the servers have stopped):
OEA's routing + counting per step, and SGLang's CPU MoE layer at the two T, for B = C (the decode
batch while all C requests decode) and the model's shapes. A reader can then tell whether the
TPOT difference is about what the experts OEA skipped are worth, and whether OEA's own work is
small next to it or not.
"""

import json
import os
import statistics
from typing import List, Optional, Sequence, Tuple

from common import report
from common.oea_metrics import run_experts

Cell = Tuple[int, str, int, float, float]  # (C, arm, k0, T before, T after)


def arm_experts(records: Sequence[dict], arm: str, conc: int) -> Optional[Tuple[float, float]]:
    """(T before, T after) of one arm at one C: medians over its runs where OEA applied; None if none."""
    found = [e for r in records if r.get("arm") == arm and r.get("concurrency") == conc
             and (e := run_experts(r)) is not None and e["before"] is not None and e["after"] is not None]
    if not found:
        return None
    return statistics.median(e["before"] for e in found), statistics.median(e["after"] for e in found)


def paired_tpot_saving(records: Sequence[dict], arm: str, conc: int) -> Optional[report.Spread]:
    """Baseline minus arm median TPOT (ms), per repeat at concurrency conc: median and min-max."""
    def tpots(name):
        return {r["repeat"]: r["median_tpot_ms"] for r in records if r.get("arm") == name
                and r.get("concurrency") == conc and not r.get("error") and r.get("median_tpot_ms") is not None}

    base, oea = tpots(report.BASELINE), tpots(arm)
    return report.Spread.of([base[rep] - oea[rep] for rep in sorted(set(base) & set(oea))])


def cost_cells(records: Sequence[dict], summary: report.Summary) -> List[Cell]:
    """Every (C, OEA arm) with a k0 and T readings, in table order."""
    k0_of = {r["arm"]: r.get("k0") for r in records}
    cells = []
    for conc in summary.concurrencies:
        for arm in summary.arms:
            t = arm_experts(records, arm, conc) if arm != report.BASELINE and k0_of.get(arm) else None
            if t is not None:
                cells.append((conc, arm, k0_of[arm], *t))
    return cells


def cost_section(records: Sequence[dict], summary: report.Summary, model_dir: str, label: str) -> str:
    """The markdown section (measures the micro-benchmarks: about 20 s); '' when no run recorded T."""
    cells = cost_cells(records, summary)
    if not cells:
        return ""
    from cost.step_cost import Shapes, describe, measure_step_costs  # torch: only when there is something to time

    with open(os.path.join(model_dir, "config.json")) as f:
        shapes = Shapes.of_config(json.load(f))
    costs = measure_step_costs([(c, k0, before, after) for c, _, k0, before, after in cells], shapes)
    parts = [f"## What OEA costs per decode step, and what it saved ({label})", "",
             f"Model shapes: {shapes.num_experts} experts, top-{shapes.top_k}, hidden {shapes.hidden}, expert FFN "
             f"{shapes.ffn}, {shapes.layers} MoE layers; B = C. Measured: T (the server's metrics) and TPOT (the "
             "server, paired by repeat); OEA's own work and the MoE work at each T (micro-benchmarks on this "
             "machine, one thread, after the server stopped). Estimated: net = saved - own work.", ""]
    for (conc, arm, *_), cost in zip(cells, costs):
        parts += [f"C={conc}, {arm}:", describe(cost), tpot_line(records, arm, conc, cost.net_ms), ""]
    return "\n".join(parts)


def tpot_line(records: Sequence[dict], arm: str, conc: int, net_ms: float) -> str:
    """The server's paired TPOT difference, set beside the estimated net saving per step."""
    saving = paired_tpot_saving(records, arm, conc)
    if saving is None:
        return "  TPOT in the server: no paired runs"
    spread = f" (min-max {saving.lo:+.2f} to {saving.hi:+.2f} over {saving.n} repeats)" if saving.n > 1 else ""
    return (f"  TPOT in the server (measured): baseline - {arm} = {saving.median:+.2f} ms{spread}, "
            f"against {net_ms:+.2f} ms estimated")
