"""Offline compiles of the two fused OEA routing kernels for Hopper and Blackwell, with no GPU.

Each compile is the binary that a launch on that GPU would build: the launches come from
`sglang_oea.kernels.oea_route.kernel_launches` (the plan `oea_route` itself runs), and each one is
turned into Triton's compile inputs by Triton's own launch-time code (the kernel's argument binder
and `JITFunction._pack_args`: signature types, constexprs including ints specialised to constants,
divisibility attributes), then compiled with `triton.compile` for `GPUTarget("cuda", arch, 32)`.
Triton assembles with the ptxas bundled in its wheel (`--gpu-name=sm_90a` / `sm_100a` / `sm_120a`);
its `-v` log, captured from that same run, gives registers per thread and spill stores/loads, and
`metadata.shared` the shared memory per block.

Targets and the per-block shared-memory limits checked (opt-in maximum per thread block; CUDA C++
Programming Guide, "Technical Specifications per Compute Capability"; the same values as
`max_shared_memory_per_block_optin` in NVIDIA CCCL's libcudacxx/include/cuda/__device/arch_traits.h:
228 KB per SM minus 1 KB reserved on 9.0 and 10.0, 100 KB minus 1 KB on 12.0):
    sm_90  (H100 / H200)            227 KB
    sm_100 (B200)                   227 KB
    sm_120 (RTX PRO 6000 Blackwell)  99 KB

Cases (`cases()`): every N x K x scoring, the same on every arch; the other settings rotate so that
each of their values appears with every (N, K) pair (hence with every N and with every K):
    N in (64, 128, 160, 256, 384, 512), K in (6, 8, 10, 16);
    scoring: softmax, or sigmoid + correction bias + grouped restriction (8 groups);
    ids int32/int64, logits bf16/fp32, weights fp32/bf16, stats off/on, 0/1 fused shared-expert
    column, checksum off/on: each is the parity of the scoring's index plus its own pattern of N's
    and K's index, so the softmax and the sigmoid case of one (N, K) pair take both values, and the
    six settings combine differently from one pair to the next. Stats are a row of an [L, 3] int64
    buffer: an odd row is only 8-byte aligned, so both specialisations of that pointer compile. The
    checksum is column 3 of a row of an [L, 4] int64 table, as in serving (8 mod 16 bytes; the
    kernel never specialises that pointer on alignment). A call with stats also passes the lost
    router mass row (columns LOST.. of a row of the serving counter table), as the runtime does.
    The row count is always a 1-element int32
    device tensor, and k0 and the gate bounds a 3-element int32 control block read on the device
    (live settings: no value of them is compiled in). Every launch compiles with the plan's options
    (libdevice without flush-to-zero).
Compiles that would build the same binary (equal `KernelLaunch.variant()` on one arch) run once.

    python benchmark/oea/gpu/compile_table.py                 # print the markdown table
    python benchmark/oea/gpu/compile_table.py --out benchmark/oea/results/compile-table-2026-11-30.md
    python benchmark/oea/gpu/compile_table.py --arch 120 --workers 2

Exit status 1 when a check fails (spills, shared memory over the limit, a ptxas warning).
test/srt/test_kernel_compile.py runs the same compiles in CI.
"""

import argparse
import concurrent.futures
import contextlib
import io
import multiprocessing
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[3]
if str(REPO / "python") not in sys.path:
    sys.path.insert(0, str(REPO / "python"))

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from sglang_oea.kernels.oea_route import KernelLaunch, OEAWorkspace, kernel_launches  # noqa: E402
from sglang_oea.counters import LOST, WIDTH  # noqa: E402

KB = 1024


@dataclass(frozen=True)
class Arch:
    capability: int
    gpus: str
    shared_limit: int  # bytes per thread block, opt-in maximum


ARCHS: Dict[int, Arch] = {
    90: Arch(90, "H100 / H200", 227 * KB),
    100: Arch(100, "B200", 227 * KB),
    120: Arch(120, "RTX PRO 6000 Blackwell", 99 * KB),
}
N_VALUES = (64, 128, 160, 256, 384, 512)
K_VALUES = (6, 8, 10, 16)
SCORINGS = ("softmax", "sigmoid")
ROWS = 4  # rows of the planned call; no shape or specialisation depends on it
GROUPS = 8


@dataclass(frozen=True)
class Case:
    """One `oea_route` call to plan (nothing is launched)."""

    n: int
    k: int
    scoring: str
    ids_int64: bool
    logits_fp32: bool
    weights_bf16: bool
    stats: bool
    extra: int  # fused shared-expert columns after the K routed ones
    stats_row: int  # which row of the [2, 3] stats buffer
    checksum: bool = False  # pass a checksum slot (column 3 of a row of an [L, 4] int64 table)

    @property
    def groups(self) -> int:
        """Groups of the sigmoid case: 8 when N % 8 == 0, else the largest divisor of N up to 8."""
        return next(g for g in range(GROUPS, 0, -1) if self.n % g == 0)

    def settings(self) -> str:
        parts = ["i64" if self.ids_int64 else "i32", "fp32" if self.logits_fp32 else "bf16",
                 "w:bf16" if self.weights_bf16 else "w:fp32"]
        parts += [f"stats[{self.stats_row}]"] * self.stats + ["+1 shared"] * self.extra + ["checksum"] * self.checksum
        return " ".join(parts)


def cases() -> List[Case]:
    """N x K x scoring; the other settings rotate (see the module docstring)."""
    out = []
    for n_i, n in enumerate(N_VALUES):
        for k_i, k in enumerate(K_VALUES):
            for s_i, scoring in enumerate(SCORINGS):
                # Each setting is the parity of the scoring's index plus its own pattern.
                ids_int64, logits_fp32, weights_bf16, stats, extra, checksum = (
                    bool((s_i + pattern) % 2)
                    for pattern in (k_i, n_i, n_i + k_i, n_i // 2 + k_i, n_i + k_i // 2, n_i // 2 + k_i // 2)
                )
                out.append(Case(n, k, scoring, ids_int64, logits_fp32, weights_bf16, stats, int(extra),
                                stats_row=(n_i + k_i) % 2, checksum=checksum))
    return out


ROTATED = ("ids_int64", "logits_fp32", "weights_bf16", "stats", "extra", "checksum")


def coverage_gaps(case_list: Sequence[Case]) -> List[str]:
    """Each rotated setting must take both values with every N and with every K."""
    gaps = []
    for name in ROTATED:
        for axis, values in (("n", N_VALUES), ("k", K_VALUES)):
            for value in values:
                seen = {getattr(c, name) for c in case_list if getattr(c, axis) == value}
                if len(seen) < 2:
                    gaps.append(f"{name} only {seen} with {axis}={value}")
    return gaps


def plan(case: Case) -> Tuple[KernelLaunch, KernelLaunch]:
    """The two launches of the routing call described by `case`, from small CPU tensors."""
    n, cols = case.n, case.k + case.extra
    ids_dtype = torch.int64 if case.ids_int64 else torch.int32
    weights_dtype = torch.bfloat16 if case.weights_bf16 else torch.float32
    logits = torch.zeros(ROWS, n, dtype=torch.float32 if case.logits_fp32 else torch.bfloat16)
    ids = torch.zeros(ROWS, cols, dtype=ids_dtype)
    weights = torch.zeros(ROWS, cols, dtype=weights_dtype)
    workspace = OEAWorkspace.allocate(n, cols, ROWS, ids_dtype, weights_dtype, device="cpu")
    sigmoid = case.scoring == "sigmoid"
    return kernel_launches(
        logits, ids, weights, control=torch.tensor([case.k // 2, 1, 0], dtype=torch.int32),
        num_valid_rows=torch.zeros(1, dtype=torch.int32),
        workspace=workspace, num_routed=case.k, scoring_func=case.scoring,
        correction_bias=torch.zeros(n) if sigmoid else None, num_groups=case.groups if sigmoid else 1,
        restrict_groups=sigmoid,
        stats=torch.zeros(2, 3, dtype=torch.int64)[case.stats_row] if case.stats else None,
        checksum=torch.zeros(2, 4, dtype=torch.int64)[case.stats_row, 3:] if case.checksum else None,
        lost=torch.zeros(2, WIDTH, dtype=torch.int64)[case.stats_row, LOST:] if case.stats else None,
    )


def jit_compile_inputs(launch: KernelLaunch, arch: int) -> Tuple[ASTSource, dict]:
    """(source, options) exactly as `JITFunction.run` builds them for this launch on `arch`."""
    backend = make_backend(GPUTarget("cuda", arch, 32))
    kernel = launch.kernel
    kwargs = {**dict(launch.args), **dict(launch.constexprs), "num_warps": launch.num_warps, **dict(launch.options)}
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, _ = binder(**kwargs)
    runtime = tuple(tuple(s) for s, p in zip(specialization, kernel.params) if not p.is_constexpr)
    assert runtime == launch.specialization(), (runtime, launch.specialization())
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, None)
    return ASTSource(kernel, signature, constexprs, attrs), options.__dict__


class _TargetOnlyDriver:
    """Stands in for Triton's active driver where there is no GPU: reports a target, runs nothing."""

    def __init__(self, arch: int):
        self.arch = arch

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.arch, 32)

    def get_current_device(self) -> str:
        return f"offline-sm_{self.arch}"  # one binder and kernel cache per arch

    def get_current_stream(self, device=None) -> int:
        return 0


def launch_path_hash(launch: KernelLaunch, arch: int) -> str:
    """Triton's cache hash of what its own launch path compiles for `launch` on `arch`:
    `JITFunction.warmup` (binds, specialises and compiles like a launch, launches nothing) with
    the driver replaced by one that only reports the target. A cross-check of jit_compile_inputs."""
    from triton.runtime.driver import driver

    previous = driver._active  # None until something asks for a (real) driver
    driver.set_active(_TargetOnlyDriver(arch))
    try:
        kwargs = {**dict(launch.args), **dict(launch.constexprs), **dict(launch.options)}
        return launch.kernel.warmup(**kwargs, num_warps=launch.num_warps, grid=launch.grid).hash
    finally:
        driver._active = previous


PTXAS_TARGET = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
PTXAS_REGS = re.compile(r"Used (\d+) registers")


@dataclass(frozen=True)
class Compiled:
    kernel: str
    ptxas_target: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    shared: int
    num_warps: int
    hash: str  # Triton's cache key of the compile: equal hashes, equal inputs, equal binary
    seconds: float  # wall
    cpu_seconds: float  # this process and its ptxas child: less sensitive to a busy machine
    warnings: Tuple[str, ...]


def compile_launch(launch: KernelLaunch, arch: int) -> Compiled:
    """Compile one launch for `arch`; resource usage from the ptxas -v log of that compile."""
    src, options = jit_compile_inputs(launch, arch)
    log = io.StringIO()
    start, cpu_start = time.perf_counter(), os.times()
    # Triton runs ptxas -v and prints its log when asked; always_compile: a cache hit has no log.
    with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = True
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    seconds, cpu_end = time.perf_counter() - start, os.times()
    cpu_seconds = sum(cpu_end[i] - cpu_start[i] for i in range(4))  # user, system, children's user, system
    text = log.getvalue()
    target, frame, regs = PTXAS_TARGET.search(text), PTXAS_FRAME.search(text), PTXAS_REGS.search(text)
    assert target and frame and regs, f"no ptxas -v report in:\n{text}"
    return Compiled(
        kernel=target.group(1), ptxas_target=target.group(2), registers=int(regs.group(1)),
        spill_stores=int(frame.group(2)), spill_loads=int(frame.group(3)), stack=int(frame.group(1)),
        shared=compiled.metadata.shared, num_warps=compiled.metadata.num_warps, hash=compiled.hash, seconds=seconds,
        cpu_seconds=cpu_seconds,
        warnings=tuple(line.strip() for line in text.splitlines() if "warning" in line.lower()),
    )


@dataclass(frozen=True)
class Row:
    arch: int
    case: Case
    result: Compiled


def _compile_job(job: Tuple[int, Case, int]) -> Compiled:
    arch, case, index = job
    return compile_launch(plan(case)[index], arch)


def compile_all(archs: Iterable[int] = tuple(ARCHS), case_list: Optional[Sequence[Case]] = None,
                workers: int = 2) -> List[Row]:
    """Both kernels of every case on every arch; one compile per distinct binary.

    Workers are spawned processes (a fresh Triton in each); they inherit os.environ, so set
    TRITON_CACHE_DIR before calling to keep the compiles out of the user's cache."""
    case_list = cases() if case_list is None else case_list
    jobs: Dict[tuple, Tuple[int, Case, int]] = {}
    slots = []
    for arch in archs:
        for case in case_list:
            for index, launch in enumerate(plan(case)):
                key = (arch, launch.variant())
                jobs.setdefault(key, (arch, case, index))
                slots.append((arch, case, key))
    keys = list(jobs)
    if workers <= 1:
        results = [_compile_job(jobs[k]) for k in keys]
    else:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            results = list(pool.map(_compile_job, [jobs[k] for k in keys]))
    by_key = dict(zip(keys, results))
    return [Row(arch, case, by_key[key]) for arch, case, key in slots]


def problems(rows: Sequence[Row]) -> List[str]:
    """What fails the checks: spills, stack, shared memory over the limit, ptxas warnings, target."""
    out = []
    for row in rows:
        r, limit = row.result, ARCHS[row.arch].shared_limit
        where = f"{r.kernel} sm_{row.arch} N={row.case.n} K={row.case.k} {row.case.scoring} {row.case.settings()}"
        if r.spill_stores or r.spill_loads:
            out.append(f"{where}: spills {r.spill_stores} B stored, {r.spill_loads} B loaded")
        if r.shared > limit:
            out.append(f"{where}: shared {r.shared} B > {limit} B")
        if r.ptxas_target != f"sm_{row.arch}a":
            out.append(f"{where}: ptxas compiled for {r.ptxas_target}")
        out += [f"{where}: ptxas: {w}" for w in r.warnings]
    return out


def summary(rows: Sequence[Row]) -> List[dict]:
    """Per kernel and arch: compiles, max registers, max shared, total spill bytes."""
    groups: Dict[Tuple[str, int], List[Compiled]] = {}
    for row in rows:
        groups.setdefault((row.result.kernel, row.arch), []).append(row.result)
    return [
        dict(kernel=kernel, arch=arch, cases=len(rs), max_registers=max(r.registers for r in rs),
             max_shared=max(r.shared for r in rs), limit=ARCHS[arch].shared_limit,
             spills=sum(r.spill_stores + r.spill_loads for r in rs), max_stack=max(r.stack for r in rs))
        for (kernel, arch), rs in sorted(groups.items())
    ]


def summary_markdown(rows: Sequence[Row]) -> str:
    lines = ["| kernel | arch | cases | max registers / thread | max shared (B) | limit per block | spill bytes |",
             "|---|---|---|---|---|---|---|"]
    for s in sorted(summary(rows), key=lambda s: (_launch_position(s["kernel"]), s["arch"])):
        lines.append(f"| `{s['kernel']}` | sm_{s['arch']} | {s['cases']} | {s['max_registers']} | "
                     f"{s['max_shared']} | {s['limit'] // KB} KB | {s['spills']} |")
    return "\n".join(lines)


def _launch_position(kernel: str) -> int:
    launch_order = ("_oea_union_kernel", "_oea_route_kernel")
    return launch_order.index(kernel) if kernel in launch_order else len(launch_order)


def table_markdown(rows: Sequence[Row]) -> str:
    """One line per kernel x N x K x scoring: registers per arch side by side, shared bytes (one
    value when every arch agrees, else one per arch), total spill bytes over the archs."""
    archs = sorted({row.arch for row in rows})
    cells: Dict[tuple, Dict[int, Compiled]] = {}
    for row in rows:
        cells.setdefault((row.result.kernel, row.case), {})[row.arch] = row.result
    head = ["kernel", "N", "K", "scoring", "settings", "warps"]
    head += [f"sm_{a} regs" for a in archs] + ["shared B", "spill B"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = {c: i for i, c in enumerate(cases())}
    keyed = sorted(cells.items(), key=lambda kv: (_launch_position(kv[0][0]), kv[0][0], order.get(kv[0][1], 0)))
    for (kernel, case), per_arch in keyed:
        shared = {per_arch[a].shared for a in archs}
        cols = [f"`{kernel.strip('_')}`", str(case.n), str(case.k), case.scoring, case.settings(),
                "/".join(sorted({str(r.num_warps) for r in per_arch.values()}))]
        cols += [str(per_arch[a].registers) for a in archs]
        cols.append(str(shared.pop()) if len(shared) == 1 else " / ".join(str(per_arch[a].shared) for a in archs))
        cols.append(str(sum(r.spill_stores + r.spill_loads for r in per_arch.values())))
        lines.append("| " + " | ".join(cols) + " |")
    return "\n".join(lines)


def report(rows: Sequence[Row], archs: Sequence[int], wall: float, workers: int, load: float) -> str:
    """The markdown file: setup, summary line, summary table, per-case table."""
    from triton.backends.nvidia.compiler import get_ptxas

    distinct = {id(row.result): row.result for row in rows}.values()
    seconds: Dict[str, List[float]] = {}
    for r in distinct:
        seconds.setdefault(r.kernel, []).append(r.cpu_seconds)
    bad, s = problems(rows), summary(rows)
    kernels = sorted(seconds, key=_launch_position)
    timing = ", ".join(f"`{k}` {sum(seconds[k]) / len(seconds[k]):.2f} s" for k in kernels)
    tools = "; ".join(f"sm_{a} ({ARCHS[a].gpus}): `{Path(get_ptxas(a).path).name}` {get_ptxas(a).version}, "
                      f"`--gpu-name=sm_{a}a`, limit {ARCHS[a].shared_limit // KB} KB" for a in archs)
    return "\n\n".join([
        "# OEA kernels: offline compile table",
        f"Triton {triton.__version__} (its bundled ptxas), torch {torch.__version__}, no GPU. {tools}. "
        "Shared-memory limit: opt-in maximum per thread block (CUDA C++ Programming Guide, technical "
        "specifications per compute capability).",
        f"{len(rows)} kernel compiles, {len(distinct)} distinct binaries, {wall:.0f} s with {workers} worker "
        f"process(es) on {os.cpu_count()} CPU(s) (1-minute load average {load:.1f} before the start); "
        f"mean CPU time per compile (Triton and its ptxas): {timing}.",
        f"**Summary:** max registers/thread {max(x['max_registers'] for x in s)}, max shared "
        f"{max(x['max_shared'] for x in s)} B per block, spill bytes {sum(x['spills'] for x in s)}, "
        f"stack bytes {max(x['max_stack'] for x in s)}; checks: "
        + ("all passed." if not bad else f"{len(bad)} failed."),
        summary_markdown(rows),
        "Per case. Settings: ids, logits and weights dtypes; `stats[r]`: the call passes row r of an "
        "[L, 3] stats buffer and the lost-router-mass row of the serving counter table; `+1 shared`: one "
        "fused shared-expert column; `checksum`: a rank-check checksum slot (column 3 of an [L, 4] table). "
        "Sigmoid cases use a "
        f"correction bias and grouped restriction ({GROUPS} groups).",
        table_markdown(rows),
        "Regenerate (no GPU needed): `python benchmark/oea/gpu/compile_table.py --out <file>`.",
    ]) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, action="append", choices=sorted(ARCHS), help="default: all")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, help="also write the markdown here")
    args = parser.parse_args(argv)
    archs = args.arch or sorted(ARCHS)
    with tempfile.TemporaryDirectory(prefix="oea-triton-cache-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        load, start = os.getloadavg()[0], time.perf_counter()
        rows = compile_all(archs, workers=args.workers)
        wall = time.perf_counter() - start
    text = report(rows, archs, wall, args.workers, load)
    print(text)
    bad = problems(rows)
    for line in bad:
        print("FAIL", line, file=sys.stderr)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
