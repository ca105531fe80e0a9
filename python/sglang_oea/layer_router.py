"""Routing one MoE layer, once the runtime has let the pass through its gates. No SGLang import.

A layer's routing is read once from SGLang's TopKConfig (by attribute, so no SGLang import) into a
LayerRouting: the RouterSpec, the routed columns, or why OEA does not handle it. LayerRouter then
runs the router that routers.RouterChoice picked for the layer's routing shape, with the row count
and the settings it reads (for graph passes and the kernel: the device row scalar and the device
control block, so that a captured graph follows live settings; for the eager torch path: host
ints), and counts the layer's distinct experts and lost router mass and folds its rank-check
checksum where the router did not. DeviceState holds the per-process device tensors this needs.
"""

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from sglang_oea.config import LiveSettings, OEAConfig
from sglang_oea.counters import LayerCounters, SnapshotRing
from sglang_oea.passes import StepInfo, row_bounds
from sglang_oea.reference import distinct_experts, ids_checksum, lost_router_mass_units
from sglang_oea.routers import CAPTURE, EAGER, WARMUP, RouterChoice
from sglang_oea.routing import RouterSpec, control_gate


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


def routing_support(topk_config: Any, spec: RouterSpec) -> Optional[str]:
    """None when OEA handles this router, else why not (softmax and sigmoid(+bias) top-k only)."""
    if topk_config.custom_routing_function is not None:
        return "a custom routing function"
    if spec.scoring_func not in ("softmax", "sigmoid"):
        return f"scoring_func={spec.scoring_func!r}"
    backend = getattr(topk_config, "runner_backend", None)
    trtllm_routed = backend is not None and getattr(backend, "value", backend) == "flashinfer_trtllm_routed"
    if trtllm_routed and spec.scoring_func == "softmax" and spec.correction_bias is None and not topk_config.renormalize:
        # That backend's softmax router hands over raw logits as weights, which OEA cannot rescale.
        return "flashinfer_trtllm_routed with an unnormalised softmax router (raw-logit weights)"
    return None


@dataclass(frozen=True)
class LayerRouting:
    """A MoE layer's routing, read once from its TopKConfig: spec, routed columns, or why not.

    slot: this (layer, TopKConfig) pair's index, which keys its router and workspace.
    config: the TopKConfig itself, held so that its id() is not reused while it is a key.
    """

    spec: RouterSpec
    num_routed: int
    unsupported: Optional[str]
    slot: int
    config: Any


class DeviceState:
    """Per-process device tensors, made at the first routing call (outside capture): the real
    row count and the control block that captured graphs read, and the per-layer counters
    (expert statistics and rank-check checksums, see sglang_oea.counters) with the ring of host
    snapshots they are read through. No counters when both are off.

    control: int32 [3] = (k0, min_batch, max_batch) of the settings in force, read on the device
    by every routing call of a graph pass and by the kernel (routing.CONTROL_FIELDS). Written only
    by `write_control`, on the current (forward) stream, element by element with fill_ (no host
    sync), and only where a value changed.
    group_rows: int32 [G] under DP attention (groups = G > 1): each attention-DP group's real token
    rows, which a graph replay's gathered order reads (sglang_oea.gathered); None otherwise.
    """

    def __init__(self, device: torch.device, stats: bool, checksums: bool, settings: LiveSettings, groups: int = 0):
        self.rows = torch.zeros((), dtype=torch.int32, device=device)
        self.group_rows = torch.zeros(groups, dtype=torch.int32, device=device) if groups > 1 else None
        self.control = torch.zeros(3, dtype=torch.int32, device=device)
        self.written: Tuple[int, ...] = (0, 0, 0)  # what the block holds (zeros when made)
        self.write_control(settings)
        self.stats, self.checksums = stats, checksums
        self.counters = LayerCounters(device) if stats or checksums else None
        self.snapshots = SnapshotRing(self.counters) if self.counters is not None else None

    def write_group_rows(self, rows) -> None:
        """Enqueue each group's real rows into group_rows on the current stream (no host sync)."""
        self.group_rows.copy_(host_int32(rows, self.group_rows.device), non_blocking=True)

    def write_control(self, settings: LiveSettings) -> None:
        """Enqueue the settings' values into the control block on the current stream."""
        values = (settings.k0, settings.min_batch, settings.max_batch)
        for i, (old, new) in enumerate(zip(self.written, values)):
            if old != new:
                self.control[i].fill_(new)
        self.written = values


def host_int32(values, device: torch.device) -> torch.Tensor:
    """int32 [len(values)] in host memory, pinned when `device` is a GPU, so that a non-blocking
    copy to it needs no host sync (the caching host allocator keeps it alive until the copy is done)."""
    return torch.tensor(list(values), dtype=torch.int32, pin_memory=device.type == "cuda")


class LayerRouter:
    """Routes MoE layers for one process: each layer's routing, its router run, its counts."""

    def __init__(self, cfg: OEAConfig, routers: RouterChoice):
        self.cfg = cfg
        self.routers = routers
        self.layers: Dict[Tuple[int, int], LayerRouting] = {}  # (layer id, id(TopKConfig)) -> routing

    def layer_routing(self, layer: int, topk_config: Any, width: int) -> LayerRouting:
        """This layer's routing, read from its TopKConfig on the first call. Keyed by the config object
        too: a layer id alone may be reused (a draft model, or tests routing several configs)."""
        key = (layer, id(topk_config))
        known = self.layers.get(key)
        if known is None:
            spec = router_spec_of(topk_config)
            num_shared = topk_config.num_shared_topk_slots if width == topk_config.top_k else 0
            known = LayerRouting(spec, width - num_shared, routing_support(topk_config, spec), len(self.layers),
                                 topk_config)
            self.layers[key] = known
        return known

    def route_layer(self, step: StepInfo, state: DeviceState, layer: int, info: LayerRouting, logits, ids, weights,
                    capturing: bool, graph: bool):
        """Run the chosen router on one layer; count distinct experts and fold the checksum if the
        router did not. None when OEA is off for this routing shape (under --oea-kernel auto on
        CUDA, the kernel failed its self-check on some rank, or cannot run)."""
        counters = state.counters
        stats_row = counters.stats_row(layer) if state.stats else None
        lost = counters.lost_row(layer) if state.stats else None
        checksum = counters.checksum_slot(layer) if state.checksums else None
        # The routing shape names the counter arguments this call passes: each selects a compiled
        # kernel variant, and the startup self-check runs the one named.
        router = self.routers.router_for(info.slot, logits, ids, weights, info.spec, info.num_routed,
                                         stats_row is not None, capturing, checksum=checksum is not None,
                                         lost=lost is not None)
        if router is None:
            step.tally.kernel_off = True
            return None
        rows, lo, hi, control = self.row_count(step, state, router.name, graph)
        if counters is not None:
            counters.note_layer(layer)
        phase = CAPTURE if capturing else WARMUP if graph else EAGER
        per_request = step.rows_per_request
        new_ids, new_weights, counted = router(info.slot, logits, ids, weights, info.spec, step.settings.k0,
                                               info.num_routed, rows, lo, hi, phase, stats_row, checksum,
                                               control=control, rows_per_request=per_request, lost=lost)
        if counted:
            return new_ids, new_weights
        k, num_experts = info.num_routed, logits.shape[1]
        if state.stats:
            # Routed columns only; no slicing ops where there are no shared-expert columns.
            own, new = (ids, weights), (new_ids, new_weights)
            if k < ids.shape[1]:
                own, new = (ids[:, :k], weights[:, :k]), (new_ids[:, :k], new_weights[:, :k])
            gate = 1 if control is None else control_gate(rows, control, k, per_request)
            before = distinct_experts(own[0], num_experts, rows)
            counters.add_stats(layer, before, distinct_experts(new[0], num_experts, rows), gate)
            units = lost_router_mass_units(*own, *new, num_experts, rows)
            counters.add_lost(layer, step.settings.k0 if control is None else control[0],
                              units if control is None else units * gate)
        if state.checksums:
            checksum.add_(ids_checksum(new_ids[:, :k], rows))
        return new_ids, new_weights

    def row_count(self, step: StepInfo, state: DeviceState, router: str, graph: bool):
        """(rows, min_rows, max_rows, control) for the router. Graph passes and the kernel read the
        real token rows from the device scalar and the settings from the device control block,
        and gate on the device (min_rows, max_rows: passes.row_bounds, the host's view of the
        same bounds); the eager torch path uses host ints and no control block (the host gate
        already passed)."""
        lo, hi = row_bounds(step.settings, step)
        if graph:
            return state.rows, lo, hi, state.control
        if router == "torch":
            return step.num_rows, 1, 0, None
        if not step.tally.rows_written:  # one small device write per eager pass
            state.rows.fill_(step.num_rows)
            step.tally.rows_written = True
        return state.rows, lo, hi, state.control
