"""benchmark/oea/training/deepseek_mtp.py: the MTP layer computes DeepSeek-V3's formula on the input
SGLang's NextN draft gets, and a deepseek_v3 checkpoint written by train_moe.py holds what SGLang
0.5.23's DeepseekV3ForCausalLM and DeepseekV3ForCausalLMNextN load (their own loaders, on the CPU).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from training import deepseek_mtp as dm

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
TOOL = os.path.join(ROOT, "benchmark", "oea", "training", "train_moe.py")
SMOKE = ["--arch", "deepseek_v3", "--steps", "2", "--warmup-steps", "1", "--max-docs", "6", "--num-experts", "16",
         "--top-k", "4", "--hidden-size", "32", "--moe-intermediate-size", "8", "--num-layers", "3",
         "--num-heads", "2", "--vocab-size", "300", "--seq-len", "32", "--batch-size", "2",
         "--heldout-tokens", "256", "--threads", "1"]
MTP_ONLY = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "embed_tokens.weight",
            "shared_head.head.weight")


def tiny_model(seed: int = 0):
    """A 2-layer DeepseekV3ForCausalLM (dense, then MoE) and its MTPLayer, float32, norms random."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=50, hidden_size=16, intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=2, n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, routed_scaling_factor=2.5, max_position_embeddings=64,
        rope_scaling={**dm.YARN, "original_max_position_embeddings": 16}, rope_theta=10000.0,
        num_nextn_predict_layers=1)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).eval()
    mtp = dm.build_mtp(model, seed).eval()
    with torch.no_grad():
        for name, param in list(model.named_parameters()) + list(mtp.named_parameters()):
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return model, mtp


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_mtp_layer_computes_the_deepseek_v3_formula():
    """logits_{t+2} = head(shared_head.norm(Block(eh_proj([enorm(E(tok_{t+1})); hnorm(h_t)])))), with
    h_t the main model's last layer output after the final norm, positions 0..T-1, causal."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    model, mtp = tiny_model()
    eps = model.config.rms_norm_eps
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    last_layer = []
    handle = model.model.layers[-1].register_forward_hook(lambda m, i, out: last_layer.append(out))
    with torch.no_grad():
        _, got = dm.main_and_mtp_logits(model, mtp, ids)  # [B, S - 1, V]
        handle.remove()
        h = rms_norm(last_layer[0], model.model.norm.weight, eps)[:, :-1]  # post-norm h_0 .. h_{S-2}
        e = model.model.embed_tokens.weight[ids[:, 1:]]  # tok_1 .. tok_{S-1}
        x = torch.cat([rms_norm(e, mtp.enorm.weight, eps), rms_norm(h, mtp.hnorm.weight, eps)], -1)
        x = x @ mtp.eh_proj.weight.T
        steps = x.shape[1]
        positions = torch.arange(steps).unsqueeze(0)
        causal = torch.full((steps, steps), float("-inf")).triu(1)[None, None]  # [1, 1, T, T]
        block = mtp.decoder(x, attention_mask=causal, position_ids=positions,
                            position_embeddings=model.model.rotary_emb(x, positions))
        want = rms_norm(block, mtp.shared_head.norm.weight, eps) @ model.lm_head.weight.T
    assert isinstance(mtp.decoder.mlp, DeepseekV3MoE)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_mtp_prediction_at_t_reads_tokens_up_to_t_plus_1_only():
    model, mtp = tiny_model()
    ids = torch.randint(0, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[0, 6] = (ids[0, 6] + 1) % model.config.vocab_size
    with torch.no_grad():
        _, before = dm.main_and_mtp_logits(model, mtp, ids)
        _, after = dm.main_and_mtp_logits(model, mtp, changed)
    # Position t sees tok_{<= t+1} (up to float rounding: the batch's other rows share the matmuls).
    torch.testing.assert_close(before[:, :5], after[:, :5], rtol=0, atol=1e-6)
    assert (before[:, 5] - after[:, 5]).abs().max() > 1e-3


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("deepseek_v3"))
    path = os.pathsep.join([os.path.join(ROOT, "python"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    subprocess.run([sys.executable, TOOL, "--out", out, *SMOKE], check=True, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=300)
    return out


def test_mtp_layer_is_stored_under_the_nextn_names(checkpoint_dir):
    """model.layers.{L}.*: a MoE decoder layer named as the main model's last one (experts one per
    name), plus enorm, hnorm, eh_proj, shared_head.norm and copies of the embedding and head."""
    from safetensors.torch import load_file

    with open(os.path.join(checkpoint_dir, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    weights = load_file(os.path.join(checkpoint_dir, "model.safetensors"))
    mtp, last = f"model.layers.{layers}.", f"model.layers.{layers - 1}."
    mtp_names = {n[len(mtp):] for n in weights if n.startswith(mtp)}
    assert set(MTP_ONLY) <= mtp_names
    assert mtp_names - set(MTP_ONLY) == {n[len(last):] for n in weights if n.startswith(last)}
    assert "mlp.experts.15.gate_proj.weight" in mtp_names
    assert torch.equal(weights[mtp + "embed_tokens.weight"], weights["model.embed_tokens.weight"])
    assert torch.equal(weights[mtp + "shared_head.head.weight"], weights["lm_head.weight"])
    assert not [n for n in weights if n.startswith(f"model.layers.{layers + 1}.")]


def test_sglang_loads_every_target_and_draft_weight(checkpoint_dir):
    """SGLang's own DeepseekV3ForCausalLM and DeepseekV3ForCausalLMNextN, built from config.json,
    parameters NaN-filled, then their load_weights over model.safetensors: every target parameter is
    written; every draft parameter but embed_tokens and lm_head (shared from the target at serve
    time, deepseek_weight_loader.py skips the checkpoint's copies); no loader warnings; fused
    tensors equal their sources."""
    from sglang_oea.cpu.serve import cpu_environment

    env = cpu_environment()
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], os.path.join(ROOT, "python")])
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, os.path.join(HERE, "sglang_deepseek_load.py"), checkpoint_dir],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["target"]["unloaded"] == [] and result["target"]["warnings"] == []
    assert result["draft"]["unloaded"] == ["lm_head.weight", "model.embed_tokens.weight"]
    assert result["draft"]["warnings"] == []
    draft = set(result["draft"]["parameters"])
    assert {"model.enorm.weight", "model.hnorm.weight", "model.eh_proj.weight", "model.shared_head.norm.weight",
            "model.decoder.mlp.experts.w13_weight", "model.decoder.mlp.gate.e_score_correction_bias"} <= draft
    assert all(result["values_match"].values()), result["values_match"]
