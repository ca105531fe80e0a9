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
The startup line's verdicts come from here too (startup_state, speculative_note): whether OEA
routes, and which verify passes it routes under speculative decoding.
"""

import logging
from typing import Any, List, NamedTuple, Optional, Tuple

from sglang_oea import flags
from sglang_oea.config import OEAConfig
from sglang_oea.passes import verify_cap_problem

logger = logging.getLogger("sglang_oea")

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


def check_resolved_arguments(server_args: Any, cfg: Optional[OEAConfig] = None) -> None:
    """Refuse parallel layouts in the arguments as SGLang resolved them, and a batch cap that no
    verify pass can pass (passes.verify_cap_problem). Raises ValueError."""
    from sglang.srt.arg_groups.overrides import resolved_view

    view = resolved_view(server_args)
    flags.check_resolved_parallelism(lambda name, default: getattr(view, name, default))
    if cfg is not None and cfg.verify:
        refusal, warning = verify_cap_problem(cfg.min_batch, cfg.max_batch, verify_widths(view))
        if refusal:
            raise ValueError(refusal)
        if warning:
            logger.warning("sglang-oea: %s", warning)


def verify_widths(view: Any) -> Tuple[int, ...]:
    """The draft tokens per request of every verify pass a server can run, from its resolved
    arguments (SGLang's ResolvedView, or a record whose speculative fields are resolved): () without
    speculative decoding; every candidate's steps + 1 under --speculative-adaptive (SGLang builds a
    verify runner per candidate: speculative/adaptive_spec_params.py, eagle_worker_v2.py); else
    --speculative-num-draft-tokens."""
    if not getattr(view, "speculative_algorithm", None):
        return ()
    if getattr(view, "speculative_adaptive", False):
        from sglang.srt.speculative.adaptive_spec_params import resolve_candidate_steps_from_config

        steps = resolve_candidate_steps_from_config(cfg_path=getattr(view, "speculative_adaptive_config", None))
        return tuple(sorted({int(s) + 1 for s in steps}))
    drafts = getattr(view, "speculative_num_draft_tokens", None)
    return (int(drafts),) if drafts else ()


def resolved_verify_widths(server_args: Any) -> Tuple[int, ...]:
    """verify_widths of a server record as SGLang resolved it (in a scheduler process, where the
    record's own speculative fields may still be unset: SGLang declares them during resolution)."""
    from sglang.srt.arg_groups.overrides import resolved_view

    return verify_widths(resolved_view(server_args))


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


def startup_state(k0: int, shape: Any) -> str:
    """The startup line's word on whether OEA routes (shape: the model's MoEShape, or None)."""
    if k0 == 0:
        return 'armed, off (k0=0) until POST /set_internal_state {"server_args": {"oea_k0": K0}} turns it on'
    return "no-op (k0 >= top-k)" if shape and k0 >= shape.top_k else "on"


def speculative_note(cfg: OEAConfig, algorithm: Any, widths: Tuple[int, ...] = ()) -> str:
    """The startup line's word on speculative decoding ('' without it). widths: the draft tokens
    per request of the verify passes the server runs (verify_widths), when known."""
    if not algorithm:
        return ""
    if not cfg.verify:
        return f"; speculative {algorithm}: verify passes not routed (--oea-verify off), so OEA applies nowhere"
    note = f"; speculative {algorithm}: verify passes routed (rows = requests x draft tokens)"
    if widths and cfg.max_batch:
        admitted = ", ".join(f"{cfg.max_batch // w} requests of {w} draft tokens" for w in widths)
        note += f", at most {admitted} under the cap"
        warning = verify_cap_problem(cfg.min_batch, cfg.max_batch, widths)[1]
        if warning:
            note += f"; {warning}"
    return note
