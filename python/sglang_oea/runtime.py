"""Per-process OEA state and the routing step the SGLang hook calls. No SGLang import.

One OEARuntime lives in each scheduler / TP-worker process. The forward-context hook tells it
what kind of pass is running (decode, target verify, draft or other; its real token rows and
requests; whether it is a CUDA-graph warm-up or capture pass); the routing hook hands it SGLang's
top-k output, and it returns the OEA ids and weights, or None to leave them alone. Statistics are
kept on the device and read by the host once per decode-log interval.

Routed passes: DECODE (rows = requests) and, under speculative decoding, the target model's
TARGET_VERIFY passes (rows = requests x draft tokens). In both, every real row is a token of the
union and padded rows are excluded; the batch gate (min_batch / max_batch) counts requests.

Accounting is done when the outermost forward pass ends, from what actually happened in it: a
routed pass counts as applied only if OEA rewrote its ids (eagerly, or by replaying a CUDA graph
whose capture rewrote them); otherwise it is skipped with the reason. Warm-up and capture passes
are not serving steps and are not counted; neither are the draft model's passes (under
speculative decoding, every DECODE pass belongs to the draft model).
"""

import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from sglang_oea.config import OEAConfig
from sglang_oea.counters import MAX_LAYERS, LayerCounters, Snapshot, SnapshotRing
from sglang_oea.rank_check import RankCheck
from sglang_oea.reference import batch_gate, distinct_experts, ids_checksum
from sglang_oea.routers import CAPTURE, EAGER, WARMUP, GraphCaptureError, RouterChoice
from sglang_oea.routing import RouterSpec

logger = logging.getLogger(__name__)

DECODE, VERIFY, DRAFT, OTHER = "decode", "verify", "draft", "other"
ROUTED_MODES = (DECODE, VERIFY)
SKIP_BELOW_MIN = "below_min_batch"
SKIP_ABOVE_MAX = "above_max_batch"
SKIP_NOT_DECODE = "not_decode"
SKIP_VERIFY = "target_verify"
SKIP_NO_IDS = "no_topk_ids"
SKIP_UNSUPPORTED = "router_unsupported"
SKIP_NOOP = "k0_covers_top_k"
SKIP_KERNEL_OFF = "kernel_off"


@dataclass
class PassTally:
    """What happened to the routing during one outermost forward pass (nested contexts share it)."""

    rewrote: bool = False  # OEA rewrote the ids of some MoE layer
    unsupported: bool = False  # a target MoE layer has a router OEA does not handle
    noop: bool = False  # k0 >= the layer's top-k
    kernel_off: bool = False  # OEA is off for a layer's routing shape (kernel failed or unavailable on CUDA)
    replayed_bucket: Optional[int] = None  # the graph (bucket in requests) replayed for this pass
    rows_written: bool = False  # the device row count holds this pass's real rows

    def outcome(self) -> Optional[str]:
        """None when OEA rewrote ids, else the skip reason."""
        if self.rewrote:
            return None
        if self.kernel_off:
            return SKIP_KERNEL_OFF
        return SKIP_UNSUPPORTED if self.unsupported else SKIP_NOOP if self.noop else SKIP_NO_IDS


@dataclass
class StepInfo:
    """What the current forward pass is: set by the forward-context hook.

    num_rows: the pass's token rows: requests in decode, requests x draft tokens in verify (graph
        warm-up and capture passes: the bucket's rows, padding included).
    requests: the pass's requests (the bucket size in graph passes); the batch gate counts these.
    """

    mode: str = OTHER
    num_rows: int = 0
    requests: int = 0
    apply: bool = False  # the host batch gate (real requests; eager passes)
    graph: bool = False  # a CUDA-graph warm-up or capture pass
    index: int = -1  # routed steps counted before this one (router dumps)
    tally: PassTally = field(default_factory=PassTally)

    @property
    def routed(self) -> bool:
        """A pass whose MoE layers OEA may route (decode, or the target's verify)."""
        return self.mode in ROUTED_MODES

    @property
    def rows_per_request(self) -> int:
        """Token rows per request: 1 in decode, the draft tokens per request in verify."""
        return max(1, self.num_rows // self.requests) if self.requests else 1


def graph_capture_active() -> bool:
    """True while a CUDA graph is being captured on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def is_capturing(tensor: torch.Tensor) -> bool:
    """True while a CUDA graph that `tensor` belongs to is being captured."""
    return tensor.is_cuda and graph_capture_active()


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


class RouterDump:
    """Writes decode-step router logits for benchmark/oea/simulate.py, for a bounded step count."""

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
    row count that captured graphs read, and the per-layer counters (expert statistics and
    rank-check checksums, see sglang_oea.counters) with the ring of host snapshots they are read
    through. No counters when both are off."""

    def __init__(self, device: torch.device, stats: bool, checksums: bool):
        self.rows = torch.zeros((), dtype=torch.int32, device=device)
        self.stats, self.checksums = stats, checksums
        self.counters = LayerCounters(device) if stats or checksums else None
        self.snapshots = SnapshotRing(self.counters) if self.counters is not None else None


class OEARuntime:
    """OEA for one process: gate, route, count."""

    def __init__(self, cfg: OEAConfig, rank: int = 0, speculative: bool = False, world_size: int = 1,
                 agree: Optional[Callable[[bool], bool]] = None):
        """agree: combines this rank's kernel self-check verdict with every other TP rank's
        (routers.RouterChoice); None in a single process."""
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        # Checksums only when there are ranks to compare them with.
        self.checksums = bool(cfg.check_ranks) and world_size > 1
        self.rank_check: Optional[RankCheck] = None  # set once the process groups exist
        self.speculative = speculative
        self.step = StepInfo()
        self.device: Optional[DeviceState] = None
        self.routed_steps = 0  # decode and verify steps counted (applied or skipped)
        self.applied: Counter = Counter()  # pass mode -> steps whose ids OEA rewrote
        self.skipped: Counter = Counter()  # (pass mode, reason) -> steps without OEA
        self.captured: Dict[Tuple[str, int], Optional[str]] = {}  # (mode, bucket) -> outcome of its capture
        self.dump = RouterDump(cfg.dump_router_logits, cfg.dump_steps, rank) if cfg.dump_router_logits else None
        self.depth = 0  # nesting of SGLang forward contexts
        self.routers = RouterChoice(cfg.kernel, cfg.k0, rank, agree=agree)
        self.layers: Dict[Tuple[int, int], LayerRouting] = {}  # (layer id, id(TopKConfig)) -> routing
        self.warned: set = set()

    @property
    def counters(self) -> Optional[LayerCounters]:
        """The device counter table, once the first routing call made it (None when both the
        expert statistics and the rank check are off)."""
        return None if self.device is None else self.device.counters

    def read_snapshot(self) -> Optional[Snapshot]:
        """The counters as every rank left them at the same routed step (see sglang_oea.counters);
        None before two routed passes ended. Waits for that snapshot's copy, not for the pass in flight."""
        if self.device is None or self.device.snapshots is None:
            return None
        return self.device.snapshots.read()

    @property
    def applied_steps(self) -> int:
        return sum(self.applied.values())

    @property
    def skipped_steps(self) -> Counter:
        """reason -> skipped steps, over all pass modes."""
        by_reason: Counter = Counter()
        for (_, reason), count in self.skipped.items():
            by_reason[reason] += count
        return by_reason

    def steps_of(self, mode: str) -> int:
        """Counted steps (applied or skipped) of one pass mode."""
        return self.applied[mode] + sum(count for (m, _), count in self.skipped.items() if m == mode)

    def pass_mode(self, mode: str) -> str:
        """The mode OEA treats a pass as: under speculative decoding, decode passes are the draft's."""
        return DRAFT if mode == DECODE and self.speculative else mode

    def skip_reason(self, mode: str, requests: int) -> Optional[str]:
        """Why the host gate keeps OEA off this pass, or None when it may apply. The gate counts
        requests in verify passes too, so one setting means the same concurrency in both modes."""
        if mode == VERIFY and not self.cfg.verify:
            return SKIP_VERIFY
        if mode not in ROUTED_MODES:
            return SKIP_NOT_DECODE
        if requests < self.cfg.min_batch:
            return SKIP_BELOW_MIN
        if self.cfg.max_batch and requests > self.cfg.max_batch:
            return SKIP_ABOVE_MAX
        return None

    def begin_step(self, mode: str = DECODE, num_rows: int = 0, graph: bool = False, outermost: bool = True,
                   decode: Optional[bool] = None, requests: Optional[int] = None) -> StepInfo:
        """Enter a forward pass (host ints only: no device sync); returns the previous step.

        num_rows: token rows; requests: the pass's requests (default num_rows, as in decode).
        A nested context (outermost=False) describes the same pass: it shares its tally.
        `decode=True/False` is shorthand for mode DECODE / OTHER.
        """
        if decode is not None:
            mode = DECODE if decode else OTHER
        mode = self.pass_mode(mode)
        requests = num_rows if requests is None else requests
        previous = self.step
        tally = PassTally() if outermost else previous.tally
        index = self.routed_steps if outermost else previous.index
        apply = self.skip_reason(mode, requests) is None
        self.step = StepInfo(mode=mode, num_rows=num_rows, requests=requests, apply=apply, graph=graph,
                             index=index, tally=tally)
        return previous

    def end_step(self) -> None:
        """Account for the outermost pass that is ending (see the module docstring)."""
        step = self.step
        if step.graph:
            if step.routed:  # replays of this bucket rewrite ids iff this capture pass did
                self.captured[(step.mode, step.requests)] = step.tally.outcome()
            return
        if step.mode == DRAFT:
            return
        reason = self.skip_reason(step.mode, step.requests)
        if reason is None:
            reason = self.replay_outcome(step) if step.tally.replayed_bucket is not None else step.tally.outcome()
        self.count(step.mode, reason)
        if step.routed and self.device is not None and self.device.snapshots is not None:
            # On the stream that ran the pass, behind its last MoE layer (see sglang_oea.counters).
            self.device.snapshots.take(self.routed_steps)

    def count(self, mode: str, reason: Optional[str]) -> None:
        """One serving pass of `mode`: applied (reason None) or skipped with `reason`."""
        self.routed_steps += int(mode in ROUTED_MODES)
        if reason is None:
            self.applied[mode] += 1
            return
        self.skipped[(mode, reason)] += 1
        if reason == SKIP_NO_IDS:
            self.warn_once(SKIP_NO_IDS, "sglang-oea: a %s step ended without the routing hook seeing any top-k "
                           "ids; the MoE backend may route inside its kernel. OEA is not applied (metric reason "
                           "no_topk_ids).", mode)

    def replay_outcome(self, step: StepInfo) -> Optional[str]:
        """A replayed graph rewrote ids iff its capture pass did (the device gate agrees with the
        host gate, which already passed)."""
        return self.captured.get((step.mode, step.tally.replayed_bucket), SKIP_NO_IDS)

    def set_replay_rows(self, real_rows: int) -> None:
        """Before a graph replay: the real token rows, for the captured routing to read."""
        if self.device is not None:
            self.device.rows.fill_(real_rows)

    def note_replay(self, bucket: int) -> None:
        """After a graph replay: which bucket's graph (in requests) ran in this pass."""
        self.step.tally.replayed_bucket = bucket

    def warn_once(self, key: str, message: str, *args) -> None:
        if key not in self.warned:
            self.warned.add(key)
            logger.warning(message, *args)

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
        Returns:
            (ids [B, K + S] in topk_ids.dtype, weights [B, K + S] in topk_weights.dtype), or None.
        """
        step = self.step
        # Draft-model MoE blocks opt out of routed-expert capture; OEA leaves them alone too.
        if not step.routed or not topk_config.allow_routed_experts_capture:
            return None
        layer = layer_id or 0
        info = self.layer_routing(layer, topk_config, topk_ids.shape[1])
        if info.unsupported is not None:
            step.tally.unsupported = True
            self.warn_once(SKIP_UNSUPPORTED, "sglang-oea: this model's router (%s) is not supported; its experts "
                           "are routed unchanged.", info.unsupported)
            return None
        capturing = is_capturing(router_logits)
        graph = step.graph or capturing
        routed = self.route_if_open(layer, info, router_logits, topk_ids, topk_weights, capturing, graph)
        if self.dump is not None and not graph and self.dump.wants(step.index):
            rows = step.num_rows
            self.dump.write(step.index, layer, router_logits[:rows], info.spec, topk_config, info.num_routed,
                            topk_ids[:rows], None if routed is None else routed[0][:rows])
        return routed

    def route_if_open(self, layer: int, info: LayerRouting, logits, ids, weights, capturing: bool, graph: bool):
        """route()'s gates, then route_layer: (ids, weights), or None to keep the router's."""
        step = self.step
        if self.cfg.k0 >= info.num_routed:
            step.tally.noop = True
            return None
        # A graph bucket is gated on the device at replay: only buckets too small for min_batch
        # can be left out. Eager passes were gated on the host with their real requests.
        if (graph and step.requests < self.cfg.min_batch) or (not graph and not step.apply):
            return None
        routed = self.route_layer(layer, info, logits, ids, weights, capturing, graph)
        step.tally.rewrote |= routed is not None
        return routed

    def device_state(self, device: torch.device, capturing: bool) -> DeviceState:
        if self.device is None:
            if capturing:
                raise GraphCaptureError("sglang-oea: the routing state would be allocated inside CUDA-graph capture")
            self.device = DeviceState(device, self.cfg.stats, self.checksums)
        return self.device

    def route_layer(self, layer: int, info: LayerRouting, logits, ids, weights, capturing: bool, graph: bool):
        """Run the chosen router on one layer; count distinct experts and fold the checksum if the
        router did not. None when OEA is off for this routing shape (under --oea-kernel auto on
        CUDA, the kernel failed its self-check on some rank, or cannot run)."""
        state = self.device_state(logits.device, capturing)
        router = self.routers.router_for(info.slot, logits, ids, weights, info.spec, info.num_routed,
                                         state.stats, capturing, checksum=state.checksums)
        if router is None:
            self.step.tally.kernel_off = True
            return None
        rows, lo, hi = self.row_count(router.name, graph)
        counters = state.counters
        if counters is not None:
            counters.note_layer(layer)
        stats_row = counters.stats_row(layer) if state.stats else None
        checksum = counters.checksum_slot(layer) if state.checksums else None
        phase = CAPTURE if capturing else WARMUP if graph else EAGER
        new_ids, new_weights, counted = router(info.slot, logits, ids, weights, info.spec, self.cfg.k0,
                                               info.num_routed, rows, lo, hi, phase, stats_row, checksum)
        if counted:
            return new_ids, new_weights
        k = info.num_routed
        if state.stats:
            gate = batch_gate(rows, lo, hi) if isinstance(rows, torch.Tensor) else 1
            before = distinct_experts(ids[:, :k], logits.shape[1], rows)
            counters.add_stats(layer, before, distinct_experts(new_ids[:, :k], logits.shape[1], rows), gate)
        if state.checksums:
            checksum.add_(ids_checksum(new_ids[:, :k], rows))
        return new_ids, new_weights

    def row_count(self, router: str, graph: bool):
        """(rows, min_rows, max_rows) for the router. Graph passes and the kernel read the real
        token rows from the device scalar and gate on the device; the eager torch path uses host
        ints (the host gate already passed).

        The device gate compares token rows, so the request bounds are scaled by the rows per
        request: a verify pass has requests x draft tokens rows, the same for every request (SGLang
        replays a verify graph only for batches of its captured width), so the scaled gate opens
        exactly when the request gate does."""
        per_request = self.step.rows_per_request
        lo, hi = self.cfg.min_batch * per_request, self.cfg.max_batch * per_request
        if graph:
            return self.device.rows, lo, hi
        if router == "torch":
            return self.step.num_rows, 1, 0
        if not self.step.tally.rows_written:  # one small device write per eager pass
            self.device.rows.fill_(self.step.num_rows)
            self.step.tally.rows_written = True
        return self.device.rows, lo, hi
