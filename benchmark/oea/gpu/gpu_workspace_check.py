"""Check 9 of benchmark/oea/gpu/gpu_check.py: routing workspaces outlive every graph captured over them.

SGLang's adaptive speculative decoding (`--speculative-adaptive`) builds one target-verify graph
runner per candidate step count, each wider than the last (up to 8 verify tokens per request), and
only the first gets the warm-up that sized OEA's workspaces. The check drives that sequence through
one OEARuntime with the fused kernel, on GLM-5-shaped layers that every runner shares (one
TopKConfig per layer, as the model keeps them):
  1. one verify runner per draft-token count in RUNNER_DRAFTS, each captured as SGLang captures a
     bucket (two eager warm-ups, then ONE torch.cuda.CUDAGraph over every layer's `runtime.route`);
     the workspace floor is lowered (TritonRouter.MIN_WORKSPACE_ROWS) so that each wider runner
     needs a larger workspace, as a 1024-row floor does for wide runners on real buckets;
  2. an eager verify batch wider than every runner (a larger workspace again), checked against
     sglang_oea.routing.route_from_logits;
  3. the memory a released workspace would have returned to the caching allocator is taken and
     filled with junk (a freed buffer that a graph still points at would now hold junk);
  4. every runner's graph is replayed with fewer real requests than its bucket, on fresh inputs,
     and each layer's output must equal the reference; every workspace a capture used must still be
     held by the router at its captured addresses.
On the CPU (the dry run, TRITON_INTERPRET=1) the same sequence runs without a graph, with
sglang_oea.runtime.is_capturing forced on for the "captured" calls (gpu_runtime_check.GraphCapture).
"""

import zlib
from dataclasses import replace
from typing import List, Sequence, Tuple

import torch

from gpu.gpu_cases import SEED
from gpu.gpu_runtime_check import (CPU_SHAPES, GLM5, GraphCapture, Layer, Scenario, draw_inputs, forward,
                                   forward_step, make_layers, refill, verify_layer)
from sglang_oea.config import OEAConfig
from sglang_oea.runtime import OEARuntime

RUNNER_DRAFTS = (2, 3, 4, 8)  # verify tokens per request of each runner, captured in this order
K0, MIN_BATCH = 3, 2


def widen(layers: Sequence[Layer], rows: int, gen: torch.Generator, device) -> List[Layer]:
    """The same layers (their TopKConfig, so the same workspace slots) with static inputs of `rows`."""
    out = []
    for layer in layers:
        logits, ids, weights = (t.to(device) for t in draw_inputs(layer.shape, layer.host_spec, rows, gen))
        out.append(replace(layer, logits=logits, ids=ids, weights=weights))
    return out


def held_addresses(rt: OEARuntime) -> dict:
    """{id(workspace): its buffers' addresses} over every workspace the kernel router holds."""
    return {id(ws): (ws.union.data_ptr(), ws.out_ids.data_ptr(), ws.out_weights.data_ptr())
            for held in rt.routers.triton.workspaces.values() for ws in held}


def check_outputs(name: str, layers: Sequence[Layer], outputs: dict, sc: Scenario, requests: int) -> List[str]:
    errors = [verify_layer(layer, outputs.get(layer.layer_id), requests, sc)[0] for layer in layers]
    return [f"{name}: {e}" for e in errors if e is not None]


def capture_runners(rt: OEARuntime, base: Sequence[Layer], requests: int, gen, device, use_graph: bool):
    """([(drafts, layers, graph)] per runner, {id: addresses} of every workspace held right after
    some capture: any of them may be one that a captured graph points at)."""
    runners, captured = [], {}
    for drafts in RUNNER_DRAFTS:
        layers = widen(base, requests * drafts, gen, device)
        graph = GraphCapture(use_graph)
        with forward_step(rt, requests, graph=True, drafts=drafts):
            with graph.warm_up_stream():
                for _ in range(2):
                    forward(rt, layers)
            graph.capture(lambda layers=layers: forward(rt, layers))
        captured.update(held_addresses(rt))
        runners.append((drafts, layers, graph))
    return runners, captured


def scribble(device) -> List[torch.Tensor]:
    """Take whatever the caching allocator holds free, in a spread of sizes, and fill it with junk."""
    return [torch.full((n,), -7, dtype=torch.int32, device=device) for n in (1 << 8, 1 << 12, 1 << 16, 1 << 20)]


def check_growing_runners(device, use_graph: bool) -> Tuple[List[str], List[str]]:
    """Check 9. Returns (failures, report lines)."""
    from sglang_oea.routers import TritonRouter

    shape = GLM5 if use_graph else CPU_SHAPES[0]
    requests = 32 if use_graph else 4
    gen = torch.Generator().manual_seed(SEED + zlib.crc32(b"growing runners"))
    rt = OEARuntime(OEAConfig(k0=K0, min_batch=MIN_BATCH), speculative=True)
    floor, TritonRouter.MIN_WORKSPACE_ROWS = TritonRouter.MIN_WORKSPACE_ROWS, 2 * requests
    try:
        base = make_layers([shape], 1, gen, device)
        runners, captured = capture_runners(rt, base, requests, gen, device, use_graph)
        wide = 3 * requests * max(RUNNER_DRAFTS)  # rows of the eager batch: wider than every runner
        eager = widen(base, wide, gen, device)
        with forward_step(rt, wide // 4, drafts=4):
            outputs = forward(rt, eager)
        sc = Scenario("eager", "auto", K0, 0, wide // 4, (), min_batch=MIN_BATCH, drafts=4)
        failures = check_outputs("eager batch wider than every runner", eager, outputs, sc, wide // 4)
        junk = scribble(device)
        held = held_addresses(rt)
        gone = [k for k, v in captured.items() if held.get(k) != v]
        failures += [f"{len(gone)} workspace(s) held at a capture were released or moved"] * bool(gone)
        replays = []
        for drafts, layers, graph in runners:
            name = f"runner of {drafts} drafts"
            real = requests - 3
            refill(layers, gen)
            with forward_step(rt, real, drafts=drafts):
                rt.set_replay_rows(real * drafts)
                outputs = graph.replay(rt, requests, drafts)
                rt.note_replay(requests)
            sc = Scenario(name, "auto", K0, 0, requests, (real,), min_batch=MIN_BATCH, drafts=drafts)
            errors = check_outputs(name, layers, outputs, sc, real)
            failures += errors
            replays.append(f"{drafts} drafts ({requests * drafts} rows): {'ok' if not errors else 'FAIL'}")
        del junk
    finally:
        TritonRouter.MIN_WORKSPACE_ROWS = floor
    sizes = {key[0]: [ws.max_rows for ws in held] for key, held in rt.routers.triton.workspaces.items()}
    lines = [
        f"{shape.name} layers {', '.join(map(str, shape.layers))}, k0={K0}, {requests} requests a bucket, verify "
        f"runners of {', '.join(map(str, RUNNER_DRAFTS))} drafts captured in order, then an eager batch of {wide} "
        f"rows and junk in the freed memory; workspace floor {2 * requests} rows.",
        f"Workspaces per layer slot (rows): {sizes}.",
        "Replays after it all: " + "; ".join(replays) + ".",
        "",
    ]
    return failures, lines + [f"- FAIL: {f}" for f in failures]
