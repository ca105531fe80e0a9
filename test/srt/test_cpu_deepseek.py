"""DeepseekV3ForCausalLM, GLM-5's architecture family, on the real SGLang server on the CPU engine:
the trained checkpoint benchmark/oea/models/deepseek_v3_stdlib (train_moe.py --arch deepseek_v3:
MLA with q_lora_rank, a first dense layer, 256 routed experts top-8 with sigmoid scores and a
learned correction bias, one shared expert, routed scaling factor 2.5, yarn rope, and one MTP
layer). transformers' float32 greedy decoding of held-out prompts is the reference throughout.

Two servers, one at a time (2 cores), each shared by the assertions it can serve; OEA settings
change between assertions through /set_internal_state:
- TP=1 with EAGLE, the checkpoint's own MTP layer as the draft (DeepseekV3ForCausalLMNextN), the
  shared expert as its own MLP (SGLang's default here): speculative greedy output equals
  transformers' with OEA at k0 >= top-k and off; k0=1 changes it; the OpenAI endpoints answer;
  under concurrent requests OEA applies in the target's verify passes only, never in the draft's
  passes nor in draft extend, and SGLang's accept length stays between 1 and the draft tokens.
- TP=2, shared expert fused into the routed top-k (--enforce-shared-experts-fusion), no
  speculative decoding: transformers' greedy output at k0 >= top-k and off, k0=1 changes it, then
  OEA applied under load with both ranks' routing compared every step.

The hook that makes MLA run on the `torch_native` backend (sglang_oea/cpu/mla.py) is unit-tested
here too; the servers and transformers' tokens are what show it right.
"""

import json
import os
import re
import types
from concurrent.futures import ThreadPoolExecutor

import pytest

from test_server_e2e import (TRAINED_DIR, accept_lengths, complete, concurrent, greedy_ids, heldout_prompts,
                             oea_value, post, scrape, serve, set_live, transformers_greedy)

MODEL = os.path.join(TRAINED_DIR, "deepseek_v3_stdlib")
TOP_K, NUM_EXPERTS, MOE_LAYERS = 8, 256, ("1", "2", "3")  # layer 0 is dense
FP32 = ("--dtype", "float32")
METRICS = ("--enable-metrics", "--decode-log-interval", "1")
DRAFTS = 4  # 3 MTP draft steps, top-1: a chain of 4 draft tokens per request and step
EAGLE = ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(DRAFTS - 1), "--speculative-eagle-topk",
         "1", "--speculative-num-draft-tokens", str(DRAFTS), "--max-total-tokens", "8192")
APPLIED, SKIPPED = "sglang:oea_decode_steps_applied_total", "sglang:oea_decode_steps_skipped_total"


@pytest.fixture(scope="module")
def deepseek():
    """{"prompts", "ids"}: held-out prompts and transformers' float32 greedy ids for them."""
    prompts = heldout_prompts(MODEL)
    return {"prompts": prompts, "ids": transformers_greedy(MODEL, prompts)}


def check_identity_then_change(base, deepseek):
    """Greedy ids one request at a time: transformers' at k0 >= top-k and with OEA off; k0=1 at
    min-batch 1 (each token keeps its own best expert and borrows from its pass) moves them, so the
    identity checks can fail."""
    for k0 in (TOP_K, 0):
        set_live(base, oea_k0=k0, oea_min_batch=1)
        assert greedy_ids(base, deepseek["prompts"]) == deepseek["ids"], k0
    set_live(base, oea_k0=1)
    assert greedy_ids(base, deepseek["prompts"]) != deepseek["ids"]


def fake_mla_layer(backend):
    return types.SimpleNamespace(current_attention_backend=backend)


@pytest.mark.parametrize("chosen", ["MHA", "MHA_CHUNKED_KV", "MHA_ONE_SHOT"])
def test_torch_native_runs_mla_absorbed(chosen):
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    from sglang_oea.cpu.mla import absorbed_on_torch_native

    original = lambda attn, batch: AttnForwardMethod[chosen]  # noqa: E731
    assert absorbed_on_torch_native(original, fake_mla_layer("torch_native"), None) == AttnForwardMethod.MLA
    assert absorbed_on_torch_native(original, fake_mla_layer("triton"), None) == AttnForwardMethod[chosen]
    mla = lambda attn, batch: AttnForwardMethod.MLA  # noqa: E731
    assert absorbed_on_torch_native(mla, fake_mla_layer("torch_native"), None) == AttnForwardMethod.MLA


# ----------------------------------------------------------------------------- TP=1, EAGLE with the MTP draft


@pytest.fixture(scope="module")
def eagle_run(tmp_path_factory, deepseek):
    """One EAGLE server with OEA armed: the identity checks, the endpoints, then k0 2 from 2
    requests: a lone request (below the floor), then 8 concurrent ones, /metrics around."""
    flags = (*FP32, *METRICS, *EAGLE, "--oea-k0", str(TOP_K), "--oea-min-batch", "1")
    with serve(tmp_path_factory, MODEL, *flags) as (base, log):
        check_identity_then_change(base, deepseek)
        endpoints = check_openai_endpoints(base)
        set_live(base, oea_k0=2, oea_min_batch=2)
        start = scrape(base)
        complete(base, "alone", 16, ignore_eos=True)
        alone = scrape(base)
        with ThreadPoolExecutor(8) as pool:
            outputs = list(pool.map(lambda ids: complete(base, ids, 20, ignore_eos=True), deepseek["prompts"] * 2))
        after = scrape(base)
    return types.SimpleNamespace(outputs=outputs, start=start, alone=alone, after=after, log=open(log).read(),
                                 endpoints=endpoints)


def check_openai_endpoints(base):
    """Completions, chat and a streamed completion through the EAGLE server."""
    assert complete(base, "hello", 8, ignore_eos=True)["usage"]["completion_tokens"] == 8
    chat_request = {"model": "m", "max_tokens": 6, "messages": [{"role": "user", "content": "hi"}]}
    chat = json.loads(post(base + "/v1/chat/completions", chat_request))
    assert chat["choices"][0]["message"]["role"] == "assistant" and chat["usage"]["completion_tokens"] > 0
    stream_request = {"model": "m", "prompt": "hello", "max_tokens": 8, "stream": True, "ignore_eos": True}
    stream = post(base + "/v1/completions", stream_request)
    assert stream.count("data: ") >= 3 and stream.rstrip().endswith("data: [DONE]")
    return True


@pytest.mark.server
def test_eagle_serves_the_trained_checkpoint_identically_with_oea_off_or_a_no_op(eagle_run):
    """Reached only when check_identity_then_change and the endpoints passed inside the fixture."""
    assert eagle_run.endpoints
    text = eagle_run.log
    assert f"N={NUM_EXPERTS} top-k={TOP_K} routing=sigmoid+bias" in text
    assert "Shared experts fusion optimization is disabled" in text
    assert "speculative EAGLE: verify passes routed (rows = requests x draft tokens)" in text


@pytest.mark.server
def test_concurrent_requests_finish_with_all_their_tokens(eagle_run):
    assert [r["usage"]["completion_tokens"] for r in eagle_run.outputs] == [20] * 8


@pytest.mark.server
def test_oea_routes_the_targets_verify_passes_only(eagle_run):
    run = eagle_run

    def delta(name, old, new, **labels):
        return oea_value(new, name, **labels) - oea_value(old, name, **labels)

    assert delta(APPLIED, run.start, run.alone) == 0, "one request at a time stays below --oea-min-batch 2"
    assert delta(SKIPPED, run.start, run.alone, mode="verify", reason="below_min_batch") >= 15 // DRAFTS
    assert delta(APPLIED, run.alone, run.after, mode="verify") >= 3
    assert oea_value(run.after, APPLIED) == oea_value(run.after, APPLIED, mode="verify")
    assert oea_value(run.after, APPLIED, mode="decode") + oea_value(run.after, SKIPPED, mode="decode") == 0
    # Every EAGLE step runs one target verify pass and three draft passes (two draft decodes and a
    # draft extend); exactly the verify passes are counted, one per 'Decode batch' line.
    verify_steps = oea_value(run.after, APPLIED, mode="verify") + oea_value(run.after, SKIPPED, mode="verify")
    assert verify_steps == len(accept_lengths(run.log))
    for layer in MOE_LAYERS:
        before = oea_value(run.after, "sglang:oea_active_experts_before", layer=layer)
        assert 2 <= oea_value(run.after, "sglang:oea_active_experts_after", layer=layer) < before
    assert re.search(r"Decode batch.*OEA k0=2: applied \d+/\d+ verify steps", run.log)


@pytest.mark.server
def test_the_trained_draft_is_accepted(eagle_run):
    """SGLang's accept length, per step and as its gauge: between 1 and the draft tokens, and above
    1 on average (the MTP layer learned to predict the token after next)."""
    lengths = accept_lengths(eagle_run.log)
    assert lengths and all(1 <= n <= DRAFTS for n in lengths)
    assert sum(lengths) / len(lengths) > 1.1
    assert 1 <= oea_value(eagle_run.after, "sglang:spec_accept_length") <= DRAFTS


# ----------------------------------------------------------------------------- TP=2, shared expert fused


@pytest.mark.server
def test_tp2_with_a_fused_shared_expert_matches_and_ranks_agree(tmp_path_factory, deepseek):
    """The shared expert fused into the top-k as its ninth slot (SGLang's GPU layout for DeepSeek-V3;
    off by default on the CPU) at --tp 2: transformers' greedy tokens at k0 >= top-k and off, k0=1
    changes them; then k0=2 at min-batch 2 under concurrent load, with the ranks' routing compared
    every step."""
    flags = (*FP32, *METRICS, "--tp", "2", "--enforce-shared-experts-fusion", "--oea-check-ranks", "1",
             "--oea-k0", str(TOP_K), "--oea-min-batch", "1")
    with serve(tmp_path_factory, MODEL, *flags) as (base, log):
        check_identity_then_change(base, deepseek)
        set_live(base, oea_k0=2, oea_min_batch=2)
        assert all(r["usage"]["completion_tokens"] == 20 for r in concurrent(base, 6, 20))
        metrics = scrape(base)
        assert greedy_ids(base, deepseek["prompts"][:1]) == deepseek["ids"][:1], "batch 1 is below min-batch"
    for rank in ("0", "1"):
        assert oea_value(metrics, APPLIED, tp_rank=rank, k0="2") >= 10
        assert oea_value(metrics, "sglang:oea_rank_checks_total", tp_rank=rank) >= 10
    text = open(log).read()
    assert "Shared experts fusion optimization enabled." in text
    assert "routed different experts" not in text
