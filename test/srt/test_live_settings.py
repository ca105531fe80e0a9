"""Live OEA settings: POST /set_internal_state {"server_args": {"oea_k0": ..., "oea_min_batch": ...,
"oea_max_batch": ...}} on a running server (sglang_oea.live_settings).

Unit tests of the rules and of the handlers inside SGLang's own SchedulerInternalStateController
(no server), then one shared CPU server for the end-to-end tests: the trained Qwen3-MoE in float32,
started armed and off (--oea-k0 0), with --oea-min-batch 1 so that single requests are routed.
Its greedy outputs with OEA off are compared with transformers' greedy decoding, which
test_server_e2e proves equal to plain SGLang's on the same checkpoint and prompts.
"""

import asyncio
import json
import logging
import re
import time
import types
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from sglang_oea import hooks, live_settings
from sglang_oea.config import LiveSettings, OEAConfig
from sglang_oea.live_settings import SettingRefused, check_request
from sglang_oea.routers import RouterChoice
from test_server_e2e import (FP32, PROMPTS, TOP_K, TRAINED, complete, greedy_ids, heldout_prompts, oea_value, scrape, serve,
                             transformers_greedy)

STARTUP = OEAConfig(k0=0, min_batch=2, max_batch=32)  # the envelope: 2 <= min_batch, max_batch <= 32


class FakeRuntime:
    """What the handlers read of OEARuntime: its startup config, the settings in force, the
    pending change, and request_settings."""

    def __init__(self, cfg=STARTUP):
        self.cfg, self.settings, self.pending, self.requested = cfg, cfg.live(), None, []
        self.routers, self.world_size, self.verify_widths = RouterChoice(cfg.kernel, cfg.k0), 1, ()

    def request_settings(self, new):
        self.requested.append(new)
        self.pending = new


# ----------------------------------------------------------------------------- the rules


def test_a_request_is_merged_into_the_current_settings():
    current = LiveSettings(0, 2, 32)
    assert check_request(current, {"oea_k0": 4}, STARTUP) == LiveSettings(4, 2, 32)
    assert check_request(current, {"oea_k0": 0, "oea_min_batch": 8, "oea_max_batch": 16}, STARTUP) == LiveSettings(0, 8, 16)
    assert check_request(current, {"oea_k0": 64}, STARTUP).k0 == 64, "k0 >= top-k is a no-op, as with the flag"


def test_the_whole_request_is_checked_across_keys():
    """min 8 with the max in force (4) would be refused alone; with max 16 in the same request it is
    allowed, whatever the key order. The reverse: each key fine alone, together refused."""
    narrow = LiveSettings(1, 2, 4)
    assert check_request(narrow, {"oea_min_batch": 8, "oea_max_batch": 16}, STARTUP) == LiveSettings(1, 8, 16)
    with pytest.raises(SettingRefused, match=r"oea_max_batch must be 0 \(no cap\) or >= oea_min_batch \(8\), got 4"):
        check_request(narrow, {"oea_min_batch": 8}, STARTUP)
    with pytest.raises(SettingRefused, match=r"in force after this request: oea_min_batch 20, oea_max_batch 10"):
        check_request(LiveSettings(1, 2, 32), {"oea_min_batch": 20, "oea_max_batch": 10}, STARTUP)


@pytest.mark.parametrize("requested,reason", [
    ({"oea_k0": -1}, r"oea_k0 must be an integer from 0 to 64, got -1 \(0 = OEA off\)"),
    ({"oea_k0": 2.5}, r"oea_k0 must be an integer from 0 to 64, got 2.5"),
    ({"oea_k0": 3.0}, r"oea_k0 must be an integer from 0 to 64, got 3.0"),
    ({"oea_k0": True}, r"oea_k0 must be an integer from 0 to 64, got True"),
    ({"oea_min_batch": 0}, r"oea_min_batch must be an integer from 1 to 65536, got 0"),
    ({"oea_max_batch": -2}, r"oea_max_batch must be an integer from 0 to 65536, got -2 \(0 = no cap\)"),
    ({"oea_k0": 2, "oea_max_batch": 1.5}, r"oea_max_batch must be an integer from 0 to 65536, got 1.5"),
    ({"oea_k0": 2 ** 31}, r"oea_k0 must be an integer from 0 to 64, got 2147483648 \(0 = OEA off\)"),
    ({"oea_k0": 65}, r"oea_k0 must be an integer from 0 to 64, got 65"),
    ({"oea_min_batch": 2 ** 40}, r"oea_min_batch must be an integer from 1 to 65536, got 1099511627776"),
    ({"oea_min_batch": 1}, r"oea_min_batch must be >= 2, the server's --oea-min-batch, got 1 \(CUDA graphs were "
                           r"captured without OEA routing .*restart with a wider --oea-min-batch / --oea-max-batch"),
    ({"oea_max_batch": 64}, r"oea_max_batch must be between oea_min_batch and 32, the server's --oea-max-batch "
                            r"\(0, no cap, is outside it\), got 64 \(CUDA graphs"),
    ({"oea_max_batch": 0}, r"oea_max_batch must be between oea_min_batch and 32.* got 0 "),
])
def test_refusals_name_the_key_the_value_and_what_is_allowed(requested, reason):
    with pytest.raises(SettingRefused) as exc:
        check_request(LiveSettings(0, 2, 32), requested, STARTUP)
    message = str(exc.value)
    assert message.startswith(f"sglang-oea: refused {json.dumps(requested)}: ")
    assert message.endswith("; nothing changed")
    assert re.search(reason, message), message


def test_an_uncapped_server_takes_any_cap_and_none():
    uncapped = OEAConfig(k0=4, min_batch=1)
    assert check_request(uncapped.live(), {"oea_max_batch": 512}, uncapped).max_batch == 512
    assert check_request(LiveSettings(4, 1, 512), {"oea_max_batch": 0}, uncapped).max_batch == 0


def test_server_info_state_has_the_settings_the_pending_change_and_the_envelope():
    runtime = FakeRuntime()
    assert live_settings.state_of(runtime) == {
        "k0": 0, "min_batch": 2, "max_batch": 32, "envelope": {"min_batch": 2, "max_batch": 32}, "verify": True,
        "kernel": {"flag": "auto", "paths": [{"router": "auto", "self_check": "pending", "shapes": 0}], "tp_size": 1}}
    runtime.routers.decisions = {"shape a": ("torch", "not_run"), "shape b": ("torch", "not_run")}
    assert live_settings.state_of(runtime)["kernel"]["paths"] == [{"router": "torch", "self_check": "not_run", "shapes": 2}]
    runtime.pending = LiveSettings(3, 4, 16)
    assert live_settings.state_of(runtime)["pending"] == {"k0": 3, "min_batch": 4, "max_batch": 16}


# ----------------------------------------------------------------------------- inside SGLang's controller


@pytest.fixture
def controller(monkeypatch):
    """SGLang's SchedulerInternalStateController with OEA's hooks as a scheduler process has them
    (applied by hand: HookRegistry patches only scheduler processes), on a FakeRuntime."""
    from sglang.srt.managers.scheduler_components.internal_state import SchedulerInternalStateController

    runtime = FakeRuntime()
    monkeypatch.setattr(hooks, "ensure_runtime", lambda: runtime)
    state = SchedulerInternalStateController(scheduler=None, record_step_time=False)

    def update_handlers(self):
        handlers = SchedulerInternalStateController._update_handlers(self)
        hooks.update_handlers_hook(handlers, self)
        return handlers

    state._update_handlers = types.MethodType(update_handlers, state)
    set_state = SchedulerInternalStateController.set_internal_state
    state.post = lambda args: hooks.set_internal_state_hook(set_state, state, request(args)).updated
    state.runtime = runtime
    return state


def request(server_args):
    from sglang.srt.managers.io_struct import SetInternalStateReq

    return SetInternalStateReq(server_args=server_args)


def test_an_accepted_request_is_requested_once_and_never_overrides_server_args(controller, monkeypatch):
    overrides = []
    monkeypatch.setattr("sglang.srt.managers.scheduler_components.internal_state.get_context",
                        lambda: types.SimpleNamespace(override=lambda **kw: overrides.append(kw)))
    assert controller.post({"oea_max_batch": 16, "oea_k0": 4, "oea_min_batch": 8}) is True
    assert controller.runtime.requested == [LiveSettings(4, 8, 16)]
    assert controller.post({"oea_k0": 1}) is True
    assert controller.runtime.requested[-1] == LiveSettings(1, 8, 16), "merged into the pending change"
    assert overrides == [], "the oea_* keys are not ServerArgs fields"


def test_a_live_cap_no_verify_pass_can_pass_is_refused_as_at_startup():
    """Under speculative decoding the cap counts rows: 8 rows under 4 requests x 4 draft tokens
    closes every verify pass, which the startup check refuses too."""
    with pytest.raises(SettingRefused, match=r'refused \{"oea_max_batch": 8\}: oea_max_batch 8 rows is below '
                       r"oea_min_batch 4 requests x 4 draft tokens, so OEA would apply in no verify pass; give "
                       r"oea_max_batch at least 16"):
        check_request(LiveSettings(3, 4, 32), {"oea_max_batch": 8}, STARTUP, widths=(4,))
    assert check_request(LiveSettings(3, 4, 32), {"oea_max_batch": 16}, STARTUP, widths=(4,)).max_batch == 16
    assert check_request(LiveSettings(3, 4, 32), {"oea_max_batch": 8}, STARTUP).max_batch == 8, "no speculation"


def test_a_live_cap_that_closes_some_adaptive_widths_is_accepted_with_a_warning(caplog):
    runtime = FakeRuntime()
    runtime.verify_widths = (1, 2, 4, 6, 8)
    handler = live_settings.handlers(runtime)["oea_max_batch"]
    with caplog.at_level(logging.WARNING, logger="sglang_oea"):
        handler.validate("oea_max_batch", 8)
        handler.apply("oea_max_batch", 8)
    assert runtime.requested == [LiveSettings(0, 2, 8)]
    assert ("sglang-oea: accepted, but oea_max_batch 8 rows is below oea_min_batch 2 requests x 6, 8 draft tokens: "
            "verify passes of that width never route with OEA") in caplog.text


def test_a_refused_request_changes_nothing_and_logs_one_line(controller, caplog):
    with caplog.at_level(logging.WARNING):
        assert controller.post({"oea_k0": 4, "oea_min_batch": 8, "oea_max_batch": 64}) is False
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ['sglang-oea: refused {"oea_k0": 4, "oea_min_batch": 8, "oea_max_batch": 64}: oea_max_batch must '
                     "be between oea_min_batch and 32, the server's --oea-max-batch (0, no cap, is outside it), got 64 "
                     "(CUDA graphs were captured without OEA routing for batch sizes outside the startup window; restart "
                     "with a wider --oea-min-batch / --oea-max-batch to widen it); nothing changed"]
    assert controller.post({"oea_k0": 4, "no_such_setting": 1}) is False, "SGLang refuses a key it has no handler for"
    assert controller.runtime.requested == []


@pytest.mark.parametrize("server_args", [
    {"oea_k0": 4, "pp_max_micro_batch_size": 2},
    {"pp_max_micro_batch_size": 2, "oea_k0": 4, "oea_min_batch": 8},  # SGLang's key validated first, and passes
])
def test_oea_keys_mixed_with_sglang_keys_are_refused_whole(controller, monkeypatch, caplog, server_args):
    """A replica checks pp_max_micro_batch_size against its own max_running_requests, so a mixed
    request could land on some replicas only: refused whole, on every one, whatever each holds.
    Here SGLang's key alone is valid (and accepted: last)."""
    internal_state = "sglang.srt.managers.scheduler_components.internal_state"
    overrides = []
    monkeypatch.setattr(f"{internal_state}.get_context",
                        lambda: types.SimpleNamespace(override=lambda **kw: overrides.append(kw)))
    monkeypatch.setattr(f"{internal_state}.get_parallel", lambda: types.SimpleNamespace(pp_size=1))
    controller.scheduler = types.SimpleNamespace(max_running_requests=8)
    with caplog.at_level(logging.WARNING):
        assert controller.post(server_args) is False
    oea = {key: value for key, value in server_args.items() if key.startswith("oea_")}
    assert [r.getMessage() for r in caplog.records] == [
        f"sglang-oea: refused {json.dumps(oea)} sent with pp_max_micro_batch_size: the oea_* keys cannot share a "
        "request with other keys: data-parallel replicas check some of SGLang's keys against their own state, so "
        "one request could change some replicas and not others; send the oea_* keys and the others in separate "
        "requests; nothing changed"]
    assert controller.runtime.requested == [] and overrides == [], "nothing applied"
    assert controller.post(oea) is True and controller.post({"pp_max_micro_batch_size": 2}) is True, "sent apart"
    assert controller.runtime.requested[-1].k0 == 4 and overrides[-1]["pp_max_micro_batch_size"] == 2


def test_a_server_without_oea_refuses_the_keys_with_advice(controller, monkeypatch, caplog):
    monkeypatch.setattr(hooks, "ensure_runtime", lambda: None)
    with caplog.at_level(logging.WARNING):
        assert controller.post({"oea_k0": 4}) is False
    assert caplog.records[-1].getMessage() == (
        'sglang-oea: refused {"oea_k0": 4}: OEA is not installed on this server (it was started without --oea-k0); '
        "start the server with --oea-k0 0 to arm OEA without turning it on")


def test_engine_settings_are_checked_before_they_are_sent():
    sent = []

    async def set_internal_state(req):
        sent.append(dict(req.server_args))
        return [True]

    engine = types.SimpleNamespace(loop=asyncio.new_event_loop(),
                                   tokenizer_manager=types.SimpleNamespace(set_internal_state=set_internal_state))
    assert live_settings.set_engine_settings(engine, oea_k0=4, oea_max_batch=16) == [True]
    assert sent == [{"oea_k0": 4, "oea_max_batch": 16}]
    for bad in ({"oea_k0": True}, {"oea_min_batch": 2.0}, {}):
        with pytest.raises(ValueError, match="oea_k0 must be|oea_min_batch must be|give at least one of"):
            live_settings.set_engine_settings(engine, **bad)
    assert len(sent) == 1
    engine.loop.close()


# ----------------------------------------------------------------------------- one live server

ADMIN_KEY = "oea-live-settings-test"
MODEL = TRAINED["qwen3_moe_trained"]
SERVER_FLAGS = (*FP32, "--oea-k0", "0", "--oea-min-batch", "1", "--oea-max-batch", "32", "--enable-metrics",
                "--decode-log-interval", "1", "--admin-api-key", ADMIN_KEY)
APPLIED, SKIPPED = "sglang:oea_decode_steps_applied_total", "sglang:oea_decode_steps_skipped_total"
ARMED = {"k0": 0, "min_batch": 1, "max_batch": 32, "verify": True, "model": {"num_experts": 128, "top_k": TOP_K}}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Held-out prompts and plain SGLang's greedy ids for them: transformers' greedy decoding in
    float32, which test_server_e2e proves equal to plain SGLang's on this checkpoint."""
    prompts = heldout_prompts(MODEL)
    return {"prompts": prompts, "ids": transformers_greedy(MODEL, prompts)}


@pytest.fixture(scope="module")
def live(tmp_path_factory, plain):
    """The shared server: armed and off, every single request routed once k0 is set, the gate's
    cap at 32 (the envelope), the admin key required to change settings."""
    with serve(tmp_path_factory, MODEL, *SERVER_FLAGS) as running:
        yield running


def set_live(base, settings, key=ADMIN_KEY):
    """POST /set_internal_state: (HTTP status, the decoded answer)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(base + "/set_internal_state", json.dumps({"server_args": settings}).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def sglang_state(base, key):
    """A key of SGLang's own /server_info internal state (rank 0)."""
    return json.loads(urllib.request.urlopen(base + "/server_info", timeout=30).read())["internal_states"][0][key]


def oea_state(base, kernel=False):
    """/server_info's OEA state; without its "kernel" part unless asked (it changes as routing
    shapes are first seen)."""
    info = json.loads(urllib.request.urlopen(base + "/server_info", timeout=30).read())
    state = info["internal_states"][0]["oea"]
    return state if kernel else {key: value for key, value in state.items() if key != "kernel"}


def change(base, **settings):
    """Set live settings; the reply and /server_info confirm them (in force, or pending until
    the next forward pass)."""
    assert set_live(base, settings) == (200, [True])
    state = oea_state(base)
    requested = state.get("pending", state)
    assert all(requested[key[len("oea_"):]] == value for key, value in settings.items()), state


def applied_steps(metrics, **labels):
    return oea_value(metrics, APPLIED, **labels)


CHANGE_LINE = re.compile(r"sglang-oea rank (\d+): settings (k0=\d+ min_batch=\d+ max_batch=\d+) -> "
                         r"(k0=\d+ min_batch=\d+ max_batch=\d+) from routed step (\d+)")


def changes_logged(log):
    """[(rank, old, new, routed step)] of the runtime's settings-change lines, in log order."""
    return [(m.group(1), m.group(2), m.group(3), int(m.group(4))) for m in CHANGE_LINE.finditer(open(log).read())]


@pytest.mark.server
def test_off_on_off_changes_routing_and_only_while_on(live, plain):
    base, log = live
    assert oea_state(base) == {**ARMED, "envelope": {"min_batch": 1, "max_batch": 32}}
    start = scrape(base)
    assert greedy_ids(base, plain["prompts"]) == plain["ids"], "armed and off: plain SGLang's output"
    off = scrape(base)
    assert applied_steps(off) == applied_steps(start) == 0
    assert oea_value(off, SKIPPED, reason="oea_off", k0="0") > 0 and oea_value(off, "sglang:oea_k0") == 0

    change(base, oea_k0=1)
    assert oea_value(scrape(base), "sglang:oea_k0") == 1, "the gauge moves when the change is accepted, idle or not"
    assert greedy_ids(base, plain["prompts"]) != plain["ids"], "k0=1 at min-batch 1 prunes every request"
    on = scrape(base)
    assert oea_state(base) == {**ARMED, "k0": 1, "envelope": {"min_batch": 1, "max_batch": 32}}, "no change pending"
    assert oea_state(base, kernel=True)["kernel"] == {
        "flag": "auto", "paths": [{"router": "torch", "self_check": "not_run", "shapes": 1}], "tp_size": 1}
    assert applied_steps(on, k0="1") > 40
    assert (oea_value(on, "sglang:oea_k0"), oea_value(on, "sglang:oea_max_batch")) == (1, 32)
    assert_kept_router_mass_moved(on, log)

    change(base, oea_k0=0)
    assert greedy_ids(base, plain["prompts"]) == plain["ids"], "off again: plain SGLang's output"
    again = scrape(base)
    assert oea_value(again, "sglang:oea_k0") == 0 and oea_state(base)["k0"] == 0
    assert "OEA armed, off (k0=0) until POST /set_internal_state" in open(log).read()
    on_at, off_at = [(old, new, step) for _, old, new, step in changes_logged(log)]
    assert on_at[:2] == ("k0=0 min_batch=1 max_batch=32", "k0=1 min_batch=1 max_batch=32")
    assert off_at[:2] == ("k0=1 min_batch=1 max_batch=32", "k0=0 min_batch=1 max_batch=32")
    # Exactly the routed steps between the two changes applied OEA: none while off. (A step is
    # published just after its token is streamed, so `on` may lack the last one; `again` has it.)
    assert applied_steps(again) == applied_steps(again, k0="1") == off_at[2] - on_at[2]
    assert oea_value(again, SKIPPED, reason="oea_off") - oea_value(on, SKIPPED, reason="oea_off") >= 80
    # The last k0=1 step's kept mass is reported during the k0=0 requests (see assert_kept_router_mass_is_one).
    assert_kept_router_mass_is_one(again, k0="0")


KEPT, LAYER_KEPT = "sglang:oea_kept_router_mass", "sglang:oea_layer_kept_router_mass"
LOST, TOKEN_LAYERS = "sglang:oea_router_mass_lost_total", "sglang:oea_routed_token_layers_total"


def assert_kept_router_mass_moved(metrics, log):
    """k0 = 1 on single requests: every MoE layer keeps less than the router's whole choice, in the
    per-layer and whole-model gauges, in the counters and in the decode log line."""
    layers = [v for (name, labels), v in metrics.items() if name == LAYER_KEPT and ("k0", "1") in labels]
    assert len(layers) >= 2 and all(0 < v < 1 for v in layers), layers
    kept = oea_value(metrics, KEPT, k0="1", mode="decode")
    assert 0 < kept < 1 and min(layers) <= kept <= max(layers)
    assert oea_value(metrics, LOST, k0="1") > 0 and oea_value(metrics, TOKEN_LAYERS, k0="1") >= 40 * len(layers)
    line = re.search(r"OEA k0=1: applied .*, kept router mass (0\.\d+) \(lowest layer (0\.\d+)\)", open(log).read())
    assert line and float(line.group(2)) <= float(line.group(1)) < 1, "the decode log line carries it"


def assert_kept_router_mass_is_one(metrics, k0):
    """Where OEA changed nothing, the signal is exactly 1.0: no router mass was lost.

    On this server (eager passes) a step at k0 0 or >= top-k launches no routing, so nothing ever
    writes its k0's lost column: what can break is attribution. A report publishes the kept mass
    of the routed steps up to the second-newest snapshot (sglang_oea.counters), so the last step
    before a change is reported after it, while the new k0 is in force. The callers change from
    k0=1 (every step loses mass) to `k0`: a lossy step filed under the k0 in force at its report,
    not the k0 it ran with, shows here as lost mass under `k0`."""
    assert oea_value(metrics, TOKEN_LAYERS, k0=k0) > 0, "the steps were counted"
    assert oea_value(metrics, LOST, k0=k0) == 0 and oea_value(metrics, KEPT, k0=k0) == 1.0
    layers = [v for (name, labels), v in metrics.items() if name == LAYER_KEPT and ("k0", k0) in labels]
    assert layers and all(v == 1.0 for v in layers)


@pytest.mark.server
def test_k0_at_least_top_k_set_live_is_identical_to_plain(live, plain):
    """k0 = the model's top-k, set live: a no-op, plain SGLang's greedy output, and no router mass
    lost (the change comes from k0=1, whose last step is reported at top-k)."""
    base, _ = live
    change(base, oea_k0=1)
    complete(base, PROMPTS[0], 6, ignore_eos=True)
    change(base, oea_k0=TOP_K)
    assert greedy_ids(base, plain["prompts"]) == plain["ids"]
    assert oea_state(base)["k0"] == TOP_K
    change(base, oea_k0=0)
    complete(base, PROMPTS[0], 4)  # the k0 = top-k steps reach /metrics behind later ones
    assert_kept_router_mass_is_one(scrape(base), k0=str(TOP_K))


BAD = [
    {"oea_k0": -1}, {"oea_k0": 2.5}, {"oea_k0": 3.0}, {"oea_min_batch": 0},
    {"oea_min_batch": 8, "oea_max_batch": 4},  # max below min
    {"oea_max_batch": 64}, {"oea_max_batch": 0},  # outside the startup cap of 32
    {"oea_k0": 2, "oea_min_batch": 4, "oea_max_batch": 1.5},  # one bad key among good ones
    {"pp_max_micro_batch_size": 1, "oea_k0": 2},  # with one of SGLang's keys (valid alone): refused whole
    {"no_such_setting": 1},  # a key SGLang has no handler for: SGLang's own refusal
    {"oea_k0": 2 ** 31}, {"oea_min_batch": 2 ** 40},  # past the int32 control block: refused, not a crash
]


@pytest.mark.server
def test_bad_values_are_refused_and_change_nothing(live):
    base, log = live
    before, micro_batch = oea_state(base), sglang_state(base, "pp_max_micro_batch_size")
    for settings in BAD:
        assert set_live(base, settings) == (200, [False]), settings
    for settings in ({"oea_k0": "four"}, {"oea_k0": None}):
        status, body = set_live(base, settings)
        assert status == 400 and "Input should be a valid" in body, "SGLang's request parsing refuses a non-number"
    assert oea_state(base) == before and sglang_state(base, "pp_max_micro_batch_size") == micro_batch
    assert complete(base, PROMPTS[0], 4)["usage"]["completion_tokens"] == 4, "still serving"
    text = open(log).read()
    assert text.count("sglang-oea: refused ") == len(BAD) - 1, "one line per refused request (SGLang's own for one)"
    assert 'sglang-oea: refused {"oea_k0": 2147483648}: oea_k0 must be an integer from 0 to 64' in text
    assert ('sglang-oea: refused {"oea_k0": 2, "oea_min_batch": 4, "oea_max_batch": 1.5}: oea_max_batch must be an '
            "integer from 0 to 65536, got 1.5 (0 = no cap); nothing changed") in text
    assert "oea_max_batch must be between oea_min_batch and 32, the server's --oea-max-batch" in text
    assert "Updating no_such_setting is not supported." in text
    assert ('sglang-oea: refused {"oea_k0": 2} sent with pp_max_micro_batch_size: the oea_* keys cannot share a '
            "request with other keys") in text and "send the oea_* keys and the others in separate requests" in text


@pytest.mark.server
def test_json_booleans_and_numeric_strings_arrive_as_integers(live):
    """What SGLang's request parsing (pydantic, lax) does before any handler sees the request:
    JSON true becomes 1 and "2" becomes 2, both then accepted as integers."""
    base, _ = live
    for sent, arrives in ((True, 1), ("2", 2), (False, 0)):
        assert set_live(base, {"oea_k0": sent}) == (200, [True])
        state = oea_state(base)
        assert state.get("pending", state)["k0"] == arrives
    complete(base, PROMPTS[0], 2)  # a forward pass applies the last one
    assert oea_state(base) == {**ARMED, "envelope": {"min_batch": 1, "max_batch": 32}}


@pytest.mark.server
def test_changes_need_the_admin_key(live):
    base, _ = live
    before = oea_state(base)
    assert set_live(base, {"oea_k0": 2}, key=None)[0] == 401
    assert set_live(base, {"oea_k0": 2}, key="not-the-key")[0] == 401
    assert oea_state(base) == before


@pytest.mark.server
def test_changes_under_load_lose_no_token(live):
    """16 requests in flight across three changes of k0 and the gate: every request gets all its
    tokens, and each change is in force from the pass after it was accepted. The requests are
    long enough (255 decode steps) to outlast the three changes many times over: each change
    waits for a few decode steps, polled (a step at batch 16 took about 15 ms on the 2-core CI machine,
    2026-12-05)."""
    base, log = live
    tokens, changes = 256, [{"oea_k0": 2}, {"oea_k0": 0, "oea_max_batch": 8}, {"oea_k0": 3, "oea_min_batch": 4, "oea_max_batch": 32}]
    logged = len(changes_logged(log))
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(complete, base, f"{PROMPTS[i % 4]} {i}", tokens, ignore_eos=True) for i in range(16)]
        for settings in changes:
            wait_for_decode_steps(base, 4)
            assert not all(f.done() for f in futures), "the change must land while requests are in flight"
            change(base, **settings)
        results = [f.result() for f in futures]
    assert all(r["usage"]["completion_tokens"] == tokens and r["choices"][0]["finish_reason"] == "length"
               for r in results)
    # The last change may have been accepted during the pass that finished the last requests: it
    # is then pending, by design, until the next pass. One more request runs that pass.
    complete(base, PROMPTS[0], 2)
    assert oea_state(base) == {**ARMED, "k0": 3, "min_batch": 4, "envelope": {"min_batch": 1, "max_batch": 32}}
    news = [new for _, _, new, _ in changes_logged(log)[logged:]]
    assert news == ["k0=2 min_batch=1 max_batch=32", "k0=0 min_batch=1 max_batch=8", "k0=3 min_batch=4 max_batch=32"]
    change(base, oea_k0=0, oea_min_batch=1, oea_max_batch=32)
    complete(base, PROMPTS[0], 2)  # in force again: no change left pending for what runs next


def wait_for_decode_steps(base, count, timeout=120):
    """Until `count` more decode steps were counted (applied or skipped)."""
    def steps():
        metrics = scrape(base)
        return oea_value(metrics, APPLIED, mode="decode") + oea_value(metrics, SKIPPED, mode="decode")

    start, deadline = steps(), time.time() + timeout
    while steps() < start + count:
        assert time.time() < deadline, "no decode progress"
        time.sleep(0.2)
