"""Load a deepseek_v3 checkpoint with SGLang 0.5.23's own model classes and loaders, on the CPU.

    python test/srt/benchmark/sglang_deepseek_load.py MODEL_DIR      # prints one JSON line

Builds DeepseekV3ForCausalLM (the target) and DeepseekV3ForCausalLMNextN (the MTP draft) from
MODEL_DIR/config.json in float32, fills every parameter with NaN, runs each class's load_weights
over MODEL_DIR/model.safetensors, and reports, per class, the parameters still holding a NaN (never
written by the loader), every parameter name, and the warnings the loader logged. A few loaded
values are checked against the checkpoint tensors they come from (SGLang fuses some on load).

Run in a subprocess with sglang_oea.cpu_serve.cpu_environment(): it initialises a one-process
torch.distributed group, as SGLang's layers need one even at TP 1.
"""

import json
import logging
import os
import socket
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(HERE))), "python"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_sglang(model_dir: str) -> None:
    """One-process distributed groups and resolved server args, as SGLang's model classes need."""
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs
    from sglang.test.layer_ut_utils import init_single_process_dist

    init_single_process_dist(master_port=free_port())
    server_args = ServerArgs(model_path=model_dir, device="cpu", attention_backend="torch_native",
                             disable_cuda_graph=True)
    server_args.resolve_once()
    get_context().set_server_args(server_args)


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def load(cls, model_dir: str, checkpoint: dict, warnings: Warnings):
    """An instance of `cls` whose parameters start as NaN, after its load_weights over `checkpoint`."""
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    config.torch_dtype = torch.float32
    model = cls(config)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))
    warnings.messages.clear()
    model.load_weights(iter(checkpoint.items()))
    return model


def report(model, warnings: Warnings) -> dict:
    import torch

    return {"unloaded": sorted(n for n, p in model.named_parameters() if torch.isnan(p).any()),
            "parameters": sorted(n for n, _ in model.named_parameters()), "warnings": list(warnings.messages)}


def fused_values_match(target, draft, checkpoint: dict, layers: int) -> dict:
    """Loaded tensors equal their checkpoint sources, fusions included (last MoE layer, expert 1)."""
    import torch

    moe, mtp = f"model.layers.{layers - 1}.", f"model.layers.{layers}."

    def gate_up(prefix):
        return torch.cat([checkpoint[f"{prefix}mlp.experts.1.gate_proj.weight"],
                          checkpoint[f"{prefix}mlp.experts.1.up_proj.weight"]]).float()

    def qkv_a(prefix):
        return torch.cat([checkpoint[f"{prefix}self_attn.q_a_proj.weight"],
                          checkpoint[f"{prefix}self_attn.kv_a_proj_with_mqa.weight"]]).float()

    pairs = {
        "target experts w13": (target.model.layers[layers - 1].mlp.experts.w13_weight[1], gate_up(moe)),
        "target fused_qkv_a": (target.model.layers[layers - 1].self_attn.fused_qkv_a_proj_with_mqa.weight,
                               qkv_a(moe)),
        "target correction bias": (target.model.layers[layers - 1].mlp.gate.e_score_correction_bias,
                                   checkpoint[f"{moe}mlp.gate.e_score_correction_bias"].float()),
        "draft eh_proj": (draft.model.eh_proj.weight, checkpoint[f"{mtp}eh_proj.weight"].float()),
        "draft enorm": (draft.model.enorm.weight, checkpoint[f"{mtp}enorm.weight"].float()),
        "draft hnorm": (draft.model.hnorm.weight, checkpoint[f"{mtp}hnorm.weight"].float()),
        "draft shared_head.norm": (draft.model.shared_head.norm.weight,
                                   checkpoint[f"{mtp}shared_head.norm.weight"].float()),
        "draft experts w13": (draft.model.decoder.mlp.experts.w13_weight[1], gate_up(mtp)),
        "draft experts w2": (draft.model.decoder.mlp.experts.w2_weight[1],
                             checkpoint[f"{mtp}mlp.experts.1.down_proj.weight"].float()),
        "draft fused_qkv_a": (draft.model.decoder.self_attn.fused_qkv_a_proj_with_mqa.weight, qkv_a(mtp)),
        "draft correction bias": (draft.model.decoder.mlp.gate.e_score_correction_bias,
                                  checkpoint[f"{mtp}mlp.gate.e_score_correction_bias"].float()),
    }
    return {name: bool(torch.equal(got.detach().float(), want)) for name, (got, want) in pairs.items()}


def main(model_dir: str) -> dict:
    import torch
    from safetensors.torch import load_file

    torch.set_num_threads(1)
    init_sglang(model_dir)
    from sglang.srt.models.deepseek_nextn import DeepseekV3ForCausalLMNextN
    from sglang.srt.models.deepseek_v2 import DeepseekV3ForCausalLM

    checkpoint = load_file(os.path.join(model_dir, "model.safetensors"))
    warnings = Warnings()
    logging.getLogger().addHandler(warnings)
    target = load(DeepseekV3ForCausalLM, model_dir, checkpoint, warnings)
    result = {"target": report(target, warnings)}
    draft = load(DeepseekV3ForCausalLMNextN, model_dir, checkpoint, warnings)
    result["draft"] = report(draft, warnings)
    result["values_match"] = fused_values_match(target, draft, checkpoint, target.config.num_hidden_layers)
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
