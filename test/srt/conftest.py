"""Test setup: the package from python/, this folder's helpers, and SGLang on the CPU engine.

The CPU engine and the stand-in sgl_kernel must be in place before anything imports sglang.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [HERE, os.path.join(ROOT, "python")]

from sglang_oea.cpu.serve import STUB_DIR, cpu_environment  # noqa: E402

os.environ.update(cpu_environment())
if STUB_DIR not in sys.path:
    sys.path.insert(0, STUB_DIR)
sys.path.insert(0, os.path.join(ROOT, "benchmark", "oea"))  # its folders as packages: from serving import ab_serving
