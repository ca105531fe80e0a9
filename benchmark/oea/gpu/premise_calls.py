"""The MoE layers that moe_premise.py times: its shapes, and the MoE function SGLang 0.5.23 itself
calls for each backend, set up with random weights of the dtype, layout and scale factors that
SGLang's quantization method hands that function.

Shape legend: E = routed experts (all of them on every rank under tensor parallelism), H = hidden
size, I = one expert's FFN width on one rank (moe_intermediate_size / tp), K = top-k, R = rows.

    backend              dtype   GPUs              what is called (as SGLang 0.5.23 calls it)
    flashinfer_cutlass   nvfp4   sm_100, sm_120    flashinfer.fused_moe.cutlass_fused_moe, from
                                                   moe_runner/flashinfer_cutlass.py (_run_flashinfer_cutlass)
    triton               bf16    sm_90             fused_experts (moe_runner/triton_utils/fused_moe.py),
                         fp8                       from moe_runner/triton.py (fused_experts_none_to_triton)

The dry run (the CPU) times a plain-torch stand-in that reads only the experts with tokens: it
tests the command's pipeline, and its times are not a GPU's and not SGLang's kernel's.
"""

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import torch

# Backends by SGLang's --moe-runner-backend name; "fused_moe_triton" is the triton runner's kernel folder.
BACKEND_ALIASES = {"flashinfer_cutlass": "flashinfer_cutlass", "triton": "triton", "fused_moe_triton": "triton"}
DTYPES = ("nvfp4", "fp8", "bf16")
# (backend, dtype) -> {compute capability major: arch name}
SUPPORTED: Dict[Tuple[str, str], Dict[int, str]] = {
    ("flashinfer_cutlass", "nvfp4"): {10: "sm_100", 12: "sm_120"},
    ("triton", "bf16"): {9: "sm_90"},
    ("triton", "fp8"): {9: "sm_90"},
}
DEFAULT_DTYPE_BY_MAJOR = {9: "bf16", 10: "nvfp4", 12: "nvfp4"}
NVFP4_GROUP = 16  # NVFP4: one fp8 block scale per 16 weights along K
NVFP4_ROWS = 64  # the expert width per rank: see check_shape_for
FP8_BLOCK = (128, 128)  # block fp8 checkpoints (DeepSeek-V3, GLM-5-FP8): one scale per 128 x 128

# The call each backend makes, found in the installed SGLang at run time (module path, text of the call).
CALL_SITES = {
    "flashinfer_cutlass": ("sglang/srt/layers/moe/moe_runner/flashinfer_cutlass.py",
                           "output = flashinfer_cutlass_fused_moe("),
    "triton": ("sglang/srt/layers/moe/moe_runner/triton.py", "output = fused_experts("),
}
FUNCTIONS = {
    "flashinfer_cutlass": "flashinfer.fused_moe.cutlass_fused_moe (NVFP4 weights, bf16 activations quantized inside)",
    "triton": "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe.fused_experts (inplace, as FusedMoE's default)",
    "torch": "a plain-torch stand-in that reads only the experts with tokens (dry run; not SGLang's kernel)",
}


@dataclass(frozen=True)
class PremiseShape:
    """One routed MoE layer on one tensor-parallel rank (shared experts are outside it)."""

    name: str
    experts: int  # E
    hidden: int  # H
    inter: int  # I, per rank
    top_k: int  # K
    tp: int

    def describe(self) -> str:
        return (f"{self.name}: {self.experts} experts, hidden {self.hidden}, expert FFN {self.inter * self.tp}"
                f"/{self.tp} = {self.inter} per rank (TP={self.tp}), top-{self.top_k}")


# name -> (E, H, moe_intermediate_size, K, default tp, default dtype)
PRESETS = {
    "glm5-nvfp4": (256, 6144, 2048, 8, 8, "nvfp4"),
    "glm5-fp8": (256, 6144, 2048, 8, 8, "fp8"),
    "glm5-bf16": (256, 6144, 2048, 8, 8, "bf16"),
    "qwen3-30b-a3b": (128, 2048, 768, 8, 1, "bf16"),
    "tiny": (64, 64, 64, 8, 1, None),  # the dry run's default
}
_EXPERT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
_TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k")
_INTER_KEYS = ("moe_intermediate_size", "expert_intermediate_size", "intermediate_size")


def _first(config: dict, keys, what: str, source: str) -> int:
    for key in keys:
        if isinstance(config.get(key), int) and config[key] > 0:
            return config[key]
    raise ValueError(f"--model-config {source}: no {what} (looked for {', '.join(keys)})")


def load_shape(model_config: str, tp: Optional[int]) -> Tuple[PremiseShape, Optional[str]]:
    """(shape, the preset's dtype or None) from a preset name or a HF config.json path.

    The expert width per rank is moe_intermediate_size / tp, which must divide evenly."""
    if model_config in PRESETS:
        E, H, inter, K, tp_default, dtype = PRESETS[model_config]
        name = model_config
    else:
        path = Path(model_config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"--model-config {model_config!r}: neither a preset ({', '.join(PRESETS)}) "
                             "nor a config.json file")
        config = json.loads(path.read_text())
        config = config.get("text_config", config) if "hidden_size" not in config else config
        E = _first(config, _EXPERT_KEYS, "expert count", model_config)
        H = _first(config, ("hidden_size",), "hidden size", model_config)
        inter = _first(config, _INTER_KEYS, "expert FFN width", model_config)
        K = _first(config, _TOPK_KEYS, "top-k", model_config)
        tp_default, dtype, name = 1, None, str(config.get("model_type", path.parent.name))
    tp = tp_default if tp is None else tp
    if tp < 1 or inter % tp:
        raise ValueError(f"--tp {tp}: must be >= 1 and divide the expert FFN width {inter}")
    if not 1 <= K <= E:
        raise ValueError(f"--model-config {model_config}: top-k {K} must be in [1, {E}]")
    return PremiseShape(name, E, H, inter // tp, K, tp), dtype


def arch_name(capability: Tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def check_supported(backend: str, dtype: str, capability: Optional[Tuple[int, int]]) -> None:
    """Raise ValueError, naming the flags and the allowed combinations, unless `backend` with `dtype`
    on a GPU of `capability` (None: on some supported GPU) is one this tool can time."""
    allowed = "; ".join(f"--backend {b} --dtype {d} on {', '.join(a.values())}" for (b, d), a in SUPPORTED.items())
    archs = SUPPORTED.get((backend, dtype))
    if archs is None:
        raise ValueError(f"--backend {backend} with --dtype {dtype} is not supported; supported: {allowed}")
    if capability is not None and capability[0] not in archs:
        raise ValueError(f"--backend {backend} --dtype {dtype} runs on {', '.join(archs.values())}, "
                         f"not on this {arch_name(capability)} GPU; supported: {allowed}")


def check_shape_for(dtype: str, shape: PremiseShape) -> None:
    """NVFP4 packs two values a byte and flashinfer reads the weights as int64: H must be a multiple
    of 16 (one block scale per 16). SGLang swizzles the gate-up block scales of [2I] rows in 128-row
    tiles and flashinfer wants 2 x I rounded up to 64: the two agree when I is a multiple of 64
    (SGLang refuses to pad a gated layer). Block fp8 splits I per rank in whole 128-wide blocks,
    as SGLang's Fp8MoEMethod requires."""
    if dtype == "nvfp4" and (shape.hidden % NVFP4_GROUP or shape.inter % NVFP4_ROWS):
        raise ValueError(f"--dtype nvfp4 needs hidden ({shape.hidden}) to be a multiple of {NVFP4_GROUP} and the "
                         f"expert width per rank ({shape.inter}, from --model-config and --tp) a multiple of "
                         f"{NVFP4_ROWS}")
    if dtype == "fp8" and shape.inter % FP8_BLOCK[0]:
        raise ValueError(f"--dtype fp8 (128 x 128 blocks) needs the expert width per rank ({shape.inter}, "
                         f"from --model-config and --tp) to be a multiple of {FP8_BLOCK[0]}")


def call_site(backend: str) -> Optional[str]:
    """'sglang/.../file.py:LINE' of the call this backend times, in the installed SGLang (found
    without importing it); None when SGLang is missing or the call is not there."""
    if backend not in CALL_SITES:
        return None
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    rel, needle = CALL_SITES[backend]
    path = Path(list(spec.submodule_search_locations)[0]).parent / rel
    if not path.is_file():
        return None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if needle in line:
            return f"{rel}:{number}"
    return None


def next_power_of_2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


class TorchStandIn:
    """Dry run: out = sum over a row's slots of w * (silu(x W_gate) * (x W_up)) W_down, one matmul
    pair per expert with tokens, in float32 on the CPU (gpu_moe.moe_loop_forward)."""

    backend, dtype = "torch", "float32"

    def __init__(self, shape: PremiseShape, gen: torch.Generator):
        E, H, inter = shape.experts, shape.hidden, shape.inter
        self.shape = shape
        self.x = torch.randn(1, H, generator=gen)
        self.w_up = torch.randn(E, H, 2 * inter, generator=gen) * H ** -0.5  # [E, H, 2I]
        self.w_down = torch.randn(E, inter, H, generator=gen) * inter ** -0.5  # [E, I, H]

    def prepare(self, rows: int) -> str:
        self.x = torch.randn(rows, self.shape.hidden, generator=torch.Generator().manual_seed(rows))
        return "no tuning (stand-in)"

    def bind(self, ids: torch.Tensor, weights: torch.Tensor) -> Callable[[], object]:
        from gpu.gpu_moe import loop_groups, moe_loop_forward

        groups = loop_groups(ids, weights, "cpu")  # sorted by expert outside the timed call
        return lambda: moe_loop_forward(self.x, self.w_up, self.w_down, groups)


class CutlassNvfp4:
    """flashinfer's cutlass_fused_moe with the arguments SGLang 0.5.23's _run_flashinfer_cutlass
    passes for modelopt_fp4 (ModelOptNvFp4FusedMoEMethod.apply, process_weights_after_loading):

        w13 uint8 [E, 2I, H/2] and w2 uint8 [E, H, I/2], two e2m1 values a byte, passed .view(int64);
        block scales fp8 e4m3 [E, 2I, H/16] and [E, H, I/16], swizzled by SGLang's
        swizzle_blockscale (padded to 128 rows, 4 columns), passed .view(int32);
        quant_scales = [1/a13 (0-d), w13 block scales, a13 * w13_scale_2 [E],
                        1/a2 (0-d), w2 block scales, a2 * w2_scale_2 [E]];
        bf16 activations (TP without DP attention quantizes no input before the call), bf16 output.
    `device` is "cuda" to time it; the tests build the arguments on the CPU.
    """

    backend, dtype = "flashinfer_cutlass", "nvfp4"

    def __init__(self, shape: PremiseShape, gen: torch.Generator, max_rows: int, autotune: bool,
                 device: str = "cuda"):
        from flashinfer.fused_moe import cutlass_fused_moe
        from flashinfer.fused_moe.core import ActivationType
        from sglang.srt.environ import envs
        from sglang.srt.layers.quantization.utils import swizzle_blockscale

        E, H, inter, dev = shape.experts, shape.hidden, shape.inter, device
        self.shape, self.autotune, self.device = shape, autotune, device
        self.fn, self.swiglu = cutlass_fused_moe, ActivationType.Swiglu
        self.fused_finalize = envs.SGLANG_FLASHINFER_MOE_FUSED_FINALIZE.get()
        # A decode server's tuning range (SGLang passes next_power_of_2(rows) there; a colocated
        # server min(max_prefill_tokens, 8192), which only adds larger buckets).
        self.tune_max = next_power_of_2(max_rows)
        self.w13 = torch.randint(0, 256, (E, 2 * inter, H // 2), dtype=torch.uint8, device=dev, generator=gen)
        self.w2 = torch.randint(0, 256, (E, H, inter // 2), dtype=torch.uint8, device=dev, generator=gen)

        def block_scales(rows: int, cols: int) -> torch.Tensor:  # [E, rows, cols / 16] fp8, swizzled, as int32
            s = torch.rand(E, rows, cols // NVFP4_GROUP, device=dev, generator=gen) + 0.5
            return swizzle_blockscale(s.to(torch.float8_e4m3fn)).view(torch.int32)

        a13, a2 = torch.tensor(4.0 / 2688, device=dev), torch.tensor(4.0 / 2688, device=dev)  # amax / (448 * 6)
        w_scale_2 = torch.full((E,), 0.02 / 6, device=dev)
        self.quant_scales = [1 / a13, block_scales(2 * inter, H), (a13 * w_scale_2).float(),
                             1 / a2, block_scales(H, inter), (a2 * w_scale_2).float()]
        self.x = self.out = None

    def prepare(self, rows: int) -> str:
        """The input and output of a batch of `rows`, and the tactics tuned as a server tunes them."""
        gen = torch.Generator(device=self.device).manual_seed(rows)
        self.x = torch.randn(rows, self.shape.hidden, dtype=torch.bfloat16, device=self.device, generator=gen)
        self.out = torch.empty_like(self.x)
        if not self.autotune:
            return "flashinfer autotune off (--no-autotune): default tactic"
        from flashinfer.autotuner import autotune

        ids = torch.stack([torch.randperm(self.shape.experts)[: self.shape.top_k] for _ in range(rows)])
        with autotune(True):  # as SGLang's startup autotune: tactics profiled, then cached per bucket
            self.bind(ids, torch.full(ids.shape, 1.0 / self.shape.top_k))()
        torch.cuda.synchronize()
        return f"flashinfer autotune over buckets up to {self.tune_max} rows"

    def call_kwargs(self, ids: torch.Tensor, weights: torch.Tensor) -> Dict[str, object]:
        """The keyword arguments of one call on ids [R, K] and weights [R, K], after prepare(R)."""
        return dict(output=self.out, input=self.x, token_selected_experts=ids.to(self.device, torch.int32),
                    token_final_scales=weights.to(self.device, torch.float32),
                    fc1_expert_weights=self.w13.view(torch.long), fc2_expert_weights=self.w2.view(torch.long),
                    output_dtype=torch.bfloat16, input_sf=None, quant_scales=self.quant_scales, swiglu_alpha=None,
                    swiglu_beta=None, swiglu_limit=None, ep_size=1, ep_rank=0, tp_size=self.shape.tp, tp_rank=0,
                    tune_max_num_tokens=self.tune_max, activation_type=self.swiglu, enable_alltoall=False,
                    use_fused_finalize=self.fused_finalize)

    def bind(self, ids: torch.Tensor, weights: torch.Tensor) -> Callable[[], object]:
        kwargs = self.call_kwargs(ids, weights)
        return lambda: self.fn(**kwargs)[0]


class TritonFusedMoE:
    """SGLang's fused_experts, as fused_experts_none_to_triton calls it for Fp8MoEMethod (block fp8,
    128 x 128 scales, dynamic activation quantization) or for unquantized bf16 weights:
    w13 [E, 2I, H], w2 [E, H, I]; fp8 scales float32 [E, 2 I/128, ceil(H/128)] and
    [E, ceil(H/128), I/128]. FusedMoE's default inplace=True overwrites the input, so each
    timed call first restores it from a copy; moe_premise.py subtracts that copy's own time.
    `device` is "cuda" to time it; the tests build the arguments on the CPU.
    """

    backend = "triton"

    def __init__(self, shape: PremiseShape, dtype: str, gen: torch.Generator, device: str = "cuda"):
        from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig
        from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import fused_experts
        from sglang.srt.layers.moe.topk import StandardTopKOutput

        E, H, inter, dev = shape.experts, shape.hidden, shape.inter, device
        self.shape, self.dtype, self.device = shape, dtype, device
        self.fn, self.topk_output = fused_experts, StandardTopKOutput
        self.config = MoeRunnerConfig(num_experts=E, num_local_experts=E, hidden_size=H,
                                      intermediate_size_per_partition=inter, top_k=shape.top_k,
                                      params_dtype=torch.bfloat16, activation="silu", is_gated=True, inplace=True)

        def weight(*size: int) -> torch.Tensor:
            w = torch.randn(*size, device=dev, generator=gen, dtype=torch.bfloat16) * size[-1] ** -0.5
            return w if dtype == "bf16" else (w * 64).to(torch.float8_e4m3fn)

        self.w13, self.w2 = weight(E, 2 * inter, H), weight(E, H, inter)
        self.scales: Dict[str, object] = {}
        if dtype == "fp8":
            bn, bk = FP8_BLOCK
            scale = lambda *size: torch.rand(*size, device=dev, generator=gen) / 64 + 1 / 128  # noqa: E731
            self.scales = dict(use_fp8_w8a8=True, block_shape=list(FP8_BLOCK),
                               w1_scale=scale(E, 2 * math.ceil(inter / bn), math.ceil(H / bk)),
                               w2_scale=scale(E, math.ceil(H / bn), math.ceil(inter / bk)))
        self.x0 = self.x = None

    def prepare(self, rows: int) -> str:
        gen = torch.Generator(device=self.device).manual_seed(rows)
        self.x0 = torch.randn(rows, self.shape.hidden, dtype=torch.bfloat16, device=self.device, generator=gen)
        self.x = self.x0.clone()
        return "Triton config from SGLang's tuned tables (try_get_optimal_moe_config), compiled on first call"

    def restore(self) -> Callable[[], object]:
        """The input copy alone, timed to subtract it."""
        return lambda: self.x.copy_(self.x0)

    def call_args(self, ids: torch.Tensor, weights: torch.Tensor) -> Tuple[tuple, Dict[str, object]]:
        """(positional, keyword) arguments of one call on ids [R, K] and weights [R, K], after prepare(R)."""
        topk = self.topk_output(weights.to(self.device, torch.float32), ids.to(self.device, torch.int32), None)
        return (self.x, self.w13, self.w2, topk, self.config), dict(b1=None, b2=None, a1_scale=None, a2_scale=None,
                                                                    **self.scales)

    def bind(self, ids: torch.Tensor, weights: torch.Tensor) -> Callable[[], object]:
        args, kwargs = self.call_args(ids, weights)

        def call():
            self.x.copy_(self.x0)
            return self.fn(*args, **kwargs)

        return call


def publish_server_args() -> None:
    """fused_experts reads SGLang's published config (deterministic mode, fused all-reduce); publish
    the defaults the way SGLang's own kernel tests do (sglang.test.test_utils.published_topology)."""
    from sglang.test.test_utils import published_topology

    published_topology().__enter__()  # left published for the life of this process


def make_backend(backend: str, dtype: str, shape: PremiseShape, gen: torch.Generator, max_rows: int,
                 autotune: bool):
    """The timed MoE call of one backend (GPU), with its weights on the device."""
    if backend == "flashinfer_cutlass":
        return CutlassNvfp4(shape, gen, max_rows, autotune)
    publish_server_args()
    return TritonFusedMoE(shape, dtype, gen)


def default_dtype(preset_dtype: Optional[str], capability: Optional[Tuple[int, int]]) -> str:
    if preset_dtype is not None:
        return preset_dtype
    return DEFAULT_DTYPE_BY_MAJOR.get(capability[0], "bf16") if capability else "nvfp4"


def default_backend(dtype: str) -> str:
    return "flashinfer_cutlass" if dtype == "nvfp4" else "triton"


def versions() -> str:
    """torch, triton, flashinfer and sglang versions, those installed."""
    from importlib import metadata

    out = [f"torch {torch.__version__}"]
    for dist in ("triton", "flashinfer-python", "sglang"):
        try:
            out.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(out)


def cpu_count() -> int:
    return os.cpu_count() or 1
