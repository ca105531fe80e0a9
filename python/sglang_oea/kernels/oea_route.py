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
Triton's bundled libdevice implement expf alike (benchmark/oea/gpu/gpu_score_bits.py checks this
on the GPU). Softmax ranks by the logit (monotonic: the probability order, without the ties
that rounding or underflow put into probabilities): both paths read the same logits, so its ids do
not depend on any exp at all; its weights differ from torch's by the order of the sum (ulps).
Consequence: an expert whose logit is -inf (selection -inf) is never piggybacked.
Under TRITON_INTERPRET=1 exp is numpy's, which is not torch's CPU exp in the last bit.

Launch 1 (`_oea_union_kernel`, one program per row) ranks the row's routed top-K and marks its
base (the K0 best) in a union bitmap U [N] int32. Every writer stores the same value 1, so the
result does not depend on the order of the programs.
Launch 2 (`_oea_route_kernel`, one program per row) reads U, picks the row's K - K0 piggybacked
experts (or the fills), computes the weights and applies the gate. The last program to
finish (an atomic ticket counter) clears U again, so the workspace is clean for the next call
without any extra launch or torch op.

Settings read on the device. Both launches read k0, and launch 2 the gate bounds, from a control
block int32 [3] = (k0, min_batch, max_batch) in device memory, never from launch arguments: a
CUDA graph captured once follows every later value written there (live settings), and one compiled
variant serves every k0. The gate (launch 2) is
    1 <= k0 < K  and  rows >= min_batch * rows_per_request  and  (max_batch == 0 or rows <= max_batch)
with rows the device row count; rows_per_request (1 in decode, the draft tokens per request in a
speculative verify pass) is fixed per graph and stays a launch argument. Gate closed (k0 = 0: OEA
off; k0 >= K: a no-op; or the batch outside the bounds): the outputs are the router's ids and
weights, bit for bit.

Optional per-layer statistics (`stats=`, an int64 [3] view of a persistent [L, 3] buffer): launch 1
also marks every routed id of a valid row in a second bitmap R [N] int32; the last program of
launch 2 counts U and R, adds gate * (1, |R|, T_after) to stats with integer atomics and clears R
with U. T_after = max(|U|, K) if there is a valid row, else 0: the number of distinct experts in
the output rows of the valid rows (OEA completes every valid row from one shared fill order, which
guarantees it; tested against reference.distinct_experts). No extra launch.

Shared-expert columns: SGLang appends fused shared-expert columns after the K routed ones
(`num_routed` < topk_ids.shape[1]); launch 2 copies them through unchanged, so the caller needs no
torch.cat around the kernel.

Graph safety: no host sync, no shape that depends on tensor values, and with a workspace no
allocation. The row count and the settings are always read on the device, from 1-element / 3-element
int32 tensors (the caller's, or the workspace's `rows` and `control` slots, written from ints), so
eager calls and CUDA-graph capture launch the same compiled variant: one eager call compiles and
loads everything a capture will launch (`kernel_launches` + `KernelLaunch.variant` let a caller
check this before capturing).
Determinism: no floating-point atomics (the statistics are integer atomics, so their sums do not
depend on the order either); each row's result depends only on its inputs and on U, so every TP
rank that sees the same logits produces the same ids and weights.

Optional lost router mass (`lost=`, an int64 [MAX_K0] view of a persistent buffer, one column per
k0): where the gate is open, every valid row adds its reference.lost_router_mass in units of
2^-20 (rounded to the nearest unit) to lost[k0], with one integer atomic; its own ids and
weights are read in launch 2 anyway, and a closed gate skips the work. Float32 sums in another
order than torch's may move a row's share by one unit. No extra launch.

Optional rank-check checksum (`checksum=`, an int64 [1] view of a persistent buffer): launch 2
adds reference.ids_checksum(ids[:rows, :K]) of its output ids, gate open or closed: each program
mixes its own row and adds it with one wrapping integer atomic (order-independent). No extra launch.

Use under CUDA graphs (one workspace per MoE layer, allocated before capture):

    ws = OEAWorkspace.allocate(N, K, max_bucket_rows, torch.int32, torch.float32, "cuda")
    real_rows = torch.zeros(1, dtype=torch.int32, device="cuda")   # persistent
    control = torch.tensor([3, 4, 0], dtype=torch.int32, device="cuda")  # k0, min_batch, max_batch
    # eagerly once (compiles and loads), then during capture:
    ids, weights = oea_route(logits, topk_ids, topk_weights, control=control, scoring_func="softmax",
                             num_valid_rows=real_rows, workspace=ws)
    # before each replay: real_rows.fill_(n); to change a setting between replays: control[0].fill_(5)
    # optional counters: sums = torch.zeros(L, 3, dtype=torch.int64, device="cuda") before capture,
    # then pass stats=sums[layer]; read sums on the host whenever (one sync), zero it in place.

`ids`/`weights` are views ws.out_ids[:B] / ws.out_weights[:B]: the same memory on every replay,
overwritten by the next call with the same workspace.

This file tells the story in order: the scores and the per-row pieces (@triton.jit helpers), the
two kernels, then the launcher: the plan of one call's two launches (`kernel_launches`) and
`oea_route` itself. The workspace is OEAWorkspace (sglang_oea.kernels.workspace); a planned launch
and the compiled variant it needs are a KernelLaunch (sglang_oea.kernels.launch); the checks of a
call's arguments are in sglang_oea.kernels.checks; the per-row checksum and lost-mass helpers are
in sglang_oea.kernels.row_counters.
"""

from typing import Callable, Optional, Tuple, Union

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from sglang_oea.kernels.checks import MAX_EXPERTS, MAX_TOP_K, check_arguments, check_settings
from sglang_oea.kernels.launch import KernelLaunch
from sglang_oea.kernels.workspace import OEAWorkspace
from sglang_oea.kernels.row_counters import add_lost_mass, add_row_checksum

# Compile options of every launch: libdevice without flush-to-zero, as nvcc (and so PyTorch)
# links it by default; Triton's default would flush subnormal exp results to 0.
COMPILE_OPTIONS = (("enable_reflect_ftz", False),)

# The interpreter cannot call libdevice: there exp is numpy's (chosen when this module is
# imported, as triton.jit chooses between compiling and interpreting).
_INTERPRETED = tl.constexpr(bool(triton.knobs.runtime.interpret))


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


@triton.jit
def _load_bitmaps(union_ptr, routed_ptr, cols, in_row, STATS: tl.constexpr):
    """U and, with STATS, R as [N_PAD] booleans (without STATS, R is U: the caller never reads it).

    Every program loads R next to U (R is stable in launch 2), so that the last program, the only
    one that uses it, adds no load latency to the serial tail.
    """
    in_union = tl.load(union_ptr + cols, mask=in_row, other=0) != 0
    if STATS:
        routed = tl.load(routed_ptr + cols, mask=in_row, other=0) != 0
    else:
        routed = in_union
    return in_union, routed


@triton.jit
def _fill_slots(ids, rank, is_base, key, cols, valid, k0, K: tl.constexpr, K_PAD: tl.constexpr):
    """A row's K output ids [K_PAD] int32 and which of them carry weight (active [K_PAD]).

    A valid row's slots [0, k0) hold its base ranked (a padded row has none). The remaining slots
    take the experts in the descending order of `key` (_pick_keys): the best piggyback candidates,
    active, then the fills, inactive.
    """
    slots = tl.arange(0, K_PAD)
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
    return out, active


@triton.jit
def _oea_weights(out, active, w, cols, own_w):
    """Weights [K_PAD] float32 of a row's output ids `out`, as reference.opportunistic_weights:
    p_j = w[out_j] (w [N_PAD]: the weight scores of _scores), and
    new_w_j = active_j * p_j / sum_j'(active * p) * sum_j(own_w), 0 if the active sum is 0,
    where own_w [K_PAD] are the row's router weights."""
    p = tl.sum(tl.where(out[:, None] == cols[None, :], w[None, :], 0.0), axis=1)
    picked = tl.where(active, p, 0.0)
    total = tl.sum(picked, axis=0)
    scale = tl.div_rn(tl.sum(own_w.to(tl.float32), axis=0), tl.maximum(total, 1.1754943508222875e-38))
    return tl.where(total > 0, picked * scale, 0.0)


@triton.jit
def _copy_shared_columns(ids_ptr, weights_ptr, out_ids_ptr, out_weights_ptr, K: tl.constexpr,
                         EXTRA: tl.constexpr, EXTRA_PAD: tl.constexpr):
    """Copy a row's fused shared-expert columns K..K + EXTRA through, gate open or closed."""
    extra = K + tl.arange(0, EXTRA_PAD)
    in_extra = extra < K + EXTRA
    x_ids = tl.load(ids_ptr + extra, mask=in_extra)
    x_w = tl.load(weights_ptr + extra, mask=in_extra)
    tl.store(out_ids_ptr + extra, x_ids, mask=in_extra)
    tl.store(out_weights_ptr + extra, x_w, mask=in_extra)


@triton.jit
def _last_program_clears(union_ptr, routed_ptr, counter_ptr, stats_ptr, in_union, routed, cols, in_row, rows, gate,
                         K: tl.constexpr, STATS: tl.constexpr, N_PAD: tl.constexpr):
    """Self-cleaning union: the last program of launch 2 to arrive (all others have read U) zeroes
    U and the counter; with STATS it first adds gate * (1, |R|, T_after) to stats [3] int64 and
    zeroes R too."""
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


@triton.jit
def _clamp_k0(k0, K: tl.constexpr):
    """k0 clamped to [0, K]: outside [1, K) the gate closes, and the clamp keeps every loop over
    slots within K whatever the control block holds."""
    return tl.minimum(tl.maximum(k0, 0), K)


@triton.jit
def _read_control(control_ptr, rows, rows_per_request, K: tl.constexpr):
    """(k0 clamped, gate) from the control block [k0, min_batch, max_batch] and the real row count.
    gate: 1 <= k0 < K, rows >= min_batch * rows_per_request, and max_batch == 0 or rows <= max_batch."""
    k0 = tl.load(control_ptr)
    min_batch = tl.load(control_ptr + 1)
    max_batch = tl.load(control_ptr + 2)
    gate = (k0 >= 1) & (k0 < K) & (rows >= min_batch * rows_per_request) & ((max_batch == 0) | (rows <= max_batch))
    return _clamp_k0(k0, K), gate


# Scalars that may change between calls of one layer: never specialised, so one compiled variant
# serves every value (an int equal to 1 would otherwise become a compile-time constant). k0 and
# the gate bounds are not arguments at all: they are read from the control block.
ROUTE_DO_NOT_SPECIALIZE = ("rows_per_request",)
# The checksum slot is a view into the counter table (8 mod 16 bytes): one variant for any
# alignment, shared by every layer (only one scalar atomic reads the pointer); the lost row is
# read by one scalar atomic too. The control block
# is read by three scalar loads: one variant whatever tensor holds it.
UNION_DO_NOT_SPECIALIZE_ON_ALIGNMENT = ("control_ptr",)
ROUTE_DO_NOT_SPECIALIZE_ON_ALIGNMENT = ("checksum_ptr", "control_ptr", "lost_ptr")


@triton.jit(do_not_specialize_on_alignment=UNION_DO_NOT_SPECIALIZE_ON_ALIGNMENT)
def _oea_union_kernel(
    logits_ptr, bias_ptr, topk_ids_ptr, union_ptr, routed_ptr, num_valid_ptr, control_ptr,
    N, stride_logits, stride_ids,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, STATS: tl.constexpr,
    K: tl.constexpr, K_PAD: tl.constexpr, N_PAD: tl.constexpr,
):
    """Launch 1: U[e] = 1 for every expert e in the base of some valid row.

    logits [B, N], topk_ids [B, >= K] (routed ids first, any column order), bias [N] (sigmoid
    only), union [N] int32 (all zero on entry), num_valid_ptr [1] int32 (the real row count),
    control_ptr [3] int32 (k0, min_batch, max_batch; only k0 is read here).
    Program r handles row r; rows >= num_valid_rows write nothing.
    base_r = the k0 routed ids of row r with the highest selection score (ties: lower id).
    STATS: also R[e] = 1 (routed [N] int32, zero on entry) for every routed id e of a valid row.
    """
    row = tl.program_id(0).to(tl.int64)
    rows = tl.load(num_valid_ptr).to(tl.int32)
    k0 = _clamp_k0(tl.load(control_ptr), K)
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
    logits_ptr, bias_ptr, topk_ids_ptr, topk_weights_ptr, union_ptr, routed_ptr, counter_ptr, stats_ptr,
    checksum_ptr, lost_ptr, out_ids_ptr, out_weights_ptr, num_valid_ptr, control_ptr,
    N, group_size, rows_per_request,
    stride_logits, stride_ids, stride_weights, stride_out_ids, stride_out_weights,
    SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RESTRICT_GROUPS: tl.constexpr, STATS: tl.constexpr,
    CHECKSUM: tl.constexpr, LOST: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, EXTRA: tl.constexpr,
    EXTRA_PAD: tl.constexpr, N_PAD: tl.constexpr,
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
    active sum is 0 (_oea_weights). Gate (_read_control, from control_ptr [3] int32 = k0, min_batch,
    max_batch, and rows_per_request) closed: out = (topk_ids, topk_weights) bit for bit.
    STATS: the last program adds gate * (1, |R|, T_after) to stats [3] int64 (R from launch 1,
    T_after = max(|U|, K) if num_valid_rows >= 1 else 0) and clears R with U.
    CHECKSUM: every valid row adds its share of ids_checksum(out_ids[:, :K]) to checksum [1] int64.
    LOST: with the gate open, every valid row adds its lost router mass (units) to lost [MAX_K0] at k0.
    """
    row = tl.program_id(0).to(tl.int64)
    rows = tl.load(num_valid_ptr).to(tl.int32)
    k0, gate = _read_control(control_ptr, rows, rows_per_request, K)
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
    in_union, routed = _load_bitmaps(union_ptr, routed_ptr, cols, in_row, STATS)
    key = _pick_keys(sel, in_union, held, cols, N, valid)
    out, active = _fill_slots(ids, rank, is_base, key, cols, valid, k0, K, K_PAD)

    own_ids = tl.load(topk_ids_ptr + row * stride_ids + slots, mask=in_k)
    own_w = tl.load(topk_weights_ptr + row * stride_weights + slots, mask=in_k, other=0.0)
    new_w = _oea_weights(out, active, w, cols, own_w)
    out_ids = tl.where(gate, out.to(own_ids.dtype), own_ids)
    out_w = tl.where(gate, new_w.to(own_w.dtype), own_w)
    tl.store(out_ids_ptr + row * stride_out_ids + slots, out_ids, mask=in_k)
    tl.store(out_weights_ptr + row * stride_out_weights + slots, out_w, mask=in_k)
    if CHECKSUM:
        add_row_checksum(checksum_ptr, out_ids, in_k, row, valid)
    if LOST:
        add_lost_mass(lost_ptr, own_ids, own_w, out_ids, out_w, in_k, k0, N, valid & gate)
    if EXTRA > 0:
        _copy_shared_columns(topk_ids_ptr + row * stride_ids, topk_weights_ptr + row * stride_weights,
                             out_ids_ptr + row * stride_out_ids, out_weights_ptr + row * stride_out_weights,
                             K, EXTRA, EXTRA_PAD)
    _last_program_clears(union_ptr, routed_ptr, counter_ptr, stats_ptr, in_union, routed, cols, in_row, rows, gate,
                         K, STATS, N_PAD)


def _num_warps(n_pad: int, k_pad: int) -> int:
    """Warps per program: the [K_PAD, N_PAD] tiles dominate; ~64 elements per thread."""
    return max(1, min(8, (n_pad * k_pad) // 2048))


def kernel_launches(router_logits: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                    control: torch.Tensor, num_valid_rows: torch.Tensor, workspace: OEAWorkspace,
                    num_routed: Optional[int] = None, scoring_func: str = "softmax",
                    correction_bias: Optional[torch.Tensor] = None, num_groups: int = 1,
                    restrict_groups: bool = False, rows_per_request: int = 1, stats: Optional[torch.Tensor] = None,
                    checksum: Optional[torch.Tensor] = None, lost: Optional[torch.Tensor] = None,
                    ) -> Tuple[KernelLaunch, KernelLaunch]:
    """The two launches of one `oea_route` call (arguments as there, already checked; the row count
    and the control block as device tensors), unlaunched."""
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
            ("control_ptr", control), ("N", num_experts), ("stride_logits", router_logits.stride(0)),
            ("stride_ids", topk_ids.stride(0)),
        ),
        constexprs=tuple(shared.items()),
        do_not_specialize=(),
        num_warps=num_warps,
        grid=(num_rows,),
        options=COMPILE_OPTIONS,
        do_not_specialize_on_alignment=UNION_DO_NOT_SPECIALIZE_ON_ALIGNMENT,
    )
    route = KernelLaunch(
        _oea_route_kernel,
        args=(
            ("logits_ptr", router_logits), ("bias_ptr", bias), ("topk_ids_ptr", topk_ids),
            ("topk_weights_ptr", topk_weights), ("union_ptr", workspace.union), ("routed_ptr", workspace.routed),
            ("counter_ptr", workspace.counter),
            ("stats_ptr", workspace.counter if stats is None else stats),  # placeholder pointer without stats
            ("checksum_ptr", workspace.counter if checksum is None else checksum),  # placeholder without checksum
            ("lost_ptr", workspace.counter if lost is None else lost),  # placeholder without lost
            ("out_ids_ptr", out_ids), ("out_weights_ptr", out_weights), ("num_valid_ptr", num_valid_rows),
            ("control_ptr", control), ("N", num_experts),
            ("group_size", num_experts // num_groups if restrict else num_experts),
            ("rows_per_request", rows_per_request), ("stride_logits", router_logits.stride(0)),
            ("stride_ids", topk_ids.stride(0)), ("stride_weights", topk_weights.stride(0)),
            ("stride_out_ids", out_ids.stride(0)), ("stride_out_weights", out_weights.stride(0)),
        ),
        constexprs=tuple(shared.items()) + (
            ("RESTRICT_GROUPS", restrict), ("CHECKSUM", checksum is not None), ("LOST", lost is not None),
            ("EXTRA", extra),
            ("EXTRA_PAD", triton.next_power_of_2(max(extra, 1))),
        ),
        do_not_specialize=ROUTE_DO_NOT_SPECIALIZE,
        num_warps=num_warps,
        grid=(num_rows,),
        options=COMPILE_OPTIONS,
        do_not_specialize_on_alignment=ROUTE_DO_NOT_SPECIALIZE_ON_ALIGNMENT,
    )
    return union, route


def call_workspace(workspace: Optional[OEAWorkspace], router_logits: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor) -> OEAWorkspace:
    """The workspace of one `oea_route` call, checked against it: the caller's, or new buffers sized
    for this call (not allowed under capture)."""
    num_rows, num_experts = router_logits.shape
    if workspace is None:
        workspace = OEAWorkspace.allocate(num_experts, topk_ids.shape[1], num_rows, topk_ids.dtype,
                                          topk_weights.dtype, router_logits.device)
    workspace.check(num_rows, num_experts, topk_ids, topk_weights)
    return workspace


def oea_route(router_logits: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
              k0: Optional[int] = None, num_routed: Optional[int] = None, scoring_func: str = "softmax",
              correction_bias: Optional[torch.Tensor] = None, num_groups: int = 1, restrict_groups: bool = False,
              num_valid_rows: Optional[Union[int, torch.Tensor]] = None, min_batch: int = 1, max_batch: int = 0,
              control: Optional[torch.Tensor] = None, rows_per_request: int = 1,
              workspace: Optional[OEAWorkspace] = None, stats: Optional[torch.Tensor] = None,
              checksum: Optional[torch.Tensor] = None, before_launch: Optional[Callable[[KernelLaunch], None]] = None,
              lost: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gated OEA routing from logits; same result as sglang_oea.routing.route_from_logits.

    Args:
        router_logits: [B, N] float logits (any float dtype, last dim contiguous).
        topk_ids: [B, C] int32/int64: K routed ids (any column order, distinct per row), then
            C - K fused shared-expert ids, which are copied through.
        topk_weights: [B, C] float router weights for topk_ids.
        k0, min_batch, max_batch: the settings as host ints (control None): k0 >= 1; k0 >= K
            returns (topk_ids, topk_weights) themselves, else the three are written to
            workspace.control (three fills). OEA applies iff min_batch <= rows and (max_batch == 0
            or rows <= max_batch); otherwise the outputs equal the inputs bit for bit.
        control: or the settings on the device (k0 None): a contiguous int32 [3] tensor (k0,
            min_batch, max_batch) on the logits' device, read at every launch, so that a captured
            graph follows later writes. OEA applies iff 1 <= k0 < K, rows >= min_batch *
            rows_per_request and (max_batch == 0 or rows <= max_batch); otherwise the outputs
            (workspace views) equal the inputs bit for bit. One compiled variant serves every k0.
        rows_per_request: token rows per request (1 in decode, draft tokens per request in a
            verify pass), scaling the control block's min_batch; with control only.
        num_routed: K, the routed columns (default C: no shared-expert columns).
        scoring_func: "softmax" or "sigmoid"; correction_bias [N] (sigmoid, selection only).
        num_groups, restrict_groups: as RouterSpec; candidates limited to touched groups.
        num_valid_rows: rows past this count are padding. A 1-element int32 tensor on the
            logits' device (read on the device: use this under CUDA graphs), an int, or None
            (all B rows are real); an int is written to workspace.rows first (one fill).
        workspace: preallocated buffers; None allocates them (not allowed under capture).
        stats: None, or a contiguous int64 tensor of 3 elements on the logits' device (e.g. the
            row sums[layer] of a persistent [L, 3] buffer). The call adds, with integer atomics
            (no host sync, no extra launch, graph-safe), gate * (1, T_before, T_after): the distinct
            experts among topk_ids[:rows, :K] and among ids[:rows, :K], rows = min(num_valid_rows,
            B); T_after = max(|U|, K) if rows >= 1 else 0, exactly (see the module docstring).
        checksum: None, or an int64 tensor of 1 element on the logits' device (any alignment, e.g.
            counters[layer, 3:4] of a persistent [L, 4] buffer). The call adds
            reference.ids_checksum(ids[:, :K], rows), gate open or closed (wrapping integer atomics).
        lost: None, or a contiguous int64 tensor of MAX_K0 elements on the logits' device (e.g. a
            layer's lost row of sglang_oea.counters). With the gate open, the call adds at [k0] the
            sum over the valid rows of reference.lost_router_mass in units of 2^-20 (each row rounded
            to the nearest unit; within one unit of reference.lost_router_mass_units per row).
            A call that launches nothing (an int k0 >= K, or B == 0) adds nothing to stats, checksum
            or lost.
        before_launch: called with each KernelLaunch before it runs (routers.TritonRouter records
            the compiled variants before graph capture with it, and refuses unseen ones during it).
    Returns:
        ids [B, C] (topk_ids dtype) and weights [B, C] (topk_weights dtype).
    """
    check_arguments(router_logits, topk_ids, topk_weights, num_routed, scoring_func, correction_bias,
                    num_groups, restrict_groups, stats, checksum, lost)
    check_settings(k0, control, rows_per_request, router_logits.device)
    if control is None and k0 >= (topk_ids.shape[1] if num_routed is None else num_routed):
        return topk_ids, topk_weights
    num_rows = router_logits.shape[0]
    workspace = call_workspace(workspace, router_logits, topk_ids, topk_weights)
    if num_rows == 0:
        return workspace.out_ids[:0], workspace.out_weights[:0]
    rows = workspace.row_count(num_valid_rows, num_rows)
    control = workspace.control_block(control, k0, min_batch, max_batch)
    for launch in kernel_launches(
        router_logits, topk_ids, topk_weights, control=control, num_valid_rows=rows, workspace=workspace, num_routed=num_routed, scoring_func=scoring_func,
        correction_bias=correction_bias, num_groups=num_groups, restrict_groups=restrict_groups,
        rows_per_request=rows_per_request, stats=stats, checksum=checksum, lost=lost,
    ):
        if before_launch is not None:
            before_launch(launch)
        launch.run()
    return workspace.out_ids[:num_rows], workspace.out_weights[:num_rows]
