r"""Router statistics of a served model, from `--oea-dump-router-logits` recordings.

    python benchmark/oea/studies/router_stats.py --model-path benchmark/oea/models/qwen3_moe_stdlib \
        --model-path benchmark/oea/models/glm4_moe_stdlib --out-dir out/router_stats
    python benchmark/oea/studies/router_stats.py --dump-dir qwen=DIR --dump-dir glm=DIR2 --out-dir ...

For each model:
1. Records (unless --dump-dir gives a recording): a CPU server (`sglang_oea.cpu_serve`) with
   `--oea-k0 <top-k>` (OEA a no-op, so SGLang's own routing is recorded) and
   `--oea-dump-router-logits`, sent --concurrency held-out prompts at once (training/heldout.py), each
   sampled at temperature 1 for --output-len tokens. The first --steps decode steps are recorded.
2. T against B: from every recorded step with at least --batch rows, per layer, the router's own
   ids of B rows drawn without replacement (--draws per step), for B = 1 ... --batch. The rows of
   one step are different requests decoding at the same time, so a draw is a batch SGLang could
   have run. Beside it: the uniform-routing expectation N(1 - (1 - k/N)^B), and T after OEA at
   each --k0 on the same draws (simulate.evaluate_batch, the product's reference routing).
3. Popularity: per layer, the share of all recorded (row, slot) choices each expert took: the
   busiest expert's share over the mean share, the share taken by the busiest 10% of experts, and
   the effective number of experts exp(entropy) against N.

Writes router_stats.json, router_stats.md and router_stats.png into --out-dir.
"""

import argparse
import json
import os
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmark/oea
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)  # its folders import as packages

from training import heldout  # noqa: E402
from serving.servers import child_env, cpu_server, terminate_as_interrupt  # noqa: E402
from studies import simulate  # noqa: E402

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
THREAD_ENV = {"OMP_NUM_THREADS": "1"}


# ----------------------------------------------------------------------------------------------
# Recording
# ----------------------------------------------------------------------------------------------


def model_top_k(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        return int(json.load(f)["num_experts_per_tok"])


def generate(base_url: str, ids: List[int], output_len: int) -> None:
    """One request: the prompt's ids, then `output_len` tokens sampled from the model (temperature 1),
    so the recorded decode rows route the model's own text, not a greedy loop."""
    params = {"max_new_tokens": output_len, "temperature": 1.0, "ignore_eos": True}
    body = json.dumps({"input_ids": ids, "sampling_params": params}).encode()
    request = urllib.request.Request(base_url + "/generate", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=1800) as response:
        response.read()


def record(model_dir: str, dump_dir: str, args: argparse.Namespace) -> None:
    """Serve `model_dir` with SGLang's own routing recorded into dump_dir, under held-out traffic."""
    os.makedirs(dump_dir, exist_ok=True)
    flags = ["--random-seed", "0", "--oea-k0", str(model_top_k(model_dir)), "--oea-min-batch", "1",
             "--oea-dump-router-logits", dump_dir, "--oea-dump-steps", str(args.steps),
             "--max-running-requests", str(args.concurrency)]
    env = {**child_env(), **THREAD_ENV}
    log_path = os.path.join(dump_dir, "server.log")
    with cpu_server(model_dir, flags, lambda: log_path, env, 600) as (base_url, _):
        prompts = heldout.prompt_continuations(model_dir, args.concurrency, args.prompt_len, 1, seed=args.seed)
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(lambda p: generate(base_url, p["prompt_ids"], args.output_len), prompts))


# ----------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------


def layer_steps(dump_dir: str) -> Dict[int, List[dict]]:
    """{layer: [record, ...]} of the lowest rank's recording, records cut to their real rows."""
    out: Dict[int, List[dict]] = {}
    for _step, layer, rec in simulate.load_dumps(dump_dir):
        rows = int(rec.get("batch_size", rec["router_logits"].shape[0]))
        out.setdefault(layer, []).append({**rec, "router_logits": rec["router_logits"][:rows].float(),
                                          "router_ids": rec["router_ids"][:rows].long()})
    return out


def router_of(rec: dict) -> simulate.Router:
    return simulate.Router.make(rec.get("scoring_func", "softmax"), int(rec["top_k"]), rec.get("correction_bias"),
                                rec.get("num_expert_group") or 1, rec.get("topk_group") or 1)


def t_against_b(records: Sequence[dict], batch_sizes: Sequence[int], k0s: Sequence[int], draws: int,
                seed: int) -> Dict[int, Dict]:
    """{B: {"steps", "T", "T_sd", "T_oea": {k0: mean}}} over B-row draws from each step with >= B rows."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for b in batch_sizes:
        t_plain, t_oea = [], {k0: [] for k0 in k0s}
        steps = [rec for rec in records if rec["router_logits"].shape[0] >= b]
        for rec in steps:
            for _ in range(draws):
                rows = torch.randperm(rec["router_logits"].shape[0], generator=gen)[:b]
                stats = simulate.evaluate_batch(rec["router_logits"][rows], router_of(rec), k0s)
                t_plain.append(stats.t_vanilla)
                for k0 in k0s:
                    t_oea[k0].append(stats.t_oea[k0])
        if steps:
            out[b] = {"steps": len(steps), "T": mean(t_plain), "T_sd": sd(t_plain),
                      "T_oea": {k0: mean(v) for k0, v in t_oea.items()}}
    return out


def popularity(records: Sequence[dict], num_experts: int) -> Dict:
    """How unevenly one layer's recorded choices spread over its experts."""
    ids = torch.cat([rec["router_ids"] for rec in records]).flatten()
    ids = ids[ids < num_experts]  # fused shared-expert columns are not routed choices
    share = torch.bincount(ids, minlength=num_experts).double() / ids.numel()
    top = max(1, num_experts // 10)
    nonzero = share[share > 0]
    return {"choices": int(ids.numel()), "max_over_mean": float(share.max() * num_experts),
            "top10pct_share": float(share.sort(descending=True).values[:top].sum()),
            "effective_experts": float(torch.exp(-(nonzero * nonzero.log()).sum())),
            "unused_experts": int((share == 0).sum())}


def mean(values: Sequence[float]) -> float:
    return float(np.mean(values))


def sd(values: Sequence[float]) -> float:
    """Sample standard deviation (n - 1); 0 for a single value."""
    return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def model_stats(name: str, dump_dir: str, args: argparse.Namespace) -> Dict:
    """Per layer: T against B (router, uniform expectation, OEA at each k0) and popularity."""
    layers = layer_steps(dump_dir)
    first = layers[min(layers)][0]
    n, k = first["router_logits"].shape[1], int(first["top_k"])
    batch_sizes = [b for b in BATCH_SIZES if b <= args.batch]
    uniform = {b: simulate.expected_t_vanilla(n, k, b) for b in batch_sizes}
    per_layer = {layer: {"t_vs_b": t_against_b(recs, batch_sizes, args.k0, args.draws, args.seed + layer),
                         "popularity": popularity(recs, n), "recorded_steps": len(recs),
                         "rows": sum(r["router_logits"].shape[0] for r in recs)}
                 for layer, recs in sorted(layers.items())}
    return {"model": name, "num_experts": n, "top_k": k, "scoring_func": first.get("scoring_func"),
            "uniform_T": uniform, "layers": per_layer}


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def markdown(results: Sequence[Dict], args: argparse.Namespace, label: str) -> str:
    lines = ["# Router statistics of served models", "", label, ""]
    for res in results:
        bs = sorted(res["uniform_T"])
        lines += [f"## {res['model']} (N={res['num_experts']}, top-{res['top_k']}, {res['scoring_func']})", "",
                  "T = distinct experts per layer in a decode batch of B rows (router's own routing), mean over "
                  f"draws; uniform = N(1-(1-k/N)^B).", "",
                  "| layer | " + " | ".join(f"B={b}" for b in bs) + " |", "|---|" + "---|" * len(bs),
                  "| uniform | " + " | ".join(f"{res['uniform_T'][b]:.1f}" for b in bs) + " |"]
        for layer, st in res["layers"].items():
            cells = [f"{st['t_vs_b'][b]['T']:.1f}" if b in st["t_vs_b"] else "-" for b in bs]
            lines.append(f"| {layer} | " + " | ".join(cells) + " |")
        lines += ["", "Expert popularity over all recorded choices (shared-expert columns excluded):", "",
                  "| layer | recorded rows | busiest / mean | top 10% of experts take | effective experts (of N) | unused |",
                  "|---|---|---|---|---|---|"]
        for layer, st in res["layers"].items():
            p = st["popularity"]
            lines.append(f"| {layer} | {st['rows']} | {p['max_over_mean']:.1f}x | {p['top10pct_share']:.0%} | "
                         f"{p['effective_experts']:.0f} of {res['num_experts']} | {p['unused_experts']} |")
        lines += ["", "T after OEA on the same draws (mean over layers; router -> OEA):", "",
                  "| B | router | " + " | ".join(f"k0={k0}" for k0 in args.k0) + " |", "|---|---|" + "---|" * len(args.k0)]
        for b in bs:
            rows = [st["t_vs_b"][b] for st in res["layers"].values() if b in st["t_vs_b"]]
            if rows:
                t = mean([r["T"] for r in rows])
                cells = [f"{mean([r['T_oea'][k0] for r in rows]):.1f} ({mean([r['T_oea'][k0] for r in rows]) / t:.2f}x)"
                         for k0 in args.k0]
                lines.append(f"| {b} | {t:.1f} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(results: Sequence[Dict], path: str, label: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, res in zip(axes[0], results):
        bs = sorted(res["uniform_T"])
        ax.plot(bs, [res["uniform_T"][b] for b in bs], "k--", label="uniform N(1-(1-k/N)^B)")
        for layer, st in res["layers"].items():
            have = [b for b in bs if b in st["t_vs_b"]]
            ax.plot(have, [st["t_vs_b"][b]["T"] for b in have], "o-", label=f"layer {layer}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("decode batch B")
        ax.set_ylabel("distinct experts T")
        ax.set_title(f"{res['model']} (N={res['num_experts']}, top-{res['top_k']})")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(label, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", action="append", default=[], help="a model to serve and record (repeatable)")
    p.add_argument("--dump-dir", action="append", default=[], metavar="NAME=DIR",
                   help="an existing recording instead of serving (repeatable)")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight while recording")
    p.add_argument("--steps", type=int, default=48, help="decode steps recorded (--oea-dump-steps)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=64, help="largest B drawn")
    p.add_argument("--draws", type=int, default=8, help="B-row draws per recorded step")
    p.add_argument("--k0", type=int, nargs="+", default=[3, 4, 5, 6])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="", help="machine and date, printed on the report")
    args = p.parse_args(argv)
    if not args.model_path and not args.dump_dir:
        p.error("give --model-path (to record) or --dump-dir NAME=DIR (a recording)")
    if any("=" not in d for d in args.dump_dir):
        p.error("--dump-dir takes NAME=DIR")
    if args.concurrency < args.batch:
        p.error(f"--batch ({args.batch}) needs --concurrency >= it (got {args.concurrency})")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    sources: List[Tuple[str, str]] = [tuple(d.split("=", 1)) for d in args.dump_dir]
    for model in args.model_path:
        name = os.path.basename(os.path.normpath(model))
        dump = os.path.join(args.out_dir, "dumps", name)
        record(model, dump, args)
        sources.append((name, dump))
    results = [model_stats(name, dump, args) for name, dump in sources]
    label = args.label or "CPU recording of tiny models; says nothing about GLM-5 or a GPU."
    with open(os.path.join(args.out_dir, "router_stats.json"), "w") as f:
        json.dump({"label": label, "args": vars(args), "models": results}, f, indent=1)
    with open(os.path.join(args.out_dir, "router_stats.md"), "w") as f:
        f.write(markdown(results, args, label))
    plot(results, os.path.join(args.out_dir, "router_stats.png"), label)
    print(markdown(results, args, label))
    return 0


if __name__ == "__main__":
    with terminate_as_interrupt():  # SIGTERM stops the servers started, as Ctrl-C does
        sys.exit(main())
