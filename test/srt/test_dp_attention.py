"""Plain SGLang DP attention (`--tp 2 --attn-dp-size 2`) on the CPU engine, no OEA: the trained
DeepSeek-V3 checkpoint (benchmark/oea/models/deepseek_v3_stdlib), float32.

Under DP attention each of the two ranks schedules its own requests and runs attention on them
alone; before every MoE layer the ranks gather their hidden states, so the experts (split over the
two ranks as under plain TP) see the rows of both groups. A rank with no requests still runs every
pass with the other (an IDLE pass), or the gather would never complete. The CPU harness supplies
one stand-in for it (sglang_oea/cpu/dp_attention.py: the padded rows' sequence length).

One server, the CPU harness alone (SGLANG_PLUGINS=oea_cpu_harness): the held-out prompts one at a
time (each request alone on one rank, the other rank idle), then five at once (both groups busy,
three and two requests, so one group's batch is padded to the other's in decode).

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
from concurrent.futures import ThreadPoolExecutor

import pytest

from sglang_oea.cpu.dp_attention import CPU_FILL, cpu_fill_value_for_padding, padded_seq_len
from test_cpu_deepseek import MODEL
from test_server_e2e import GREEDY_TOKENS, heldout_prompts, oea_value, post, scrape, serve, transformers_greedy

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
