r"""How much of the live signal's ranking do the settings alone explain? A re-analysis of a finished
signal study (signal_study.py's results.json): no model runs, a few seconds on a CPU.

For every cell (model, k0, B) the study kept per-block means of each signal and of the NLL increase.
Here three predictors of the NLL increase are ranked against it with the study's own block bootstrap
(quality_signals.rank_correlation, oriented so that +1 ranks the cells exactly as their cost):
- the mean kept router mass (`mass_kept`), the series the server exports;
- the active-experts ratio (T after OEA / T of plain routing), which the server also exports;
- `k0 + 0.5 * log2(B)`: the settings and the batch size alone, with a weight chosen by hand, not
  fitted (a larger base and a larger batch both keep more of a token's routing).
Per model, for each pair of models pooled, and all three pooled.

Usage:
    .venv/bin/python benchmark/oea/studies/signal_baselines.py \
        benchmark/oea/results/cpu-2026-12-03-signal-study/results.json --out baselines.md
"""

import argparse
import json
import math
import os
import sys
from typing import Dict, List, Optional, Sequence

import numpy as np

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmark/oea
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

from studies import quality_signals as qs  # noqa: E402
from studies.signal_study import T_RATIO, fmt_rho  # noqa: E402

SETTINGS = "k0 + 0.5 log2(B)"
PREDICTORS = ("mass_kept", T_RATIO, SETTINGS)  # each KEPT-like: higher predicts less cost
LABELS = {"mass_kept": "kept router mass (mean, exported)", T_RATIO: "active-experts ratio (exported)",
          SETTINGS: "`k0 + 0.5 log2(B)` (settings only, unfitted)"}
SHORT = {"qwen3_moe_stdlib": "Qwen-style", "glm4_moe_stdlib": "GLM-style", "deepseek_v3_stdlib": "DeepSeek-V3"}


def settings_score(cell: Dict) -> float:
    """The settings-only predictor of one cell."""
    return cell["k0"] + 0.5 * math.log2(cell["batch"])


def stratum(cells: Sequence[Dict], predictor: str) -> qs.Stratum:
    """One model's cells as a bootstrap stratum of `predictor` against the NLL increase; the
    settings-only predictor is the same in every block of a cell."""
    cost = np.array([c["block_nll"] for c in cells])
    if predictor == SETTINGS:
        signal = np.array([[settings_score(c)] * len(c["block_nll"]) for c in cells])
    else:
        signal = np.array([c["block_mean"][predictor] for c in cells])
    return qs.Stratum(signal, cost)


def groups(models: Sequence[str]) -> List[Sequence[str]]:
    """Each model alone, each pair, then all together."""
    pairs = [(a, b) for i, a in enumerate(models) for b in models[i + 1:]]
    return [(m,) for m in models] + pairs + [tuple(models)]


def correlations(cells: Sequence[Dict], resamples: int) -> Dict[str, Dict[str, Dict]]:
    """{predictor: {"model[+model...]": oriented rank_correlation}}."""
    models = list(dict.fromkeys(c["model"] for c in cells))
    out = {}
    for predictor in PREDICTORS:
        strata = {m: stratum([c for c in cells if c["model"] == m], predictor) for m in models}
        out[predictor] = {"+".join(g): qs.oriented(qs.rank_correlation([strata[m] for m in g], resamples), qs.KEPT)
                          for g in groups(models)}
    return out


def markdown(result: Dict[str, Dict[str, Dict]], source: str) -> str:
    keys = list(next(iter(result.values())))
    heads = [" + ".join(SHORT.get(m, m) for m in key.split("+")) for key in keys]
    lines = ["# Rank correlation with the NLL increase: the signal against the settings alone", "",
             f"Re-analysis of `{source}` (signal_baselines.py). Spearman over the cells of each model, each "
             "pair of models and all three, oriented (+1: ranks the cells exactly as the NLL increase), with "
             "95% block-bootstrap intervals.", "",
             "| predictor | " + " | ".join(heads) + " |", "|---|" + "---|" * len(keys)]
    for predictor, per in result.items():
        lines.append(f"| {LABELS[predictor]} | " + " | ".join(fmt_rho(per[k]) for k in keys) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", help="a signal study's results.json")
    p.add_argument("--out", help="write the table here too")
    p.add_argument("--resamples", type=int, default=2000)
    args = p.parse_args(argv)
    with open(args.results) as f:
        cells = json.load(f)["cells"]
    text = markdown(correlations(cells, args.resamples), os.path.relpath(args.results))
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
