"""What an OEA server's /metrics says: the OEA samples around one benchmark run, the share of
decode steps where OEA applied over an arm, the mean kept router mass over an arm, and SGLang's
accept length over a run.

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
from typing import Dict, Iterator, Optional, Sequence, Tuple, Union

from common.http import http_get

METRIC_PREFIX = "sglang:oea_"
APPLIED = METRIC_PREFIX + "decode_steps_applied_total"
SKIPPED = METRIC_PREFIX + "decode_steps_skipped_total"
NOT_DECODE = "not_decode"  # skip reason of prefill / extend passes: not decode steps
# SGLang's own counters behind accept length: both are counted when a request finishes (in the
# tokenizer manager), not per decode-log interval, so a run's delta is exactly its own requests'.
GENERATION_TOKENS = "sglang:generation_tokens_total"
VERIFY_CALLS = "sglang:spec_verify_calls_total"
SPEC_COUNTERS = (GENERATION_TOKENS, VERIFY_CALLS)
# Kept router mass (docs/quality-signal.md): the lost mass (1 - kept) summed over routed tokens and
# MoE layers, and the count of those token-layers, both per k0 and mode (skipped steps count 1.0 kept).
MASS_LOST = METRIC_PREFIX + "router_mass_lost_total"
TOKEN_LAYERS = METRIC_PREFIX + "routed_token_layers_total"
APPLIED_DEFINITION = ("applied / (applied + skipped for every reason but not_decode), counter deltas of the "
                      "OEA server's /metrics over the arm, counting only the steps labelled with the arm's k0 "
                      "(the counters reach /metrics once per --decode-log-interval, so an earlier arm's last "
                      "steps may appear during this one: its label tells them apart), lowest tp_rank")
ACCEPT_DEFINITION = ("completion tokens / verify passes of the run's requests (deltas of SGLang's "
                     "sglang:generation_tokens_total and sglang:spec_verify_calls_total, counted as each request "
                     "finishes): SGLang's per-request accept length, pooled over the run")
KEPT_MASS_DEFINITION = ("1 - lost / routed token-layers, deltas of sglang:oea_router_mass_lost_total and "
                        "sglang:oea_routed_token_layers_total over the arm's runs, counting only the samples labelled "
                        "with the arm's k0 (decode and verify pooled), lowest tp_rank")
KEPT_MASS_NOTE = ("Kept router mass: per routed token and MoE layer, the share of the token's own top-k router weight "
                  "whose experts OEA kept, averaged over every decode (and verify) step of the arm (1.0 where OEA "
                  "changed nothing: the steps it skipped, the baseline); lower means OEA gave up more of the router's own choice. "
                  "See docs/quality-signal.md and docs/metrics.md in sglang-oea. Computed as " + KEPT_MASS_DEFINITION)


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


def labelled(samples: Dict[str, float], names: Sequence[str], k0: Optional[int]) -> Iterator[Tuple[str, Dict, float]]:
    """(name, {label: value}, value) of each sample named in `names` that counts for a window run
    at k0 (label_matches)."""
    for key, value in samples.items():
        match = _SAMPLE.match(f"{key} {value}")
        if not match or match.group(1) not in names:
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        if label_matches(labels, k0):
            yield match.group(1), labels, value


def step_counters(samples: Dict[str, float], k0: Optional[int] = None) -> Dict[str, Dict]:
    """Applied / skipped step counters of {"name{labels}": value} samples, per tp_rank ('' when
    unlabelled), only the steps that ran with `k0` (label_matches).

    Returns {rank: {"applied": float, "skipped": {reason: float}}}; labels other than tp_rank and
    reason (model_name, mode) are summed over.
    """
    out: Dict[str, Dict] = {}
    for name, labels, value in labelled(samples, (APPLIED, SKIPPED), k0):
        rank = out.setdefault(labels.get("tp_rank", ""), {"applied": 0.0, "skipped": {}})
        if name == APPLIED:
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


def mass_counters(samples: Dict[str, float], k0: Optional[int] = None) -> Dict[str, Dict[str, float]]:
    """Kept-router-mass counters of {"name{labels}": value} samples, per tp_rank, only the samples
    labelled with k0 (label_matches), other labels (model_name, dp_rank, mode) summed over.

    Returns {rank: {"lost": float, "token_layers": float}}, only ranks that export the token-layer
    counter (a lost-mass series not yet created counts 0).
    """
    out: Dict[str, Dict[str, float]] = {}
    for name, labels, value in labelled(samples, (MASS_LOST, TOKEN_LAYERS), k0):
        rank = out.setdefault(labels.get("tp_rank", ""), {})
        key = "lost" if name == MASS_LOST else "token_layers"
        rank[key] = rank.get(key, 0.0) + value
    return {r: {"lost": c.get("lost", 0.0), "token_layers": c["token_layers"]}
            for r, c in out.items() if "token_layers" in c}


def mass_delta(before: Dict[str, float], after: Dict[str, float], k0: Optional[int] = None) -> Optional[Dict]:
    """What the kept-mass counters labelled k0 grew by between two sample dicts, on the lowest
    tp_rank: {"lost", "token_layers", "tp_rank"}; None when `after` has no such counter (a plugin
    without kept router mass, or no step at k0 yet)."""
    after_counts = mass_counters(after, k0)
    rank = lowest_rank(after_counts)
    if rank is None:
        return None
    old = mass_counters(before, k0).get(rank, {"lost": 0.0, "token_layers": 0.0})
    return {"lost": after_counts[rank]["lost"] - old["lost"],
            "token_layers": after_counts[rank]["token_layers"] - old["token_layers"], "tp_rank": rank or None}


def kept_of(deltas: Sequence[Optional[Dict]]) -> Optional[float]:
    """Mean kept router mass pooled over mass_delta results: 1 - sum(lost) / sum(token_layers);
    None when none counted a token."""
    counted = [d for d in deltas if d]
    layers = sum(d["token_layers"] for d in counted)
    return 1.0 - sum(d["lost"] for d in counted) / layers if layers > 0 else None


Samples = Union[str, Dict[str, float], None]


def kept_router_mass(before: Samples, after: Samples, k0: Optional[int] = None) -> Optional[float]:
    """A window's mean kept router mass at k0 (KEPT_MASS_DEFINITION), from two /metrics pages or
    sample dicts (scrape_oea_metrics) read before and after it. Only the samples labelled k0 count,
    so another arm's late steps in the window are left out; the lowest tp_rank is read. None when a
    page is missing, the counters are absent (a plugin without them), or no token was counted."""
    if before is None or after is None:
        return None
    before, after = (oea_samples(p) if isinstance(p, str) else p for p in (before, after))
    return kept_of([mass_delta(before, after, k0)])


def kept_mass_in_runs(records: Sequence[Dict]) -> Optional[float]:
    """Mean kept router mass pooled over benchmark runs (records of results.jsonl), each counted
    from its oea_metrics_delta at its own k0 (run_k0); None when no run has the counters."""
    return kept_of([mass_delta({}, r["oea_metrics_delta"], run_k0(r)) for r in records
                    if r.get("oea_metrics_delta") and not r.get("error")])
