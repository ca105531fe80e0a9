"""SGLang plugin `oea_cpu_harness`: lets `cpu_serve --tp N` run the real server on the CPU.

It changes nothing about routing and does nothing unless the CPU stand-in `sgl_kernel` (see
cpu_serve) is the one this process would import, so on a GPU machine it is inert.

Why it exists: SGLang 0.5.23 decides whether a process group gets a PyNccl communicator from
the platform, not from the group's device (`init_model_parallel_group`), so with `--tp 2` on the
CPU engine every group builds one and fails with "Expected a cuda device, but got: cpu". With
no NCCL or custom communicator, `GroupCoordinator.all_reduce` on CPU tensors uses
torch.distributed over the gloo group, which is what a CPU run needs.

It is a separate plugin from `oea` so that a TP>1 baseline can load it alone
(SGLANG_PLUGINS=oea_cpu_harness): plain SGLang routing, on the CPU.
"""

import importlib.util
import os

from sglang_oea.cpu_serve import STUB_DIR

PARALLEL_GROUP = "sglang.srt.distributed.parallel_state.init_model_parallel_group"


def stub_active() -> bool:
    """True when `import sgl_kernel` would load the CPU stand-in (found, not imported)."""
    spec = importlib.util.find_spec("sgl_kernel")
    origin = getattr(spec, "origin", None) or ""
    return os.path.abspath(origin).startswith(STUB_DIR + os.sep)


def cpu_group_kwargs(group_ranks, local_rank, backend, *rest, **kwargs):
    """BEFORE hook: no PyNccl or custom all-reduce for groups of a CPU run (all of them)."""
    if rest:  # SGLang passes these three positionally and the rest by name; anything else is new
        raise TypeError(f"oea_cpu_harness: unexpected positional arguments to {PARALLEL_GROUP}: {rest!r}")
    kwargs.update(use_pynccl=False, use_custom_allreduce=False)
    return (group_ranks, local_rank, backend), kwargs


def register() -> None:
    """Entry point `oea_cpu_harness` in the `sglang.srt.plugins` group."""
    if not stub_active():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(PARALLEL_GROUP, cpu_group_kwargs, HookType.BEFORE)
