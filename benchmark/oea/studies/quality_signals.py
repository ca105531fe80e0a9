"""Candidate live quality signals of OEA, per routed token, from the router's scores and the final
expert set; a frontier gate that records them; and the rank-correlation bootstrap of signal_study.py.

Shape legend: M = routed token rows (one MoE layer each), N = routed experts, K = columns of a
row's ids (top-k, plus any fused shared-expert columns), L = decode positions, R = rows of a
forward, C = cells, G = blocks (independent clusters of sequences), H = histogram bins.

Definitions. For one token at one MoE layer:
    w_e   the router's weight score of routed expert e: softmax(logits) for Qwen-style routers,
          sigmoid(logits) WITHOUT the correction bias for GLM/DeepSeek-style ones (the bias only
          ranks experts; it never weighs them). Any row constant (top-k renormalisation, the
          routed scaling factor) cancels in every signal below.
    S     the original set: the router's own top-k ids, routed experts only (ids in [0, N));
          fused shared-expert columns (ids >= N) and unused columns (-1) are excluded.
    F     the final set: the routed ids OEA gives the token with a positive weight (fill slots
          carry weight 0 and are not in it).
    p     the original weights: p_e = w_e / sum_S w on S, 0 elsewhere.
    q     the final weights: q_e = w_e / sum_F w on F, 0 elsewhere.
Signals (KEPT ones are 1 when OEA changes nothing, COST ones 0):
    mass_kept   sum_{S & F} w / sum_S w: the share of the original top-k score mass the final set
                keeps, before renormalisation.
    final_mass  sum_F w / sum_S w: the final set's score mass relative to the original's (it
                credits the refilled experts; above 1 is possible under a correction bias).
    overlap     |S & F| / |S|: the share of the original top-k set kept.
    top1_kept   1 when the original expert of highest w (ties to the lower id) is in F.
    js          Jensen-Shannon divergence of p and q, nats, in [0, ln 2]:
                (KL(p || m) + KL(q || m)) / 2 with m = (p + q) / 2. Both plain KL directions are
                infinite for almost every changed token, since OEA both drops experts of S (q = 0
                where p > 0) and adds experts outside S (p = 0 where q > 0); JS is the KL of each
                to their midpoint: finite, zero exactly when p = q, no smoothing constant.
    tv          total variation 0.5 * sum |p - q|, in [0, 1]: the mixing weights' share that
                moved, which bounds the change of the layer's routed output (relative to its
                largest expert output) by 2 tv.
"""

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from scipy import stats

from sglang_oea.routing import score_experts
from studies import frontier_eval as fe

KEPT, COST = "kept", "cost"
# name -> direction; a KEPT signal predicts more cost when it is lower.
SIGNALS: Dict[str, str] = {"mass_kept": KEPT, "final_mass": KEPT, "overlap": KEPT, "top1_kept": KEPT,
                           "js": COST, "tv": COST}
# Histogram range of each signal for the tail bootstrap (values are clipped into it).
RANGES: Dict[str, Tuple[float, float]] = {"final_mass": (0.0, 2.0), "js": (0.0, float(np.log(2.0)))}
BINS = 2000


def set_mask(ids: torch.Tensor, num_experts: int, active: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[M, N] bool: the routed experts (ids in [0, N), and active where given) of ids [M, K]."""
    keep = (ids >= 0) & (ids < num_experts)
    if active is not None:
        keep = keep & active
    mask = torch.zeros(ids.shape[0], num_experts + 1, dtype=torch.bool, device=ids.device)
    return mask.scatter(1, torch.where(keep, ids, num_experts).long(), True)[:, :num_experts]


def token_signals(weight: torch.Tensor, original_ids: torch.Tensor, final_ids: torch.Tensor,
                  final_weights: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Every signal of SIGNALS per row (see the module docstring), float64 [M].

    Args:
        weight: [M, N] the router's weight scores w (softmax, or sigmoid without bias).
        original_ids: [M, K] the router's own ids; columns outside [0, N) are ignored.
        final_ids: [M, K'] the ids after OEA; final_weights: [M, K'] their weights (0 = unused).
    """
    num_experts = weight.shape[1]
    w = weight.double()
    orig = set_mask(original_ids, num_experts)
    final = set_mask(final_ids, num_experts, final_weights > 0)
    tiny = torch.finfo(torch.float64).tiny
    w_orig = (w * orig).sum(dim=1)
    w_final = (w * final).sum(dim=1)
    p = w * orig / w_orig.clamp_min(tiny)[:, None]
    q = w * final / w_final.clamp_min(tiny)[:, None]
    mid = (p + q) / 2
    kl_to_mid = lambda x: (torch.xlogy(x, x) - torch.xlogy(x, mid)).sum(dim=1)  # noqa: E731  (0 log 0 = 0)
    # argmax returns the first maximum: ties go to the lower id.
    top1 = w.masked_fill(~orig, float("-inf")).argmax(dim=1, keepdim=True)
    return {"mass_kept": (w * (orig & final)).sum(dim=1) / w_orig.clamp_min(tiny),
            "final_mass": w_final / w_orig.clamp_min(tiny),
            "overlap": (orig & final).sum(dim=1).double() / orig.sum(dim=1).clamp_min(1),
            "top1_kept": final.gather(1, top1)[:, 0].double(),
            "js": ((kl_to_mid(p) + kl_to_mid(q)) / 2).clamp_min(0),
            "tv": (p - q).abs().sum(dim=1) / 2}


class SignalGate(fe.BatchRoutedGate):
    """The frontier's BatchRoutedGate, also recording each decode row's token_signals.

    After each routed forward of R rows, `records` gains {signal: [L, R] float64}, rows in the
    forward's order (the gate's by_step layout). Prompt positions are not recorded: OEA never
    routes them.
    """

    def __init__(self, gate: torch.nn.Module):
        super().__init__(gate)
        self.records: List[Dict[str, torch.Tensor]] = []

    def forward(self, hidden_states: torch.Tensor):
        logits, weights, ids = super().forward(hidden_states)
        if self.policy is not None:
            self.records.append(self.decode_signals(hidden_states, logits, weights, ids))
        return logits, weights, ids

    def decode_signals(self, hidden_states, logits, weights, ids) -> Dict[str, torch.Tensor]:
        """{signal: [L, R]} of the decode rows, against the router's own ids (routed again: the
        router is deterministic, and the parent's forward does not hand them out)."""
        original = self.gate(hidden_states)[2]
        decode = lambda x: self.by_step(x)[self.prompt_len:]  # noqa: E731  [L, R, X]
        weight = decode(score_experts(logits, self.spec)[1])
        steps, rows, experts = weight.shape
        flat = lambda x: decode(x).reshape(steps * rows, -1)  # noqa: E731
        got = token_signals(weight.reshape(-1, experts), flat(original.long()), flat(ids.long()), flat(weights.float()))
        return {name: value.view(steps, rows) for name, value in got.items()}


def install_signal_gates(model) -> List[SignalGate]:
    """Wrap every MoE router of a freshly loaded model in a SignalGate (fe.install then keeps
    them: it wraps only unwrapped routers)."""
    gates = []
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if hasattr(gate, "top_k"):
            layer.mlp.gate = SignalGate(gate)
            gates.append(layer.mlp.gate)
    if not gates:
        raise ValueError("no MoE router found (a Qwen3-MoE, GLM-4-MoE or DeepSeek-V3 model is expected)")
    return gates


def collect(gates: Sequence[SignalGate]) -> Dict[str, torch.Tensor]:
    """{signal: [n, layers, L]} of the forwards recorded since the last collect (then cleared)."""
    per_gate = [{name: torch.cat([r[name] for r in gate.records], dim=1) for name in SIGNALS} for gate in gates]
    for gate in gates:
        gate.records = []
    return {name: torch.stack([g[name] for g in per_gate]).permute(2, 0, 1).contiguous() for name in SIGNALS}


def block_histograms(values: np.ndarray, name: str) -> np.ndarray:
    """[G, H] counts of each block's values [G, m] of signal `name` over its RANGES (clipped)."""
    lo, hi = RANGES.get(name, (0.0, 1.0))
    clipped = np.clip(values, lo, hi)
    return np.stack([np.histogram(row, bins=BINS, range=(lo, hi))[0] for row in clipped])


def histogram_quantile(counts: np.ndarray, name: str, q: float) -> np.ndarray:
    """The q-quantile (lower bin edge of the bin holding it) of histograms counts [..., H]."""
    lo, hi = RANGES.get(name, (0.0, 1.0))
    cum = np.cumsum(counts, axis=-1)
    target = q * cum[..., -1:]
    index = (cum <= target).sum(axis=-1)  # the first bin whose cumulative count exceeds the target
    return lo + (hi - lo) * np.minimum(index, BINS - 1) / BINS


def spearman(x: Sequence[float], y: Sequence[float]) -> Optional[float]:
    """Spearman's rank correlation (ties at their mean rank); None with fewer than 3 points or a
    constant side, where it is undefined."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.size < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    return float(stats.spearmanr(x, y).statistic)


def block_means(values: np.ndarray) -> np.ndarray:
    """Cell values from block statistics [C, G'] of equal blocks: their mean over blocks, [C]."""
    return values.mean(axis=1)


@dataclass
class Stratum:
    """One independent set of blocks (one model): per cell and block, the signal's block
    statistic signal [C, G, ...] and the cost's block mean cost [C, G]. reduce maps the signal of
    a selection of blocks [C, G', ...] to cell values [C] (block_means for a mean; a histogram
    quantile for a tail)."""

    signal: np.ndarray
    cost: np.ndarray
    reduce: Callable[[np.ndarray], np.ndarray] = field(default=block_means)

    def cells(self, drawn: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(signal [C], cost [C]) over the blocks drawn [G'] (with repeats)."""
        return self.reduce(self.signal[:, drawn]), self.cost[:, drawn].mean(axis=1)


def rank_correlation(strata: Sequence[Stratum], resamples: int = 2000, seed: int = 0) -> Dict:
    """Spearman of signal and cost over the cells of all strata, with a 95% percentile bootstrap
    interval that redraws each stratum's blocks with replacement, independently per stratum
    (scipy.stats.bootstrap, unpaired samples of block indices, rng seeded).

    A block is a set of sequences that shares nothing with other blocks; every cell of a stratum
    is computed on the same sequences, so a resample keeps the drawn blocks for all its cells.
    Returns {"rho", "lo", "hi", "cells", "blocks"}; rho None where undefined (a constant side),
    the interval None then or when a stratum has fewer than 2 blocks.
    """
    def rho_of(*drawn):
        parts = [s.cells(np.asarray(d, dtype=np.int64)) for s, d in zip(strata, drawn)]
        got = spearman(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
        return np.nan if got is None else got

    everything = [np.arange(s.cost.shape[1]) for s in strata]
    rho = rho_of(*everything)
    out = {"rho": None if np.isnan(rho) else float(rho), "lo": None, "hi": None,
           "cells": int(sum(s.cost.shape[0] for s in strata)), "blocks": [int(s.cost.shape[1]) for s in strata]}
    if out["rho"] is None or min(out["blocks"]) < 2:
        return out
    got = stats.bootstrap(tuple(everything), rho_of, n_resamples=resamples, method="percentile", paired=False,
                          vectorized=False, rng=np.random.default_rng(seed)).confidence_interval
    if not (np.isnan(got.low) or np.isnan(got.high)):
        out.update(lo=float(got.low), hi=float(got.high))
    return out


def oriented(result: Dict, direction: str) -> Dict:
    """rank_correlation's result oriented so that +1 means the signal ranks the cells exactly as
    their cost does: a KEPT signal's rho and interval change sign, a COST one's stay."""
    if direction == COST:
        return dict(result)
    flip = lambda v: None if v is None else -v  # noqa: E731
    return {**result, "rho": flip(result["rho"]), "lo": flip(result["hi"]), "hi": flip(result["lo"])}
