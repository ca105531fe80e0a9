"""The two implementations of one OEA routing call, and the choice between them. No SGLang import.

TorchRouter runs sglang_oea.routing (the CPU path, and the fallback on CUDA). TritonRouter runs
the fused kernel with one workspace per MoE layer; it keeps the promises CUDA-graph capture needs:
  - the row count is always a device scalar, so eager warm-ups and capture launch one variant;
  - every variant a capture launches was launched before, outside capture (else GraphCaptureError);
  - a workspace is allocated outside capture, sized at the layer's first call, and never freed or
    replaced (captured graphs point at it); larger eager batches get a separate overflow workspace.
RouterChoice applies --oea-kernel: auto runs the startup self-check and falls back to torch on
any failure; triton refuses to start instead; torch never touches the kernel.
"""

import logging
from typing import Dict, Set, Tuple, Union

import torch

from sglang_oea.routing import RouterSpec, route_from_logits
from sglang_oea.self_check import RoutingShape, run_self_check, spec_key

logger = logging.getLogger("sglang_oea")

RowCount = Union[int, torch.Tensor]
# When a routing call happens: a plain eager pass, a CUDA-graph warm-up pass (eager, right before
# capture), or inside stream capture.
EAGER, WARMUP, CAPTURE = "eager", "warmup", "capture"


class GraphCaptureError(RuntimeError):
    """Something that must happen before CUDA-graph capture was about to happen inside it."""


class KernelSelfCheckError(RuntimeError):
    """--oea-kernel triton, and the kernel's startup self-check failed."""


def launch_kernel(logits, ids, weights, spec: RouterSpec, k0: int, num_routed: int, rows: RowCount,
                  min_batch: int, max_batch: int, workspace, stats=None, before_launch=None):
    """kernels.oea_route with the router's scoring unpacked from its RouterSpec."""
    from sglang_oea import kernels

    return kernels.oea_route(
        logits, ids, weights, k0=k0, num_routed=num_routed, scoring_func=spec.scoring_func,
        correction_bias=spec.correction_bias, num_groups=spec.num_groups, restrict_groups=spec.restrict_groups,
        num_valid_rows=rows, min_batch=min_batch, max_batch=max_batch, workspace=workspace, stats=stats,
        before_launch=before_launch,
    )


class TorchRouter:
    """OEA through sglang_oea.routing.route_from_logits (a handful of torch ops)."""

    name = "torch"

    def __call__(self, slot: int, logits, ids, weights, spec: RouterSpec, k0: int, num_routed: int,
                 rows: RowCount, min_batch: int, max_batch: int, phase: str = EAGER, stats=None):
        """(ids [B, C], weights [B, C], counted): counted is False (the runtime counts)."""
        shared = num_routed < ids.shape[1]
        routed_ids, routed_weights = (ids[:, :num_routed], weights[:, :num_routed]) if shared else (ids, weights)
        new_ids, new_weights = route_from_logits(logits, routed_ids, routed_weights, spec, k0, rows, min_batch, max_batch)
        new_ids = new_ids.to(ids.dtype)  # SGLang's MoE runners take the router's id dtype (int32)
        if not shared:
            return new_ids, new_weights, False
        return (torch.cat([new_ids, ids[:, num_routed:]], dim=1),
                torch.cat([new_weights, weights[:, num_routed:]], dim=1), False)


class TritonRouter:
    """OEA through the fused Triton kernel (two launches, counters fused in)."""

    name = "triton"
    MIN_WORKSPACE_ROWS = 1024

    def __init__(self):
        self.workspaces: Dict[int, object] = {}  # layer slot -> workspace, fixed once made
        self.overflow: Dict[int, object] = {}  # layer slot -> eager-only workspace for larger batches
        self.prepared: Set[tuple] = set()  # kernel variants launched by graph warm-ups

    def workspace(self, slot: int, logits, ids, weights, capturing: bool):
        """The workspace for this call; allocates only outside capture (GraphCaptureError else)."""
        from sglang_oea.kernels import OEAWorkspace

        rows = logits.shape[0]
        for table in (self.workspaces, self.overflow):
            ws = table.get(slot)
            if ws is not None and ws.max_rows >= rows:
                return ws
        if capturing:
            raise GraphCaptureError(
                f"sglang-oea: a MoE layer would allocate its routing workspace ({rows} rows) inside "
                "CUDA-graph capture; it must be allocated by an eager call first"
            )
        # The first workspace of a layer is the one graphs capture: never replace it.
        table = self.overflow if slot in self.workspaces else self.workspaces
        table[slot] = OEAWorkspace.allocate(
            logits.shape[1], ids.shape[1], max(rows, self.MIN_WORKSPACE_ROWS), ids.dtype, weights.dtype, logits.device
        )
        return table[slot]

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
                 rows: RowCount, min_batch: int, max_batch: int, phase: str = EAGER, stats=None):
        """(ids [B, C], weights [B, C], counted): views of the layer's workspace; counted is True
        when the kernel added this call's distinct-expert counts to `stats` itself. Warm-up calls
        record the variants they launch; capture calls may launch only those (no check eagerly:
        it costs host time on every call)."""
        capturing = phase == CAPTURE
        ws = self.workspace(slot, logits, ids, weights, capturing)
        guard = None if phase == EAGER else self.variant_guard(capturing)
        new_ids, new_weights = launch_kernel(logits, ids, weights, spec, k0, num_routed, rows, min_batch, max_batch,
                                             ws, stats, guard)
        return new_ids, new_weights, stats is not None


def routing_shape(logits, ids, weights, spec: RouterSpec, num_routed: int, stats: bool) -> RoutingShape:
    return RoutingShape(logits.shape[1], num_routed, ids.shape[1], spec_key(spec), logits.dtype, ids.dtype,
                        weights.dtype, stats)


class RouterChoice:
    """--oea-kernel applied per routing shape: which router runs, and how its self-check went."""

    def __init__(self, kernel: str, k0: int, rank: int = 0):
        self.kernel, self.k0, self.rank = kernel, k0, rank
        self.torch = TorchRouter()
        self.triton = TritonRouter()
        self.decisions: Dict[RoutingShape, Tuple[str, str]] = {}  # shape -> (router name, self-check)
        self.by_slot: Dict[int, object] = {}  # layer slot -> router, once decided

    def kernel_wanted(self, logits: torch.Tensor) -> bool:
        """Whether --oea-kernel lets this call use the fused kernel on this device."""
        from sglang_oea import kernels

        if self.kernel == "torch":
            return False
        # Under TRITON_INTERPRET=1 (tests) the kernel also runs on CPU tensors.
        return (logits.is_cuda or kernels.interpret_mode()) and kernels.is_available(logits.device)

    def router_for(self, slot: int, logits, ids, weights, spec: RouterSpec, num_routed: int, stats: bool,
                   capturing: bool):
        """The router for this layer slot, decided at its first call (a layer's shapes never change)."""
        router = self.by_slot.get(slot)
        if router is None:
            shape = routing_shape(logits, ids, weights, spec, num_routed, stats)
            if shape not in self.decisions:
                self.decisions[shape] = self.decide_first(shape, spec, logits, capturing)
            router = self.by_slot[slot] = self.triton if self.decisions[shape][0] == "triton" else self.torch
        return router

    def decide_first(self, shape: RoutingShape, spec: RouterSpec, logits, capturing: bool) -> Tuple[str, str]:
        """The first call of a routing shape: no kernel here, or its self-check (never in capture)."""
        if not self.kernel_wanted(logits):
            if self.kernel == "triton":
                raise KernelSelfCheckError(
                    f"sglang-oea: error: --oea-kernel triton, but the kernel cannot run on {logits.device}")
            return "torch", "not_run"
        if capturing:
            raise GraphCaptureError("sglang-oea: the kernel self-check would run inside CUDA-graph capture")
        return self.decide(shape, spec, logits.device)

    def decide(self, shape: RoutingShape, spec: RouterSpec, device) -> Tuple[str, str]:
        """Run the self-check for one routing shape; returns (router name, self-check result)."""
        error = run_self_check(self.kernel_trial(spec, shape.num_routed), shape, spec, self.k0, device)
        if error is None:
            logger.info("sglang-oea rank %d: kernel self-check passed (%s); routing with the fused Triton kernel",
                        self.rank, shape.describe())
            return "triton", "passed"
        if self.kernel == "triton":
            raise KernelSelfCheckError(f"sglang-oea: error: --oea-kernel triton, but the kernel self-check failed "
                                       f"({shape.describe()}): {error}")
        logger.error("sglang-oea rank %d: kernel self-check failed (%s): %s; routing with the torch path",
                     self.rank, shape.describe(), error)
        return "torch", "failed"

    def kernel_trial(self, spec: RouterSpec, num_routed: int):
        """The kernel launched as TritonRouter launches it, on a scratch workspace per trial."""
        from sglang_oea import kernels

        def route(logits, ids, weights, rows, stats):
            ws = kernels.OEAWorkspace.allocate(logits.shape[1], ids.shape[1], logits.shape[0], ids.dtype,
                                               weights.dtype, logits.device)
            return launch_kernel(logits, ids, weights, spec, self.k0, num_routed, rows, 1, 0, ws, stats)
        return route

    def status(self) -> Dict[Tuple[str, str], int]:
        """{(router, self-check result): routing shapes}; {(kernel flag, "pending"): 0} before the first
        routing call. Results: passed, failed, not_run (--oea-kernel torch, or no CUDA device)."""
        if not self.decisions:
            return {(self.kernel, "pending"): 0}
        counts: Dict[Tuple[str, str], int] = {}
        for decision in self.decisions.values():
            counts[decision] = counts.get(decision, 0) + 1
        return counts

    def describe(self) -> str:
        """One phrase for the startup line: the router(s) in use and the self-check outcome."""
        parts = [f"{router} (self-check {result.replace('_', ' ')}, {n} routing shape{'s' * (n != 1)})" if n else
                 "chosen at the first decode step" for (router, result), n in self.status().items()]
        return f"kernel {self.kernel}: " + ", ".join(parts)
