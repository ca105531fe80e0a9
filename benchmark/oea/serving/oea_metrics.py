"""What an OEA server's /metrics says: the OEA samples around one benchmark run, the share of
decode steps where OEA applied over an arm, and SGLang's accept length over a run.

Standard library only. The plugin exports Prometheus samples named sglang:oea_* (counters end in
_total; gauges, such as the per-layer expert counts, hold the latest reading).

Attribution by the k0 label. The step counters carry a `k0` label: the k0 each step ran with.
They reach /metrics only once per --decode-log-interval steps, so the last steps of one arm can
appear while the next arm runs. Every reader here therefore counts, over a window, only the
samples labelled with the window's own k0 (`k0=` arguments): a previous arm's late steps, labelled
with its k0, are never taken for the next arm's. A window's own last steps that reach /metrics
after it are missed by it (less than one interval); samples without a k0 label (older plugin
versions) are counted as they come.
"""

import re
from typing import Dict, Optional

from serving.servers import http_get

METRIC_PREFIX = "sglang:oea_"
APPLIED = METRIC_PREFIX + "decode_steps_applied_total"
SKIPPED = METRIC_PREFIX + "decode_steps_skipped_total"
NOT_DECODE = "not_decode"  # skip reason of prefill / extend passes: not decode steps
# SGLang's own counters behind accept length: both are counted when a request finishes (in the
# tokenizer manager), not per decode-log interval, so a run's delta is exactly its own requests'.
GENERATION_TOKENS = "sglang:generation_tokens_total"
VERIFY_CALLS = "sglang:spec_verify_calls_total"
SPEC_COUNTERS = (GENERATION_TOKENS, VERIFY_CALLS)
APPLIED_DEFINITION = ("applied / (applied + skipped for every reason but not_decode), counter deltas of the "
                      "OEA server's /metrics over the arm, counting only the steps labelled with the arm's k0 "
                      "(the counters reach /metrics once per --decode-log-interval, so an earlier arm's last "
                      "steps may appear during this one: its label tells them apart), lowest tp_rank")
ACCEPT_DEFINITION = ("completion tokens / verify passes of the run's requests (deltas of SGLang's "
                     "sglang:generation_tokens_total and sglang:spec_verify_calls_total, counted as each request "
                     "finishes): SGLang's per-request accept length, pooled over the run")


def scrape_oea_metrics(base_url: str) -> Optional[Dict[str, float]]:
    """The samples of /metrics whose name contains 'oea' (case-insensitive), and SGLang's two
    counters behind accept length (SPEC_COUNTERS), as {"name{labels}": value}; None without /metrics."""
    body = http_get(base_url + "/metrics")
    return None if body is None else oea_samples(body)


def oea_samples(text: str) -> Dict[str, float]:
    """What scrape_oea_metrics keeps of a /metrics page: {"name{labels}": value}."""
    out = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if not line or line.startswith("#") or ("oea" not in name.lower() and name not in SPEC_COUNTERS):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def counter_deltas(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, float]:
    """What each counter (a `*_total` sample) grew by during a run. Gauges are left out: the
    difference of two "most recent" readings means nothing."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if k.split("{")[0].endswith("_total")}


_SAMPLE = re.compile(r"^([^#\s{]+)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def label_matches(labels: Dict[str, str], k0: Optional[int]) -> bool:
    """Whether a step counter's sample counts for a window run at k0: any sample when k0 is None,
    else one labelled k0 (or with no k0 label: an older plugin)."""
    return k0 is None or labels.get("k0", str(k0)) == str(k0)


def step_counters(samples: Dict[str, float], k0: Optional[int] = None) -> Dict[str, Dict]:
    """Applied / skipped step counters of {"name{labels}": value} samples, per tp_rank ('' when
    unlabelled), only the steps that ran with `k0` (label_matches).

    Returns {rank: {"applied": float, "skipped": {reason: float}}}; labels other than tp_rank and
    reason (model_name, mode) are summed over.
    """
    out: Dict[str, Dict] = {}
    for key, value in samples.items():
        match = _SAMPLE.match(f"{key} {value}")
        if not match or match.group(1) not in (APPLIED, SKIPPED):
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        if not label_matches(labels, k0):
            continue
        rank = out.setdefault(labels.get("tp_rank", ""), {"applied": 0.0, "skipped": {}})
        if match.group(1) == APPLIED:
            rank["applied"] += value
        else:
            reason = labels.get("reason", "")
            rank["skipped"][reason] = rank["skipped"].get(reason, 0.0) + value
    return out


def parse_oea_counters(text: str, k0: Optional[int] = None) -> Dict[str, Dict]:
    """step_counters of a /metrics page."""
    return step_counters(oea_samples(text), k0)


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


def applied_share(before: Optional[str], after: Optional[str], k0: Optional[int] = None) -> Optional[Dict]:
    """Share of decode steps where OEA applied during an arm run at `k0`, from two /metrics pages.

    Decode steps = applied + every skip reason except not_decode (prefill / extend passes). Only
    the steps labelled with k0 count (None: every step), so another arm's steps that reach /metrics
    during this window are left out. Reads the lowest tp_rank only (each rank of a TP server counts
    the same steps). None when the server exports no OEA counters.
    """
    if before is None or after is None:
        return None
    return steps_share(oea_samples(before), oea_samples(after), k0)


def steps_share(before: Dict[str, float], after: Dict[str, float], k0: Optional[int] = None) -> Optional[Dict]:
    """applied_share of two scraped sample dicts (scrape_oea_metrics)."""
    after_counters = step_counters(after, k0)
    rank = lowest_rank(after_counters)
    if rank is None:
        return None
    delta = counter_delta(step_counters(before, k0), after_counters, rank)
    decode = delta["applied"] + sum(v for r, v in delta["skipped"].items() if r != NOT_DECODE)
    return {"share": delta["applied"] / decode if decode else None, "applied_steps": delta["applied"],
            "decode_steps": decode, "skipped_steps": delta["skipped"], "tp_rank": rank or None, "k0": k0,
            "definition": APPLIED_DEFINITION}


def metric_mean(sample: Dict[str, float], name: str) -> Optional[float]:
    """Mean of one metric's samples over its labels (e.g. layers), or None when it has none."""
    vals = [v for k, v in sample.items() if k.split("{")[0] == name]
    return sum(vals) / len(vals) if vals else None


def run_k0(record: Dict) -> Optional[int]:
    """The k0 a benchmark run's steps ran with: the one-server arm's live oea_k0 (0 for the
    baseline), else the arm's k0 (two servers; None for a baseline without the plugin)."""
    live = record.get("oea_live") or {}
    return live.get("oea_k0", record.get("k0"))


def applied_in_run(record: Dict) -> Optional[float]:
    """Decode steps OEA applied during one benchmark run, counting only the steps labelled with the
    run's own k0 (run_k0), every rank and mode summed; None when the record has no counter deltas."""
    delta = record.get("oea_metrics_delta")
    if delta is None:
        return None
    return sum(c["applied"] for c in step_counters(delta, run_k0(record)).values())


def accept_length_in_run(record: Dict) -> Optional[float]:
    """SGLang's accept length over one run (ACCEPT_DEFINITION), from its counter deltas; None
    without speculative decoding (no verify pass counted) or without deltas."""
    delta = record.get("oea_metrics_delta") or {}
    verify = sum(v for k, v in delta.items() if k.split("{")[0] == VERIFY_CALLS)
    tokens = sum(v for k, v in delta.items() if k.split("{")[0] == GENERATION_TOKENS)
    return tokens / verify if verify > 0 else None


def run_experts(record: Dict) -> Optional[Dict[str, float]]:
    """Distinct experts per MoE layer and decode step in one run's tail, from the gauges read after it:
    {"before": router's own, "after": after OEA, "ratio": after / before}, means over layers.

    The gauges hold the latest export, so they belong to this run only if OEA applied in it: None
    when its counter deltas show no applied step at its own k0 (one server: the reading would be
    another arm's), or when there is no ratio gauge. Records without deltas (older files) are taken
    as they are.
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
