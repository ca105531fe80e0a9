"""Write a tiny MoE model directory (config.json + tokenizer) that `--load-format dummy` can serve.

    python -m sglang_oea.tiny_model --arch qwen3_moe --out DIR [--num-experts 128 --top-k 8 ...]
    python -m sglang_oea.tiny_model --arch qwen3_moe --out DIR --random-weights   # + a checkpoint

--random-weights also writes model.safetensors (seeded normal weights, std 0.02, unit norms; served
without --load-format dummy). SGLang's dummy weights are uniform in +-1e-3 for every tensor, norms
included, so the MoE output is some 1e-9 of the residual stream and no routing change can move a
greedy token: a test that compares outputs needs real weights to be able to fail.

qwen3_moe: softmax routing (Qwen3MoeForCausalLM).
glm4_moe:  sigmoid routing with a correction bias, expert groups and a shared expert
           (Glm4MoeForCausalLM), the routing family of GLM-4.5 and GLM-5. --nextn-layers 1 adds
           the MTP layer SGLang's EAGLE draft (Glm4MoeForCausalLMNextN) loads from the same
           checkpoint (with --random-weights; dummy weights fill it too).
The tokenizer is a small byte-level BPE trained here on a fixed text, so nothing is downloaded
(benchmark/oea/training/train_moe.py trains it on its corpus instead, through write_model's `texts`).
"""

import argparse
import json
import os
from typing import Dict, Iterable, List, Optional

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"]
CORPUS_LINE = (
    "Opportunistic expert activation keeps each token's best experts and lets it borrow the "
    "experts its batch already loads. Mixture of experts decode is memory bound, so fewer "
    "distinct experts per step means less weight traffic. 0123456789 ,.;:!?()[]{}<>+-*/=_'\""
)


def train_tokenizer(out_dir: str, vocab_size: int, texts: Optional[Iterable[str]] = None) -> int:
    """Train a byte-level BPE on `texts` (default: a fixed line); write tokenizer files; return the vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([CORPUS_LINE] * 64 if texts is None else texts, trainer=trainer)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "bos_token": None,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), tokenizer_config)
    _write_json(os.path.join(out_dir, "special_tokens_map.json"), {"eos_token": "<|endoftext|>"})
    return tokenizer.get_vocab_size()


def common_config(args: argparse.Namespace, vocab_size: int, eos_id: int) -> Dict:
    """Fields both architectures share."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.hidden_size * 2,
        "moe_intermediate_size": args.moe_intermediate_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_heads,
        "head_dim": args.hidden_size // args.num_heads,
        "num_experts_per_tok": args.top_k,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def qwen3_moe_config(args: argparse.Namespace, base: Dict) -> Dict:
    """Qwen3-MoE: softmax routing over num_experts, renormalised top-k."""
    return {
        **base,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": args.num_experts,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
    }


def sigmoid_bias_moe(args: argparse.Namespace, dense_layers: int) -> Dict:
    """The config keys of the DeepSeek-style MoE block (GLM-4 MoE and DeepSeek-V3 alike): sigmoid
    + correction bias (noaux_tc), grouped routing, one shared expert, a routed scaling factor,
    `dense_layers` dense first layers."""
    return {
        "n_routed_experts": args.num_experts,
        "n_shared_experts": 1,
        "n_group": args.num_groups,
        "topk_group": args.topk_group,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": dense_layers,
        "moe_layer_freq": 1,
    }


def glm4_moe_config(args: argparse.Namespace, base: Dict) -> Dict:
    """GLM-4 MoE: sigmoid + correction bias (noaux_tc), grouped routing, one shared expert."""
    return {
        **base,
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        **sigmoid_bias_moe(args, dense_layers=0),
        "partial_rotary_factor": 0.5,
        "use_qk_norm": True,
        "num_nextn_predict_layers": getattr(args, "nextn_layers", 0),  # train_moe's arguments have none
    }


def write_model(args: argparse.Namespace, texts: Optional[Iterable[str]] = None) -> str:
    """Write config.json and tokenizer files (BPE trained on `texts`, see train_tokenizer) into args.out."""
    os.makedirs(args.out, exist_ok=True)
    vocab_size = train_tokenizer(args.out, args.vocab_size, texts)
    base = common_config(args, vocab_size, eos_id=SPECIAL_TOKENS.index("<|endoftext|>"))
    build = qwen3_moe_config if args.arch == "qwen3_moe" else glm4_moe_config
    _write_json(os.path.join(args.out, "config.json"), build(args, base))
    _write_json(os.path.join(args.out, "generation_config.json"), {"eos_token_id": base["eos_token_id"]})
    return args.out


def write_random_weights(directory: str, seed: int = 0, std: float = 0.02) -> None:
    """model.safetensors (bf16, the architecture's checkpoint names) for the config in `directory`."""
    import torch
    from safetensors.torch import save_file

    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return (torch.randn(*shape, generator=generator) * std).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    build = glm4_moe_weights if cfg["model_type"] == "glm4_moe" else qwen3_moe_weights
    save_file(build(cfg, normal, ones), os.path.join(directory, "model.safetensors"))


def attention_weights(cfg: Dict, prefix: str, normal, ones) -> Dict:
    """One layer's attention and norms (q/k/v/o projections, per-head q/k norms)."""
    hidden, head_dim = cfg["hidden_size"], cfg["head_dim"]
    q_rows, kv_rows = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    p, a = prefix, prefix + "self_attn."
    return {p + "input_layernorm.weight": ones(hidden), p + "post_attention_layernorm.weight": ones(hidden),
            a + "q_proj.weight": normal(q_rows, hidden), a + "k_proj.weight": normal(kv_rows, hidden),
            a + "v_proj.weight": normal(kv_rows, hidden), a + "o_proj.weight": normal(hidden, q_rows),
            a + "q_norm.weight": ones(head_dim), a + "k_norm.weight": ones(head_dim)}


def ffn_weights(prefix: str, hidden: int, inter: int, normal) -> Dict:
    """A SwiGLU FFN's gate/up/down projections under `prefix` (an expert or a shared expert)."""
    return {prefix + "gate_proj.weight": normal(inter, hidden), prefix + "up_proj.weight": normal(inter, hidden),
            prefix + "down_proj.weight": normal(hidden, inter)}


def qwen3_moe_weights(cfg: Dict, normal, ones) -> Dict:
    """Qwen3-MoE checkpoint tensors."""
    hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    weights = {"model.embed_tokens.weight": normal(cfg["vocab_size"], hidden), "model.norm.weight": ones(hidden),
               "lm_head.weight": normal(cfg["vocab_size"], hidden)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        weights.update(attention_weights(cfg, p, normal, ones))
        weights[p + "mlp.gate.weight"] = normal(cfg["num_experts"], hidden)
        for e in range(cfg["num_experts"]):
            weights.update(ffn_weights(f"{p}mlp.experts.{e}.", hidden, inter, normal))
    return weights


def glm4_moe_weights(cfg: Dict, normal, ones) -> Dict:
    """GLM-4 MoE checkpoint tensors, the nextn (MTP) layers included: those follow the decoder
    layers as model.layers.{num_hidden_layers + i}, a decoder layer plus the MTP head's eh_proj
    [hidden, 2 * hidden], enorm, hnorm and shared_head.norm (the draft shares the target's
    embedding and LM head, so shared_head.head is not written)."""
    import torch

    hidden, inter, experts = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    weights = {"model.embed_tokens.weight": normal(cfg["vocab_size"], hidden), "model.norm.weight": ones(hidden),
               "lm_head.weight": normal(cfg["vocab_size"], hidden)}
    layers = cfg["num_hidden_layers"]
    for layer in range(layers + cfg.get("num_nextn_predict_layers", 0)):
        p = f"model.layers.{layer}."
        weights.update(attention_weights(cfg, p, normal, ones))
        weights[p + "mlp.gate.weight"] = normal(experts, hidden)
        weights[p + "mlp.gate.e_score_correction_bias"] = normal(experts).float()  # fp32, as GLM ships it
        for e in range(experts):
            weights.update(ffn_weights(f"{p}mlp.experts.{e}.", hidden, inter, normal))
        weights.update(ffn_weights(p + "mlp.shared_experts.", hidden, inter * cfg["n_shared_experts"], normal))
        if layer >= layers:
            weights.update({p + "eh_proj.weight": normal(hidden, 2 * hidden), p + "enorm.weight": ones(hidden),
                            p + "hnorm.weight": ones(hidden), p + "shared_head.norm.weight": ones(hidden)})
    assert all(t.dtype in (torch.bfloat16, torch.float32) for t in weights.values())
    return weights


def _write_json(path: str, payload: Dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang_oea.tiny_model", description=__doc__.split("\n")[0])
    p.add_argument("--arch", choices=["qwen3_moe", "glm4_moe"], required=True)
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--num-experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--moe-intermediate-size", type=int, default=384)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-groups", type=int, default=8, help="glm4_moe: expert groups (n_group)")
    p.add_argument("--topk-group", type=int, default=4, help="glm4_moe: groups each token may use")
    p.add_argument("--vocab-size", type=int, default=1024, help="BPE vocabulary size to train")
    p.add_argument("--nextn-layers", type=int, default=0, choices=[0, 1],
                   help="glm4_moe: MTP (nextn) layers after the decoder layers (the EAGLE draft SGLang loads)")
    p.add_argument("--random-weights", action="store_true",
                   help="also write model.safetensors with seeded random weights")
    args = p.parse_args(argv)
    if args.nextn_layers and args.arch != "glm4_moe":
        p.error(f"--nextn-layers needs --arch glm4_moe, got {args.arch}")
    if args.top_k > args.num_experts:
        p.error(f"--top-k must be <= --num-experts ({args.num_experts}), got {args.top_k}")
    if args.arch == "glm4_moe" and args.num_experts % args.num_groups:
        p.error(f"--num-experts ({args.num_experts}) must be divisible by --num-groups ({args.num_groups})")
    return args


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    write_model(args)
    if args.random_weights:
        write_random_weights(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
