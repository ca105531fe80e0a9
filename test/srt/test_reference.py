"""sglang_oea.reference against an independent brute force, plus the invariants OEA promises."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from oea_brute_force import brute_force_oea, brute_force_weights
from sglang_oea.reference import (
    MIX1,
    MIX2,
    ROW_SHIFT,
    distinct_experts,
    ids_checksum,
    opportunistic_route,
    opportunistic_slots,
    opportunistic_topk,
    opportunistic_weights,
    rank_routed_columns,
)


def make_case(rng: random.Random, num_rows: int, num_experts: int, k: int, ties: bool):
    """Scores (with many ties when asked), the router's top-k in shuffled column order."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    if ties:
        scores = torch.randint(0, 4, (num_rows, num_experts), generator=gen).float() / 4
    else:
        scores = torch.randn(num_rows, num_experts, generator=gen)
    topk = torch.topk(scores, k, dim=1).indices
    shuffle = torch.argsort(torch.rand(num_rows, k, generator=gen), dim=1)
    return scores, topk.gather(1, shuffle).to(torch.int32)


def check_against_brute_force(scores, topk, k0, num_valid):
    ids, active = opportunistic_slots(scores, topk, k0, num_valid)
    want_ids, want_active = brute_force_oea(scores.tolist(), topk.tolist(), k0, num_valid)
    assert ids.tolist() == want_ids
    assert active.tolist() == want_active


def test_random_cases_match_brute_force():
    rng = random.Random(0)
    for _ in range(2500):
        num_experts = rng.choice([8, 16, 64, 128, 160, 256, 512])
        k = rng.randint(1, min(16, num_experts))
        num_rows = rng.choice([1, 2, 3, 5, 8, 13, 32])
        k0 = rng.randint(1, k)
        num_valid = rng.choice([None, rng.randint(0, num_rows)])
        scores, topk = make_case(rng, num_rows, num_experts, k, ties=rng.random() < 0.5)
        check_against_brute_force(scores, topk, k0, num_valid)


@pytest.mark.parametrize("num_rows", [64, 257, 512])
@pytest.mark.parametrize("num_experts", [128, 512])
def test_large_batches_match_brute_force(num_rows, num_experts):
    rng = random.Random(num_rows * num_experts)
    scores, topk = make_case(rng, num_rows, num_experts, 8, ties=True)
    check_against_brute_force(scores, topk, 3, num_rows - 5)


def test_short_rows_with_minus_inf_scores_match_brute_force():
    """Rows that cannot fill from U (small batch, or -inf blocking candidates) run short."""
    rng = random.Random(7)
    for _ in range(400):
        num_experts, k = rng.choice([(16, 8), (64, 6), (128, 8)])
        num_rows = rng.randint(1, 4)
        scores, topk = make_case(rng, num_rows, num_experts, k, ties=False)
        blocked = torch.rand(num_rows, num_experts) < 0.5
        blocked.scatter_(1, topk.long(), False)  # the router's own picks stay finite
        scores = scores.masked_fill(blocked, float("-inf"))
        check_against_brute_force(scores, topk, rng.randint(1, k - 1), None)


@settings(max_examples=300, deadline=None)
@given(
    num_rows=st.integers(1, 24),
    num_experts=st.integers(2, 64),
    k_frac=st.floats(0.01, 1.0),
    k0_frac=st.floats(0.0, 1.0),
    valid_frac=st.floats(0.0, 1.0),
    seed=st.integers(0, 1 << 20),
    ties=st.booleans(),
)
def test_hypothesis_matches_brute_force(num_rows, num_experts, k_frac, k0_frac, valid_frac, seed, ties):
    k = max(1, min(num_experts, round(k_frac * 16)))
    k0 = max(1, round(k0_frac * k))
    scores, topk = make_case(random.Random(seed), num_rows, num_experts, k, ties)
    check_against_brute_force(scores, topk, k0, round(valid_frac * num_rows))


def test_weights_match_brute_force():
    rng = random.Random(3)
    for _ in range(300):
        scores, topk = make_case(rng, rng.randint(1, 12), 64, 8, ties=rng.random() < 0.5)
        probs = torch.softmax(torch.randn_like(scores), dim=1)
        ids, active = opportunistic_slots(scores, topk, rng.randint(1, 7))
        row_sums = torch.rand(scores.shape[0]) + 0.5
        got = opportunistic_weights(probs, ids, active, row_sums)
        want = brute_force_weights(probs.tolist(), ids.tolist(), active.tolist(), row_sums.tolist())
        torch.testing.assert_close(got, torch.tensor(want), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("k0", [8, 9, 20])
def test_k0_at_least_k_returns_router_selection_sorted(k0):
    scores, topk = make_case(random.Random(1), 9, 64, 8, ties=True)
    ids = opportunistic_topk(scores, topk, k0)
    assert ids.tolist() == rank_routed_columns(scores, topk).tolist()
    assert sorted(map(sorted, ids.tolist())) == sorted(map(sorted, topk.tolist()))
    ranked_scores = scores.gather(1, ids)
    assert bool((ranked_scores[:, :-1] >= ranked_scores[:, 1:]).all())


def test_ranking_ignores_column_order_and_breaks_ties_by_lower_id():
    scores = torch.tensor([[0.5, 0.5, 0.9, 0.5, 0.1, 0.5]])
    for order in ([0, 1, 2, 3], [3, 2, 1, 0], [2, 3, 0, 1]):
        assert rank_routed_columns(scores, torch.tensor([order])).tolist() == [[2, 0, 1, 3]]


@pytest.mark.parametrize("k0", [1, 3, 5, 7])
def test_single_row_is_top_k0_pruning(k0):
    scores, topk = make_case(random.Random(k0), 1, 128, 8, ties=False)
    ids, active = opportunistic_slots(scores, topk, k0)
    assert ids[0, :k0].tolist() == torch.topk(scores[0], k0).indices.tolist()
    assert active[0].tolist() == [True] * k0 + [False] * (8 - k0)
    weights = opportunistic_weights(scores.softmax(1), ids, active, torch.ones(1))
    assert bool((weights[0, k0:] == 0).all())


@pytest.mark.parametrize("num_rows,k0", [(2, 3), (16, 3), (16, 5), (64, 4), (300, 2)])
def test_batch_invariants(num_rows, k0):
    num_experts, k = 128, 8
    scores, topk = make_case(random.Random(num_rows), num_rows, num_experts, k, ties=True)
    ids, active = opportunistic_slots(scores, topk, k0)
    base = rank_routed_columns(scores, topk)[:, :k0]
    union = set(base.flatten().tolist())
    carrying = set(ids[active].tolist())
    assert carrying == union, "experts that carry weight are exactly U"
    assert distinct_experts(ids, num_experts).item() == max(len(union), k), "the batch loads max(|U|, k)"
    assert int(ids.min()) >= 0 and int(ids.max()) < num_experts
    assert all(len(set(row)) == k for row in ids.tolist()), "no duplicate id in a row"
    assert distinct_experts(ids[:, :k0], num_experts).item() <= distinct_experts(topk, num_experts).item()


def test_padded_rows_add_nothing_to_union_and_point_into_it():
    scores, topk = make_case(random.Random(5), 16, 128, 8, ties=False)
    ids, active = opportunistic_slots(scores, topk, 3, num_valid_rows=9)
    real_union = set(ids[:9][active[:9]].tolist())
    assert not bool(active[9:].any())
    assert set(ids[9:].flatten().tolist()) <= real_union
    alone, _ = opportunistic_slots(scores[:9], topk[:9], 3)
    assert ids[:9].tolist() == alone.tolist(), "padding never changes the real rows"


def test_num_valid_rows_as_device_scalar_equals_int():
    scores, topk = make_case(random.Random(11), 16, 64, 8, ties=True)
    as_int = opportunistic_slots(scores, topk, 4, 7)
    as_tensor = opportunistic_slots(scores, topk, 4, torch.tensor(7, dtype=torch.int32))
    assert as_int[0].tolist() == as_tensor[0].tolist() and as_int[1].tolist() == as_tensor[1].tolist()


def test_route_keeps_router_row_sums_and_gates_bit_identically():
    scores, topk = make_case(random.Random(2), 12, 64, 8, ties=False)
    probs = scores.softmax(1)
    weights = probs.gather(1, topk.long()) * 2.5  # e.g. routed_scaling_factor applied in routing
    ids, new_weights = opportunistic_route(probs, probs, topk, weights, 3, min_batch=4)
    assert bool((new_weights >= 0).all()) and bool(new_weights.isfinite().all())
    torch.testing.assert_close(new_weights.sum(1), weights.sum(1), rtol=1e-5, atol=1e-5)
    for rows, min_batch, max_batch in [(3, 4, 0), (12, 1, 8), (12, 13, 0)]:
        gated_ids, gated_w = opportunistic_route(probs, probs, topk, weights, 3, rows, min_batch, max_batch)
        assert torch.equal(gated_ids, topk.long()) and torch.equal(gated_w, weights)


# ----------------------------------------------------------------------------- rank-check checksum

MASK64 = (1 << 64) - 1


def python_checksum(ids, rows=None):
    """ids_checksum with Python integers mod 2^64, element by element, over the first `rows` rows."""
    total = 0
    for r, row in enumerate(ids.tolist()[:rows]):
        for expert in row:
            h = (expert + (r << ROW_SHIFT) + 1) * MIX1 & MASK64
            h = h - (1 << 64) if h >> 63 else h  # >> acts on the signed value
            h = (h ^ (h >> 31)) * MIX2 & MASK64
            total = (total + h) & MASK64
    return total - (1 << 64) if total >> 63 else total


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_ids_checksum_matches_the_integer_definition_over_every_row(dtype):
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 512, (int(torch.randint(1, 40, (1,), generator=gen)), 8), generator=gen, dtype=dtype)
        got = ids_checksum(ids)
        assert got.dtype == torch.int64 and got.dim() == 0
        assert int(got) == python_checksum(ids)


def test_ids_checksum_leaves_out_rows_past_the_count_with_any_row_count_kind():
    ids = torch.randint(0, 1 << 15, (13, 6), generator=torch.Generator().manual_seed(1)).int()
    for rows in (0, 1, 7, 13, 20):
        want = python_checksum(ids, rows)
        assert int(ids_checksum(ids, rows)) == want
        assert int(ids_checksum(ids[:rows])) == want
        for as_tensor in (torch.tensor(rows, dtype=torch.int32), torch.tensor([rows], dtype=torch.int32),
                          torch.tensor([rows], dtype=torch.int64)):
            assert int(ids_checksum(ids, as_tensor)) == want, (rows, as_tensor)
    assert int(ids_checksum(ids, 0)) == 0 and int(ids_checksum(ids[:0])) == 0


def test_ids_checksum_ignores_column_order_and_sees_a_changed_id():
    ids = torch.randint(0, 256, (9, 8), generator=torch.Generator().manual_seed(2))
    base = int(ids_checksum(ids, 6))
    assert int(ids_checksum(ids[:, torch.randperm(8)], 6)) == base
    changed = ids.clone()
    changed[5, 3] += 1
    assert int(ids_checksum(changed, 6)) != base
    changed[5, 3] -= 1
    changed[7, 0] += 1  # a padded row: not part of the digest
    assert int(ids_checksum(changed, 6)) == base


class HostReads(TorchDispatchMode):
    """Fails on aten ops that read a tensor's values on the host."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        assert name not in {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal"}, f"host read: {func}"
        return func(*args, **(kwargs or {}))


def test_ids_checksum_reads_a_device_row_count_without_a_host_sync():
    ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(3)).int()
    with HostReads():
        got = ids_checksum(ids, torch.tensor([11], dtype=torch.int32))
    assert int(got) == python_checksum(ids, 11)
