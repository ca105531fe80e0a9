"""Quality against T: teacher-forced, batched evaluation of decode-step routing policies.

What it measures. B held-out sequences of P + L + 1 tokens decode in lockstep. The first P
positions are the prompt: prefill, routed by the model's own router (never rerouted). Each of the
L later positions t is one decode step: at every MoE layer the B rows at position t are routed
together by the policy under test (policies.py), which sees what SGLang's router sees (logits,
selection scores with the correction bias, weight scores, the group-limited top-K) and returns the
ids and weights the experts then run. T is the number of distinct experts those B rows use. Each
decode position predicts the next token; the continuation's NLL and next-token accuracy are over
those L predictions.

Why one forward per batch. A causal forward computes position t from positions <= t only, so a
teacher-forced forward whose routing at position t is batch-routed over the B rows at t computes
exactly what lockstep decoding of the B sequences (with their true tokens fed back) computes:
position t's keys and values at every layer come from the same routed hidden states either way.

Why transformers and not SGLang. The model here is the transformers model we trained
(benchmark/oea/models, training/train_moe.py), and plain SGLang's greedy output on both checkpoints equals
transformers' in float32 (test/srt/test_server_e2e.py, test_sglang_serves_the_trained_*_weights),
while SGLang's model code needs a running server and offers no per-position hook. The routing is swapped at each MoE
block's router (`mlp.gate`, which returns (logits, weights, ids) in both families): the wrapper
keeps the router's own output for prompt positions and replaces decode positions' rows.

Usage (the study; see main for the flags):
    .venv/bin/python benchmark/oea/studies/frontier.py --out-dir benchmark/oea/results/<run>

Modules: frontier_eval.py (the batch-routed forwards), frontier_compare.py (rows, intervals,
matched-T comparisons, verdicts), frontier_report.py (frontier.md, frontier.png, the JSON files).
"""

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmark/oea
for _path in (BENCH, os.path.join(os.path.dirname(os.path.dirname(BENCH)), "python")):
    if _path not in sys.path:
        sys.path.insert(0, _path)  # its folders import as packages; sglang_oea from this checkout

from studies.frontier_compare import row_id, summary_row, t_stats  # noqa: E402
from studies.frontier_eval import Scored, load_model, run_policy  # noqa: E402
from studies.frontier_report import rewrite_report, write_all  # noqa: E402


@dataclass
class StudyConfig:
    """The study's grid: models, static batch sizes B, held-out windows (count of P + L + 1 tokens,
    seed), and each policy's knobs."""

    models: Sequence[str]
    batches: Sequence[int]
    count: int
    prompt_len: int
    continuation: int
    seed: int
    top_p: Sequence[float] = (0.2, 0.35, 0.5, 0.7, 0.8, 0.9, 0.95)
    k0s: Sequence[int] = (1, 2, 3, 4, 5, 6, 7)
    new_k0: int = 2


def model_study(model_dir: str, cfg: StudyConfig, log) -> Tuple[List[Dict], Dict[str, torch.Tensor]]:
    """Every (policy, knob, B) of one model: rows and per-sequence NLL per token."""
    name = os.path.basename(model_dir.rstrip("/"))
    model = load_model(model_dir)
    from training import heldout

    windows = heldout.heldout_windows(model_dir, cfg.count, cfg.prompt_len + cfg.continuation + 1, cfg.seed)
    rows, per_seq = [], {}

    def record(policy, knob, batch, got, base):
        row = summary_row(name, policy, knob, batch, got, base)
        rows.append(row)
        per_seq[row_id(row)] = got.nll / got.tokens
        log(f"{name} B={batch} {policy} {knob}: T={row['mean_T']:.2f}/{row['T_plain']:.2f} "
            f"dNLL={row['nll_delta']:+.4f} [{row['nll_delta_lo']:+.4f},{row['nll_delta_hi']:+.4f}] "
            f"{got.seconds:.1f}s")
        return row

    for batch in cfg.batches:
        base = run_policy(model, windows, batch, cfg.prompt_len, "plain", None)
        record("plain", None, batch, base, base)
        oea_runs = {k0: run_policy(model, windows, batch, cfg.prompt_len, "oea", k0) for k0 in cfg.k0s}
        oea_t = [record("oea", k0, batch, got, base)["mean_T"] for k0, got in oea_runs.items()]
        # oea_budget at a cap of 0 is oea(new_k0) (test_frontier checks it): its curve's low end.
        record("oea_budget", [cfg.new_k0, 0], batch, oea_runs[cfg.new_k0], base)
        pruned_runs = {k0: run_policy(model, windows, batch, cfg.prompt_len, "pruned", k0) for k0 in cfg.k0s}
        for k0, got in pruned_runs.items():
            record("pruned", k0, batch, got, base)
        # p = 0 keeps one expert per row: top_p(0) is pruned(1), oea_mass(0) is oea(1) (tested).
        record("top_p", 0.0, batch, pruned_runs[1], base)
        record("oea_mass", 0.0, batch, oea_runs[1], base)
        for p in cfg.top_p:
            record("top_p", p, batch, run_policy(model, windows, batch, cfg.prompt_len, "top_p", p), base)
            record("oea_mass", p, batch, run_policy(model, windows, batch, cfg.prompt_len, "oea_mass", p), base)
        for cap in budget_grid(oea_t, base):
            record("budget", cap, batch, run_policy(model, windows, batch, cfg.prompt_len, "budget", cap), base)
            # Below the union of its bases, oea_budget is oea(new_k0) (already run).
            if cap > oea_t[cfg.k0s.index(cfg.new_k0)]:
                knob = [cfg.new_k0, cap]
                record("oea_budget", knob, batch, run_policy(model, windows, batch, cfg.prompt_len, "oea_budget", knob),
                       base)
    return rows, per_seq


def budget_grid(oea_t: Sequence[float], base: Scored) -> List[int]:
    """Budgets E: OEA's mean T at each k0 (so that budgets meet OEA at matched T), 30% of plain's
    T, and points between them wherever those leave gaps over 20% of plain's T."""
    t_plain = t_stats(base.steps)["mean"]
    points = sorted(set(list(oea_t) + [0.3 * t_plain]))
    grid = set()
    for lo, hi in zip(points, points[1:]):
        pieces = max(1, math.ceil((hi - lo) / (0.2 * t_plain)))
        grid.update(lo + (hi - lo) * i / pieces for i in range(pieces + 1))
    return sorted({max(1, round(x)) for x in grid})


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=[os.path.join(BENCH, "models", m)
                                                        for m in ("qwen3_moe_stdlib", "glm4_moe_stdlib",
                                                                  "deepseek_v3_stdlib")])
    parser.add_argument("--batches", nargs="+", type=int, default=[4, 16, 64])
    parser.add_argument("--count", type=int, default=256, help="held-out sequences (a multiple of every B)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--continuation", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="heldout_windows seed")
    parser.add_argument("--new-k0", type=int, default=2, help="oea_budget's guaranteed base (chosen on a pilot)")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the report from the out-dir's frontier.json and per_sequence.json")
    args = parser.parse_args(argv)
    if args.report_only:
        rewrite_report(args.out_dir)
        return 0
    torch.set_num_threads(1)
    cfg = StudyConfig(args.models, args.batches, args.count, args.prompt_len, args.continuation, args.seed,
                      new_k0=args.new_k0)
    os.makedirs(args.out_dir, exist_ok=True)
    log_file = open(os.path.join(args.out_dir, "log.txt"), "a")

    def log(text):
        print(text, flush=True)
        log_file.write(text + "\n")
        log_file.flush()

    start = time.perf_counter()
    rows, per_seq = [], {}
    for model_dir in cfg.models:
        got_rows, got_seq = model_study(model_dir, cfg, log)
        rows += got_rows
        per_seq.update(got_seq)
    write_all(args.out_dir, rows, per_seq, vars(args), time.perf_counter() - start)
    log(f"total {time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())