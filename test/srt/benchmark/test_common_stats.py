"""benchmark/oea/common/stats.py: its intervals pinned to scipy's where both apply, the edge cases
the libraries refuse (no item, one item, one cluster), and what the batch-cluster bootstrap
resamples (whole static batches, as the frontier study needs)."""

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from common import stats

RESAMPLES = 4000  # the quality A/B's
REPS = 2000  # the frontier's


def library_bootstrap(values, resamples, seed=0):
    """scipy's 95% percentile bootstrap of the mean, as (low, high)."""
    got = scipy_stats.bootstrap((np.asarray(values, dtype=np.float64),), np.mean, n_resamples=resamples,
                                method="percentile", rng=np.random.default_rng(seed)).confidence_interval
    return got.low, got.high


def width(interval):
    return interval[1] - interval[0]


# ---- proportions and paired outcomes ----

def test_wilson_interval_known_values():
    assert stats.wilson_ci(8, 10) == pytest.approx((0.4902, 0.9433), abs=1e-4)
    assert stats.wilson_ci(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert stats.wilson_ci(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    assert stats.wilson_ci(0, 0) is None
    assert stats.wilson_ci(0, 24)[0] == 0.0 and stats.wilson_ci(24, 24)[1] == 1.0  # exact ends


@pytest.mark.parametrize("k,n", [(0, 1), (1, 1), (3, 7), (8, 10), (0, 24), (24, 24), (57, 200)])
def test_wilson_is_binomtests(k, n):
    want = scipy_stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    assert stats.wilson_ci(k, n) == (want.low, want.high)


def test_mcnemar_exact_p():
    assert stats.mcnemar_exact_p(0, 5) == pytest.approx(2 / 32)
    assert stats.mcnemar_exact_p(2, 8) == pytest.approx(2 * (1 + 10 + 45) / 1024)
    assert stats.mcnemar_exact_p(0, 0) == 1.0
    assert stats.mcnemar_exact_p(3, 3) == 1.0
    for b, c in ((1, 6), (7, 2), (10, 20)):  # the exact binomial test of the discordant pairs
        assert stats.mcnemar_exact_p(b, c) == scipy_stats.binomtest(min(b, c), b + c, 0.5).pvalue


# ---- means ----

def test_normal_and_bootstrap_intervals():
    assert stats.normal_mean_ci([]) == (None, None) and stats.normal_mean_ci([2.0]) == (2.0, None)
    mean, ci = stats.normal_mean_ci([1.0, 2.0, 3.0])  # sd 1
    assert mean == 2.0 and ci == pytest.approx((2 - stats.Z95 / 3 ** 0.5, 2 + stats.Z95 / 3 ** 0.5))
    # Means of two draws from {0, 1}: 0, 0.5, 1 with chances 1/4, 1/2, 1/4; both tails hold > 2.5%.
    assert stats.bootstrap_mean_ci([0.0, 1.0], RESAMPLES) == (0.0, 1.0)
    assert stats.bootstrap_mean_ci([0.25] * 5, RESAMPLES) == pytest.approx((0.25, 0.25))
    assert stats.bootstrap_mean_ci([1.0], RESAMPLES) is None
    values = [((i * 37) % 101) / 100 for i in range(400)]  # spread over [0, 1]
    low, high = stats.bootstrap_mean_ci(values, RESAMPLES, seed=3)
    assert stats.bootstrap_mean_ci(values, RESAMPLES, seed=3) == (low, high)  # seeded
    normal = stats.normal_mean_ci(values)[1]
    assert low == pytest.approx(normal[0], abs=0.01) and high == pytest.approx(normal[1], abs=0.01)


def test_bootstrap_is_scipys_percentile_bootstrap():
    values = torch.randn(37, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert stats.bootstrap_mean_ci(values, 500, seed=7) == library_bootstrap(values, 500, seed=7)
    assert stats.Z95 == pytest.approx(1.959963984540054, abs=1e-15)


def test_paired_mean_difference():
    diff = stats.paired_mean_difference([0.5, 0.25, 1.0], [0.75, 0.5, 1.25], RESAMPLES)  # d = 0.25 everywhere
    assert (diff["n"], diff["mean"]) == (3, pytest.approx(0.25))
    assert (diff["baseline"], diff["oea"]) == (pytest.approx(7 / 12), pytest.approx(10 / 12))
    assert diff["ci95"] == pytest.approx((0.25, 0.25)) and diff["ci95_normal"] == pytest.approx((0.25, 0.25))
    empty = stats.paired_mean_difference([], [], RESAMPLES)
    assert empty["mean"] is None and empty["ci95"] is None
    base, oea = [0.1, 0.9, 0.4, 0.7], [0.3, 0.8, 0.9, 0.7]
    got = stats.paired_mean_difference(base, oea, 500, seed=2)["ci95"]
    assert got == library_bootstrap([o - b for b, o in zip(base, oea)], 500, seed=2)  # over the differences


# ---- batch-cluster bootstrap ----

def test_cluster_interval_resamples_whole_batches():
    """The interval is that of the mean over all sequences of batches drawn with replacement: with
    equal batches, scipy's percentile bootstrap of the batch means."""
    values = torch.randn(24, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    expect = library_bootstrap(values.view(4, 6).mean(dim=1), 500)  # 4 batches of 6
    assert stats.cluster_mean_ci(values, 6, 500) == pytest.approx(expect)
    assert stats.cluster_mean_ci(values, 1, REPS) == stats.bootstrap_mean_ci(values, REPS)  # batches of 1
    assert stats.cluster_mean_ci([0.5, 0.25], 2, REPS) == (0.375, 0.375)  # one batch: the point


def test_cluster_interval_of_identical_copies_is_that_of_the_batch_means():
    means = torch.tensor([0.1, 0.5, -0.2, 0.3, 0.9, 0.0, 0.4, -0.1, 0.2, 0.6], dtype=torch.float64)
    copies = means.repeat_interleave(8)
    assert stats.cluster_mean_ci(copies, 8, REPS) == pytest.approx(stats.bootstrap_mean_ci(means, REPS))
    # Taken as 80 independent sequences, the same values give an interval about sqrt(8) narrower.
    assert width(stats.bootstrap_mean_ci(copies, REPS)) < 0.5 * width(stats.cluster_mean_ci(copies, 8, REPS))


def test_within_batch_correlation_widens_the_cluster_interval_only():
    gen = torch.Generator().manual_seed(5)
    shared = torch.randn(16, 1, generator=gen, dtype=torch.float64)  # what a batch's routing shares
    correlated = (shared + 0.2 * torch.randn(16, 16, generator=gen, dtype=torch.float64)).reshape(-1)
    assert width(stats.cluster_mean_ci(correlated, 16, REPS)) > 2 * width(stats.bootstrap_mean_ci(correlated, REPS))
    independent = torch.randn(256, generator=gen, dtype=torch.float64)
    ratio = width(stats.cluster_mean_ci(independent, 16, REPS)) / width(stats.bootstrap_mean_ci(independent, REPS))
    assert 0.6 < ratio < 1.6
