"""Stand-in for SGLang's CUDA kernel wheel (`sgl_kernel`) on machines without a GPU driver.

The real wheel cannot load without a driver, yet several sglang modules import names from it at
import time. On the CPU engine none of those ops is called. This module satisfies the imports:
every attribute, and every submodule, is a stand-in that logs an error and raises if it is ever
called, so a CPU run can never silently depend on a missing GPU kernel.
"""

import importlib.abc
import importlib.machinery
import logging
import sys
import types

logger = logging.getLogger("sglang_oea.cpu_stub")
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
    """A module whose public attributes are raising stand-in ops."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        op = _StubOp(f"{self.__name__.partition('.')[2] or ''}.{name}".lstrip("."))
        setattr(self, name, op)
        return op


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Creates any `sgl_kernel.<sub>` module on import as a _StubModule."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        return None


if not any(isinstance(f, _StubFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _StubFinder())
sys.modules[__name__].__class__ = _StubModule
