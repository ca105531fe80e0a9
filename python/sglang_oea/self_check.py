"""Startup self-check of the fused kernel against the torch routing path. No SGLang import.

Each rank runs it once per routing shape, the first time it routes on CUDA and before any graph
capture: random router inputs with this model's exact N, K, shared-expert columns, scoring
(softmax, or sigmoid with this layer's correction bias and group restriction) and dtypes, at a
few batch sizes, one of them with padded rows. It passes when the kernel's ids equal the torch
path's exactly and its weights agree within WEIGHT_TOLERANCE (with counting on, its distinct-expert
counters equal reference.distinct_experts and its lost router mass, filed under k0 alone, is within
one unit per row of reference.lost_router_mass_units; with the rank check on, the checksum it folds
in equals reference.ids_checksum of the torch path's ids).

The kernel is launched with the counter arguments the routing shape names (stats=, lost=,
checksum=), as serving launches that shape: each is a compile-time constant of the kernel (STATS,
LOST, CHECKSUM), so the self-check compiles and checks the very variant that will serve, and a
compile error there is a failed self-check rather than a raise at the first CUDA-graph warm-up.

It runs with a k0 that exercises the kernel whatever the startup --oea-k0 is (0, armed but off,
or >= top-k, a no-op): live settings may later set any k0 (`trial_k0`). The kernel reads it from a
device control block, as in serving; the torch path is run with the same values.

Its verdict is this rank's alone; sglang_oea.routers makes the ranks agree on it.
"""

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from sglang_oea.config import MAX_K0
from sglang_oea.reference import batch_gate, distinct_experts, ids_checksum, lost_router_mass_units
from sglang_oea.routing import RouterSpec, route_from_logits, score_experts

# (rows, real rows) per trial: a single row, padded rows, a full batch.
TRIALS = ((1, 1), (9, 6), (32, 32))
# The kernel and the torch path compute the same float32 scores in a different order of
# operations (fused exp/sum); bf16 weights round the result once more.
WEIGHT_TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5)}
DEFAULT_TOLERANCE = dict(rtol=1e-3, atol=1e-5)


@dataclass(frozen=True)
class RoutingShape:
    """Everything about a routing call that selects a compiled kernel variant.

    num_experts: N; num_routed: K; num_columns: K + fused shared-expert columns.
    stats: the call adds distinct-expert counters (stats=); checksum: it folds the rank-check
    checksum of its ids in (checksum=); lost: it adds its lost router mass (lost=). Each selects
    a kernel constexpr (STATS, CHECKSUM, LOST): the caller names exactly the arguments it passes.
    """

    num_experts: int
    num_routed: int
    num_columns: int
    spec_key: Tuple
    logits_dtype: torch.dtype
    ids_dtype: torch.dtype
    weights_dtype: torch.dtype
    stats: bool
    checksum: bool = False
    lost: bool = False

    def describe(self) -> str:
        scoring, has_bias, groups, restrict = self.spec_key
        extra = f" +{self.num_columns - self.num_routed} shared" if self.num_columns > self.num_routed else ""
        grouped = f" groups {groups}" + (" restricted" if restrict else "") if groups > 1 else ""
        return (
            f"N={self.num_experts} K={self.num_routed}{extra} {scoring}{'+bias' if has_bias else ''}{grouped} "
            f"logits {str(self.logits_dtype).split('.')[-1]} ids {str(self.ids_dtype).split('.')[-1]} "
            f"weights {str(self.weights_dtype).split('.')[-1]}"
        )


def trial_k0(k0: int, num_routed: int) -> int:
    """The self-check's k0 for a routing shape of top-k `num_routed`: the startup k0 where
    1 <= k0 < top-k, else top-k // 2 (at least 1), so that the trials route with OEA on."""
    return k0 if 1 <= k0 < num_routed else max(1, num_routed // 2)


def spec_key(spec: RouterSpec) -> Tuple:
    return (spec.scoring_func, spec.correction_bias is not None, spec.num_groups, spec.restrict_groups)


def trial_inputs(shape: RoutingShape, spec: RouterSpec, rows: int, gen: torch.Generator, device):
    """Random logits [rows, N] and the router's own top-K of them, columns shuffled, plus fused
    shared-expert columns (ids N.., random weights): what SGLang hands the routing hook."""
    n, k, c = shape.num_experts, shape.num_routed, shape.num_columns
    logits = (torch.randn(rows, n, generator=gen) * 2).to(device=device, dtype=shape.logits_dtype)
    selection, weight = score_experts(logits, spec)
    ids = selection.topk(k, dim=1).indices
    ids = ids.gather(1, torch.rand(rows, k, generator=gen).argsort(dim=1).to(device))
    w = weight.gather(1, ids)
    w = w / w.sum(dim=1, keepdim=True)
    shared_ids = torch.arange(n, n + c - k, device=device).expand(rows, c - k)
    shared_w = torch.rand(rows, c - k, generator=gen).to(device)
    ids = torch.cat([ids, shared_ids], dim=1).to(shape.ids_dtype)
    w = torch.cat([w, shared_w], dim=1).to(shape.weights_dtype)
    return logits, ids.contiguous(), w.contiguous()


def compare_lost(shape: RoutingShape, k0: int, real: int, ids, w, got_ids, got_w, lost: torch.Tensor) -> Optional[str]:
    """None when the kernel filed its lost router mass under k0 alone, within one unit per real row
    of reference.lost_router_mass_units of its own output (the kernel rounds each row, the
    reference the sum; the ids and weights themselves are compared before), else what differed."""
    k = shape.num_routed
    got = lost.cpu()
    want = int(lost_router_mass_units(ids[:, :k], w[:, :k], got_ids[:, :k], got_w[:, :k], shape.num_experts, real))
    elsewhere = [col for col in got.nonzero().flatten().tolist() if col != k0]
    if elsewhere:
        return f"lost router mass filed under k0={elsewhere}, expected k0={k0} only"
    if abs(int(got[k0]) - want) > real:
        return f"lost router mass {int(got[k0])} units, expected {want} (+-{real})"
    return None


def compare_trial(shape: RoutingShape, spec: RouterSpec, k0: int, rows: int, real: int, logits, ids, w,
                  got_ids, got_w, stats: Optional[torch.Tensor],
                  checksum: Optional[torch.Tensor] = None, lost: Optional[torch.Tensor] = None) -> Optional[str]:
    """None when the kernel's output of one trial matches the torch path, else what differed."""
    k = shape.num_routed
    want_ids, want_w = route_from_logits(logits, ids[:, :k], w[:, :k], spec, k0, real)
    got_ids, got_w = got_ids.cpu(), got_w.cpu()
    want_ids, want_w, ids, w = want_ids.cpu(), want_w.cpu(), ids.cpu(), w.cpu()
    where = f"B={rows} ({real} real)"
    if got_ids.dtype != ids.dtype or got_w.dtype != w.dtype:
        return f"{where}: output dtypes {got_ids.dtype}/{got_w.dtype}, expected {ids.dtype}/{w.dtype}"
    bad = (got_ids[:, :k].long() != want_ids).any(dim=1)
    if bool(bad.any()):
        r = int(bad.int().argmax())
        return (f"{where}: ids differ in {int(bad.sum())} rows; row {r}: kernel {got_ids[r, :k].tolist()} "
                f"torch {want_ids[r].tolist()}")
    if not (torch.equal(got_ids[:, k:], ids[:, k:]) and torch.equal(got_w[:, k:], w[:, k:])):
        return f"{where}: shared-expert columns were not passed through"
    tol = WEIGHT_TOLERANCE.get(w.dtype, DEFAULT_TOLERANCE)
    if not torch.allclose(got_w[:, :k].float(), want_w.float(), **tol):
        diff = (got_w[:, :k].float() - want_w.float()).abs().max().item()
        return f"{where}: weights differ by up to {diff:.3g} (tolerance rtol={tol['rtol']}, atol={tol['atol']})"
    if stats is not None:
        want = [1, int(distinct_experts(ids[:, :k], shape.num_experts, real)),
                int(distinct_experts(want_ids, shape.num_experts, real))] if bool(batch_gate(real, 1, 0)) else [0, 0, 0]
        if stats.cpu().tolist() != want:
            return f"{where}: expert counters {stats.cpu().tolist()}, expected {want}"
    if checksum is not None:
        got_sum, want_sum = (int(t) & (1 << 64) - 1 for t in (checksum.cpu()[0], ids_checksum(want_ids, real)))
        if got_sum != want_sum:
            return f"{where}: ids checksum {got_sum:#018x}, expected {want_sum:#018x}"
    if lost is not None:
        error = compare_lost(shape, k0, real, ids, w, got_ids, got_w, lost)
        if error is not None:
            return f"{where}: {error}"
    return None


def run_self_check(kernel_route, shape: RoutingShape, spec: RouterSpec, k0: int, device,
                   trials: Sequence[Tuple[int, int]] = TRIALS, seed: int = 0) -> Optional[str]:
    """None when every trial passes, else one line saying what differed (or what raised).

    Args:
        kernel_route: `kernel_route(logits, ids, weights, rows_tensor, stats, checksum, lost) -> (ids,
            weights)`, the fused kernel exactly as the runtime launches it (1-element int32 row
            count; stats a [3] int64 tensor, checksum a [1] int64 tensor, lost a [MAX_K0] int64
            tensor, each None where the shape says the call does not pass it).
    """
    gen = torch.Generator().manual_seed(seed)
    for rows, real in trials:
        # A compile, launch or allocation failure (an OOM) is a failed self-check, reported: nothing
        # may raise past here, since every rank must reach the agreement that follows (routers.py).
        try:
            logits, ids, w = trial_inputs(shape, spec, rows, gen, device)
            stats = torch.zeros(3, dtype=torch.int64, device=device) if shape.stats else None
            checksum = torch.zeros(1, dtype=torch.int64, device=device) if shape.checksum else None
            lost = torch.zeros(MAX_K0, dtype=torch.int64, device=device) if shape.lost else None
            real_rows = torch.full((1,), real, dtype=torch.int32, device=device)
            got_ids, got_w = kernel_route(logits, ids, w, real_rows, stats, checksum, lost)
            error = compare_trial(shape, spec, k0, rows, real, logits, ids, w, got_ids, got_w, stats, checksum, lost)
        except Exception as exc:
            first_line = (str(exc).strip().splitlines() or [""])[0]
            error = f"B={rows} ({real} real): {type(exc).__name__}: {first_line}"
        if error is not None:
            return error
    return None
