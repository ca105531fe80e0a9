"""Plain SGLang DP attention (`--tp 2 --attn-dp-size 2`) on the CPU engine, no OEA: the trained
DeepSeek-V3 checkpoint (benchmark/oea/models/deepseek_v3_stdlib), float32.

Under DP attention each of the two ranks schedules its own requests and runs attention on them
alone; before every MoE layer the ranks gather their hidden states, so the experts (split over the
two ranks as under plain TP) see the rows of both groups. A rank with no requests still runs every
pass with the other (an IDLE pass), or the gather would never complete. The CPU harness supplies
one stand-in for it (sglang_oea/cpu/dp_attention.py: the padded rows' sequence length).

Three servers, one at a time:
- plain DP attention, the CPU harness alone (SGLANG_PLUGINS=oea_cpu_harness): the held-out prompts
  one at a time (each request alone on one rank, the other rank idle), then five at once (both
  groups busy, three and two requests, so one group's batch is padded to the other's in decode);
- the same with OEA (oea_run): every rank routes the gathered batch, the real rows of both groups,
  alike; OEA off and k0 >= top-k serve as plain DP attention; an idle group's rank routes; live
  settings land on both ranks at the same pass; each gathered pass is counted once per rank;
- the same under EAGLE (eagle_run), lone requests: the target's verify passes of the gathered
  batch are routed on both ranks, the draft's never.

The reference is transformers' float32 greedy decoding of the same prompts, the reference that
plain TP=2 of the same checkpoint matches in test_cpu_deepseek.py
(test_tp2_with_a_fused_shared_expert_matches_and_ranks_agree): equal to it, DP attention is equal
to plain TP=2 (checked directly while this test was written, with a plain TP=2 server: identical
ids; the second server is not kept, for CI time).

What SGLang guarantees here: nothing bitwise. DP attention computes each request's attention on one
rank with all heads and plain TP splits the heads over two ranks and sums them, and the gathered
batch changes the MoE's batch shape, so sums run in another order. In float32 these differences are
about 1e-6, far below the trained model's greedy margins on these prompts, so the ids are expected
equal, as the suite's other identity tests expect between SGLang and transformers.
"""

import json
import os
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from sglang_oea.cpu.dp_attention import CPU_FILL, cpu_fill_value_for_padding, padded_seq_len
from test_cpu_deepseek import EAGLE, MODEL, TOP_K
from test_server_e2e import (GREEDY_TOKENS, heldout_prompts, oea_value, post, scrape, scrape_until, serve,
                             transformers_greedy)

FP32 = ("--dtype", "float32")
HARNESS_ONLY = "oea_cpu_harness"
DP_ATTENTION = ("--tp", "2", "--attn-dp-size", "2")
# sglang:dp_attention_steps_total{rank_state="idle"} counts a rank's passes with no tokens of its
# own; SGLang publishes it only with this variable and --enable-metrics.
DP_METRICS_ENV = {"SGLANG_ENABLE_METRICS_DP_ATTENTION": "1"}
IDLE_STEPS = "sglang:dp_attention_steps_total"
CONCURRENT = 5  # odd: the groups get 3 and 2 requests


def generate(base, ids, max_tokens=GREEDY_TOKENS):
    """SGLang's /generate reply for one token-id prompt, greedy, exactly max_tokens new tokens."""
    params = {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return json.loads(post(base + "/generate", {"input_ids": ids, "sampling_params": params}))


def idle_steps(metrics, dp_rank):
    return oea_value(metrics, IDLE_STEPS, rank_state="idle", dp_rank=str(dp_rank))


# ----------------------------------------------------------------------------- the stand-in


def test_padding_length_is_sglangs_own_cpu_value():
    """SGLang's CPU attention backend (intel_amx) pads with this length, as its GPU backends do."""
    from sglang.srt.layers.attention.intel_amx_backend import IntelAMXAttnBackend

    assert padded_seq_len() == IntelAMXAttnBackend.get_cpu_graph_seq_len_fill_value(None) == 1


def test_a_backend_without_a_cpu_fill_value_gets_one_and_others_keep_theirs():
    class Runner:
        def __init__(self, backend):
            self.attn_backend = backend

    class TorchNativeLike:
        pass

    class OwnValue:
        def get_cpu_graph_seq_len_fill_value(self):
            return 7

    bare, own = TorchNativeLike(), OwnValue()
    assert cpu_fill_value_for_padding(None, Runner(bare), 4, 4) is None  # the arguments go on unchanged
    assert getattr(bare, CPU_FILL)() == 1
    cpu_fill_value_for_padding(None, Runner(own), 4, 4)
    assert own.get_cpu_graph_seq_len_fill_value() == 7


# ----------------------------------------------------------------------------- the servers


@pytest.fixture(scope="module")
def prompts():
    return heldout_prompts(MODEL)


@pytest.fixture(scope="module")
def reference(prompts):
    """transformers' float32 greedy ids, one prompt at a time (plain TP=2's, see the module docstring)."""
    return transformers_greedy(MODEL, prompts)


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory, prompts):
    """The DP-attention server: lone requests between two /metrics scrapes, then CONCURRENT at once."""
    flags = (*FP32, *DP_ATTENTION, "--enable-metrics")
    with serve(tmp_path_factory, MODEL, *flags, plugins=HARNESS_ONLY, extra_env=DP_METRICS_ENV) as (base, log):
        before = scrape(base)
        alone = [generate(base, ids) for ids in prompts]
        after = scrape(base)
        batch = (prompts * 2)[:CONCURRENT]
        with ThreadPoolExecutor(CONCURRENT) as pool:
            together = list(pool.map(lambda ids: generate(base, ids), batch))
    return {"alone": alone, "before": before, "after": after, "together": together, "log": open(log).read()}


@pytest.mark.server
def test_lone_requests_match_plain_tp2(dp_run, reference):
    assert [r["output_ids"] for r in dp_run["alone"]] == reference
    assert "DP attention is enabled" in dp_run["log"]


@pytest.mark.server
def test_the_idle_group_runs_a_pass_for_every_pass_of_the_busy_one(dp_run):
    """A lone request on one rank is prefilled and decoded in GREEDY_TOKENS passes; each of them
    gathers over both ranks, so the other rank ran as many passes with no tokens of its own."""
    served_by = {r["meta_info"]["dp_rank"] for r in dp_run["alone"]}
    assert served_by == {0, 1}, "round robin sends the lone requests to both groups in turn"
    for rank in (0, 1):
        assert idle_steps(dp_run["after"], rank) - idle_steps(dp_run["before"], rank) >= GREEDY_TOKENS


@pytest.mark.server
def test_concurrent_requests_on_both_groups_finish_and_match_plain_tp2(dp_run, reference):
    together = dp_run["together"]
    assert [r["meta_info"]["completion_tokens"] for r in together] == [GREEDY_TOKENS] * CONCURRENT
    assert sorted(r["meta_info"]["dp_rank"] for r in together) in ([0, 0, 0, 1, 1], [0, 0, 1, 1, 1])
    assert [r["output_ids"] for r in together] == (reference * 2)[:CONCURRENT]
    assert "Traceback" not in dp_run["log"]


# ----------------------------------------------------------------------------- OEA under DP attention

APPLIED, CHECKS = "sglang:oea_decode_steps_applied_total", "sglang:oea_rank_checks_total"
DUMP_STEPS = 12


def together(base, prompts, count=CONCURRENT):
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda ids: generate(base, ids), (prompts * 2)[:count]))


def set_state(base, **settings):
    """POST /set_internal_state: SGLang's reply, one bool per attention-DP group's scheduler."""
    return json.loads(post(base + "/set_internal_state", {"server_args": settings}))


def oea_states(base):
    """/server_info's internal_states: [(dp_rank, OEA state)], one entry per scheduler that answered."""
    with urllib.request.urlopen(base + "/server_info", timeout=60) as reply:
        states = json.loads(reply.read())["internal_states"]
    return sorted((state["oea"]["dp_rank"], state["oea"]) for state in states)


def per_rank(metrics, name, **labels):
    return [oea_value(metrics, name, tp_rank=str(rank), **labels) for rank in (0, 1)]


def settings_lines(log_text):
    """{rank: [(change, routed step)]} of the 'settings ... from routed step S' lines."""
    out = {}
    for rank, change, step in re.findall(r"\bTP(\d)\] sglang-oea rank \d: settings (.*) from routed step (\d+)", log_text):
        out.setdefault(rank, []).append((change, int(step)))
    return out


@pytest.fixture(scope="module")
def oea_run(tmp_path_factory, prompts):
    """DP attention with OEA at k0=1, min-batch 1, the rank check at every routed pass and the
    router dump of the first DUMP_STEPS routed passes. In order: CONCURRENT requests (dumped: both
    groups busy, one padded); k0 = top-k, then OEA off (lone requests, then concurrent ones off);
    k0=1 again with lone requests (each group idle in turn), metrics scraped around them."""
    dump = str(tmp_path_factory.mktemp("dump"))
    flags = (*FP32, *DP_ATTENTION, "--enable-metrics", "--decode-log-interval", "1", "--oea-k0", "1",
             "--oea-min-batch", "1", "--oea-check-ranks", "1", "--oea-dump-router-logits", dump,
             "--oea-dump-steps", str(DUMP_STEPS))
    run = {"dump": dump}
    with serve(tmp_path_factory, MODEL, *flags, extra_env=DP_METRICS_ENV) as (base, log):
        run["loaded"] = [r["output_ids"] for r in together(base, prompts)]
        run["replies"] = [set_state(base, oea_k0=TOP_K)]
        run["noop"] = [r["output_ids"] for r in map(lambda ids: generate(base, ids), prompts)]
        run["replies"].append(set_state(base, oea_k0=0))
        run["off"] = [r["output_ids"] for r in map(lambda ids: generate(base, ids), prompts)]
        run["off_loaded"] = [r["output_ids"] for r in together(base, prompts)]
        run["replies"].append(set_state(base, oea_k0=1))
        run["refused"] = set_state(base, oea_k0=99)
        run["pending"] = oea_states(base)
        before = scrape(base)
        run["lone"] = [generate(base, ids) for ids in prompts]
        lone_passes = len(prompts) * (GREEDY_TOKENS - 1)  # each request: one prefill, then decode passes
        run["metrics"] = scrape_until(base, lambda m: min(per_rank(m, APPLIED, k0="1")) >= per_rank(before, APPLIED, k0="1")[0] + lone_passes
                                      and len(set(per_rank(m, APPLIED, k0="1"))) == 1)
        run["before"], run["lone_passes"] = before, lone_passes
        run["states"] = oea_states(base)
        run["log"] = open(log).read()
    return run


@pytest.mark.server
def test_oea_off_and_at_top_k_serve_as_plain_dp_attention(oea_run, reference):
    """k0 = top-k (a no-op) and k0 = 0 (off), set live on both groups: lone requests and
    concurrent ones (one group's batch padded) give plain DP attention's greedy ids."""
    assert oea_run["noop"] == reference and oea_run["off"] == reference
    assert oea_run["off_loaded"] == (reference * 2)[:CONCURRENT]
    assert oea_run["replies"] == [[True, True]] * 3


@pytest.mark.server
def test_both_ranks_route_the_gathered_batch_alike_and_by_the_definition(oea_run):
    """The router dump of the concurrent requests at k0=1: each rank recorded every routed pass
    (one folder: the ranks route one batch), with the same real rows of both groups (never a
    padded row: every logit finite), the same router ids and the same OEA ids, which are OEA's
    definition over exactly those rows; and OEA changed experts."""
    import torch

    from test_cpu_deepseek import reference_oea_ids
    from test_tp import dumps_by_rank

    records = dumps_by_rank(oea_run["dump"])
    assert {step for step, _ in records} == set(range(DUMP_STEPS))
    assert all(set(ranks) == {"0", "1"} for ranks in records.values())
    sizes, changed = set(), 0
    for key, ranks in sorted(records.items()):
        zero, one = ranks["0"], ranks["1"]
        for field in ("router_logits", "router_ids", "oea_ids"):
            assert torch.equal(zero[field], one[field]), (key, field)
        assert torch.isfinite(zero["router_logits"]).all(), key
        one_pass = type("Pass", (), {"logits": [zero["router_logits"]], "bias": [zero["correction_bias"]]})
        assert torch.equal(zero["oea_ids"].long(), reference_oea_ids(one_pass, 1)[:, 0]), key
        sizes.add(zero["batch_size"])
        changed += int(not torch.equal(zero["oea_ids"].sort().values, zero["router_ids"].sort().values))
    assert CONCURRENT in sizes, "some dumped pass held every group's requests (3 and 2: one group padded)"
    assert changed > 0


@pytest.mark.server
def test_an_idle_groups_rank_routes_and_each_gathered_pass_counts_once(oea_run, reference):
    """Lone requests at k0=1, each on one group with the other group's rank idle: OEA changes the
    output; both ranks count every gathered decode pass once, as applied at k0=1 (the idle rank
    too), the same number on both (not once per group); the rank check passes at every pass."""
    assert [r["output_ids"] for r in oea_run["lone"]] != reference
    assert {r["meta_info"]["dp_rank"] for r in oea_run["lone"]} == {0, 1}
    before, after = oea_run["before"], oea_run["metrics"]
    applied = [a - b for a, b in zip(per_rank(after, APPLIED, k0="1"), per_rank(before, APPLIED, k0="1"))]
    assert applied[0] == applied[1]
    assert oea_run["lone_passes"] <= applied[0] < 2 * oea_run["lone_passes"]
    for rank in (0, 1):
        assert idle_steps(after, rank) - idle_steps(before, rank) >= GREEDY_TOKENS - 1
    checks = [a - b for a, b in zip(per_rank(after, CHECKS), per_rank(before, CHECKS))]
    assert min(checks) >= oea_run["lone_passes"] - 2  # every routed pass (the reads lag by one)
    assert "routed different experts" not in oea_run["log"] and "Traceback" not in oea_run["log"]


@pytest.mark.server
def test_live_settings_land_on_both_ranks_at_the_same_pass(oea_run):
    """Every accepted change is logged once by each rank, from the same routed step; a refused one
    is refused by both schedulers; /server_info has each scheduler's OEA state (its attention-DP
    group's dp_rank): the change pending on both until the next pass, then in force on both."""
    lines = settings_lines(oea_run["log"])
    assert len(lines["0"]) == 3 and lines["0"] == lines["1"]
    assert oea_run["refused"] == [False, False]
    for states in (oea_run["pending"], oea_run["states"]):
        assert [dp_rank for dp_rank, _ in states] == [0, 1]
    assert all((state["k0"], state["pending"]["k0"]) == (0, 1) for _, state in oea_run["pending"])
    assert all(state["k0"] == 1 and "pending" not in state for _, state in oea_run["states"])


@pytest.fixture(scope="module")
def eagle_run(tmp_path_factory, prompts):
    """DP attention under EAGLE (the checkpoint's MTP layer drafts, shared expert unfused as GLM-5
    is served), OEA armed at k0 = top-k: lone requests (the other group idle) at k0 = top-k, off,
    then k0=1, the metrics scraped around the last. Concurrent requests are not sent: on the CPU
    engine SGLang's torch_native backend cannot run a group's padded draft-extend batch."""
    flags = (*FP32, *DP_ATTENTION, *EAGLE, "--disable-shared-experts-fusion", "--enable-metrics",
             "--decode-log-interval", "1", "--oea-k0", str(TOP_K), "--oea-min-batch", "1", "--oea-check-ranks", "1")
    run = {}
    with serve(tmp_path_factory, MODEL, *flags, extra_env=DP_METRICS_ENV) as (base, log):
        run["noop"] = [generate(base, ids)["output_ids"] for ids in prompts]
        run["replies"] = [set_state(base, oea_k0=0)]
        run["off"] = [generate(base, ids)["output_ids"] for ids in prompts]
        run["replies"].append(set_state(base, oea_k0=1))
        before = scrape(base)
        run["lone"] = [generate(base, ids) for ids in prompts]
        verify = sum(r["meta_info"]["spec_verify_ct"] for r in run["lone"])
        run["metrics"] = scrape_until(base, lambda m: min(per_rank(m, APPLIED, k0="1", mode="verify"))
                                      >= per_rank(before, APPLIED, k0="1", mode="verify")[0] + verify)
        run["before"], run["verify"] = before, verify
        run["log"] = open(log).read()
    return run


@pytest.mark.server
def test_eagle_verify_passes_route_the_gathered_batch_on_both_ranks(eagle_run, reference):
    """Under EAGLE, OEA routes the target's verify passes of the gathered batch: k0 = top-k and off
    give transformers' greedy ids; at k0=1 the ids change, and both ranks count every verify pass of
    the lone requests once as applied (the idle group's rank too: its pass is an idle verify pass,
    its draft passes draft passes), with the rank check passing at every pass."""
    assert eagle_run["noop"] == reference and eagle_run["off"] == reference
    assert eagle_run["replies"] == [[True, True]] * 2
    lone = eagle_run["lone"]
    assert [r["output_ids"] for r in lone] != reference and {r["meta_info"]["dp_rank"] for r in lone} == {0, 1}
    before, after = eagle_run["before"], eagle_run["metrics"]
    applied = [a - b for a, b in zip(per_rank(after, APPLIED, k0="1", mode="verify"),
                                     per_rank(before, APPLIED, k0="1", mode="verify"))]
    assert applied[0] == applied[1] and eagle_run["verify"] <= applied[0] < 2 * eagle_run["verify"]
    assert per_rank(after, APPLIED, mode="decode") == [0, 0], "no draft pass is routed or counted"
    assert min(a - b for a, b in zip(per_rank(after, CHECKS), per_rank(before, CHECKS))) > 0
    assert "routed different experts" not in eagle_run["log"] and "Traceback" not in eagle_run["log"]
    assert "without the routing hook seeing any top-k ids" not in eagle_run["log"]
