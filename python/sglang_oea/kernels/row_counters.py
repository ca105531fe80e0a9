"""Per-row counters of the fused route kernel (sglang_oea.kernels.oea_route), as @triton.jit helpers
that its launch 2 calls for each valid row: the rank-check checksum share of the row's output ids, and
the row's lost router mass (the live quality signal). Each is one integer atomic per row, in
parallel with the other rows, so no program reads every row in the serial tail, and integer sums
do not depend on the order in which the rows arrive. No SGLang import.
"""

import triton
import triton.language as tl

from sglang_oea.reference import MASS_ONE, MIX1, MIX2, ROW_SHIFT

# The checksum's constants (sglang_oea.reference.ids_checksum).
_MIX1 = tl.constexpr(MIX1)
_MIX2 = tl.constexpr(MIX2)
_ROW_SHIFT = tl.constexpr(ROW_SHIFT)
# The lost router mass's fixed-point unit (sglang_oea.reference.lost_router_mass_units).
_MASS_ONE = tl.constexpr(float(MASS_ONE))


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
def add_row_checksum(checksum_ptr, ids, in_k, row, valid):
    """checksum [1] int64 += a valid row's share of ids_checksum (_ids_checksum_part). One atomic
    per valid row, in parallel with the other rows, rather than the last program reading every
    row's ids in the serial tail; the wrapping integer sum does not depend on the order in which
    the rows arrive."""
    part = _ids_checksum_part(ids, in_k, row)
    tl.atomic_add(checksum_ptr, part, mask=valid, sem="relaxed", scope="gpu")


@triton.jit
def add_lost_mass(lost_ptr, own_ids, own_w, out_ids, out_w, in_k, k0, N, counted):
    """lost [MAX_K0] int64 at k0 += the row's reference.lost_router_mass in units of 2^-20 where
    `counted` (a valid row, gate open): the share of its own routed weight (ids in [0, N)) whose
    experts are not among its output ids with a weight > 0. Inputs [K_PAD], masked by in_k."""
    if counted:
        weighted = in_k & (out_w > 0)
        kept = tl.max(((own_ids[:, None] == out_ids[None, :]) & weighted[None, :]).to(tl.int32), axis=1) > 0
        w = tl.where(in_k & (own_ids >= 0) & (own_ids < N), own_w.to(tl.float32), 0.0)
        total = tl.sum(w, axis=0)
        gone = tl.sum(tl.where(kept, 0.0, w), axis=0)
        share = tl.minimum(tl.div_rn(gone, tl.maximum(total, 1.1754943508222875e-38)), 1.0)
        share = tl.where(total > 0, share, 0.0)
        # share * 2^20 is exact and + 0.5 exact below 2^23: the truncation rounds to nearest.
        units = (share * _MASS_ONE + 0.5).to(tl.int64)
        tl.atomic_add(lost_ptr + k0, units, sem="relaxed", scope="gpu")
