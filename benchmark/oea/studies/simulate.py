"""Offline simulator for Opportunistic Expert Activation (arXiv 2511.02237): no server, no GPU.

For an MoE layer with N routed experts and top-k routing it measures, per decode batch of B tokens:
  - T, the number of distinct experts activated in the batch, for the vanilla router and for OEA
    at each k0 (Monte-Carlo), against the closed forms for uniform routing
        E[T_vanilla] = N (1 - (1 - k/N)^B)        E[T_oea] = N (1 - (1 - k0/N)^B)
    (T_oea counts the experts that receive weight: the union of the rows' top-k0 bases.
    T_loaded also counts the zero-weight fill slots the SGLang runners need, max(T_oea, k));
  - fidelity: per token, the share of its original router mass (weights over its original top-k,
    normalised to sum 1) that lies in its final OEA set, and the overlap |final ∩ top-k| / k.

Routing distributions: "uniform" (i.i.d. normal logits), "zipf" (i.i.d. normal logits plus the
log-popularity of a Zipf(s) expert popularity, a fresh random expert order per batch), and router
logits dumped from a server (--dump-dir, files rank{R}_step{S}_layer{L}.pt written by the
--oea-dump-router-logits flag). OEA itself comes from sglang_oea.reference / sglang_oea.routing.

    python benchmark/oea/studies/simulate.py --out-dir /tmp/oea-sim
    python benchmark/oea/studies/simulate.py --config 128/8 --k0 3 4 --batch-sizes 1 16 256 --dist zipf
    python benchmark/oea/studies/simulate.py --dump-dir /tmp/dumps --k0 3 4 5 --out-dir /tmp/oea-sim-dump
    python benchmark/oea/studies/simulate.py --suggest 256/8 --k0 3 4 5 6 7 --min-saving 0.05
"""

import argparse
import glob
import math
import os
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
try:
    import sglang_oea  # noqa: F401  (importable already? else use this checkout)
except ImportError:
    sys.path.insert(0, os.path.join(_REPO, "python"))

from sglang_oea.reference import distinct_experts, opportunistic_slots  # noqa: E402
from sglang_oea.routing import RouterSpec, mask_foreign_groups, score_experts  # noqa: E402


# ----------------------------------------------------------------------------------------------
# Closed forms (uniform routing: each token's top-k is a uniformly random k-subset of N)
# ----------------------------------------------------------------------------------------------


def expected_active_experts(num_experts: int, per_token: int, batch_size: int) -> float:
    """E[T] = N (1 - (1 - m/N)^B): distinct experts hit by B tokens choosing m experts each."""
    return num_experts * (1.0 - (1.0 - per_token / num_experts) ** batch_size)


def expected_t_vanilla(num_experts: int, k: int, batch_size: int) -> float:
    """Closed-form E[T] of the vanilla top-k router under uniform routing: N(1-(1-k/N)^B)."""
    return expected_active_experts(num_experts, k, batch_size)


def expected_t_oea(num_experts: int, k0: int, batch_size: int) -> float:
    """Closed-form E[T] under OEA with base size k0 (uniform routing): N(1-(1-k0/N)^B).

    OEA never adds an expert outside the union of the rows' top-k0, and each row's top-k0 is a
    uniform k0-subset, so T_oea is the union of B uniform k0-subsets.
    """
    return expected_active_experts(num_experts, min(k0, num_experts), batch_size)


def expected_saving(num_experts: int, k: int, k0: int, batch_size: int) -> float:
    """1 - E[T_oea] / E[T_vanilla] from the closed forms (uniform routing)."""
    return 1.0 - expected_t_oea(num_experts, min(k0, k), batch_size) / expected_t_vanilla(num_experts, k, batch_size)


def suggest_max_batch(num_experts: int, k: int, k0: int, min_saving: float = 0.05,
                      max_batch_size: int = 1 << 20) -> Optional[int]:
    """Largest power-of-two B whose expected T saving (closed forms, uniform routing) is >= min_saving.

    Use the result as `--oea-max-batch`: above it OEA is expected to save less than min_saving of
    the activated experts, so the routing change is not worth its accuracy cost. Returns None when
    even B=1 saves less than min_saving (for instance k0 >= k); never 0, which the server reads as
    "no cap". Capped at max_batch_size.
    """
    best = None
    b = 1
    while b <= max_batch_size:
        if expected_saving(num_experts, k, k0, b) >= min_saving:
            best = b
        b *= 2
    return best


# ----------------------------------------------------------------------------------------------
# Routing: the model's router (vanilla) and OEA on top of it
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    name: str
    num_experts: int
    top_k: int
    scoring_func: str = "softmax"


PRESETS: Dict[str, ModelConfig] = {
    "qwen3-30b": ModelConfig("qwen3-30b", 128, 8, "softmax"),
    "glm-5": ModelConfig("glm-5", 256, 8, "sigmoid"),
}


@dataclass(frozen=True)
class Router:
    """How a layer routes: OEA's RouterSpec plus what the vanilla router needs (k, group count)."""

    spec: RouterSpec
    top_k: int
    topk_group: int = 1

    @staticmethod
    def make(scoring_func: str, top_k: int, correction_bias: Optional[torch.Tensor] = None,
             num_expert_group: int = 1, topk_group: int = 1) -> "Router":
        groups = max(int(num_expert_group or 1), 1)
        sel_groups = max(int(topk_group or groups), 1)
        spec = RouterSpec(scoring_func=scoring_func, correction_bias=correction_bias,
                          num_groups=groups, restrict_groups=sel_groups < groups)
        return Router(spec=spec, top_k=top_k, topk_group=sel_groups)


def vanilla_topk(selection: torch.Tensor, router: Router) -> torch.Tensor:
    """The router's own top-k ids [B, k] from selection scores [B, N].

    Grouped routing keeps the topk_group best groups first: group score = sum of the group's two
    best selection scores when the router has a correction bias (DeepSeek-V3 style), else the
    group's best score.
    """
    if router.spec.restrict_groups:
        rows, n = selection.shape
        g = router.spec.num_groups
        grouped = selection.view(rows, g, n // g)
        if router.spec.correction_bias is not None:
            group_score = grouped.topk(min(2, n // g), dim=-1).values.sum(-1)
        else:
            group_score = grouped.max(dim=-1).values
        keep = group_score.topk(router.topk_group, dim=-1).indices
        allowed = torch.zeros(rows, g, dtype=torch.bool).scatter(1, keep, True)
        selection = selection.masked_fill(~allowed.repeat_interleave(n // g, dim=1), float("-inf"))
    return selection.topk(router.top_k, dim=-1).indices


@dataclass
class StepStats:
    """Per-batch measurements; fidelity values are means over the batch's tokens."""

    t_vanilla: float
    t_oea: Dict[int, float]
    t_loaded: Dict[int, float]
    mass_kept: Dict[int, float]
    overlap: Dict[int, float]


def evaluate_batch(router_logits: torch.Tensor, router: Router, k0s: Sequence[int]) -> StepStats:
    """Vanilla and OEA routing of one batch of router logits [B, N]."""
    n = router_logits.shape[1]
    k = router.top_k
    selection, weight = score_experts(router_logits, router.spec)
    topk_ids = vanilla_topk(selection, router)
    orig_w = weight.gather(1, topk_ids)
    orig_w = orig_w / orig_w.sum(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    if router.spec.restrict_groups:
        selection = mask_foreign_groups(selection, topk_ids, router.spec.num_groups)
    stats = StepStats(float(distinct_experts(topk_ids, n)), {}, {}, {}, {})
    for k0 in k0s:
        ids, active = opportunistic_slots(selection, topk_ids, k0)
        final = torch.zeros(ids.shape[0], n, dtype=torch.bool).scatter(1, ids, active)  # [B, N]
        in_final = final.gather(1, topk_ids)  # [B, k]
        stats.t_oea[k0] = float(final.any(dim=0).sum())
        stats.t_loaded[k0] = float(distinct_experts(ids, n))
        stats.mass_kept[k0] = float((orig_w * in_final).sum(dim=1).mean())
        stats.overlap[k0] = float(in_final.float().sum(dim=1).mean() / k)
    return stats


def sample_logits(dist: str, batch_size: int, num_experts: int, gen: torch.Generator,
                  zipf_s: float = 1.0) -> torch.Tensor:
    """[B, N] synthetic router logits: i.i.d. N(0,1), plus Zipf log-popularity for "zipf"."""
    logits = torch.randn(batch_size, num_experts, generator=gen)
    if dist == "uniform":
        return logits
    if dist == "zipf":
        ranks = torch.randperm(num_experts, generator=gen).float() + 1.0
        return logits - zipf_s * torch.log(ranks)[None, :]
    raise ValueError(f"unknown distribution {dist!r}")


# ----------------------------------------------------------------------------------------------
# Aggregation
# ----------------------------------------------------------------------------------------------


@dataclass
class Point:
    """Mean over batches (trials or dumped steps) at one batch size."""

    source: str  # e.g. "qwen3-30b / uniform" or "dump"
    num_experts: int
    top_k: int
    batch_size: int
    batches: int
    t_vanilla: float
    t_oea: Dict[int, float]
    t_loaded: Dict[int, float]
    mass_kept: Dict[int, float]
    overlap: Dict[int, float]


def aggregate(source: str, n: int, k: int, b: int, steps: List[StepStats]) -> Point:
    def mean(xs: Iterable[float]) -> float:
        xs = list(xs)
        return sum(xs) / len(xs)

    k0s = list(steps[0].t_oea)
    return Point(
        source, n, k, b, len(steps), mean(s.t_vanilla for s in steps),
        {k0: mean(s.t_oea[k0] for s in steps) for k0 in k0s},
        {k0: mean(s.t_loaded[k0] for s in steps) for k0 in k0s},
        {k0: mean(s.mass_kept[k0] for s in steps) for k0 in k0s},
        {k0: mean(s.overlap[k0] for s in steps) for k0 in k0s},
    )


def simulate(config: ModelConfig, dist: str, k0s: Sequence[int], batch_sizes: Sequence[int],
             trials: int = 4, min_rows: int = 256, seed: int = 0, zipf_s: float = 1.0) -> List[Point]:
    """Monte-Carlo over synthetic logits: max(trials, ceil(min_rows / B)) batches per batch size."""
    gen = torch.Generator().manual_seed(seed)
    router = Router.make(config.scoring_func, config.top_k)
    points = []
    for b in batch_sizes:
        n_batches = max(trials, math.ceil(min_rows / b))
        steps = [evaluate_batch(sample_logits(dist, b, config.num_experts, gen, zipf_s), router, k0s)
                 for _ in range(n_batches)]
        points.append(aggregate(f"{config.name} / {dist}", config.num_experts, config.top_k, b, steps))
    return points


_DUMP_NAME = re.compile(r"rank(\d+)_step(\d+)_layer(\d+)\.pt$")


def load_dumps(dump_dir: str, rank: Optional[int] = None) -> List[Tuple[int, int, dict]]:
    """[(step, layer, record)] of one TP rank (the lowest found unless given), sorted."""
    found = []
    for path in glob.glob(os.path.join(dump_dir, "rank*_step*_layer*.pt")):
        m = _DUMP_NAME.search(os.path.basename(path))
        if m:
            found.append((int(m.group(1)), int(m.group(2)), int(m.group(3)), path))
    if not found:
        raise FileNotFoundError(f"no rank*_step*_layer*.pt files in {dump_dir}")
    ranks = sorted({r for r, *_ in found})
    use = ranks[0] if rank is None else rank
    if use not in ranks:
        raise ValueError(f"rank {use} not in the dump (ranks: {ranks})")
    out = []
    for r, step, layer, path in sorted(found):
        if r == use:
            out.append((step, layer, torch.load(path, map_location="cpu", weights_only=True)))
    return out


def simulate_dumps(dump_dir: str, k0s: Sequence[int], rank: Optional[int] = None,
                   layers: Optional[Sequence[int]] = None) -> List[Point]:
    """Vanilla vs OEA on dumped router logits, grouped by the dumped batch size."""
    by_batch: Dict[Tuple[int, int, int], List[StepStats]] = defaultdict(list)
    for _step, layer, rec in load_dumps(dump_dir, rank):
        if layers is not None and layer not in layers:
            continue
        logits = rec["router_logits"].float()
        b = int(rec.get("batch_size", logits.shape[0]))
        logits = logits[:b]
        n, k = logits.shape[1], int(rec["top_k"])
        router = Router.make(rec.get("scoring_func", "softmax"), k, rec.get("correction_bias"),
                             rec.get("num_expert_group") or 1, rec.get("topk_group") or 1)
        by_batch[(n, k, b)].append(evaluate_batch(logits, router, k0s))
    return [aggregate("dump", n, k, b, steps) for (n, k, b), steps in sorted(by_batch.items())]


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def markdown_report(points: Sequence[Point], k0s: Sequence[int]) -> str:
    """Per source: a T table (Monte-Carlo vs closed form) and a fidelity table."""
    out = []
    sources = list(dict.fromkeys(p.source for p in points))
    for src in sources:
        pts = [p for p in points if p.source == src]
        n, k = pts[0].num_experts, pts[0].top_k
        ks = [k0 for k0 in k0s if k0 in pts[0].t_oea]
        out += [f"## {src} (N={n}, k={k})", ""]
        out.append("Active experts T per step: Monte-Carlo mean [closed form, uniform routing]; "
                   "saving = 1 - T_oea / T_vanilla (Monte-Carlo).")
        out.append("")
        hdr = ["B", "batches", "T vanilla"] + [f"T k0={k0} (saving)" for k0 in ks]
        out += ["| " + " | ".join(hdr) + " |", "|" + "|".join(["---"] * len(hdr)) + "|"]
        for p in pts:
            row = [str(p.batch_size), str(p.batches),
                   f"{p.t_vanilla:.1f} [{expected_t_vanilla(n, k, p.batch_size):.1f}]"]
            for k0 in ks:
                saving = 1.0 - p.t_oea[k0] / p.t_vanilla
                row.append(f"{p.t_oea[k0]:.1f} [{expected_t_oea(n, k0, p.batch_size):.1f}] ({saving:.0%})")
            out.append("| " + " | ".join(row) + " |")
        out += ["", "Fidelity: original router mass kept / overlap with the original top-k "
                    "(means over tokens); T_loaded adds the zero-weight fill experts.", ""]
        hdr = ["B"] + [f"k0={k0} mass / overlap / T_loaded" for k0 in ks]
        out += ["| " + " | ".join(hdr) + " |", "|" + "|".join(["---"] * len(hdr)) + "|"]
        for p in pts:
            row = [str(p.batch_size)] + [
                f"{p.mass_kept[k0]:.3f} / {p.overlap[k0]:.3f} / {p.t_loaded[k0]:.1f}" for k0 in ks]
            out.append("| " + " | ".join(row) + " |")
        out.append("")
    return "\n".join(out)


def suggestion_table(configs: Sequence[ModelConfig], k0s: Sequence[int], min_saving: float) -> str:
    hdr = ["model (N/k)"] + [f"k0={k0}" for k0 in k0s]
    out = [f"Suggested --oea-max-batch (largest power-of-two B with expected T saving >= "
           f"{min_saving:.0%} under uniform routing; '-' = none):", "",
           "| " + " | ".join(hdr) + " |", "|" + "|".join(["---"] * len(hdr)) + "|"]
    for c in configs:
        cells = [f"{c.name} ({c.num_experts}/{c.top_k})"]
        for k0 in k0s:
            s = suggest_max_batch(c.num_experts, c.top_k, k0, min_saving)
            cells.append("-" if s is None else str(s))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def plot(points: Sequence[Point], k0s: Sequence[int], path: str) -> str:
    """PNG: per source, T vs B (markers Monte-Carlo, dashed closed forms) and mass kept vs B."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = list(dict.fromkeys(p.source for p in points))
    fig, axes = plt.subplots(len(sources), 2, figsize=(13, 4.2 * len(sources)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, src in enumerate(sources):
        pts = [p for p in points if p.source == src]
        n, k = pts[0].num_experts, pts[0].top_k
        ks = [k0 for k0 in k0s if k0 in pts[0].t_oea]
        bs = [p.batch_size for p in pts]
        dense = sorted(set(bs) | {2 ** i for i in range(int(math.log2(max(bs))) + 1)})
        ax = axes[row][0]
        ax.plot(bs, [p.t_vanilla for p in pts], "o", color="black", label=f"vanilla k={k}")
        ax.plot(dense, [expected_t_vanilla(n, k, b) for b in dense], "--", color="black", linewidth=1)
        for i, k0 in enumerate(ks):
            c = colors[i % len(colors)]
            ax.plot(bs, [p.t_oea[k0] for p in pts], "o", color=c, label=f"OEA k0={k0}")
            ax.plot(dense, [expected_t_oea(n, k0, b) for b in dense], "--", color=c, linewidth=1)
        ax.set_title(f"{src}: active experts T (dashed: closed form, uniform)")
        ax.set_ylabel("T per step")
        ax = axes[row][1]
        for i, k0 in enumerate(ks):
            ax.plot(bs, [p.mass_kept[k0] for p in pts], "o-", color=colors[i % len(colors)], label=f"k0={k0}")
        ax.set_title(f"{src}: original router mass kept")
        ax.set_ylabel("mass kept (mean over tokens)")
        ax.set_ylim(0, 1.02)
        for ax in axes[row]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch size B")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _parse_config(text: str) -> ModelConfig:
    """'qwen3-30b', 'N/k', 'N/k/sigmoid' or 'name=N/k[/scoring]'."""
    if text in PRESETS:
        return PRESETS[text]
    name, _, spec = text.rpartition("=")
    parts = spec.split("/")
    if len(parts) not in (2, 3):
        raise argparse.ArgumentTypeError(f"--config wants a preset {list(PRESETS)} or N/k[/scoring], got {text!r}")
    n, k = int(parts[0]), int(parts[1])
    scoring = parts[2] if len(parts) == 3 else "softmax"
    return ModelConfig(name or f"N={n},k={k}", n, k, scoring)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=_parse_config, action="append",
                   help="model preset (qwen3-30b, glm-5) or N/k[/softmax|sigmoid]; repeatable "
                        "(default: qwen3-30b and glm-5)")
    p.add_argument("--k0", type=int, nargs="+", default=[3, 4, 5, 6, 7])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[2 ** i for i in range(11)])
    p.add_argument("--dist", nargs="+", default=["uniform", "zipf"], choices=["uniform", "zipf"])
    p.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent of expert popularity")
    p.add_argument("--trials", type=int, default=8, help="batches per point (at least)")
    p.add_argument("--min-rows", type=int, default=512,
                   help="small B gets more batches: max(trials, ceil(min_rows / B))")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dump-dir", help="router-logit dump of a server; simulates it instead of synthetic logits")
    p.add_argument("--rank", type=int, help="TP rank of the dump to read (default: the lowest)")
    p.add_argument("--layers", type=int, nargs="+", help="only these layers of the dump")
    p.add_argument("--min-saving", type=float, default=0.05, help="for the --oea-max-batch suggestions")
    p.add_argument("--suggest", type=_parse_config, action="append",
                   help="only print suggest_max_batch for this config (repeatable), no simulation")
    p.add_argument("--out-dir", default="oea_sim_out")
    p.add_argument("--threads", type=int, default=1, help="torch threads (keep small on shared machines)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    configs = args.config or list(PRESETS.values())

    if args.suggest:
        print(suggestion_table(args.suggest, args.k0, args.min_saving))
        return 0

    start = time.time()
    if args.dump_dir:
        points = simulate_dumps(args.dump_dir, args.k0, args.rank, args.layers)
        n, k = points[0].num_experts, points[0].top_k
        configs = [ModelConfig("dump", n, k)]
    else:
        points = []
        for cfg in configs:
            for dist in args.dist:
                points += simulate(cfg, dist, args.k0, args.batch_sizes, args.trials, args.min_rows,
                                   args.seed, args.zipf_s)
                print(f"[simulate] {cfg.name} / {dist}: {time.time() - start:.1f}s", flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    report = "# OEA simulation\n\n" + markdown_report(points, args.k0) + "\n" + \
        suggestion_table(configs, args.k0, args.min_saving)
    md = os.path.join(args.out_dir, "simulate.md")
    with open(md, "w") as f:
        f.write(report)
    png = plot(points, args.k0, os.path.join(args.out_dir, "simulate.png"))
    print(report)
    print(f"wrote {md} and {png} in {time.time() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
