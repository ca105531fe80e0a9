"""From router logits to OEA routing: scores, group restriction, gating. Pure torch, no SGLang.

Shape legend: B = rows, N = routed experts, K = routed experts per row, G = expert groups.

Selection score (what ranks experts) and weight score (what weights them) follow the router:
    softmax routing: selection = weight = softmax(logits)
    sigmoid routing: weight = sigmoid(logits); selection = weight + correction_bias (if any)
With grouped routing (topk_group < G), a row may only piggyback experts of the groups its own
routed top-K lies in, a subset of the groups the router selected for it.

`route_from_logits` is the CPU path and the oracle for the fused kernel in sglang_oea.kernels.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from sglang_oea.reference import RowCount, opportunistic_route


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


def score_experts(router_logits: torch.Tensor, spec: RouterSpec) -> Tuple[torch.Tensor, torch.Tensor]:
    """Selection and weight scores from raw router logits.

    Args:
        router_logits: [B, N] logits, any float dtype.
    Returns:
        selection: [B, N] float32; weight: [B, N] float32.
    """
    logits = router_logits.float()
    if spec.scoring_func == "softmax":
        weight = softmax_rows(logits)
        return weight, weight
    if spec.scoring_func != "sigmoid":
        raise ValueError(f"OEA supports scoring_func 'softmax' or 'sigmoid', got {spec.scoring_func!r}")
    weight = torch.sigmoid(logits)
    if spec.correction_bias is None:
        return weight, weight
    return weight + spec.correction_bias.float(), weight


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


def route_from_logits(
    router_logits: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    spec: RouterSpec,
    k0: int,
    num_valid_rows: RowCount = None,
    min_batch: int = 1,
    max_batch: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gated OEA over routed columns, starting from the router's logits.

    Args:
        router_logits: [B, N] raw logits.
        topk_ids: [B, K] routed ids (no shared-expert columns), any order.
        topk_weights: [B, K] the router's weights for them.
        spec: the router's scoring.
        k0, num_valid_rows, min_batch, max_batch: see reference.opportunistic_route.
    Returns:
        ids [B, K] int64 and weights [B, K] in topk_weights.dtype.
    """
    selection, weight = score_experts(router_logits, spec)
    if spec.restrict_groups:
        selection = mask_foreign_groups(selection, topk_ids, spec.num_groups)
    return opportunistic_route(
        selection, weight, topk_ids, topk_weights, k0, num_valid_rows, min_batch, max_batch
    )
