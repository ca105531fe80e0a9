"""From router logits to OEA routing: scores, group restriction, gating. Pure torch, no SGLang.

Shape legend: B = rows, N = routed experts, K = routed experts per row, G = expert groups.

Selection score (what ranks experts) and weight score (what weights them) follow the router,
all in float32:
    softmax routing: selection = logits                            weight = softmax(logits)
    sigmoid routing: selection = weight + correction_bias (or weight)  weight = sigmoid(logits)
Softmax is monotonic, so ranking by the logit is ranking by probability, except that rounding (or
underflow to 0) can tie probabilities whose logits differ: the logit breaks those ties the way the
router itself saw them, and it is the same bits on every path, since every path reads the same
logits. One consequence: an expert whose logit is -inf has selection -inf and is never a
piggyback candidate (reference: "-inf = never piggyback"); its probability is 0 anyway.
The fused kernel (sglang_oea.kernels.oea_route) computes the same selection bits as torch on
CUDA: the logit itself, or 1 / (1 + exp(-x)) with CUDA's accurate expf and an IEEE division
(torch.sigmoid's own formula), then one float32 add of the bias; benchmark/oea/gpu/gpu_score_bits.py
verifies it on a GPU.
With grouped routing (topk_group < G), a row may only piggyback experts of the groups its own
routed top-K lies in, a subset of the groups the router selected for it.

`route_from_logits` is the CPU path, the fallback on CUDA (also inside CUDA graphs) and the
oracle for the fused kernel in sglang_oea.kernels. It returns bit for bit what `score_experts`,
`mask_foreign_groups` and `reference.opportunistic_route` compute, in 21 to 39 torch ops instead
of 63 to 75 (over 200 counting their sub-ops): like the kernel, it ranks experts by composite
int64 keys (see `_score_keys`), so that one torch.topk over [B, N] replaces the stable sorts.

Live settings. k0, min_batch and max_batch may be host ints or 0-d device tensors: the values of
the device control block (CONTROL_FIELDS, `control_values`) that a captured CUDA graph reads at
every replay, so that a setting changed between replays takes effect without recapture. A device
k0 ranks all K routed columns and lifts those of rank < k0; the gate then also requires
1 <= k0 < K (k0 = 0: OEA off; k0 >= K: a no-op), and is applied on the device. Results equal
those of the int path for every k0 (for an int k0 outside [1, K) the router's own tensors come
back without any op).
"""

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple, Union

import torch

from sglang_oea.reference import RowCount, batch_gate

# A setting as routing reads it: a host int, or a 0-d / 1-element integer tensor on the device.
Setting = Union[int, torch.Tensor]
# The device control block of the live settings: int32 [3] in this order (the kernel reads it too).
CONTROL_FIELDS = ("k0", "min_batch", "max_batch")

# Key layout: order-preserving score bits (32, signed) above the 16 id bits; see _score_keys.
_ID_BITS = 16
# Added to the keys of a row's base, so that its K0 experts take the first slots, ranked.
_BASE_TIER = 1 << 49
# The keys of experts outside U: below every key of U (|score part| < 2^47), in id order.
_OUTSIDE_U = -(1 << 49)
_INT32_MIN = -(1 << 31)
# The int32 bits of -inf, and what the signed mapping of _score_keys makes of them.
_NEG_INF_BITS = -(1 << 23)
_NEG_INF_SIGNED = _INT32_MIN - _NEG_INF_BITS
_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class RouterSpec:
    """How the model's router scores experts; built once per layer from SGLang's TopKConfig.

    scoring_func: "softmax" or "sigmoid".
    correction_bias: [N] float or None; added to selection scores only.
    num_groups: G, expert groups (1 = ungrouped).
    restrict_groups: True when the router selects fewer than G groups per row.
    """

    scoring_func: str
    correction_bias: Optional[torch.Tensor] = None
    num_groups: int = 1
    restrict_groups: bool = False


def softmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Row softmax of [B, N] float32 logits.

    Written out because ATen's CPU softmax forks an OpenMP region per call, which stalls for
    milliseconds on a loaded 2-core host; these element-wise ops stay in microseconds.
    """
    shifted = (logits - logits.amax(dim=-1, keepdim=True)).exp()
    return shifted / shifted.sum(dim=-1, keepdim=True)


def _float32(tensor: torch.Tensor) -> torch.Tensor:
    """tensor as float32; no op at all when it already is (.float() would still dispatch one)."""
    return tensor if tensor.dtype == torch.float32 else tensor.float()


def score_experts(router_logits: torch.Tensor, spec: RouterSpec) -> Tuple[torch.Tensor, torch.Tensor]:
    """Selection and weight scores from raw router logits (see the module docstring).

    softmax: selection = the float32 logits (a -inf logit: never piggybacked), weight = softmax.
    sigmoid: weight = torch.sigmoid(logits), selection = weight + correction_bias (or weight).

    Args:
        router_logits: [B, N] logits, any float dtype.
    Returns:
        selection: [B, N] float32; weight: [B, N] float32.
    """
    logits = _float32(router_logits)
    if spec.scoring_func == "softmax":
        return logits, softmax_rows(logits)
    if spec.scoring_func != "sigmoid":
        raise ValueError(f"OEA supports scoring_func 'softmax' or 'sigmoid', got {spec.scoring_func!r}")
    weight = torch.sigmoid(logits)
    if spec.correction_bias is None:
        return weight, weight
    return weight + _float32(spec.correction_bias), weight


def mask_foreign_groups(selection: torch.Tensor, topk_ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Set to -inf the selection score of experts outside the groups a row's top-K lies in.

    Args:
        selection: [B, N] float32, N divisible by num_groups.
        topk_ids: [B, K] int routed ids.
    Returns:
        [B, N] float32.
    """
    num_rows, num_experts = selection.shape
    group_size = num_experts // num_groups
    touched = torch.zeros(num_rows, num_groups, dtype=torch.bool, device=selection.device)
    touched = touched.scatter(1, topk_ids.long() // group_size, True)  # [B, G]
    allowed = touched.repeat_interleave(group_size, dim=1)  # [B, N]
    return selection.masked_fill(~allowed, float("-inf"))


def _capturing(device: torch.device) -> bool:
    """True while a CUDA graph is being captured on the current stream of `device`."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# (key, device) -> a constant tensor that calls only read: id rows, row indices, 0-d scalars.
_CONSTANTS: Dict[tuple, torch.Tensor] = {}


def _constant(key: tuple, device: torch.device, build: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A read-only constant tensor, built once per (key, device) instead of once per call.

    Not cached while a CUDA graph is being captured: a tensor made then holds its values only
    once the graph replays. A tensor cached before capture is a plain input of the graph.
    """
    got = _CONSTANTS.get((key, device))
    if got is None:
        got = build()
        if not _capturing(device):
            _CONSTANTS[(key, device)] = got
    return got


def _scalar(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A cached 0-d tensor: an op on a Python number wraps it in a new tensor on every call,
    which costs more on the CPU than the op itself at small B."""
    return _constant(("scalar", value, dtype), device,
                     lambda: torch.full((), value, dtype=dtype, device=device))


def _score_keys(selection: torch.Tensor, signed: bool) -> torch.Tensor:
    """[B, N] int64 keys whose descending order is score descending, then expert id ascending.

    key = ordered_bits(score) * 2^16 - id. Float32 bits order like sign-magnitude integers:
    non-negative scores and -inf (negative bits, below them all) need no mapping, and plain sigmoid
    scores are never negative (nor -0.0). Logits (softmax) and biased scores can be (signed=True):
    INT32_MIN - bits reverses the negative ones and maps -0.0 to 0, so that -0.0 and +0.0 tie, as
    in torch.sort.
    """
    num_experts, device = selection.shape[1], selection.device
    bits = selection.view(torch.int32)
    if signed:
        bits = torch.where(bits < 0, _INT32_MIN - bits, bits)
    minus_ids = _constant(("minus_ids", num_experts), device,
                          lambda: torch.arange(0, -num_experts, -1, device=device))
    # add() computes in int64 (the promoted dtype), so the shifted bits do not overflow.
    return torch.add(minus_ids, bits, alpha=1 << _ID_BITS)


def _real_rows(num_rows: int, num_valid_rows: RowCount, device: torch.device) -> Optional[torch.Tensor]:
    """[B, 1] bool, True for rows below num_valid_rows; None when every row is real."""
    if num_valid_rows is None:
        return None
    if not isinstance(num_valid_rows, torch.Tensor) and num_valid_rows >= num_rows:
        return None
    rows = _constant(("rows", num_rows), device, lambda: torch.arange(num_rows, device=device)[:, None])
    return rows < num_valid_rows


def _host_gate(num_rows: int, num_valid_rows: RowCount, k0: Setting, k: int, min_batch: Setting,
               max_batch: Setting) -> bool:
    """False when the gate is closed whatever the device values are: an int k0 outside [1, K)
    (0 = off, >= K = no-op), or the int bounds (reference.batch_gate) of a host row count."""
    if not isinstance(k0, torch.Tensor) and not 1 <= k0 < k:
        return False
    if isinstance(min_batch, torch.Tensor) or isinstance(max_batch, torch.Tensor):
        return True
    if isinstance(num_valid_rows, torch.Tensor):
        return not 0 < max_batch < min_batch
    return bool(batch_gate(num_rows if num_valid_rows is None else num_valid_rows, min_batch, max_batch))


def _device_gate(num_valid_rows: torch.Tensor, min_batch: int, max_batch: int) -> torch.Tensor:
    """reference.batch_gate for a device row count and int bounds (0-d or [1] bool), in at most two ops."""
    if max_batch == 0:
        return num_valid_rows >= min_batch
    return num_valid_rows.clamp(min_batch, max_batch) == num_valid_rows


def _settings_gate(rows: Setting, k0: Setting, k: int, min_batch: Setting,
                   max_batch: Setting) -> Optional[torch.Tensor]:
    """The part of the gate that only the device can decide (0-d or [1] bool), or None when the host
    gate decided it all: the batch gate where the row count or a bound is a device tensor, and
    1 <= k0 < K for a device k0."""
    gate = None
    if isinstance(min_batch, torch.Tensor) or isinstance(max_batch, torch.Tensor):
        gate = (rows >= min_batch) & ((max_batch == 0) | (rows <= max_batch))
    elif isinstance(rows, torch.Tensor):
        gate = _device_gate(rows, min_batch, max_batch)
    if isinstance(k0, torch.Tensor):
        in_range = (k0 >= 1) & (k0 < k)
        gate = in_range if gate is None else gate & in_range
    return gate


def control_values(control: torch.Tensor, rows_per_request: int = 1) -> Tuple[torch.Tensor, ...]:
    """(k0, min_rows, max_rows), 0-d device tensors, from the control block [k0, min_batch,
    max_batch] (int32 [3]): the gate compares token rows, so min_rows = min_batch x rows_per_request
    (1 in decode, the draft tokens per request in a verify pass)."""
    k0, min_batch, max_batch = control[0], control[1], control[2]
    return k0, (min_batch if rows_per_request == 1 else min_batch * rows_per_request), max_batch


def control_gate(rows: Setting, control: torch.Tensor, k: int, rows_per_request: int = 1) -> torch.Tensor:
    """0-d bool on the device: whether OEA applies to `rows` real token rows under the control
    block (1 <= k0 < K and the batch gate), as route_from_logits and the fused kernel decide it."""
    k0, min_rows, max_rows = control_values(control, rows_per_request)
    return _settings_gate(rows, k0, k, min_rows, max_rows)


def _own_groups(topk_ids: torch.Tensor, num_experts: int, num_groups: int,
                real: Optional[torch.Tensor]) -> torch.Tensor:
    """[B, N] bool: the experts of the groups that a real row's routed ids lie in (as
    mask_foreign_groups). Padded rows get none: the scatter writes each row's real flag instead
    of True, which spares a [B, N] op."""
    (num_rows, _), device = topk_ids.shape, topk_ids.device
    group_size = num_experts // num_groups
    mark = True if real is None else real.expand_as(topk_ids)
    # scatter (not scatter_) copies the cached all-False table: one op instead of zeros + scatter.
    untouched = _constant(("no_groups", num_rows, num_groups), device,
                          lambda: torch.zeros(num_rows, num_groups, dtype=torch.bool, device=device))
    touched = untouched.scatter(1, topk_ids // group_size, mark)  # [B, G]
    return touched.repeat_interleave(group_size, dim=1)


def _lift_bases(keys: torch.Tensor, topk_ids: torch.Tensor, k0: Setting,
                real: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Add _BASE_TIER to the keys of each real row's base; return them with U.

    base = the K0 best routed ids by key: the routed experts lie in the row's own groups, so
    their keys are unmasked and this is the reference's ranking. gather and scatter take the
    router's int32 ids as they are (torch >= 2.8). A device k0 (0-d tensor) ranks all K routed
    ids and lifts those of rank < k0: the same keys, with shapes that do not depend on k0.

    Args:
        keys: [B, N] int64 from _score_keys, modified in place.
        topk_ids: [B, K] routed ids.
    Returns:
        keys [B, N] int64 and in_union [N] bool.
    """
    if isinstance(k0, torch.Tensor):
        return _lift_ranked(keys, topk_ids, k0, real)
    best = keys.gather(1, topk_ids).topk(k0, dim=1)  # [B, K0] columns of topk_ids
    base = topk_ids.gather(1, best.indices)
    if real is None:
        # A row's base ids are distinct, so even with atomics on CUDA each key gets one add.
        keys.scatter_(1, base, _BASE_TIER, reduce="add")
    else:
        # A padded row writes its own keys back: it holds no base and adds nothing to U.
        keys.scatter_(1, base, torch.add(best.values, real, alpha=_BASE_TIER))
    # Lifted keys exceed 2^48, all others stay below 2^47.
    return keys, keys.amax(dim=0) > _scalar(_BASE_TIER // 2, torch.int64, keys.device)


def _lift_ranked(keys: torch.Tensor, topk_ids: torch.Tensor, k0: torch.Tensor,
                 real: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """_lift_bases for a device k0: every routed id ranked by key, the first k0 lifted (a padded
    row writes its own keys back unlifted)."""
    k, device = topk_ids.shape[1], keys.device
    ranked = keys.gather(1, topk_ids).topk(k, dim=1)  # [B, K] columns of topk_ids, best first
    ranks = _constant(("ranks", k), device, lambda: torch.arange(k, device=device))
    lift = ranks < k0  # [K] bool
    if real is not None:
        lift = lift & real  # [B, K]
    keys.scatter_(1, topk_ids.gather(1, ranked.indices), torch.add(ranked.values, lift, alpha=_BASE_TIER))
    return keys, keys.amax(dim=0) > _scalar(_BASE_TIER // 2, torch.int64, device)


def _slot_order(keys: torch.Tensor, in_union: torch.Tensor, k: int):
    """torch.topk over the final keys: (values, ids), both [B, K] int64.

    Descending key order is the reference's slot order: the base ranked (_BASE_TIER), then the
    experts of U by score (masked ones, at -inf, fall to the end of U in id order: fills), then
    the experts outside U by id (fills).
    """
    num_experts, device = keys.shape[1], keys.device
    outside = _constant(("outside", num_experts), device,
                        lambda: torch.arange(_OUTSIDE_U, _OUTSIDE_U - num_experts, -1, device=device))
    return torch.where(in_union, keys, outside).topk(k, dim=1)


def _renormalised(picked: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """reference.opportunistic_weights from picked = weight score * active, [B, K] float32.

    Zeroing the numerator instead of the product gives the same bits: picked is +0 wherever the
    active total is 0.
    """
    total = picked.sum(dim=1, keepdim=True)
    row_sums = _float32(topk_weights).sum(dim=1, keepdim=True)
    zero = _scalar(0.0, torch.float32, picked.device)
    scale = torch.where(total > zero, row_sums, zero) / total.clamp_min(_TINY)
    weights = picked * scale
    return weights if weights.dtype == topk_weights.dtype else weights.to(topk_weights.dtype)


def _candidate_scores(router_logits: torch.Tensor, topk_ids: torch.Tensor, spec: RouterSpec,
                      real: Optional[torch.Tensor], masked: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(selection, weight) [B, N] float32, the selection masked where a row may not piggyback.

    masked (grouped or biased routing, or softmax with padded rows): foreign groups and padded
    rows score -inf; activity is then read from the keys (see _picked). Otherwise a score is -inf
    only where its weight is 0 (a softmax -inf logit), and the padded rows of a plain sigmoid
    router score every expert 0: they rank U by id, then the rest by id, at weight 0: the
    reference's fills (softmax gets here only when every row is real).
    """
    selection, weight = score_experts(router_logits, spec)
    if not masked:
        if real is not None:
            selection = weight = weight * real  # plain sigmoid: selection is weight
        return selection, weight
    if spec.restrict_groups and spec.num_groups > 1:
        allowed = _own_groups(topk_ids, router_logits.shape[1], spec.num_groups, real)
    elif real is not None:
        allowed = real
    else:
        return selection, weight
    return torch.where(allowed, selection, _scalar(float("-inf"), torch.float32, selection.device)), weight


def _picked(weight: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, in_union: torch.Tensor,
            masked: bool, signed: bool) -> torch.Tensor:
    """[B, K] float32: the weight score of each slot's expert, 0 on inactive slots.

    Unmasked, every expert of U that a real row takes is active and padded rows weigh 0, except
    an expert of U whose logit is -inf (softmax), a fill whose weight is +0 all the same:
    multiplying by U (weights are finite and >= 0) costs less than torch.where. Masked, the
    active slots are the base and the finite-scored experts of U, whose keys lie above the -inf
    keys of U.
    """
    if not masked:
        return (weight * in_union).gather(1, ids)
    lowest = (_NEG_INF_SIGNED if signed else _NEG_INF_BITS) << _ID_BITS  # the -inf key of id 0
    return weight.gather(1, ids) * (values > _scalar(lowest, torch.int64, values.device))


def route_from_logits(
    router_logits: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    spec: RouterSpec,
    k0: Setting,
    num_valid_rows: RowCount = None,
    min_batch: Setting = 1,
    max_batch: Setting = 0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gated OEA over routed columns, starting from the router's logits.

    Fixed shapes and no host sync: it runs inside CUDA graphs with a device row count and device
    settings. Scores must not be NaN (the reference's order is not defined for them either).

    Args:
        router_logits: [B, N] raw logits, N <= 2^16 (an id takes the low 16 bits of a key).
        topk_ids: [B, K] int32/int64 routed ids (no shared-expert columns), any order.
        topk_weights: [B, K] the router's weights for them.
        spec: the router's scoring.
        k0, num_valid_rows, min_batch, max_batch: see reference.opportunistic_route; k0 = 0 is
            OEA off. k0, min_batch and max_batch may each be an int or a 0-d integer device tensor
            (see the module docstring: `control_values` reads them from the control block).
    Returns:
        ids [B, K] int64 and weights [B, K] in topk_weights.dtype: bit for bit those of
        reference.opportunistic_route on the scores of score_experts (and mask_foreign_groups);
        the router's own when k0 is outside [1, K) or the gate is closed.
    """
    num_rows, k = topk_ids.shape
    assert router_logits.shape[1] <= 1 << _ID_BITS, f"{router_logits.shape=}"
    if num_rows == 0 or not _host_gate(num_rows, num_valid_rows, k0, k, min_batch, max_batch):
        return topk_ids.long(), topk_weights
    real = _real_rows(num_rows, num_valid_rows, router_logits.device)
    softmax = spec.scoring_func == "softmax"
    biased = not softmax and spec.correction_bias is not None
    # Logits and biased scores may be negative or -0.0.
    signed = softmax or biased
    # Scores that are -inf where the weight is not 0: masked groups, a -inf bias, and the padded
    # rows of a softmax router (its selection is not its weight, so they cannot just weigh 0).
    masked = biased or (spec.restrict_groups and spec.num_groups > 1) or (softmax and real is not None)
    selection, weight = _candidate_scores(router_logits, topk_ids, spec, real, masked)

    keys, in_union = _lift_bases(_score_keys(selection, signed), topk_ids, k0, real)
    values, ids = _slot_order(keys, in_union, k)
    weights = _renormalised(_picked(weight, values, ids, in_union, masked, signed), topk_weights)
    gate = _settings_gate(num_rows if num_valid_rows is None else num_valid_rows, k0, k, min_batch, max_batch)
    if gate is None:
        return ids, weights
    return torch.where(gate, ids, topk_ids), torch.where(gate, weights, topk_weights)
