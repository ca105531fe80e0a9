"""Router inputs the way SGLang hands them to the routing hook, shared by the runtime tests."""

import types

import torch

NUM_EXPERTS, TOP_K = 64, 8


def topk_config(shared: int = 0, top_k: int = TOP_K) -> types.SimpleNamespace:
    """The TopKConfig attributes OEARuntime reads: a softmax router (Qwen3-MoE) with `shared` fused
    shared-expert columns."""
    return types.SimpleNamespace(
        top_k=top_k + shared, num_shared_topk_slots=shared, allow_routed_experts_capture=True,
        scoring_func="softmax", correction_bias=None, num_expert_group=None, topk_group=None, use_grouped_topk=False,
        custom_routing_function=None, renormalize=True,
    )


def router_inputs(rows: int, seed: int, shared: int = 0, shared_weight: float = 0.25):
    """logits [rows, N] float32, the router's top-K ids [rows, K + shared] int32 (columns unsorted,
    shared-expert ids N.. last) and weights [rows, K + shared] float32."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, NUM_EXPERTS, generator=gen)
    weights, ids = torch.topk(logits.softmax(1), TOP_K, sorted=False)
    ids = ids.int()
    if shared:
        ids = torch.cat([ids, torch.full((rows, shared), NUM_EXPERTS, dtype=ids.dtype)], 1)
        weights = torch.cat([weights, torch.full((rows, shared), shared_weight)], 1)
    return logits, ids, weights
