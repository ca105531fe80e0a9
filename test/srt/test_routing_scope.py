"""How OEA's routing hook runs inside SGLang's select_experts (CPU): eagerly on every call when the
caller is compiled by torch.compile (--enable-torch-compile), and with SGLang's symmetric-memory
context (--enable-symm-mem) suspended while it routes."""

import json
import os

import pytest
import torch

from sglang_oea import hooks
from sglang_oea.config import OEAConfig
from sglang_oea.runtime import DECODE, OTHER, OEARuntime

NUM_ROWS, NUM_EXPERTS, TOP_K = 11, 64, 8


@pytest.fixture(scope="module")
def topk_module():
    cfg = OEAConfig(k0=3, min_batch=2)
    previous = os.environ.get(hooks.CONFIG_ENV)
    os.environ[hooks.CONFIG_ENV] = json.dumps(cfg.as_dict())
    hooks.install_routing()
    from sglang.srt.layers.moe import topk

    hooks._runtime = OEARuntime(cfg)
    yield topk
    hooks._runtime = None
    if previous is None:
        os.environ.pop(hooks.CONFIG_ENV, None)
    else:
        os.environ[hooks.CONFIG_ENV] = previous


@pytest.fixture
def route_calls(topk_module, monkeypatch):
    """Records, for every call of the runtime's routing, whether torch.compile was tracing it."""
    calls = []
    route = hooks._runtime.route

    def recorded(*args):
        calls.append(torch.compiler.is_compiling())
        return route(*args)

    monkeypatch.setattr(hooks._runtime, "route", recorded)
    return calls


def logits_of(seed):
    return torch.randn(NUM_ROWS, NUM_EXPERTS, generator=torch.Generator().manual_seed(seed))


def make_router(topk_module):
    """One MoE layer's routing as SGLang runs it: select_experts with a softmax top-8 router."""
    config = topk_module.TopKConfig(top_k=TOP_K, renormalize=True, torch_native=True)
    hidden = torch.zeros(NUM_ROWS, 16)

    def route_layer(logits):
        out = topk_module.select_experts(hidden, logits, config, layer_id=0)
        return out.topk_ids, out.topk_weights

    return route_layer


def test_compiled_caller_runs_the_hook_eagerly_on_every_call(topk_module, route_calls):
    route_layer = make_router(topk_module)
    torch._dynamo.reset()
    compiled = torch.compile(route_layer, backend="eager")
    steps = [(0, DECODE), (1, DECODE), (2, OTHER), (3, DECODE)]
    for seed, mode in steps:
        logits = logits_of(seed)
        hooks._runtime.begin_step(OTHER, NUM_ROWS)
        router_ids, _ = route_layer(logits)
        hooks._runtime.begin_step(mode, NUM_ROWS)
        got_ids, got_weights = compiled(logits)
        want_ids, want_weights = route_layer(logits)
        assert torch.equal(got_ids, want_ids) and torch.equal(got_weights, want_weights)
        assert torch.equal(got_ids, router_ids) == (mode == OTHER), "decode steps are rewritten by OEA"
    decode_steps = sum(mode == DECODE for _, mode in steps)
    assert route_calls == [False] * (2 * decode_steps), "routing ran eagerly in every compiled and plain call"
    reasons = [reason.reason for reason in torch._dynamo.explain(route_layer)(logits_of(0)).break_reasons]
    assert any("topk_post_hook" in r and "torch.compiler.disable" in r for r in reasons), reasons


class FakeSymmetricContext:
    """Stands in for SGLang's SymmetricMemoryContext (a CUDA-only object): like it, __exit__ clears
    the allocator's active context and __enter__ sets it again."""

    def __init__(self, allocator):
        self.allocator = allocator
        self.events = []

    def __enter__(self):
        self.events.append("enter")
        self.allocator._active_symmetric_memory_context = self
        return self

    def __exit__(self, *exc):
        self.events.append("exit")
        self.allocator._active_symmetric_memory_context = None


@pytest.fixture
def symmetric_context(topk_module, monkeypatch):
    from sglang.srt.distributed.device_communicators import pynccl_allocator

    context = FakeSymmetricContext(pynccl_allocator)
    monkeypatch.setattr(pynccl_allocator, "_active_symmetric_memory_context", context)
    return pynccl_allocator, context


def test_routing_runs_with_symmetric_memory_suspended(topk_module, symmetric_context, monkeypatch):
    allocator, context = symmetric_context
    seen = []
    route = hooks._runtime.route
    monkeypatch.setattr(hooks._runtime, "route",
                        lambda *args: seen.append(allocator._active_symmetric_memory_context) or route(*args))
    route_layer = make_router(topk_module)
    hooks._runtime.begin_step(OTHER, NUM_ROWS)
    router_ids, _ = route_layer(logits_of(5))
    assert context.events == [] and seen == [], "a closed gate leaves the context alone"
    hooks._runtime.begin_step(DECODE, NUM_ROWS)
    ids, _ = route_layer(logits_of(5))
    assert not torch.equal(ids, router_ids), "OEA rewrote the ids"
    assert seen == [None], "routing ran with no active symmetric-memory context"
    assert context.events == ["exit", "enter"]
    assert allocator._active_symmetric_memory_context is context, "restored afterwards"


def test_symmetric_memory_is_restored_when_routing_raises(topk_module, symmetric_context, monkeypatch):
    allocator, context = symmetric_context

    def fail(*args):
        raise RuntimeError("routing failed")

    monkeypatch.setattr(hooks._runtime, "route", fail)
    hooks._runtime.begin_step(DECODE, NUM_ROWS)
    with pytest.raises(RuntimeError, match="routing failed"):
        make_router(topk_module)(logits_of(6))
    assert context.events == ["exit", "enter"]
    assert allocator._active_symmetric_memory_context is context
