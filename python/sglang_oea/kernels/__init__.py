"""Fused OEA routing kernels (Triton). The pure-torch sglang_oea.routing stays the CPU path.

    oea_route   the two kernels, their math and shapes, and the launcher `oea_route`
    row_counters  the per-row counters launch 2 adds (rank-check checksum, lost router mass)
    workspace   OEAWorkspace, the buffers a call writes into (preallocated for CUDA graphs)
    launch      KernelLaunch, one planned launch and the compiled variant it needs
    checks      the checks of one call's arguments (shapes, dtypes, devices: no device sync)

Importing this package never fails: without Triton, `is_available()` is False and `oea_route`
raises. Nothing here imports SGLang.
"""

import importlib.util
import os
from typing import Optional, Union

import torch

_HAVE_TRITON = importlib.util.find_spec("triton") is not None

if _HAVE_TRITON:
    from sglang_oea.kernels.oea_route import OEAWorkspace, oea_route
else:  # pragma: no cover - depends on the environment

    class OEAWorkspace:  # type: ignore[no-redef]
        def __init__(self, *args, **kwargs):
            raise ImportError("sglang_oea.kernels needs triton")

        @classmethod
        def allocate(cls, *args, **kwargs):
            raise ImportError("sglang_oea.kernels needs triton")

    def oea_route(*args, **kwargs):  # type: ignore[no-redef]
        raise ImportError("sglang_oea.kernels needs triton")


def interpret_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def is_available(device: Optional[Union[str, torch.device]] = None) -> bool:
    """Whether `oea_route` can run on `device` (default: CUDA, or anything under the interpreter).

    CUDA tensors need Triton and a CUDA device; CPU tensors need TRITON_INTERPRET=1 (tests only:
    the interpreter is slow). Use the pure-torch sglang_oea.routing path otherwise.
    """
    if not _HAVE_TRITON:
        return False
    if interpret_mode():
        return True
    if device is not None and torch.device(device).type != "cuda":
        return False
    return torch.cuda.is_available()


__all__ = ["OEAWorkspace", "oea_route", "is_available", "interpret_mode"]
