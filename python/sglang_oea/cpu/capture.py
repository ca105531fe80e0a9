"""CPU harness hook for SGLang's routed-expert capture (`--enable-return-routed-experts`).

One hook, registered by the `oea_cpu_harness` plugin only when the CPU stand-in `sgl_kernel` is in
use (harness.install_hooks):

- `unpinned` (BEFORE `mem_cache.pool_host.common.alloc_with_host_register`): host buffers are
  allocated without page-locking.

Why. The capture keeps a host copy of every token's routed experts, [tokens, layers, top-k] int32
(`state_capturer/base.py`, BaseHostCache). SGLang 0.5.23 allocates it with pin_memory=True, and
on every device but npu, musa and xpu that means `cudaHostRegister`, so on a machine with no CUDA
driver the scheduler stops at startup ("Found no NVIDIA driver on your system"). On the CPU engine
the capture's device buffer is already in host memory and nothing is copied over a bus, so the
buffer needs no pinning; everything else about the capture stays SGLang's own. The GPU path never
sees this hook.
"""

HOST_ALLOC = "sglang.srt.mem_cache.pool_host.common.alloc_with_host_register"
PIN_MEMORY_POSITION = 3  # alloc_with_host_register(dims, dtype, device, pin_memory, allocator, ...)


def unpinned(*args, **kwargs):
    """BEFORE hook: the same allocation with pin_memory=False (given by name or by position)."""
    if "pin_memory" in kwargs:
        kwargs["pin_memory"] = False
    elif len(args) > PIN_MEMORY_POSITION:
        args = (*args[:PIN_MEMORY_POSITION], False, *args[PIN_MEMORY_POSITION + 1:])
    return args, kwargs


def register_hooks() -> None:
    """Register the hook above with SGLang's HookRegistry (harness.install_hooks calls this)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOST_ALLOC, unpinned, HookType.BEFORE)
