"""Per-process OEA state and the routing step the SGLang hook calls. No SGLang import.

One OEARuntime lives in each scheduler / TP-worker process. The forward-context hook tells it
what kind of step is running (decode or not, how many real rows); the routing hook hands it
SGLang's top-k output, and it returns the OEA ids and weights, or None to leave them alone.
Statistics are kept on the device and read by the host once per decode-log interval.
"""

import logging
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

from sglang_oea.config import OEAConfig
from sglang_oea.reference import batch_gate, distinct_experts
from sglang_oea.routing import RouterSpec, route_from_logits

logger = logging.getLogger(__name__)

SKIP_BELOW_MIN = "below_min_batch"
SKIP_ABOVE_MAX = "above_max_batch"
SKIP_NOT_DECODE = "not_decode"
MAX_LAYERS = 1024


@dataclass
class StepInfo:
    """What the current forward pass is: set by the forward-context hook."""

    decode: bool = False
    num_rows: int = 0
    apply: bool = False
    index: int = -1


def graph_capture_active() -> bool:
    """True while a CUDA graph is being captured on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def is_capturing(tensor: torch.Tensor) -> bool:
    """True while a CUDA graph that `tensor` belongs to is being captured."""
    return tensor.is_cuda and graph_capture_active()


class FusedRouter:
    """The fused Triton kernel on CUDA, with one preallocated workspace per MoE layer; the
    pure-torch reference everywhere else. Both compute the same routing (test_oea_kernel.py)."""

    MIN_WORKSPACE_ROWS = 1024

    def __init__(self):
        self.workspaces = {}

    def workspace(self, layer: int, router_logits, topk_ids, topk_weights, capturing: bool):
        """This layer's workspace, allocated outside capture (SGLang warms up before capturing)."""
        from sglang_oea.kernels import OEAWorkspace

        rows, num_experts = router_logits.shape
        ws = self.workspaces.get(layer)
        if not capturing and (ws is None or ws.out_ids.shape[0] < rows):
            ws = OEAWorkspace.allocate(
                num_experts, topk_ids.shape[1], max(rows, self.MIN_WORKSPACE_ROWS),
                topk_ids.dtype, topk_weights.dtype, router_logits.device,
            )
            self.workspaces[layer] = ws
        return ws

    def __call__(self, layer, router_logits, topk_ids, topk_weights, spec, k0, rows, min_batch, max_batch, capturing, stats=None):
        """(ids, weights, counted): counted is True when the kernel added to `stats` itself."""
        from sglang_oea import kernels

        # Under TRITON_INTERPRET=1 (tests) the kernel also runs on CPU tensors.
        wanted = router_logits.is_cuda or kernels.interpret_mode()
        if not (wanted and kernels.is_available(router_logits.device)):
            ids, weights = route_from_logits(router_logits, topk_ids, topk_weights, spec, k0, rows, min_batch, max_batch)
            return ids, weights, False
        ws = self.workspace(layer, router_logits, topk_ids, topk_weights, capturing)
        ids, weights = kernels.oea_route(
            router_logits, topk_ids, topk_weights, k0=k0, scoring_func=spec.scoring_func,
            correction_bias=spec.correction_bias, num_groups=spec.num_groups,
            restrict_groups=spec.restrict_groups, num_valid_rows=rows, min_batch=min_batch,
            max_batch=max_batch, workspace=ws, stats=stats,
        )
        return ids.long(), weights, stats is not None


def router_spec_of(topk_config: Any) -> RouterSpec:
    """RouterSpec from SGLang's TopKConfig (read by attribute, so no SGLang import).

    SGLang's biased grouped router (DeepSeek-V3, GLM-4.5/5: grouped + correction bias) always
    scores with sigmoid, whatever TopKConfig.scoring_func says (GLM-4 MoE leaves it 'softmax').
    """
    num_groups = topk_config.num_expert_group or 1
    grouped = bool(topk_config.use_grouped_topk) and num_groups > 1
    biased_grouped = bool(topk_config.use_grouped_topk) and topk_config.correction_bias is not None
    return RouterSpec(
        scoring_func="sigmoid" if biased_grouped else topk_config.scoring_func,
        correction_bias=topk_config.correction_bias,
        num_groups=num_groups,
        restrict_groups=grouped and (topk_config.topk_group or num_groups) < num_groups,
    )


class ExpertStats:
    """Device-side sums of distinct experts per MoE layer, before and after OEA.

    sums: [MAX_LAYERS, 3] int64 on the routing device: (steps, T before, T after) per layer.
    Allocated up front, so CUDA-graph capture records in-place adds into a persistent buffer.
    """

    def __init__(self, device: torch.device):
        self.sums = torch.zeros(MAX_LAYERS, 3, dtype=torch.int64, device=device)

    def add(self, layer_id: int, before: torch.Tensor, after: torch.Tensor, gate: Any = 1) -> None:
        """gate: 1, or a 0-d device bool/int (graph replays where the batch gate was closed add 0)."""
        row = torch.stack([torch.ones_like(before), before, after]).long()
        self.sums[layer_id].add_(row * gate)

    def drain(self) -> Optional[torch.Tensor]:
        """[L, 4] host rows (steps, T before, T after, layer id) of the layers seen since the
        last drain, or None; one device sync, then the sums restart from zero."""
        host = self.sums.to("cpu", copy=True).double()
        self.sums.zero_()
        layer_ids = torch.arange(MAX_LAYERS, dtype=torch.float64)[:, None]
        rows = torch.cat([host, layer_ids], dim=1)[host[:, 0] > 0]
        return rows if rows.shape[0] else None


class RouterDump:
    """Writes decode-step router logits for benchmark/oea/simulate.py, for a bounded step count."""

    def __init__(self, directory: str, max_steps: int, rank: int):
        self.directory, self.max_steps, self.rank = directory, max_steps, rank
        self.steps_seen = set()
        os.makedirs(directory, exist_ok=True)

    def wants(self, step: int) -> bool:
        return step in self.steps_seen or len(self.steps_seen) < self.max_steps

    def write(self, step: int, layer_id: int, router_logits: torch.Tensor, spec: RouterSpec,
              topk_config: Any, top_k: int) -> None:
        """One record: [B, N] logits plus the routing as SGLang applies it (spec's scoring)."""
        self.steps_seen.add(step)
        bias = spec.correction_bias
        record = {
            "router_logits": router_logits.detach().float().cpu(),
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


def routing_supported(topk_config: Any, spec: RouterSpec) -> bool:
    """OEA knows softmax and sigmoid(+bias) top-k routers, not custom routing functions."""
    return topk_config.custom_routing_function is None and spec.scoring_func in ("softmax", "sigmoid")


class OEARuntime:
    """OEA for one process: gate, route, count."""

    def __init__(self, cfg: OEAConfig, rank: int = 0, device: Optional[torch.device] = None):
        device = torch.device("cpu") if device is None else device
        self.cfg = cfg
        self.rank = rank
        # Real rows of the decode batch being replayed: set before each CUDA-graph replay.
        self.graph_rows = torch.zeros((), dtype=torch.int32, device=device)
        self.step = StepInfo()
        self.decode_steps = 0
        self.applied_steps = 0
        self.skipped_steps: Counter = Counter()
        self.stats = ExpertStats(device) if cfg.stats else None
        self.dump = RouterDump(cfg.dump_router_logits, cfg.dump_steps, rank) if cfg.dump_router_logits else None
        self.depth = 0  # nesting of SGLang forward contexts
        self.fused = FusedRouter()
        self.unsupported_warned = False

    def skip_reason(self, decode: bool, num_rows: int) -> Optional[str]:
        """Why OEA does not apply to this forward pass, or None when it does."""
        if not decode:
            return SKIP_NOT_DECODE
        if num_rows < self.cfg.min_batch:
            return SKIP_BELOW_MIN
        if self.cfg.max_batch and num_rows > self.cfg.max_batch:
            return SKIP_ABOVE_MAX
        return None

    def begin_step(self, decode: bool, num_rows: int, count: bool = True) -> StepInfo:
        """Enter a forward pass (host ints only: no device sync); returns the previous step.

        count=False re-enters the pass already counted (SGLang nests its forward contexts).
        """
        previous = self.step
        reason = self.skip_reason(decode, num_rows)
        index = self.decode_steps - int(not count) if decode else previous.index
        self.step = StepInfo(decode=decode, num_rows=num_rows, apply=reason is None, index=index)
        if not count:
            return previous
        self.decode_steps += int(decode)
        if reason is None:
            self.applied_steps += 1
        else:
            self.skipped_steps[reason] += 1
        return previous

    def route(
        self,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_config: Any,
        router_logits: torch.Tensor,
        layer_id: Optional[int],
    ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """OEA ids and weights for SGLang's top-k output, or None to keep the router's.

        Args:
            topk_ids: [B, K + S] int32, K routed columns then S fused shared-expert columns.
            topk_weights: [B, K + S] float.
            router_logits: [B, N] raw router logits.
        """
        # Draft-model MoE blocks opt out of routed-expert capture; OEA leaves them alone too.
        if not self.step.decode or not topk_config.allow_routed_experts_capture:
            return None
        spec = router_spec_of(topk_config)
        if not routing_supported(topk_config, spec):
            self.warn_unsupported(topk_config)
            return None
        num_shared = topk_config.num_shared_topk_slots if topk_ids.shape[1] == topk_config.top_k else 0
        routed = topk_ids.shape[1] - num_shared
        layer = layer_id or 0
        capturing = is_capturing(router_logits)
        if self.dump is not None and not capturing and self.dump.wants(self.step.index):
            self.dump.write(self.step.index, layer, router_logits[: self.step.num_rows], spec, topk_config, routed)
        if self.cfg.k0 >= routed or not self.step_may_apply(capturing):
            return None
        ids, weights, gate, counted = self.route_routed(layer, router_logits, topk_ids[:, :routed], topk_weights[:, :routed], spec, capturing)
        if self.stats is not None and not counted:
            rows = self.graph_rows if capturing else self.step.num_rows
            num_experts = router_logits.shape[1]
            before = distinct_experts(topk_ids[:, :routed], num_experts, rows)
            self.stats.add(layer, before, distinct_experts(ids, num_experts, rows), gate)
        ids = torch.cat([ids.to(topk_ids.dtype), topk_ids[:, routed:]], dim=1)
        return ids, torch.cat([weights, topk_weights[:, routed:]], dim=1)

    def warn_unsupported(self, topk_config: Any) -> None:
        if not self.unsupported_warned:
            self.unsupported_warned = True
            logger.warning(
                "sglang-oea: this model's router (scoring_func=%r, custom routing function: %s) is not "
                "supported; its experts are routed unchanged.",
                topk_config.scoring_func, topk_config.custom_routing_function is not None,
            )

    def step_may_apply(self, capturing: bool) -> bool:
        """Host-side gate. Under graph capture the batch is a bucket: the real rows, known only at
        replay, are gated on the device, so only buckets too small for min_batch are skipped."""
        if capturing:
            return self.step.num_rows >= self.cfg.min_batch
        return self.step.apply

    def route_routed(self, layer, router_logits, topk_ids, topk_weights, spec, capturing):
        """(ids, weights, gate, counted) for the routed columns.

        gate is 1, or a device 0/1 when capturing; counted says the kernel already added this
        call's distinct-expert counts to the stats (the pure-torch path leaves that to route()).
        """
        stats = None if self.stats is None else self.stats.sums[layer]
        if not capturing:  # the host already gated this step on its real rows
            rows, lo, hi = self.step.num_rows, 1, 0
        else:
            rows, lo, hi = self.graph_rows, self.cfg.min_batch, self.cfg.max_batch
        ids, weights, counted = self.fused(layer, router_logits, topk_ids, topk_weights, spec, self.cfg.k0, rows, lo, hi, capturing, stats)
        return ids, weights, (batch_gate(rows, lo, hi) if capturing else 1), counted
