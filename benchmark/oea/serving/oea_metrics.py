"""What an OEA server's /metrics says: the OEA samples around one benchmark run, and the share of
decode steps where OEA applied over a quality arm.

Standard library only. The plugin exports Prometheus samples named sglang:oea_* (counters end in
_total; gauges, such as the per-layer expert counts, hold the latest reading).
"""

import re
from typing import Dict, Optional

from serving.servers import http_get

METRIC_PREFIX = "sglang:oea_"
APPLIED = METRIC_PREFIX + "decode_steps_applied_total"
SKIPPED = METRIC_PREFIX + "decode_steps_skipped_total"
NOT_DECODE = "not_decode"  # skip reason of prefill / extend passes: not decode steps
APPLIED_DEFINITION = ("applied / (applied + skipped for every reason but not_decode), counter deltas of the "
                      "OEA server's /metrics over the OEA arm, lowest tp_rank; OEA exports its counters once per "
                      "--decode-log-interval, so start that server with --decode-log-interval 1 for exact counts")


def scrape_oea_metrics(base_url: str) -> Optional[Dict[str, float]]:
    """Prometheus samples whose name contains 'oea' (case-insensitive), or None without /metrics."""
    body = http_get(base_url + "/metrics")
    if body is None:
        return None
    out = {}
    for line in body.splitlines():
        if not line or line.startswith("#") or "oea" not in line.split("{")[0].split(" ")[0].lower():
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


def counter_deltas(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, float]:
    """What each counter (a `*_total` sample) grew by during a run. Gauges are left out: the
    difference of two "most recent" readings means nothing."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if k.split("{")[0].endswith("_total")}


_SAMPLE = re.compile(r"^([^#\s{]+)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_oea_counters(text: str) -> Dict[str, Dict]:
    """Applied / skipped step counters of a /metrics page, per tp_rank ('' when unlabelled).

    Returns {rank: {"applied": float, "skipped": {reason: float}}}; labels other than tp_rank and
    reason (model_name) are summed over.
    """
    out: Dict[str, Dict] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or match.group(1) not in (APPLIED, SKIPPED):
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        rank = out.setdefault(labels.get("tp_rank", ""), {"applied": 0.0, "skipped": {}})
        if match.group(1) == APPLIED:
            rank["applied"] += float(match.group(3))
        else:
            reason = labels.get("reason", "")
            rank["skipped"][reason] = rank["skipped"].get(reason, 0.0) + float(match.group(3))
    return out


def lowest_rank(counters: Dict[str, Dict]) -> Optional[str]:
    """The smallest tp_rank label (numerically when it is a number); None without counters."""
    if not counters:
        return None
    return min(counters, key=lambda r: (0, int(r), r) if r.isdigit() else (1, 0, r))


def counter_delta(before: Dict[str, Dict], after: Dict[str, Dict], rank: str) -> Dict:
    """after - before of one rank's counters (a rank or reason absent before counts from 0)."""
    old = before.get(rank, {"applied": 0.0, "skipped": {}})
    new = after[rank]
    skipped = {r: v - old["skipped"].get(r, 0.0) for r, v in new["skipped"].items()}
    return {"applied": new["applied"] - old["applied"], "skipped": skipped}


def applied_share(before: Optional[str], after: Optional[str]) -> Optional[Dict]:
    """Share of decode steps where OEA applied during an arm, from two /metrics pages.

    Decode steps = applied + every skip reason except not_decode (prefill / extend passes). Reads
    the lowest tp_rank only (each rank of a TP server counts the same steps). None when the server
    exports no OEA counters.
    """
    if before is None or after is None:
        return None
    after_counters = parse_oea_counters(after)
    rank = lowest_rank(after_counters)
    if rank is None:
        return None
    delta = counter_delta(parse_oea_counters(before), after_counters, rank)
    decode = delta["applied"] + sum(v for r, v in delta["skipped"].items() if r != NOT_DECODE)
    return {"share": delta["applied"] / decode if decode else None, "applied_steps": delta["applied"],
            "decode_steps": decode, "skipped_steps": delta["skipped"], "tp_rank": rank or None,
            "definition": APPLIED_DEFINITION}


def metric_mean(sample: Dict[str, float], name: str) -> Optional[float]:
    """Mean of one metric's samples over its labels (e.g. layers), or None when it has none."""
    vals = [v for k, v in sample.items() if k.split("{")[0] == name]
    return sum(vals) / len(vals) if vals else None


def applied_in_run(record: Dict) -> Optional[float]:
    """Decode steps OEA applied during one benchmark run (oea_metrics_delta, every rank and mode
    summed), or None when the record has no counter deltas."""
    delta = record.get("oea_metrics_delta")
    if delta is None:
        return None
    return sum(v for k, v in delta.items() if k.split("{")[0] == APPLIED)


def run_experts(record: Dict) -> Optional[Dict[str, float]]:
    """Distinct experts per MoE layer and decode step in one run's tail, from the gauges read after it:
    {"before": router's own, "after": after OEA, "ratio": after / before}, means over layers.

    The gauges hold the latest export, so they belong to this run only if OEA applied in it: None
    when its counter deltas show no applied step (one server: the reading would be another arm's),
    or when there is no ratio gauge. Records without deltas (older files) are taken as they are.
    """
    sample = record.get("oea_metrics")
    applied = applied_in_run(record)
    if record.get("error") or sample is None or applied == 0:
        return None
    ratio = metric_mean(sample, METRIC_PREFIX + "active_experts_ratio")
    if ratio is None:
        return None
    return {"before": metric_mean(sample, METRIC_PREFIX + "active_experts_before"),
            "after": metric_mean(sample, METRIC_PREFIX + "active_experts_after"), "ratio": ratio}
