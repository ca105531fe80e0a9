"""The benchmarks' confidence intervals, on scipy and numpy, plus the little they do not cover.

    bootstrap_mean_ci   95% percentile bootstrap of a mean (scipy.stats.bootstrap, seeded)
    cluster_mean_ci     the same over whole clusters (static batches): the bootstrap of the cluster means
    wilson_ci           Wilson interval of a proportion (scipy.stats.binomtest(...).proportion_ci)
    mcnemar_exact_p     exact McNemar test of two paired outcomes (scipy.stats.binomtest, p = 1/2)
    normal_mean_ci      mean +- z sd / sqrt(n), sd with n - 1
    paired_mean_difference  B minus A of a per-item measure, paired by item: both intervals

What is ours is the edge cases the libraries refuse (no items, one item, one cluster) and the
cluster means. Every interval is seeded, so a report is reproducible from its inputs.
"""

from typing import Dict, Optional, Sequence, Tuple

import numpy as np
from scipy import stats

Z95 = float(stats.norm.ppf(0.975))  # two-sided 95% normal quantile, 1.95996...
Interval = Tuple[float, float]


def bootstrap_mean_ci(values: Sequence[float], resamples: int, seed: int = 0) -> Optional[Interval]:
    """95% percentile bootstrap interval of the mean of values [n]: the 2.5% and 97.5% percentiles of
    `resamples` means of n draws with replacement (scipy.stats.bootstrap, rng seeded). None for n < 2."""
    sample = np.asarray(values, dtype=np.float64)
    if sample.size < 2:
        return None
    got = stats.bootstrap((sample,), np.mean, n_resamples=resamples, method="percentile",
                          rng=np.random.default_rng(seed)).confidence_interval
    return float(got.low), float(got.high)


def cluster_mean_ci(values: Sequence[float], cluster_size: int, resamples: int, seed: int = 0) -> Interval:
    """95% cluster bootstrap interval of the mean of values [n]: entry i belongs to cluster
    i // cluster_size, and a resample draws whole clusters with replacement.

    With equal clusters the mean over all entries of the drawn clusters is the mean of their means,
    so this is bootstrap_mean_ci of the [n // cluster_size] cluster means. Paired when values are
    per-entry differences of two arms: both arms get the same drawn clusters. One cluster: the
    interval is the point (there is nothing to resample).
    """
    sample = np.asarray(values, dtype=np.float64)
    assert sample.size % cluster_size == 0, f"{sample.size=} {cluster_size=}"
    means = sample.reshape(-1, cluster_size).mean(axis=1)  # [clusters]
    if means.size == 1:
        return float(means[0]), float(means[0])
    return bootstrap_mean_ci(means, resamples, seed)


def wilson_ci(successes: int, n: int) -> Optional[Interval]:
    """Wilson score 95% interval of a binomial proportion, exact 0 and 1 at the ends; None when n == 0."""
    if n == 0:
        return None
    got = stats.binomtest(successes, n).proportion_ci(confidence_level=0.95, method="wilson")
    return float(got.low), float(got.high)


def mcnemar_exact_p(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value of discordant counts b and c: binomial(b + c, 1/2); 1 when none."""
    if b + c == 0:
        return 1.0
    return float(stats.binomtest(min(b, c), b + c, 0.5).pvalue)


def normal_mean_ci(values: Sequence[float], z: float = Z95) -> Tuple[Optional[float], Optional[Interval]]:
    """(mean, mean +- z * sd / sqrt(n)) of values [n], sd with n - 1; (None, None) when empty, the
    interval None for n < 2."""
    sample = np.asarray(values, dtype=np.float64)
    if sample.size == 0:
        return None, None
    mean = float(sample.mean())
    if sample.size < 2:
        return mean, None
    half = z * float(sample.std(ddof=1)) / float(np.sqrt(sample.size))
    return mean, (mean - half, mean + half)


def paired_mean_difference(base: Sequence[float], oea: Sequence[float], resamples: int, seed: int = 0) -> Dict:
    """OEA minus baseline of a per-item measure: [n] floats each arm, paired by item.

    d_i = oea_i - base_i; returns {"n", "baseline", "oea" (arm means), "mean" (mean d), "ci95"
    (bootstrap_mean_ci of d), "ci95_normal" (normal_mean_ci of d), "method"}.
    """
    assert len(base) == len(oea), f"{len(base)=} {len(oea)=}"
    diffs = [o - b for b, o in zip(base, oea)]
    mean, normal = normal_mean_ci(diffs)
    return {"n": len(diffs), "baseline": normal_mean_ci(base)[0], "oea": normal_mean_ci(oea)[0], "mean": mean,
            "ci95": bootstrap_mean_ci(diffs, resamples, seed), "ci95_normal": normal,
            "method": f"paired over prompts; ci95: percentile bootstrap of the mean difference ({resamples} "
                      f"resamples, seed {seed}); ci95_normal: mean +- 1.96 sd/sqrt(n), sd with n-1"}
