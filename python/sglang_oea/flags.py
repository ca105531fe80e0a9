"""The --oea-* server flags and the startup checks on the rest of the server's configuration.

No SGLang import: the hooks in sglang_oea.hooks pass SGLang's parser and records in.
Every refusal raises ValueError with one line naming the flag or setting and the allowed values.
"""

import argparse
import logging
import os
from typing import Any, Callable, Mapping, Optional

from sglang_oea.config import (
    DEFAULT_MIN_BATCH, ENGINE_KEYWORDS, KERNEL_CHOICES, MAX_BATCH, MAX_K0, SWITCH_CHOICES,
    OEAConfig, build_config, parse_int_flag,
)
from sglang_oea.model_info import SUPPORTED_FAMILIES, MoEShape, read_moe_shape

logger = logging.getLogger(__name__)

# SGLang's switch for DSPARK's ragged ("compact") verify graphs, keyed by token count.
RAGGED_VERIFY_ENV = "SGLANG_RAGGED_VERIFY_MODE"

# MoE runner backends whose top-k output carries no topk_ids for OEA to rewrite.
HIDDEN_TOPK_BACKENDS = {
    "flashinfer_trtllm": "routes inside the MoE kernel (BYPASSED top-k output)",
    "experimental_sgl_trtllm": "routes inside the MoE kernel, as flashinfer_trtllm does (BYPASSED top-k output)",
    "flashinfer_mxfp4": "routes inside the MoE kernel for non-FP4 experts (BYPASSED top-k output)",
    "triton_kernel": "passes ragged routing metadata instead of topk_ids (TRITON_KERNEL output)",
}
# When `auto` resolves to a backend that hides topk_ids: a backend that keeps them and runs the
# checkpoint's quantization in SGLang 0.5.23 (triton has no NVFP4 MoE path; cutlass refuses NVFP4).
FALLBACK_BY_QUANTIZATION = {
    None: "triton",
    "fp8": "triton",
    "modelopt_fp4": "flashinfer_cutlass",
    "modelopt_fp8": "flashinfer_cutlass",
    "modelopt_mixed": "flashinfer_cutlass",
}
WORKING_BACKENDS = (
    "triton (bf16, fp8), flashinfer_cutlass (modelopt_fp4, modelopt_fp8, modelopt_mixed) or "
    "flashinfer_trtllm_routed (nvfp4_online, mxfp8, modelopt_fp4 on SM100)"
)


def _int_type(flag: str, minimum: int, maximum: Optional[int] = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            return parse_int_flag(flag, text, minimum, maximum)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def add_oea_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the OEA argument group to SGLang's server parser."""
    group = parser.add_argument_group(
        "Opportunistic Expert Activation (sglang-oea)",
        "Batch-aware MoE routing for decode (arXiv 2511.02237). Not installed unless --oea-k0 is given.",
    )
    group.add_argument(
        "--oea-k0", type=_int_type("--oea-k0", 0, MAX_K0), default=None, metavar="K0",
        help="Experts each token keeps as its own; the rest of its top-k is refilled "
        "from experts the decode batch already loads. k0 >= the model's top-k is a no-op. 0 installs OEA "
        "but leaves it off (plain SGLang routing) until POST /set_internal_state sets oea_k0; "
        "k0, --oea-min-batch and --oea-max-batch can be changed that way on a running server.",
    )
    group.add_argument(
        "--oea-min-batch", type=_int_type("--oea-min-batch", 1, MAX_BATCH), default=DEFAULT_MIN_BATCH, metavar="M",
        help=f"Apply OEA only to decode batches with at least M real requests (default {DEFAULT_MIN_BATCH}; "
        "B=1 would be pure top-k0 pruning).",
    )
    group.add_argument(
        "--oea-max-batch", type=_int_type("--oea-max-batch", 0, MAX_BATCH), default=0, metavar="M",
        help="Skip OEA above M routed token rows (requests in decode, requests x draft tokens in a "
        "speculative verify pass), where the batch touches nearly every expert anyway "
        "(0 = no cap; see docs/operating.md for choosing M).",
    )
    group.add_argument(
        "--oea-disable-stats", action="store_true",
        help="Do not count distinct experts before/after OEA (the sglang:oea_* expert metrics).",
    )
    group.add_argument(
        "--oea-kernel", choices=KERNEL_CHOICES, default="auto",
        help="Routing implementation: auto (default) runs the fused Triton kernel on CUDA after a startup "
        "self-check that passed on every tensor-parallel rank, and otherwise turns OEA off with an error line "
        "(the torch path on the CPU); triton refuses to start without it; torch always uses the torch path.",
    )
    group.add_argument(
        "--oea-dump-router-logits", default=None, metavar="DIR",
        help="Record decode-step router logits into DIR for benchmark/oea/studies/simulate.py (off by default).",
    )
    group.add_argument(
        "--oea-dump-steps", type=_int_type("--oea-dump-steps", 1), default=32, metavar="N",
        help="With --oea-dump-router-logits: how many decode steps to record (default 32).",
    )
    group.add_argument(
        "--oea-check-ranks", type=_int_type("--oea-check-ranks", 0), default=0, metavar="N",
        help="Every N decode steps, compare a checksum of the experts OEA chose across tensor-parallel "
        "ranks and stop the server if they differ (0 = off, the default).",
    )
    group.add_argument(
        "--oea-verify", choices=tuple(SWITCH_CHOICES), default=None,
        help="With --speculative-algorithm: route the target model's verify passes, where it decodes "
        "(on, the default; every draft token is a row; --oea-min-batch counts requests, --oea-max-batch token rows), "
        "or leave them alone (off).",
    )


def config_from_namespace(args: argparse.Namespace, environ: Optional[Mapping[str, str]] = None) -> OEAConfig:
    """OEAConfig from parsed CLI arguments (plus the deprecated SGLANG_OEA_K0)."""
    values = {key: getattr(args, key, None) for key in ENGINE_KEYWORDS}
    return build_config(values, environ)


def check_a2a_backend(backend: Optional[str], resolved: bool = False) -> None:
    """Refuse all-to-all MoE dispatch: it places the experts on other ranks (expert parallel), and
    SGLang sets ep_size = tp_size for it. `resolved`: the value came out of SGLang's resolution."""
    if (backend or "none") == "none":
        return
    found = f"SGLang's argument resolution chose {backend}" if resolved else f"got {backend}"
    raise ValueError(
        f"--oea-k0 supports --moe-a2a-backend none only (all-to-all expert dispatch is expert parallel, "
        f"which is not supported yet); {found}"
    )


def check_parallelism(get: Callable[[str, Any], Any]) -> None:
    """Refuse the parallel layouts OEA does not support yet. `get(name, default)` reads a setting.

    Supported: tensor parallel on one node or across nodes (--nnodes), data-parallel replicas
    (--dp-size N without DP attention: every scheduler routes its own batch), and DP attention
    (every rank routes the batch gathered from every attention-DP group; check_dp_attention)
    (docs/scale-out.md)."""
    check_a2a_backend(get("moe_a2a_backend", "none"))
    if (get("ep_size", 1) or 1) > 1:
        raise ValueError(f"--oea-k0 supports --ep-size 1 only (expert parallel is not supported yet), got {get('ep_size', 1)}")
    if get("enable_dp_attention", False) or (get("attn_dp_size", 1) or 1) > 1:
        check_dp_attention(get)
    if get("use_ray", False):
        raise ValueError("--oea-k0 does not support --use-ray: Ray workers do not load SGLang plugins")


# DP attention settings under which the ranks would not route one gathered batch alike: flag -> why.
DP_ATTENTION_REFUSED = {
    "enable_dp_attention_local_control_broadcast": "each attention-DP group then receives live settings on its own, "
    "so the ranks could switch k0 at different passes",
    "enable_two_batch_overlap": "each half of the batch is gathered and routed on its own",
    "enable_single_batch_overlap": "it overlaps the MoE with an all-to-all dispatch (DeepEP, MoRI)",
}
# SGLang's environment switch that skips the ranks' per-pass metadata exchange (managers/scheduler_components/
# dp_attn.py): without it no rank knows the other groups' token counts.
SKIP_ALL_GATHER_ENV = "SGLANG_SCHEDULER_SKIP_ALL_GATHER"


def check_dp_attention(get: Callable[[str, Any], Any], environ: Optional[Mapping[str, str]] = None) -> None:
    """Refuse what keeps the ranks of a DP-attention server from routing one gathered batch alike."""
    for name, why in DP_ATTENTION_REFUSED.items():
        if get(name, False):
            raise ValueError(f"--oea-k0 with DP attention does not support --{name.replace('_', '-')}: {why}")
    for name in ("attn_cp_size", "dwdp_size"):
        if (get(name, 1) or 1) > 1:
            raise ValueError(f"--oea-k0 with DP attention supports --{name.replace('_', '-')} 1 only, got {get(name, 1)} "
                             "(its gathered layout is not supported yet)")
    environ = os.environ if environ is None else environ
    if environ.get(SKIP_ALL_GATHER_ENV, "").lower() in ("1", "true", "yes", "on"):
        raise ValueError(f"--oea-k0 with DP attention cannot run with {SKIP_ALL_GATHER_ENV} set: the ranks then do not "
                         "exchange their groups' token counts, which OEA needs to route the gathered batch alike")


def note_disaggregation(get: Callable[[str, Any], Any]) -> None:
    """Say once what OEA does on a prefill/decode-disaggregated server (sglang --disaggregation-mode).
    A decode server's batches are ordinary decode passes (routed as on any server); a prefill server
    runs no decode pass at all, so OEA there is armed but never applies."""
    mode = get("disaggregation_mode", "null") or "null"
    if mode == "prefill":
        logger.warning("sglang-oea: --disaggregation-mode prefill: this server runs only prefill passes, which OEA "
                       "never routes, so --oea-k0 changes nothing here; give it to the decode servers "
                       "(--disaggregation-mode decode), where the decode batches run.")
    elif mode == "decode":
        logger.info("sglang-oea: --disaggregation-mode decode: OEA routes this server's decode batches (the requests "
                    "whose KV cache the prefill servers transferred), as on a server that does both.")


def check_resolved_parallelism(get: Callable[[str, Any], Any]) -> None:
    """check_parallelism on the values SGLang resolved: resolution can turn on all-to-all dispatch
    (e.g. deepep for --enable-waterfill) and with it ep_size = tp_size, with neither flag given."""
    check_a2a_backend(get("moe_a2a_backend", "none"), resolved=True)
    try:
        check_parallelism(get)
    except ValueError as exc:
        raise ValueError(f"{exc} (after SGLang's argument resolution)") from None


def check_backend(backend: Optional[str]) -> None:
    """Refuse a MoE runner backend that hides topk_ids."""
    if backend in HIDDEN_TOPK_BACKENDS:
        raise ValueError(
            f"--oea-k0 needs top-k ids, but --moe-runner-backend {backend} {HIDDEN_TOPK_BACKENDS[backend]}; "
            f"use --moe-runner-backend {WORKING_BACKENDS}"
        )


def fallback_backend(resolved: str, quantization: Optional[str]) -> Optional[str]:
    """The backend to use instead of what `--moe-runner-backend auto` resolved to, or None to keep it.

    Raises ValueError with advice when the resolved backend hides topk_ids and no backend known to
    keep them runs this quantization.
    """
    if resolved not in HIDDEN_TOPK_BACKENDS:
        return None
    if quantization in FALLBACK_BY_QUANTIZATION:
        return FALLBACK_BY_QUANTIZATION[quantization]
    raise ValueError(
        f"--oea-k0 needs top-k ids, but --moe-runner-backend auto chose {resolved}, which "
        f"{HIDDEN_TOPK_BACKENDS[resolved]}, and sglang-oea knows no other backend for --quantization "
        f"{quantization}; pass one that keeps top-k ids and runs it: {WORKING_BACKENDS}"
    )


def check_serving_mode(cfg: OEAConfig, get: Callable[[str, Any], Any], environ: Optional[Mapping[str, str]] = None) -> None:
    """Refuse serving modes OEA cannot honour; say once how speculative decoding is routed."""
    if get("enable_deterministic_inference", False):
        raise ValueError(
            "--oea-k0 cannot be combined with --enable-deterministic-inference: with OEA a request's "
            "experts depend on the other requests in its decode batch, so its output does too"
        )
    if get("enable_pdmux", False):
        raise ValueError(
            "--oea-k0 does not support --enable-pdmux: its decode streams would share one routing workspace"
        )
    algorithm = get("speculative_algorithm", None)
    if algorithm:
        check_speculative(cfg, str(algorithm), os.environ if environ is None else environ)


def check_speculative(cfg: OEAConfig, algorithm: str, environ: Mapping[str, str]) -> None:
    """Under speculative decoding the target model decodes only in verify passes: say whether OEA
    routes them; refuse the verify layout whose padded rows the routing cannot tell apart."""
    if not cfg.verify:
        logger.warning(
            "sglang-oea: --oea-verify off with --speculative-algorithm %s: the target model decodes only in "
            "verify passes, so OEA is applied nowhere (verify passes are counted as skipped, reason target_verify).",
            algorithm,
        )
        return
    if algorithm.upper() == "DSPARK" and environ.get(RAGGED_VERIFY_ENV, "static").lower() == "compact":
        raise ValueError(
            f"--oea-verify on does not support {RAGGED_VERIFY_ENV}=compact (per-request verify lengths: the "
            "routing cannot tell padded rows from real ones); unset it, or pass --oea-verify off"
        )
    logger.info(
        "sglang-oea: --speculative-algorithm %s: OEA routes the target model's verify passes (every draft "
        "token is a row; --oea-min-batch counts requests, --oea-max-batch token rows). --oea-verify off leaves "
        "them alone.",
        algorithm,
    )


def check_kernel(cfg: OEAConfig, get: Callable[[str, Any], Any], cuda_available: Callable[[], bool]) -> None:
    """--oea-kernel triton needs a CUDA device (or Triton's interpreter, for tests)."""
    if cfg.kernel != "triton":
        return
    from sglang_oea import kernels

    device = get("device", None)
    if kernels.interpret_mode():
        return
    if device not in (None, "cuda") or not cuda_available():
        raise ValueError(
            f"--oea-kernel triton needs a CUDA device (device: {device or 'auto'}); use --oea-kernel auto or torch"
        )


def check_model(shape: Optional[MoEShape], model_path: str, cfg: OEAConfig) -> None:
    """Refuse a model without routed experts; log once when k0 makes OEA a no-op."""
    if shape is None:
        raise ValueError(f"--oea-k0 needs a mixture-of-experts model with routed experts; {model_path} has none")
    if shape.family not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"--oea-k0 supports routers scored by {', '.join(SUPPORTED_FAMILIES)}; {model_path} uses "
            f"scoring_func {shape.family!r}"
        )
    if cfg.k0 >= shape.top_k:
        logger.warning("--oea-k0 %d >= the model's top-k %d: OEA is a no-op for %s.", cfg.k0, shape.top_k, model_path)


# Every build of this release: 0.5.23 itself, post-releases (0.5.23.post1) and local builds
# (0.5.23+cu130) carry the same internals. Pre- and dev releases (0.5.23rc1) come before it and may
# not; other releases move the functions OEA hooks.
SUPPORTED_SGLANG = "0.5.23"
SUPPORTED_SGLANG_SPEC = ">=0.5.23,<0.5.24"  # the wheel's requirement, the same rule for pip


def installed_sglang_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return "not installed"


def supported_sglang(found: str) -> bool:
    """Whether `found` is a 0.5.23 release build (post-releases and local builds included)."""
    from packaging.version import InvalidVersion, Version

    try:
        version = Version(found)
    except InvalidVersion:
        return False
    return version.release == (0, 5, 23) and not version.is_prerelease


def check_sglang_version(found: str) -> None:
    """OEA hooks SGLang's internals, which change between releases: refuse any other release."""
    if not supported_sglang(found):
        raise ValueError(f"--oea-k0 needs an sglang 0.5.23 build (0.5.23, 0.5.23.postN or 0.5.23+local; the "
                         f"release sglang-oea hooks into); this environment has sglang {found}")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def validate_server(
    cfg: OEAConfig,
    get: Callable[[str, Any], Any],
    load_hf_config: Callable[[], Any],
    cuda_available: Optional[Callable[[], bool]] = None,
) -> Optional[MoEShape]:
    """All startup checks for an enabled config; returns the model's MoE shape.

    Args:
        get: reads a raw server setting, `get(name, default)`.
        load_hf_config: returns the model's Hugging Face config (read lazily: it touches disk).
        cuda_available: whether this machine has a CUDA device (for --oea-kernel triton).
    """
    if not cfg.enabled:
        return None
    check_sglang_version(installed_sglang_version())
    check_parallelism(get)
    note_disaggregation(get)
    check_backend(get("moe_runner_backend", "auto"))
    check_serving_mode(cfg, get)
    check_kernel(cfg, get, cuda_available or _cuda_available)
    shape = read_moe_shape(load_hf_config())
    check_model(shape, get("model_path", "?"), cfg)
    return shape
