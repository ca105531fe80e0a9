"""Where and how OEA's routing hooks run inside SGLang 0.5.23. No SGLang import at module level.

- Which processes: only scheduler / TP-worker processes route. SGLang's plugin loader runs in
  every process (the launcher, the detokenizer, the DP controller, each scheduler), and a
  scheduler's process title is set only after its plugins load, so the call site tells them apart:
  `load_plugins()` is the first statement of `sglang.srt.managers.scheduler.run_scheduler_process`,
  the entry of every scheduler process (launched directly or through the DP controller).
- Not traced by torch.compile: under --enable-torch-compile SGLang compiles the decode forward
  (`compilation/torch_compile_decoration.patch_model`), which calls `select_experts` and so the
  routing hook. Traced, its host-side logic (step gates, the capture check, accounting) would run
  once at trace time and be baked into the graph; excluded, Dynamo breaks the graph there and the
  hook runs eagerly on every call, exactly as it does without torch.compile.
- Outside symmetric memory: `TopK.forward_cuda` calls `select_experts` inside
  `use_symmetric_memory(...)` (--enable-symm-mem), which sends allocations to NCCL's symmetric
  pool and, under graph capture, pauses the graph's private pool. OEA's routing runs with that
  context suspended, so its persistent state and its capture-time temporaries are ordinary (or
  graph-pool) allocations, and the context is restored afterwards, also when routing raises.
"""

import sys
from typing import Any, Callable, TypeVar

import torch

SCHEDULER_ENTRY = ("sglang.srt.managers.scheduler", "run_scheduler_process")
PYNCCL_ALLOCATOR = "sglang.srt.distributed.device_communicators.pynccl_allocator"

Hook = TypeVar("Hook", bound=Callable[..., Any])


def loading_in_scheduler_process() -> bool:
    """True when the caller runs (through `load_plugins`) inside SGLang's scheduler process entry."""
    module, function = SCHEDULER_ENTRY
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == function and frame.f_globals.get("__name__") == module:
            return True
        frame = frame.f_back
    return False


def never_traced(hook: Hook) -> Hook:
    """`hook`, run eagerly even when called from code that torch.compile traces (a graph break)."""
    return torch.compiler.disable(hook, reason="sglang-oea routing hook: host-side logic runs on every call")


def outside_symmetric_memory(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` with SGLang's active symmetric-memory context, if any, suspended.

    SGLang's own `disable_symmetric_memory_context` / `restore_symmetric_memory_context` do the
    suspending (its context's __exit__, then __enter__ again). Without an active context this costs a
    dictionary lookup and one call; the allocator module is never imported here.
    """
    allocator = sys.modules.get(PYNCCL_ALLOCATOR)
    saved = None if allocator is None else allocator.disable_symmetric_memory_context()
    if saved is None:
        return fn(*args, **kwargs)
    try:
        return fn(*args, **kwargs)
    finally:
        allocator.restore_symmetric_memory_context(saved)
