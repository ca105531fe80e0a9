"""Per-process OEA state and the routing step the SGLang hook calls. No SGLang import.

One OEARuntime lives in each scheduler / TP-worker process. The forward-context hook tells it
what kind of pass is running (decode, target verify, draft or other; its real token rows and
requests; whether it is a CUDA-graph warm-up or capture pass); the routing hook hands it SGLang's
top-k output, and it returns the OEA ids and weights, or None to leave them alone. Statistics are
kept on the device and read by the host once per decode-log interval.

Routed passes: DECODE (rows = requests) and, under speculative decoding, the target model's
TARGET_VERIFY passes (rows = requests x draft tokens). In both, every real row is a token of the
union and padded rows are excluded. The batch gate's floor (min_batch) counts requests; its cap
(max_batch) counts routed token rows, since the union's coverage of the experts grows with rows.

Live settings. k0, min_batch and max_batch are a LiveSettings that may change while the server
runs (request_settings, from the scheduler's host thread between passes, already validated). A
request takes effect at the next outermost forward pass that is not a CUDA-graph warm-up or
capture pass: begin_step, on the forward stream, writes the changed values into the device
control block that captured graphs and the kernel read (no host sync, no recapture), and that
pass and every later one route with them; a pass already begun keeps its own. k0 = 0 is OEA off
(the router's own experts, bit for bit), k0 >= the layer's top-k a no-op. A runtime built with
startup k0 = 0 ("armed but off") captures routing into its graphs all the same, so that a later
k0 routes without recapture; eager passes with k0 = 0 or >= top-k launch nothing.

OEARuntime is the façade the hooks use. Behind it:
    passes          what pass is running (StepInfo, PassTally) and the batch gate over it
    accounting      each pass, when the outermost one ends: applied, or skipped with the reason
    layer_router    one MoE layer routed: its TopKConfig read once, the chosen router run, counted
    router_dump     --oea-dump-router-logits
"""

import logging
import os
import threading
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from sglang_oea.accounting import PassAccounts
from sglang_oea.config import LiveSettings, OEAConfig
from sglang_oea.counters import MAX_LAYERS, LayerCounters, Snapshot
from sglang_oea.gathered import gathered_order, layout_problem, slot_starts
from sglang_oea.layer_router import DeviceState, LayerRouter, LayerRouting, host_int32
from sglang_oea.passes import (  # the pass vocabulary, imported from here by the hooks, metrics and tests
    DECODE, DRAFT, OTHER, ROUTED_MODES, SKIP_ABOVE_MAX, SKIP_BELOW_MIN, SKIP_KERNEL_OFF, SKIP_NO_IDS, SKIP_NOOP,
    SKIP_LAYOUT, SKIP_NOT_DECODE, SKIP_OFF, SKIP_UNSUPPORTED, SKIP_VERIFY, VERIFY, PassTally, StepInfo,
    bucket_may_open, skip_reason,
)
from sglang_oea.rank_check import RankCheck
from sglang_oea.router_dump import RouterDump
from sglang_oea.routers import GraphCaptureError, RouterChoice

logger = logging.getLogger(__name__)

__all__ = [
    "OEARuntime", "graph_capture_active", "is_capturing", "MAX_LAYERS", "PassTally", "StepInfo",
    "DECODE", "VERIFY", "DRAFT", "OTHER", "ROUTED_MODES", "SKIP_BELOW_MIN", "SKIP_ABOVE_MAX", "SKIP_NOT_DECODE",
    "SKIP_VERIFY", "SKIP_NO_IDS", "SKIP_UNSUPPORTED", "SKIP_NOOP", "SKIP_KERNEL_OFF", "SKIP_OFF", "SKIP_LAYOUT",
]


def graph_capture_active() -> bool:
    """True while a CUDA graph is being captured on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def is_capturing(tensor: torch.Tensor) -> bool:
    """True while a CUDA graph that `tensor` belongs to is being captured."""
    return tensor.is_cuda and graph_capture_active()


def dump_directory(directory: str, dp_rank: Optional[int]) -> str:
    """Where a process writes --oea-dump-router-logits: DIR, or DIR/dp<N> in data-parallel replica N
    (each replica numbers its own TP ranks and steps from 0, so their files would collide)."""
    return directory if dp_rank is None else os.path.join(directory, f"dp{dp_rank}")


def _read_through(part: str, name: str, doc: str) -> property:
    """A read-only attribute of the façade that reads `name` of one of its parts."""
    return property(lambda runtime: getattr(getattr(runtime, part), name), doc=doc)


class OEARuntime:
    """OEA for one process: gate, route, count (passes, layer_router, accounting behind it)."""

    def __init__(self, cfg: OEAConfig, rank: int = 0, speculative: bool = False, world_size: int = 1,
                 agree: Optional[Callable[[bool], bool]] = None, dp_rank: Optional[int] = None, groups: int = 0,
                 slots: Optional[Callable[[], Optional[Sequence[int]]]] = None):
        """rank, world_size: this process's place in its tensor-parallel group. agree: combines this
        rank's kernel self-check verdict with every other TP rank's (routers.RouterChoice); None in
        a single process. dp_rank: its data-parallel replica (--dp-size > 1) or, under DP attention,
        its attention-DP group; None without either. groups: the attention-DP groups under DP
        attention (0 without it); slots: reads the padded token counts of the groups' slots in the
        current eager pass's gathered buffer (SGLang's, sglang_oea.dp_attention)."""
        self.cfg = cfg
        self.groups = groups
        self.slots = slots
        self.rank = rank
        self.dp_rank = dp_rank
        self.world_size = world_size
        # Checksums only when there are ranks to compare them with.
        self.checksums = bool(cfg.check_ranks) and world_size > 1
        self.rank_check: Optional[RankCheck] = None  # set once the process groups exist
        self.speculative = speculative
        # Draft tokens per request of every verify pass this server runs (set at scheduler start;
        # () without speculative decoding or with --oea-verify off): the live cap is checked
        # against them (passes.verify_cap_problem).
        self.verify_widths: Tuple[int, ...] = ()
        self.moe_shape: Optional[Any] = None  # the model's model_info.MoEShape, set at scheduler start
        self._settings = cfg.live()  # those of the last outermost pass begun
        self._pending: Optional[LiveSettings] = None  # requested, not yet applied
        self._pending_lock = threading.Lock()
        # Called with each accepted change (request_settings), on the scheduler's thread: the
        # settings gauges follow at once, on an idle server too (sglang_oea.metrics).
        self.settings_listeners: List[Callable[[LiveSettings], None]] = []
        self.step = StepInfo()
        self.depth = 0  # nesting of SGLang forward contexts
        self.graph_buckets: Tuple[int, ...] = ()  # the capturing runner's buckets (requests), set around capture
        self.device: Optional[DeviceState] = None
        self.accounts = PassAccounts(cfg)
        self.routers = RouterChoice(cfg.kernel, cfg.k0, rank, agree=agree)
        self.layer_router = LayerRouter(cfg, self.routers)
        # Under DP attention every rank routes the same gathered batch and counts the same steps: one folder.
        dump_dir = cfg.dump_router_logits and dump_directory(cfg.dump_router_logits, None if groups else dp_rank)
        self.dump = RouterDump(dump_dir, cfg.dump_steps, rank) if dump_dir else None
        self.warned: set = set()

    # ------------------------------------------------------------------ the parts, read through

    routed_steps = _read_through("accounts", "routed_steps", "Decode and verify steps counted (applied or skipped).")
    applied = _read_through("accounts", "applied", "pass mode -> steps whose ids OEA rewrote.")
    skipped = _read_through("accounts", "skipped", "(pass mode, reason) -> steps without OEA.")
    captured = _read_through("accounts", "captured", "(mode, bucket, rows per request) -> outcome of its capture.")
    applied_steps = _read_through("accounts", "applied_steps", "Steps whose ids OEA rewrote, over all pass modes.")
    skipped_steps = _read_through("accounts", "skipped_steps", "reason -> skipped steps, over all pass modes.")
    applied_by_k0 = _read_through("accounts", "applied_by_k0", "(pass mode, k0) -> steps whose ids OEA rewrote.")
    skipped_by_k0 = _read_through("accounts", "skipped_by_k0", "(pass mode, k0, reason) -> steps without OEA.")
    layers = _read_through("layer_router", "layers", "(layer id, id(TopKConfig)) -> the layer's routing.")

    @property
    def routed_mode(self) -> str:
        """The mode of this server's routed passes: verify under speculative decoding (its decode
        passes are the draft's), else decode. A server has exactly one."""
        return VERIFY if self.speculative else DECODE

    def moe_layers(self) -> Tuple[int, ...]:
        """The ids of the MoE layers OEA routes (those whose router it supports), seen so far."""
        return tuple(sorted({layer for (layer, _), info in self.layers.items() if info.unsupported is None}))

    def steps_of(self, mode: str) -> int:
        """Counted steps (applied or skipped) of one pass mode."""
        return self.accounts.steps_of(mode)

    def count(self, mode: str, reason: Optional[str], k0: Optional[int] = None, rows: int = 0) -> None:
        """One serving pass of `mode` with `rows` real token rows, routed with k0 (default: that in
        force): applied (reason None) or skipped with `reason`."""
        self.accounts.count(mode, reason, self._settings.k0 if k0 is None else k0, rows)

    # ------------------------------------------------------------------ live settings

    @property
    def settings(self) -> LiveSettings:
        """The settings in force: those of the last outermost pass begun (at creation: cfg.live())."""
        return self._settings

    @property
    def pending(self) -> Optional[LiveSettings]:
        """Settings requested and not yet applied (None when there are none)."""
        return self._pending

    def request_settings(self, new: LiveSettings) -> None:
        """Ask for `new` (already validated) from the next outermost pass on; see the module
        docstring. Host only: nothing is written to the device here. Of several requests before
        that pass, the last wins. The settings listeners hear of it at once."""
        with self._pending_lock:
            self._pending = new
        for listener in self.settings_listeners:
            listener(new)

    def apply_pending(self) -> None:
        """At an outermost begin_step outside graph capture: make the requested settings those in
        force, write their changed values into the device control block (on the current stream:
        the forward stream), and log it once."""
        with self._pending_lock:
            new, self._pending = self._pending, None
        old = self._settings
        if new is None or new == old:
            return
        if self.device is not None:
            self.device.write_control(new)
        self._settings = new
        logger.info("sglang-oea rank %d: settings k0=%d min_batch=%d max_batch=%d -> k0=%d min_batch=%d "
                    "max_batch=%d from routed step %d", self.rank, old.k0, old.min_batch, old.max_batch, new.k0,
                    new.min_batch, new.max_batch, self.routed_steps)

    # ------------------------------------------------------------------ device state

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

    def device_state(self, device: torch.device, capturing: bool) -> DeviceState:
        if self.device is None:
            if capturing:
                raise GraphCaptureError("sglang-oea: the routing state would be allocated inside CUDA-graph capture")
            self.device = DeviceState(device, self.cfg.stats, self.checksums, self._settings, self.groups)
        return self.device

    # ------------------------------------------------------------------ the pass

    def pass_mode(self, mode: str) -> str:
        """The mode OEA treats a pass as: under speculative decoding, decode passes are the draft's."""
        return DRAFT if mode == DECODE and self.speculative else mode

    def begin_step(self, mode: str = DECODE, num_rows: int = 0, graph: bool = False, outermost: bool = True,
                   decode: Optional[bool] = None, requests: Optional[int] = None, groups: int = 0,
                   group_rows: Tuple[int, ...] = ()) -> StepInfo:
        """Enter a forward pass (host ints only: no device sync); returns the previous step.

        num_rows: token rows; requests: the pass's requests (default num_rows, as in decode).
        groups, group_rows: the gathered batch under DP attention (StepInfo).
        A nested context (outermost=False) describes the same pass: it shares its tally and its
        settings. An outermost pass outside CUDA-graph warm-up and capture first applies the
        settings requested since the last one (apply_pending).
        `decode=True/False` is shorthand for mode DECODE / OTHER.
        """
        if decode is not None:
            mode = DECODE if decode else OTHER
        mode = self.pass_mode(mode)
        requests = num_rows if requests is None else requests
        previous = self.step
        if outermost and self._pending is not None and not graph and not graph_capture_active():
            self.apply_pending()
        tally = PassTally() if outermost else previous.tally
        index = self.routed_steps if outermost else previous.index
        settings = self._settings if outermost else previous.settings
        apply = skip_reason(settings, self.cfg.verify, mode, requests, num_rows) is None
        self.step = StepInfo(mode=mode, num_rows=num_rows, requests=requests, apply=apply, graph=graph,
                             index=index, tally=tally, settings=settings, groups=groups, group_rows=tuple(group_rows))
        return previous

    def end_step(self) -> None:
        """Account for the outermost pass that is ending (sglang_oea.accounting), then snapshot the
        counters of a routed one."""
        step = self.step
        counted = self.accounts.end_pass(step)
        if counted and step.routed and self.device is not None and self.device.snapshots is not None:
            # On the stream that ran the pass, behind its last MoE layer (see sglang_oea.counters).
            self.device.snapshots.take(self.routed_steps, host=dict(self.accounts.tokens_by_k0))

    def set_replay_rows(self, real_rows: int) -> None:
        """Before a graph replay: the real token rows, for the captured routing to read (under DP
        attention: every group's, from the pass's gathered rows, and each group's apart)."""
        if self.device is None:
            return
        step = self.step
        if step.groups and step.group_rows and self.device.group_rows is not None:
            self.device.write_group_rows(step.group_rows)
            real_rows = sum(step.group_rows)
        self.device.rows.fill_(real_rows)

    def note_replay(self, bucket: int) -> None:
        """After a graph replay: which bucket's graph (in requests) ran in this pass."""
        self.step.tally.replayed_bucket = bucket

    def warn_once(self, key: str, message: str, *args) -> None:
        if key not in self.warned:
            self.warned.add(key)
            logger.warning(message, *args)

    # ------------------------------------------------------------------ routing

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
        info = self.layer_router.layer_routing(layer, topk_config, topk_ids.shape[1])
        if info.unsupported is not None:
            step.tally.unsupported = True
            self.warn_once(SKIP_UNSUPPORTED, "sglang-oea: this model's router (%s) is not supported; its experts "
                           "are routed unchanged.", info.unsupported)
            return None
        capturing = is_capturing(router_logits)
        graph = step.graph or capturing
        routed = self.route_if_open(layer, info, router_logits, topk_ids, topk_weights, capturing, graph)
        if self.dump is not None and not graph and self.dump.wants(step.index):
            self.dump_layer(layer, info, topk_config, router_logits, topk_ids, routed)
        return routed

    def dump_layer(self, layer: int, info: LayerRouting, topk_config: Any, logits, ids, routed) -> None:
        """--oea-dump-router-logits: the real rows of one eager layer (under DP attention, every
        group's real rows of the gathered batch, in buffer order)."""
        step = self.step
        tensors = (logits, ids, None if routed is None else routed[0])
        order = (self.gathered(self.device_state(logits.device, False), logits.shape[0], False, False)
                 if step.groups else None)
        if step.groups and order is None:
            return
        if order is None:
            real = [t if t is None else t[:step.num_rows] for t in tensors]
        else:
            real = [t if t is None else t.index_select(0, order[0][:step.num_rows]) for t in tensors]
        self.dump.write(step.index, layer, real[0], info.spec, topk_config, info.num_routed, real[1], real[2])

    def route_if_open(self, layer: int, info: LayerRouting, logits, ids, weights, capturing: bool, graph: bool):
        """route()'s gates, then the layer router: (ids, weights), or None to keep the router's.

        A graph bucket is gated on the device at replay, k0 included (from the control block), so
        that live settings need no recapture; a bucket whose every batch is outside the startup
        envelope (passes.bucket_may_open) is captured without routing. Eager passes were gated on
        the host (k0 = 0 among them); one whose k0 covers the layer's top-k launches nothing.
        """
        step = self.step
        if graph:
            if not bucket_may_open(self.cfg, step, self.graph_buckets):
                return None
        elif not step.apply:
            return None
        elif step.settings.k0 >= info.num_routed:
            step.tally.noop = True
            return None
        state = self.device_state(logits.device, capturing)
        order = None
        if step.groups:  # route the gathered batch's real rows, moved to the front (sglang_oea.gathered)
            order = self.gathered(state, logits.shape[0], graph, capturing)
            if order is None:
                return None
            logits, ids, weights = (t.index_select(0, order[0]) for t in (logits, ids, weights))
        routed = self.layer_router.route_layer(step, state, layer, info, logits, ids, weights, capturing, graph)
        if routed is None:
            return None
        step.tally.rewrote = True
        step.tally.top_k = max(step.tally.top_k, info.num_routed)
        return routed if order is None else tuple(t.index_select(0, order[1]) for t in routed)

    def gathered(self, state: DeviceState, num_rows: int, graph: bool, capturing: bool):
        """(order, inverse) of this pass's gathered batch (sglang_oea.gathered), made at its first
        routed layer; None, with the pass skipped as SKIP_LAYOUT, when its layout is not the one
        expected. Graph passes read each group's real rows from the device (written before every
        replay) in equal slots; eager passes take them from the host, in the slots SGLang padded.

        Made again inside a capture: SGLang runs a bucket's eager warm-ups and its capture in one
        outer forward context (one tally), and an order made by a warm-up holds that warm-up's
        rows, in memory the graph does not own."""
        step = self.step
        cached = step.tally.order
        if cached is not None and cached[:2] == (num_rows, capturing):
            return cached[2], cached[3]
        real, starts = state.group_rows, None
        if graph:
            problem = layout_problem(num_rows, [0] * step.groups, None)
        else:
            slots = self.slots() if self.slots is not None else None
            problem = ("the gathered slots' sizes are unknown" if slots is None
                       else layout_problem(num_rows, step.group_rows, slots))
            if problem is None:
                block = host_int32(list(step.group_rows) + slot_starts(slots), state.rows.device).to(
                    state.rows.device, non_blocking=True)
                real, starts = block[:step.groups], block[step.groups:]
        if problem is not None or real is None:
            step.tally.layout = True
            self.warn_once(SKIP_LAYOUT, "sglang-oea: a DP-attention pass's gathered batch is not laid out as "
                           "expected (%s); OEA leaves such passes alone.", problem or "no group rows on the device")
            return None
        order, inverse = gathered_order(num_rows, real, starts)
        step.tally.order = (num_rows, capturing, order, inverse)
        return order, inverse
