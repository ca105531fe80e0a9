"""OEA's own cost per decode step on the CPU, next to the MoE work it saves, for one model's shapes.

For a decode batch of B rows whose router chose T_before distinct experts per MoE layer and OEA
T_after, two micro-benchmarks on this machine (one thread, as the demo's servers run):
  overhead  OEARuntime.route with counting on (cpu_routing_cost's `oea+stats`: the OEA routing, the
            distinct-expert counting, the runtime's gates) per MoE layer, times the MoE layers.
            Not in it: the hook wrappers' own Python calls around each layer and the export of the
            counters once per decode-log interval;
  saved     SGLang's own CPU MoE layer (moe_layer_cost: moe_forward_native) at T_before minus at
            T_after distinct experts, times the MoE layers;
and their difference, net = saved - overhead: an estimate (two measurements outside the server)
of what OEA should take off a decode step, to set beside the TPOT difference the server measured.

    python benchmark/oea/cost/step_cost.py --batch 16 --t-before 63 --t-after 38.5 --k0 4
        # defaults: the demo model's shapes (128 experts, top-8, hidden 128, expert FFN 32, 4 MoE layers)

CPU timings only: on a GPU the fused kernel routes and counts (gpu/), and MoE layers are memory-bound.
"""

import argparse
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmark/oea
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)  # its folders import as packages

import torch  # noqa: E402

from cost import cpu_routing_cost, moe_layer_cost  # noqa: E402


@dataclass(frozen=True)
class Shapes:
    """The MoE shapes of one model: experts N, top-k K, hidden H, expert FFN F, MoE layers L."""

    num_experts: int = 128
    top_k: int = 8
    hidden: int = 128
    ffn: int = 32
    layers: int = 4

    @staticmethod
    def of_config(cfg: Dict) -> "Shapes":
        """From a Hugging Face config.json (Qwen3-MoE names, with the usual alternatives); every layer
        is an MoE layer but `mlp_only_layers` (decoder_sparse_step 1)."""
        experts = cfg.get("num_experts", cfg.get("num_local_experts", cfg.get("n_routed_experts")))
        layers = cfg["num_hidden_layers"] - len(cfg.get("mlp_only_layers") or [])
        return Shapes(experts, cfg["num_experts_per_tok"], cfg["hidden_size"], cfg["moe_intermediate_size"], layers)


@dataclass(frozen=True)
class StepCost:
    """One (B, k0, T_before, T_after) cell; every time in us per MoE layer, medians over repeats."""

    batch: int
    k0: int
    t_before: float
    t_after: float
    layers: int
    plain_us: float  # the router's own softmax + top-k (reference: what the baseline pays)
    oea_us: float  # OEARuntime.route with counting: what OEA adds
    moe_before_us: float  # SGLang's CPU MoE layer at T_before experts
    moe_after_us: float  # ... at T_after experts

    @property
    def overhead_ms(self) -> float:
        return self.layers * self.oea_us / 1000

    @property
    def saved_ms(self) -> float:
        return self.layers * (self.moe_before_us - self.moe_after_us) / 1000

    @property
    def net_ms(self) -> float:
        return self.saved_ms - self.overhead_ms


def feasible_t(t: float, batch: int, shapes: Shapes) -> int:
    """T rounded into what B rows of top-k can use: [K, min(N, B * K)]."""
    return int(min(max(round(t), shapes.top_k), shapes.num_experts, batch * shapes.top_k))


def routing_us(batch: int, k0: int, shapes: Shapes, repeats: int, iters: int) -> Tuple[float, float]:
    """(plain router, OEA route with counting), us per MoE layer at B rows: medians over repeats."""
    args = cpu_routing_cost.build_parser().parse_args(
        ["--num-experts", str(shapes.num_experts), "--top-k", str(shapes.top_k), "--k0", str(k0),
         "--repeats", str(repeats), "--iters", str(iters), "--warmup", str(max(1, iters // 4))])
    times = cpu_routing_cost.measure(batch, args, count_ops=False)
    return statistics.median(times["plain"]), statistics.median(times["oea+stats"])


def moe_us(batch: int, distinct: Sequence[int], shapes: Shapes, repeats: int, iters: int) -> Dict[int, float]:
    """SGLang's CPU MoE layer at B rows, per T in distinct: median us per call (in a subprocess
    under the CPU engine's environment)."""
    argv = ["--batch", str(batch), "--distinct", *map(str, distinct), "--top-k", str(shapes.top_k),
            "--num-experts", str(shapes.num_experts), "--hidden", str(shapes.hidden), "--ffn", str(shapes.ffn),
            "--repeats", str(repeats), "--iters", str(iters)]
    return {t: statistics.median(v) for t, v in moe_layer_cost.run_in_cpu_env(argv).items()}


def measure_step_costs(cells: Sequence[Tuple[int, int, float, float]], shapes: Shapes, repeats: int = 5,
                       iters: int = 100) -> List[StepCost]:
    """A StepCost per (B, k0, T_before, T_after) cell: the routing timed in this process (torch on
    one thread), the MoE layer in one subprocess per B."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        moe = {}
        for batch in sorted({c[0] for c in cells}):
            ts = sorted({feasible_t(t, batch, shapes) for b, _, before, after in cells if b == batch
                         for t in (before, after)})
            moe[batch] = moe_us(batch, ts, shapes, repeats, iters)
        out = []
        for batch, k0, before, after in cells:
            plain, oea = routing_us(batch, k0, shapes, repeats, 2 * iters)
            moe_before, moe_after = (moe[batch][feasible_t(t, batch, shapes)] for t in (before, after))
            out.append(StepCost(batch, k0, before, after, shapes.layers, plain, oea, moe_before, moe_after))
        return out
    finally:
        torch.set_num_threads(threads)


def describe(cost: StepCost) -> str:
    """Three lines on one cell: OEA's own work, the MoE work saved, and which is larger."""
    larger = ("the saved MoE work is the larger" if cost.net_ms > 0 else
              "OEA's own work is the larger: with experts this small, routing costs more than the experts it skips")
    return "\n".join([
        f"  OEA's own work (measured, micro-benchmark): {cost.layers} MoE layers x {cost.oea_us:.0f} us "
        f"(OEA routing + counting) = {cost.overhead_ms:.2f} ms per decode step "
        f"(the router's own softmax + top-k: {cost.layers} x {cost.plain_us:.0f} us)",
        f"  MoE work saved (measured, micro-benchmark of SGLang's CPU MoE layer at B={cost.batch}): "
        f"T {cost.t_before:.1f} -> {cost.t_after:.1f} experts, {cost.layers} x ({cost.moe_before_us:.0f} - "
        f"{cost.moe_after_us:.0f} us) = {cost.saved_ms:.2f} ms per decode step",
        f"  net (estimated: saved - own work) {cost.net_ms:+.2f} ms per decode step; {larger}",
    ])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--k0", type=int, default=4)
    p.add_argument("--t-before", type=float, required=True, help="distinct experts per layer, the router's own")
    p.add_argument("--t-after", type=float, required=True, help="distinct experts per layer after OEA")
    for name, default in (("num-experts", 128), ("top-k", 8), ("hidden", 128), ("ffn", 32), ("layers", 4)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iters", type=int, default=100)
    return p


def main(argv: Optional[Sequence[str]] = None) -> StepCost:
    a = build_parser().parse_args(argv)
    shapes = Shapes(a.num_experts, a.top_k, a.hidden, a.ffn, a.layers)
    cost = measure_step_costs([(a.batch, a.k0, a.t_before, a.t_after)], shapes, a.repeats, a.iters)[0]
    print(f"B={a.batch}, k0={a.k0}, {shapes}, CPU, one thread:\n{describe(cost)}", flush=True)
    return cost


if __name__ == "__main__":
    main()
