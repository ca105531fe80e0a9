"""--oea-kernel and the startup self-check, on the CPU.

The kernel is replaced here by stand-ins built on the torch path (one exact, some broken), so the
choice logic runs without a GPU; test_graph_path.py runs the real kernel through the same choice
in Triton's interpreter (and requires its self-check to pass).
"""

import logging
import types

import pytest
import torch

from oea_fixtures import NUM_EXPERTS, TOP_K, router_inputs, topk_config
from sglang_oea import routers
from sglang_oea.config import OEAConfig
from sglang_oea.routers import KernelSelfCheckError, TorchRouter
from sglang_oea.routing import RouterSpec, route_from_logits
from sglang_oea.runtime import DECODE, OEARuntime
from sglang_oea.self_check import RoutingShape, run_self_check, spec_key

def torch_kernel(logits, ids, weights, spec, k0, num_routed, rows, min_batch, max_batch, workspace, stats=None,
                 before_launch=None):
    """A stand-in for the fused kernel with its exact contract, computed by the torch path."""
    new_ids, new_weights, _ = TorchRouter()(0, logits, ids, weights, spec, k0, num_routed, rows, min_batch, max_batch)
    if stats is not None:
        from sglang_oea.reference import batch_gate, distinct_experts

        gate = batch_gate(rows, min_batch, max_batch)
        before = distinct_experts(ids[:, :num_routed], logits.shape[1], rows)
        after = distinct_experts(new_ids[:, :num_routed], logits.shape[1], rows)
        stats.add_(torch.stack([torch.ones_like(before), before, after]) * gate)
    return new_ids, new_weights


def swapped_columns(*args, **kwargs):
    ids, weights = torch_kernel(*args, **kwargs)
    return ids[:, [1, 0] + list(range(2, ids.shape[1]))], weights


def failing_compile(*args, **kwargs):
    raise RuntimeError("PTX compilation failed: out of resource (stand-in)")


@pytest.fixture
def kernel(monkeypatch):
    """Pretend the fused kernel can run here; `kernel.use(fn)` picks what it computes."""
    monkeypatch.setattr(routers.RouterChoice, "kernel_wanted", lambda self, logits: self.kernel != "torch")
    monkeypatch.setattr(routers.TritonRouter, "workspace", lambda self, *a: None)
    calls = []

    def use(fn):
        monkeypatch.setattr(routers, "launch_kernel", lambda *a, **kw: calls.append(1) or fn(*a, **kw))
    use(torch_kernel)
    return types.SimpleNamespace(use=use, calls=calls)


def routed_step(rt, rows=6, seed=0, shared=0):
    logits, ids, weights = router_inputs(rows, seed, shared)
    rt.begin_step(DECODE, rows)
    out = rt.route(ids, weights, topk_config(shared), logits, 0)
    rt.end_step()
    want = route_from_logits(logits, ids[:, :TOP_K], weights[:, :TOP_K], RouterSpec("softmax"), 3, rows)
    return out, want


def test_auto_routes_with_the_kernel_after_a_passing_self_check(kernel, caplog):
    rt = OEARuntime(OEAConfig(k0=3, min_batch=2))
    with caplog.at_level(logging.INFO, logger="sglang_oea"):
        (ids, weights), (want_ids, want_weights) = routed_step(rt, shared=1)
    assert rt.routers.status() == {("triton", "passed"): 1}
    assert "kernel self-check passed (N=64 K=8 +1 shared softmax" in caplog.text
    assert torch.equal(ids[:, :TOP_K].long(), want_ids)
    calls = len(kernel.calls)
    routed_step(rt, seed=1, shared=1)
    assert len(kernel.calls) == calls + 1, "one self-check per routing shape, then one launch per call"


@pytest.mark.parametrize("broken,message", [
    (swapped_columns, "ids differ in"),
    (failing_compile, "RuntimeError: PTX compilation failed: out of resource"),
])
def test_auto_falls_back_to_torch_when_the_self_check_fails(kernel, caplog, broken, message):
    kernel.use(broken)
    rt = OEARuntime(OEAConfig(k0=3, min_batch=2))
    (ids, weights), (want_ids, want_weights) = routed_step(rt)
    assert rt.routers.status() == {("torch", "failed"): 1}
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "kernel self-check failed" in errors[0].getMessage() and message in errors[0].getMessage()
    assert "routing with the torch path" in errors[0].getMessage()
    assert torch.equal(ids.long(), want_ids) and torch.equal(weights, want_weights)


def test_triton_refuses_to_start_when_the_self_check_fails(kernel):
    kernel.use(swapped_columns)
    rt = OEARuntime(OEAConfig(k0=3, min_batch=2, kernel="triton"))
    with pytest.raises(KernelSelfCheckError, match="--oea-kernel triton, but the kernel self-check failed .*ids differ"):
        routed_step(rt)


def test_torch_never_touches_the_kernel(kernel):
    kernel.use(failing_compile)
    rt = OEARuntime(OEAConfig(k0=3, min_batch=2, kernel="torch"))
    (ids, _), (want_ids, _) = routed_step(rt)
    assert torch.equal(ids.long(), want_ids) and not kernel.calls
    assert rt.routers.status() == {("torch", "not_run"): 1}


def test_without_cuda_auto_uses_torch_and_triton_refuses():
    rt = OEARuntime(OEAConfig(k0=3, min_batch=2))
    assert rt.routers.status() == {("auto", "pending"): 0}
    routed_step(rt)
    assert rt.routers.status() == {("torch", "not_run"): 1}
    with pytest.raises(KernelSelfCheckError, match="cannot run on cpu"):
        routed_step(OEARuntime(OEAConfig(k0=3, min_batch=2, kernel="triton")))


def test_self_check_weight_tolerance():
    """Weights may differ by float rounding (rtol 1e-5 for float32 weights), not by more."""
    spec = RouterSpec("softmax")
    shape = RoutingShape(NUM_EXPERTS, TOP_K, TOP_K, spec_key(spec), torch.float32, torch.int32, torch.float32, False)

    def scaled(factor):
        def route(logits, ids, weights, rows, stats):
            new_ids, new_weights = torch_kernel(logits, ids, weights, spec, 3, TOP_K, rows, 1, 0, None, stats)
            return new_ids, new_weights * factor
        return route

    assert run_self_check(scaled(1 + 2e-7), shape, spec, 3, "cpu") is None
    error = run_self_check(scaled(1 + 1e-3), shape, spec, 3, "cpu")
    assert error is not None and "weights differ by up to" in error and "rtol=1e-05" in error
