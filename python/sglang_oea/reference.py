"""Simplified Opportunistic Expert Activation (arXiv 2511.02237, Algorithm 1) in pure torch.

This module is the definition of OEA for the whole project: the SGLang hooks call it on the CPU,
the Triton kernel is tested against it, and it imports nothing from SGLang.

Shape legend: B = rows (tokens), N = routed experts, K = routed experts per row, K0 = base size.

For each valid row r (r < num_valid_rows), with experts ranked by selection score, descending,
ties going to the lower expert id:
    base_r  = the K0 best of the row's own routed top-K         (whatever order its columns had)
    U       = union of base_r over the valid rows
    extra_r = the K - K0 best experts of U minus base_r, searched over all N (any rank)
An expert whose selection score is -inf is never piggybacked (the SGLang layer uses this to keep
candidates inside the routing groups a row selected; a softmax router's -inf logit is one too).

A row "runs short" when U minus base_r holds fewer than K - K0 eligible experts. SGLang's MoE
runners need K distinct valid ids per row, so short rows and padded rows (r >= num_valid_rows) are
completed from one shared fill order: the experts of U by id ascending, then the experts outside U
by id ascending, skipping experts the row already holds. Fill slots are inactive (weight 0).
Because every row draws on the same fill order, a batch loads exactly max(|U|, K) distinct
experts: only U when |U| >= K, and never more than the router's K otherwise.

Selection scores are an input here; sglang_oea.routing.score_experts defines them per router:
the float32 logit for softmax routers (softmax is monotonic: the probability order, without the
ties that rounding or underflow put into probabilities), sigmoid(logit) + correction bias for
sigmoid routers. The fused kernel computes the same selection bits (sglang_oea.kernels.oea_route).

`lost_router_mass` defines the live quality signal: the share of each token's own routed weight
whose experts OEA dropped (sglang_oea.counters sums it per layer on the device, in fixed point;
both routing paths compute it with this definition).

`ids_checksum` is the rank-check digest of a batch's expert choice (sglang_oea.rank_check): the
fused kernel can add it on the device, and is tested against this definition.
"""

from typing import Optional, Tuple, Union

import torch

RowCount = Optional[Union[int, torch.Tensor]]

# ids_checksum: odd 64-bit mixing constants (splitmix64's), as signed int64; products wrap.
MIX1 = 0x9E3779B97F4A7C15 - (1 << 64)
MIX2 = 0xBF58476D1CE4E5B9 - (1 << 64)
ROW_SHIFT = 20  # expert ids < 2**20

# lost_router_mass_units: a token's share of router mass in fixed point (1 = MASS_ONE units, 2^-20
# resolution): an int64 per-layer sum then holds 2^43 tokens, years of traffic.
MASS_BITS = 20
MASS_ONE = 1 << MASS_BITS

# Fill classes, in the order a row consumes them (see the module docstring).
_ELIGIBLE, _FILL_IN_UNION, _FILL_OUTSIDE, _HELD = 0, 1, 2, 3


def valid_row_mask(num_rows: int, num_valid_rows: RowCount, device: torch.device) -> torch.Tensor:
    """[num_rows] bool: True for the first num_valid_rows rows (all rows when it is None).

    num_valid_rows may be a 0-d device tensor, so no host sync is needed under CUDA graphs.
    """
    rows = torch.arange(num_rows, device=device)
    if num_valid_rows is None:
        return torch.ones(num_rows, dtype=torch.bool, device=device)
    return rows < num_valid_rows


def rank_routed_columns(selection_scores: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Sort each row's routed ids by selection score, descending, ties to the lower id.

    Args:
        selection_scores: [B, N] float, the router's selection score per expert.
        topk_ids: [B, K] int, the router's routed top-K in any column order.
    Returns:
        [B, K] int64 ids, best first.
    """
    ids_ascending = topk_ids.long().sort(dim=1).values
    scores = selection_scores.gather(1, ids_ascending)
    # A stable descending sort keeps equal scores in their (ascending id) input order.
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    return ids_ascending.gather(1, order)


def _fill_classes(
    selection_scores: torch.Tensor, held: torch.Tensor, in_union: torch.Tensor
) -> torch.Tensor:
    """[B, N] int class of each expert for each row (eligible, fill in U, fill outside U, held)."""
    eligible = in_union & ~held & (selection_scores > float("-inf"))
    classes = torch.full_like(held, _FILL_OUTSIDE, dtype=torch.int8)
    classes = classes.masked_fill(in_union, _FILL_IN_UNION)
    classes = classes.masked_fill(eligible, _ELIGIBLE)
    return classes.masked_fill(held, _HELD)


def _order_candidates(selection_scores: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
    """[B, N] expert ids per row: eligible by score (desc, lower id first), then fills by id."""
    key = selection_scores.float().masked_fill(classes != _ELIGIBLE, float("-inf"))
    by_score = torch.sort(key, dim=1, descending=True, stable=True).indices
    by_class = torch.sort(classes.gather(1, by_score), dim=1, stable=True).indices
    return by_score.gather(1, by_class)


def opportunistic_slots(
    selection_scores: torch.Tensor,
    topk_ids: torch.Tensor,
    k0: int,
    num_valid_rows: RowCount = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """OEA ids plus the mask of slots that carry weight.

    Args:
        selection_scores: [B, N] float router selection scores (-inf = never piggyback).
        topk_ids: [B, K] int routed ids, any column order, distinct within a row, in [0, N).
        k0: base size, >= 1. k0 >= K returns the router's own selection, ranked.
        num_valid_rows: rows past this count are padding (int, 0-d tensor, or None = all).
    Returns:
        ids: [B, K] int64. Valid rows: slots [0, k0) the base ranked, then piggybacked experts
            ranked, then fills. Padded rows: the first K experts of the fill order.
        active: [B, K] bool, False on fill slots and on every slot of a padded row.
    """
    assert selection_scores.dim() == 2 and topk_ids.dim() == 2, f"{selection_scores.shape=} {topk_ids.shape=}"
    assert selection_scores.shape[0] == topk_ids.shape[0], f"{selection_scores.shape=} {topk_ids.shape=}"
    assert k0 >= 1, f"{k0=}"
    num_rows, num_experts = selection_scores.shape
    k = topk_ids.shape[1]
    ranked = rank_routed_columns(selection_scores, topk_ids)
    if k0 >= k:
        return ranked, torch.ones_like(ranked, dtype=torch.bool)

    valid = valid_row_mask(num_rows, num_valid_rows, selection_scores.device)[:, None]
    held = torch.zeros(num_rows, num_experts, dtype=torch.bool, device=selection_scores.device)
    held = held.scatter(1, ranked[:, :k0], True) & valid  # [B, N]
    in_union = held.any(dim=0, keepdim=True)  # [1, N]
    classes = _fill_classes(selection_scores, held, in_union)
    classes = torch.where(valid, classes, torch.where(in_union, _FILL_IN_UNION, _FILL_OUTSIDE).to(torch.int8))
    order = _order_candidates(selection_scores, classes)  # [B, N]

    extra = order[:, : k - k0]
    ids = torch.where(valid, torch.cat([ranked[:, :k0], extra], dim=1), order[:, :k])
    extra_active = classes.gather(1, extra) == _ELIGIBLE
    base_active = torch.ones(num_rows, k0, dtype=torch.bool, device=ids.device)
    active = torch.cat([base_active, extra_active], dim=1) & valid
    return ids, active


def opportunistic_topk(
    selection_scores: torch.Tensor,
    topk_ids: torch.Tensor,
    k0: int,
    num_valid_rows: RowCount = None,
) -> torch.Tensor:
    """OEA routing ids; see opportunistic_slots for arguments.

    Returns:
        [B, K] int64 ids: base (ranked), piggybacked (ranked), fills; padded rows hold fills.
    """
    return opportunistic_slots(selection_scores, topk_ids, k0, num_valid_rows)[0]


def opportunistic_weights(
    weight_scores: torch.Tensor,
    ids: torch.Tensor,
    active: torch.Tensor,
    row_sums: torch.Tensor,
) -> torch.Tensor:
    """Router scores of the final set, renormalised, scaled to the router's own row sums.

    w[r, j] = active[r, j] * p[r, ids[r, j]] / sum_j'(active * p) * row_sums[r]

    Args:
        weight_scores: [B, N] float unbiased router scores p (softmax or sigmoid, no bias).
        ids: [B, K] int64 from opportunistic_slots.
        active: [B, K] bool from opportunistic_slots.
        row_sums: [B] float, the sum of the router's own routed weights per row.
    Returns:
        [B, K] float32 weights; 0 on inactive slots and on rows whose active scores sum to 0.
    """
    # Selection, not a product with the mask: a padded row's scores may hold anything (NaN x 0 = NaN).
    picked = torch.where(active, weight_scores.float().gather(1, ids), 0.0)
    total = picked.sum(dim=1, keepdim=True)
    scale = row_sums.float()[:, None] / total.clamp_min(torch.finfo(torch.float32).tiny)
    return torch.where(total > 0, picked * scale, torch.zeros_like(picked))


def distinct_experts(ids: torch.Tensor, num_experts: int, num_valid_rows: RowCount = None) -> torch.Tensor:
    """0-d int64 tensor: the number of distinct experts that the first num_valid_rows rows use.

    Args:
        ids: [B, K] int ids in [0, num_experts).
    """
    valid = valid_row_mask(ids.shape[0], num_valid_rows, ids.device)[:, None]
    used = torch.zeros(ids.shape[0], num_experts, dtype=torch.bool, device=ids.device)
    used = used.scatter(1, ids.long(), True) & valid
    return used.any(dim=0).sum()


def batch_gate(num_valid_rows: Union[int, torch.Tensor], min_batch: int, max_batch: int) -> Union[bool, torch.Tensor]:
    """True when OEA applies to a batch of num_valid_rows real rows (0-d bool tensor for a tensor).

    min_batch <= num_valid_rows, and num_valid_rows <= max_batch unless max_batch == 0 (no cap).
    """
    above_min = num_valid_rows >= min_batch
    if max_batch == 0:
        return above_min
    return above_min & (num_valid_rows <= max_batch)


def opportunistic_route(
    selection_scores: torch.Tensor,
    weight_scores: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    k0: int,
    num_valid_rows: RowCount = None,
    min_batch: int = 1,
    max_batch: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gated OEA over the routed columns: what the SGLang layer and the fused kernel compute.

    Args:
        selection_scores: [B, N] float selection scores (-inf = never piggyback).
        weight_scores: [B, N] float unbiased router scores.
        topk_ids: [B, K] int routed ids from the router, any column order.
        topk_weights: [B, K] float the router's weights for those ids.
        k0, num_valid_rows: as in opportunistic_slots (None = every row is real).
        min_batch, max_batch: the batch gate (see batch_gate).
    Returns:
        ids [B, K] int64 and weights [B, K] in topk_weights.dtype. When the gate is closed, or
        k0 >= K, they equal the router's own topk_ids and topk_weights bit for bit.
    """
    num_rows, k = topk_ids.shape
    if k0 >= k:
        return topk_ids.long(), topk_weights
    rows = num_rows if num_valid_rows is None else num_valid_rows
    ids, active = opportunistic_slots(selection_scores, topk_ids, k0, num_valid_rows)
    weights = opportunistic_weights(weight_scores, ids, active, topk_weights.float().sum(dim=1))
    gate = torch.as_tensor(batch_gate(rows, min_batch, max_batch), device=topk_ids.device)
    ids = torch.where(gate, ids, topk_ids.long())
    weights = torch.where(gate, weights.to(topk_weights.dtype), topk_weights)
    return ids, weights


def ids_checksum(ids: torch.Tensor, rows: RowCount = None) -> torch.Tensor:
    """0-d int64 digest of the expert ids of the first `rows` rows (the rank check's, sglang_oea.rank_check).

    digest = sum over rows r < rows and columns j of mix(r, ids[r, j]), wrapping mod 2^64, with
        h = (id + (r << ROW_SHIFT) + 1) * MIX1;  mix = (h ^ (h >> 31)) * MIX2
    (int64, products wrapping, >> arithmetic). Column order does not matter; a changed id, or two
    rows trading experts, changes it except with probability about 2^-64. rows=None covers every
    row.

    Args:
        ids: [B, K] integer expert ids.
        rows: None, an int, or a 0-d / 1-element integer tensor on ids' device (read on the device:
            no host sync, so it can be captured in a CUDA graph). Rows past it are left out.
    Returns:
        0-d int64 tensor on ids' device.
    """
    num_rows, device = ids.shape[0], ids.device
    # (r << ROW_SHIFT) + 1; the end bound + 1 keeps B = 0 a valid (empty) range.
    offsets = torch.arange(1, (num_rows << ROW_SHIFT) + 1, 1 << ROW_SHIFT, device=device, dtype=torch.int64)
    h = (ids.long() + offsets[:, None]) * MIX1
    h = (h ^ (h >> 31)) * MIX2
    if rows is not None:
        h = torch.where(valid_row_mask(num_rows, rows, device)[:, None], h, 0)
    return h.sum()


def lost_router_mass(own_ids: torch.Tensor, own_weights: torch.Tensor, new_ids: torch.Tensor,
                     new_weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Per row, the share of its own routed weight whose experts OEA dropped.

    lost_r = sum_{j own, not kept} w_j / sum_{j own} w_j, over the row's routed columns j whose id
    lies in [0, num_experts) (no shared-expert columns here; a -1 id counts in neither sum); an
    own expert is kept iff it is among the row's final ids with a final weight > 0 (a fill slot
    weighs 0). 0 when the row's own weights sum to 0. The router's weights may be renormalised
    or scaled: the share does not change. 1 - lost_r is the "kept router mass".

    Written as few torch ops that copy nothing (the torch routing path runs it per MoE layer, also
    inside CUDA graphs): masked_fill, not products with masks, and the ids compared in their own
    dtype. The final slots without weight take the id -2, which no column holds.

    Args:
        own_ids, own_weights: [B, K] the router's routed ids and weights.
        new_ids, new_weights: [B, K] the ids and weights OEA hands to the layer (the router's own
            where OEA did not apply: the share is then exactly 0).
    Returns:
        [B] float32 in [0, 1].
    """
    w = own_weights if own_weights.dtype == torch.float32 else own_weights.float()
    foreign = own_ids.clamp(0, num_experts - 1) != own_ids  # ids outside [0, N)
    weighted = new_ids.masked_fill(new_weights <= 0, -2)
    kept = (own_ids[:, :, None] == weighted[:, None, :]).any(dim=2)
    gone = w.masked_fill(kept | foreign, 0.0).sum(dim=1)
    total = w.masked_fill(foreign, 0.0).sum(dim=1)
    return gone / total.clamp_min(torch.finfo(torch.float32).tiny)


def lost_router_mass_units(own_ids: torch.Tensor, own_weights: torch.Tensor, new_ids: torch.Tensor,
                           new_weights: torch.Tensor, num_experts: int, rows: RowCount = None) -> torch.Tensor:
    """0-d int64: the sum over the first `rows` rows of lost_router_mass, in units of 2^-MASS_BITS
    rounded to the nearest unit (the device counters' column). The fused kernel rounds each row
    and the torch path the sum, so the two agree to within one unit per row.

    Rows are left out by selection, never by a product with a mask: a padded row of a graph pass
    holds whatever its buffer held, and one NaN there (NaN x 0 = NaN) would turn the sum into
    -2^63 in the layer's counter for good. (A real row with a weight that is not finite has no
    share; the metrics skip an interval whose counts cannot be right: sglang_oea.metrics.)"""
    share = lost_router_mass(own_ids, own_weights, new_ids, new_weights, num_experts)
    if isinstance(rows, torch.Tensor):
        share = torch.where(valid_row_mask(own_ids.shape[0], rows, own_ids.device), share, 0.0)
    elif rows is not None:
        share = share[:rows]
    return (share.sum() * MASS_ONE).round().long()
