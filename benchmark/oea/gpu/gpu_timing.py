"""CUDA-graph timing and checks 3 and 6 of benchmark/oea/gpu/gpu_check.py. CUDA only.

Check 3: routing time per MoE layer under CUDA-graph replay (fused kernel vs the pure-torch
reference vs plain softmax + torch.topk), the registers and spills of the compiled kernels, and
after the timing the last replay's outputs against the reference and a clean workspace.
Check 6: the runtime path (gpu_runtime_check.py's layers): per model and batch size, one layer's
`runtime.route` as captured (the whole call, glue included) under graph replay, kernel path vs torch
path (OEAConfig(kernel="torch")), next to plain routing (what the router itself does: softmax, or
sigmoid + bias + grouped top-k, then torch.topk); and the eager host time per `runtime.route` call
on the kernel path.
"""

import time
import traceback
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from gpu.gpu_cases import SEED, Case, case_control, kernels, router_inputs, run_kernel
from gpu.gpu_compare import compare, new_stats
from gpu.gpu_runtime_check import GPU_SHAPES, Layer, forward_step, make_layers, plain_routing, regs_spills
from sglang_oea.config import OEAConfig
from sglang_oea.routing import RouterSpec, route_from_logits
from sglang_oea.runtime import OEARuntime


def graph_time_us(fn: Callable[[], object], inner: int = 20, replays: int = 100) -> Tuple[float, float, float, str]:
    """(median, p20, p80) microseconds per fn() call under CUDA-graph replay, and the mode.

    fn is captured `inner` times in one graph (amortising the graph launch); each replay is timed
    with CUDA events. Falls back to eager timing when fn cannot be captured.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    mode = "graph"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
        run = graph.replay
    except Exception as e:  # report it, time eagerly
        print(f"  capture failed ({type(e).__name__}: {e}); timing eagerly")
        torch.cuda.synchronize()
        mode = "eager"

        def run():
            for _ in range(inner):
                fn()

    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(replays):
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0 / inner)
    q = torch.tensor(samples).quantile(torch.tensor([0.5, 0.2, 0.8])).tolist()
    return q[0], q[1], q[2], mode


def kernel_resources(case: Case, logits, ids, w, spec: RouterSpec, num_valid, workspace, control,
                     stats=None) -> List[str]:
    """Launch the two kernels of one call (union, route) through the plan `oea_route` runs, and
    return 'regs/spills' of each compiled kernel, read after the launch."""
    launches = kernels().kernel_launches(
        logits, ids, w, control=control, num_valid_rows=num_valid, workspace=workspace,
        scoring_func=spec.scoring_func, correction_bias=spec.correction_bias, num_groups=spec.num_groups,
        restrict_groups=spec.restrict_groups, stats=stats,
    )
    compiled = [launch.run() for launch in launches]
    torch.cuda.synchronize()
    return [regs_spills(c) for c in compiled]


def workspace_dirt(ws) -> Optional[str]:
    """None when U, R and the ticket counter are all zero (the kernel cleans up after itself)."""
    dirty = {name: int(getattr(ws, name).count_nonzero()) for name in ("union", "routed", "counter")}
    return None if not any(dirty.values()) else f"workspace not left clean: nonzero entries {dirty}"


def bench_routing(
    device: str,
    deadline: float,
    shapes: Sequence[Tuple[int, int]] = ((128, 8), (256, 8)),
    batch_sizes: Sequence[int] = (1, 4, 16, 64, 256, 1024),
) -> Tuple[List[str], List[str], List[str], Dict[Tuple[int, int, int], float]]:
    """Check 3: routing time per MoE layer. Returns (correctness failures, target misses, report
    lines, kernel us by (N, K, B)). "stats overhead us" = median of the kernel with stats= minus
    the kernel without. After the timing, the last replay's outputs are checked against the
    reference and the workspace must be clean. Shapes not started by `deadline` are skipped."""
    oea = kernels()
    lines = [
        "| N/K | B | plain softmax+topk us | reference us | fused kernel us (p20-p80) | kernel/plain | target "
        "| stats overhead us | target < 1 us | regs/spills union, route (with stats: union, route) | after |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    failures, misses, kernel_us, skipped = [], [], {}, []
    for N, K in shapes:
        for B in batch_sizes:
            if time.time() > deadline:
                skipped.append(f"{N}/{K} B={B}")
                continue
            case = Case(B=B, N=N, K=K, k0=3, ties="bf16")
            logits, ids, w, spec = router_inputs(case, torch.Generator().manual_seed(B + N), device)
            num_valid = torch.full((1,), B, dtype=torch.int32, device=device)
            control = case_control(case, device)  # the settings on the device, as the runtime's graphs read them
            ws = oea.OEAWorkspace.allocate(N, K, B, ids.dtype, w.dtype, device)
            _, stats_row = new_stats(device)
            resources = kernel_resources(case, logits, ids, w, spec, num_valid, ws, control)
            resources += kernel_resources(case, logits, ids, w, spec, num_valid, ws, control, stats_row)
            kernel = graph_time_us(lambda: run_kernel(case, logits, ids, w, spec, num_valid=num_valid, workspace=ws,
                                                      control=control))
            counted = graph_time_us(lambda: run_kernel(case, logits, ids, w, spec, num_valid=num_valid, workspace=ws,
                                                       stats=stats_row, control=control))
            # The last replay left its outputs in the workspace: check them, and the clean-up.
            err = compare(case, ws.out_ids[:B], ws.out_weights[:B], logits, ids, w, spec, nv=B) or workspace_dirt(ws)
            if err:
                failures.append(f"check 3 after timing, N={N} K={K} B={B}: {err}")
            ref = graph_time_us(lambda: route_from_logits(logits, ids, w, spec, case.k0, num_valid))
            plain = graph_time_us(lambda: torch.topk(torch.softmax(logits.float(), dim=-1), K, dim=-1))
            kernel_us[(N, K, B)] = kernel[0]
            ratio = kernel[0] / plain[0]
            ok = ratio <= 3.0 and (B > 256 or kernel[0] <= 10.0)
            if not ok:
                misses.append(f"routing N={N} K={K} B={B}: kernel {kernel[0]:.1f} us, {ratio:.2f}x plain")
            overhead = counted[0] - kernel[0]
            stats_ok = overhead < 1.0
            if not stats_ok:
                misses.append(f"stats N={N} K={K} B={B}: +{overhead:.2f} us per layer")
            lines.append(
                f"| {N}/{K} | {B} | {plain[0]:.1f} | {ref[0]:.1f}{' (eager)' if ref[3] == 'eager' else ''} | "
                f"{kernel[0]:.1f} ({kernel[1]:.1f}-{kernel[2]:.1f}){' (eager)' if kernel[3] == 'eager' else ''} | "
                f"{ratio:.2f}x | {'pass' if ok else 'FAIL'} | {overhead:+.2f} (with stats {counted[0]:.1f}) | "
                f"{'pass' if stats_ok else 'FAIL'} | {resources[0]}, {resources[1]} ({resources[2]}, {resources[3]}) | "
                f"{'ok' if err is None else 'FAIL'} |"
            )
            print("  " + lines[-1])
    lines += ["", "regs/spills: registers per thread and spilled registers of the compiled kernel (Triton's "
              "CompiledKernel after its launch); after: the last replay's output == reference and U, R, counter "
              "all zero."]
    if skipped:
        lines.append(f"- skipped (time budget): {', '.join(skipped)}")
    return failures, misses, lines, kernel_us


# ------------------------------------------------------------------------------------------------
# Check 6: the runtime path (gpu_runtime_check.py's layers), timed
# ------------------------------------------------------------------------------------------------


def captured_route_us(rt: OEARuntime, layer: Layer, rows: int):
    """graph_time_us of one layer's `runtime.route` in a bucket's capture step, all rows real."""
    with forward_step(rt, rows, graph=True):
        if layer.route(rt) is None:  # outside capture: device state, self-check, workspace
            raise RuntimeError(f"runtime.route left layer {layer.layer_id} alone at {rows} rows")
        rt.set_replay_rows(rows)
        return graph_time_us(lambda: layer.route(rt))


def eager_host_us(rt: OEARuntime, layer: Layer, rows: int, calls: int = 200) -> float:
    """Host microseconds per eager `runtime.route` call (no sync between calls)."""
    with forward_step(rt, rows):
        layer.route(rt)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            layer.route(rt)
        host = (time.perf_counter() - start) / calls * 1e6
        torch.cuda.synchronize()
    return host


def bench_runtime(device, deadline: float, batch_sizes: Sequence[int] = (4, 16, 64, 256)) -> List[str]:
    """Check 6. Report lines; batch sizes not started by `deadline` are skipped (and listed)."""
    runtimes = {kind: OEARuntime(OEAConfig(k0=3, min_batch=4, kernel=kind)) for kind in ("auto", "torch")}
    # As on a rank of a TP=2 server with --oea-check-ranks: the per-layer id checksum is captured too.
    runtimes["checked"] = OEARuntime(OEAConfig(k0=3, min_batch=4, check_ranks=1), world_size=2)
    gen = torch.Generator().manual_seed(SEED + 6)
    lines = [
        "| model | B | plain routing us | torch path us | kernel path us (p20-p80) | kernel/plain | kernel/torch "
        "| kernel path eager host us per call | kernel path + rank checksum us |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    skipped, keep = [], []
    for shape in GPU_SHAPES:
        for rows in batch_sizes:
            if time.time() > deadline:
                skipped.append(f"{shape.name} B={rows}")
                continue
            layer = make_layers((replace(shape, layers=shape.layers[:1]),), rows, gen, device)[0]
            keep.append(layer)  # runtime layers are keyed by id(config): keep every config alive
            try:
                kernel = captured_route_us(runtimes["auto"], layer, rows)
                torch_path = captured_route_us(runtimes["torch"], layer, rows)
                plain = graph_time_us(lambda: plain_routing(layer.logits, shape, layer.spec.correction_bias))
                host = eager_host_us(runtimes["auto"], layer, rows)
                checked = captured_route_us(runtimes["checked"], layer, rows)
            except Exception as e:
                print(traceback.format_exc())
                lines.append(f"| {shape.name} | {rows} | raised {type(e).__name__}: "
                             f"{(str(e).strip().splitlines() or [''])[0][:200]} | | | | | | |")
                continue
            timed = (("kernel", kernel), ("torch", torch_path), ("plain", plain), ("checked", checked))
            eager = [name for name, t in timed if t[3] != "graph"]
            lines.append(
                f"| {shape.name} | {rows} | {plain[0]:.1f} | {torch_path[0]:.1f} | {kernel[0]:.1f} "
                f"({kernel[1]:.1f}-{kernel[2]:.1f}) | {kernel[0] / plain[0]:.2f}x | {kernel[0] / torch_path[0]:.2f}x "
                f"| {host:.1f}" + (f" (timed eagerly, capture failed: {', '.join(eager)})" if eager else "")
                + f" | {checked[0]:.1f} |"
            )
            print("  " + lines[-1])
    routers = {kind: rt.routers.status() for kind, rt in runtimes.items()}
    lines += ["", f"Per MoE layer, median of CUDA-graph replays of 20 captured calls; routers used: {routers}. "
              "Plain routing: the router's own scores and torch.topk (grouped for GLM-5)."]
    if skipped:
        lines.append(f"- skipped (time budget): {', '.join(skipped)}")
    return lines
