"""OEA on prefill/decode-disaggregated servers (`--disaggregation-mode prefill|decode`), on the CPU.

A decode server's requests arrive with their KV cache transferred by a prefill server. SGLang
0.5.23 admits them in a PREBUILT batch that never enters a model forward (the scheduler answers
it without one, or runs the inner IDLE batch that DP attention needs), merges them into its
running batch, and from then on runs ordinary DECODE passes (TARGET_VERIFY and draft passes under
speculative decoding) through the same ModelRunner, forward context and decode CUDA-graph runner
as a server that does both. So the plugin's pass detection is what these tests drive, with the
ForwardMode values such a server's batches carry, through the plugin's hooks, as
test_verify_routing.py does. The KV transfer backends (Mooncake, NIXL, ...) need RDMA and cannot
run here; docs/scale-out.md says what is only read.

One server test runs a real decode server on the CPU engine with SGLang's `fake` transfer backend
(its own test backend: every transfer "succeeds" at once and moves nothing), so the requests go
through the decode server's whole admission path (pre-allocation, transfer queue, PREBUILT batch,
merge into the running batch) into its decode passes. Its outputs are meaningless (no KV cache
arrives), so only the mechanics are checked, never the tokens.
"""

import contextlib
import json
import logging
import types
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from oea_fixtures import assert_reference_routing, router_inputs, topk_config
from sglang_oea import flags, hooks
from sglang_oea.config import OEAConfig
from sglang_oea.passes import SKIP_NOT_DECODE
from sglang_oea.runtime import DECODE, DRAFT, OTHER, VERIFY, OEARuntime
from test_server_e2e import TRAINED, oea_value, post, scrape, scrape_until, serve
from test_verify_routing import forward_batch

K0, REQUESTS, DRAFTS = 3, 4, 4
CONFIG = topk_config()


def scheduler_runtime(monkeypatch, speculative=False):
    """The runtime of a decode server's scheduler process, eager (no graph capture), every batch
    of 2 or more requests routed."""
    rt = OEARuntime(OEAConfig(k0=K0, min_batch=2), speculative=speculative)
    monkeypatch.setattr(hooks, "_runtime", rt)
    monkeypatch.setattr(hooks, "capture_mode_active", lambda: False)
    return rt


@pytest.fixture
def runtime(monkeypatch):
    return scheduler_runtime(monkeypatch)


def one_pass(rt, batch, rows, seed=0):
    """One pass of `batch` through SGLang's forward context (hooked), one MoE layer routed inside:
    (the pass mode OEA saw, (logits, ids, weights), what the routing hook returned)."""
    inputs = router_inputs(rows, seed=seed)
    logits, ids, weights = inputs
    with hooks.forward_context_hook(lambda ctx, forward_batch=None: contextlib.nullcontext(), None, forward_batch=batch):
        return rt.step.mode, inputs, rt.route(ids, weights, CONFIG, logits, 0)


def test_a_decode_servers_decode_batches_are_routed_as_on_any_server(runtime):
    """After the PREBUILT batch merged into the running batch, a decode server's batches are
    DECODE passes of the running requests: routed over every row, like the reference."""
    mode, (logits, ids, weights), routed = one_pass(runtime, forward_batch("DECODE", REQUESTS, REQUESTS), REQUESTS)
    assert mode == DECODE
    assert_reference_routing(routed, logits, ids, weights, K0, REQUESTS)
    assert runtime.applied == {DECODE: 1} and not runtime.skipped


@pytest.mark.parametrize("mode_name", ["PREBUILT", "IDLE"])
def test_prebuilt_and_idle_passes_are_never_routed(runtime, mode_name):
    """PREBUILT stands for the requests whose KV cache just arrived (it never reaches the model in
    0.5.23; if it did, it would not be routed); IDLE is DP attention's empty batch."""
    mode, _, routed = one_pass(runtime, forward_batch(mode_name, 0, REQUESTS), REQUESTS)
    assert (mode, routed) == (OTHER, None)
    assert not runtime.applied and runtime.skipped == {(OTHER, SKIP_NOT_DECODE): 1}
    assert runtime.routed_steps == 0, "not a decode step: the rank check and the step counts skip it"


def test_sglang_answers_a_prebuilt_batch_without_a_forward_pass():
    """SGLang's own decode-server handler of a PREBUILT batch: no model forward, or the inner IDLE
    batch only (DP attention), which the test above shows is never routed."""
    from sglang.srt.disaggregation.decode import SchedulerDisaggregationDecodeMixin

    ran = []
    scheduler = types.SimpleNamespace(run_batch=lambda batch: ran.append(batch) or "idle result")
    prebuilt = types.SimpleNamespace(inner_idle_batch=None)
    result = SchedulerDisaggregationDecodeMixin._run_batch_prebuilt(scheduler, prebuilt)
    assert ran == [] and type(result).__name__ == "GenerationBatchResult"
    idle = types.SimpleNamespace(forward_mode="IDLE")
    prebuilt.inner_idle_batch = idle
    assert SchedulerDisaggregationDecodeMixin._run_batch_prebuilt(scheduler, prebuilt) == "idle result"
    assert ran == [idle] and prebuilt.inner_idle_batch is None


def test_a_speculative_decode_server_routes_its_verify_passes_only(monkeypatch):
    """Under speculative decoding a decode server receives the draft's first tokens with the KV
    cache; then its target model decodes in TARGET_VERIFY passes (routed, rows = requests x draft
    tokens), and its draft passes (DECODE and DRAFT_EXTEND_V2) are left alone."""
    rt = scheduler_runtime(monkeypatch, speculative=True)
    rows = REQUESTS * DRAFTS
    mode, (logits, ids, weights), routed = one_pass(rt, forward_batch("TARGET_VERIFY", REQUESTS, rows), rows, seed=1)
    assert mode == VERIFY
    assert_reference_routing(routed, logits, ids, weights, K0, rows)
    for name in ("DECODE", "DRAFT_EXTEND_V2"):
        assert one_pass(rt, forward_batch(name, REQUESTS, REQUESTS), REQUESTS)[::2] == (DRAFT, None)
    assert rt.applied == {VERIFY: 1} and not rt.skipped


@pytest.mark.parametrize("mode_name", ["EXTEND", "MIXED"])
def test_a_prefill_servers_passes_are_never_routed(runtime, mode_name):
    """A prefill server runs prefill (EXTEND, or MIXED with chunked prefill) and hands each
    request over after its first token: no pass OEA routes."""
    mode, _, routed = one_pass(runtime, forward_batch(mode_name, REQUESTS, 40), 40)
    assert (mode, routed) == (OTHER, None)
    assert runtime.skipped == {(OTHER, SKIP_NOT_DECODE): 1} and not runtime.applied


# ----------------------------------------------------------------------------- startup


def settings(**overrides):
    values = {"model_path": "m", "moe_runner_backend": "auto", "disaggregation_mode": "null", **overrides}
    return lambda name, default: values.get(name, default)


@pytest.mark.parametrize("mode,level,words", [
    ("prefill", logging.WARNING, "this server runs only prefill passes, which OEA never routes, so --oea-k0 changes "
                                 "nothing here; give it to the decode servers (--disaggregation-mode decode)"),
    ("decode", logging.INFO, "OEA routes this server's decode batches"),
])
def test_each_role_is_accepted_and_told_what_oea_does_there(caplog, mode, level, words):
    config = {"model_type": "qwen3_moe", "num_experts": 16, "num_experts_per_tok": 4}
    with caplog.at_level(logging.INFO, logger="sglang_oea"):
        shape = flags.validate_server(OEAConfig(k0=2), settings(disaggregation_mode=mode), lambda: config)
    assert shape.top_k == 4
    notes = [r for r in caplog.records if "--disaggregation-mode" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == level
    assert f"sglang-oea: --disaggregation-mode {mode}: " in notes[0].getMessage() and words in notes[0].getMessage()


def test_a_server_that_does_both_gets_no_disaggregation_note(caplog):
    with caplog.at_level(logging.INFO, logger="sglang_oea"):
        flags.note_disaggregation(settings())
        flags.note_disaggregation(lambda name, default: default)  # an Engine record without the field
    assert "--disaggregation-mode" not in caplog.text


# ----------------------------------------------------------------------------- a real decode server

# SGLang's own stand-in for a prefill server: requests that name it as their bootstrap host take the
# fake transfer path (disaggregation/utils.py FAKE_BOOTSTRAP_HOST), as SGLang's warm-up requests do.
FAKE_PREFILL = "2.2.2.2"
DECODE_FLAGS = ("--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "fake",
                # The default host-pool backup of retracted requests registers pinned memory with CUDA.
                "--disaggregation-decode-retraction-backup", "cpu_tensor",
                "--oea-k0", "2", "--oea-min-batch", "1", "--enable-metrics", "--decode-log-interval", "1")
APPLIED, SKIPPED = "sglang:oea_decode_steps_applied_total", "sglang:oea_decode_steps_skipped_total"


def handed_over(base, room, tokens):
    """A request as a PD router sends it to a decode server (its prefill server: the fake one)."""
    payload = {"text": f"request {room}", "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
               "bootstrap_host": FAKE_PREFILL, "bootstrap_room": room}
    return json.loads(post(base + "/generate", payload))


def routed_since(before, metrics):
    return oea_value(metrics, APPLIED, mode="decode", k0="2") - oea_value(before, APPLIED)


def off_steps(metrics):
    return oea_value(metrics, SKIPPED, mode="decode", reason="oea_off", k0="0")


def decode_state(base):
    info = json.loads(urllib.request.urlopen(base + "/server_info", timeout=60).read())
    return [(state["disaggregation_mode"], state["oea"]["k0"]) for state in info["internal_states"]]


@pytest.mark.server
def test_a_decode_server_routes_the_requests_handed_over_to_it(tmp_path_factory):
    with serve(tmp_path_factory, TRAINED["qwen3_moe_trained"], *DECODE_FLAGS) as (base, log):
        assert decode_state(base) == [("decode", 2)]
        before = scrape(base)
        with ThreadPoolExecutor(4) as pool:
            done = list(pool.map(lambda room: handed_over(base, room, 8), range(100, 104)))
        assert [len(r["output_ids"]) for r in done] == [8] * 4
        # 7 decode steps at least (the first token comes with the KV cache); the last step's
        # stats reach /metrics just after its token does.
        on = scrape_until(base, lambda m: routed_since(before, m) >= 7)
        assert routed_since(before, on) >= 7
        # Nothing but decode passes reached the model: no prefill runs here, and the PREBUILT batch
        # that admits the handed-over requests never enters a forward pass.
        assert oea_value(on, SKIPPED) == 0

        assert json.loads(post(base + "/set_internal_state", {"server_args": {"oea_k0": 0}})) == [True]
        assert len(handed_over(base, 104, 4)["output_ids"]) == 4
        assert decode_state(base) == [("decode", 0)]
        assert off_steps(scrape_until(base, lambda m: off_steps(m) >= 3)) >= 3
    text = open(log).read()
    assert "sglang-oea: --disaggregation-mode decode: OEA routes this server's decode batches" in text
    assert "sglang-oea rank 0: OEA on, k0=2" in text
