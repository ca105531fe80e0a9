"""The built-model refusal: a routed layer whose top-k output hides topk_ids stops startup.

Unit tests build real SGLang TopK layers and bind them to MoE runner backends as SGLang's models do
(DeepSeek-style biased grouped routing, the GLM-5 router). The server test starts the real CPU
server with a throwaway plugin that binds every TopK the way flashinfer_trtllm does on Blackwell
(BYPASSED), which no CPU backend does, and checks that the server stops before its memory pools.
"""

import os
import subprocess
import sys
import types

import pytest
import torch

from sglang_oea import hooks, startup_checks
from sglang_oea.cpu.serve import cpu_environment
from sglang_oea.cpu.tiny_model import main as write_tiny_model

NUM_EXPERTS, TOP_K = 64, 8


class Block(torch.nn.Module):
    def __init__(self, topk):
        super().__init__()
        self.topk = topk


class Model(torch.nn.Module):
    """Stands in for a built model: one MoE block per layer, each owning a real SGLang TopK."""

    def __init__(self, topks):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(topk) for topk in topks)


def deepseek_topk(layer_id, backend_name):
    """A TopK as DeepseekV2MoE builds it for an NVFP4 checkpoint (output format left to the
    runner backend), bound to `backend_name`."""
    from sglang.srt.layers.moe.topk import TopK
    from sglang.srt.layers.moe.utils import MoeRunnerBackend, RoutingMethodType
    from sglang.srt.runtime_context import get_context

    with get_context().override_server_args(device="cpu"):
        topk = TopK(TOP_K, layer_id=layer_id, use_grouped_topk=True, num_expert_group=8, topk_group=4,
                    renormalize=True, correction_bias=torch.zeros(NUM_EXPERTS), routed_scaling_factor=2.5)
        topk.bind_runner_backend(MoeRunnerBackend(backend_name), routing_method_type=RoutingMethodType.DeepSeekV3)
    return topk


def runner(model, quantization="modelopt_fp4", draft=False):
    return types.SimpleNamespace(model=model, model_config=types.SimpleNamespace(quantization=quantization),
                                 is_draft_worker=draft)


def test_bypassed_layers_are_refused_with_the_flags_that_fix_them():
    model = Model([deepseek_topk(0, "flashinfer_cutlass"), deepseek_topk(1, "flashinfer_trtllm"),
                   deepseek_topk(2, "flashinfer_trtllm")])
    assert model.layers[1].topk.topk_config.output_format.name == "BYPASSED", "SGLang's own binding"
    with pytest.raises(ValueError) as exc:
        hooks.model_built_hook(None, runner(model))
    assert str(exc.value) == (
        "--oea-k0 needs top-k ids, but routed layer layers.1.topk (layer_id 1) (and 1 more routed layers) runs MoE "
        "runner backend flashinfer_trtllm (the layer's quantization method chose it) with --moe-runner-backend "
        "auto, whose top-k output format is BYPASSED: the MoE kernel routes from the raw router logits, so no "
        "topk_ids exist; start the server with --quantization modelopt_fp4 --moe-runner-backend flashinfer_cutlass"
    )


@pytest.mark.parametrize("backend", ["flashinfer_cutlass", "triton", "flashinfer_trtllm_routed"])
def test_layers_with_standard_output_pass(backend):
    model = Model([deepseek_topk(0, backend), deepseek_topk(1, backend)])
    assert model.layers[0].topk.topk_config.output_format.name == "STANDARD"
    hooks.model_built_hook(None, runner(model))


def test_the_draft_model_is_not_checked():
    """OEA never routes the draft model's layers, so their output format does not matter."""
    hooks.model_built_hook(None, runner(Model([deepseek_topk(0, "flashinfer_trtllm")]), draft=True))


def test_triton_kernel_output_is_refused():
    model = Model([deepseek_topk(3, "triton_kernel")])
    with pytest.raises(ValueError) as exc:
        hooks.model_built_hook(None, runner(model, quantization=None))
    assert ("layers.0.topk (layer_id 3) runs MoE runner backend triton_kernel (the layer's quantization method chose "
            "it) with --moe-runner-backend auto, whose top-k output format is TRITON_KERNEL: it passes ragged routing "
            "metadata instead of topk_ids; start the server with --moe-runner-backend triton") in str(exc.value)


@pytest.mark.parametrize("quantization,advice", [
    (None, "--moe-runner-backend triton"),
    ("fp8", "--quantization fp8 --moe-runner-backend triton"),
    ("modelopt_fp4", "--quantization modelopt_fp4 --moe-runner-backend flashinfer_cutlass"),
    ("mxfp8", "a --moe-runner-backend that keeps top-k ids: triton (bf16, fp8)"),
])
def test_advice_follows_the_quantization(quantization, advice):
    assert startup_checks.backend_advice(quantization).startswith(advice)


# ----------------------------------------------------------------------------- the real server

FORCE_BYPASSED_PLUGIN = '''
"""Test plugin: every TopK binds as flashinfer_trtllm does on Blackwell (BYPASSED output)."""


def force_bypassed(result, topk, *args, **kwargs):
    from sglang.srt.layers.moe.topk import TopKOutputFormat

    topk.topk_config.output_format = TopKOutputFormat.BYPASSED


def register():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.layers.moe.topk.TopK.bind_runner_backend", force_bypassed, HookType.AFTER)
'''


def write_plugin(directory):
    """A plugin distribution SGLang's loader finds on PYTHONPATH (entry point group sglang.srt.plugins)."""
    with open(os.path.join(directory, "oea_force_bypassed.py"), "w") as f:
        f.write(FORCE_BYPASSED_PLUGIN)
    info = os.path.join(directory, "oea_force_bypassed-0.0.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: oea-force-bypassed\nVersion: 0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[sglang.srt.plugins]\noea_force_bypassed = oea_force_bypassed:register\n")


@pytest.mark.server
def test_server_stops_before_its_memory_pools(tmp_path):
    model = str(tmp_path / "moe")
    write_tiny_model(["--arch", "qwen3_moe", "--out", model, "--num-experts", "16", "--top-k", "4", "--num-layers", "2",
                      "--hidden-size", "64", "--moe-intermediate-size", "32"])
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    write_plugin(str(plugin))
    env = cpu_environment()
    env.pop(hooks.CONFIG_ENV, None)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(plugin)])
    args = ["--model-path", model, "--load-format", "dummy", "--device", "cpu", "--attention-backend", "torch_native",
            "--disable-cuda-graph", "--mem-fraction-static", "0.1", "--oea-k0", "2"]
    proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", *args], env=env, capture_output=True,
                          text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    assert ("ValueError: --oea-k0 needs top-k ids, but routed layer model.layers.0.mlp.topk (layer_id 0) (and 1 more "
            "routed layers) runs MoE runner backend") in log, log[-3000:]
    assert "whose top-k output format is BYPASSED" in log
    assert "Load weight end" in log, "refused once the model is built"
    assert "KV Cache is allocated" not in log and "fired up" not in log, "before the memory pools; never served"
