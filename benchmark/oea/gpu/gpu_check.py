"""One-shot GPU check of the fused OEA routing kernel (sglang_oea.kernels) and of the runtime path
around it, sized for one H200 and at most 8 minutes. Needs only torch, triton and this repository's
python/ (no SGLang).

Checks, in the order they run (correctness first; numbers kept from earlier reports):
  8. the kernel's selection scores == the torch path's, bit for bit (sigmoid: accurate expf and IEEE
     division as torch.sigmoid on CUDA; softmax: the logit), over ~1e6 values, and kernel ids ==
     torch ids on 1-ulp near-ties at the base boundary (gpu_score_bits.check_score_bits);
  1. kernel == sglang_oea.routing.route_from_logits on the device, over the sampled grid that
     test/srt/test_oea_kernel.py uses (plus large-B cases), bitwise deterministic, expert counters
     (`stats=`) and rank-check checksum (`checksum=`) as sglang_oea.reference says; a pool of
     worker processes shares the compiles (gpu_cases.py, gpu_compare.py);
  5. the real runtime path: OEARuntime + GLM-5 / Qwen3-30B-A3B shaped layers, SGLang's warm-ups,
     ONE real CUDA graph captured over every layer's `runtime.route`, replays with several real row
     counts (gate open and closed) == the reference; nothing compiled during capture; the
     self-check's wall time; and the same captured as `--cuda-graph-backend-decode breakable` does
     around graph breaks: a graph per layer in one pool, eager work between them
     (gpu_runtime_check.py);
 11. the runtime path under DP attention (2 attention-DP groups): the same layers and sequence on a
     gathered batch, captured as SGLang captures a bucket of every group, replayed with each group's
     real rows (an idle group, one group full, gate open and closed), NaN and then huge logits in
     every padded row; the real rows == the reference over them alone, bit-stable whatever the
     padding holds; eager gathered passes in SGLang's padded slots; the kernel, the torch path, a
     breakable capture and a verify graph (gpu_dp_check.py);
 10. live settings under that graph, captured once: k0 3 -> 5 -> 0 -> 3 -> top-k and the gate's
     floor and cap changed between replays (OEARuntime.request_settings), each replay == the
     reference at its pass's settings (k0 = 0 and k0 >= top-k: the router's own bits), nothing
     recaptured, compiled or launched outside the graph, the accounting by k0; and a request made
     while an earlier pass still waits on the forward stream applies from the next pass only
     (gpu_live_check.py);
  9. routing workspaces outlive the graphs captured over them: verify runners of growing width
     captured one after another (as --speculative-adaptive builds them), then a wider eager batch
     and junk in freed memory; every graph replayed afterwards == the reference
     (gpu_workspace_check.py);
  7. the counter snapshots under two overlapped steps on two streams, as SGLang's overlap
     scheduler runs them: the rank check and the metrics read a completed step, equal to a
     synchronized copy (gpu_overlap_check.py);
  2. the kernel alone under CUDA-graph replay with a persistent row count, counters and checksum
     captured (gpu_compare.py);
  3. routing time under graph replay: kernel vs reference vs plain softmax + torch.topk, registers
     and spills of the compiled kernels, outputs and workspace checked after the timing
     (gpu_timing.py); target: <= 10 us per MoE layer at B <= 256 and <= 3x plain routing, counters
     < 1 us;
  6. the runtime path's time per MoE layer under graph replay (kernel path, torch path, plain
     routing) and its eager host time per call (gpu_timing.py): the torch path's figure is what
     `--oea-kernel auto` avoids by turning OEA off when the kernel fails;
  4. MoE-layer time vs T on Qwen3-30B-A3B shapes with a Triton grouped GEMM (gpu_moe.py), its tile
     configs limited to those whose shared memory fits the device (sm_120: 101376 B per block, so
     not 16x128x128 with 3 stages in bf16), the report naming the one that ran. This is our own
     GEMM; moe_premise.py times the MoE function SGLang itself calls.

    python benchmark/oea/gpu/gpu_check.py             # GPU: report to $OUT/gpu_check.md if OUT is set,
                                                      # else benchmark/oea/results/gpu_check-<date>.md
    python benchmark/oea/gpu/gpu_check.py --out /tmp/check.md --workers 8 --budget-s 300
    python benchmark/oea/gpu/gpu_check.py --dry-run   # CPU: correctness subset, small, no graph

--budget-s (default 420) bounds the whole run: the timing checks 3, 6 and 4 shrink, or are skipped,
when it runs short, and the report says what was left out. A check that raises is reported with its
traceback and the next one still runs. The exit status is 1 on any correctness failure; the time
targets of check 3 are reported as pass/fail, not enforced.
--dry-run sets TRITON_INTERPRET=1 (Triton's CPU interpreter) and runs a subset of check 1 (half
of it with counters), checks 5, 11 and 9 on small shapes without a graph (is_capturing forced on for
the "captured" calls, as test/srt/test_graph_path.py), check 2 without a graph, check 8 on 16K values,
check 7 as the protocol alone (no streams), check 10 on small shapes without a graph and a tiny
grouped GEMM.
"""

import argparse
import datetime
import os
import platform
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Callable, List, Optional, Sequence

BENCH = Path(__file__).resolve().parents[1]  # benchmark/oea
REPO = BENCH.parents[1]
for _path in (REPO / "python", BENCH):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))  # sglang_oea from this checkout; the benchmark folders as packages
if __name__ == "__main__" and "--dry-run" in sys.argv:
    # Before triton.jit decorates any kernel: it picks the interpreter at decoration time.
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

from gpu.gpu_cases import large_cases, sampled_cases  # noqa: E402
from gpu.gpu_compare import check_correctness, check_graph_replay  # noqa: E402
from gpu.gpu_dp_check import check_dp_attention  # noqa: E402
from gpu.gpu_live_check import check_live_settings  # noqa: E402
from gpu.gpu_moe import bench_moe, check_grouped_gemm_small  # noqa: E402
from gpu.gpu_overlap_check import check_overlapped_snapshots  # noqa: E402
from gpu.gpu_runtime_check import check_runtime_path  # noqa: E402
from gpu.gpu_score_bits import check_score_bits  # noqa: E402
from gpu.gpu_timing import bench_routing, bench_runtime  # noqa: E402
from gpu.gpu_workspace_check import check_growing_runners  # noqa: E402

DEFAULT_BUDGET_S = 420.0


def _versions() -> str:
    return f"torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}"


def dry_run(workers: int = 1) -> int:
    """CPU, interpreter: a correctness subset, checks 5, 11 and 2 without a graph, a tiny grouped GEMM."""
    t0 = time.time()
    cases = [replace(c, stats=i % 2 == 0) for i, c in enumerate([c for c in sampled_cases() if c.B <= 16][::4][:12])]
    errors, secs = check_correctness(cases, "cpu", workers=workers)
    print(f"check 1 (subset of {len(cases)} cases, {sum(c.stats for c in cases)} with stats): "
          f"{len(errors)} failures, {secs:.1f} s")
    t = time.time()
    runtime_errors, lines = check_runtime_path("cpu", use_graph=False)
    print(f"check 5 (runtime path, no graph: is_capturing forced on), {time.time() - t:.1f} s:\n" + "\n".join(lines))
    t = time.time()
    dp_errors, lines = check_dp_attention("cpu", use_graph=False)
    print(f"check 11 (DP attention, gathered batch, no graph), {time.time() - t:.1f} s:\n" + "\n".join(lines))
    t = time.time()
    live_errors, lines = check_live_settings("cpu", use_graph=False)
    print(f"check 10 (live settings, no graph), {time.time() - t:.1f} s:\n" + "\n".join(lines))
    workspace_errors, lines = check_growing_runners("cpu", use_graph=False)
    print("check 9 (growing runners, no graph):\n" + "\n".join(lines))
    graph_errors, lines = check_graph_replay("cpu", use_graph=False)
    print("check 2 (no graph):\n" + "\n".join(lines))
    bits_errors, lines = check_score_bits("cpu")
    print("check 8 (small, interpreter):\n" + "\n".join(lines))
    overlap_errors, lines = check_overlapped_snapshots("cpu")
    print("check 7 (protocol only, no streams):\n" + "\n".join(lines))
    gemm_error = check_grouped_gemm_small("cpu")
    print(f"grouped GEMM (tiny, float32): {'ok' if gemm_error is None else gemm_error}")
    failures = (errors + runtime_errors + dp_errors + live_errors + workspace_errors + graph_errors + bits_errors
                + overlap_errors + ([gemm_error] if gemm_error else []))
    for f in failures:
        print("FAIL:", f)
    if failures:
        return 1
    print(f"dry run: all checks passed in {time.time() - t0:.1f} s")
    return 0


class Run:
    """The report of one GPU run and its time budget; the report is rewritten after every check, so a
    run cut short still leaves one."""

    def __init__(self, out_path: Path, budget_s: float):
        self.out_path, self.budget_s, self.t0 = out_path, budget_s, time.time()
        self.failures: List[str] = []
        self.skipped: List[str] = []
        self.report = [
            "# OEA fused kernel and runtime path: GPU check",
            "",
            f"- machine: {torch.cuda.get_device_name()}, {os.cpu_count()} CPU cores",
            f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
            f"- versions: {_versions()}",
            f"- command: `python benchmark/oea/gpu/gpu_check.py {' '.join(sys.argv[1:])}`",
            f"- time budget: {budget_s:.0f} s (the timing checks shrink or are skipped past it)",
        ]

    def left(self) -> float:
        return self.budget_s - (time.time() - self.t0)

    def deadline(self, share: float, floor: float) -> float:
        """When a timing check must stop starting new measurements: a share of what is left."""
        return time.time() + max(floor, share * self.left())

    def skip(self, what: str) -> None:
        self.skipped.append(what)
        self.report.append(f"skipped: out of time budget ({self.left():.0f} s left)")

    def add_timing(self, check: str, lines: List[str]) -> None:
        """A timing check's report lines; its '- skipped ...' line also goes to the summary."""
        self.report.extend(lines)
        self.skipped += [f"{check}: {line[2:]}" for line in lines if line.startswith("- skipped")]

    def save(self) -> None:
        try:
            self.out_path.parent.mkdir(parents=True, exist_ok=True)
            self.out_path.write_text("\n".join(self.report) + "\n")
        except OSError as e:
            print(f"could not write {self.out_path}: {e}")

    def stage(self, title: str, run: Callable[[], None], is_correctness: bool) -> None:
        self.report.extend(["", f"## {title}", ""])
        start = len(self.report) - 1
        t = time.time()
        try:
            run()
        except Exception:
            tb = traceback.format_exc()
            print(tb)
            self.report.extend(["Raised:", "", "```", tb.strip(), "```"])
            if is_correctness:
                self.failures.append(f"{title}: raised {tb.strip().splitlines()[-1]}")
        self.report.append(f"\n({time.time() - t:.0f} s)")
        print("\n".join(self.report[start:]))
        self.save()


def gpu_run(out_path: Path, workers: int, budget_s: float) -> int:
    """All checks on CUDA; 1 on any correctness failure."""
    device = "cuda"
    run = Run(out_path, budget_s)
    state = {"routing_us": None}

    def check_8():
        errors, lines = check_score_bits(device)
        run.failures.extend(errors)
        run.report.extend(lines)

    def check_1():
        cases = sampled_cases() + large_cases()
        errors, secs = check_correctness(cases, device, workers)
        run.failures.extend(errors)
        run.report.extend([
            f"{len(cases) - len(errors)}/{len(cases)} cases pass ({secs:.0f} s, {workers} worker processes; "
            "the sampled grid of test/srt/test_oea_kernel.py plus large-B cases; each run twice, bitwise).",
            "",
        ] + [f"- FAIL: {e.splitlines()[0]}" for e in errors[:20]])

    def check_5():
        errors, lines = check_runtime_path(device, use_graph=True)
        run.failures.extend(errors)
        run.report.extend(lines)

    def check_11():
        errors, lines = check_dp_attention(device, use_graph=True)
        run.failures.extend(errors)
        run.report.extend(lines)

    def check_10():
        errors, lines = check_live_settings(device, use_graph=True)
        run.failures.extend(errors)
        run.report.extend(lines)

    def check_9():
        errors, lines = check_growing_runners(device, use_graph=True)
        run.failures.extend(errors)
        run.report.extend(lines)

    def check_7():
        errors, lines = check_overlapped_snapshots(device)
        run.failures.extend(errors)
        run.report.extend(lines)

    def check_2():
        errors, lines = check_graph_replay(device, use_graph=True)
        run.failures.extend(errors)
        run.report.extend(["| config | real rows: result |", "|---|---|"] + lines + [f"- FAIL: {e}" for e in errors])

    def check_3():
        if run.left() < 45:
            return run.skip("check 3 (routing time)")
        errors, misses, lines, kernel_us = bench_routing(device, run.deadline(0.35, 30))
        run.failures.extend(errors)
        run.add_timing("check 3", lines + ["", "Targets (kernel <= 10 us at B <= 256, <= 3x plain; stats overhead "
                                           "< 1 us): " + ("all pass." if not misses else "; ".join(misses) + ".")]
                       + [f"- FAIL: {e}" for e in errors])
        state["routing_us"] = kernel_us.get((128, 8, 16))

    def check_6():
        if run.left() < 40:
            return run.skip("check 6 (runtime path time)")
        run.add_timing("check 6", bench_runtime(device, run.deadline(0.5, 25)))

    def check_4():
        if run.left() < 40:
            return run.skip("check 4 (MoE-layer time)")
        seeds = max(3, min(20, int((run.left() - 20) // 8)))
        run.report.extend(bench_moe(device, seeds, state["routing_us"])[1])

    stages = [
        ("8. Kernel scores == torch scores, bit for bit; 1-ulp near-ties", check_8, True),
        ("1. Kernel == reference (CUDA)", check_1, True),
        ("5. Runtime path under one real CUDA graph (OEARuntime, as SGLang drives it)", check_5, True),
        ("11. Runtime path under DP attention: 2 groups' gathered batch, one real CUDA graph", check_11, True),
        ("10. Live settings under one CUDA graph captured once (k0, min_batch, max_batch changed between replays)",
         check_10, True),
        ("9. Workspaces outlive the graphs of verify runners of growing width", check_9, True),
        ("7. Counter snapshots under two overlapped steps (two streams)", check_7, True),
        ("2. Kernel under CUDA-graph replay (captured at 16 rows)", check_2, True),
        ("3. Routing time under CUDA-graph replay (median us per MoE layer, k0 = 3)", check_3, False),
        ("6. Runtime path time per MoE layer (k0 = 3, all rows real)", check_6, False),
        ("4. MoE-layer time vs T (Qwen3-30B-A3B: hidden 2048, inter 768, 128 experts, top-8, B = 16)",
         check_4, False),
    ]
    for title, fn, is_correctness in stages:
        run.stage(title, fn, is_correctness)

    run.report.extend([
        "", "## Summary", "",
        f"- total {time.time() - run.t0:.0f} s (budget {budget_s:.0f} s)",
        "- correctness: " + ("all pass." if not run.failures else f"{len(run.failures)} failures."),
        "- skipped for the time budget: " + ("; ".join(run.skipped) if run.skipped else "nothing"),
    ] + [f"- FAIL: {f.splitlines()[0]}" for f in run.failures[:30]])
    run.save()
    print("\n".join(run.report))
    print(f"report written to {out_path}")
    return 1 if run.failures else 0


def default_out() -> Path:
    """$OUT/gpu_check.md when OUT is set (the device tool returns what is written there)."""
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / "gpu_check.md"
    return REPO / "benchmark/oea/results" / f"gpu_check-{datetime.date.today().isoformat()}.md"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU interpreter, small, correctness only")
    parser.add_argument("--out", type=Path, default=None, help="markdown report path (default: see above)")
    parser.add_argument("--workers", type=int, default=None, help="processes for check 1 (GPU default: <= 16)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help="seconds for the whole run; the timing checks shrink or are skipped past it")
    args = parser.parse_args(argv)
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--dry-run needs TRITON_INTERPRET=1 before triton is imported (run it as a script)")
        return dry_run(args.workers or 1)
    if not torch.cuda.is_available():
        parser.error("no CUDA device (use --dry-run on a CPU machine)")
    workers = args.workers or min(16, os.cpu_count() or 1)
    return gpu_run(args.out or default_out(), workers, args.budget_s)


if __name__ == "__main__":
    sys.exit(main())
