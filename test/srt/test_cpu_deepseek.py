"""DeepseekV3ForCausalLM, GLM-5's architecture family (MLA attention; the DeepseekV2MoE block with
sigmoid routing, a correction bias, one expert group, one shared expert and a routed scaling
factor; a first dense layer), on the real SGLang server on the CPU engine.

The checkpoint is a tiny DeepseekV3ForCausalLM with real random weights written by transformers
(float32, q_lora_rank set as in DeepSeek-V3 and GLM-5, yarn rope: SGLang's CPU rope supports only
DeepSeek's yarn). Its router weights and correction bias are scaled so that routing is neither
uniform nor collapsed onto a few experts, which test_the_checkpoint_routes_like_a_trained_router
checks. transformers' greedy decoding of that checkpoint is the reference throughout.

Two servers, one at a time (2 cores), each shared by the assertions it can serve; OEA settings
change between assertions through /set_internal_state:
- TP=1, shared expert as its own MLP (SGLang's default here): SGLang's greedy output equals
  transformers' with OEA off and at k0 >= top-k; the OpenAI endpoints answer; k0=1 at
  --oea-min-batch 2 under concurrent requests changes the text and counts applied steps.
- TP=2, shared expert fused into the routed top-k (--enforce-shared-experts-fusion): the same
  greedy output at k0 >= top-k, then OEA applied under load with both ranks checked every step.

The hook that makes MLA run on the `torch_native` backend (sglang_oea/cpu_mla.py) is unit-tested
here too; the servers and transformers' tokens are what show it right.
"""

import json
import os
import types

import pytest
import torch

from test_server_e2e import complete, concurrent, greedy_ids, oea_value, post, scrape, serve, transformers_greedy

TOP_K, NUM_EXPERTS, MOE_LAYERS = 8, 64, 2
FP32 = ("--dtype", "float32")
METRICS = ("--enable-metrics", "--decode-log-interval", "1")
APPLIED = "sglang:oea_decode_steps_applied_total"
# The shapes of the failure cpu_mla.py fixes: qk_nope 32 + rope 16 per head, latent 64 + rope 16.
TINY_DEEPSEEK_V3 = dict(
    hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=1 + MOE_LAYERS,
    first_k_dense_replace=1, moe_layer_freq=1, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, head_dim=16,
    n_routed_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, n_group=1, topk_group=1, n_shared_experts=1,
    topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
    max_position_embeddings=4096, num_nextn_predict_layers=0, tie_word_embeddings=False,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    # Larger than the default 0.02, so that the MoE output is a sizable part of the residual stream
    # and a routing change moves greedy tokens.
    initializer_range=0.05,
)
ROUTER_STD, BIAS_STD = 0.1, 0.05  # router logits ~N(0, 1.1); the bias reorders near ties only


def write_deepseek_v3(directory, seed=0, **overrides):
    """A tiny DeepseekV3ForCausalLM checkpoint (float32, real random weights) and a BPE tokenizer."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from sglang_oea.tiny_model import SPECIAL_TOKENS, train_tokenizer

    os.makedirs(directory, exist_ok=True)
    eos = SPECIAL_TOKENS.index("<|endoftext|>")
    vocab = train_tokenizer(directory, 512)
    config = DeepseekV3Config(vocab_size=vocab, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                              **{**TINY_DEEPSEEK_V3, **overrides})
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).float()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers[config.first_k_dense_replace:]:
            layer.mlp.gate.weight.normal_(0, ROUTER_STD, generator=generator)
            layer.mlp.gate.e_score_correction_bias.normal_(0, BIAS_STD, generator=generator)
    model.save_pretrained(directory)
    return directory


def token_prompts(vocab_size, lengths=(9, 14, 5, 21), seed=7):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab_size, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """{"dir", "prompts", "ids"}: the checkpoint, token-id prompts and transformers' greedy ids."""
    directory = write_deepseek_v3(str(tmp_path_factory.mktemp("deepseek_v3") / "model"))
    vocab = json.load(open(os.path.join(directory, "config.json")))["vocab_size"]
    prompts = token_prompts(vocab)
    return {"dir": directory, "prompts": prompts, "ids": transformers_greedy(directory, prompts)}


def set_live(base, **settings):
    assert json.loads(post(base + "/set_internal_state", {"server_args": settings})) == [True], settings


def texts(results):
    return [r["choices"][0]["text"] for r in results]


# ----------------------------------------------------------------------------- no server


def test_the_checkpoint_routes_like_a_trained_router(deepseek):
    """Neither collapsed (a random correction bias can make every token pick the same experts) nor
    uniform: over 64 tokens each MoE layer uses at least half the experts, and no expert is picked
    by every token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(deepseek["dir"], dtype=torch.float32).eval()
    picked = {}
    for index, layer in enumerate(model.model.layers[1:], 1):
        layer.mlp.gate.register_forward_hook(lambda mod, inp, out, index=index: picked.__setitem__(index, out[2]))
    tokens = torch.randint(4, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(tokens)
    assert len(picked) == MOE_LAYERS
    for index, ids in picked.items():  # ids: [64, TOP_K]
        counts = torch.bincount(ids.flatten(), minlength=NUM_EXPERTS)
        assert (counts > 0).sum() >= NUM_EXPERTS // 2 and counts.max() < 64, (index, counts.tolist())


def fake_mla_layer(backend):
    return types.SimpleNamespace(current_attention_backend=backend)


@pytest.mark.parametrize("chosen", ["MHA", "MHA_CHUNKED_KV", "MHA_ONE_SHOT"])
def test_torch_native_runs_mla_absorbed(chosen):
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    from sglang_oea.cpu_mla import absorbed_on_torch_native

    original = lambda attn, batch: AttnForwardMethod[chosen]  # noqa: E731
    assert absorbed_on_torch_native(original, fake_mla_layer("torch_native"), None) == AttnForwardMethod.MLA
    assert absorbed_on_torch_native(original, fake_mla_layer("triton"), None) == AttnForwardMethod[chosen]
    mla = lambda attn, batch: AttnForwardMethod.MLA  # noqa: E731
    assert absorbed_on_torch_native(mla, fake_mla_layer("torch_native"), None) == AttnForwardMethod.MLA


# ----------------------------------------------------------------------------- TP=1, shared expert unfused


@pytest.fixture(scope="class")
def tp1(tmp_path_factory, deepseek):
    flags = (*FP32, *METRICS, "--oea-k0", str(TOP_K), "--oea-min-batch", "1")
    with serve(tmp_path_factory, deepseek["dir"], *flags) as running:
        yield running


@pytest.mark.server
class TestDeepseekV3AtTP1:
    """One server (class scope: it stops before the TP=2 server starts)."""

    def test_greedy_output_equals_transformers_with_oea_off_and_at_k0_top_k(self, tp1, deepseek):
        base, log = tp1
        set_live(base, oea_k0=TOP_K, oea_min_batch=1)
        assert greedy_ids(base, deepseek["prompts"]) == deepseek["ids"]
        set_live(base, oea_k0=0)
        assert greedy_ids(base, deepseek["prompts"]) == deepseek["ids"]
        text = open(log).read()
        assert "OEA no-op (k0 >= top-k)" in text and f"N={NUM_EXPERTS} top-k={TOP_K} routing=sigmoid+bias" in text
        assert "Shared experts fusion optimization is disabled" in text

    def test_openai_endpoints(self, tp1):
        base, _ = tp1
        assert complete(base, "hello", 8, ignore_eos=True)["usage"]["completion_tokens"] == 8
        chat_request = {"model": "m", "max_tokens": 6, "messages": [{"role": "user", "content": "hi"}]}
        chat = json.loads(post(base + "/v1/chat/completions", chat_request))
        assert chat["choices"][0]["message"]["role"] == "assistant" and chat["usage"]["completion_tokens"] > 0
        stream_request = {"model": "m", "prompt": "hello", "max_tokens": 8, "stream": True, "ignore_eos": True}
        stream = post(base + "/v1/completions", stream_request)
        assert stream.count("data: ") >= 3 and stream.rstrip().endswith("data: [DONE]")

    def test_small_k0_changes_concurrent_text_and_counts_applied_steps(self, tp1):
        """k0=1 at --oea-min-batch 2: every decode step of six concurrent requests keeps each token's
        own best expert and borrows the rest from the batch, so the text moves; k0 >= top-k at the
        same batch changes nothing the router chose."""
        base, _ = tp1
        set_live(base, oea_k0=TOP_K, oea_min_batch=2)
        unchanged = texts(concurrent(base, 6, 20))
        before = oea_value(scrape(base), APPLIED)
        set_live(base, oea_k0=1)
        oea = concurrent(base, 6, 20)
        assert all(r["usage"]["completion_tokens"] == 20 for r in oea)
        assert texts(oea) != unchanged
        assert oea_value(scrape(base), APPLIED) - before >= 10


# ----------------------------------------------------------------------------- TP=2, shared expert fused


@pytest.mark.server
def test_tp2_with_a_fused_shared_expert_matches_and_ranks_agree(tmp_path_factory, deepseek):
    """The shared expert fused into the top-k as its ninth slot (SGLang's GPU layout for DeepSeek-V3;
    off by default on the CPU) at --tp 2: transformers' greedy tokens at k0 >= top-k, as at TP=1;
    then k0=2 at min-batch 2 under concurrent load, with the ranks' routing compared every step."""
    flags = (*FP32, *METRICS, "--tp", "2", "--enforce-shared-experts-fusion", "--oea-check-ranks", "1",
             "--oea-k0", str(TOP_K), "--oea-min-batch", "1")
    with serve(tmp_path_factory, deepseek["dir"], *flags) as (base, log):
        assert greedy_ids(base, deepseek["prompts"]) == deepseek["ids"]
        set_live(base, oea_k0=2, oea_min_batch=2)
        assert all(r["usage"]["completion_tokens"] == 20 for r in concurrent(base, 6, 20))
        metrics = scrape(base)
        assert greedy_ids(base, deepseek["prompts"][:1]) == deepseek["ids"][:1], "batch 1 is below min-batch"
    for rank in ("0", "1"):
        assert oea_value(metrics, APPLIED, tp_rank=rank) >= 10
        assert oea_value(metrics, "sglang:oea_rank_checks_total", tp_rank=rank) >= 10
    text = open(log).read()
    assert "Shared experts fusion optimization enabled." in text
    assert "routed different experts" not in text
