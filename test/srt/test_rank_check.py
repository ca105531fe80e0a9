"""The rank-divergence guard (--oea-check-ranks): its checksum, and two real gloo processes that
route a batch through OEARuntime and compare, as tensor-parallel ranks do after a decode step."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from oea_fixtures import NUM_EXPERTS, TOP_K, router_inputs, topk_config
from sglang_oea.config import OEAConfig
from sglang_oea.rank_check import RankCheck, RankDivergenceError, mismatched_layers
from sglang_oea.reference import ids_checksum
from sglang_oea.runtime import DECODE, OEARuntime


def test_checksum_ignores_column_order_and_sees_every_change():
    _, ids, _ = router_inputs(16, seed=2)
    base = int(ids_checksum(ids))
    assert int(ids_checksum(ids[:, torch.randperm(TOP_K)])) == base  # a rank's kernel and torch path may order columns differently
    assert int(ids_checksum(ids.long())) == base
    for row in range(16):
        for col in range(TOP_K):
            changed = ids.clone()
            changed[row, col] = (changed[row, col] + 1) % NUM_EXPERTS
            assert int(ids_checksum(changed)) != base
    swapped = ids[[1, 0, *range(2, 16)]]  # two rows trade their experts: same multiset of ids
    assert int(ids_checksum(swapped)) != base


def test_mismatched_layers_names_each_layer_that_differs():
    gathered = torch.tensor([[5, 6, 7, 0], [5, 9, 7, 1]])
    assert mismatched_layers(gathered) == [1, 3]
    assert mismatched_layers(gathered[:1].repeat(3, 1)) == []


def test_check_is_due_every_n_steps_and_only_with_other_ranks():
    assert [s for s in range(1, 13) if RankCheck(4, None, 2).due(s)] == [4, 8, 12]


def test_runtime_keeps_checksums_only_when_there_are_ranks_to_compare():
    assert not OEARuntime(OEAConfig(k0=2, check_ranks=1), world_size=1).checksums
    assert not OEARuntime(OEAConfig(k0=2), world_size=2).checksums
    assert OEARuntime(OEAConfig(k0=2, check_ranks=5), world_size=2).checksums


def one_ulp_flip(logits):
    """Row 0's second-best expert raised one ulp above its best: the router's top-k set is unchanged,
    but the row's best expert, and so OEA's union, is not."""
    top2 = logits[0].topk(2).indices
    logits[0, top2[1]] = torch.nextafter(logits[0, top2[0]], torch.tensor(float("inf")))
    return logits


def route_as_rank(rank, flip, extra_steps=0):
    """(OEA ids [B, K], runtime) for the batch rank `rank` sees; rank 1 sees the flip if asked.
    The batch is routed twice, plus extra_steps times: the check reads the second-newest snapshot."""
    logits, _, _ = router_inputs(8, seed=3)
    if flip and rank == 1:
        logits = one_ulp_flip(logits)
    weights, ids = torch.topk(logits.softmax(1), TOP_K, sorted=False)
    runtime = OEARuntime(OEAConfig(k0=1, min_batch=1, check_ranks=1, kernel="torch", stats=False),
                         rank=rank, world_size=2)
    for _ in range(2 + extra_steps):
        runtime.begin_step(DECODE, 8)
        routed = runtime.route(ids.int(), weights, topk_config(), logits, layer_id=5)
        runtime.end_step()
    return routed[0], runtime


def rank_process(rank, init_file, flip, out_dir, skew=False):
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        ids, runtime = route_as_rank(rank, flip, extra_steps=int(skew and rank == 1))
        check = RankCheck(1, None, 2)
        try:
            check.check(runtime.read_snapshot(), 7)
            outcome = "agree"
        except RankDivergenceError as exc:
            outcome = str(exc)
        torch.save({"ids": ids, "outcome": outcome, "checks": check.checks}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def run_two_ranks(tmp_path, flip, skew=False):
    mp.spawn(rank_process, args=(str(tmp_path / "init"), flip, str(tmp_path), skew), nprocs=2, join=True)
    return [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]


def test_two_ranks_that_route_alike_pass(tmp_path):
    zero, one = run_two_ranks(tmp_path, flip=False)
    assert torch.equal(zero["ids"], one["ids"])
    assert zero["outcome"] == one["outcome"] == "agree" and zero["checks"] == one["checks"] == 1


def test_one_ulp_on_one_rank_is_caught_on_every_rank(tmp_path):
    # The premise: plain top-k routing is the same on both ranks, OEA's is not.
    logits, _, _ = router_inputs(8, seed=3)
    assert torch.equal(logits.topk(TOP_K).indices.sort().values, one_ulp_flip(logits.clone()).topk(TOP_K).indices.sort().values)
    zero, one = run_two_ranks(tmp_path, flip=True)
    assert not torch.equal(zero["ids"].sort().values, one["ids"].sort().values)
    for result in (zero, one):
        assert result["checks"] == 0
        assert "ranks routed different experts (decode step 7; layer 5: rank 0=" in result["outcome"]
        assert "restart without --oea-k0" in result["outcome"]


def test_ranks_that_ran_different_numbers_of_passes_are_stopped(tmp_path):
    zero, one = run_two_ranks(tmp_path, flip=False, skew=True)
    for result in (zero, one):
        assert result["checks"] == 0
        assert "compared checksums of different routed steps (decode step 7; rank 0=1, rank 1=2)" in result["outcome"]
