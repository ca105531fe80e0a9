"""Checks of one `oea_route` call's arguments (sglang_oea.kernels.oea_route): shapes, dtypes and
devices only, so that no check syncs with the device. No SGLang import.
"""

from typing import Optional

import torch

from sglang_oea.config import MAX_K0

# An expert id lives in the low 16 bits of a pick key (oea_route._pick_keys).
MAX_EXPERTS = 1 << 15
MAX_TOP_K = MAX_K0  # --oea-k0 is bounded by the same number


def check_arguments(router_logits, topk_ids, topk_weights, num_routed, scoring_func, correction_bias,
                    num_groups, restrict_groups, stats, checksum=None, lost=None) -> None:
    """Assert that one `oea_route` call is well formed (shapes, dtypes, devices: no device sync)."""
    assert router_logits.dim() == 2 and topk_ids.dim() == 2, f"{router_logits.shape=} {topk_ids.shape=}"
    assert topk_weights.shape == topk_ids.shape, f"{topk_weights.shape=} {topk_ids.shape=}"
    num_rows, num_experts = router_logits.shape
    top_k = topk_ids.shape[1] if num_routed is None else num_routed
    assert topk_ids.shape[0] == num_rows, f"{router_logits.shape=} {topk_ids.shape=}"
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
    if lost is not None:
        assert lost.dtype == torch.int64 and lost.numel() == MAX_K0 and lost.is_contiguous(), (
            f"lost must be a contiguous int64 tensor of {MAX_K0} elements (one per k0): {lost.dtype=} {lost.shape=}"
        )
        assert lost.device == router_logits.device, f"{lost.device=} {router_logits.device=}"
    if scoring_func == "sigmoid" and correction_bias is not None:
        assert correction_bias.shape == (num_experts,) and correction_bias.is_contiguous(), f"{correction_bias.shape=}"
        assert correction_bias.device == router_logits.device, f"{correction_bias.device=}"


def check_settings(k0: Optional[int], control: Optional[torch.Tensor], rows_per_request: int, device) -> None:
    """Assert that a call gives its settings one way: an int k0 >= 1, or a device control block."""
    assert (k0 is None) != (control is None), f"give k0 or control, not both or neither: {k0=}"
    if control is None:
        assert k0 >= 1 and rows_per_request == 1, f"{k0=} {rows_per_request=}"
        return
    assert control.dtype == torch.int32 and control.shape == (3,) and control.is_contiguous(), (
        f"control must be a contiguous int32 tensor of 3 elements (k0, min_batch, max_batch): "
        f"{control.dtype=} {control.shape=}"
    )
    assert control.device == device, f"{control.device=} {device=}"
    assert rows_per_request >= 1, f"{rows_per_request=}"
