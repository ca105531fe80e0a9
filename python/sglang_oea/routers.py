"""The two implementations of one OEA routing call, and the choice between them. No SGLang import.

TorchRouter runs sglang_oea.routing (the CPU path, and --oea-kernel torch). TritonRouter runs the fused kernel with one
workspace per MoE layer and id/weight dtypes; it keeps the promises CUDA-graph capture needs:
  - the row count is always a device scalar, so eager warm-ups and capture launch one variant;
  - every variant a capture launches was launched before, outside capture (else GraphCaptureError);
  - a workspace is allocated outside capture and never freed or replaced: any graph may have
    captured it (SGLang captures several runners one after another: adaptive speculative decoding
    builds a verify runner per step count, each wider than the last). A call wider than every
    workspace of its key adds a larger one (at least twice the largest), so a key holds a few
    workspaces of growing capacity for the life of the process, and each call uses the smallest
    that fits. One layer may route ids of two dtypes (the int64 ids of a torch.compile bucket's
    native top-k, the int32 ids of every other call): each (slot, ids dtype, weights dtype) has its
    own workspaces.

RouterChoice applies --oea-kernel once per routing shape, and every tensor-parallel rank makes the
same choice (its `agree` is a MIN over the ranks' verdicts; TP sums partial outputs of the experts
each rank chose, so ranks that routed differently would be silently wrong):
  auto, on CUDA: the fused kernel if its self-check passed on every rank; else OEA is OFF for that
      shape (router_for returns None: keep the router's own ids), with one error line. The torch
      path is no fallback there: see TORCH_PATH_LAUNCHES_PER_LAYER.
  auto, elsewhere (the CPU engine): the torch path; self-check not_run.
  triton: the kernel if its self-check passed on every rank; else KernelSelfCheckError on every rank.
  torch: the torch path; the kernel is never compiled.
"""

import logging
from typing import Callable, Dict, List, Optional, Set, Tuple, Union

import torch

from sglang_oea.routing import RouterSpec, control_values, route_from_logits
from sglang_oea.self_check import RoutingShape, run_self_check, spec_key, trial_k0

logger = logging.getLogger("sglang_oea")

RowCount = Union[int, torch.Tensor]
# When a routing call happens: a plain eager pass, a CUDA-graph warm-up pass (eager, right before
# capture), or inside stream capture.
EAGER, WARMUP, CAPTURE = "eager", "warmup", "capture"

# Why a failed self-check under `auto` on CUDA turns OEA off instead of falling back to the torch
# path. Inside a CUDA graph every torch op is its own kernel node: route_from_logits is 21 to 39
# ops, and the runtime's counting adds about 55 more with the counts on (the default: distinct
# experts before and after, the kept router mass; cpu_routing_cost.py counts them), so about 25-40
# launches per MoE layer with --oea-disable-stats and up to about 95 without it, each about 2-3 us
# on the GPU at decode sizes (a tiny kernel plus the gap between nodes). GLM-5 has 75 MoE layers:
# 75 x 25-95 = 1,900-7,100 launches, about 4-21 ms per decode step.
# OEA saves a share of each MoE layer's expert-weight reads: 55-70 us per layer on Qwen3-30B at
# k0=4 / k0=3 on one H100 (175.7 -> 120.9 / 106.8 us, the paper), less under TP (0.85x / 0.73x of
# the layer on 8x H100), so roughly 1-5 ms per step over 75 layers. The torch path would likely cost more
# than OEA saves: a server that asked for `auto` gets the router's own experts (no slowdown, no
# change to outputs) and a loud error instead. --oea-kernel torch forces the torch path anyway.
# (An estimate from the paper's layer times and typical launch costs, not measured on GLM-5.)
TORCH_PATH_LAUNCHES_PER_LAYER = (25, 95)
GRAPH_LAUNCH_US = (2, 3)

# router_for's router names, as status() reports them.
TRITON, TORCH, OFF = "triton", "torch", "off"
# Self-check results, as status() reports them (low cardinality: they label a metric).
PASSED = "passed"  # passed on this rank and on every other rank
FAILED = "failed"  # failed on this rank
FAILED_OTHER_RANK = "failed_other_rank"  # passed here, failed (or could not run) on another rank
UNAVAILABLE = "unavailable"  # the kernel cannot run on this CUDA device (Triton missing)
NOT_RUN = "not_run"  # --oea-kernel torch, or no CUDA device (the CPU engine)
PENDING = "pending"  # no routing call yet
RESULT_PHRASES = {
    PASSED: "self-check passed", FAILED: "self-check failed", FAILED_OTHER_RANK: "self-check failed on another rank",
    UNAVAILABLE: "kernel unavailable", NOT_RUN: "self-check not run",
}

# What went wrong, for the error line (and the refusal under --oea-kernel triton).
FAILURE_PHRASES = {
    FAILED: "the kernel self-check failed", FAILED_OTHER_RANK: "the kernel self-check failed on another rank",
    UNAVAILABLE: "the kernel is unavailable",
}

# agree(passed_here) -> True iff every tensor-parallel rank passed; collective, called by every rank
# at the same point. None: a single process.
Agreement = Callable[[bool], bool]
# What keys a layer's workspace: its slot, and the ids and weights dtypes it returns.
WorkspaceKey = Tuple[int, torch.dtype, torch.dtype]


def min_agreement(group=None) -> Agreement:
    """An `agree` for RouterChoice over a torch.distributed CPU (gloo) process group: a MIN
    all-reduce of one int, so it returns True iff every rank passed. group: the tensor-parallel
    ranks' CPU group (None: the default group). A host tensor, at startup only: no device sync."""
    def agree(passed_here: bool) -> bool:
        verdict = torch.tensor([int(passed_here)], dtype=torch.int32)
        torch.distributed.all_reduce(verdict, op=torch.distributed.ReduceOp.MIN, group=group)
        return bool(verdict.item())
    return agree


class GraphCaptureError(RuntimeError):
    """Something that must happen before CUDA-graph capture was about to happen inside it."""


class KernelSelfCheckError(RuntimeError):
    """--oea-kernel triton, and the kernel cannot run here or failed its startup self-check (on
    this rank or on another)."""


def launch_kernel(logits, ids, weights, spec: RouterSpec, k0: int, num_routed: int, rows: RowCount,
                  min_batch: int, max_batch: int, workspace, stats=None, before_launch=None, checksum=None,
                  control: Optional[torch.Tensor] = None, rows_per_request: int = 1, lost=None):
    """kernels.oea_route with the router's scoring unpacked from its RouterSpec.

    stats: None or a [3] int64 device tensor, checksum: None or a [1] int64 device tensor, lost:
    None or a [MAX_K0] int64 device tensor, that the kernel adds this call's distinct-expert
    counts, its output ids' rank-check checksum and its lost router mass (at k0) into.
    control: None, or the device control block int32 [3] (k0, min_batch, max_batch) that the kernel
    reads instead of k0, min_batch and max_batch (the host's copy of the same values), with the
    floor scaled by rows_per_request.
    """
    from sglang_oea import kernels

    gate = dict(k0=k0, min_batch=min_batch, max_batch=max_batch) if control is None else dict(
        control=control, rows_per_request=rows_per_request)
    return kernels.oea_route(
        logits, ids, weights, num_routed=num_routed, scoring_func=spec.scoring_func,
        correction_bias=spec.correction_bias, num_groups=spec.num_groups, restrict_groups=spec.restrict_groups,
        num_valid_rows=rows, workspace=workspace, stats=stats, checksum=checksum, before_launch=before_launch,
        lost=lost, **gate,
    )


class TorchRouter:
    """OEA through sglang_oea.routing.route_from_logits (a handful of torch ops)."""

    name = TORCH

    def __call__(self, slot: int, logits, ids, weights, spec: RouterSpec, k0: int, num_routed: int,
                 rows: RowCount, min_batch: int, max_batch: int, phase: str = EAGER, stats=None, checksum=None,
                 control: Optional[torch.Tensor] = None, rows_per_request: int = 1, lost=None):
        """(ids [B, C], weights [B, C], counted): counted is always False: stats, checksum and lost
        are left untouched, for the runtime to add with reference ops. control: as launch_kernel's (k0 and
        the bounds read on the device: routing.control_values)."""
        shared = num_routed < ids.shape[1]
        routed_ids, routed_weights = (ids[:, :num_routed], weights[:, :num_routed]) if shared else (ids, weights)
        if control is not None:
            k0, min_batch, max_batch = control_values(control, rows_per_request)
        new_ids, new_weights = route_from_logits(logits, routed_ids, routed_weights, spec, k0, rows, min_batch, max_batch)
        new_ids = new_ids.to(ids.dtype)  # SGLang's MoE runners take the router's id dtype (int32)
        if not shared:
            return new_ids, new_weights, False
        return (torch.cat([new_ids, ids[:, num_routed:]], dim=1),
                torch.cat([new_weights, weights[:, num_routed:]], dim=1), False)


class TritonRouter:
    """OEA through the fused Triton kernel (two launches, counters fused in)."""

    name = TRITON
    MIN_WORKSPACE_ROWS = 1024

    def __init__(self):
        # (slot, ids dtype, weights dtype) -> its workspaces, by growing capacity; kept for the
        # process (a captured graph may point at any of them).
        self.workspaces: Dict[WorkspaceKey, List[object]] = {}
        self.prepared: Set[tuple] = set()  # kernel variants launched by graph warm-ups

    def workspace(self, slot: int, logits, ids, weights, capturing: bool):
        """The smallest workspace of this call's key with room for its rows; adds a larger one only
        outside capture (GraphCaptureError else) and never frees or replaces one."""
        from sglang_oea.kernels import OEAWorkspace

        rows, key = logits.shape[0], (slot, ids.dtype, weights.dtype)
        held = self.workspaces.get(key, [])
        for ws in held:  # ascending capacity
            if ws.max_rows >= rows:
                return ws
        if capturing:
            raise GraphCaptureError(
                f"sglang-oea: a MoE layer would allocate its routing workspace ({rows} rows, ids {ids.dtype}, "
                f"weights {weights.dtype}) inside CUDA-graph capture; it must be allocated by an eager call first"
            )
        # Doubling keeps a key's workspaces few, and their total size under twice the largest one.
        capacity = max(rows, self.MIN_WORKSPACE_ROWS, 2 * held[-1].max_rows if held else 0)
        ws = OEAWorkspace.allocate(logits.shape[1], ids.shape[1], capacity, ids.dtype, weights.dtype, logits.device)
        self.workspaces[key] = held + [ws]
        return ws

    def variant_guard(self, capturing: bool):
        """before_launch callback: record variants outside capture, refuse unseen ones inside it."""
        def guard(launch) -> None:
            key = launch.variant()
            if not capturing:
                self.prepared.add(key)
            elif key not in self.prepared:
                raise GraphCaptureError(
                    f"sglang-oea: kernel variant {key[0]} {dict(key[2])} would be compiled inside CUDA-graph "
                    "capture; an eager call with the same inputs must come first"
                )
        return guard

    def __call__(self, slot: int, logits, ids, weights, spec: RouterSpec, k0: int, num_routed: int,
                 rows: RowCount, min_batch: int, max_batch: int, phase: str = EAGER, stats=None, checksum=None,
                 control: Optional[torch.Tensor] = None, rows_per_request: int = 1, lost=None):
        """(ids [B, C], weights [B, C], counted): views of the layer's workspace; counted is always
        True: the kernel itself added this call's distinct-expert counts to `stats`, its ids'
        checksum to `checksum` and its lost router mass to `lost` (each when given), so the
        runtime adds none of them. Warm-up calls record
        the variants they launch; capture calls may launch only those (no check eagerly: it costs
        host time on every call). control: as launch_kernel's."""
        capturing = phase == CAPTURE
        ws = self.workspace(slot, logits, ids, weights, capturing)
        guard = None if phase == EAGER else self.variant_guard(capturing)
        new_ids, new_weights = launch_kernel(logits, ids, weights, spec, k0, num_routed, rows, min_batch, max_batch,
                                             ws, stats, guard, checksum, control, rows_per_request, lost)
        return new_ids, new_weights, True


def routing_shape(logits, ids, weights, spec: RouterSpec, num_routed: int, stats: bool,
                  checksum: bool = False, lost: bool = False) -> RoutingShape:
    return RoutingShape(logits.shape[1], num_routed, ids.shape[1], spec_key(spec), logits.dtype, ids.dtype,
                        weights.dtype, stats, checksum, lost)


class RouterChoice:
    """--oea-kernel applied per routing shape: which router runs, and how its self-check went.

    Args:
        kernel: --oea-kernel ("auto", "triton" or "torch").
        k0: the startup --oea-k0 (0 = armed but off), for the self-check: it runs with this k0 where
            it exercises the kernel (1 <= k0 < top-k), else with top-k // 2 (self_check.trial_k0).
        rank: this tensor-parallel rank (log lines).
        agree: `agree(passed_here) -> bool`, True iff every tensor-parallel rank passed (a MIN
            all-reduce over the TP CPU group); called exactly once per routing shape by every
            rank, whatever the path. None: a single process (this rank's verdict stands).
    """

    def __init__(self, kernel: str, k0: int, rank: int = 0, agree: Optional[Agreement] = None):
        self.kernel, self.k0, self.rank, self.agree = kernel, k0, rank, agree
        self.torch = TorchRouter()
        self.triton = TritonRouter()
        self.by_name = {TRITON: self.triton, TORCH: self.torch, OFF: None}
        self.decisions: Dict[RoutingShape, Tuple[str, str]] = {}  # shape -> (router name, self-check)
        # (slot, logits, ids and weights dtypes) -> router or None (off), once decided.
        self.by_slot: Dict[tuple, Optional[object]] = {}

    def kernel_device(self, logits: torch.Tensor) -> bool:
        """Whether the fused kernel is meant for this device: CUDA, or any device under
        TRITON_INTERPRET=1 (tests). The same on every rank (one --device per server)."""
        from sglang_oea import kernels

        return logits.is_cuda or kernels.interpret_mode()

    def kernel_available(self, device) -> bool:
        """Whether the fused kernel can run on this rank's device (Triton importable, device visible)."""
        from sglang_oea import kernels

        return kernels.is_available(device)

    def router_for(self, slot: int, logits, ids, weights, spec: RouterSpec, num_routed: int, stats: bool,
                   capturing: bool, checksum: bool = False, lost: bool = False):
        """The router for this call: TorchRouter, TritonRouter, or None when OEA is off for its
        routing shape (--oea-kernel auto on CUDA and the kernel failed its self-check on some rank:
        keep the router's own ids, count nothing). Decided at the first call of each routing shape,
        on every rank at once (see decide_first); cached per layer slot and dtypes, since one layer
        may route int64 ids in a torch.compile bucket and int32 ids elsewhere.

        Args:
            stats, checksum, lost: whether calls pass stats= / checksum= / lost= (part of the
                routing shape: each selects a compiled kernel variant, and the self-check runs
                the one named here).
        """
        key = (slot, logits.dtype, ids.dtype, weights.dtype)
        if key not in self.by_slot:
            shape = routing_shape(logits, ids, weights, spec, num_routed, stats, checksum, lost)
            if shape not in self.decisions:
                self.decisions[shape] = self.decide_first(shape, spec, logits, capturing)
            self.by_slot[key] = self.by_name[self.decisions[shape][0]]
        return self.by_slot[key]

    def decide_first(self, shape: RoutingShape, spec: RouterSpec, logits, capturing: bool) -> Tuple[str, str]:
        """The first call of a routing shape: this rank's verdict, the ranks' agreement, the choice.

        Every rank reaches this at the same routing call: the ranks run the same passes over the
        same layers with the same gates, and a shape (N, K, columns, scoring, dtypes) is a property
        of the replicated router. The agreement runs on every path, even where its answer cannot
        change the choice (--oea-kernel torch, the CPU engine): one tiny CPU collective per shape
        at startup, and a rule that pairs up with no proof that a skip condition is the same on
        every rank (kernel_available is not: Triton and device visibility are per process).
        """
        on_kernel_device = self.kernel != TORCH and self.kernel_device(logits)
        if capturing and on_kernel_device:
            # Before the agreement is fine: the flag, the device type and SGLang's order of warm-ups
            # and captures are the same on every rank, so every rank raises here.
            raise GraphCaptureError("sglang-oea: the kernel self-check would run inside CUDA-graph capture")
        result, error = self.check_here(shape, spec, logits.device) if on_kernel_device else (NOT_RUN, None)
        everywhere = self.agree_all(result == PASSED)
        if not on_kernel_device:
            if self.kernel == TRITON:
                raise KernelSelfCheckError(
                    f"sglang-oea: error: --oea-kernel triton, but the kernel cannot run on {logits.device}")
            return TORCH, NOT_RUN
        if everywhere:
            logger.info("sglang-oea rank %d: kernel self-check passed (%s)%s; routing with the fused Triton kernel",
                        self.rank, shape.describe(), "" if self.agree is None else " on every rank")
            return TRITON, PASSED
        if result == PASSED:
            result, error = FAILED_OTHER_RANK, ("it passed on this rank, but all tensor-parallel ranks must route "
                                                "alike (the failing rank's log has the reason)")
        return OFF, self.refuse(shape, result, error)

    def check_here(self, shape: RoutingShape, spec: RouterSpec, device) -> Tuple[str, Optional[str]]:
        """This rank's verdict alone: (PASSED, None), or (FAILED or UNAVAILABLE, why)."""
        if not self.kernel_available(device):
            return UNAVAILABLE, f"the fused kernel cannot run on {device} (is Triton installed?)"
        k0 = trial_k0(self.k0, shape.num_routed)
        error = run_self_check(self.kernel_trial(spec, shape.num_routed, k0), shape, spec, k0, device)
        return (PASSED, None) if error is None else (FAILED, error)

    def agree_all(self, passed_here: bool) -> bool:
        """True iff every rank passed (this rank's verdict in a single process)."""
        return passed_here if self.agree is None else bool(self.agree(passed_here))

    def refuse(self, shape: RoutingShape, result: str, error: str) -> str:
        """The kernel is out for this shape: raise under --oea-kernel triton; under auto, log one
        error line and return the self-check result that status() reports with router "off"."""
        what = FAILURE_PHRASES[result]
        if self.kernel == TRITON:
            raise KernelSelfCheckError(
                f"sglang-oea: error: --oea-kernel triton, but {what} ({shape.describe()}): {error}")
        low, high = TORCH_PATH_LAUNCHES_PER_LAYER
        logger.error(
            "sglang-oea rank %d: %s (%s): %s. OEA is OFF for this routing shape: its MoE layers use the "
            "router's own experts. The torch path is not used instead on CUDA: inside CUDA graphs it costs about "
            "%d-%d kernel launches per MoE layer (%d-%d us each), likely more than OEA saves. To route with it "
            "anyway, pass --oea-kernel torch; please report this failure (this line, the GPU, torch and triton "
            "versions).", self.rank, what, shape.describe(), error, low, high, *GRAPH_LAUNCH_US)
        return result

    def kernel_trial(self, spec: RouterSpec, num_routed: int, k0: Optional[int] = None):
        """The kernel launched as TritonRouter launches it (settings read from a device control
        block holding k0, min_batch 1, max_batch 0: those the torch path is compared under), on a
        scratch workspace per trial, with the counter arguments (stats, checksum, lost) that
        run_self_check passes for the routing shape: the compiled variant that serves it.
        k0: default trial_k0 of the startup k0."""
        from sglang_oea import kernels

        k0 = trial_k0(self.k0, num_routed) if k0 is None else k0

        def route(logits, ids, weights, rows, stats, checksum, lost):
            ws = kernels.OEAWorkspace.allocate(logits.shape[1], ids.shape[1], logits.shape[0], ids.dtype,
                                               weights.dtype, logits.device)
            control = torch.tensor([k0, 1, 0], dtype=torch.int32).to(logits.device)
            return launch_kernel(logits, ids, weights, spec, k0, num_routed, rows, 1, 0, ws, stats,
                                 checksum=checksum, control=control, lost=lost)
        return route

    def status(self) -> Dict[Tuple[str, str], int]:
        """{(router, self-check result): routing shapes}; {(kernel flag, "pending"): 0} before the
        first routing call. Routers: triton, torch, off (OEA off: the router's own ids). Results:
        passed (every rank), failed (this rank), failed_other_rank (passed here, failed on another
        rank), unavailable (no kernel on this CUDA device), not_run (--oea-kernel torch, or no CUDA
        device). off comes only with failed, failed_other_rank or unavailable."""
        if not self.decisions:
            return {(self.kernel, PENDING): 0}
        counts: Dict[Tuple[str, str], int] = {}
        for decision in self.decisions.values():
            counts[decision] = counts.get(decision, 0) + 1
        return counts

    def describe(self) -> str:
        """One phrase for the startup line: the router(s) in use and the self-check outcome."""
        def part(router: str, result: str, n: int) -> str:
            if not n:
                return "chosen at the first decode step"
            what = "OEA off, the router's own experts" if router == OFF else router
            return f"{what} ({RESULT_PHRASES[result]}, {n} routing shape{'s' * (n != 1)})"
        parts = [part(router, result, n) for (router, result), n in self.status().items()]
        return f"kernel {self.kernel}: " + ", ".join(parts)
