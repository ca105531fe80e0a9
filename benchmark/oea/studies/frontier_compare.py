"""The frontier's rows and matched-T comparisons: per-sequence NLL differences, their paired
batch-cluster intervals (common/stats.py), the comparisons of the new policies with OEA and the
budget at matched T, and the verdicts.

per_seq maps row_id(row) to that row's per-sequence NLL per token, [n] float64; the n sequences
form static batches of `batch` consecutive rows (evaluate's batches), the unit of resampling.
"""

import json
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from common import stats
from studies.frontier_eval import Scored

ROW_KEYS = ("model", "policy", "knob", "batch", "mean_T", "T_plain", "nll", "nll_plain", "acc",
            "acc_plain", "nll_delta_lo", "nll_delta_hi")
PERCENTILES = (5, 25, 50, 75, 95)
BOOTSTRAP_RESAMPLES = 2000
NEW = ("oea_mass", "oea_budget")
PEERS = ("oea", "budget")
RATIO_TARGETS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
POLICY_ORDER = ("plain", "pruned", "top_p", "budget", "oea", "oea_mass", "oea_budget")
VERDICTS = ("better", "overlaps", "worse", "inconclusive")

# Below this many static batches the cluster bootstrap's interval is not trusted (verdicts read
# inconclusive): 4 batches have only 35 distinct resamples, the bootstrap's spread is sqrt(3/4) of
# the usual standard error, and 95% over 4 units takes t(3) = 3.18 standard errors, not 1.96: the
# percentile interval is about half as wide as it should be.
MIN_CLUSTERS = 10


def interval_cell(delta: torch.Tensor, batch: int) -> Dict:
    """Mean of paired per-sequence differences delta [n], its 95% batch-cluster interval, and the
    number of clusters (batches): {"diff", "lo", "hi", "clusters"}.

    Entry i belongs to static batch i // batch, and the sequences of one batch share their routing,
    so a resample draws whole batches with replacement (stats.cluster_mean_ci). Paired: both arms
    of a difference get the same drawn batches."""
    lo, hi = stats.cluster_mean_ci(delta.double(), batch, BOOTSTRAP_RESAMPLES)
    return {"diff": float(delta.double().mean()), "lo": lo, "hi": hi, "clusters": delta.numel() // batch}


def t_stats(steps: torch.Tensor) -> Dict:
    """Mean, percentiles and per-layer means of T over layer-steps [batches, layers, L]."""
    flat = steps.double().reshape(-1)
    out = {"mean": float(flat.mean())}
    out.update({f"p{q}": float(flat.quantile(q / 100)) for q in PERCENTILES})
    out["max"] = float(flat.max())
    out["per_layer"] = [round(float(x), 3) for x in steps.double().mean(dim=(0, 2))]
    return out


def summary_row(model: str, policy: str, knob, batch: int, got: Scored, base: Scored) -> Dict:
    """One frontier.json row: ROW_KEYS first, then T's distribution and timing."""
    cell = interval_cell((got.nll - base.nll) / got.tokens, batch)  # paired differences per token
    predictions = got.nll.numel() * got.tokens
    t, t_plain = t_stats(got.steps), t_stats(base.steps)
    row = {"model": model, "policy": policy, "knob": knob, "batch": batch,
           "mean_T": t["mean"], "T_plain": t_plain["mean"],
           "nll": float(got.nll.sum()) / predictions, "nll_plain": float(base.nll.sum()) / predictions,
           "acc": float(got.correct.sum()) / predictions, "acc_plain": float(base.correct.sum()) / predictions,
           "nll_delta_lo": cell["lo"], "nll_delta_hi": cell["hi"], "clusters": cell["clusters"]}
    row.update({"nll_delta": row["nll"] - row["nll_plain"], "T_ratio": t["mean"] / t_plain["mean"],
                "T": t, "sequences": got.nll.numel(), "continuation": got.tokens, "seconds": got.seconds})
    return row


def curve_at(rows: Sequence[Dict], per_seq: Dict[str, torch.Tensor], target: float) -> Optional[torch.Tensor]:
    """Per-sequence NLL [n] (per token) of a policy at mean T = target, interpolated linearly in T
    between the two knobs around it (one policy's rows); None outside its range of T."""
    pts = sorted(rows, key=lambda r: r["mean_T"])
    for lo, hi in zip(pts, pts[1:]):
        if lo["mean_T"] <= target <= hi["mean_T"]:
            span = hi["mean_T"] - lo["mean_T"]
            frac = 0.0 if span == 0 else (target - lo["mean_T"]) / span
            return (1 - frac) * per_seq[row_id(lo)] + frac * per_seq[row_id(hi)]
    exact = [r for r in pts if abs(r["mean_T"] - target) < 1e-9]
    return per_seq[row_id(exact[0])] if exact else None


def row_id(row: Dict) -> str:
    """A row's key in the per-sequence table."""
    return f"{row['model']}|{row['policy']}|{json.dumps(row['knob'])}|{row['batch']}"


def paired_at(rows_a, rows_b, per_seq, target: float) -> Optional[Dict]:
    """Mean and 95% paired batch-cluster bootstrap interval of NLL(a) - NLL(b) per token at mean
    T = target (rows of one model and B)."""
    a, b = curve_at(rows_a, per_seq, target), curve_at(rows_b, per_seq, target)
    if a is None or b is None:
        return None
    return {"T": target, **interval_cell(a - b, rows_a[0]["batch"])}


def with_cluster_intervals(rows: Sequence[Dict], per_seq) -> List[Dict]:
    """rows with nll_delta_lo / nll_delta_hi / clusters recomputed from the per-sequence NLLs:
    the paired batch-cluster interval against plain routing at the same model and B (what
    summary_row computes, for a report rewritten from saved rows). ROW_KEYS stay first."""
    plain = {(r["model"], r["batch"]): per_seq[row_id(r)] for r in rows if r["policy"] == "plain"}
    out = []
    for row in rows:
        cell = interval_cell(per_seq[row_id(row)] - plain[row["model"], row["batch"]], row["batch"])
        new = {k: row[k] for k in ROW_KEYS}
        new.update(nll_delta_lo=cell["lo"], nll_delta_hi=cell["hi"], clusters=cell["clusters"])
        new.update((k, v) for k, v in row.items() if k not in new)
        out.append(new)
    return out


def groups_of(rows: Sequence[Dict]) -> Dict[Tuple[str, int], Dict[str, List[Dict]]]:
    """rows by (model, batch), then by policy."""
    out: Dict[Tuple[str, int], Dict[str, List[Dict]]] = {}
    for row in rows:
        out.setdefault((row["model"], row["batch"]), {}).setdefault(row["policy"], []).append(row)
    return out


def policy_curves(group: Dict[str, List[Dict]]) -> Dict[str, List[Dict]]:
    """Each policy's rows, with plain's row (T = T_plain, delta 0) as its k = K end point."""
    plain_rows = group.get("plain", [])
    return {name: rows + plain_rows for name, rows in group.items() if name != "plain"}


def matched_cell(curve: Sequence[Dict], plain_row: Dict, per_seq, target: float) -> Optional[Dict]:
    """A policy's NLL delta to plain at mean T = target (interpolated per sequence), interval."""
    got = curve_at(curve, per_seq, target)
    if got is None:
        return None
    return interval_cell(got - per_seq[row_id(plain_row)], plain_row["batch"])


def comparisons(rows: Sequence[Dict], per_seq) -> List[Dict]:
    """Paired new-policy-minus-peer NLL differences at matched T, per (model, B, new, peer):
    at the peer's own knobs' T (OEA's k0 points; the budgets') and at RATIO_TARGETS x T_plain."""
    out = []
    for (model, batch), group in groups_of(rows).items():
        curves = policy_curves(group)
        t_plain = group["plain"][0]["mean_T"]
        for new in NEW:
            for peer in PEERS:
                if new not in curves or peer not in curves:
                    continue
                knob_ts = {r["mean_T"] for r in group[peer]}
                for target in sorted(knob_ts | {f * t_plain for f in RATIO_TARGETS}):
                    got = paired_at(curves[new], curves[peer], per_seq, target)
                    if got is not None:
                        got.update(model=model, batch=batch, new=new, peer=peer, T_ratio=target / t_plain,
                                   at_peer_knob=target in knob_ts,
                                   clear=verdict_of(got))
                        out.append(got)
    return out


VERDICTS = ("better", "overlaps", "worse", "inconclusive")


def verdict_of(pair: Dict) -> str:
    """better / worse (the interval clears zero), overlaps, identical (the same routing: e.g.
    oea_budget below its bases' union is oea), or inconclusive (fewer than MIN_CLUSTERS batches,
    whatever the interval says)."""
    if pair["lo"] == pair["hi"] == 0:
        return "identical"
    if pair["clusters"] < MIN_CLUSTERS:
        return "inconclusive"
    return "better" if pair["hi"] < 0 else "worse" if pair["lo"] > 0 else "overlaps"


def batches_text(clusters: int) -> str:
    """'4 batches', '1 batch'."""
    return f"{clusters} batch" + ("" if clusters == 1 else "es")


def verdict_text(verdict: str, clusters: int) -> str:
    """A verdict as frontier.md writes it: 'inconclusive (4 batches)'."""
    return f"inconclusive ({batches_text(clusters)})" if verdict == "inconclusive" else verdict


def untrusted(clusters: int, what: str) -> str:
    """'4 batches: <what> not trusted' below MIN_CLUSTERS batches, else ''."""
    return f"{batches_text(clusters)}: {what} not trusted" if clusters < MIN_CLUSTERS else ""


def verdicts(pairs: Sequence[Dict], lo_ratio: float = 0.3, hi_ratio: float = 0.9) -> List[Dict]:
    """Per (new, peer, B): does the new policy's interval clear zero (better) at every knob of
    the peer with T/T_plain in [lo_ratio, hi_ratio], on every model? answer: yes, no, or
    inconclusive (too few batches for the interval to decide).

    Only the peer's own knobs count: there the peer is measured, not interpolated, while the new
    policy is interpolated between two knobs, which overstates its NLL where its curve is convex
    (linear interpolation would flatter whichever side is interpolated). Identical points are
    left out."""
    out = []
    keys = sorted({(p["new"], p["peer"], p["batch"]) for p in pairs})
    for new, peer, batch in keys:
        mine = [p for p in pairs if (p["new"], p["peer"], p["batch"]) == (new, peer, batch)]
        per_model = {}
        for p in mine:
            if p["at_peer_knob"] and lo_ratio <= p["T_ratio"] <= hi_ratio and p["clear"] != "identical":
                per_model.setdefault(p["model"], []).append(p["clear"])
        counts = {m: {c: v.count(c) for c in VERDICTS} for m, v in per_model.items()}
        seen = set().union(*per_model.values()) if per_model else set()
        beats = bool(per_model) and seen == {"better"}
        answer = "yes" if beats else "inconclusive" if "inconclusive" in seen else "no"
        out.append({"new": new, "peer": peer, "batch": batch, "clusters": min(p["clusters"] for p in mine),
                    "per_model": counts, "beats_everywhere": beats, "answer": answer})
    return out
