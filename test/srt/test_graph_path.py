"""The CUDA-graph routing path, run on the CPU as SGLang drives it.

DecodeCudaGraphRunner captures one graph per bucket, largest first: an outer forward context in
capture mode, two eager warm-up forwards, then the captured forward; each replay first sets the
real row count. Capture itself needs a GPU (benchmark/oea/gpu/gpu_check.py), so here stream capture is
forced on (`is_capturing`) for the captured forward, and a replay re-runs the captured Python path
with the device row scalar changed, as the graph would. Under speculative decoding the same runner
captures the target's verify graphs: a bucket of requests with every draft token a row.

SGLang 0.5.23's `--cuda-graph-backend-decode breakable` drives this same runner, capture and
replay: a graph break re-runs only the function it wraps at replay, and the decode forward of the
MoE models OEA supports has none, so the simulation stands for both backends. `--debug-cuda-graph`
(breakable's eager replay of the whole forward) is covered in test_verify_routing.py.

Every test runs in this process with the torch path, and again in a TRITON_INTERPRET=1 child with
the fused kernel behind the runtime (`test_graph_path_through_the_fused_kernel_in_the_interpreter`).
The kernel-only tests check that nothing is compiled or allocated inside capture.
"""

import dataclasses
import importlib
import os
import pytest
import torch

from oea_fixtures import NUM_EXPERTS, TOP_K, assert_reference_routing, router_inputs, run_in_interpreter, topk_config
from sglang_oea import runtime as runtime_module
from sglang_oea.config import OEAConfig
from sglang_oea.counters import stats_between
from sglang_oea.reference import distinct_experts
from sglang_oea.routers import GraphCaptureError
from sglang_oea.routing import RouterSpec, route_from_logits
from sglang_oea.runtime import DECODE, DRAFT, OTHER, VERIFY, OEARuntime

BUCKET, LAYERS = 16, (0, 3)
# One TopKConfig per MoE layer kind, as SGLang keeps them for the model's lifetime.
CONFIG, SHARED_CONFIG = topk_config(), topk_config(1)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
kernel_only = pytest.mark.skipif(not INTERPRET, reason="runs in the interpreter child (fused kernel)")


class Capture:
    """Forces `is_capturing` on while `on` is set. `settings` keeps, per captured graph, the host
    settings its capture pass saw: a real graph replays what its capture recorded, host values
    included, so the simulated replay re-runs the Python path with those, not with the settings in
    force (which only the device control block carries into a real replay)."""

    def __init__(self, monkeypatch):
        self.on = False
        self.settings = {}
        monkeypatch.setattr(runtime_module, "is_capturing", lambda tensor: self.on)

    @staticmethod
    def key(rt, mode, bucket, per_request):
        return id(rt), mode, bucket, per_request


@pytest.fixture
def capture(monkeypatch):
    return Capture(monkeypatch)


def run_layers(rt, inputs, config):
    """One forward pass over the MoE layers: {layer: routed (ids, weights) or None}."""
    return {layer: rt.route(ids, w, config, logits, layer) for layer, (logits, ids, w) in inputs.items()}


def capture_bucket(rt, capture, inputs, bucket, config, mode=DECODE, per_request=1):
    """As DecodeCudaGraphRunner.capture_one_shape: capture-mode context, two warm-ups, capture.
    bucket counts requests; a verify graph has per_request (draft tokens) rows for each."""
    previous = rt.begin_step(mode, bucket * per_request, graph=True, requests=bucket)
    capture.settings[capture.key(rt, mode, bucket, per_request)] = rt.step.settings
    try:
        for _ in range(2):
            run_layers(rt, inputs, config)
        capture.on = True
        return run_layers(rt, inputs, config)
    finally:
        capture.on = False
        rt.end_step()
        rt.step = previous


def replay(rt, capture, inputs, bucket, real, config, mode=DECODE, per_request=1, while_running=None):
    """One step served by the bucket's graph: the step's forward context (`real` requests), the
    real token rows set before the replay, the captured Python path re-run with them and with the
    host settings of its capture (Capture.settings), the bucket noted after. while_running: called
    once the step has begun (what the host does meanwhile)."""
    previous = rt.begin_step(mode, real * per_request, requests=real)
    try:
        if while_running is not None:
            while_running()
        rt.set_replay_rows(real * per_request)
        graph_step = rt.begin_step(mode, bucket * per_request, graph=True, outermost=False, requests=bucket)
        rt.step = dataclasses.replace(rt.step, settings=capture.settings[capture.key(rt, mode, bucket, per_request)])
        capture.on = True
        out = run_layers(rt, inputs, config)
        capture.on = False
        rt.step = graph_step
        rt.note_replay(bucket)
        rt.end_step()
        return out
    finally:
        capture.on = False
        rt.step = previous


@pytest.fixture
def captured(capture):
    rt = OEARuntime(OEAConfig(k0=3, min_batch=4, max_batch=12))
    inputs = {layer: router_inputs(BUCKET, seed=layer) for layer in LAYERS}
    capture_bucket(rt, capture, inputs, BUCKET, CONFIG)
    return rt, capture, inputs


def assert_routed_like_the_reference(out, inputs, real_rows):
    """Each layer's routing equals sglang_oea.reference over the real rows (k0=3)."""
    for layer, (logits, ids, weights) in inputs.items():
        assert_reference_routing(out[layer], logits, ids, weights, 3, real_rows)


def assert_router_output(out, inputs):
    for layer, (logits, ids, weights) in inputs.items():
        got_ids, got_weights = out[layer]
        assert torch.equal(got_ids, ids) and torch.equal(got_weights, weights)


@pytest.mark.parametrize("real_rows", [12, 9, 4])
def test_replay_equals_reference_for_each_real_row_count(captured, real_rows):
    rt, capture, inputs = captured
    assert_routed_like_the_reference(replay(rt, capture, inputs, BUCKET, real_rows, CONFIG), inputs, real_rows)


@pytest.mark.parametrize("real_rows", [3, 1, 13, 16])
def test_closed_gate_is_bit_identical_to_the_router(captured, real_rows):
    rt, capture, inputs = captured
    assert_router_output(replay(rt, capture, inputs, BUCKET, real_rows, CONFIG), inputs)


def test_stats_count_only_replays_with_an_open_gate(captured):
    rt, capture, inputs = captured
    mark = rt.counters.snapshot_now()  # the warm-ups and the capture ran with the device gate of whatever rows it held
    for rows in (9, 2, 14, 9):
        replay(rt, capture, inputs, BUCKET, rows, CONFIG)
    layers = stats_between(rt.counters.snapshot_now(), mark)
    assert layers[:, 3].tolist() == list(LAYERS)
    logits, ids, _ = inputs[LAYERS[1]]
    steps, before, after = layers[1, :3].tolist()
    assert steps == 2 and before == 2 * distinct_experts(ids, NUM_EXPERTS, 9).item()
    assert after < before


def test_replays_are_counted_by_what_their_capture_did(captured):
    rt, capture, inputs = captured
    assert rt.steps_of(DECODE) == 0 and rt.applied_steps == 0, "warm-up and capture passes are not serving steps"
    for rows in (9, 2, 14, 4):
        replay(rt, capture, inputs, BUCKET, rows, CONFIG)
    assert rt.steps_of(DECODE) == 4 and rt.applied_steps == 2
    assert rt.skipped_steps == {"below_min_batch": 1, "above_max_batch": 1}


# ----------------------------------------------------------------------------- speculative verify graphs
# A verify graph is captured per bucket of requests, each with DRAFTS token rows, request after
# request; a replay pads the real requests up to the bucket, so the padded rows come last.
DRAFTS, VERIFY_BUCKET = 4, 4  # 16 rows, as the decode bucket


@pytest.fixture
def captured_verify(capture):
    rt = OEARuntime(OEAConfig(k0=3, min_batch=2, max_batch=3 * DRAFTS), speculative=True)
    inputs = {layer: router_inputs(VERIFY_BUCKET * DRAFTS, seed=10 + layer) for layer in LAYERS}
    capture_bucket(rt, capture, inputs, VERIFY_BUCKET, CONFIG, mode=VERIFY, per_request=DRAFTS)
    return rt, capture, inputs


def verify_replay(captured_verify, requests):
    rt, capture, inputs = captured_verify
    return replay(rt, capture, inputs, VERIFY_BUCKET, requests, CONFIG, mode=VERIFY, per_request=DRAFTS)


@pytest.mark.parametrize("requests", [3, 2])
def test_verify_replay_routes_every_real_draft_token(captured_verify, requests):
    """Every real verify token is a row of the union; the padded requests' rows are excluded."""
    assert_routed_like_the_reference(verify_replay(captured_verify, requests), captured_verify[2], requests * DRAFTS)


@pytest.mark.parametrize("requests", [1, 4])
def test_verify_gate_floor_counts_requests_and_cap_counts_rows(captured_verify, requests):
    """min_batch 2 requests, max_batch 12 rows, 4 draft tokens a request: 1 request (4 rows) is
    below the floor, which counts requests; 4 requests (16 rows) are above the cap, which counts
    rows (a cap on requests would let 4 through)."""
    assert_router_output(verify_replay(captured_verify, requests), captured_verify[2])


@pytest.mark.parametrize("mode,per_request,routed_buckets", [
    (DECODE, 1, {2, 4, 8}),  # max 6 rows: bucket 8 serves 5-8 requests, 16 serves 9-16
    (VERIFY, DRAFTS, {2, 4}),  # max 12 rows: bucket 4 serves 3-4 requests (12-16 rows), 8 serves 5-8
])
def test_buckets_outside_the_gate_are_captured_without_routing(capture, mode, per_request, routed_buckets):
    """A bucket serves batches above the next smaller bucket: one whose smallest batch is already
    above --oea-max-batch, or whose largest is below --oea-min-batch, never opens the gate, so its
    graph is captured with no routing in it (no launch at replay). Its replays keep the router's ids."""
    buckets = (1, 2, 4, 8, 16)
    rt = OEARuntime(OEAConfig(k0=3, min_batch=2, max_batch=6 if mode == DECODE else 3 * DRAFTS),
                    speculative=mode == VERIFY)
    rt.graph_buckets = buckets
    routed = set()
    for bucket in reversed(buckets):  # SGLang captures largest first
        inputs = {layer: router_inputs(bucket * per_request, seed=bucket) for layer in LAYERS}
        out = capture_bucket(rt, capture, inputs, bucket, CONFIG, mode=mode, per_request=per_request)
        if all(o is not None for o in out.values()):
            routed.add(bucket)
        else:
            assert all(o is None for o in out.values()), out
    assert routed == routed_buckets
    inputs = {layer: router_inputs(16 * per_request, seed=16) for layer in LAYERS}
    assert all(o is None for o in replay(rt, capture, inputs, 16, 12, CONFIG, mode, per_request).values())
    assert rt.skipped == {(mode, "above_max_batch"): 1}


def test_verify_graphs_hold_no_routing_under_verify_off(capture):
    """--oea-verify off: a verify graph is captured with no routing in it (bucket 4 of 4 draft
    tokens, inside every gate), its replays keep the router's ids and weights, nothing lands in the
    counters, and the accounting files the steps as target_verify with their tokens' router mass
    kept whole."""
    rt = OEARuntime(OEAConfig(k0=3, min_batch=2, verify=False), speculative=True)
    rt.graph_buckets = (1, 2, 4)
    inputs = {layer: router_inputs(VERIFY_BUCKET * DRAFTS, seed=10 + layer) for layer in LAYERS}
    assert all(o is None for o in capture_bucket(rt, capture, inputs, VERIFY_BUCKET, CONFIG, VERIFY, DRAFTS).values())
    for requests in (3, 4):
        out = replay(rt, capture, inputs, VERIFY_BUCKET, requests, CONFIG, mode=VERIFY, per_request=DRAFTS)
        assert all(o is None for o in out.values()), "a verify replay rewrote ids under --oea-verify off"
    assert rt.device is None, "nothing was routed, so no routing state was made"
    assert rt.skipped == {(VERIFY, "target_verify"): 2} and rt.applied_steps == 0
    assert rt.accounts.tokens_by_k0 == {3: 7 * DRAFTS}, "their tokens count as keeping all their router mass"


def test_verify_replays_are_counted_as_verify_steps(captured_verify):
    rt = captured_verify[0]
    assert rt.captured == {(VERIFY, VERIFY_BUCKET, DRAFTS): None}, "the capture pass rewrote ids"
    for requests in (3, 1, 4, 2):
        verify_replay(captured_verify, requests)
    assert rt.applied == {VERIFY: 2} and rt.steps_of(DECODE) == 0
    assert rt.skipped == {(VERIFY, "below_min_batch"): 1, (VERIFY, "above_max_batch"): 1}


def test_verify_runners_of_two_draft_widths_keep_their_own_capture_outcomes(capture):
    """Adaptive speculative decoding: one verify runner per draft width, each capturing the same
    buckets of requests. Under a cap of 12 rows the 2-token runner routes bucket 4 (8 rows) and the
    8-token runner, captured after it, leaves its bucket 4 (32 rows) unrouted. Replays of each are
    counted by what their own capture did: the last capture must not stand for both."""
    rt = OEARuntime(OEAConfig(k0=3, min_batch=2, max_batch=12), speculative=True)
    rt.graph_buckets = (1, 2, 4)
    narrow = {layer: router_inputs(4 * 2, seed=30 + layer) for layer in LAYERS}
    wide = {layer: router_inputs(4 * 8, seed=40 + layer) for layer in LAYERS}
    assert all(o is not None for o in capture_bucket(rt, capture, narrow, 4, CONFIG, VERIFY, per_request=2).values())
    assert all(o is None for o in capture_bucket(rt, capture, wide, 4, CONFIG, VERIFY, per_request=8).values())
    # The wide runner's bucket holds no routing (its replays never reach the kernel's gate).
    assert rt.captured == {(VERIFY, 4, 2): None, (VERIFY, 4, 8): "no_topk_ids"}
    out = replay(rt, capture, narrow, 4, 3, CONFIG, mode=VERIFY, per_request=2)  # 6 rows: gate open
    assert all(o is not None for o in out.values())
    replay(rt, capture, wide, 4, 1, CONFIG, mode=VERIFY, per_request=8)  # 8 rows, but below min_batch
    replay(rt, capture, wide, 4, 2, CONFIG, mode=VERIFY, per_request=8)  # 16 rows: above the cap
    assert rt.applied == {VERIFY: 1}
    assert rt.skipped == {(VERIFY, "below_min_batch"): 1, (VERIFY, "above_max_batch"): 1}, "never no_topk_ids"


def test_verify_stats_count_token_rows(captured_verify):
    rt, _, inputs = captured_verify
    mark = rt.counters.snapshot_now()
    verify_replay(captured_verify, 3)
    steps, before, after = stats_between(rt.counters.snapshot_now(), mark)[0, :3].tolist()
    _, ids, _ = inputs[LAYERS[0]]
    assert steps == 1 and before == distinct_experts(ids, NUM_EXPERTS, 3 * DRAFTS).item() and after < before


def test_bucket_below_min_batch_is_not_routed(capture):
    rt = OEARuntime(OEAConfig(k0=3, min_batch=4))
    inputs = {0: router_inputs(2, seed=0)}
    out = capture_bucket(rt, capture, inputs, 2, CONFIG)
    assert out == {0: None}


def test_shared_columns_pass_through_under_capture(capture):
    rt = OEARuntime(OEAConfig(k0=3, min_batch=4))
    inputs = {0: router_inputs(BUCKET, seed=5, shared=1)}
    capture_bucket(rt, capture, inputs, BUCKET, SHARED_CONFIG)
    got_ids, got_weights = replay(rt, capture, inputs, BUCKET, 10, SHARED_CONFIG)[0]
    logits, ids, weights = inputs[0]
    assert torch.equal(got_ids[:, TOP_K:], ids[:, TOP_K:]) and torch.equal(got_weights[:, TOP_K:], weights[:, TOP_K:])
    want_ids, _ = route_from_logits(logits, ids[:, :TOP_K], weights[:, :TOP_K], RouterSpec("softmax"), 3, 10)
    assert torch.equal(got_ids[:, :TOP_K].long(), want_ids)


def test_lost_router_mass_is_filed_under_the_k0_each_replay_ran_with(capture):
    """One graph, captured once, outlives a live k0 change: each replay with an open gate adds its
    real rows' lost router mass (shared-expert columns and padded rows excluded) to the column of
    its own k0; closed-gate replays and OEA off add nothing. The expected units come from a
    brute-force computation on the replay's own output (gpu_compare.brute_force_lost_units)."""
    from gpu.gpu_compare import brute_force_lost_units
    from sglang_oea.config import LiveSettings
    from sglang_oea.counters import LOST

    rt = OEARuntime(OEAConfig(k0=3, min_batch=4, max_batch=12))
    inputs = {0: router_inputs(BUCKET, seed=5, shared=1), 3: router_inputs(BUCKET, seed=6, shared=1)}
    capture_bucket(rt, capture, inputs, BUCKET, SHARED_CONFIG)
    start = rt.counters.table[:, LOST:].clone()  # the warm-ups and the capture counted what their rows held
    want = {(layer, k0): [0, 0] for layer in inputs for k0 in (0, 2, 3)}
    for k0, real in ((3, 10), (3, 2), (2, 7), (0, 9), (2, 13), (3, 5)):
        rt.request_settings(LiveSettings(k0=k0, min_batch=4, max_batch=12))
        out = replay(rt, capture, inputs, BUCKET, real, SHARED_CONFIG)
        if k0 == 0 or not 4 <= real <= 12:
            continue
        for layer, (_, ids, weights) in inputs.items():
            got_ids, got_weights = out[layer]
            units, rows = brute_force_lost_units(ids[:, :TOP_K], weights[:, :TOP_K], got_ids[:, :TOP_K],
                                                 got_weights[:, :TOP_K], NUM_EXPERTS, real)
            want[(layer, k0)] = [want[(layer, k0)][0] + units, want[(layer, k0)][1] + rows]
    added = rt.counters.table[:, LOST:] - start
    for (layer, k0), (units, rows) in want.items():
        assert abs(int(added[layer, k0]) - units) <= rows, (layer, k0, int(added[layer, k0]), units)
        if k0:
            assert units > rows, "OEA at k0 < top-k drops router mass on random routings"
    assert int(added[[0, 3]][:, [0, 2, 3]].count_nonzero()) == 4 and int(added.count_nonzero()) == 4


def test_eager_steps_count_only_when_ids_were_rewritten(caplog):
    rt = OEARuntime(OEAConfig(k0=3, min_batch=4))
    logits, ids, weights = router_inputs(6, seed=1)
    rt.begin_step(DECODE, 6)
    assert rt.route(ids, weights, CONFIG, logits, 0) is not None
    rt.end_step()
    rt.begin_step(DECODE, 6)  # a decode step in which the hook never saw top-k ids
    rt.end_step()
    rt.begin_step(DECODE, 6)
    rt.end_step()
    assert rt.applied_steps == 1 and rt.steps_of(DECODE) == 3
    assert rt.skipped_steps == {"no_topk_ids": 2}
    assert caplog.text.count("without the routing hook seeing any top-k ids") == 1


@pytest.mark.parametrize("verify", [True, False])
def test_speculative_decode_passes_belong_to_the_draft_model(verify):
    """Under speculative decoding every decode pass is the draft model's: never counted. Verify
    passes are the target's (routed with --oea-verify on, skipped as target_verify when off)."""
    rt = OEARuntime(OEAConfig(k0=3, min_batch=4, verify=verify), speculative=True)
    for mode in (DECODE, DECODE, VERIFY, OTHER, DRAFT):
        rt.begin_step(mode, 8 * 4, requests=8)
        rt.end_step()
    assert rt.steps_of(DECODE) == 0 and rt.steps_of(DRAFT) == 0 and rt.applied_steps == 0
    verify_reason = "no_topk_ids" if verify else "target_verify"  # nothing was routed in these passes
    assert rt.skipped == {(VERIFY, verify_reason): 1, (OTHER, "not_decode"): 1}


def test_custom_routing_function_is_left_alone(captured, caplog):
    rt, capture, inputs = captured
    config = topk_config()
    config.custom_routing_function = lambda **kw: None
    rt.begin_step(DECODE, 9)
    logits, ids, weights = inputs[0]
    assert rt.route(ids, weights, config, logits, 7) is None
    assert rt.route(ids, weights, config, logits, 8) is None
    rt.end_step()
    assert caplog.text.count("is not supported") == 1
    assert rt.skipped_steps["router_unsupported"] == 1


# ----------------------------------------------------------------------------- fused kernel only


@kernel_only
def test_kernel_is_used_and_nothing_compiles_or_allocates_in_capture(monkeypatch, capture):
    """max_batch below the bucket: the warm-ups' rows (the bucket) are past the gate, yet they must
    launch, compile and allocate everything the capture launches."""
    kernel_module = importlib.import_module("sglang_oea.kernels.oea_route")
    allocations = []
    original = kernel_module.OEAWorkspace.allocate.__func__
    monkeypatch.setattr(kernel_module.OEAWorkspace, "allocate", classmethod(
        lambda cls, *a, **kw: allocations.append(capture.on) or original(cls, *a, **kw)))
    launched = {False: set(), True: set()}
    run = kernel_module.KernelLaunch.run
    monkeypatch.setattr(kernel_module.KernelLaunch, "run", lambda self: launched[capture.on].add(self.variant()) or run(self))

    rt = OEARuntime(OEAConfig(k0=3, min_batch=4, max_batch=8))
    inputs = {layer: router_inputs(BUCKET, seed=layer) for layer in LAYERS}
    capture_bucket(rt, capture, inputs, BUCKET, CONFIG)
    out = replay(rt, capture, inputs, BUCKET, 6, CONFIG)
    assert rt.routers.status() == {("triton", "passed"): 1}
    assert launched[True] and launched[True] <= launched[False], "a variant was first launched inside capture"
    assert True not in allocations, "a workspace was allocated inside capture"
    logits, ids, weights = inputs[0]
    want_ids, _ = route_from_logits(logits, ids, weights, RouterSpec("softmax"), 3, 6)
    assert torch.equal(out[0][0].long(), want_ids)


@kernel_only
def test_capture_without_warm_up_is_refused(capture):
    rt = OEARuntime(OEAConfig(k0=3, min_batch=4))
    rt.begin_step(DECODE, BUCKET, graph=True)
    logits, ids, weights = router_inputs(BUCKET, seed=0)
    capture.on = True
    with pytest.raises(GraphCaptureError, match="inside CUDA-graph capture"):
        rt.route(ids, weights, CONFIG, logits, 0)


@kernel_only
def test_unseen_variant_in_capture_is_refused(capture):
    rt = OEARuntime(OEAConfig(k0=3, min_batch=4))
    inputs = {0: router_inputs(BUCKET, seed=0)}
    capture_bucket(rt, capture, inputs, BUCKET, CONFIG)
    logits, ids, weights = inputs[0]
    strided = torch.cat([logits, torch.zeros(BUCKET, 3)], dim=1)[:, :NUM_EXPERTS]  # row stride 67: another binary
    rt.begin_step(DECODE, BUCKET, graph=True)
    capture.on = True
    with pytest.raises(GraphCaptureError, match="would be compiled inside CUDA-graph capture"):
        rt.route(ids, weights, CONFIG, strided, 0)


def record_captured_workspaces(monkeypatch, router):
    """[(workspace weakref, its buffers' addresses)] for every workspace a capture call used."""
    import weakref

    used, lookup = [], router.workspace

    def workspace(slot, logits, ids, weights, capturing):
        ws = lookup(slot, logits, ids, weights, capturing)
        if capturing:
            used.append((weakref.ref(ws), (ws.union.data_ptr(), ws.out_ids.data_ptr(), ws.out_weights.data_ptr())))
        return ws
    monkeypatch.setattr(router, "workspace", workspace)
    return used


@kernel_only
def test_no_captured_workspace_is_released_or_replaced(monkeypatch, capture):
    """SGLang's adaptive speculative decoding captures one verify runner per step count, each wider
    than the last (only the first gets the warm-up that sized the main workspace), then serves eager
    batches wider still. Every workspace a capture used stays alive at its address, and every graph
    still routes like the reference when replayed afterwards."""
    from sglang_oea.routers import TritonRouter

    monkeypatch.setattr(TritonRouter, "MIN_WORKSPACE_ROWS", BUCKET)  # small, for the interpreter
    rt = OEARuntime(OEAConfig(k0=3, min_batch=2))
    router = rt.routers.triton
    used = record_captured_workspaces(monkeypatch, router)
    requests, runners = 8, (2, 3, 4)  # draft tokens per request: 16, 24, 32 rows
    inputs = {per: {0: router_inputs(requests * per, seed=per)} for per in runners}
    for per in runners:
        capture_bucket(rt, capture, inputs[per], requests, CONFIG, mode=VERIFY, per_request=per)
    logits, ids, weights = router_inputs(70, seed=9)  # an eager verify batch wider than every runner
    rt.begin_step(VERIFY, 70, requests=35)
    got_ids, _ = rt.route(ids, weights, CONFIG, logits, 0)
    rt.end_step()
    assert torch.equal(got_ids.long(), route_from_logits(logits, ids, weights, RouterSpec("softmax"), 3, 70)[0])
    held = router.workspaces[0, torch.int32, torch.float32]
    assert len(used) == len(runners) and [ws.max_rows for ws in held] == [16, 32, 70]
    for ref, pointers in used:
        ws = ref()
        assert ws is not None and any(ws is h for h in held), "a captured workspace was released"
        assert (ws.union.data_ptr(), ws.out_ids.data_ptr(), ws.out_weights.data_ptr()) == pointers
    for per in runners:  # every runner's graph still serves, through the workspace it captured
        out = replay(rt, capture, inputs[per], requests, 5, CONFIG, mode=VERIFY, per_request=per)
        logits, ids, weights = inputs[per][0]
        assert torch.equal(out[0][0].long(), route_from_logits(logits, ids, weights, RouterSpec("softmax"), 3, 5 * per)[0])


@kernel_only
@pytest.mark.parametrize("config,shared", [(CONFIG, 0), (SHARED_CONFIG, 1)])
def test_two_launches_per_layer_and_no_glue(monkeypatch, config, shared):
    """On the kernel path a layer costs its two kernel launches and nothing else: no id cast, no
    torch.cat for shared-expert columns. An eager step writes the device row count once."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import interpreter

    launches, glue, in_kernel = [], [], [False]
    run = interpreter.InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        launches.append(1)
        in_kernel[0] = True
        try:
            return run(self, *args, **kwargs)
        finally:
            in_kernel[0] = False

    class Glue(TorchDispatchMode):
        views = {"slice", "view", "alias", "detach", "as_strided", "select", "expand", "_unsafe_view"}

        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            if not in_kernel[0] and func.overloadpacket.__name__ not in self.views:
                glue.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    rt = OEARuntime(OEAConfig(k0=3, min_batch=2))
    logits, ids, weights = router_inputs(12, seed=2, shared=shared)
    for step in range(2):  # the first step runs the self-check and allocates the workspaces
        rt.begin_step(DECODE, 12)
        if step:
            monkeypatch.setattr(interpreter.InterpretedFunction, "run", counted_run)
            with Glue():
                outs = [rt.route(ids, weights, config, logits, layer) for layer in LAYERS]
        else:
            outs = [rt.route(ids, weights, config, logits, layer) for layer in LAYERS]
        rt.end_step()
    assert all(out is not None and out[0].dtype == ids.dtype and out[0].shape == ids.shape for out in outs)
    assert len(launches) == 2 * len(LAYERS)
    assert glue == ["fill_"], glue


def test_graph_path_through_the_fused_kernel_in_the_interpreter():
    """The same tests with the Triton kernel (interpreted) behind the runtime, in a child process:
    Triton reads TRITON_INTERPRET once, at import."""
    if INTERPRET:
        pytest.skip("already running in the interpreter")
    run_in_interpreter(__file__, "through_the_fused_kernel")
