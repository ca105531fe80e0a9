"""What OEA needs to know about a model, read from its Hugging Face config. No SGLang import."""

from dataclasses import dataclass
from typing import Any, Optional

# Config fields that hold the number of routed experts, by model family.
_EXPERT_COUNT_FIELDS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")


@dataclass(frozen=True)
class MoEShape:
    """num_experts: N routed experts; top_k: routed experts per token; family: routing family."""

    num_experts: int
    top_k: int
    family: str
    num_groups: int = 1
    topk_group: int = 1

    def describe(self) -> str:
        groups = f", groups {self.topk_group}/{self.num_groups}" if self.num_groups > 1 else ""
        return f"N={self.num_experts} top-k={self.top_k} routing={self.family}{groups}"


def _field(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def _text_config(config: Any) -> Any:
    """Multimodal configs keep the language model's fields in a text config."""
    inner = _field(config, "text_config")
    return inner if inner is not None and _expert_count(inner) else config


def _expert_count(config: Any) -> Optional[int]:
    for name in _EXPERT_COUNT_FIELDS:
        value = _field(config, name)
        if isinstance(value, int) and value > 0:
            return value
    return None


SUPPORTED_FAMILIES = ("softmax", "sigmoid", "sigmoid+bias")


def routing_family(config: Any) -> str:
    """'sigmoid+bias' (DeepSeek-V3, GLM-4.5/5), 'sigmoid', 'softmax' (Qwen3-MoE, Mixtral), or the
    config's own scoring_func when it is something else (not supported by OEA)."""
    scoring = _field(config, "scoring_func") or "softmax"
    if scoring == "sigmoid":
        return "sigmoid+bias" if _field(config, "topk_method") == "noaux_tc" else "sigmoid"
    return scoring


def read_moe_shape(config: Any) -> Optional[MoEShape]:
    """The model's routed-expert shape, or None for a model with no routed experts.

    Args:
        config: a transformers PretrainedConfig or the dict of a config.json.
    """
    config = _text_config(config)
    num_experts = _expert_count(config)
    top_k = _field(config, "num_experts_per_tok") or _field(config, "moe_topk")
    if not num_experts or not isinstance(top_k, int) or top_k < 1:
        return None
    return MoEShape(
        num_experts=num_experts,
        top_k=top_k,
        family=routing_family(config),
        num_groups=_field(config, "n_group") or 1,
        topk_group=_field(config, "topk_group") or 1,
    )
