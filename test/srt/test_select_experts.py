"""OEA inside SGLang's own select_experts (CPU), with the plugin's hooks applied.

The router runs for real (softmax top-k, biased grouped sigmoid top-k with fused shared experts);
the expected result is computed independently here from the logits with the brute force.
"""

import json
import os

import pytest
import torch

from oea_brute_force import brute_force_oea, brute_force_weights
from sglang_oea import hooks
from sglang_oea.config import OEAConfig
from sglang_oea.runtime import OEARuntime

NUM_ROWS, NUM_EXPERTS, TOP_K, K0 = 11, 64, 8, 3


@pytest.fixture(scope="module")
def topk_module():
    cfg = OEAConfig(k0=K0, min_batch=2)
    os.environ[hooks.CONFIG_ENV] = json.dumps(cfg.as_dict())
    hooks.install_routing()
    from sglang.srt.layers.moe import topk

    assert hasattr(topk._post_process_topk_ids, "__wrapped__")
    hooks._runtime = OEARuntime(cfg)
    yield topk
    hooks._runtime = None


def run_router(topk_module, logits, config, decode, rows=NUM_ROWS):
    hooks._runtime.begin_step(decode=decode, num_rows=rows)
    out = topk_module.select_experts(torch.zeros(logits.shape[0], 16), logits, config, layer_id=0)
    return out.topk_ids, out.topk_weights


def expected_routing(selection, probs, router_ids, router_weights, routed, rows=NUM_ROWS):
    ids, active = brute_force_oea(selection.tolist(), router_ids[:, :routed].tolist(), K0, rows)
    row_sums = router_weights[:, :routed].sum(1).tolist()
    weights = brute_force_weights(probs.tolist(), ids, active, row_sums)
    return torch.tensor(ids), torch.tensor(weights)


def softmax_config(topk_module, renormalize):
    return topk_module.TopKConfig(top_k=TOP_K, renormalize=renormalize, torch_native=True)


def grouped_config(topk_module, topk_group, shared, renormalize=True):
    from sglang.srt.configs.shared_experts import SharedExpertsConfig

    bias = torch.linspace(-0.05, 0.05, NUM_EXPERTS)
    # As sglang/srt/models/glm4_moe.py builds it: scoring_func is left at its default ('softmax');
    # SGLang's biased grouped router scores with sigmoid regardless.
    return topk_module.TopKConfig(
        top_k=TOP_K + shared, use_grouped_topk=True, num_expert_group=8, topk_group=topk_group,
        renormalize=renormalize, correction_bias=bias, routed_scaling_factor=2.5,
        shared_experts=SharedExpertsConfig(num_fused_shared_experts=shared),
    )


def group_masked(selection, router_ids, num_groups):
    size = selection.shape[1] // num_groups
    allowed = torch.zeros_like(selection, dtype=torch.bool)
    for r, row in enumerate(router_ids.tolist()):
        for g in {e // size for e in row}:
            allowed[r, g * size:(g + 1) * size] = True
    return selection.masked_fill(~allowed, float("-inf"))


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_routing(topk_module, renormalize):
    logits = torch.randn(NUM_ROWS, NUM_EXPERTS, generator=torch.Generator().manual_seed(0))
    config = softmax_config(topk_module, renormalize)
    router_ids, router_weights = run_router(topk_module, logits, config, decode=False)
    ids, weights = run_router(topk_module, logits, config, decode=True)
    probs = logits.softmax(1)
    want_ids, want_weights = expected_routing(probs, probs, router_ids, router_weights, TOP_K)
    assert ids.tolist() == want_ids.tolist()
    torch.testing.assert_close(weights.float(), want_weights, rtol=1e-5, atol=1e-6)
    assert ids.dtype == router_ids.dtype and weights.dtype == router_weights.dtype
    assert len(set(ids.flatten().tolist())) < len(set(router_ids.flatten().tolist()))


@pytest.mark.parametrize("topk_group,shared", [(4, 0), (8, 0), (4, 1), (2, 1)])
def test_biased_grouped_sigmoid_routing(topk_module, topk_group, shared):
    logits = torch.randn(NUM_ROWS, NUM_EXPERTS, generator=torch.Generator().manual_seed(topk_group + shared))
    config = grouped_config(topk_module, topk_group, shared)
    router_ids, router_weights = run_router(topk_module, logits, config, decode=False)
    ids, weights = run_router(topk_module, logits, config, decode=True)
    probs = logits.sigmoid()
    selection = probs + config.correction_bias
    if topk_group < 8:
        selection = group_masked(selection, router_ids[:, :TOP_K], 8)
    want_ids, want_weights = expected_routing(selection, probs, router_ids, router_weights, TOP_K)
    assert ids[:, :TOP_K].tolist() == want_ids.tolist()
    torch.testing.assert_close(weights[:, :TOP_K].float(), want_weights, rtol=1e-5, atol=1e-5)
    # Fused shared-expert columns pass through untouched; routed weights keep the router's sums
    # (routed_scaling_factor included).
    assert torch.equal(ids[:, TOP_K:], router_ids[:, TOP_K:])
    assert torch.equal(weights[:, TOP_K:], router_weights[:, TOP_K:])
    torch.testing.assert_close(weights[:, :TOP_K].sum(1), router_weights[:, :TOP_K].sum(1), rtol=1e-5, atol=1e-5)


def test_grouped_candidates_stay_in_the_rows_groups(topk_module):
    logits = torch.randn(NUM_ROWS, NUM_EXPERTS, generator=torch.Generator().manual_seed(9))
    config = grouped_config(topk_module, topk_group=2, shared=0)
    router_ids, _ = run_router(topk_module, logits, config, decode=False)
    ids, weights = run_router(topk_module, logits, config, decode=True)
    for r in range(NUM_ROWS):
        groups = {e // 8 for e in router_ids[r].tolist()}
        carried = [e for e, w in zip(ids[r].tolist(), weights[r].tolist()) if w > 0]
        assert {e // 8 for e in carried} <= groups


def test_router_untouched_outside_decode_and_below_min_batch(topk_module):
    logits = torch.randn(NUM_ROWS, NUM_EXPERTS, generator=torch.Generator().manual_seed(4))
    config = softmax_config(topk_module, True)
    hooks._runtime.step.mode = "other"
    plain = topk_module.select_experts(torch.zeros(NUM_ROWS, 16), logits, config, layer_id=0)
    gated_ids, gated_weights = run_router(topk_module, logits[:1], config, decode=True, rows=1)
    assert torch.equal(gated_ids, plain.topk_ids[:1]) and torch.equal(gated_weights, plain.topk_weights[:1])


def test_a_topk_that_hides_ids_is_counted_and_warned(topk_module, caplog):
    """A TopK forced to the BYPASSED output format (routing inside the MoE kernel) never hands the
    hook any ids: its decode steps are skipped as no_topk_ids, with one warning. A STANDARD one
    in the same runtime is applied."""
    from sglang.srt.runtime_context import get_context

    rt = hooks._runtime
    applied, hidden = rt.applied_steps, rt.skipped_steps["no_topk_ids"]
    logits = torch.randn(NUM_ROWS, NUM_EXPERTS, generator=torch.Generator().manual_seed(6))
    formats = topk_module.TopKOutputFormat
    with get_context().override_server_args(device="cpu"):
        bypassed = topk_module.TopK(TOP_K, layer_id=5, output_format=formats.BYPASSED)
        standard = topk_module.TopK(TOP_K, layer_id=6, output_format=formats.STANDARD)
        outputs = []
        for forward in (bypassed.forward_cuda, bypassed.forward_cuda, standard.forward_native):
            rt.begin_step(decode=True, num_rows=NUM_ROWS)
            outputs.append(forward(torch.zeros(NUM_ROWS, 16), logits))
            rt.end_step()
    assert [out.format for out in outputs] == [formats.BYPASSED, formats.BYPASSED, formats.STANDARD]
    assert rt.skipped_steps["no_topk_ids"] == hidden + 2 and rt.applied_steps == applied + 1
    assert caplog.text.count("without the routing hook seeing any top-k ids") == 1


@pytest.mark.parametrize("requests", [3, 1])
def test_verify_pass_routes_every_draft_token(topk_module, requests):
    """A target-verify pass through SGLang's select_experts: every draft token is a row of the
    union (requests x 4 drafts, all real); the gate counts requests (min_batch 2), not rows."""
    from sglang_oea.runtime import VERIFY

    rows = requests * 4
    logits = torch.randn(rows, NUM_EXPERTS, generator=torch.Generator().manual_seed(11))
    config = softmax_config(topk_module, True)
    router_ids, router_weights = run_router(topk_module, logits, config, decode=False, rows=rows)
    hooks._runtime.begin_step(VERIFY, rows, requests=requests)
    out = topk_module.select_experts(torch.zeros(rows, 16), logits, config, layer_id=0)
    if requests < 2:
        assert torch.equal(out.topk_ids, router_ids) and torch.equal(out.topk_weights, router_weights)
        return
    probs = logits.softmax(1)
    want_ids, want_weights = expected_routing(probs, probs, router_ids, router_weights, TOP_K, rows)
    assert out.topk_ids.tolist() == want_ids.tolist()
    torch.testing.assert_close(out.topk_weights.float(), want_weights, rtol=1e-5, atol=1e-6)
