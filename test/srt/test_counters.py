"""The counter snapshot protocol (sglang_oea.counters): what the rank check and the metrics read.

Two CUDA streams cannot be shown on a CPU, so these tests model the ordering the overlap scheduler
creates: when the host reads, the newest routed pass has been launched and may still be adding
into the live table on the device (modelled by adding part of a pass into the table by hand).
The reader must return a completed step, the same one on every rank, and lose nothing between
reads. benchmark/oea/gpu/gpu_check.py runs the same protocol with two real streams.
"""

import torch

from oea_fixtures import router_inputs, topk_config
from sglang_oea.config import OEAConfig
from sglang_oea.counters import AFTER, BEFORE, CHECKSUM, STEPS, LayerCounters, SnapshotRing, stats_between
from sglang_oea.runtime import DECODE, OEARuntime

LAYERS = (0, 1, 2)
CONFIG = topk_config()


def routed_pass(rt: OEARuntime, seed: int, rows: int = 8, layers=LAYERS) -> None:
    """One decode pass through `layers` MoE layers, as the forward-context and routing hooks drive it."""
    rt.begin_step(DECODE, rows)
    for layer in layers:
        logits, ids, weights = router_inputs(rows, seed=seed * 10 + layer)
        rt.route(ids, weights, CONFIG, logits, layer_id=layer)
    rt.end_step()


def runtime(check_ranks: int = 1) -> OEARuntime:
    return OEARuntime(OEAConfig(k0=2, min_batch=1, kernel="torch", check_ranks=check_ranks), world_size=2)


def test_no_snapshot_is_read_before_a_completed_pass_can_be_told_from_one_in_flight():
    rt = runtime()
    assert rt.read_snapshot() is None
    routed_pass(rt, 1)
    assert rt.read_snapshot() is None, "the only snapshot may belong to the pass still running"
    routed_pass(rt, 2)
    assert rt.read_snapshot().step == 1


def test_reader_never_sees_the_pass_in_flight():
    rt = runtime()
    for seed in (1, 2, 3):
        routed_pass(rt, seed)
        if seed == 2:
            at_end_of_pass_2 = rt.counters.snapshot_now().table.clone()
    # Pass 3 was launched; on a GPU its layers may still be adding. Model a device that has run
    # one and a half of its three layers after the snapshot of pass 3 was enqueued.
    live = rt.counters.table
    live[0, STEPS:CHECKSUM] += torch.tensor([1, 40, 20])
    live[1, STEPS] += 1
    snapshot = rt.read_snapshot()
    assert snapshot.step == 2
    assert torch.equal(snapshot.table, at_end_of_pass_2)
    assert not torch.equal(rt.counters.snapshot_now().table, at_end_of_pass_2), "the live table is torn"


def test_every_rank_reads_the_same_step_whatever_its_device_did():
    # Two ranks with the same host sequence of passes; rank 1's device is further behind or ahead
    # (different partial adds). Both read the snapshot of the same routed step, with equal values.
    ranks = [runtime(), runtime()]
    for rt in ranks:
        for seed in (1, 2, 3, 4):
            routed_pass(rt, seed)
    ranks[0].counters.table[:, CHECKSUM] += 7
    ranks[1].counters.table[2, CHECKSUM] += 1
    zero, one = (rt.read_snapshot() for rt in ranks)
    assert zero.step == one.step == 3
    assert torch.equal(zero.checksums(), one.checksums())


def test_reports_lose_nothing_and_count_nothing_twice():
    rt = OEARuntime(OEAConfig(k0=2, min_batch=1, kernel="torch"))
    reported, previous = torch.zeros(len(LAYERS), 3, dtype=torch.float64), None
    for seed in range(1, 12):
        routed_pass(rt, seed)
        if seed % 3 == 0:  # a decode-log step
            snapshot = rt.read_snapshot()
            rows = stats_between(snapshot, previous)
            previous = snapshot
            reported[rows[:, 3].long()] += rows[:, :3]
    assert previous.step == 8  # the reads covered passes 1..8; 9..11 come with the next read
    final = rt.counters.snapshot_now()
    routed_pass(rt, 12)  # pass 11's snapshot is now the second-newest
    rows = stats_between(rt.read_snapshot(), previous)
    reported[rows[:, 3].long()] += rows[:, :3]
    assert torch.equal(reported, final.table[:, :CHECKSUM].double())
    assert reported[:, 0].tolist() == [11.0] * len(LAYERS)


def test_stats_between_reports_only_layers_that_routed():
    counters = LayerCounters(torch.device("cpu"))
    for layer in (0, 3):
        counters.note_layer(layer)
    counters.table[0, STEPS:CHECKSUM] = torch.tensor([2, 30, 12])
    older = counters.snapshot_now()
    counters.table[3, STEPS:CHECKSUM] += torch.tensor([1, 9, 4])
    rows = stats_between(counters.snapshot_now(), older)
    assert rows.tolist() == [[1.0, 9.0, 4.0, 3.0]]
    assert stats_between(counters.snapshot_now(), counters.snapshot_now()) is None


def test_ring_slots_are_copies_taken_at_the_end_of_a_pass():
    counters = LayerCounters(torch.device("cpu"))
    counters.note_layer(1)
    ring = SnapshotRing(counters)
    for step in (1, 2, 3):
        counters.table[1, BEFORE] += step
        ring.take(step)
    counters.table[1, AFTER] += 100  # after the newest snapshot: never read
    snapshot = ring.read()
    assert (snapshot.step, int(snapshot.table[1, BEFORE]), int(snapshot.table[1, AFTER])) == (2, 3, 0)


def test_skipped_and_warmup_passes_take_no_snapshot():
    rt = runtime()
    routed_pass(rt, 1)
    rt.begin_step(DECODE, 8, graph=True)  # a CUDA-graph warm-up or capture pass: no copy may be enqueued
    rt.end_step()
    rt.begin_step("other", 8)
    rt.end_step()
    assert rt.device.snapshots.taken == 1
