"""KernelLaunch: one planned launch of a Triton kernel, and the name of the compiled binary it needs.
No SGLang import.

`oea_route` (sglang_oea.kernels.oea_route) runs its kernels through these plans, and so can a
caller that must know which compiled variants a call launches: the runtime records every variant
its CUDA-graph warm-ups launch and refuses an unseen one during capture (routers.TritonRouter), and
benchmark/oea/gpu/compile_table.py compiles the same plans offline.
"""

from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class KernelLaunch:
    """One planned kernel launch: runtime arguments (in the kernel's order), compile-time
    constants and launch options. `run()` launches it; `variant()` names the compiled binary it
    needs; tools that compile offline read the same plan."""

    kernel: object
    args: Tuple[Tuple[str, object], ...]
    constexprs: Tuple[Tuple[str, object], ...]
    do_not_specialize: Tuple[str, ...]
    num_warps: int
    grid: Tuple[int, ...]
    options: Tuple[Tuple[str, object], ...]  # compile options besides num_warps
    do_not_specialize_on_alignment: Tuple[str, ...] = ()

    def run(self):
        """Launch; returns Triton's compiled kernel (n_regs / n_spills once loaded on a GPU)."""
        return self.kernel[self.grid](**dict(self.args), **dict(self.constexprs), num_warps=self.num_warps,
                                      **dict(self.options))

    def specialization(self) -> Tuple[Tuple[str, object], ...]:
        """(type, specialization) per runtime argument, as Triton keys its compile cache: dtype and
        16-byte alignment of pointers (unless never specialised on alignment), int width and
        divisibility by 16 (an int equal to 1 becomes a constant) unless never specialised."""
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend

        return tuple(
            native_specialize_impl(BaseBackend, value, False, name not in self.do_not_specialize,
                                   name not in self.do_not_specialize_on_alignment)
            for name, value in self.args
        )

    def variant(self) -> tuple:
        """A hashable name of the compiled binary this launch needs (equal names, one binary):
        (kernel name, specialization, constexprs, num_warps, options)."""
        return (self.kernel.fn.__name__, self.specialization(), self.constexprs, self.num_warps, self.options)

