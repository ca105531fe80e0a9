"""Live settings (OEARuntime.request_settings): k0, min_batch and max_batch changed between passes,
with no recapture, on the CPU as SGLang drives the runtime.

A graph is captured once (test_graph_path.py's simulation: stream capture forced on, a replay re-runs
the captured Python path); the settings then change between replays. Each change must take effect
at the next outermost pass, through the device control block the captured routing reads, and not
in a pass already begun (the overlap scheduler launches the next batch before it processes the
last one's results). k0 = 0 and k0 >= top-k must give the router's ids and weights bit for bit.

Every test runs in this process with the torch path, and again in a TRITON_INTERPRET=1 child with
the fused kernel behind the runtime (`test_live_routing_through_the_fused_kernel_in_the_interpreter`),
where the kernel's variant guard also proves that no replay launches a binary that capture did not.
"""

import logging
import os

import pytest
import torch

from oea_fixtures import TOP_K, assert_reference_routing, router_inputs, run_in_interpreter, topk_config
from sglang_oea.config import LiveSettings, OEAConfig
from sglang_oea.counters import stats_between
from sglang_oea.runtime import DECODE, OEARuntime
from test_graph_path import Capture, capture_bucket, replay, run_layers

BUCKET, LAYERS = 12, (0, 3)
CONFIG = topk_config()
STARTUP = dict(min_batch=4, max_batch=12)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def capture(monkeypatch):
    return Capture(monkeypatch)


def captured_runtime(capture, k0: int, inputs=None):
    """A runtime started with k0 and the STARTUP gate, one bucket captured; (runtime, inputs)."""
    rt = OEARuntime(OEAConfig(k0=k0, **STARTUP))
    inputs = inputs or {layer: router_inputs(BUCKET, seed=20 + layer) for layer in LAYERS}
    assert all(out is not None for out in capture_bucket(rt, capture, inputs, BUCKET, CONFIG).values()), (
        "an armed server captures routing whatever its k0")
    return rt, inputs


def assert_routes(out, inputs, k0: int, rows: int):
    """OEA at k0 over the real rows (reference), or the router's own bits when k0 is off or a no-op."""
    for layer, (logits, ids, weights) in inputs.items():
        if 1 <= k0 < TOP_K:
            assert_reference_routing(out[layer], logits, ids, weights, k0, rows)
        else:
            assert_router_bits(out[layer], ids, weights)


def assert_router_bits(routed, ids, weights):
    got_ids, got_weights = routed
    assert torch.equal(got_ids, ids) and torch.equal(got_weights.view(torch.int32), weights.view(torch.int32))


def settings(k0=3, min_batch=4, max_batch=12) -> LiveSettings:
    return LiveSettings(k0, min_batch, max_batch)


# (settings requested before the pass, real rows, k0 it routes with or None for a closed batch gate)
SEQUENCE = [
    (None, 9, 3),
    (settings(k0=5), 9, 5),
    (settings(k0=0), 9, 0),  # OEA off: the router's own
    (settings(k0=TOP_K), 9, TOP_K),  # a no-op
    (settings(k0=3), 10, 3),
    (settings(k0=3, min_batch=10), 9, None),  # below the live floor, inside the startup envelope
    (None, 11, 3),
    (settings(k0=6, min_batch=4, max_batch=10), 11, None),  # above the live cap
    (None, 10, 6),
]


def test_each_setting_takes_effect_at_the_next_replay_without_recapture(capture):
    rt, inputs = captured_runtime(capture, 3)
    for new, rows, k0 in SEQUENCE:
        if new is not None:
            rt.request_settings(new)
        out = replay(rt, capture, inputs, BUCKET, rows, CONFIG)
        if k0 is None:
            for layer, (_, ids, weights) in inputs.items():
                assert_router_bits(out[layer], ids, weights)
        else:
            assert_routes(out, inputs, k0, rows)
        assert rt.pending is None and (new is None or rt.settings == new)
    assert rt.routers.status() == {("triton", "passed") if INTERPRET else ("torch", "not_run"): 1}
    assert rt.applied_by_k0 == {(DECODE, 3): 3, (DECODE, 5): 1, (DECODE, 6): 1}
    assert rt.skipped_by_k0 == {(DECODE, 0, "oea_off"): 1, (DECODE, TOP_K, "k0_covers_top_k"): 1,
                                (DECODE, 3, "below_min_batch"): 1, (DECODE, 6, "above_max_batch"): 1}
    assert rt.applied_steps == 5 and sum(rt.skipped_steps.values()) == 4


def test_closed_gates_count_no_expert_statistics(capture):
    """The expert counters follow the device gate, k0 included: k0 = 0 and k0 >= top-k add nothing."""
    rt, inputs = captured_runtime(capture, 3)
    mark = rt.counters.snapshot_now()
    for k0 in (0, TOP_K, 4):
        rt.request_settings(settings(k0=k0))
        replay(rt, capture, inputs, BUCKET, 9, CONFIG)
    steps = stats_between(rt.counters.snapshot_now(), mark)[:, 0].tolist()
    assert steps == [1.0] * len(LAYERS)


def test_a_pass_begun_before_the_request_keeps_its_settings(capture, caplog):
    """The overlap scheduler launches pass N+1 before it processes pass N's results, where control
    requests are handled: a request made while a pass runs applies from the next pass on, and the
    accounting and the log line say so."""
    rt, inputs = captured_runtime(capture, 3)
    replay(rt, capture, inputs, BUCKET, 9, CONFIG)  # routed step 0

    def requests_meanwhile():
        rt.request_settings(settings(k0=6))
        rt.request_settings(settings(k0=5))  # the last request wins
        assert rt.settings == settings(k0=3) and rt.pending == settings(k0=5)
    assert_routes(replay(rt, capture, inputs, BUCKET, 9, CONFIG, while_running=requests_meanwhile), inputs, 3, 9)
    with caplog.at_level(logging.INFO, logger="sglang_oea"):
        assert_routes(replay(rt, capture, inputs, BUCKET, 9, CONFIG), inputs, 5, 9)
        replay(rt, capture, inputs, BUCKET, 9, CONFIG)
    lines = [r.getMessage() for r in caplog.records if "settings k0=" in r.getMessage()]
    assert lines == ["sglang-oea rank 0: settings k0=3 min_batch=4 max_batch=12 -> k0=5 min_batch=4 "
                     "max_batch=12 from routed step 2"]
    assert rt.applied_by_k0 == {(DECODE, 3): 2, (DECODE, 5): 2}


def test_no_change_inside_capture_mode(capture):
    """A request is not applied by a CUDA-graph warm-up or capture pass (the write would be captured
    into the graph), but by the next pass outside capture mode."""
    rt, inputs = captured_runtime(capture, 3)
    rt.request_settings(settings(k0=5))
    capture_bucket(rt, capture, {0: router_inputs(2 * BUCKET, seed=7)}, 2 * BUCKET, CONFIG)
    assert rt.settings == settings(k0=3) and rt.pending == settings(k0=5)
    assert_routes(replay(rt, capture, inputs, BUCKET, 9, CONFIG), inputs, 5, 9)


def eager_pass(rt, rows, seed=3):
    """One eager decode pass over LAYERS: (inputs, {layer: routed or None})."""
    inputs = {layer: router_inputs(rows, seed=seed + layer) for layer in LAYERS}
    rt.begin_step(DECODE, rows)
    out = run_layers(rt, inputs, CONFIG)
    rt.end_step()
    return inputs, out


@pytest.mark.parametrize("k0", [0, TOP_K, TOP_K + 2])
def test_eager_passes_off_or_no_op_launch_nothing(k0):
    """Eager passes with k0 = 0 or >= top-k are left alone on the host: no device state, no router
    call, no launch; a later k0 routes them."""
    rt = OEARuntime(OEAConfig(k0=3, **STARTUP))
    rt.request_settings(settings(k0=k0))
    _, out = eager_pass(rt, 6)
    assert set(out.values()) == {None} and rt.device is None and not rt.routers.decisions
    assert rt.skipped_by_k0 == {(DECODE, k0, "oea_off" if k0 == 0 else "k0_covers_top_k"): 1}
    rt.request_settings(settings(k0=2))
    inputs, out = eager_pass(rt, 6, seed=9)
    assert_routes(out, inputs, 2, 6)
    assert rt.applied_by_k0 == {(DECODE, 2): 1}


def test_armed_but_off_at_startup_routes_nothing_until_a_request(capture):
    """--oea-k0 0: everything installed, graphs captured with routing, OEA off until k0 is set."""
    rt, inputs = captured_runtime(capture, 0)
    assert rt.settings == settings(k0=0)
    assert_routes(replay(rt, capture, inputs, BUCKET, 9, CONFIG), inputs, 0, 9)
    assert set(eager_pass(rt, 6)[1].values()) == {None}
    assert rt.skipped_by_k0 == {(DECODE, 0, "oea_off"): 2} and rt.applied_steps == 0
    rt.request_settings(settings(k0=4))
    assert_routes(replay(rt, capture, inputs, BUCKET, 9, CONFIG), inputs, 4, 9)
    eager_inputs, out = eager_pass(rt, 6)
    assert_routes(out, eager_inputs, 4, 6)
    assert rt.applied_by_k0 == {(DECODE, 4): 2}


def test_startup_k0_covering_top_k_captures_routing_too(capture):
    rt, inputs = captured_runtime(capture, TOP_K)
    assert_routes(replay(rt, capture, inputs, BUCKET, 9, CONFIG), inputs, TOP_K, 9)
    assert rt.skipped_by_k0 == {(DECODE, TOP_K, "k0_covers_top_k"): 1}
    rt.request_settings(settings(k0=2))
    assert_routes(replay(rt, capture, inputs, BUCKET, 9, CONFIG), inputs, 2, 9)


def test_live_routing_through_the_fused_kernel_in_the_interpreter():
    """The same tests with the Triton kernel (interpreted) behind the runtime, in a child process."""
    if INTERPRET:
        pytest.skip("already running in the interpreter")
    run_in_interpreter(__file__, "through_the_fused_kernel")
