"""The held-out windows every trained-model study draws from (training/heldout.py), and the statistics
of studies/router_stats.py on recordings built here (known routing in, known T and popularity out)."""

import os

import pytest
import torch

from training import heldout
from studies import router_stats, simulate
from training import train_moe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
MODEL = os.path.join(ROOT, "benchmark", "oea", "models", "qwen3_moe_stdlib")


def test_heldout_windows_are_seeded_distinct_pieces_of_the_heldout_stream():
    stream = heldout.heldout_stream(MODEL)
    blocks = train_moe.pack_blocks(stream, 40)
    windows = heldout.heldout_windows(MODEL, 6, 40, seed=3)
    assert windows.shape == (6, 40)
    assert torch.equal(windows, heldout.heldout_windows(MODEL, 6, 40, seed=3))
    assert not torch.equal(windows, heldout.heldout_windows(MODEL, 6, 40, seed=4))
    index = {tuple(row.tolist()): i for i, row in enumerate(blocks)}
    assert len({index[tuple(row.tolist())] for row in windows}) == 6  # whole, distinct blocks
    pairs = heldout.prompt_continuations(MODEL, 6, 30, 10, seed=3)
    assert [p["prompt_ids"] + p["continuation_ids"] for p in pairs] == windows.tolist()
    with pytest.raises(ValueError, match="fewer than the"):
        heldout.heldout_windows(MODEL, blocks.shape[0] + 1, 40)


def recording(ids_per_step, num_experts, top_k):
    """Records as the dump writes them, with router logits that make `ids` the router's top-k."""
    records = []
    for ids in ids_per_step:
        ids = torch.tensor(ids)
        logits = torch.full((ids.shape[0], num_experts), -5.0).scatter(1, ids, 5.0)
        records.append({"router_logits": logits, "router_ids": ids, "top_k": top_k, "scoring_func": "softmax"})
    return records


def test_t_against_b_counts_distinct_router_experts_of_drawn_rows():
    # Every row of a step routes to experts {0, 1}, except that row i also takes expert 2 + i.
    rows = [[0, 1, 2 + i] for i in range(4)]
    got = router_stats.t_against_b(recording([rows, rows], 16, 3), [1, 2, 4, 8], k0s=[1], draws=5, seed=0)
    assert got[1]["T"] == 3 and got[2]["T"] == 4 and got[4]["T"] == 6
    assert 8 not in got, "no step holds 8 rows"
    assert got[4]["steps"] == 2 and got[4]["T_sd"] == 0
    # OEA at k0=1: each row keeps its best expert; the logits tie at 5.0, so the lowest id, 0, wins.
    assert got[4]["T_oea"][1] == 1


def test_popularity_of_skewed_and_even_choices():
    skewed = router_stats.popularity(recording([[[0, 1], [0, 2], [0, 3], [0, 1]]], 8, 2), 8)
    assert skewed["choices"] == 8 and skewed["unused_experts"] == 4
    assert skewed["max_over_mean"] == pytest.approx(0.5 * 8)
    even = router_stats.popularity(recording([[[0, 1], [2, 3], [4, 5], [6, 7]]], 8, 2), 8)
    assert even["max_over_mean"] == pytest.approx(1) and even["effective_experts"] == pytest.approx(8)
    # Shared-expert columns (id >= N) are not routed choices.
    fused = [{"router_ids": torch.tensor([[0, 8], [1, 8]])}]
    assert router_stats.popularity(fused, 8)["choices"] == 2


def test_uniform_expectation_is_the_closed_form():
    assert simulate.expected_t_vanilla(128, 8, 16) == pytest.approx(128 * (1 - (1 - 8 / 128) ** 16))
