"""Check 7 of benchmark/oea/gpu/gpu_check.py: the counter snapshots under two overlapped steps.

SGLang's overlap scheduler launches decode pass N on the forward stream, then processes pass N-1's
results on the schedule stream, where `report_decode_stats` reads OEA's counters (rank-check
checksums, expert statistics). This check builds that situation with two real CUDA streams:
  1. a warm-up pass, then pass "1" over the GLM-5 and Qwen3-30B-A3B shaped layers of check 5, on
     the forward stream; a synchronized copy of the counter table is the reference for that step;
  2. pass 2 on the forward stream, with a ~50 ms device sleep between its first and second MoE
     layer (standing in for a slow attention kernel), so that pass 2 is half done on the device
     while the host goes on;
  3. at once, on the schedule stream: runtime.read_snapshot() (the protocol the server uses) must
     equal the step-1 reference exactly, checksums included, and say step 1; and, for the record,
     a plain device-to-host copy of the live table on that stream (what the server did before
     snapshots) is compared with it: it shows whether the torn read happens on this machine;
  4. after a synchronize and a third pass: the snapshot of step 2 equals a synchronized copy.
It also times one snapshot: the host time of SnapshotRing.take() (one copy and one event record).
On the CPU (dry run) it runs the same sequence with no streams and no sleep (protocol only).
"""

import time
from contextlib import nullcontext
from typing import List, Tuple

import torch

from gpu.gpu_runtime_check import CPU_SHAPES, GPU_SHAPES, forward, forward_step, make_layers, refill
from sglang_oea.config import OEAConfig
from sglang_oea.runtime import OEARuntime

SLEEP_CYCLES = 100_000_000  # ~50 ms at ~2 GHz


def run_pass(rt: OEARuntime, layers, rows: int, sleep_after_first: bool = False) -> None:
    """One decode pass over every layer, as the forward-context and routing hooks drive it."""
    with forward_step(rt, rows):
        for i, layer in enumerate(layers):
            layer.route(rt)
            if sleep_after_first and i == 0:
                torch.cuda._sleep(SLEEP_CYCLES)


def synced_table(rt: OEARuntime) -> torch.Tensor:
    if rt.counters.table.is_cuda:
        torch.cuda.synchronize()
    return rt.counters.snapshot_now().table


def check_overlapped_snapshots(device) -> Tuple[List[str], List[str]]:
    """(failures, report lines)."""
    on_cuda = torch.device(device).type == "cuda"
    shapes = GPU_SHAPES if on_cuda else CPU_SHAPES
    rows = 32 if on_cuda else 6
    gen = torch.Generator().manual_seed(7)
    layers = make_layers(shapes, rows, gen, device)
    # world_size 2 turns the checksums on (no process group is needed to take or read snapshots).
    rt = OEARuntime(OEAConfig(k0=3, min_batch=4, check_ranks=1), world_size=2)
    forward_stream = torch.cuda.Stream() if on_cuda else None
    schedule_stream = torch.cuda.Stream() if on_cuda else None
    failures, lines = [], []

    def on(stream):
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    with on(forward_stream):
        run_pass(rt, layers, rows)  # compiles, self-checks, allocates: then a clean step 1
    refill(layers, gen)
    with on(forward_stream):
        run_pass(rt, layers, rows)
    step1 = synced_table(rt)
    step1_tag = rt.routed_steps

    refill(layers, gen)
    with on(forward_stream):
        run_pass(rt, layers, rows, sleep_after_first=on_cuda)
    with on(schedule_stream):
        t = time.perf_counter()
        snapshot = rt.read_snapshot()
        read_us = (time.perf_counter() - t) * 1e6
        live = rt.counters.table[: rt.counters.layers_seen].to("cpu")  # the old way: no wait for the forward stream
    torn = not torch.equal(live, step1)
    if snapshot is None or snapshot.step != step1_tag or not torch.equal(snapshot.table, step1):
        failures.append(f"snapshot during the overlapped pass: step {None if snapshot is None else snapshot.step}, "
                        f"expected step {step1_tag} with the synchronized table of that step")
    step2 = synced_table(rt)
    refill(layers, gen)
    with on(forward_stream):
        run_pass(rt, layers, rows)
    later = rt.read_snapshot()
    if later is None or later.step != step1_tag + 1 or not torch.equal(later.table, step2):
        failures.append("snapshot after the overlapped pass does not equal the synchronized table of its step")

    take_us = time_take(rt, forward_stream)
    lines += [
        f"Layers: {', '.join(s.name for s in shapes)} ({len(layers)} MoE layers), {rows} rows, k0=3, "
        f"counters and checksums on; {'two CUDA streams, ~50 ms sleep inside the overlapped pass' if on_cuda else 'CPU, no streams'}.",
        "",
        f"- snapshot read during the overlapped pass: {'ok' if not failures else 'FAIL'} (step {step1_tag}, "
        f"{read_us:.0f} us on the host)",
        (f"- a plain copy of the live table on the schedule stream at that moment "
         f"{'differed from' if torn else 'equalled'} the synchronized step-{step1_tag} table"
         f"{' (a torn read: what the snapshots prevent)' if torn else ''}" if on_cuda else
         "- (no streams on the CPU: the next pass has already run when the host reads, so only the protocol is shown)"),
        f"- one snapshot (copy of {rt.counters.layers_seen} counter rows + event record): {take_us:.1f} us host time, median of 200",
    ] + [f"- FAIL: {f}" for f in failures]
    return failures, lines


def time_take(rt: OEARuntime, stream) -> float:
    ring = rt.device.snapshots
    samples = []
    ctx = torch.cuda.stream(stream) if stream is not None else nullcontext()
    with ctx:
        for _ in range(200):
            t = time.perf_counter()
            ring.take(rt.routed_steps)
            samples.append((time.perf_counter() - t) * 1e6)
    if stream is not None:
        torch.cuda.synchronize()
    return sorted(samples)[len(samples) // 2]

