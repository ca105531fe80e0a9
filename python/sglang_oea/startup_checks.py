"""OEA's startup checks on what SGLang 0.5.23 decided after the raw arguments were checked.

sglang_oea.flags checks the raw arguments, before SGLang resolves anything. Two things are known
only later:
- Resolved arguments. Resolution can turn on expert parallel with neither --ep-size nor
  --moe-a2a-backend given: an all-to-all MoE backend (given, or chosen by resolution, e.g. deepep
  for --enable-waterfill) makes `_a2a_ep_size` (arg_groups/overrides.py) set ep_size = tp_size.
- The built model. A MoE layer's quantization method may choose its runner when the layer is
  built: with `--moe-runner-backend auto` and no --quantization, a ModelOpt NVFP4 checkpoint on a
  Blackwell GPU gets flashinfer_trtllm (`ModelOptNvFp4FusedMoEMethod.create_moe_runner`), and
  `TopK.bind_runner_backend` then makes the layer's top-k output BYPASSED: the MoE kernel routes
  from the raw logits and no topk_ids exist for OEA to rewrite. Only the built layers tell.
Every refusal raises ValueError with one line naming the setting and what fixes it.
"""

from typing import Any, List, NamedTuple, Optional

from sglang_oea import flags

# Why a top-k output format carries no topk_ids (TopKOutputFormat names).
HIDDEN_FORMATS = {
    "BYPASSED": "the MoE kernel routes from the raw router logits, so no topk_ids exist",
    "TRITON_KERNEL": "it passes ragged routing metadata instead of topk_ids",
    "PACKED": "it passes packed routing ids instead of topk_ids",
}


class HiddenTopK(NamedTuple):
    """A routed layer whose top-k output OEA cannot rewrite."""

    name: str  # the TopK module's name in the model
    layer_id: Optional[int]
    backend: str  # the MoE runner backend its experts bound
    output_format: str  # TopKOutputFormat name


def check_resolved_arguments(server_args: Any) -> None:
    """Refuse parallel layouts in the arguments as SGLang resolved them. Raises ValueError."""
    from sglang.srt.arg_groups.overrides import resolved_view

    view = resolved_view(server_args)
    flags.check_resolved_parallelism(lambda name, default: getattr(view, name, default))


def hidden_topk_layers(model: Any) -> List[HiddenTopK]:
    """Every SGLang TopK module in `model` whose bound output format has no topk_ids, in module
    order. A TopK whose format is still unset is left to SGLang (its CUDA forward refuses it)."""
    from sglang.srt.layers.moe.topk import TopK

    hidden = []
    for name, module in model.named_modules():
        if not isinstance(module, TopK):
            continue
        output_format = module.topk_config.output_format
        if output_format is None or output_format.name not in HIDDEN_FORMATS:
            continue
        backend = module.topk_config.runner_backend
        hidden.append(HiddenTopK(name, module.layer_id, str(getattr(backend, "value", backend)), output_format.name))
    return hidden


def backend_advice(quantization: Optional[str]) -> str:
    """The flags that give this quantization a MoE backend that keeps topk_ids."""
    fallback = flags.FALLBACK_BY_QUANTIZATION.get(quantization)
    if fallback is None:
        return f"a --moe-runner-backend that keeps top-k ids: {flags.WORKING_BACKENDS}"
    if quantization is None:
        return f"--moe-runner-backend {fallback}"
    return f"--quantization {quantization} --moe-runner-backend {fallback}"


def check_topk_formats(model: Any, quantization: Optional[str], server_backend: str) -> None:
    """Refuse a built model with a routed layer whose top-k output hides topk_ids. Raises ValueError.

    Args:
        quantization: the model's quantization as its ModelConfig resolved it (checkpoint included).
        server_backend: the server's resolved --moe-runner-backend.
    """
    hidden = hidden_topk_layers(model)
    if not hidden:
        return
    first = hidden[0]
    others = f" (and {len(hidden) - 1} more routed layers)" if len(hidden) > 1 else ""
    chosen = " (the layer's quantization method chose it)" if server_backend == "auto" else ""
    raise ValueError(
        f"--oea-k0 needs top-k ids, but routed layer {first.name} (layer_id {first.layer_id}){others} runs MoE "
        f"runner backend {first.backend}{chosen} with --moe-runner-backend {server_backend}, whose top-k output "
        f"format is {first.output_format}: {HIDDEN_FORMATS[first.output_format]}; start the server with "
        f"{backend_advice(quantization)}"
    )


def check_built_model(model_runner: Any) -> None:
    """check_topk_formats on a ModelRunner's model, once SGLang has built it. Raises ValueError."""
    from sglang.srt.layers.moe.utils import get_moe_runner_backend

    backend = get_moe_runner_backend()
    check_topk_formats(model_runner.model, model_runner.model_config.quantization,
                       str(getattr(backend, "value", backend)))
