"""--oea-dump-router-logits: decode-step router logits on disk, for benchmark/oea/studies/simulate.py.
No SGLang import.

One file per (rank, step, layer), for the first `max_steps` routed steps: the [B, N] logits, the
routing as SGLang applies it, and the ids of the router and of OEA.
"""

import os
from typing import Any, Optional

import torch

from sglang_oea.routing import RouterSpec


class RouterDump:
    """Writes decode-step router logits for benchmark/oea/studies/simulate.py, for a bounded step count."""

    def __init__(self, directory: str, max_steps: int, rank: int):
        self.directory, self.max_steps, self.rank = directory, max_steps, rank
        self.steps_seen = set()
        os.makedirs(directory, exist_ok=True)

    def wants(self, step: int) -> bool:
        return step in self.steps_seen or len(self.steps_seen) < self.max_steps

    def write(self, step: int, layer_id: int, router_logits: torch.Tensor, spec: RouterSpec,
              topk_config: Any, top_k: int, router_ids: torch.Tensor, oea_ids: Optional[torch.Tensor]) -> None:
        """One record: [B, N] logits plus the routing as SGLang applies it (spec's scoring), and
        the [B, top_k] ids of the router and of OEA (None where OEA left the step alone)."""
        self.steps_seen.add(step)
        bias = spec.correction_bias
        record = {
            "router_logits": router_logits.detach().float().cpu(),
            "router_ids": router_ids[:, :top_k].cpu(),
            "oea_ids": None if oea_ids is None else oea_ids[:, :top_k].cpu(),
            "layer_id": layer_id,
            "step": step,
            "batch_size": router_logits.shape[0],
            "top_k": top_k,
            "scoring_func": spec.scoring_func,
            "correction_bias": None if bias is None else bias.detach().float().cpu(),
            "num_expert_group": topk_config.num_expert_group or 1,
            "topk_group": topk_config.topk_group or 1,
        }
        name = f"rank{self.rank}_step{step:06d}_layer{layer_id:03d}.pt"
        torch.save(record, os.path.join(self.directory, name))
