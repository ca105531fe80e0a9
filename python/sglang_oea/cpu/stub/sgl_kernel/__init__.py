"""Stand-in for SGLang's CUDA kernel wheel (`sgl_kernel`) on machines without a GPU driver.

The real wheel cannot load without a driver, yet several sglang modules import names from it at
import time. On the CPU engine almost none of those ops is called. This module satisfies the
imports: every attribute, and every submodule, is a stand-in that logs an error and raises if it is
ever called, so a CPU run can never silently depend on a missing GPU kernel.

The exceptions are the ops in `cpu_bodies` (plain torch): SGLang's CPU engine calls them under
speculative decoding (NGRAM), to move KV slots and to prepare and verify draft tokens.
`eagle_bodies` adds those EAGLE / MTP drafts need (the draft's KV slots, its token tree, the bonus
token).
"""

import importlib.abc
import importlib.machinery
import logging
import sys
import types

logger = logging.getLogger("sglang_oea.cpu.stub")
OWN_MODULES = {__name__ + ".cpu_bodies", __name__ + ".eagle_bodies"}
__version__ = "0.0.0+sglang-oea-cpu-stub"
IS_SGLANG_OEA_STUB = True


class StubOpCalled(RuntimeError):
    """A GPU kernel from the stand-in sgl_kernel was called on the CPU path."""


class _StubOp:
    """A stand-in op: calling it logs and raises; its attributes are stand-ins too."""

    def __init__(self, qualname: str):
        self._qualname = qualname

    def __call__(self, *args, **kwargs):
        logger.error("sglang-oea CPU stand-in: sgl_kernel op %s was called; it has no CPU body", self._qualname)
        raise StubOpCalled(
            f"sgl_kernel.{self._qualname} was called, but sgl_kernel is a CPU stand-in (sglang_oea.cpu_serve)"
        )

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubOp(f"{self._qualname}.{name}")

    def __repr__(self) -> str:
        return f"<sgl_kernel CPU stand-in {self._qualname}>"


class _StubModule(types.ModuleType):
    """A module whose public attributes are raising stand-in ops (or a body from SUBMODULE_BODIES)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        qualname = f"{self.__name__.partition('.')[2] or ''}.{name}".lstrip(".")
        op = SUBMODULE_BODIES.get(qualname) or _StubOp(qualname)
        setattr(self, name, op)
        return op


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Creates any `sgl_kernel.<sub>` module on import as a _StubModule (but this stand-in's own files)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + ".") and fullname not in OWN_MODULES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        return None


# SGLang imports these from sgl_kernel itself (after the stand-in machinery they sit beside).
from sgl_kernel.cpu_bodies import (  # noqa: E402, F401
    assign_extend_cache_locs_cpu,
    assign_req_to_token_pool_cpu,
    copy_all_layer_kv_cache_cpu,
    fill_accept_out_cache_loc_cpu,
    reconstruct_indices_from_tree_mask,
    verify_tree_greedy_cpu,
)

from sgl_kernel.eagle_bodies import (  # noqa: E402, F401
    assign_draft_cache_locs_contiguous_cpu,
    build_tree_kernel_efficient_cpu,
    fill_bonus_tokens_cpu,
)

# Bodies SGLang imports from a submodule (`from sgl_kernel.speculative import ...`).
SUBMODULE_BODIES = {"speculative.reconstruct_indices_from_tree_mask": reconstruct_indices_from_tree_mask}

if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _StubFinder())
sys.modules[__name__].__class__ = _StubModule
