"""What OEA's CPU routing path costs per MoE layer, next to plain routing, on this machine.

The CPU path is the one `sglang_oea.cpu_serve` runs: `OEARuntime.route`, the pure-torch
`route_from_logits` plus the distinct-expert counting (on a GPU the fused kernel does this work;
`gpu_check.py` times that). Per batch size it times, interleaved in each repeat:
  - plain: softmax + torch.topk, what the router itself does;
  - oea: OEARuntime.route with counting off (--oea-disable-stats);
  - oea+stats: OEARuntime.route with counting on (the default);
  - oea+stats+check: as oea+stats, plus the per-layer checksum of --oea-check-ranks (as on a rank
    of a TP=2 server; the comparison itself, once every N steps, is timed by rank_check_cost.py);
  - route_from_logits: sglang_oea.routing.route_from_logits alone (no runtime around it).
It prints the median over repeats with the min-max, the ratio to plain, and the torch ops that one
oea call dispatches (`torch_ops`: the rule of test/srt/test_lean_routing.py).

    python benchmark/oea/cost/cpu_routing_cost.py                      # B = 1 4 16 64 256, N=128, K=8, k0=4
    python benchmark/oea/cost/cpu_routing_cost.py --threads 2 --batch-sizes 4 256 --num-experts 256

CPU timings only: they say nothing about a GPU.
"""

import argparse
import statistics
import sys
import time
import types
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[3]
if str(REPO / "python") not in sys.path:
    sys.path.insert(0, str(REPO / "python"))

import torch  # noqa: E402

from sglang_oea.routing import RouterSpec, route_from_logits, softmax_rows  # noqa: E402

VARIANTS = ("plain", "oea", "oea+stats", "oea+stats+check", "route_from_logits")


def topk_config(top_k: int) -> types.SimpleNamespace:
    """The attributes of SGLang's TopKConfig that OEARuntime reads: a softmax router (Qwen3-MoE)."""
    return types.SimpleNamespace(
        top_k=top_k, num_shared_topk_slots=0, allow_routed_experts_capture=True, scoring_func="softmax",
        correction_bias=None, num_expert_group=None, topk_group=None, use_grouped_topk=False,
        custom_routing_function=None,
    )


def per_call_us(fn: Callable[[], object], iters: int) -> float:
    """Mean wall time of fn() in microseconds over iters calls."""
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def torch_ops(fn: Callable[[], object]) -> List[str]:
    """The aten ops one fn() call dispatches from Python: torch.profiler events without a parent
    event (an op's own sub-ops are not counted). Counted on a second call, after one that builds
    any cached tables."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]


def callables(batch: int, num_experts: int, top_k: int, k0: int, seed: int) -> Dict[str, Callable[[], object]]:
    """One routing call per variant on the same [batch, num_experts] bf16 logits."""
    # Imported here, so that torch_ops is usable without the runtime.
    from sglang_oea.config import OEAConfig
    from sglang_oea.runtime import OEARuntime

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, num_experts, generator=gen).to(torch.bfloat16)
    weights, ids = torch.topk(softmax_rows(logits.float()), top_k, sorted=False)
    ids, cfg = ids.int(), topk_config(top_k)
    fns = {
        "plain": lambda: torch.topk(softmax_rows(logits.float()), top_k, sorted=False),
        "route_from_logits": lambda: route_from_logits(logits, ids, weights, RouterSpec("softmax"), k0, batch),
    }
    for name, stats, check in (("oea", False, 0), ("oea+stats", True, 0), ("oea+stats+check", True, 1)):
        rt = OEARuntime(OEAConfig(k0=k0, min_batch=1, stats=stats, check_ranks=check), world_size=2)
        rt.begin_step(decode=True, num_rows=batch)
        fns[name] = lambda rt=rt: rt.route(ids, weights, cfg, logits, 0)
        if fns[name]() is None:  # route() returns None when it leaves the router's choice alone
            raise RuntimeError(f"OEA did not route at B={batch}: the timing would measure a no-op")
    return fns


def measure(batch: int, args, count_ops: bool = True) -> Dict[str, List[float]]:
    """Per variant, one per-call time (us) per repeat; the variants alternate within a repeat.
    Under "ops" (with count_ops): the number of torch ops of one oea call, in a one-element list."""
    fns = callables(batch, args.num_experts, args.top_k, args.k0, args.seed)
    for fn in fns.values():
        per_call_us(fn, args.warmup)
    times: Dict[str, List[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name in VARIANTS:
            times[name].append(per_call_us(fns[name], args.iters))
    if count_ops:
        times["ops"] = [len(torch_ops(fns["oea"]))]
    return times


def spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def report(rows: Dict[int, Dict[str, List[float]]], args) -> str:
    """Markdown table: per batch size, each variant's median us (min-max), the torch ops of one
    oea call, and each variant's median / plain's."""
    compared = VARIANTS[1:]
    lines = [
        f"CPU routing cost per MoE layer, N={args.num_experts}, top-{args.top_k}, k0={args.k0}, "
        f"{args.threads} thread(s), {args.repeats} repeats of {args.iters} calls: median us (min-max)",
        "",
        "| B | " + " | ".join(VARIANTS) + " | oea torch ops | " + " | ".join(f"{n} / plain" for n in compared) + " |",
        "|---|" + "---|" * (2 * len(VARIANTS)),
    ]
    for batch, times in rows.items():
        plain = statistics.median(times["plain"])
        ratios = [statistics.median(times[name]) / plain for name in compared]
        cells = [spread(times[name]) for name in VARIANTS] + [str(times["ops"][0])] + [f"{r:.1f}x" for r in ratios]
        lines.append(f"| {batch} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    p.add_argument("--num-experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--k0", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (cpu_serve's default on 2 cores: 1)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iters", type=int, default=300, help="calls per timing")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: Optional[Sequence[str]] = None) -> str:
    args = build_parser().parse_args(argv)
    if not 1 <= args.k0 < args.top_k <= args.num_experts:
        raise SystemExit(f"need 1 <= --k0 < --top-k <= --num-experts, got {args.k0}, {args.top_k}, {args.num_experts}")
    torch.set_num_threads(args.threads)
    table = report({batch: measure(batch, args) for batch in args.batch_sizes}, args)
    print(table, flush=True)
    return table


if __name__ == "__main__":
    main()
