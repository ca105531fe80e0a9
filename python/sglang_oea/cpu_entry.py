"""Entry point `oea_cpu_harness` (group `sglang.srt.plugins`): the CPU harness, only where it is wanted.

SGLang's plugin loader loads and calls every entry point of the group in every server process,
GPU servers included, unless SGLANG_PLUGINS names the ones to load. So this module decides from
the standard library alone whether this process runs on the CPU stand-in `sgl_kernel`
(sglang_oea/cpu/stub, put first on PYTHONPATH by cpu_serve), and imports the harness
(sglang_oea.cpu.harness) only then: a GPU server loads the OEA plugin and nothing of sglang_oea.cpu.
"""

import importlib.util
import os

STUB_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu", "stub")


def stub_active() -> bool:
    """True when `import sgl_kernel` would load the CPU stand-in (found, not imported)."""
    spec = importlib.util.find_spec("sgl_kernel")
    origin = getattr(spec, "origin", None) or ""
    return os.path.abspath(origin).startswith(STUB_DIR + os.sep)


def register() -> None:
    """Called by sglang.srt.plugins.load_plugins() in every SGLang process: installs the harness's
    hooks where the stand-in is active, and does nothing (importing nothing) elsewhere."""
    if stub_active():
        from sglang_oea.cpu import harness

        harness.install_hooks()
