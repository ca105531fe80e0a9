"""The CUDA-graph routing path, run on the CPU: the batch gate and the real-row count come from a
persistent device scalar, so one captured computation must serve every real batch size of its
bucket. Capture itself needs a GPU (benchmark/oea/gpu_check.py); here the same code runs with
`is_capturing` forced on and the scalar changed between calls, as a replay would."""

import types

import pytest
import torch

from sglang_oea import runtime as runtime_module
from sglang_oea.config import OEAConfig
from sglang_oea.reference import distinct_experts
from sglang_oea.routing import RouterSpec, route_from_logits
from sglang_oea.runtime import OEARuntime

BUCKET, NUM_EXPERTS, TOP_K = 16, 64, 8


def topk_config(shared=0):
    return types.SimpleNamespace(
        top_k=TOP_K + shared, num_shared_topk_slots=shared, allow_routed_experts_capture=True,
        scoring_func="softmax", correction_bias=None, num_expert_group=None, topk_group=None, use_grouped_topk=False,
        custom_routing_function=None,
    )


@pytest.fixture
def captured(monkeypatch):
    monkeypatch.setattr(runtime_module, "is_capturing", lambda tensor: True)
    rt = OEARuntime(OEAConfig(k0=3, min_batch=4, max_batch=12))
    rt.begin_step(decode=True, num_rows=BUCKET, count=False)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(BUCKET, NUM_EXPERTS, generator=gen)
    probs = logits.softmax(1)
    weights, ids = torch.topk(probs, TOP_K, sorted=False)
    return rt, logits, ids.int(), weights


@pytest.mark.parametrize("real_rows", [12, 9, 4])
def test_replay_equals_reference_for_each_real_row_count(captured, real_rows):
    rt, logits, ids, weights = captured
    rt.graph_rows.fill_(real_rows)
    got_ids, got_weights = rt.route(ids, weights, topk_config(), logits, 0)
    want_ids, want_weights = route_from_logits(logits, ids, weights, RouterSpec("softmax"), 3, real_rows)
    assert torch.equal(got_ids.long(), want_ids)
    torch.testing.assert_close(got_weights, want_weights)
    union = set(got_ids[:real_rows][got_weights[:real_rows] > 0].tolist())
    assert set(got_ids[real_rows:].flatten().tolist()) <= union, "padded rows stay inside the union"
    assert bool((got_weights[real_rows:] == 0).all())


@pytest.mark.parametrize("real_rows", [3, 1, 13, 16])
def test_closed_gate_is_bit_identical_to_the_router(captured, real_rows):
    rt, logits, ids, weights = captured
    rt.graph_rows.fill_(real_rows)
    got_ids, got_weights = rt.route(ids, weights, topk_config(), logits, 0)
    assert torch.equal(got_ids, ids) and torch.equal(got_weights, weights)


def test_stats_count_only_replays_with_an_open_gate(captured):
    rt, logits, ids, weights = captured
    for rows in (9, 2, 14, 9):
        rt.graph_rows.fill_(rows)
        rt.route(ids, weights, topk_config(), logits, 5)
    layers = rt.stats.drain()
    assert layers[:, 3].tolist() == [5]
    steps, before, after = layers[0, :3].tolist()
    assert steps == 2 and before == 2 * distinct_experts(ids, NUM_EXPERTS, 9).item()
    assert after < before


def test_bucket_below_min_batch_is_not_routed(monkeypatch):
    monkeypatch.setattr(runtime_module, "is_capturing", lambda tensor: True)
    rt = OEARuntime(OEAConfig(k0=3, min_batch=4))
    rt.begin_step(decode=True, num_rows=2, count=False)
    logits = torch.randn(2, NUM_EXPERTS)
    weights, ids = torch.topk(logits.softmax(1), TOP_K)
    assert rt.route(ids.int(), weights, topk_config(), logits, 0) is None


def test_shared_columns_pass_through_under_capture(captured):
    rt, logits, ids, weights = captured
    rt.graph_rows.fill_(10)
    shared_ids = torch.full((BUCKET, 1), NUM_EXPERTS, dtype=ids.dtype)
    shared_w = torch.full((BUCKET, 1), 0.25)
    got_ids, got_weights = rt.route(torch.cat([ids, shared_ids], 1), torch.cat([weights, shared_w], 1), topk_config(1), logits, 0)
    assert torch.equal(got_ids[:, TOP_K:], shared_ids) and torch.equal(got_weights[:, TOP_K:], shared_w)


def test_graph_path_through_the_fused_kernel_in_the_interpreter():
    """The same tests with the Triton kernel (interpreted) behind FusedRouter, in a child process:
    Triton reads TRITON_INTERPRET once, at import."""
    import os
    import subprocess
    import sys

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("already running in the interpreter")
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "not through_the_fused_kernel"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "12 passed" in proc.stdout


def test_kernel_is_used_under_the_interpreter():
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs in the interpreter child only")
    calls = []
    from sglang_oea import kernels

    original = kernels.oea_route
    rt = OEARuntime(OEAConfig(k0=3, min_batch=2))
    rt.begin_step(decode=True, num_rows=6)
    logits = torch.randn(6, NUM_EXPERTS)
    weights, ids = torch.topk(logits.softmax(1), TOP_K)
    try:
        kernels.oea_route = lambda *a, **kw: calls.append(1) or original(*a, **kw)
        got_ids, _ = rt.route(ids.int(), weights, topk_config(), logits, 0)
    finally:
        kernels.oea_route = original
    assert calls and got_ids.shape == (6, TOP_K)


def test_custom_routing_function_is_left_alone(captured, caplog):
    rt, logits, ids, weights = captured
    rt.graph_rows.fill_(10)
    config = topk_config()
    config.custom_routing_function = lambda **kw: None
    assert rt.route(ids, weights, config, logits, 0) is None
    assert rt.route(ids, weights, config, logits, 1) is None
    assert caplog.text.count("is not supported") == 1
