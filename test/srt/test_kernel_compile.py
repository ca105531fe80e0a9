"""Both fused OEA kernels compile offline, with no GPU, for sm_90, sm_100 and sm_120: no spills,
shared memory within each target's per-block limit.

The compiles, the cases and the checks live in benchmark/oea/gpu/compile_table.py (which also writes
the register / shared-memory table for the docs). Each compile is the binary a launch would build: the
launches come from `kernel_launches` (the plan `oea_route` runs), Triton's own launch-time binder and
`_pack_args` turn them into the compile inputs, and `triton.compile` targets
GPUTarget("cuda", arch, 32) with the ptxas bundled in the Triton wheel (sm_90a, sm_100a, sm_120a).
Spill stores/loads and registers come from that ptxas run's -v log; shared memory from the compiled
metadata, checked against 227 KB (sm_90, sm_100) and 99 KB (sm_120) per block. For one case per arch
the test also compiles through Triton's launch path itself (`JITFunction.warmup` with a driver
stand-in that only reports the target) and checks that Triton's cache hash is the offline one.

Coverage design. The full product of every setting (N x K x scoring x ids x logits x weights x
stats x shared-expert column x checksum x 3 archs = 18432 compiles at ~0.3-1.3 s CPU each) does not
fit the CI budget of ~4 minutes on 2 cores. So:
  - the full N x K x scoring product is compiled for every arch: N in (64, 128, 160, 256, 384, 512),
    K in (6, 8, 10, 16), softmax and sigmoid + correction bias + grouped restriction (8 groups);
  - ids int32/int64, logits bf16/fp32, weights fp32/bf16, stats off/on, 0/1 fused shared-expert
    columns and the rank-check checksum off/on rotate: each takes both values within every (N, K)
    pair (the softmax and the sigmoid case of a pair differ in all of them), so every value meets
    every N and every K on every arch (test_rotation_covers_every_value checks this);
  - the row count is always a 1-element int32 tensor, and k0 and the gate bounds a 3-element int32
    control block read on the device (the kernels' only variant, whatever the settings).
That is 48 cases x 2 kernels x 3 archs = 288 compiles: about 2-2.5 minutes on an idle 2-core
machine with a process pool of 2.
Triton's cache is a fresh temporary directory, so every compile is real.
"""

import importlib
import os
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="offline kernel compiles need triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 replaces the kernels by interpreted functions: nothing to compile",
                allow_module_level=True)

BENCH = Path(__file__).resolve().parents[2] / "benchmark" / "oea"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))  # its folders import as packages
# Imported by module name (not from a file spec): the spawned compile workers import it the same way.
compile_table = importlib.import_module("gpu.compile_table")


def test_rotation_covers_every_value():
    cases = compile_table.cases()
    grid = {(c.n, c.k, c.scoring) for c in cases}
    assert len(cases) == len(grid) == len(compile_table.N_VALUES) * len(compile_table.K_VALUES) * 2
    assert compile_table.coverage_gaps(cases) == []
    # Stricter than needed: both values of every rotated setting within each (N, K) pair.
    for n in compile_table.N_VALUES:
        for k in compile_table.K_VALUES:
            pair = [c for c in cases if (c.n, c.k) == (n, k)]
            for name in compile_table.ROTATED:
                assert {getattr(c, name) for c in pair} in ({False, True}, {0, 1}), (n, k, name)


def test_offline_compiles(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    start = time.perf_counter()
    rows = compile_table.compile_all(workers=2)
    wall = time.perf_counter() - start
    cases = compile_table.cases()
    assert len(rows) == 2 * len(cases) * len(compile_table.ARCHS)
    for arch in compile_table.ARCHS:
        for kernel in ("_oea_union_kernel", "_oea_route_kernel"):
            got = {(r.case.n, r.case.k, r.case.scoring) for r in rows if r.arch == arch and r.result.kernel == kernel}
            assert len(got) == len(cases), (arch, kernel)
    print(f"\n{len(rows)} compiles in {wall:.0f} s\n" + compile_table.summary_markdown(rows))
    assert compile_table.problems(rows) == []

    # Triton's own launch path (JITFunction.warmup, no GPU) builds the same binaries: one case per
    # arch with every optional input (sigmoid, bias, groups, stats, a shared-expert column, checksum).
    full = [c for c in cases if c.scoring == "sigmoid" and c.stats and c.extra and c.checksum]
    assert len(full) >= len(compile_table.ARCHS)
    for arch, case in zip(compile_table.ARCHS, full):
        offline = {r.result.kernel: r.result.hash for r in rows if r.arch == arch and r.case == case}
        for launch in compile_table.plan(case):
            assert compile_table.launch_path_hash(launch, arch) == offline[launch.kernel.fn.__name__], (arch, case)
