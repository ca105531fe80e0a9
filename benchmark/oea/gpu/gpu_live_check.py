"""Check 10 of benchmark/oea/gpu/gpu_check.py: live settings under one real CUDA graph.

As a server whose OEA settings change through POST /set_internal_state (OEARuntime.request_settings):
  1. per scenario (the fused kernel; the torch path), an OEARuntime(OEAConfig(k0=3, min_batch,
     max_batch)) over check 5's GLM-5 and Qwen3-30B-A3B shaped layers, and ONE CUDA graph captured
     at the bucket after SGLang's two warm-ups (gpu_runtime_check.py's sequence);
  2. replays between which the settings change: k0 3 -> 5 -> 0 -> 3 -> top-k, the floor raised and
     the cap lowered inside the startup envelope, then k0 back into range. Each replay's ids == the
     reference routing at the settings of its pass (ids exactly, weights to tolerance); k0 = 0,
     k0 >= the layer's top-k and a closed batch gate give the router's own bits. Nothing is
     recaptured, nothing compiled, no kernel launched outside the graph (on the CPU, where a replay
     re-runs the captured calls: no variant that the warm-ups did not launch), the accounting
     attributes each replay to the k0 it ran with (applied_by_k0 / skipped_by_k0), and so do the
     lost-router-mass columns of the device counters (each open replay's units, from a brute-force
     computation on its output, in the column of its own k0, nothing anywhere else);
  3. the overlap order: on a forward stream held up by a ~50 ms device sleep, pass N is replayed and
     its outputs copied (enqueued, not yet run), then the host requests new settings, and pass N+1
     begins (its control-block write enqueued on the forward stream) and is replayed. Pass N must
     route with the old settings and pass N+1 with the new, though the host asked for them before
     pass N ran on the device.
On the CPU (the dry run, TRITON_INTERPRET=1) the same sequence runs on small shapes without a graph
(sglang_oea.runtime.is_capturing forced on, as test/srt/test_live_routing.py), and step 3 in order,
without streams.
"""

import traceback
import zlib
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import List, Optional, Sequence, Tuple

import torch

from gpu.gpu_cases import SEED, kernels
from gpu.gpu_compare import brute_force_lost_units
from gpu.gpu_runtime_check import (CPU_SHAPES, GPU_SHAPES, CompileWatch, GraphCapture, LaunchRecorder, Layer,
                                   Scenario, forward, forward_step, make_layers, refill, verify_layer)
from sglang_oea.config import LiveSettings, OEAConfig
from sglang_oea.counters import LOST
from sglang_oea.runtime import OEARuntime

SLEEP_CYCLES = 100_000_000  # ~50 ms at ~2 GHz
# (settings requested before the replay or None, real rows), for a bucket of 64 (GPU) or 12 (CPU).
GPU_STEPS = [(None, 40), (LiveSettings(5, 4, 48), 40), (LiveSettings(0, 4, 48), 40), (LiveSettings(3, 4, 48), 23),
             (LiveSettings(8, 4, 48), 23), (LiveSettings(3, 16, 48), 12), (None, 23), (LiveSettings(4, 4, 32), 40),
             (None, 32)]
CPU_STEPS = [(None, 9), (LiveSettings(5, 2, 10), 9), (LiveSettings(0, 2, 10), 9), (LiveSettings(3, 2, 10), 7),
             (LiveSettings(8, 2, 10), 7), (LiveSettings(3, 8, 10), 7), (None, 9), (LiveSettings(2, 2, 6), 9),
             (None, 6)]


def expected_reason(live: LiveSettings, rows: int, top_k: int) -> Optional[str]:
    """The accounting's verdict on a replay of `rows` requests (None: applied)."""
    if live.k0 == 0:
        return "oea_off"
    if rows < live.min_batch:
        return "below_min_batch"
    if live.max_batch and rows > live.max_batch:
        return "above_max_batch"
    return "k0_covers_top_k" if live.k0 >= top_k else None


def verify_pass(layers: Sequence[Layer], outputs, rows: int, live: LiveSettings, sc: Scenario) -> List[str]:
    """Each layer's output against the reference at the pass's settings (gpu_runtime_check.verify_layer);
    a k0 outside [1, the layer's top-k) is checked as a closed gate: the router's own bits."""
    errors = []
    for layer in layers:
        at = replace(sc, k0=live.k0, min_batch=live.min_batch, max_batch=live.max_batch)
        if not 1 <= live.k0 < layer.shape.top_k:
            at = replace(at, min_batch=rows + 1)  # k0 off or a no-op: the gate is closed
        err, _ = verify_layer(layer, outputs.get(layer.layer_id), rows, at)
        errors += [f"{live}: {err}"] * (err is not None)
    return errors


def copied(outputs):
    """The replay's outputs copied (on the current stream), before the next replay overwrites them."""
    return {key: None if out is None else (out[0].clone(), out[1].clone()) for key, out in outputs.items()}


def replay_pass(rt: OEARuntime, graph: GraphCapture, rows: int, bucket: int, sync: bool = True):
    """One decode pass served by the graph: begin_step (applies requested settings), the real rows,
    the replay, note_replay, end_step. sync=False: no synchronize (the overlap step)."""
    with forward_step(rt, rows):
        rt.set_replay_rows(rows)
        if graph.use_graph and not sync:
            graph.graph.replay()
            outputs = graph.outputs
        else:
            outputs = graph.replay(rt, bucket)
        rt.note_replay(bucket)
    return copied(outputs)


def check_overlap(rt: OEARuntime, graph: GraphCapture, layers, sc: Scenario, rows: int,
                  new: LiveSettings) -> Tuple[List[str], str, Tuple[LiveSettings, LiveSettings]]:
    """Step 3: (failures, what was seen, (pass N's settings, pass N+1's))."""
    old = rt.settings
    stream = torch.cuda.Stream() if graph.use_graph else None
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
            torch.cuda._sleep(SLEEP_CYCLES)
        before = replay_pass(rt, graph, rows, sc.bucket, sync=False)
        rt.request_settings(new)
        after = replay_pass(rt, graph, rows, sc.bucket, sync=False)
        host_ahead = stream is not None and not stream.query()
    if stream is not None:
        stream.synchronize()
    failures = verify_pass(layers, before, rows, old, sc) + verify_pass(layers, after, rows, new, sc)
    seen = (f"pass N k0={old.k0}, pass N+1 k0={new.k0}: {'ok' if not failures else 'FAIL'}"
            + (f" (host ahead of the device: {host_ahead})" if stream is not None else " (in order, no streams)"))
    return failures, seen, (old, new)


@contextmanager
def counted_launches():
    """[one entry per KernelLaunch.run()] while inside (kernel launches outside a graph)."""
    module, runs = kernels(), []
    original = module.KernelLaunch.run
    module.KernelLaunch.run = lambda launch: runs.append(launch) or original(launch)
    try:
        yield runs
    finally:
        module.KernelLaunch.run = original


def capture_once(rt: OEARuntime, graph: GraphCapture, layers, bucket: int, recorder: LaunchRecorder) -> None:
    """SGLang's capture of one bucket: a capture-mode pass, two eager warm-ups, one captured forward."""
    with forward_step(rt, bucket, graph=True):
        with graph.warm_up_stream():
            for _ in range(2):
                forward(rt, layers)
        recorder.capturing = True
        graph.capture(lambda: forward(rt, layers))


def add_lost_wanted(want: dict, layers: Sequence[Layer], outputs, rows: int, k0: int) -> None:
    """want[(layer id, k0)] += (lost router mass units, rows) of one open replay, by brute force."""
    for layer in layers:
        ids, weights = outputs[layer.layer_id]
        k, n = layer.shape.top_k, layer.shape.experts
        got = brute_force_lost_units(layer.ids[:rows, :k].cpu(), layer.weights[:rows, :k].cpu(), ids[:rows, :k].cpu(),
                                     weights[:rows, :k].cpu(), n, rows)
        want[(layer.layer_id, k0)] = tuple(a + b for a, b in zip(want.get((layer.layer_id, k0), (0, 0)), got))


def lost_errors(rt: OEARuntime, start: torch.Tensor, want: dict) -> List[str]:
    """The lost columns added since `start` against `want` (one unit per row of float32 rounding)."""
    added = rt.counters.table[:, LOST:].cpu() - start
    errors = []
    for (layer, k0), (units, rows) in sorted(want.items()):
        if abs(int(added[layer, k0]) - units) > rows:
            errors.append(f"lost router mass of layer {layer} at k0={k0}: {int(added[layer, k0])}, expected {units}")
        added[layer, k0] = 0
    if added.any():
        errors.append(f"lost router mass outside the replays' (layer, k0) columns: {added.nonzero().tolist()}")
    return errors


def replay_steps(rt: OEARuntime, graph: GraphCapture, layers, sc: Scenario, steps, top_k: int, gen):
    """Step 2: (failures, report cells, Counter of the expected (k0, skip reason) per replay)."""
    failures, cells, want, want_lost = [], [], Counter(), {}
    start = rt.counters.table[:, LOST:].to("cpu", copy=True)
    for new, rows in steps:
        refill(layers, gen)
        if new is not None:
            rt.request_settings(new)
        live = rt.pending or rt.settings
        outputs = replay_pass(rt, graph, rows, sc.bucket)
        errors = verify_pass(layers, outputs, rows, live, sc)
        failures += [f"{sc.name}: {e}" for e in errors]
        reason = expected_reason(live, rows, top_k)
        want[(live.k0, reason)] += 1
        if reason is None:
            add_lost_wanted(want_lost, layers, outputs, rows, live.k0)
        cells.append(f"k0={live.k0} {live.min_batch}..{live.max_batch} {rows}:{'ok' if not errors else 'FAIL'}")
    failures += [f"{sc.name}: {e}" for e in lost_errors(rt, start, want_lost)]
    return failures, cells, want


def run_scenario(sc: Scenario, shapes, steps, device, use_graph: bool, watch: CompileWatch) -> Tuple[List[str], str]:
    """One scenario: (failures, its report row)."""
    gen = torch.Generator().manual_seed(SEED + zlib.crc32(sc.name.encode()))
    layers = make_layers(shapes, sc.bucket, gen, device)
    rt = OEARuntime(OEAConfig(k0=sc.k0, min_batch=sc.min_batch, max_batch=sc.max_batch, kernel=sc.kernel))
    graph, top_k, rows = GraphCapture(use_graph), max(s.top_k for s in shapes), steps[-1][1]
    with LaunchRecorder() as recorder:
        capture_once(rt, graph, layers, sc.bucket, recorder)
        mark = watch.mark()
        with counted_launches() as runs:
            failures, cells, want = replay_steps(rt, graph, layers, sc, steps, top_k, gen)
            errors, overlap, passes = check_overlap(rt, graph, layers, sc, rows,
                                                    LiveSettings(5, sc.min_batch, sc.max_batch))
        compiles, growth = watch.since(mark)
    failures += [f"{sc.name}: overlap: {e}" for e in errors]
    want.update((live.k0, expected_reason(live, rows, top_k)) for live in passes)
    fresh = recorder.launched[True] - recorder.launched[False]
    outside = len(runs) if use_graph else 0  # on the CPU a "replay" re-runs the captured calls
    if compiles or growth or fresh or outside:
        failures.append(f"{sc.name}: after capture: {compiles} compiles, cache growth {growth}, {len(fresh)} "
                        f"variants unseen by the warm-ups, {outside} launches outside the graph")
    counted = Counter({(k0, None): n for (_, k0), n in rt.applied_by_k0.items()})
    counted.update({(k0, reason): n for (_, k0, reason), n in rt.skipped_by_k0.items()})
    if counted != want:
        failures.append(f"{sc.name}: steps by (k0, skip reason) {dict(counted)}, expected {dict(want)}")
    row = (f"| {sc.name} | {'; '.join(cells)} | {overlap} | {'ok' if counted == want else 'FAIL'} | "
           f"{'-' if compiles is None else compiles} / {len(fresh)} / {outside} |")
    return failures, row


def check_live_settings(device, use_graph: bool) -> Tuple[List[str], List[str]]:
    """Check 10 (use_graph=False: the CPU stand-in). Returns (failures, report lines)."""
    shapes = GPU_SHAPES if use_graph else tuple(replace(s, layers=s.layers[:1]) for s in CPU_SHAPES)
    steps = GPU_STEPS if use_graph else CPU_STEPS
    bucket, startup = (64, dict(min_batch=4, max_batch=48)) if use_graph else (12, dict(min_batch=2, max_batch=10))
    scenarios = [Scenario(f"{kind}, startup k0=3 gate {startup['min_batch']}..{startup['max_batch']}", kind, 3,
                          bucket=bucket, rows=(), **startup) for kind in ("auto", "torch")]
    failures, lines = [], [
        f"One graph per scenario, captured once at bucket {bucket}; layers: "
        + ", ".join(f"{s.name} top-{s.top_k} ({len(s.layers)})" for s in shapes) + ".",
        "", "| scenario | replays (settings, rows: result) | overlap order | accounting by k0 "
        "| after capture: compiles / new variants / launches outside the graph |", "|---|---|---|---|---|",
    ]
    with CompileWatch() as watch:
        for sc in scenarios:
            try:
                errors, row = run_scenario(sc, shapes, steps, device, use_graph, watch)
            except Exception as e:
                print(traceback.format_exc())
                errors, row = [f"{sc.name}: raised {type(e).__name__}: {e}"], f"| {sc.name} | raised | | | |"
            failures += errors
            lines.append(row)
    return failures, lines + [f"- FAIL: {f}" for f in failures]
