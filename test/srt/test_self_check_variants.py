"""The startup self-check compiles and checks the kernel variants that serve, on the CPU.

Each of the fused kernel's counter arguments (stats=, lost=, checksum=) is a compile-time constant
(STATS, LOST, CHECKSUM): a variant the self-check did not launch is compiled at the first CUDA-graph
warm-up, outside the self-check's error handling. Here the real launcher plans every launch
(`kernels.oea_route` down to `KernelLaunch`), a stand-in `KernelLaunch.run` records the compiled
variant each launch needs (or fails to compile it), and the torch path computes what the kernel
would, so the runtime serves as on CUDA without a GPU. The real kernel runs the same self-check in
the interpreter child of test_kernel_choice.py and test_graph_path.py.
"""

import logging
import types

import pytest
import torch

from oea_fixtures import router_inputs, topk_config
from sglang_oea import kernels, routers
from sglang_oea import runtime as runtime_module
from sglang_oea.config import OEAConfig
from sglang_oea.kernels.launch import KernelLaunch
from sglang_oea.kernels.oea_route import oea_route as real_oea_route
from sglang_oea.reference import distinct_experts, ids_checksum, lost_router_mass_units
from sglang_oea.routers import RouterChoice, TorchRouter
from sglang_oea.routing import RouterSpec, control_gate
from sglang_oea.runtime import DECODE, VERIFY, OEARuntime

SELF_CHECK, SERVING = "self_check", "serving"
COMPILE_ERROR = "PTX compilation failed: out of resource (stand-in)"


def add_counters(logits, ids, weights, new_ids, new_weights, k, rows, control, per_request, stats, checksum, lost):
    """What the kernel adds to its counter arguments, computed with the reference."""
    gate = control_gate(rows, control, k, per_request)
    own, own_w, new, new_w = ids[:, :k], weights[:, :k], new_ids[:, :k], new_weights[:, :k]
    num_experts = logits.shape[1]
    if stats is not None:
        before, after = distinct_experts(own, num_experts, rows), distinct_experts(new, num_experts, rows)
        stats.add_(torch.stack([torch.ones_like(before), before, after]) * gate)
    if lost is not None:
        units = lost_router_mass_units(own, own_w, new, new_w, num_experts, rows)
        lost[int(control[0])] += (units * gate).sum()  # gate: [1] with a 1-element row count
    if checksum is not None:
        checksum.add_(ids_checksum(new, rows))


def torch_computed_route(logits, ids, weights, *, control, num_valid_rows, num_routed=None, scoring_func="softmax",
                         correction_bias=None, num_groups=1, restrict_groups=False, rows_per_request=1, stats=None,
                         checksum=None, lost=None, **kw):
    """kernels.oea_route with the real launcher's plan and argument checks (its launches go to the
    stand-in KernelLaunch.run), and the kernel's results computed by the torch path."""
    out_ids, out_weights = real_oea_route(
        logits, ids, weights, control=control, num_valid_rows=num_valid_rows, num_routed=num_routed,
        scoring_func=scoring_func, correction_bias=correction_bias, num_groups=num_groups,
        restrict_groups=restrict_groups, rows_per_request=rows_per_request, stats=stats, checksum=checksum,
        lost=lost, **kw)
    spec, k = RouterSpec(scoring_func, correction_bias, num_groups, restrict_groups), num_routed or ids.shape[1]
    new_ids, new_weights, _ = TorchRouter()(0, logits, ids, weights, spec, 0, k, num_valid_rows, 1, 0,
                                            control=control, rows_per_request=rows_per_request)
    add_counters(logits, ids, weights, new_ids, new_weights, k, num_valid_rows, control, rows_per_request, stats,
                 checksum, lost)
    out_ids.copy_(new_ids)
    out_weights.copy_(new_weights)
    return out_ids, out_weights


@pytest.fixture
def planned(monkeypatch):
    """The kernel path on the CPU: `planned.variants[SELF_CHECK | SERVING]` is the set of compiled
    variants (KernelLaunch.variant) launched inside the self-check and outside it; a launch for
    which `planned.fails(launch)` is true raises a compile error, as Triton does."""
    state = types.SimpleNamespace(phase=SERVING, variants={SELF_CHECK: set(), SERVING: set()}, fails=lambda l: False)
    monkeypatch.setattr(RouterChoice, "kernel_device", lambda self, logits: True)
    monkeypatch.setattr(RouterChoice, "kernel_available", lambda self, device: True)

    def run(launch):
        state.variants[state.phase].add(launch.variant())
        if state.fails(launch):
            raise RuntimeError(COMPILE_ERROR)
    monkeypatch.setattr(KernelLaunch, "run", run)
    monkeypatch.setattr(kernels, "oea_route", torch_computed_route)
    self_check = routers.run_self_check

    def recorded_self_check(*args, **kwargs):
        state.phase = SELF_CHECK
        try:
            return self_check(*args, **kwargs)
        finally:
            state.phase = SERVING
    monkeypatch.setattr(routers, "run_self_check", recorded_self_check)
    return state


def serve(monkeypatch, rt, mode=DECODE, per_request=1, requests=6):
    """An eager step, then a CUDA-graph bucket's two warm-ups and capture, over a plain layer and a
    layer with a fused shared-expert column (two routing shapes): {layer: OEA's output or None}."""
    capturing = [False]
    monkeypatch.setattr(runtime_module, "is_capturing", lambda tensor: capturing[0])
    rows = requests * per_request
    inputs = {0: (router_inputs(rows, 0), topk_config()), 1: (router_inputs(rows, 1, shared=1), topk_config(1))}

    def forward():
        return {layer: rt.route(ids, w, config, logits, layer) for layer, ((logits, ids, w), config) in inputs.items()}
    rt.begin_step(mode, rows, requests=requests)
    out = forward()
    rt.end_step()
    rt.begin_step(mode, rows, graph=True, requests=requests)
    forward(), forward()
    capturing[0] = True
    forward()
    capturing[0] = False
    rt.end_step()
    return out


def route_constants(variants):
    """The counter constants of the route kernel's variants: {(STATS, LOST, CHECKSUM)}."""
    return {tuple(dict(v[2])[name] for name in ("STATS", "LOST", "CHECKSUM")) for v in variants
            if v[0] == "_oea_route_kernel"}


@pytest.mark.parametrize("stats", [True, False], ids=["stats", "no-stats"])
@pytest.mark.parametrize("check_ranks", [0, 16], ids=["no-checksum", "checksum"])
@pytest.mark.parametrize("mode,per_request", [(DECODE, 1), (VERIFY, 4)])
def test_self_check_runs_exactly_the_variants_that_serve(monkeypatch, planned, stats, check_ranks, mode, per_request):
    """Serving passes lost= whenever the counts are on (the default) and checksum= under
    --oea-check-ranks with more than one rank: the self-check must have compiled and checked those
    very binaries (constexprs and specialisation), for every routing shape, in eager steps, graph
    warm-ups, captures and verify passes alike."""
    cfg = OEAConfig(k0=3, min_batch=2, stats=stats, check_ranks=check_ranks)
    rt = OEARuntime(cfg, speculative=mode == VERIFY, world_size=2, agree=lambda passed: passed)
    out = serve(monkeypatch, rt, mode, per_request)
    assert all(routed is not None for routed in out.values()) and rt.routers.status() == {("triton", "passed"): 2}
    assert route_constants(planned.variants[SERVING]) == {(stats, stats, bool(check_ranks))}
    assert planned.variants[SERVING] == planned.variants[SELF_CHECK]


@pytest.mark.parametrize("agree", [None, "ranks"])
def test_a_compile_error_of_the_lost_variant_turns_oea_off(monkeypatch, planned, caplog, agree):
    """The kernel compiles, except with LOST (the variant with the most registers): under auto on
    CUDA, OEA turns off with one error line on every rank, as for any failed self-check; nothing
    raises past the routing hook."""
    planned.fails = lambda launch: dict(launch.constexprs).get("LOST", False)
    verdicts = []
    rt = OEARuntime(OEAConfig(k0=3, min_batch=2), world_size=1 if agree is None else 2,
                    agree=None if agree is None else lambda passed: verdicts.append(passed) or passed)
    out = serve(monkeypatch, rt)
    assert out == {0: None, 1: None}, "OEA is off: the router's own ids are kept"
    assert rt.routers.status() == {("off", "failed"): 2}
    assert verdicts == ([] if agree is None else [False, False])
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and all(COMPILE_ERROR in e and "OEA is OFF for this routing shape" in e for e in errors)
    assert not planned.variants[SERVING], "nothing launched after the failed self-check"


def test_without_counts_the_lost_variant_is_neither_checked_nor_served(monkeypatch, planned):
    """--oea-disable-stats: no LOST variant serves, so its compile error does not matter."""
    planned.fails = lambda launch: dict(launch.constexprs).get("LOST", False)
    rt = OEARuntime(OEAConfig(k0=3, min_batch=2, stats=False))
    assert all(routed is not None for routed in serve(monkeypatch, rt).values())
    assert rt.routers.status() == {("triton", "passed"): 2}
