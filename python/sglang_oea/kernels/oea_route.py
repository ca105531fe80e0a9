"""Fused Triton OEA routing: `sglang_oea.routing.route_from_logits` in two launches per MoE layer.

Shape legend: B = rows (tokens), N = routed experts, K = routed experts per row, K0 = base size.

Scores, in float32, the same bits as sglang_oea.routing.score_experts computes with torch on CUDA:
    softmax: sel = x (the logit);               w = exp(x - max x) / sum exp(x - max x)
    sigmoid: w = 1 / (1 + exp(-x));             sel = w + bias (one add), or w
exp is CUDA's accurate expf (libdevice __nv_expf, not tl.exp's ex2.approx) and "/" the IEEE
round-to-nearest division (tl.div_rn, not the div.full of "/"). For sigmoid that is PyTorch's own
formula: its CUDA sigmoid kernel computes 1 / (1 + std::exp(-x)) in float32 (std::exp is expf,
nvcc's default -prec-div=true makes "/" IEEE), and both links to libdevice are compiled without
flush-to-zero (enable_reflect_ftz=False, nvcc's default -ftz=false). So the selection scores, which
decide the ids, are bit-identical to the torch path's as long as PyTorch's CUDA toolkit and
Triton's bundled libdevice implement expf alike (benchmark/oea/gpu_cases.py check_score_bits checks
this on the GPU). Softmax ranks by the logit (monotonic: the probability order, without the ties
that rounding or underflow put into probabilities): both paths read the same logits, so its ids do
not depend on any exp at all; its weights differ from torch's by the order of the sum (ulps).
Consequence: an expert whose logit is -inf (selection -inf) is never piggybacked.
Under TRITON_INTERPRET=1 exp is numpy's, which is not torch's CPU exp in the last bit.

Launch 1 (`_oea_union_kernel`, one program per row) ranks the row's routed top-K and marks its
base (the K0 best) in a union bitmap U [N] int32. Every writer stores the same value 1, so the
result does not depend on the order of the programs.
Launch 2 (`_oea_route_kernel`, one program per row) reads U, picks the row's K - K0 piggybacked
experts (or the fills), computes the weights and applies the batch gate. The last program to
finish (an atomic ticket counter) clears U again, so the workspace is clean for the next call
without any extra launch or torch op.

Optional per-layer statistics (`stats=`, an int64 [3] view of a persistent [L, 3] buffer): launch 1
also marks every routed id of a valid row in a second bitmap R [N] int32; the last program of
launch 2 counts U and R, adds gate * (1, |R|, T_after) to stats with integer atomics and clears R
with U. T_after = max(|U|, K) if there is a valid row, else 0: the number of distinct experts in
the output rows of the valid rows (the fill order guarantees it; see `oea_route`). No extra launch.

Shared-expert columns: SGLang appends fused shared-expert columns after the K routed ones
(`num_routed` < topk_ids.shape[1]); launch 2 copies them through unchanged, so the caller needs no
torch.cat around the kernel.

Graph safety: no host sync, no shape that depends on tensor values, and with a workspace no
allocation. The row count is always read on the device from a 1-element int32 tensor (the caller's,
or the workspace's `rows` slot for an int), so eager calls and CUDA-graph capture launch the same
compiled variant: one eager call compiles and loads everything a capture will launch
(`kernel_launches` + `launch_variant` let a caller check this before capturing).
Determinism: no floating-point atomics (the statistics are integer atomics, so their sums do not
depend on the order either); each row's result depends only on its inputs and on U, so every TP
rank that sees the same logits produces the same ids and weights.

Optional rank-check checksum (`checksum=`, an int64 [1] view of a persistent buffer): launch 2
adds reference.ids_checksum(ids[:rows, :K]) of its output ids, gate open or closed: each program
mixes its own row and adds it with one wrapping integer atomic (order-independent). No extra launch.

Use under CUDA graphs (one workspace per MoE layer, allocated before capture):

    ws = OEAWorkspace.allocate(N, K, max_bucket_rows, torch.int32, torch.float32, "cuda")
    real_rows = torch.zeros(1, dtype=torch.int32, device="cuda")   # persistent
    # eagerly once (compiles and loads), then during capture:
    ids, weights = oea_route(logits, topk_ids, topk_weights, k0=3, scoring_func="softmax",
                             num_valid_rows=real_rows, min_batch=4, max_batch=0, workspace=ws)
    # before each replay: real_rows.fill_(n)
    # optional counters: sums = torch.zeros(L, 3, dtype=torch.int64, device="cuda") before capture,
    # then pass stats=sums[layer]; read sums on the host whenever (one sync), zero it in place.

`ids`/`weights` are views ws.out_ids[:B] / ws.out_weights[:B]: the same memory on every replay,
overwritten by the next call with the same workspace.
"""

from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from sglang_oea.reference import MIX1, MIX2, ROW_SHIFT

# An expert id lives in the low 16 bits of a pick key (see _pick_keys).
MAX_EXPERTS = 1 << 15
MAX_TOP_K = 64
# Compile options of every launch: libdevice without flush-to-zero, as nvcc (and so PyTorch)
# links it by default; Triton's default would flush subnormal exp results to 0.
COMPILE_OPTIONS = (("enable_reflect_ftz", False),)

# The interpreter cannot call libdevice: there exp is numpy's (chosen when this module is
# imported, as triton.jit chooses between compiling and interpreting).
_INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))
# The checksum's constants (sglang_oea.reference.ids_checksum).
_MIX1 = tl.constexpr(MIX1)
_MIX2 = tl.constexpr(MIX2)
_ROW_SHIFT = tl.constexpr(ROW_SHIFT)


@triton.jit
def _accurate_exp(x):
    """exp of float32 x with CUDA's accurate expf (libdevice __nv_expf), not tl.exp's ex2.approx."""
    if _INTERPRETED:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def _scores(logits_ptr, bias_ptr, cols, N, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Selection and weight scores [N_PAD] float32 of one row, as routing.score_experts (see the
    module docstring for why these are torch's bits on CUDA).

    softmax: sel = x, w = exp(x - max x) / sum exp(x - max x)
    sigmoid: w = 1 / (1 + exp(-x)), sel = w + bias
    Padding columns (>= N) get sel = -inf and w = 0.
    """
    in_row = cols < N
    x = tl.load(logits_ptr + cols, mask=in_row, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        # 1 + exp(-x) may be contracted into one FMA with expf's last step, a multiplication by a
        # power of two: exact unless it over- or underflows, where 1 + e is inf or 1 either way.
        w = tl.div_rn(1.0, 1.0 + _accurate_exp(-x))
        sel = w
        if HAS_BIAS:
            sel = w + tl.load(bias_ptr + cols, mask=in_row, other=0.0).to(tl.float32)
    else:
        sel = x
        e = _accurate_exp(x - tl.max(x, axis=0))
        w = tl.div_rn(e, tl.sum(e, axis=0))
    sel = tl.where(in_row, sel, float("-inf"))
    w = tl.where(in_row, w, 0.0)
    return sel, w


@triton.jit
def _ids_checksum_part(ids, in_k, row):
    """Row `row`'s share of reference.ids_checksum: the int64 sum of mix(row, id) over the ids
    [K_PAD] where in_k. Products and sums wrap mod 2^64: Triton's integer ops carry no overflow
    flags (LLVM mul/add without nsw wrap), its debug overflow check skips 64-bit integers, and
    numpy's int64 arrays (the interpreter) wrap too."""
    h = (ids.to(tl.int64) + ((row << _ROW_SHIFT) + 1)) * _MIX1
    h = (h ^ (h >> 31)) * _MIX2
    return tl.sum(tl.where(in_k, h, 0), axis=0)


@triton.jit
def _rank_routed(ids_ptr, sel, cols, k0, K: tl.constexpr, K_PAD: tl.constexpr):
    """Rank one row's routed top-K by selection score, descending, ties to the lower id.

    Returns ids [K_PAD] int32 (-1 on padding), hit [K_PAD, N_PAD] (ids[j] == col),
    rank [K_PAD] (0 = best) and is_base [K_PAD] (rank < k0).
    """
    slots = tl.arange(0, K_PAD)
    in_k = slots < K
    ids = tl.load(ids_ptr + slots, mask=in_k, other=-1).to(tl.int32)
    hit = ids[:, None] == cols[None, :]
    # Read the scores out of the row vector rather than recomputing them at the gathered ids,
    # so that ranking and piggyback selection see bit-identical values.
    s = tl.max(tl.where(hit, sel[None, :], float("-inf")), axis=1)
    s_i = s[:, None]
    s_j = s[None, :]
    beats = (s_j > s_i) | ((s_j == s_i) & (ids[None, :] < ids[:, None]))
    rank = tl.sum((beats & in_k[None, :]).to(tl.int32), axis=1)
    is_base = in_k & (rank < k0)
    return ids, hit, rank, is_base


@triton.jit
def _mask_foreign_groups(sel, ids, cols, group_size, K: tl.constexpr, K_PAD: tl.constexpr):
    """sel with -inf outside the expert groups that the row's routed ids lie in."""
    in_k = tl.arange(0, K_PAD) < K
    # in_k matters: the padding id -1 would truncate to group 0 under integer division.
    same = ((ids[:, None] // group_size) == (cols[None, :] // group_size)) & in_k[:, None]
    allowed = tl.max(same.to(tl.int32), axis=0) > 0
    return tl.where(allowed, sel, float("-inf"))


@triton.jit
def _pick_keys(sel, in_union, held, cols, N, valid):
    """[N_PAD] int64 keys whose descending order is the row's candidate order.

    key = tier << 48 | score_bits << 16 | (0xFFFF - id). Eligible experts (in U, not held,
    score > -inf, valid row) carry their order-preserving score bits, so equal scores fall back
    to the lower id; fills carry no score, so they come by id ascending. Held experts and
    padding columns get -1.
    """
    eligible = valid & in_union & (~held) & (sel > float("-inf"))
    # Tier 3: piggyback candidate; 2: fill from U; 1: fill from outside U (fill order).
    tier = tl.where(eligible, 3, tl.where(in_union, 2, 1)).to(tl.int64)
    # -0.0 and +0.0 must tie, as they do in torch.sort.
    s = tl.where(sel == 0.0, 0.0, sel)
    # IEEE-754 bits order like sign-magnitude integers: flipping the magnitude bits of negative
    # values makes them order like the floats; the offset makes them non-negative (32 bits).
    bits = s.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + 2147483648
    score_part = tl.where(eligible, ordered, 0)
    key = (tier << 48) | (score_part << 16) | (0xFFFF - cols).to(tl.int64)
    return tl.where(held | (cols >= N), -1, key)


# Scalars that change between calls of one layer: never specialised, so one compiled variant
# serves every value (an int equal to 1 would otherwise become a compile-time constant).
UNION_DO_NOT_SPECIALIZE = ("k0",)
ROUTE_DO_NOT_SPECIALIZE = ("k0", "min_batch", "max_batch")
# The checksum slot is a view into a [L, 4] int64 table (8 mod 16 bytes): one variant for any
# alignment, shared by every layer (only one scalar atomic reads the pointer).
ROUTE_DO_NOT_SPECIALIZE_ON_ALIGNMENT = ("checksum_ptr",)


@triton.jit(do_not_specialize=UNION_DO_NOT_SPECIALIZE)
def _oea_union_kernel(
    logits_ptr,
    bias_ptr,
    topk_ids_ptr,
    union_ptr,
    routed_ptr,
    num_valid_ptr,
    k0,
    N,
    stride_logits,
    stride_ids,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    STATS: tl.constexpr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    N_PAD: tl.constexpr,
):
    """Launch 1: U[e] = 1 for every expert e in the base of some valid row.

    logits [B, N], topk_ids [B, >= K] (routed ids first, any column order), bias [N] (sigmoid
    only), union [N] int32 (all zero on entry), num_valid_ptr [1] int32 (the real row count).
    Program r handles row r; rows >= num_valid_rows write nothing.
    base_r = the k0 routed ids of row r with the highest selection score (ties: lower id).
    STATS: also R[e] = 1 (routed [N] int32, zero on entry) for every routed id e of a valid row.
    """
    row = tl.program_id(0).to(tl.int64)
    rows = tl.load(num_valid_ptr).to(tl.int32)
    cols = tl.arange(0, N_PAD)
    sel, _ = _scores(logits_ptr + row * stride_logits, bias_ptr, cols, N, SIGMOID, HAS_BIAS)
    ids, _, _, is_base = _rank_routed(topk_ids_ptr + row * stride_ids, sel, cols, k0, K, K_PAD)
    ones = tl.full([K_PAD], 1, tl.int32)
    tl.store(union_ptr + ids, ones, mask=is_base & (row < rows))
    if STATS:
        # Every writer stores 1 here too. The range test keeps a bad id from writing elsewhere.
        in_range = (tl.arange(0, K_PAD) < K) & (ids >= 0) & (ids < N)
        tl.store(routed_ptr + ids, ones, mask=in_range & (row < rows))


@triton.jit(do_not_specialize=ROUTE_DO_NOT_SPECIALIZE,
            do_not_specialize_on_alignment=ROUTE_DO_NOT_SPECIALIZE_ON_ALIGNMENT)
def _oea_route_kernel(
    logits_ptr,
    bias_ptr,
    topk_ids_ptr,
    topk_weights_ptr,
    union_ptr,
    routed_ptr,
    counter_ptr,
    stats_ptr,
    checksum_ptr,
    out_ids_ptr,
    out_weights_ptr,
    num_valid_ptr,
    k0,
    N,
    group_size,
    min_batch,
    max_batch,
    stride_logits,
    stride_ids,
    stride_weights,
    stride_out_ids,
    stride_out_weights,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RESTRICT_GROUPS: tl.constexpr,
    STATS: tl.constexpr,
    CHECKSUM: tl.constexpr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    EXTRA: tl.constexpr,
    EXTRA_PAD: tl.constexpr,
    N_PAD: tl.constexpr,
):
    """Launch 2: OEA ids and weights of row r = program_id, then clear U after the last row.

    Inputs as in launch 1, plus topk_weights [B, K], the union U written by launch 1 and
    counter [1] int32 (zero on entry). Outputs out_ids [B, K + EXTRA] (topk_ids dtype) and
    out_weights [B, K + EXTRA] (topk_weights dtype); columns K.. (fused shared experts) are
    copied from the inputs.

    Valid row (r < num_valid_rows): slots [0, k0) = base ranked; then the best of
    {e in U - base : sel[e] > -inf} by score (ties: lower id), active; then fills inactive.
    Padded row: the first K experts of the fill order, all inactive.
    Fill order: U by id ascending, then the rest by id ascending, minus held experts.
    Weights: w_j = active_j * p[id_j] / sum_j'(active * p) * sum_j(topk_weights), 0 if the
    active sum is 0. Gate closed: out = (topk_ids, topk_weights) bit for bit.

    STATS: the last program adds gate * (1, |R|, T_after) to stats [3] int64 (R from launch 1,
    T_after = max(|U|, K) if num_valid_rows >= 1 else 0) and clears R with U.
    CHECKSUM: every valid row adds its share of ids_checksum(out_ids[:, :K]) to checksum [1] int64.
    """
    row = tl.program_id(0).to(tl.int64)
    rows = tl.load(num_valid_ptr).to(tl.int32)
    gate = (rows >= min_batch) & ((max_batch == 0) | (rows <= max_batch))
    valid = row < rows
    cols = tl.arange(0, N_PAD)
    in_row = cols < N
    slots = tl.arange(0, K_PAD)
    in_k = slots < K

    sel, w = _scores(logits_ptr + row * stride_logits, bias_ptr, cols, N, SIGMOID, HAS_BIAS)
    ids, hit, rank, is_base = _rank_routed(topk_ids_ptr + row * stride_ids, sel, cols, k0, K, K_PAD)
    if RESTRICT_GROUPS:
        # After ranking: routed experts always lie in their own groups, so their scores stand.
        sel = _mask_foreign_groups(sel, ids, cols, group_size, K, K_PAD)
    held = valid & (tl.max((hit & is_base[:, None]).to(tl.int32), axis=0) > 0)
    in_union = tl.load(union_ptr + cols, mask=in_row, other=0) != 0
    if STATS:
        # Read by every program next to U (R is stable in this launch), so that the last one
        # adds no load latency to the serial tail; only the last program uses it.
        routed = tl.load(routed_ptr + cols, mask=in_row, other=0) != 0
    key = _pick_keys(sel, in_union, held, cols, N, valid)

    # Base slots: slot s holds the routed id of rank s.
    base_at = (rank[None, :] == slots[:, None]) & is_base[None, :]
    first = tl.where(valid, k0, 0)
    out = tl.where(slots < first, tl.sum(tl.where(base_at, ids[None, :], 0), axis=1), 0)
    active = slots < first
    # Remaining slots: repeated argmax over keys that are unique (the id is part of the key), so
    # no tie rule of tl.argmax is involved. Tier 3 (piggybacked) slots carry weight.
    for t in range(0, K - first):
        best = tl.max(key, axis=0)
        expert = (0xFFFF - (best & 0xFFFF)).to(tl.int32)
        here = slots == first + t
        out = tl.where(here, expert, out)
        active = tl.where(here, (best >> 48) == 3, active)
        key = tl.where(cols == expert, -1, key)

    # Weights, as reference.opportunistic_weights.
    own_ids = tl.load(topk_ids_ptr + row * stride_ids + slots, mask=in_k)
    own_w = tl.load(topk_weights_ptr + row * stride_weights + slots, mask=in_k, other=0.0)
    p = tl.sum(tl.where(out[:, None] == cols[None, :], w[None, :], 0.0), axis=1)
    picked = tl.where(active, p, 0.0)
    total = tl.sum(picked, axis=0)
    scale = tl.div_rn(tl.sum(own_w.to(tl.float32), axis=0), tl.maximum(total, 1.1754943508222875e-38))
    new_w = tl.where(total > 0, picked * scale, 0.0)

    out_ids = tl.where(gate, out.to(own_ids.dtype), own_ids)
    out_w = tl.where(gate, new_w.to(own_w.dtype), own_w)
    tl.store(out_ids_ptr + row * stride_out_ids + slots, out_ids, mask=in_k)
    tl.store(out_weights_ptr + row * stride_out_weights + slots, out_w, mask=in_k)
    if CHECKSUM:
        # One atomic per valid row, in parallel with the other rows, rather than the last program
        # reading every row's ids in the serial tail below; the wrapping integer sum does not
        # depend on the order in which the rows arrive.
        part = _ids_checksum_part(out_ids, in_k, row)
        tl.atomic_add(checksum_ptr, part, mask=valid, sem="relaxed", scope="gpu")
    if EXTRA > 0:
        # Fused shared-expert columns pass through, gate open or closed.
        extra = K + tl.arange(0, EXTRA_PAD)
        in_extra = extra < K + EXTRA
        x_ids = tl.load(topk_ids_ptr + row * stride_ids + extra, mask=in_extra)
        x_w = tl.load(topk_weights_ptr + row * stride_weights + extra, mask=in_extra)
        tl.store(out_ids_ptr + row * stride_out_ids + extra, x_ids, mask=in_extra)
        tl.store(out_weights_ptr + row * stride_out_weights + extra, x_w, mask=in_extra)

    # Self-cleaning union: the last program to arrive (all others have read U) zeroes it.
    # The barrier orders this program's reads of U before the release of the atomic.
    tl.debug_barrier()
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) - 1:
        if STATS:
            # U and R were written by launch 1, and U is not cleared before this point, so the
            # values loaded above are the final ones. Every valid row's output is its base and
            # experts of U, completed from the shared fill order (U by id, then the rest by id),
            # so the valid rows together use exactly max(|U|, K) experts (U when |U| >= K).
            n_union = tl.sum(in_union.to(tl.int32), axis=0).to(tl.int64)
            n_before = tl.sum(routed.to(tl.int32), axis=0).to(tl.int64)
            n_after = tl.where(rows > 0, tl.maximum(n_union, K), 0).to(tl.int64)
            which = tl.arange(0, 4)
            add = tl.where(which == 0, 1, tl.where(which == 1, n_before, n_after)).to(tl.int64)
            tl.atomic_add(stats_ptr + which, add, mask=(which < 3) & gate, sem="relaxed", scope="gpu")
            tl.store(routed_ptr + cols, tl.zeros([N_PAD], tl.int32), mask=in_row)
        tl.store(union_ptr + cols, tl.zeros([N_PAD], tl.int32), mask=in_row)
        tl.store(counter_ptr, 0)


@dataclass
class OEAWorkspace:
    """Preallocated buffers, so that `oea_route` allocates nothing (CUDA-graph capture).

    union: [N] int32, all zero between calls (launch 2 clears it).
    routed: [N] int32, the routed-experts bitmap of the statistics (`stats=`); all zero between
        calls (launch 2 clears it); untouched by calls without stats.
    counter: [1] int32, zero between calls (launch 2 resets it).
    rows: [1] int32, where a call given num_valid_rows as an int (or None) writes it.
    out_ids: [max_rows, C] in the router's ids dtype; out_weights: [max_rows, C] in its weights
        dtype, C = routed + shared-expert columns. A call with B rows writes and returns views
        out_ids[:B], out_weights[:B].

    Contract: build once per MoE layer (or share between layers of equal shape, if each
    layer's outputs are consumed before the next call), outside graph capture, and never free
    or replace one that a captured graph uses. Calls that use one workspace must be serialised
    on one stream. The returned tensors are overwritten by the next call with the same
    workspace. Call `reset()` if a call was ever interrupted.
    """

    union: torch.Tensor
    routed: torch.Tensor
    counter: torch.Tensor
    rows: torch.Tensor
    out_ids: torch.Tensor
    out_weights: torch.Tensor

    @classmethod
    def allocate(
        cls,
        num_experts: int,
        num_columns: int,
        max_rows: int,
        ids_dtype: torch.dtype = torch.int32,
        weights_dtype: torch.dtype = torch.float32,
        device: Union[str, torch.device] = "cuda",
    ) -> "OEAWorkspace":
        """num_columns: the router's output width, routed plus fused shared-expert columns."""
        return cls(
            union=torch.zeros(num_experts, dtype=torch.int32, device=device),
            routed=torch.zeros(num_experts, dtype=torch.int32, device=device),
            counter=torch.zeros(1, dtype=torch.int32, device=device),
            rows=torch.zeros(1, dtype=torch.int32, device=device),
            out_ids=torch.empty(max_rows, num_columns, dtype=ids_dtype, device=device),
            out_weights=torch.empty(max_rows, num_columns, dtype=weights_dtype, device=device),
        )

    @property
    def max_rows(self) -> int:
        return self.out_ids.shape[0]

    def reset(self) -> None:
        """Zero U, R and the counter (only needed if a call was interrupted half-way)."""
        self.union.zero_()
        self.routed.zero_()
        self.counter.zero_()

    def check(self, num_rows: int, num_experts: int, ids: torch.Tensor, weights: torch.Tensor):
        """Assert that this workspace fits a call (shapes and dtypes only: no device sync)."""
        for name in ("union", "routed"):
            t = getattr(self, name)
            assert t.shape == (num_experts,) and t.dtype == torch.int32, f"{name}: {t.shape=} {t.dtype=}"
        for name in ("counter", "rows"):
            t = getattr(self, name)
            assert t.shape == (1,) and t.dtype == torch.int32, f"{name}: {t.shape=} {t.dtype=}"
        assert self.out_ids.shape[0] >= num_rows and self.out_ids.shape[1] == ids.shape[1], f"{self.out_ids.shape=}"
        assert self.out_weights.shape == self.out_ids.shape, f"{self.out_weights.shape=}"
        assert self.out_ids.dtype == ids.dtype, f"{self.out_ids.dtype=} {ids.dtype=}"
        assert self.out_weights.dtype == weights.dtype, f"{self.out_weights.dtype=} {weights.dtype=}"
        for t in (self.routed, self.counter, self.rows, self.out_ids):
            assert t.device == self.union.device == ids.device, f"{t.device=} {ids.device=}"


@dataclass(frozen=True)
class KernelLaunch:
    """One planned kernel launch: runtime arguments (in the kernel's order), compile-time
    constants and launch options. `run()` launches it; `variant()` names the compiled binary it
    needs; tools that compile offline read the same plan."""

    kernel: object
    args: Tuple[Tuple[str, object], ...]
    constexprs: Tuple[Tuple[str, object], ...]
    do_not_specialize: Tuple[str, ...]
    num_warps: int
    grid: Tuple[int, ...]
    do_not_specialize_on_alignment: Tuple[str, ...] = ()
    options: Tuple[Tuple[str, object], ...] = COMPILE_OPTIONS  # compile options besides num_warps

    def run(self):
        """Launch; returns Triton's compiled kernel (n_regs / n_spills once loaded on a GPU)."""
        return self.kernel[self.grid](**dict(self.args), **dict(self.constexprs), num_warps=self.num_warps,
                                      **dict(self.options))

    def specialization(self) -> Tuple[Tuple[str, object], ...]:
        """(type, specialization) per runtime argument, as Triton keys its compile cache: dtype and
        16-byte alignment of pointers (unless never specialised on alignment), int width and
        divisibility by 16 (an int equal to 1 becomes a constant) unless never specialised."""
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend

        return tuple(
            native_specialize_impl(BaseBackend, value, False, name not in self.do_not_specialize,
                                   name not in self.do_not_specialize_on_alignment)
            for name, value in self.args
        )

    def variant(self) -> tuple:
        """A hashable name of the compiled binary this launch needs (equal names, one binary):
        (kernel name, specialization, constexprs, num_warps, options)."""
        return (self.kernel.fn.__name__, self.specialization(), self.constexprs, self.num_warps, self.options)


def _num_warps(n_pad: int, k_pad: int) -> int:
    """Warps per program: the [K_PAD, N_PAD] tiles dominate; ~64 elements per thread."""
    return max(1, min(8, (n_pad * k_pad) // 2048))


def kernel_launches(
    router_logits: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    k0: int,
    num_valid_rows: torch.Tensor,
    workspace: OEAWorkspace,
    num_routed: Optional[int] = None,
    scoring_func: str = "softmax",
    correction_bias: Optional[torch.Tensor] = None,
    num_groups: int = 1,
    restrict_groups: bool = False,
    min_batch: int = 1,
    max_batch: int = 0,
    stats: Optional[torch.Tensor] = None,
    checksum: Optional[torch.Tensor] = None,
) -> Tuple[KernelLaunch, KernelLaunch]:
    """The two launches of one `oea_route` call (arguments as there, already checked), unlaunched."""
    num_rows, num_experts = router_logits.shape
    top_k = topk_ids.shape[1] if num_routed is None else num_routed
    extra = topk_ids.shape[1] - top_k
    out_ids, out_weights = workspace.out_ids[:num_rows], workspace.out_weights[:num_rows]
    sigmoid = scoring_func == "sigmoid"
    has_bias = sigmoid and correction_bias is not None
    bias = correction_bias if has_bias else router_logits  # placeholder pointer without bias
    restrict = bool(restrict_groups) and num_groups > 1
    n_pad, k_pad = triton.next_power_of_2(num_experts), triton.next_power_of_2(top_k)
    num_warps = _num_warps(n_pad, k_pad)
    shared = dict(SIGMOID=sigmoid, HAS_BIAS=has_bias, STATS=stats is not None, K=top_k, K_PAD=k_pad, N_PAD=n_pad)
    union = KernelLaunch(
        _oea_union_kernel,
        args=(
            ("logits_ptr", router_logits), ("bias_ptr", bias), ("topk_ids_ptr", topk_ids),
            ("union_ptr", workspace.union), ("routed_ptr", workspace.routed), ("num_valid_ptr", num_valid_rows),
            ("k0", k0), ("N", num_experts), ("stride_logits", router_logits.stride(0)),
            ("stride_ids", topk_ids.stride(0)),
        ),
        constexprs=tuple(shared.items()),
        do_not_specialize=UNION_DO_NOT_SPECIALIZE,
        num_warps=num_warps,
        grid=(num_rows,),
    )
    route = KernelLaunch(
        _oea_route_kernel,
        args=(
            ("logits_ptr", router_logits), ("bias_ptr", bias), ("topk_ids_ptr", topk_ids),
            ("topk_weights_ptr", topk_weights), ("union_ptr", workspace.union), ("routed_ptr", workspace.routed),
            ("counter_ptr", workspace.counter),
            ("stats_ptr", workspace.counter if stats is None else stats),  # placeholder pointer without stats
            ("checksum_ptr", workspace.counter if checksum is None else checksum),  # placeholder without checksum
            ("out_ids_ptr", out_ids), ("out_weights_ptr", out_weights), ("num_valid_ptr", num_valid_rows),
            ("k0", k0), ("N", num_experts), ("group_size", num_experts // num_groups if restrict else num_experts),
            ("min_batch", min_batch), ("max_batch", max_batch), ("stride_logits", router_logits.stride(0)),
            ("stride_ids", topk_ids.stride(0)), ("stride_weights", topk_weights.stride(0)),
            ("stride_out_ids", out_ids.stride(0)), ("stride_out_weights", out_weights.stride(0)),
        ),
        constexprs=tuple(shared.items()) + (
            ("RESTRICT_GROUPS", restrict), ("CHECKSUM", checksum is not None), ("EXTRA", extra),
            ("EXTRA_PAD", triton.next_power_of_2(max(extra, 1))),
        ),
        do_not_specialize=ROUTE_DO_NOT_SPECIALIZE,
        num_warps=num_warps,
        grid=(num_rows,),
        do_not_specialize_on_alignment=ROUTE_DO_NOT_SPECIALIZE_ON_ALIGNMENT,
    )
    return union, route


def check_arguments(router_logits, topk_ids, topk_weights, k0, num_routed, scoring_func, correction_bias,
                    num_groups, restrict_groups, stats, checksum=None) -> None:
    """Assert that one `oea_route` call is well formed (shapes, dtypes, devices: no device sync)."""
    assert router_logits.dim() == 2 and topk_ids.dim() == 2, f"{router_logits.shape=} {topk_ids.shape=}"
    assert topk_weights.shape == topk_ids.shape, f"{topk_weights.shape=} {topk_ids.shape=}"
    num_rows, num_experts = router_logits.shape
    top_k = topk_ids.shape[1] if num_routed is None else num_routed
    assert topk_ids.shape[0] == num_rows, f"{router_logits.shape=} {topk_ids.shape=}"
    assert k0 >= 1, f"{k0=}"
    assert 1 <= top_k <= min(num_experts, MAX_TOP_K) and top_k <= topk_ids.shape[1], f"{top_k=} {num_experts=}"
    assert num_experts <= MAX_EXPERTS, f"{num_experts=}"
    assert scoring_func in ("softmax", "sigmoid"), f"{scoring_func=}"
    assert not (restrict_groups and num_experts % num_groups), f"{num_experts=} {num_groups=}"
    for t in (router_logits, topk_ids, topk_weights):
        assert t.stride(-1) == 1 or t.shape[-1] == 1, f"last dim must be contiguous: {t.stride()=}"
    if stats is not None:
        assert stats.dtype == torch.int64 and stats.numel() == 3 and stats.is_contiguous(), (
            f"stats must be a contiguous int64 tensor of 3 elements: {stats.dtype=} {stats.shape=}"
        )
        assert stats.device == router_logits.device, f"{stats.device=} {router_logits.device=}"
    if checksum is not None:
        assert checksum.dtype == torch.int64 and checksum.numel() == 1, (
            f"checksum must be an int64 tensor of 1 element: {checksum.dtype=} {checksum.shape=}"
        )
        assert checksum.device == router_logits.device, f"{checksum.device=} {router_logits.device=}"
    if scoring_func == "sigmoid" and correction_bias is not None:
        assert correction_bias.shape == (num_experts,) and correction_bias.is_contiguous(), f"{correction_bias.shape=}"
        assert correction_bias.device == router_logits.device, f"{correction_bias.device=}"


def device_row_count(num_valid_rows: Optional[Union[int, torch.Tensor]], num_rows: int,
                     workspace: OEAWorkspace) -> torch.Tensor:
    """The 1-element int32 device tensor the kernels read the real row count from."""
    if isinstance(num_valid_rows, torch.Tensor):
        assert num_valid_rows.numel() == 1 and num_valid_rows.dtype == torch.int32, f"{num_valid_rows=}"
        assert num_valid_rows.device == workspace.union.device, f"{num_valid_rows.device=}"
        return num_valid_rows
    workspace.rows.fill_(num_rows if num_valid_rows is None else int(num_valid_rows))
    return workspace.rows


def oea_route(
    router_logits: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    k0: int,
    num_routed: Optional[int] = None,
    scoring_func: str = "softmax",
    correction_bias: Optional[torch.Tensor] = None,
    num_groups: int = 1,
    restrict_groups: bool = False,
    num_valid_rows: Optional[Union[int, torch.Tensor]] = None,
    min_batch: int = 1,
    max_batch: int = 0,
    workspace: Optional[OEAWorkspace] = None,
    stats: Optional[torch.Tensor] = None,
    checksum: Optional[torch.Tensor] = None,
    before_launch: Optional[Callable[[KernelLaunch], None]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gated OEA routing from logits; same result as sglang_oea.routing.route_from_logits.

    Args:
        router_logits: [B, N] float logits (any float dtype, last dim contiguous).
        topk_ids: [B, C] int32/int64: K routed ids (any column order, distinct per row), then
            C - K fused shared-expert ids, which are copied through.
        topk_weights: [B, C] float router weights for topk_ids.
        k0: base size >= 1. k0 >= K returns (topk_ids, topk_weights) themselves.
        num_routed: K, the routed columns (default C: no shared-expert columns).
        scoring_func: "softmax" or "sigmoid"; correction_bias [N] (sigmoid, selection only).
        num_groups, restrict_groups: as RouterSpec; candidates limited to touched groups.
        num_valid_rows: rows past this count are padding. A 1-element int32 tensor on the
            logits' device (read on the device: use this under CUDA graphs), an int, or None
            (all B rows are real); an int is written to workspace.rows first (one fill).
        min_batch, max_batch: OEA applies iff min_batch <= rows and (max_batch == 0 or
            rows <= max_batch); otherwise the outputs equal the inputs bit for bit.
        workspace: preallocated buffers; None allocates them (not allowed under capture).
        stats: None, or a contiguous int64 tensor of 3 elements on the logits' device (e.g. the
            row sums[layer] of a persistent [L, 3] buffer). The call adds, on the device and
            with integer atomics (no host sync, no extra launch, graph-safe):
              stats[0] += gate                  (OEA applied to this call: 1, else 0)
              stats[1] += gate * T_before       (distinct experts among topk_ids[:rows, :K])
              stats[2] += gate * T_after        (distinct experts among ids[:rows, :K])
            where rows = min(num_valid_rows, B) and gate is the min/max-batch gate above.
            T_before is the router's own union, counted from a bitmap of the routed ids.
            T_after is max(|U|, K) when rows >= 1 (U = union of the bases), else 0: OEA
            completes every valid row from one shared fill order, so this is exactly the
            number of distinct output experts (tested against reference.distinct_experts).
            Nothing is added when k0 >= K or B == 0: those calls launch no kernel.
        checksum: None, or an int64 tensor of 1 element on the logits' device (e.g. the view
            counters[layer, 3:4] of a persistent [L, 4] buffer: any alignment, one compiled
            variant for all layers). The call adds, on the device (integer atomics, wrapping mod
            2^64, order-independent; no host sync, no extra launch, graph-safe)
              checksum += reference.ids_checksum(ids[:, :K], rows)
            the rank-check digest of the routed output ids of the rows r < rows, gate open (OEA's
            ids) or closed (the router's own). Nothing is added when k0 >= K or B == 0 (no
            launch): the caller adds reference.ids_checksum(topk_ids[:, :K], rows) itself then.
        before_launch: called with each KernelLaunch just before it runs (e.g. to record the
            compiled variants before graph capture, or to refuse an unseen one during it).
    Returns:
        ids [B, C] (topk_ids dtype) and weights [B, C] (topk_weights dtype).
    """
    check_arguments(router_logits, topk_ids, topk_weights, k0, num_routed, scoring_func, correction_bias,
                    num_groups, restrict_groups, stats, checksum)
    num_rows, num_experts = router_logits.shape
    if k0 >= (topk_ids.shape[1] if num_routed is None else num_routed):
        return topk_ids, topk_weights
    if workspace is None:
        workspace = OEAWorkspace.allocate(
            num_experts, topk_ids.shape[1], num_rows, topk_ids.dtype, topk_weights.dtype, router_logits.device
        )
    workspace.check(num_rows, num_experts, topk_ids, topk_weights)
    if num_rows == 0:
        return workspace.out_ids[:0], workspace.out_weights[:0]
    rows = device_row_count(num_valid_rows, num_rows, workspace)
    launches = kernel_launches(
        router_logits, topk_ids, topk_weights, k0=k0, num_valid_rows=rows, workspace=workspace,
        num_routed=num_routed, scoring_func=scoring_func, correction_bias=correction_bias, num_groups=num_groups,
        restrict_groups=restrict_groups, min_batch=min_batch, max_batch=max_batch, stats=stats, checksum=checksum,
    )
    for launch in launches:
        if before_launch is not None:
            before_launch(launch)
        launch.run()
    return workspace.out_ids[:num_rows], workspace.out_weights[:num_rows]
