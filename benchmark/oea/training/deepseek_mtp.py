"""DeepSeek-V3 (the GLM-5 family) for train_moe.py: config, the multi-token-prediction (MTP) layer, its
loss, and the checkpoint names SGLang 0.5.23 loads.

Main model: transformers' DeepseekV3ForCausalLM. MLA attention, one dense first layer
(first_k_dense_replace = 1), then MoE layers with sigmoid scores, e_score_correction_bias
(noaux_tc, balanced aux-loss-free by train_moe.py), one shared expert, routed_scaling_factor,
and yarn rope.

MTP, one depth (DeepSeek-V3 report, section 2.2), with h_t the main model's hidden state at
position t AFTER its final norm (model.norm) and E the main model's embedding and head:
    x_t    = eh_proj([enorm(E(tok_{t+1})) ; hnorm(h_t)])           # embedding first
    g_t    = DecoderLayer(x_0 .. x_t)                               # MoE layer, causal, at position t
    logits = lm_head(shared_head.norm(g_t))                         # predicts tok_{t+2}
    loss   = main next-token NLL + mtp_loss_weight * MTP t+2 NLL

Why exactly this input (SGLang 0.5.23, paths below sglang/srt/):
  - models/deepseek_v2.py:3238-3241 applies model.norm before returning the hidden states, and
    3422-3424 hands those to the logits processor without hidden_states_before_norm, so
    layers/logits_processor.py:871 stores the post-norm state; speculative/eagle_worker_v2.py:1555
    captures it (FULL) in the target prefill and 1597 passes it to the draft.
  - speculative/eagle_worker_v2.py:993-996 shifts the draft's input ids left by one (position t
    gets tok_{t+1}), 1010 attaches the target hidden states unshifted (position t gets h_t).
  - models/deepseek_nextn.py:198 reads them as spec_info.hidden_states; 212-218 concatenates
    (enorm(embedding), hnorm(hidden)) in that order; 227 runs the decoder layer; 236-238 applies
    shared_head.norm; 294-300 its lm_head.
  - speculative/eagle_worker_v2.py:336-378 (init_lm_head) binds the TARGET's embedding and
    lm_head into the draft (models/deepseek_v2.py:3442-3446), so the MTP layer is trained with
    the main model's E and lm_head, shared, as in DeepSeek-V3.

Checkpoint names (models/deepseek_common/deepseek_weight_loader.py): the MTP layer is stored as
model.layers.{num_hidden_layers}.* (570-587). The draft (DeepseekV3ForCausalLMNextN, chosen for a
DeepseekV3ForCausalLM draft by configs/model_config.py:1032-1036) maps enorm, hnorm, eh_proj and
shared_head.norm to model.* and everything else to model.decoder.* (333-335); it skips the layer's
own embed_tokens and shared_head.head (326-329), which this module still writes, copies of the main
model's, as DeepSeek-V3's checkpoint does. The target skips layers >= num_hidden_layers (336-345).
transformers ignores them too: it reports them as unexpected keys and loads the main model.

Shapes: B = sequences, S = sequence length, H = hidden size, V = vocab, E = experts, I = expert width.
"""

import argparse
import json
import os
from typing import Dict, Iterable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

MTP_RECORD = {  # training.json's objective.mtp: what was trained, and the SGLang 0.5.23 lines that say why
    "formula": "logits_{t+2} = lm_head(shared_head.norm(MoE_decoder_layer(eh_proj(cat(enorm(embed(tok_{t+1})), "
               "hnorm(h_t)))))), positions 0..S-2, causal; embed and lm_head shared with the main model",
    "h_t": "main model hidden state after its final norm (model.norm); gradients flow into the main model",
    "checkpoint": "model.layers.{num_hidden_layers}.{enorm,hnorm,eh_proj,shared_head.norm,<decoder layer>,"
                  "embed_tokens,shared_head.head} (the last two copies of the main model's, not loaded by SGLang)",
    "sglang_0_5_23_evidence": {
        "target returns post-norm hidden states": "srt/models/deepseek_v2.py:3238-3241, 3422-3424",
        "logits processor stores them (no before-norm state given)": "srt/layers/logits_processor.py:866-871",
        "target prefill captures FULL and hands them to the draft": "srt/speculative/eagle_worker_v2.py:1555, 1597",
        "draft ids shifted left by one, hidden states not": "srt/speculative/eagle_worker_v2.py:993-996, 1010",
        "concat order (enorm(embed), hnorm(hidden)), then eh_proj": "srt/models/deepseek_nextn.py:198, 212-222",
        "shared_head.norm after the decoder layer": "srt/models/deepseek_nextn.py:227-238",
        "draft uses the target's embed and lm_head": "srt/speculative/eagle_worker_v2.py:336-378, "
                                                     "srt/models/deepseek_v2.py:3442-3446",
        "nextn layer is MoE": "srt/models/deepseek_v2.py:2785-2792 (_is_layer_sparse: is_nextn or ...)",
        "nextn names: layer num_hidden_layers, spec names to model.*, the rest to model.decoder.*":
            "srt/models/deepseek_common/deepseek_weight_loader.py:319-335, 567-587",
        "nextn loader skips embed_tokens and shared_head.head":
            "srt/models/deepseek_common/deepseek_weight_loader.py:326-329",
        "target loader skips layers >= num_hidden_layers":
            "srt/models/deepseek_common/deepseek_weight_loader.py:336-345",
        "draft architecture DeepseekV3ForCausalLMNextN": "srt/configs/model_config.py:1032-1036",
    },
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def deepseek_v3_config(args: argparse.Namespace, base: Dict) -> Dict:
    """config.json for DeepseekV3ForCausalLM from sglang_oea.tiny_model.common_config's `base`.

    MLA sizes follow from --hidden-size and --num-heads (head = H / heads): qk_nope_head_dim =
    v_head_dim = head, qk_rope_head_dim = head / 2, q_lora_rank = kv_lora_rank = H / 2.
    """
    from sglang_oea.cpu.tiny_model import sigmoid_bias_moe

    head = args.hidden_size // args.num_heads
    config = {key: value for key, value in base.items() if key not in ("head_dim", "rope_theta")}
    return {
        **config,
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **sigmoid_bias_moe(args, dense_layers=1),
        "q_lora_rank": args.hidden_size // 2,
        "kv_lora_rank": args.hidden_size // 2,
        "qk_nope_head_dim": head,
        "qk_rope_head_dim": head // 2,
        "v_head_dim": head,
        "rope_interleave": True,
        "rope_scaling": {**YARN, "type": "yarn"},
        "rope_theta": base["rope_theta"],
        "num_nextn_predict_layers": 1,
    }


def write_deepseek_v3_model(args: argparse.Namespace, texts: Iterable[str]) -> None:
    """Tokenizer (trained on `texts`), config.json and generation_config.json into args.out."""
    from sglang_oea.cpu.tiny_model import SPECIAL_TOKENS, common_config, train_tokenizer

    os.makedirs(args.out, exist_ok=True)
    vocab_size = train_tokenizer(args.out, args.vocab_size, texts)
    base = common_config(args, vocab_size, eos_id=SPECIAL_TOKENS.index("<|endoftext|>"))
    for name, payload in [("config.json", deepseek_v3_config(args, base)),
                          ("generation_config.json", {"eos_token_id": base["eos_token_id"]})]:
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(payload, f, indent=2)


class MTPLayer(nn.Module):
    """One DeepSeek-V3 MTP depth, attribute names as SGLang's DeepseekModelNextN (decoder: a
    transformers DeepseekV3DecoderLayer, MoE). The embedding and head are the main model's."""

    def __init__(self, config):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = DeepseekV3RMSNorm(hidden, eps)
        self.hnorm = DeepseekV3RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        # layer_idx >= first_k_dense_replace: a MoE layer, as SGLang's nextn decoder layer is.
        self.decoder = DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers)
        self.shared_head = nn.Module()
        self.shared_head.norm = DeepseekV3RMSNorm(hidden, eps)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor,
                position_embeddings: Tuple[torch.Tensor, torch.Tensor], attention_mask: Optional[torch.Tensor],
                position_ids: torch.Tensor) -> torch.Tensor:
        """shared_head.norm(decoder(eh_proj([enorm(embeds); hnorm(hidden)]))): [B, T, H] from two [B, T, H]."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        x = self.decoder(x, attention_mask=attention_mask, position_ids=position_ids,
                         position_embeddings=position_embeddings)
        return self.shared_head.norm(x)


def build_mtp(model, seed: int) -> MTPLayer:
    """A seeded MTPLayer for `model`, initialised by the model's own _init_weights (std initializer_range)."""
    torch.manual_seed(seed + 1)
    mtp = MTPLayer(model.config).to(model.dtype)
    for module in mtp.modules():
        model._init_weights(module)
    return mtp


def mtp_logits(model, mtp: MTPLayer, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """Logits for tok_{t+2} at each position t: [B, T, V] float32.

    hidden [B, T, H]: the main model's post-norm hidden states h_0 .. h_{T-1};
    next_ids [B, T]: tok_1 .. tok_T (the ids shifted left by one). Positions 0 .. T-1.
    """
    from transformers.masking_utils import create_causal_mask

    embeds = model.model.embed_tokens(next_ids)  # [B, T, H]
    position_ids = torch.arange(next_ids.shape[1], device=next_ids.device).unsqueeze(0)
    position_embeddings = model.model.rotary_emb(embeds, position_ids)
    mask = create_causal_mask(config=model.config, inputs_embeds=embeds, attention_mask=None,
                              past_key_values=None, position_ids=position_ids)
    return model.lm_head(mtp(hidden, embeds, position_embeddings, mask, position_ids)).float()


def main_and_mtp_logits(model, mtp: MTPLayer, ids: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(main logits [B, S, V] predicting tok_{t+1}, MTP logits [B, S - 1, V] predicting tok_{t+2}), float32."""
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state  # [B, S, H], after model.norm
    return model.lm_head(hidden).float(), mtp_logits(model, mtp, hidden[:, :-1], ids[:, 1:])


def main_and_mtp_nll(model, mtp: MTPLayer, ids: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Per-token NLLs and argmax hits of both heads on ids [B, S]: main [B, S - 1] (targets tok_{t+1}),
    mtp [B, S - 2] (targets tok_{t+2}), and mtp_agrees [B, S - 2]: the MTP argmax equals the main
    model's argmax at t + 1 (what greedy speculative decoding would accept)."""
    logits, draft = main_and_mtp_logits(model, mtp, ids)
    main = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    mtp_nll = F.cross_entropy(draft[:, :-1].transpose(1, 2), ids[:, 2:], reduction="none")
    guess = draft[:, :-1].argmax(-1)  # [B, S - 2]
    return {"main": main, "main_hit": logits[:, :-1].argmax(-1) == ids[:, 1:], "mtp": mtp_nll,
            "mtp_hit": guess == ids[:, 2:], "mtp_agrees": guess == logits[:, 1:-1].argmax(-1)}


def mtp_checkpoint_tensors(model, mtp: MTPLayer) -> Dict[str, torch.Tensor]:
    """The MTP layer under SGLang's nextn names, model.layers.{num_hidden_layers}.*, experts one per
    name as transformers writes the main model's, plus copies of the embedding and head."""
    prefix = f"model.layers.{model.config.num_hidden_layers}."
    tensors = {}
    for name, tensor in mtp.state_dict().items():
        name = name[len("decoder."):] if name.startswith("decoder.") else name
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                tensors[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate[e]
                tensors[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up[e]
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            for e in range(tensor.shape[0]):
                tensors[f"{prefix}mlp.experts.{e}.down_proj.weight"] = tensor[e]
        else:
            tensors[prefix + name] = tensor
    tensors[prefix + "embed_tokens.weight"] = model.model.embed_tokens.weight
    tensors[prefix + "shared_head.head.weight"] = model.lm_head.weight
    return {name: t.detach().contiguous() for name, t in tensors.items()}


def append_mtp_weights(path: str, model, mtp: MTPLayer, dtype: torch.dtype) -> int:
    """Add the MTP layer (in `dtype`, its correction bias float32) to the safetensors file at `path`; its bytes."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    for name, tensor in mtp_checkpoint_tensors(model, mtp).items():
        tensors[name] = tensor.float() if name.endswith("e_score_correction_bias") else tensor.to(dtype)
    save_file(tensors, path, metadata={"format": "pt"})
    return os.path.getsize(path)


def load_mtp(model_dir: str, model) -> MTPLayer:
    """The MTPLayer stored in model_dir/model.safetensors under model.layers.{num_hidden_layers}.*, in model's dtype."""
    from safetensors import safe_open

    prefix = f"model.layers.{model.config.num_hidden_layers}."
    with safe_open(os.path.join(model_dir, "model.safetensors"), framework="pt") as f:
        stored = {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    experts, mtp, state = model.config.n_routed_experts, MTPLayer(model.config), {}
    for name in mtp.state_dict():
        if name.endswith("mlp.experts.gate_up_proj"):
            state[name] = torch.stack([torch.cat([stored[f"mlp.experts.{e}.gate_proj.weight"],
                                                  stored[f"mlp.experts.{e}.up_proj.weight"]]) for e in range(experts)])
        elif name.endswith("mlp.experts.down_proj"):
            state[name] = torch.stack([stored[f"mlp.experts.{e}.down_proj.weight"] for e in range(experts)])
        else:
            state[name] = stored[name[len("decoder."):] if name.startswith("decoder.") else name]
    mtp.load_state_dict({k: v.to(model.dtype) for k, v in state.items()})
    return mtp.eval()
