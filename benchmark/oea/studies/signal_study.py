"""Is there a live quality signal of OEA? Candidate per-token signals (quality_signals.py) against
the measured NLL increase, on the trained models, teacher-forced with the frontier's evaluator.

Each cell is one (model, k0, B): OEA(k0) by the product's routing (policies.oea), static batches of
B held-out sequences, every decode position of every MoE layer routed per batch (frontier.py says
why one teacher-forced forward computes lockstep decoding). Per cell: every signal's mean over
(token, layer) pairs and its quantiles; the NLL increase and next-token accuracy change against
plain routing on the same sequences, with batch-cluster intervals. Across cells: each signal's
Spearman correlation with the NLL increase, per model and pooled, with a bootstrap over blocks of
sequences (quality_signals.rank_correlation). The decision rule: ship the signal that best
predicts the NLL increase if its rank correlation is at least 0.9 on every model.

Usage:
    nice -n 5 .venv/bin/python benchmark/oea/studies/signal_study.py --out-dir benchmark/oea/results/<run>
"""

import argparse
import json
import logging
import os
import sys
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmark/oea
for _path in (BENCH, os.path.join(os.path.dirname(os.path.dirname(BENCH)), "python")):
    if _path not in sys.path:
        sys.path.insert(0, _path)  # its folders import as packages; sglang_oea from this checkout

from common import stats  # noqa: E402
from studies import frontier_eval as fe  # noqa: E402
from studies import policies as pol  # noqa: E402
from studies import quality_signals as qs  # noqa: E402
from studies.frontier_compare import BOOTSTRAP_RESAMPLES, interval_cell, t_stats  # noqa: E402

MODELS = ("qwen3_moe_stdlib", "glm4_moe_stdlib", "deepseek_v3_stdlib")
QUANTILES = (0.05, 0.10, 0.50, 0.90, 0.95)
# The tail a cell is summarised by besides its mean: the low tail of a KEPT signal, the high one of a COST signal.
TAIL = {qs.KEPT: 0.10, qs.COST: 0.90}
SUMMARIES = ("mean", "tail")
# A reference predictor, not a candidate: T after OEA over T of plain routing at the same B, which the
# product already exports (T before and after, per step). Higher means less routing changed.
T_RATIO = "t_ratio"
THRESHOLD = 0.9
# The k0 the operating guide starts from (its example command), and where the trained models' curves bend.
RECOMMENDED_K0 = (4, 6)


def quantile_key(q: float) -> str:
    return f"q{round(q * 100):02d}"


def block_t(steps: torch.Tensor, per_block: int) -> np.ndarray:
    """Mean T per block of sequences [G] from T per (batch, layer, step) [batches, layers, L]."""
    return steps.double().mean(dim=(1, 2)).numpy().reshape(-1, per_block).mean(axis=1)


def cell_row(model: str, batch: int, k0: int, got: fe.Scored, base: fe.Scored,
             signals: Dict[str, torch.Tensor], block: int) -> Dict:
    """One cell: NLL/accuracy against plain (base: plain routing at the same B) with batch-cluster
    intervals, T against plain's, every signal's mean,
    quantiles and sequence-level rank correlation with the NLL increase (oriented), plus the
    block statistics the cross-cell bootstrap needs ("_blocks", not written to JSON).

    Args:
        signals: {name: [n, layers, L]} from quality_signals.collect.
        block: sequences per block (a multiple of batch).
    """
    nll_delta = (got.nll - base.nll) / got.tokens  # [n] per token
    acc_delta = (got.correct - base.correct).double() / got.tokens
    nll = interval_cell(nll_delta, batch)
    acc = stats.cluster_mean_ci(acc_delta.numpy(), batch, BOOTSTRAP_RESAMPLES)
    n = nll_delta.numel()
    row = {"model": model, "batch": batch, "k0": k0, "sequences": n, "blocks": n // block,
           "mean_T": t_stats(got.steps)["mean"], "T_plain": t_stats(base.steps)["mean"],
           "nll_plain": float(base.nll.sum()) / (n * got.tokens),
           "nll_delta": nll["diff"], "nll_delta_lo": nll["lo"], "nll_delta_hi": nll["hi"],
           "acc_plain": float(base.correct.sum()) / (n * got.tokens), "acc_delta": float(acc_delta.mean()),
           "acc_delta_lo": acc[0], "acc_delta_hi": acc[1], "seconds": got.seconds, "signals": {}}
    row["T_ratio"] = row["mean_T"] / row["T_plain"]
    blocks = {"nll": nll_delta.numpy().reshape(-1, block).mean(axis=1), "mean": {}, "hist": {}}
    blocks["mean"][T_RATIO] = block_t(got.steps, block // batch) / block_t(base.steps, block // batch)
    for name, values in signals.items():
        flat = values.reshape(-1)
        entry = {"mean": float(flat.mean())}
        entry.update({quantile_key(q): float(v) for q, v in zip(QUANTILES, torch.quantile(flat, torch.tensor(
            QUANTILES, dtype=flat.dtype)))})
        seq_rho = qs.spearman(values.mean(dim=(1, 2)).numpy(), nll_delta.numpy())
        entry["seq_rho"] = None if seq_rho is None else seq_rho * (-1 if qs.SIGNALS[name] == qs.KEPT else 1)
        row["signals"][name] = entry
        by_block = values.numpy().reshape(n // block, -1)
        blocks["mean"][name] = by_block.mean(axis=1)
        blocks["hist"][name] = qs.block_histograms(by_block, name)
    row["_blocks"] = blocks
    return row


def model_cells(model_dir: str, batches: Sequence[int], k0s: Sequence[int], count: int, prompt_len: int,
                continuation: int, seed: int, log) -> List[Dict]:
    """Every (k0, B) cell of one model: OEA against plain routing at the same B (its NLL does not
    depend on B, its T does)."""
    from training import heldout

    name = os.path.basename(model_dir.rstrip("/"))
    model = fe.load_model(model_dir)
    gates = qs.install_signal_gates(model)
    windows = heldout.heldout_windows(model_dir, count, prompt_len + continuation + 1, seed)
    block = max(batches)
    rows = []
    for batch in batches:
        base = fe.evaluate(model, windows, batch, prompt_len, pol.plain)
        plain_signals = qs.collect(gates)
        unchanged = all(bool((plain_signals[s] == (1.0 if d == qs.KEPT else 0.0)).all()) for s, d in qs.SIGNALS.items())
        log(f"{name} B={batch}: plain T={t_stats(base.steps)['mean']:.1f} {base.seconds:.1f}s, signals exact at "
            f"plain routing: {unchanged}")
        if not unchanged:
            raise RuntimeError(f"{name}: a signal is not at its no-change value under plain routing")
        for k0 in k0s:
            got = fe.run_policy(model, windows, batch, prompt_len, "oea", k0)
            row = cell_row(name, batch, k0, got, base, qs.collect(gates), block)
            rows.append(row)
            log(f"{name} B={batch} k0={k0}: T={row['mean_T']:.1f}/{row['T_plain']:.1f} dNLL={row['nll_delta']:+.4f} "
                f"[{row['nll_delta_lo']:+.4f},{row['nll_delta_hi']:+.4f}] dAcc={row['acc_delta']:+.4f} "
                + " ".join(f"{s}={v['mean']:.3f}" for s, v in row["signals"].items()) + f" {got.seconds:.1f}s")
    return rows


def stratum(rows: Sequence[Dict], name: str, summary: str) -> qs.Stratum:
    """One model's cells as a bootstrap stratum of the signal's (or T_RATIO's) `summary` ("mean" or
    "tail")."""
    cost = np.stack([r["_blocks"]["nll"] for r in rows])
    if summary == "mean":
        return qs.Stratum(np.stack([r["_blocks"]["mean"][name] for r in rows]), cost)
    q = TAIL[qs.SIGNALS[name]]
    hist = np.stack([r["_blocks"]["hist"][name] for r in rows])  # [C, G, H]
    return qs.Stratum(hist, cost, lambda h: qs.histogram_quantile(h.sum(axis=1), name, q))


def correlations(rows: Sequence[Dict], resamples: int) -> Dict[str, Dict]:
    """{"signal/summary": {model: oriented rank_correlation, ..., "pooled": ...}}, every signal's
    mean and tail, then T_RATIO's mean (the reference)."""
    models = sorted({r["model"] for r in rows}, key=lambda m: (MODELS + (m,)).index(m))
    keys = [(name, summary, direction) for name, direction in qs.SIGNALS.items() for summary in SUMMARIES]
    out = {}
    for name, summary, direction in keys + [(T_RATIO, "mean", qs.KEPT)]:
        per_model = {m: stratum([r for r in rows if r["model"] == m], name, summary) for m in models}
        got = {m: qs.oriented(qs.rank_correlation([s], resamples), direction) for m, s in per_model.items()}
        got["pooled"] = qs.oriented(qs.rank_correlation(list(per_model.values()), resamples), direction)
        out[f"{name}/{summary}"] = got
    return out


def pairwise(cells: Sequence[Dict], resamples: int) -> Dict[str, Dict]:
    """Each signal's mean (and T_RATIO) pooled over each pair of models, from the cells' block means
    (results.json rows): {"signal": {"model_a+model_b": oriented rank_correlation}}. It asks whether
    one value of the signal goes with one NLL increase on two models."""
    models = list(dict.fromkeys(c["model"] for c in cells))
    directions = {**qs.SIGNALS, T_RATIO: qs.KEPT}
    out = {}
    for name, direction in directions.items():
        strata = {m: qs.Stratum(np.array([c["block_mean"][name] for c in cells if c["model"] == m]),
                                np.array([c["block_nll"] for c in cells if c["model"] == m])) for m in models}
        out[name] = {f"{a}+{b}": qs.oriented(qs.rank_correlation([strata[a], strata[b]], resamples), direction)
                     for i, a in enumerate(models) for b in models[i + 1:]}
    return out


def split_half(rows: Sequence[Dict]) -> Optional[float]:
    """How reproducible the cells' ranking by NLL increase is: Spearman, over one model's cells, of
    the NLL increase on the even blocks against that on the odd blocks (None under 2 blocks)."""
    cost = np.stack([r["_blocks"]["nll"] for r in rows])  # [C, G]
    if cost.shape[1] < 2:
        return None
    return qs.spearman(cost[:, 0::2].mean(axis=1), cost[:, 1::2].mean(axis=1))


def decide(corr: Dict[str, Dict], models: Sequence[str], threshold: float = THRESHOLD) -> Dict:
    """The decision rule: among candidates (signal/summary) defined on every model, the best
    predictor is the one of highest minimum oriented rho over the models (then highest pooled);
    it ships when that minimum is at least `threshold`. The reference (T_RATIO) is no candidate:
    its lowest per-model correlation is reported beside them ("reference_min_rho")."""
    ranked = []
    for key, per in corr.items():
        if key.split("/")[0] not in qs.SIGNALS:
            continue
        rhos = [per[m]["rho"] for m in models]
        if all(r is not None for r in rhos):
            pooled = per["pooled"]["rho"]
            ranked.append((min(rhos), -1.0 if pooled is None else pooled, key))
    ranked.sort(reverse=True)
    best = ranked[0][2] if ranked else None
    ship = best if ranked and ranked[0][0] >= threshold else None
    reference = [corr.get(f"{T_RATIO}/mean", {}).get(m, {}).get("rho") for m in models]
    return {"threshold": threshold, "best": best, "ship": ship,
            "reference_min_rho": None if None in reference else min(reference),
            "ranking": [{"candidate": k, "min_rho": m, "pooled_rho": p} for m, p, k in ranked]}


def public(row: Dict) -> Dict:
    """A cell row for results.json: its block means kept ("block_nll", "block_mean": per block of
    sequences), its block histograms left out."""
    out = {k: v for k, v in row.items() if not k.startswith("_")}
    out["block_nll"] = [float(x) for x in row["_blocks"]["nll"]]
    out["block_mean"] = {n: [float(x) for x in v] for n, v in row["_blocks"]["mean"].items()}
    return out


def fmt_rho(got: Dict) -> str:
    """An oriented correlation with its interval, or why there is none."""
    if got["rho"] is None:
        return "undefined (constant)"
    interval = "" if got["lo"] is None else f" [{got['lo']:+.2f}, {got['hi']:+.2f}]"
    return f"{got['rho']:+.2f}{interval}"


def fmt_ci(mean: float, lo: Optional[float], hi: Optional[float], digits: int = 4) -> str:
    return f"{mean:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]"


def correlation_lines(result: Dict) -> List[str]:
    """The table of oriented rank correlations: one line per candidate, a column per model and pooled."""
    models = result["meta"]["models"]
    lines = ["| candidate | " + " | ".join(models) + " | pooled | median sequence-level rho |",
             "|---|" + "---|" * (len(models) + 2)]
    for key, per in result["correlations"].items():
        name, summary = key.split("/")
        if name not in qs.SIGNALS:
            lines.append(f"| {name} (reference: T / T_plain, exported already) | "
                         + " | ".join(fmt_rho(per[m]) for m in models) + f" | {fmt_rho(per['pooled'])} | |")
            continue
        seq = [c["signals"][name]["seq_rho"] for c in result["cells"] if c["signals"][name]["seq_rho"] is not None]
        seq_text = f"{np.median(seq):+.2f}" if summary == "mean" and seq else ""
        label = f"{name}, {summary}" + (f" (q{round(TAIL[qs.SIGNALS[name]] * 100)})" if summary == "tail" else "")
        lines.append(f"| {label} | " + " | ".join(fmt_rho(per[m]) for m in models)
                     + f" | {fmt_rho(per['pooled'])} | {seq_text} |")
    return lines


def cell_lines(cells: Sequence[Dict], names: Sequence[str], column) -> List[str]:
    """One line per cell: model, B, k0, T, NLL and accuracy changes, then column(cell, name) per signal."""
    lines = ["| model | B | k0 | T / T_plain | NLL increase [95%] | accuracy change [95%] | "
             + " | ".join(names) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(names)]
    for c in cells:
        lines.append(f"| {c['model']} | {c['batch']} | {c['k0']} | {c['mean_T']:.1f} / {c['T_plain']:.1f} | "
                     f"{fmt_ci(c['nll_delta'], c['nll_delta_lo'], c['nll_delta_hi'])} | "
                     f"{fmt_ci(c['acc_delta'], c['acc_delta_lo'], c['acc_delta_hi'])} | "
                     + " | ".join(column(c, n) for n in names) + " |")
    return lines


def decision_lines(decision: Dict, models: Sequence[str]) -> List[str]:
    best = decision["ranking"][0] if decision["ranking"] else None
    if decision["ship"]:
        head = (f"**Ship `{decision['ship']}`**: its oriented rank correlation with the NLL increase is at least "
                f"{decision['threshold']} on every model (lowest {best['min_rho']:+.2f}; "
                f"pooled {best['pooled_rho']:+.2f}).")
    elif best:
        head = (f"**Ship nothing.** No candidate reaches a rank correlation of {decision['threshold']} on every model; "
                f"the best, `{best['candidate']}`, reaches {best['min_rho']:+.2f} on its weakest model.")
    else:
        head = "**Ship nothing.** No candidate is defined on every model."
    reference = decision.get("reference_min_rho")
    ref_text = "" if reference is None else (
        f" For reference, T / T_plain, which the product already exports, reaches {reference:+.2f} on its "
        "weakest model.")
    return [head, "", "Candidates by their lowest per-model correlation (then pooled): "
            + "; ".join(f"`{r['candidate']}` {r['min_rho']:+.2f}" for r in decision["ranking"]) + "." + ref_text]


def pairwise_lines(result: Dict) -> List[str]:
    """The table of pairwise pooled correlations of each signal's mean (and T_RATIO)."""
    pairs = result.get("pairwise")
    if not pairs:
        return []
    keys = list(next(iter(pairs.values())))
    lines = ["## Across two models: does one value of the signal go with one NLL increase?", "",
             "Spearman of each signal's cell mean with the NLL increase over the cells of two models together "
             "(oriented, the same block bootstrap, each model's blocks drawn independently). Per-model "
             "correlations only say that the signal ranks one model's cells; this asks whether its value "
             "carries over between models.", "",
             "| signal (cell mean) | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for name, per in pairs.items():
        lines.append(f"| {name} | " + " | ".join(fmt_rho(per[k]) for k in keys) + " |")
    return lines


def recommended_lines(result: Dict) -> List[str]:
    """The best candidate's mean and tail beside the NLL increase at RECOMMENDED_K0, every model and B."""
    best = result["decision"]["best"]
    if best is None:
        return []
    name = best.split("/")[0]
    tail = quantile_key(TAIL[qs.SIGNALS[name]])
    lines = [f"## `{name}` at k0 = {' and '.join(map(str, RECOMMENDED_K0))}", "",
             "k0 = 4 is the operating guide's starting point; the trained models' quality curves bend at about "
             "k0 = 4 (Qwen-style) and k0 = 6 (GLM-style).", "",
             f"| model | k0 | B | {name} mean | {name} {tail} | NLL increase | accuracy change |",
             "|---|---|---|---|---|---|---|"]
    for c in result["cells"]:
        if c["k0"] in RECOMMENDED_K0:
            got = c["signals"][name]
            lines.append(f"| {c['model']} | {c['k0']} | {c['batch']} | {got['mean']:.3f} | {got[tail]:.3f} | "
                         f"{c['nll_delta']:+.4f} | {c['acc_delta']:+.4f} |")
    return lines


def markdown(result: Dict) -> str:
    """results.md of a finished study."""
    meta, cells = result["meta"], result["cells"]
    names = list(qs.SIGNALS)
    blocks = cells[0]["blocks"] if cells else 0
    machine = (f"{meta['cpus']}-core CPU (no GPU), {meta['date']}, tiny trained models; "
               if "date" in meta else "")
    lines = ["# A live quality signal for OEA: candidate signals against the NLL increase", "",
             f"{machine}none of it is a GPU figure.", "",
             f"Teacher-forced, frontier evaluator (frontier_eval.py), OEA by the product's routing; models: "
             f"{', '.join(meta['models'])}; {meta['count']} held-out sequences each (seed {meta['seed']}), "
             f"{meta['prompt_len']} prompt tokens routed by the model's router, {meta['continuation']} decode "
             f"positions routed per static batch; B in {meta['batches']}, k0 in {meta['k0']}. "
             f"Runtime {meta['seconds'] / 60:.1f} min on one thread.", "",
             "Signals per (decode token, MoE layer), from the router's weight scores w (softmax; sigmoid "
             "without the correction bias), the original top-k set S and the final set F (ids with a "
             "positive weight; fused shared-expert columns excluded); p and q are w renormalised over S "
             "and F (quality_signals.py has the exact definitions):",
             "- mass_kept = sum over S and F of w / sum over S of w; final_mass = sum over F of w / sum over S of w;",
             "- overlap = |S and F| / |S|; top1_kept = 1 when S's expert of highest w is in F;",
             "- js = Jensen-Shannon divergence of p and q (nats); tv = 0.5 sum |p - q|.", "",
             "For reference (not a candidate): t_ratio, the cell's mean T after OEA over plain routing's at the "
             "same B, which the product already exports (T before and after, per step).", "",
             "A cell is one (model, k0, B). Its signal summaries: the mean over all (token, layer) pairs, "
             "and the tail: the 10% quantile of a kept-type signal, the 90% one of a divergence.", "",
             "## Decision", ""] + decision_lines(result["decision"], meta["models"]) + [
             "", "## Rank correlation with the NLL increase across cells", "",
             f"Spearman over the {len(cells) // max(1, len(meta['models']))} cells of each model (pooled: all "
             "cells), oriented so that +1 means the signal orders the cells exactly as their NLL increase "
             "(kept-type signals change sign). 95% percentile bootstrap "
             f"({meta['resamples']} resamples): a resample redraws, per model, blocks of {max(meta['batches'])} "
             f"consecutive sequences ({blocks} per model) with replacement, and recomputes every cell on the "
             "drawn blocks. A block holds whole static batches of every B, and every cell of a model uses the same "
             "sequences, so blocks are the independent units; the pooled resample draws each model's blocks "
             "independently. Median sequence-level rho: within each cell, the rank correlation over sequences "
             "of a sequence's mean signal with its own NLL increase (oriented), median over all cells.", ""]
    lines += correlation_lines(result)
    half = result["decision"]["split_half"]
    lines += ["", "How reproducible the cells' ranking by NLL increase itself is: Spearman of the NLL increase "
              "measured on the even blocks against the odd blocks, "
              + "; ".join(f"{m}: " + ("n/a" if v is None else f"{v:+.2f}") for m, v in half.items())
              + ". A signal cannot be expected to rank the measured cells much better than the measurement "
              "ranks them against itself (at half the sequences)."]
    lines += [""] + pairwise_lines(result)
    lines += [""] + recommended_lines(result)
    lines += ["", "## Signal means per cell", ""]
    lines += cell_lines(cells, names, lambda c, n: f"{c['signals'][n]['mean']:.4f}")
    lines += ["", "## Signal tails per cell", "",
              "Kept-type signals: 5% / 10% quantiles; divergences: 90% / 95% quantiles, over (token, layer) pairs.", ""]
    tail = lambda c, n: " / ".join(f"{c['signals'][n][k]:.3f}" for k in  # noqa: E731
                                   (("q05", "q10") if qs.SIGNALS[n] == qs.KEPT else ("q90", "q95")))
    lines += cell_lines(cells, names, tail)
    lines += ["", "## Caveats", "",
              "- Tiny trained models (4 layers, 6-8M parameters) on a CPU; no figure here is a GPU or GLM-5 "
              "figure.",
              "- Teacher forcing: an early error does not compound as in free-running generation.",
              "- The tail's bootstrap reads quantiles from per-block histograms of "
              f"{qs.BINS} bins (a bin is at most 0.001 wide); the tables' quantiles are exact.",
              f"- With {blocks} blocks per model the percentile bootstrap is coarse; 12 candidates are compared, "
              "so the best one's correlation is biased upward a little."]
    return "\n".join(lines) + "\n"


def progress_log(path: str):
    """A function that writes a line to stdout and appends it to `path`."""
    logger = logging.getLogger(f"signal_study:{path}")
    if not logger.handlers:
        logger.setLevel(logging.INFO)
        logger.propagate = False
        logger.addHandler(logging.StreamHandler(sys.stdout))
        logger.addHandler(logging.FileHandler(path))
    return logger.info


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=[os.path.join(BENCH, "models", m) for m in MODELS])
    parser.add_argument("--batches", nargs="+", type=int, default=[4, 16, 64])
    parser.add_argument("--k0", nargs="+", type=int, default=[1, 2, 3, 4, 5, 6, 7])
    parser.add_argument("--count", type=int, default=512,
                        help="held-out sequences, a multiple of the largest B (blocks of that many)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--continuation", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="heldout_windows seed")
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples of the rank correlations")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--report-only", action="store_true", help="rewrite results.md from the out-dir's results.json")
    args = parser.parse_args(argv)
    if args.report_only:
        with open(os.path.join(args.out_dir, "results.json")) as f:
            result = json.load(f)
        if "pairwise" not in result:  # a run written before pairwise() existed: add it from the block means
            result["pairwise"] = pairwise(result["cells"], result["meta"]["resamples"])
            with open(os.path.join(args.out_dir, "results.json"), "w") as f:
                json.dump(result, f, indent=1)
        with open(os.path.join(args.out_dir, "results.md"), "w") as f:
            f.write(markdown(result))
        return 0
    block = max(args.batches)
    if args.count % block or any(block % b for b in args.batches):
        parser.error(f"--count ({args.count}) must be a multiple of the largest of --batches ({block}), "
                     f"which every B must divide")
    torch.set_num_threads(1)
    os.makedirs(args.out_dir, exist_ok=True)
    log = progress_log(os.path.join(args.out_dir, "log.txt"))
    start = time.perf_counter()
    rows = []
    for model_dir in args.models:
        rows += model_cells(model_dir, args.batches, args.k0, args.count, args.prompt_len, args.continuation,
                            args.seed, log)
    models = list(dict.fromkeys(r["model"] for r in rows))
    corr = correlations(rows, args.resamples)
    decision = decide(corr, models)
    decision["split_half"] = {m: split_half([r for r in rows if r["model"] == m]) for m in models}
    seconds = time.perf_counter() - start
    settings = {k: v for k, v in vars(args).items() if k != "report_only"}
    result = {"meta": {**settings, "seconds": seconds, "models": models,
                       "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
                       "quantiles": list(QUANTILES), "tail": TAIL, "signals": qs.SIGNALS},
              "cells": [public(r) for r in rows], "correlations": corr, "decision": decision}
    result["pairwise"] = pairwise(result["cells"], args.resamples)
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(args.out_dir, "results.md"), "w") as f:
        f.write(markdown(result))
    log(f"decision: best {decision['best']}, ship {decision['ship']}; total {seconds:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
