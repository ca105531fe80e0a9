"""OEA in speculative decoding's target-verify passes, on the CPU: the runtime and the SGLang hooks.

A verify pass routes every draft token of every request: rows = requests x draft tokens, all of
them in the union; the batch gate counts requests. The draft model's passes are neither routed
nor counted. Verify graphs (padded rows) are in test_graph_path.py, SGLang's own select_experts
in test_select_experts.py, a real server in test_speculative.py.
"""

import collections
import contextlib
import types

import pytest
import torch

from oea_fixtures import assert_reference_routing, router_inputs, topk_config
from sglang_oea import hooks, metrics
from sglang_oea.config import LiveSettings, OEAConfig
from sglang_oea.runtime import DECODE, DRAFT, OTHER, VERIFY, OEARuntime
from sglang_oea.passes import verify_cap_problem

DRAFTS, K0 = 4, 3
CONFIG = topk_config()


def verify_pass(rt, requests, config=CONFIG, seed=0):
    """One eager verify pass over two MoE layers: (inputs, {layer: routed or None})."""
    rows = requests * DRAFTS
    inputs = {layer: router_inputs(rows, seed=seed + layer) for layer in (0, 1)}
    rt.begin_step(VERIFY, rows, requests=requests)
    out = {layer: rt.route(ids, weights, config, logits, layer) for layer, (logits, ids, weights) in inputs.items()}
    rt.end_step()
    return inputs, out


# ----------------------------------------------------------------------------- runtime


@pytest.mark.parametrize("requests", [2, 5])
def test_eager_verify_routes_every_draft_token_like_the_reference(requests):
    rt = OEARuntime(OEAConfig(k0=K0, min_batch=2), speculative=True)
    inputs, out = verify_pass(rt, requests)
    for layer, (logits, ids, weights) in inputs.items():
        assert_reference_routing(out[layer], logits, ids, weights, K0, requests * DRAFTS)
    assert rt.applied == {VERIFY: 1} and not rt.skipped


def test_eager_verify_gate_counts_requests():
    """1 request is 4 rows and 4 requests are 16 rows: a gate on rows would route both."""
    rt = OEARuntime(OEAConfig(k0=K0, min_batch=2, max_batch=3), speculative=True)
    for requests in (1, 4):
        assert set(verify_pass(rt, requests)[1].values()) == {None}
    assert rt.skipped == {(VERIFY, "below_min_batch"): 1, (VERIFY, "above_max_batch"): 1} and not rt.applied


def test_verify_off_leaves_verify_passes_alone():
    rt = OEARuntime(OEAConfig(k0=K0, min_batch=2, verify=False), speculative=True)
    assert set(verify_pass(rt, 3)[1].values()) == {None}
    assert rt.skipped == {(VERIFY, "target_verify"): 1}


def test_draft_moe_layers_are_never_routed():
    """SGLang builds every draft TopK with allow_routed_experts_capture=False (in the draft's build
    scope, and again for a draft worker's model): OEA leaves such a layer alone in any pass."""
    draft_config = topk_config()
    draft_config.allow_routed_experts_capture = False
    rt = OEARuntime(OEAConfig(k0=K0, min_batch=2), speculative=True)
    assert set(verify_pass(rt, 3, config=draft_config)[1].values()) == {None}


def test_draft_passes_are_not_counted():
    rt = OEARuntime(OEAConfig(k0=K0, min_batch=2), speculative=True)
    logits, ids, weights = router_inputs(8, seed=1)
    for mode in (DECODE, DRAFT):  # under speculative decoding every decode pass is the draft's
        rt.begin_step(mode, 8)
        assert rt.step.mode == DRAFT and rt.route(ids, weights, CONFIG, logits, 0) is None
        rt.end_step()
    assert not rt.applied and not rt.skipped and rt.routed_steps == 0


# ----------------------------------------------------------------------------- hooks


@pytest.fixture
def runtime(monkeypatch):
    rt = OEARuntime(OEAConfig(k0=K0, min_batch=2), speculative=True)
    monkeypatch.setattr(hooks, "_runtime", rt)
    monkeypatch.setattr(hooks, "capture_mode_active", lambda: False)
    return rt


def forward_batch(mode_name, requests, rows):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return types.SimpleNamespace(forward_mode=ForwardMode[mode_name], batch_size=requests,
                                 input_ids=torch.zeros(rows, dtype=torch.long))


def forward(batch, body):
    """One pass through SGLang's forward context (hooked), as ModelRunner._forward_raw enters it."""
    with hooks.forward_context_hook(lambda ctx, forward_batch=None: contextlib.nullcontext(), None, forward_batch=batch):
        return body()


def runner_of(draft):
    return types.SimpleNamespace(is_draft_worker=draft, model_runner=types.SimpleNamespace(is_draft_worker=draft),
                                 capture_bs=[1, 2, 4, 8])


def test_target_verify_pass_is_routed_over_its_token_rows(runtime):
    logits, ids, weights = router_inputs(3 * DRAFTS, seed=3)
    batch = forward_batch("TARGET_VERIFY", 3, 3 * DRAFTS)

    def body():
        step = runtime.step
        return (step.mode, step.num_rows, step.requests), runtime.route(ids, weights, CONFIG, logits, 0)

    seen, routed = hooks.model_forward_hook(lambda runner, b: forward(b, body), runner_of(False), batch)
    assert seen == (VERIFY, 3 * DRAFTS, 3)
    assert_reference_routing(routed, logits, ids, weights, K0, 3 * DRAFTS)
    assert runtime.applied == {VERIFY: 1}


@pytest.mark.parametrize("mode_name", ["TARGET_VERIFY", "DECODE", "DRAFT_EXTEND_V2"])
def test_draft_runner_passes_are_neither_routed_nor_counted(runtime, mode_name):
    """An MTP/EAGLE draft decodes, a DFlash draft verifies: under the draft runner every pass is
    DRAFT. Draft-extend passes are DRAFT whichever runner runs them."""
    logits, ids, weights = router_inputs(12, seed=4)
    batch = forward_batch(mode_name, 3, 12)
    body = lambda: (runtime.step.mode, runtime.route(ids, weights, CONFIG, logits, 0))  # noqa: E731
    assert hooks.model_forward_hook(lambda runner, b: forward(b, body), runner_of(True), batch) == (DRAFT, None)
    if mode_name == "DRAFT_EXTEND_V2":
        assert forward(batch, body) == (DRAFT, None)
    assert not runtime.applied and not runtime.skipped


def test_a_draft_runners_capture_does_not_stand_for_the_targets(runtime, monkeypatch):
    """A DFlash draft captures verify graphs with the target's bucket sizes, after the target: its
    (dense) capture must not overwrite what the target's capture did."""
    monkeypatch.setattr(hooks, "capture_mode_active", lambda: True)
    logits, ids, weights = router_inputs(4 * DRAFTS, seed=5)
    runtime.device_state(torch.device("cpu"), capturing=False)
    batch = forward_batch("TARGET_VERIFY", 4, 4 * DRAFTS)
    target_capture = lambda runner: forward(batch, lambda: runtime.route(ids, weights, CONFIG, logits, 0))  # noqa: E731
    draft_capture = lambda runner: forward(batch, lambda: None)  # noqa: E731
    hooks.graph_capture_hook(target_capture, runner_of(False))
    hooks.graph_capture_hook(draft_capture, runner_of(True))
    assert runtime.captured == {(VERIFY, 4, DRAFTS): None}


def test_verify_graph_replay_gets_the_real_token_rows(runtime):
    runtime.device_state(torch.device("cpu"), capturing=False)  # made by the warm-ups, before capture
    runtime.captured[(VERIFY, 4, DRAFTS)] = None  # the bucket's capture rewrote ids
    batch = forward_batch("TARGET_VERIFY", 3, 3 * DRAFTS)
    replay = lambda runner, b: int(runtime.device.rows)  # noqa: E731  (what the captured routing reads)
    seen = forward(batch, lambda: hooks.graph_execute_hook(replay, types.SimpleNamespace(bs=4), batch))
    assert seen == 3 * DRAFTS
    assert runtime.applied == {VERIFY: 1}


@pytest.mark.parametrize("mode_name,per_request", [("DECODE", 1), ("TARGET_VERIFY", DRAFTS)])
def test_a_forward_rerun_inside_a_replay_routes_as_the_graph(monkeypatch, mode_name, per_request):
    """--debug-cuda-graph: the breakable backend replays by re-running the whole forward eagerly on
    the graph's capture-time batch (bucket 4, padded), inside DecodeCudaGraphRunner.execute and the
    step's own context (3 real requests). That nested pass is a graph pass: the routing reads the
    real rows from the device scalar and gates on the device, so the padded request's rows are
    never part of the union; the step is counted once, by its capture."""
    rt = OEARuntime(OEAConfig(k0=K0, min_batch=2), speculative=per_request > 1)
    monkeypatch.setattr(hooks, "_runtime", rt)
    monkeypatch.setattr(hooks, "capture_mode_active", lambda: False)  # even if SGLang's flag read False
    mode = VERIFY if per_request > 1 else DECODE
    rt.device_state(torch.device("cpu"), capturing=False)
    rt.accounts.captured[(mode, 4, per_request)] = None  # the bucket's capture rewrote ids
    logits, ids, weights = router_inputs(4 * per_request, seed=7)
    padded = forward_batch(mode_name, 4, 4 * per_request)

    def debug_replay(runner, batch):
        return forward(padded, lambda: (rt.step.graph, rt.route(ids, weights, CONFIG, logits, 0)))

    real = forward_batch(mode_name, 3, 3 * per_request)
    graph, routed = forward(real, lambda: hooks.graph_execute_hook(debug_replay, types.SimpleNamespace(bs=4), real))
    assert graph, "the re-run forward is a graph pass"
    assert_reference_routing(routed, logits, ids, weights, K0, 3 * per_request)
    assert rt.applied == {mode: 1} and not rt.skipped


def test_verify_off_holds_through_graph_capture_and_a_forward_rerun(monkeypatch):
    """--oea-verify off, with CUDA graphs: the verify bucket's capture pass (SGLang's capture mode)
    routes nothing, and a --debug-cuda-graph re-run of the forward inside its replay leaves the ids
    alone; the step is filed as target_verify."""
    rt = OEARuntime(OEAConfig(k0=K0, min_batch=2, verify=False), speculative=True)
    monkeypatch.setattr(hooks, "_runtime", rt)
    logits, ids, weights = router_inputs(4 * DRAFTS, seed=8)
    padded = forward_batch("TARGET_VERIFY", 4, 4 * DRAFTS)
    route = lambda: rt.route(ids, weights, CONFIG, logits, 0)  # noqa: E731
    monkeypatch.setattr(hooks, "capture_mode_active", lambda: True)
    assert hooks.graph_capture_hook(lambda runner: forward(padded, route), runner_of(False)) is None
    monkeypatch.setattr(hooks, "capture_mode_active", lambda: False)
    real = forward_batch("TARGET_VERIFY", 3, 3 * DRAFTS)
    rerun = lambda runner, batch: forward(padded, route)  # noqa: E731
    assert forward(real, lambda: hooks.graph_execute_hook(rerun, types.SimpleNamespace(bs=4), real)) is None
    assert rt.device is None and rt.skipped == {(VERIFY, "target_verify"): 1} and not rt.applied


def test_startup_line_says_whether_verify_passes_are_routed():
    assert hooks.speculative_note(OEAConfig(k0=K0), None) == ""
    assert "NGRAM: verify passes routed" in hooks.speculative_note(OEAConfig(k0=K0), "NGRAM")
    assert "not routed (--oea-verify off)" in hooks.speculative_note(OEAConfig(k0=K0, verify=False), "EAGLE")


def test_startup_line_says_how_many_verify_requests_the_cap_admits():
    """--oea-max-batch counts rows: under EAGLE with 4 draft tokens, a cap of 128 is 32 requests;
    under adaptive widths, a cap that closes the gate for the wider ones says so."""
    note = hooks.speculative_note(OEAConfig(k0=K0, max_batch=128), "EAGLE", (4,))
    assert "at most 32 requests of 4 draft tokens under the cap" in note and "never route" not in note
    note = hooks.speculative_note(OEAConfig(k0=K0, min_batch=2, max_batch=8), "EAGLE", (1, 2, 4, 6, 8))
    assert "at most 8 requests of 1 draft tokens, 4 requests of 2 draft tokens" in note
    assert ("--oea-max-batch 8 rows is below --oea-min-batch 2 requests x 6, 8 draft tokens: verify passes of that "
            "width never route with OEA (narrower ones still do)") in note


@pytest.mark.parametrize("min_batch,max_batch,widths,refused,warned", [
    (4, 0, (4,), False, False),  # no cap
    (4, 16, (4,), False, False),  # exactly min_batch x width
    (4, 15, (4,), True, False),  # every verify pass closed
    (2, 8, (1, 2, 4, 6, 8), False, True),  # adaptive: 6 and 8 closed, narrower open
    (2, 3, (2, 4), True, False),  # adaptive, every width closed
    (1, 0, (1 << 15,), True, False),  # past the device gate's int32 bound
    (4, 8, (), False, False),  # no speculative decoding
])
def test_verify_cap_problem(min_batch, max_batch, widths, refused, warned):
    refusal, warning = verify_cap_problem(min_batch, max_batch, widths)
    assert (refusal is not None, warning is not None) == (refused, warned), (refusal, warning)


# ----------------------------------------------------------------------------- metrics


class FakeMetric:
    """A prometheus_client Counter / Gauge that keeps its samples: {frozenset(labels): value}."""

    made = {}

    def __init__(self, name, documentation, labelnames, **kwargs):
        self.samples = collections.Counter()
        FakeMetric.made[name] = self

    def labels(self, **labels):
        key, samples = frozenset(labels.items()), self.samples
        samples[key] += 0
        return types.SimpleNamespace(inc=lambda amount=1: samples.update({key: amount}),
                                     set=lambda value: samples.__setitem__(key, value))


@pytest.fixture
def fake_prometheus(monkeypatch):
    import prometheus_client

    monkeypatch.setattr(prometheus_client, "Counter", FakeMetric)
    monkeypatch.setattr(prometheus_client, "Gauge", FakeMetric)
    return FakeMetric.made


BASE_LABELS = {("model_name", "m"), ("tp_rank", "0")}


def labelled(**labels):
    return frozenset(BASE_LABELS | set(labels.items()))


def test_step_counters_carry_the_pass_mode_and_k0(fake_prometheus):
    rt = OEARuntime(OEAConfig(k0=K0), speculative=True)
    export = metrics.PrometheusExport("m", 0, rt.settings, speculative=True)
    applied = fake_prometheus["sglang:oea_decode_steps_applied"].samples
    skipped = fake_prometheus["sglang:oea_decode_steps_skipped"].samples
    assert applied == {labelled(mode="verify", k0="3"): 0}, "the server's routed mode is exported from the start"
    for mode, reason in ((VERIFY, None), (VERIFY, None), (VERIFY, "below_min_batch"), (OTHER, "not_decode")):
        rt.count(mode, reason)
    export.publish(rt, None)
    rt.count(VERIFY, None)
    export.publish(rt, None)
    assert applied == {labelled(mode="verify", k0="3"): 3}
    assert skipped == {labelled(mode="verify", reason="below_min_batch", k0="3"): 1,
                       labelled(mode="other", reason="not_decode", k0="3"): 1}
    assert metrics.summary(rt, None) == "OEA k0=3: applied 3/4 verify steps"
    assert metrics.summary(OEARuntime(OEAConfig(k0=K0)), None) == "OEA k0=3: applied 0/0 decode steps"


def test_settings_gauges_move_when_a_change_is_accepted(fake_prometheus):
    """No decode step needed: the gauges follow an accepted change at once (an idle server too)."""
    rt = OEARuntime(OEAConfig(k0=0, min_batch=1, max_batch=16))
    export = metrics.PrometheusExport("m", 0, rt.settings)
    metrics.follow_settings(rt, export)
    gauges = {field: fake_prometheus[f"sglang:oea_{field}"].samples for field in ("k0", "min_batch", "max_batch")}
    rt.request_settings(LiveSettings(5, 2, 8))
    assert rt.settings.k0 == 0 and rt.pending == LiveSettings(5, 2, 8), "not in force before the next pass"
    assert {field: samples[labelled()] for field, samples in gauges.items()} == {"k0": 5, "min_batch": 2, "max_batch": 8}


def test_steps_are_attributed_to_the_k0_they_ran_with(fake_prometheus):
    """Live settings: each step is counted under the k0 in force when it ran; the gauges and the
    'Decode batch' summary show the settings in force."""
    rt = OEARuntime(OEAConfig(k0=0, min_batch=1, max_batch=16))
    export = metrics.PrometheusExport("m", 0, rt.settings)
    gauges = {field: fake_prometheus[f"sglang:oea_{field}"].samples for field in ("k0", "min_batch", "max_batch")}
    assert {field: samples[labelled()] for field, samples in gauges.items()} == {"k0": 0, "min_batch": 1, "max_batch": 16}
    rt.count(DECODE, "oea_off")
    assert metrics.summary(rt, None) == "OEA k0=0 (off): applied 0/1 decode steps"
    rt.request_settings(LiveSettings(2, 2, 8))
    rt.apply_pending()
    rt.count(DECODE, None)
    rt.count(DECODE, None)
    rt.count(DECODE, "below_min_batch")
    export.publish(rt, None)
    applied = fake_prometheus["sglang:oea_decode_steps_applied"].samples
    skipped = fake_prometheus["sglang:oea_decode_steps_skipped"].samples
    assert applied == {labelled(mode="decode", k0="0"): 0, labelled(mode="decode", k0="2"): 2}
    assert skipped == {labelled(mode="decode", reason="oea_off", k0="0"): 1,
                       labelled(mode="decode", reason="below_min_batch", k0="2"): 1}
    assert {field: samples[labelled()] for field, samples in gauges.items()} == {"k0": 2, "min_batch": 2, "max_batch": 8}
    assert metrics.summary(rt, None) == "OEA k0=2: applied 2/3 decode steps", "the steps that ran with the k0 in force"
