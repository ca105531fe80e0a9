"""OEA's metrics path inside SGLang's scheduler loop (sglang_oea.metrics, hooks.decode_stats_hook),
without a server: a bug or a bad count there costs a metric, never the scheduler; the settings
gauges follow one rule; the step counters carry the k0 each step ran with; a data-parallel
replica's series carry dp_rank.

Prometheus runs for real (prometheus_client, in a registry of the test's own): its Counter raises
on a negative increment, which is how a bad count used to stop the scheduler.
"""

import logging
import types

import pytest
import torch

from gpu.gpu_compare import brute_force_lost_units
from oea_fixtures import NUM_EXPERTS, TOP_K, router_inputs, topk_config
from sglang_oea import hooks, metrics
from sglang_oea.config import LiveSettings, OEAConfig
from sglang_oea.counters import LOST
from sglang_oea.reference import lost_router_mass_units, opportunistic_weights
from sglang_oea.runtime import DECODE, OEARuntime
from test_graph_path import Capture, capture_bucket, replay

LAYERS = (0, 2)
CONFIG = topk_config()
LOST_TOTAL, TOKEN_LAYERS = "sglang:oea_router_mass_lost_total", "sglang:oea_routed_token_layers_total"
APPLIED, KEPT = "sglang:oea_decode_steps_applied_total", "sglang:oea_kept_router_mass"


@pytest.fixture
def registry(monkeypatch):
    """prometheus_client's Counter and Gauge, made in a registry of this test's own; the metrics
    module's process state (the export, the last snapshot reported, what it logged) reset."""
    import prometheus_client

    registry = prometheus_client.CollectorRegistry()
    for kind in ("Counter", "Gauge"):
        cls = getattr(prometheus_client, kind)
        monkeypatch.setattr(prometheus_client, kind, lambda *a, _cls=cls, **kw: _cls(*a, registry=registry, **kw))
    for name, value in (("_export", None), ("_reported", None), ("_logged", set())):
        monkeypatch.setattr(metrics, name, value)
    return registry


def value(registry, name, **labels):
    return registry.get_sample_value(name, dict(model_name="m", tp_rank="0", **labels))


def served(monkeypatch, rt, **server_args):
    """rt as the scheduler's runtime, attached to metrics as Scheduler.__init__'s hook does."""
    monkeypatch.setattr(hooks, "_runtime", rt)
    args = dict(enable_metrics=True, served_model_name="m", model_path="/models/m", **server_args)
    metrics.attach(rt, types.SimpleNamespace(server_args=types.SimpleNamespace(**args)))


def routed_pass(rt, seed, rows=8, while_running=None):
    """One eager decode pass through LAYERS, as the forward-context and routing hooks drive it.
    while_running: called after the last layer, before the pass ends."""
    rt.begin_step(DECODE, rows)
    for layer in LAYERS:
        logits, ids, weights = router_inputs(rows, seed=seed * 10 + layer)
        rt.route(ids, weights, CONFIG, logits, layer)
    if while_running is not None:
        while_running()
    rt.end_step()


def decode_log_step(step=40):
    """SGLang's report_decode_stats at a decode-log step, through OEA's BEFORE hook."""
    hooks.decode_stats_hook(types.SimpleNamespace(forward_ct_decode=step, decode_log_interval=40))


def warnings_like(caplog, text):
    return [r for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


# ----------------------------------------------------------------------------- padded rows


def test_a_nan_in_a_padded_row_leaves_the_lost_column_right(monkeypatch):
    """A graph replay's padded rows hold whatever the buffers held: NaN weights and logits there
    leave every layer's lost column at the real rows' own lost mass (brute force)."""
    capture = Capture(monkeypatch)
    rt = OEARuntime(OEAConfig(k0=3, min_batch=4, max_batch=16, kernel="torch"))
    inputs = {layer: router_inputs(16, seed=20 + layer) for layer in LAYERS}
    capture_bucket(rt, capture, inputs, 16, CONFIG)
    start = rt.counters.table[:, LOST:].clone()
    for logits, _, weights in inputs.values():
        logits[10:], weights[10:] = float("nan"), float("nan")
    out = replay(rt, capture, inputs, 16, 10, CONFIG)
    added = rt.counters.table[:, LOST:] - start
    for layer, (_, ids, weights) in inputs.items():
        got_ids, got_weights = out[layer]
        want, rows = brute_force_lost_units(ids, weights, got_ids, got_weights, NUM_EXPERTS, 10)
        assert 0 < want and abs(int(added[layer, 3]) - want) <= rows, (layer, int(added[layer, 3]), want)
    assert int(added.count_nonzero()) == len(LAYERS), "only the k0 = 3 column of the routed layers moved"


def test_padded_rows_are_left_out_by_selection():
    """The reference's padded rows (rows past a device row count) may hold NaN."""
    _, ids, weights = router_inputs(6, seed=3)
    new_ids, new_weights = ids.flip(1)[:, :TOP_K // 2], weights.flip(1)[:, :TOP_K // 2]
    want = int(lost_router_mass_units(ids[:4], weights[:4], new_ids[:4], new_weights[:4], NUM_EXPERTS))
    weights[4:] = float("nan")
    assert int(lost_router_mass_units(ids, weights, new_ids, new_weights, NUM_EXPERTS, torch.tensor(4))) == want > 0
    scores = torch.rand(2, NUM_EXPERTS)
    scores[1, 5] = float("nan")  # an inactive slot's score
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    active = torch.tensor([[True, True, True], [True, False, True]])
    got = opportunistic_weights(scores, ids, active, torch.ones(2))
    assert bool(got.isfinite().all()) and got[1].tolist()[1] == 0.0 and abs(float(got[1].sum()) - 1) < 1e-6


# ----------------------------------------------------------------------------- bad counts, bugs


def test_a_corrupted_lost_counter_costs_one_interval_never_the_scheduler(monkeypatch, registry, caplog):
    """A lost-mass column that jumps to -2^63 between two reports: the report raises nothing, the
    interval's kept mass is skipped whole (the counters neither go down nor count its tokens), one
    warning line says so, and the next interval is published right again."""
    rt = OEARuntime(OEAConfig(k0=2, min_batch=1, kernel="torch"))
    served(monkeypatch, rt)
    for seed in range(3):
        routed_pass(rt, seed)
    decode_log_step()  # passes 1-2 (the second-newest snapshot)

    def kept_series():
        return tuple(value(registry, name, mode="decode", k0="2") for name in (LOST_TOTAL, TOKEN_LAYERS, KEPT))

    lost, tokens, kept = kept_series()
    assert lost > 0 and tokens == 2 * 8 * len(LAYERS) and 0 < kept < 1
    # The first jump makes the interval's difference wrap to about +2^63, the second one negative.
    for corrupt in range(2):
        rt.counters.table[LAYERS[0], LOST + 2] = -2 ** 63
        for seed in range(2):
            routed_pass(rt, seed)
        with caplog.at_level(logging.WARNING, logger="sglang_oea"):
            decode_log_step()
        assert kept_series() == (lost, tokens, kept), "skipped whole: nothing decreased, nothing half counted"
        routed_pass(rt, 7)  # the next interval (one pass) is clean again
        decode_log_step()
        assert kept_series()[0] > lost and kept_series()[1] == tokens + 8 * len(LAYERS)
        lost, tokens, kept = kept_series()
    assert len(warnings_like(caplog, "skipped the kept router mass at k0=2")) == 1, caplog.text
    assert "layer 0 lost" in caplog.text


def test_a_step_count_that_goes_backwards_never_reaches_the_counter(monkeypatch, registry, caplog):
    rt = OEARuntime(OEAConfig(k0=2, min_batch=1, kernel="torch"))
    served(monkeypatch, rt)
    for seed in range(3):
        routed_pass(rt, seed)
    decode_log_step()
    assert value(registry, APPLIED, mode="decode", k0="2") == 3
    rt.accounts.applied_by_k0[(DECODE, 5)] = float("nan")  # a count no step makes
    rt.accounts.applied_by_k0[(DECODE, 2)] = 1  # backwards
    with caplog.at_level(logging.WARNING, logger="sglang_oea"):
        decode_log_step()
        decode_log_step()
    assert value(registry, APPLIED, mode="decode", k0="2") == 3 and value(registry, APPLIED, mode="decode", k0="5") == 0
    assert len(warnings_like(caplog, f"skipped an increment of {APPLIED} by")) == 1, caplog.text


def test_a_bug_in_the_report_is_logged_once_and_goes_no_further(monkeypatch, registry, caplog):
    rt = OEARuntime(OEAConfig(k0=2, min_batch=1, kernel="torch"))
    served(monkeypatch, rt)
    routed_pass(rt, 1)
    routed_pass(rt, 2)

    def broken(*args, **kwargs):
        raise RuntimeError("a metrics bug")

    monkeypatch.setattr(metrics._export, "publish", broken)
    monkeypatch.setattr(metrics._export, "publish_settings", broken)
    with caplog.at_level(logging.WARNING, logger="sglang_oea"):
        for step in (40, 80):
            decode_log_step(step)
        rt.request_settings(LiveSettings(3, 1, 0))  # the settings listener, inside the live-settings handler
        rt.request_settings(LiveSettings(4, 1, 0))
    assert rt.pending == LiveSettings(4, 1, 0), "the change itself went through"
    failures = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage().split(" failed")[0] for r in failures] == [
        "sglang-oea: the OEA Prometheus export", "sglang-oea: the settings gauges"], caplog.text
    assert all(r.exc_info and "a metrics bug" in str(r.exc_info[1]) for r in failures)
    assert metrics._decode_line.pending.startswith("OEA k0=2: applied 2/2 decode steps"), "the summary still came"


def test_the_rank_check_still_stops_the_server_and_nothing_else_does(monkeypatch, registry, caplog):
    """A rank divergence means wrong outputs: it stops the server by design. A failure anywhere
    else in the hook (here: reading the snapshot on a report-only step) is logged once."""
    from sglang_oea.rank_check import RankDivergenceError

    rt = OEARuntime(OEAConfig(k0=2, min_batch=1, kernel="torch"))
    served(monkeypatch, rt)
    routed_pass(rt, 1)
    routed_pass(rt, 2)

    def diverged(snapshot, step):
        raise RankDivergenceError("ranks routed different experts")

    rt.rank_check = types.SimpleNamespace(due=lambda step: True, check=diverged, checks=0)
    with pytest.raises(RankDivergenceError):
        decode_log_step()
    rt.rank_check = None

    def unreadable():
        raise RuntimeError("the snapshot cannot be read")

    monkeypatch.setattr(rt, "read_snapshot", unreadable)
    with caplog.at_level(logging.WARNING, logger="sglang_oea"):
        decode_log_step(40)
        decode_log_step(80)
    failures = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(failures) == 1 and failures[0].startswith("sglang-oea: the OEA metrics report failed"), caplog.text


# ----------------------------------------------------------------------------- the settings gauges


def settings_gauges(registry):
    return tuple(value(registry, f"sglang:oea_{field}") for field in ("k0", "min_batch", "max_batch"))


def test_settings_gauges_do_not_fall_back_while_a_change_is_pending(monkeypatch, registry):
    """A change accepted during the pass that finishes the last batch stays pending until the next
    pass; the report that runs meanwhile must not put the old settings back on the gauges."""
    rt = OEARuntime(OEAConfig(k0=2, min_batch=1, max_batch=16, kernel="torch"))
    served(monkeypatch, rt)
    routed_pass(rt, 1)
    assert settings_gauges(registry) == (2, 1, 16)
    routed_pass(rt, 2, while_running=lambda: rt.request_settings(LiveSettings(3, 2, 8)))
    assert settings_gauges(registry) == (3, 2, 8), "accepted: the gauges move at once"
    decode_log_step()  # no pass has begun since: the change is still pending
    assert rt.settings.k0 == 2 and rt.pending == LiveSettings(3, 2, 8)
    assert settings_gauges(registry) == (3, 2, 8), "the report put the settings in force back"
    routed_pass(rt, 3)
    decode_log_step(80)
    assert rt.pending is None and settings_gauges(registry) == (3, 2, 8)
    assert value(registry, APPLIED, mode="decode", k0="2") == 2 and value(registry, APPLIED, mode="decode", k0="3") == 1


# ----------------------------------------------------------------------------- labels


def test_steps_published_after_a_change_keep_the_k0_they_ran_with(monkeypatch, registry):
    """Steps at k0=2 that no report has published yet when k0 changes are published after it,
    under k0=2; the kept-mass counters alike."""
    rt = OEARuntime(OEAConfig(k0=2, min_batch=1, kernel="torch"))
    served(monkeypatch, rt)
    routed_pass(rt, 1)
    routed_pass(rt, 2)
    decode_log_step()  # the step counts of passes 1-2; the kept mass of pass 1 (the second-newest snapshot)
    for seed in (3, 4):
        routed_pass(rt, seed)  # unpublished steps at k0 = 2
    rt.request_settings(LiveSettings(3, 1, 0))
    for seed in (5, 6, 7):
        routed_pass(rt, seed)
    decode_log_step(80)
    assert value(registry, APPLIED, mode="decode", k0="2") == 4
    assert value(registry, APPLIED, mode="decode", k0="3") == 3
    assert value(registry, TOKEN_LAYERS, mode="decode", k0="2") == 4 * 8 * len(LAYERS)
    assert value(registry, TOKEN_LAYERS, mode="decode", k0="3") == 2 * 8 * len(LAYERS), "up to the second-newest pass"


def test_a_replicas_series_carry_its_dp_rank(monkeypatch, registry):
    """--dp-size > 1: every OEA series of replica 1 carries dp_rank="1" (replicas' TP ranks both
    count from 0: without it their series would merge in Prometheus' multiprocess mode)."""
    rt = OEARuntime(OEAConfig(k0=2, min_batch=1, kernel="torch"), dp_rank=1)
    served(monkeypatch, rt)
    for seed in range(3):
        routed_pass(rt, seed)
    decode_log_step()
    samples = [s for family in registry.collect() for s in family.samples if s.name.startswith("sglang:oea_")]
    assert {s.name for s in samples} >= {APPLIED, LOST_TOTAL, KEPT, "sglang:oea_k0", "sglang:oea_kernel_info"}
    assert all(s.labels.get("dp_rank") == "1" and s.labels["tp_rank"] == "0" for s in samples), samples
    assert registry.get_sample_value(APPLIED, dict(model_name="m", tp_rank="0", dp_rank="1", mode="decode", k0="2")) == 3
