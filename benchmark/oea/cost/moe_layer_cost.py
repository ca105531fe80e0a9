"""What one MoE layer of SGLang's CPU path costs at B rows with T distinct experts, on this machine.

The CPU server runs `sglang.srt.layers.moe.fused_moe_native.moe_forward_native`: one gate_up
projection, activation and down projection per expert that received rows, so its cost grows with
T, the distinct experts of the batch. This times that very function on random weights of the given
shapes, with top-k ids that use exactly T distinct experts (each row k of them, spread evenly), for
each T asked; the difference between two T is the MoE work OEA saves or adds per layer.

    python benchmark/oea/cost/moe_layer_cost.py --batch 16 --distinct 64 38 8     # the demo model's shapes
    python benchmark/oea/cost/moe_layer_cost.py --batch 16 --distinct 64 38 --json

It imports SGLang, so it runs under the CPU engine's environment (sglang_oea.cpu_serve's stand-in
sgl_kernel): `run_in_cpu_env` starts it that way from another process. CPU timings only.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def spread_ids(batch: int, top_k: int, num_experts: int, distinct: int, seed: int = 0):
    """[batch, top_k] int32 ids using exactly `distinct` experts: row r takes pool[(r*k + j) % T],
    j < k, of a random pool of T experts. Needs top_k <= distinct <= min(num_experts, batch * top_k)."""
    import torch

    assert top_k <= distinct <= min(num_experts, batch * top_k), f"{batch=} {top_k=} {num_experts=} {distinct=}"
    pool = torch.randperm(num_experts, generator=torch.Generator().manual_seed(seed))[:distinct]
    slots = torch.arange(batch * top_k).view(batch, top_k) % distinct  # [B, K], distinct within a row
    return pool[slots].to(torch.int32)


def time_moe_layer(batch: int, top_k: int, num_experts: int, hidden: int, ffn: int, distinct: Sequence[int],
                   repeats: int, iters: int, dtype: str = "bfloat16") -> Dict[int, List[float]]:
    """Per T in `distinct`: one time per repeat (us per moe_forward_native call, mean of iters calls),
    the T interleaved within each repeat. Weights w13 [E, 2*ffn, hidden], w2 [E, hidden, ffn]."""
    import torch
    from sglang.srt.layers.moe.fused_moe_native import moe_forward_native
    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    layer = argparse.Namespace(num_experts=num_experts,
                               w13_weight=(torch.randn(num_experts, 2 * ffn, hidden, generator=gen) * 0.05).to(dt),
                               w2_weight=(torch.randn(num_experts, hidden, ffn, generator=gen) * 0.05).to(dt))
    x = torch.randn(batch, hidden, generator=gen).to(dt)  # [B, H]
    weights = torch.full((batch, top_k), 1.0 / top_k)  # [B, K] float32
    config = MoeRunnerConfig(activation="silu")
    calls = {t: (lambda ids=spread_ids(batch, top_k, num_experts, t): moe_forward_native(layer, x, (weights, ids, None),
                                                                                          config)) for t in distinct}
    for fn in calls.values():
        for _ in range(max(1, iters // 4)):
            fn()
    times: Dict[int, List[float]] = {t: [] for t in distinct}
    for _ in range(repeats):
        for t, fn in calls.items():
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            times[t].append((time.perf_counter() - start) / iters * 1e6)
    return times


def run_in_cpu_env(args: Sequence[str], timeout_s: float = 600.0) -> Dict[int, List[float]]:
    """This script with --json in a fresh process under the CPU engine's environment (the stand-in
    sgl_kernel first on PYTHONPATH); its {T: [us per repeat]}. RuntimeError with its output on failure."""
    from sglang_oea.cpu.serve import cpu_environment

    env = cpu_environment()
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], os.path.join(REPO, "python")])
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *args, "--json"], capture_output=True,
                          text=True, env=env, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"moe_layer_cost.py failed (exit code {proc.returncode}):\n{proc.stderr[-2000:]}")
    return {int(t): v for t, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16, help="rows B (decode: the requests of the batch)")
    p.add_argument("--distinct", type=int, nargs="+", default=[64, 38, 8], help="distinct experts T to time")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--num-experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=128, help="hidden size (the demo model: 128)")
    p.add_argument("--ffn", type=int, default=32, help="expert FFN size, moe_intermediate_size (the demo model: 32)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (the demo's servers: 1)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--json", action="store_true", help="print {T: [us per repeat]} as one JSON line")
    return p


def main(argv: Optional[Sequence[str]] = None) -> Dict[int, List[float]]:
    args = build_parser().parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    times = time_moe_layer(args.batch, args.top_k, args.num_experts, args.hidden, args.ffn, args.distinct,
                           args.repeats, args.iters, args.dtype)
    if args.json:
        print(json.dumps(times))
        return times
    print(f"SGLang CPU MoE layer (moe_forward_native), B={args.batch}, top-{args.top_k} of {args.num_experts}, "
          f"hidden {args.hidden}, expert FFN {args.ffn}, {args.dtype}, {args.threads} thread(s): median us (min-max)")
    for t, values in times.items():
        print(f"  T={t:4d}: {statistics.median(values):8.1f} ({min(values):.1f}-{max(values):.1f})"
              f"  {statistics.median(values) / t:6.1f} us per expert")
    return times


if __name__ == "__main__":
    main()
