"""OEA on DP attention's gathered batch, in-process (no server): float32, CPU, torch router.

Covered here:
    sglang_oea.gathered      gathered_order against the host reference real_row_mask (eager slots of
                             any padded size, graph passes' equal slots, N = 0, one group);
    OEARuntime               a gathered batch routes as OEA over its real rows alone, whatever its
                             padding holds (NaN, huge logits), eager and through the graph path;
                             two ranks with different padding agree, rank-check checksum included;
                             a layout that does not fit is skipped as `gathered_layout`;
    passes / accounting      bucket_may_open and the capture key count one group's bucket;
    dp_attention             gathered_step from ForwardBatch stand-ins, after_pass's schedule.
The server test of DP attention is test_dp_attention.py.
"""

import logging
import random
import types

import pytest
import torch

from oea_fixtures import NUM_EXPERTS, TOP_K, topk_config
from sglang_oea import dp_attention, metrics
from sglang_oea.config import OEAConfig
from sglang_oea.counters import stats_between
from sglang_oea.gathered import gathered_order, real_row_mask, slot_starts
from sglang_oea.passes import StepInfo, bucket_may_open
from sglang_oea.reference import distinct_experts, ids_checksum, opportunistic_route
from sglang_oea.routing import RouterSpec, score_experts
from sglang_oea.runtime import DECODE, DRAFT, OTHER, SKIP_LAYOUT, VERIFY, OEARuntime

K0, GROUPS, LAYERS = 2, 2, (0, 3)
CONFIG = topk_config()


# ----------------------------------------------------------------------------- gathered_order


def expected_order(mask):
    """Real rows in buffer order, then the padding in buffer order (host reference)."""
    return [i for i, real in enumerate(mask) if real] + [i for i, real in enumerate(mask) if not real]


def assert_order(num_rows, real, padded, starts):
    order, inverse = gathered_order(num_rows, torch.tensor(real, dtype=torch.int32), starts)
    assert order.tolist() == expected_order(real_row_mask(num_rows, real, padded))
    identity = torch.arange(num_rows)
    assert torch.equal(order[inverse], identity) and torch.equal(inverse[order], identity)


def random_layouts(seed=0, count=60):
    rng = random.Random(seed)
    for _ in range(count):
        padded = [rng.randint(0, 5) for _ in range(rng.randint(1, 5))]
        yield [rng.randint(0, p) for p in padded], padded
    # An idle group with no slot at all, one whose whole slot is padding; no rows at all; one group.
    yield [2, 0, 0, 3], [3, 0, 4, 3]
    yield [0, 0], [0, 0]
    yield [3], [5]


def test_eager_order_puts_the_real_rows_of_every_slot_first():
    for real, padded in random_layouts():
        starts = torch.tensor(slot_starts(padded), dtype=torch.int32)
        assert_order(sum(padded), real, padded, starts)


def test_graph_order_uses_equal_slots():
    rng = random.Random(1)
    for groups, per_group in [(rng.randint(1, 5), rng.randint(0, 5)) for _ in range(60)] + [(2, 0), (1, 4)]:
        real = [rng.randint(0, per_group) for _ in range(groups)]
        assert_order(groups * per_group, real, [per_group] * groups, None)


# ----------------------------------------------------------------------------- routing a gathered batch


def dp_runtime(slots, rank=0, **settings):
    cfg = dict(k0=K0, min_batch=1, kernel="torch", stats=True)
    cfg.update(settings)
    world = 2 if cfg.get("check_ranks") else 1
    return OEARuntime(OEAConfig(**cfg), rank=rank, world_size=world, groups=GROUPS, slots=lambda: slots)


def gathered_inputs(real, padded, garbage, seed):
    """(logits, router ids, router weights, real-row mask) of a gathered buffer whose padding holds
    garbage: NaN (an idle group's unwritten rows), or logits huge enough that their experts would
    take over the union if the padding counted."""
    num_rows = sum(padded)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, NUM_EXPERTS, generator=gen)
    mask = torch.tensor(real_row_mask(num_rows, real, padded))
    pad = torch.randn(int((~mask).sum()), NUM_EXPERTS, generator=gen) * 1e30
    logits[~mask] = float("nan") if garbage == "nan" else pad
    weights, ids = torch.topk(logits.softmax(1), TOP_K, sorted=False)
    return logits, ids.int(), weights, mask


def oea_of_real_rows(logits, ids, weights, mask):
    """OEA's definition applied to the real rows alone, as one batch in buffer order."""
    selection, weight = score_experts(logits[mask], RouterSpec("softmax"))
    return opportunistic_route(selection, weight, ids[mask], weights[mask], K0)


def oea_of_buffer(logits, ids, weights, mask):
    """The reference over the buffer's rows reordered on the host (real rows first, then the
    padding, each in buffer order) with the real rows valid, put back in buffer order."""
    order = torch.tensor(expected_order(mask.tolist()))
    selection, weight = score_experts(logits[order], RouterSpec("softmax"))
    got = opportunistic_route(selection, weight, ids[order], weights[order], K0, int(mask.sum()))
    return tuple(torch.empty_like(t).index_copy_(0, order, t) for t in got)


def assert_gathered_routing(routed, inputs):
    """Real rows: OEA of the real rows alone. Padded rows: the reference's fills (the real rows'
    union first, as padded rows of a CUDA graph), at no weight, whatever their logits held."""
    logits, ids, weights, mask = inputs
    got_ids, got_weights = routed
    want_ids, want_weights = oea_of_real_rows(logits, ids, weights, mask)
    assert got_ids.dtype == ids.dtype and torch.equal(got_ids[mask].long(), want_ids)
    torch.testing.assert_close(got_weights[mask], want_weights)
    assert torch.equal(got_ids.long(), oea_of_buffer(logits, ids, weights, mask)[0])
    # NaN padding gives NaN weights on the torch path (NaN x 0), finite padding 0: weightless either way.
    assert bool((torch.nan_to_num(got_weights[~mask]) == 0).all())
    if not logits[~mask].isnan().any():
        assert bool((got_weights[~mask] == 0).all())


def eager_pass(rt, group_rows, inputs):
    """One eager gathered decode pass over the MoE layers: {layer: routed}."""
    total = sum(group_rows)
    rt.begin_step(DECODE, total, requests=total, groups=GROUPS, group_rows=group_rows)
    try:
        return {layer: rt.route(ids, w, CONFIG, logits, layer) for layer, (logits, ids, w, _) in inputs.items()}
    finally:
        rt.end_step()


LAYOUTS = [((3, 1), [4, 4]), ((3, 1), [3, 2]), ((0, 3), [2, 3])]  # MAX_LEN-like, SUM_LEN-like, one group idle


@pytest.mark.parametrize("garbage", ["nan", "huge"])
@pytest.mark.parametrize("group_rows, slots", LAYOUTS)
def test_eager_pass_routes_the_real_rows_alone(group_rows, slots, garbage):
    rt = dp_runtime(slots)
    inputs = {layer: gathered_inputs(group_rows, slots, garbage, seed=layer) for layer in LAYERS}
    out = eager_pass(rt, group_rows, inputs)
    for layer in LAYERS:
        assert_gathered_routing(out[layer], inputs[layer])
    assert rt.applied[DECODE] == 1
    # The expert statistics count the real rows only: padding never joins a count.
    logits, ids, weights, mask = inputs[LAYERS[0]]
    steps, before, after = stats_between(rt.counters.snapshot_now(), None)[0, :3].tolist()
    want_ids, _ = oea_of_real_rows(logits, ids, weights, mask)
    assert steps == 1 and before == distinct_experts(ids[mask], NUM_EXPERTS)
    assert after == distinct_experts(want_ids, NUM_EXPERTS)


@pytest.mark.parametrize("garbage", ["nan", "huge"])
def test_graph_replay_routes_the_real_rows_of_equal_slots(garbage):
    rt, slot = dp_runtime(None), 4  # graph passes never read the eager slots
    rt.graph_buckets = (slot,)
    inputs = gathered_inputs((3, 1), [slot, slot], garbage, seed=7)
    logits, ids, weights, _ = inputs
    # Warm-up of the bucket (every group at it; real rows known only at replay): makes the device state.
    rt.begin_step(DECODE, slot * GROUPS, graph=True, requests=slot * GROUPS, groups=GROUPS)
    rt.route(ids, weights, CONFIG, logits, 0)
    rt.end_step()
    # A replay as the hooks drive it: the outer step of the gathered rows, the replay rows set (the
    # hook passes this rank's own rows; under DP attention every group's are written), then a
    # nested graph context that describes the outer one.
    rt.begin_step(DECODE, 4, requests=4, groups=GROUPS, group_rows=(3, 1))
    outer = rt.step
    rt.set_replay_rows(3)
    rt.begin_step(DECODE, 4, graph=True, outermost=False, requests=4, groups=GROUPS, group_rows=(3, 1))
    routed = rt.route(ids, weights, CONFIG, logits, 0)
    rt.step = outer
    rt.note_replay(slot)
    rt.end_step()
    assert int(rt.device.rows) == 4 and rt.device.group_rows.tolist() == [3, 1]
    assert_gathered_routing(routed, inputs)
    assert rt.applied[DECODE] == 1


def test_two_ranks_with_different_padding_route_and_checksum_alike():
    """Every rank sees the same real rows, but its padding holds its own garbage: the ids handed to
    the layer and the rank-check checksums must still agree, or --oea-check-ranks stops the server."""
    routed, sums = [], []
    for rank, garbage in enumerate(("nan", "huge")):
        rt = dp_runtime([4, 4], rank=rank, check_ranks=1)
        inputs = {5: gathered_inputs((3, 1), [4, 4], garbage, seed=3)}
        for _ in range(2):  # the snapshot read is the second-newest: that of the first pass
            out = eager_pass(rt, (3, 1), inputs)[5]
        routed.append(out)
        sums.append(rt.read_snapshot().checksums())
    logits, ids, weights, mask = inputs[5]
    assert torch.equal(routed[0][0], routed[1][0]) and torch.equal(routed[0][1][mask], routed[1][1][mask])
    assert torch.equal(sums[0], sums[1])
    want_ids, _ = oea_of_real_rows(logits, ids, weights, mask)
    assert int(sums[0][5]) == int(ids_checksum(want_ids))  # the real rows' choice, nothing else


@pytest.mark.parametrize("slots, group_rows", [
    ([4, 3], (3, 1)),  # slots that do not add up to the buffer's 8 rows
    ([2, 6], (3, 1)),  # a group's real rows overflow its slot
    (None, (3, 1)),  # SGLang published no slots
])
def test_a_layout_that_does_not_fit_is_skipped_once_warned(caplog, slots, group_rows):
    rt = dp_runtime(slots)
    logits, ids, weights, _ = gathered_inputs((3, 1), [4, 4], "nan", seed=0)
    with caplog.at_level(logging.WARNING, logger="sglang_oea"):
        for _ in range(2):
            rt.begin_step(DECODE, 4, requests=4, groups=GROUPS, group_rows=group_rows)
            assert all(rt.route(ids, weights, CONFIG, logits, layer) is None for layer in LAYERS)
            rt.end_step()
    assert rt.skipped == {(DECODE, SKIP_LAYOUT): 2} and not rt.applied
    assert len([r for r in caplog.records if "gathered batch is not laid out" in r.getMessage()]) == 1


def test_a_graph_buffer_that_does_not_split_into_equal_slots_is_not_routed():
    rt = dp_runtime(None)
    rt.graph_buckets = (4,)
    logits, ids, weights, _ = gathered_inputs((3, 1), [4, 3], "nan", seed=0)  # 7 rows, 2 groups
    rt.begin_step(DECODE, 8, graph=True, requests=8, groups=GROUPS)
    assert rt.route(ids, weights, CONFIG, logits, 0) is None and rt.step.tally.layout


# ----------------------------------------------------------------------------- graph buckets


def capture_step(bucket, groups):
    """A decode graph's capture pass: every group at the bucket (no DP attention: groups 0)."""
    requests = bucket * max(groups, 1)
    return StepInfo(mode=DECODE, num_rows=requests, requests=requests, graph=True, groups=groups)


def test_bucket_may_open_counts_every_group_but_starts_from_one_groups_bucket():
    buckets = (1, 2, 4)
    floor = OEAConfig(k0=K0, min_batch=3)
    assert bucket_may_open(floor, capture_step(2, GROUPS), buckets)  # batches of 2..4 requests, 3 among them
    assert not bucket_may_open(floor, capture_step(2, 0), buckets)  # at most 2 requests
    cap = OEAConfig(k0=K0, min_batch=1, max_batch=2)
    # Bucket 2 serves a batch of 2 requests (busiest group 2, the other idle): under the cap.
    assert bucket_may_open(cap, capture_step(2, GROUPS), buckets)
    assert not bucket_may_open(cap, capture_step(4, GROUPS), buckets)  # 3 requests at the fewest


def test_a_replay_finds_the_capture_of_its_per_group_bucket():
    rt = dp_runtime(None, min_batch=3)
    rt.graph_buckets = (1, 2, 4)
    logits, ids, weights, _ = gathered_inputs((2, 2), [2, 2], "nan", seed=0)
    rt.begin_step(DECODE, 4, graph=True, requests=4, groups=GROUPS)  # capture of bucket 2
    assert rt.route(ids, weights, CONFIG, logits, 0) is not None
    rt.end_step()
    assert rt.captured == {(DECODE, 2, 1): None}
    # A step of 3 requests (2 + 1) replays bucket 2 (the runner notes its own bs): applied.
    rt.begin_step(DECODE, 3, requests=3, groups=GROUPS, group_rows=(2, 1))
    rt.note_replay(2)
    rt.end_step()
    assert rt.applied[DECODE] == 1 and not rt.skipped


# ----------------------------------------------------------------------------- dp_attention


def forward_batch(counts, idle=False, extend=False, width=None, batch_size=0, draft=False):
    """The ForwardBatch fields gathered_step reads (spec_info: a verify input of `width` draft
    tokens per request, or with draft=True a draft model's input)."""
    spec = None if width is None and not draft else types.SimpleNamespace(
        num_tokens_per_req=width, is_draft_input=lambda: draft)
    return types.SimpleNamespace(
        original_global_num_tokens_cpu=counts, is_extend_in_batch=extend, batch_size=batch_size,
        forward_mode=types.SimpleNamespace(is_idle=lambda: idle), spec_info=spec)


def described(mode, counts, rows):
    return dict(mode=mode, num_rows=sum(rows), requests=sum(counts), groups=GROUPS, group_rows=tuple(rows))


def test_every_rank_describes_a_decode_pass_alike():
    busy = dp_attention.gathered_step(forward_batch([0, 3], batch_size=3), DECODE, DECODE, GROUPS, 3)
    idle = dp_attention.gathered_step(forward_batch([0, 3], idle=True), OTHER, DECODE, GROUPS, 0)
    assert busy == idle == described(DECODE, [0, 3], [0, 3])


def test_a_verify_pass_has_draft_tokens_rows_per_request_on_every_rank():
    busy = dp_attention.gathered_step(forward_batch([2, 1], width=4, batch_size=2), VERIFY, VERIFY, GROUPS, 8)
    idle = dp_attention.gathered_step(forward_batch([2, 1], idle=True, width=4), OTHER, VERIFY, GROUPS, 0)
    assert busy == idle == described(VERIFY, [2, 1], [8, 4])


def test_passes_that_are_not_routed_anywhere():
    # Any group prefilling: not routed on any rank, whatever the local mode.
    for mode, idle in ((DECODE, False), (OTHER, True)):
        step = dp_attention.gathered_step(forward_batch([2, 3], idle=idle, extend=True), mode, DECODE, GROUPS, 2)
        assert step["mode"] == OTHER
    assert dp_attention.gathered_step(forward_batch([0, 0], idle=True), OTHER, DECODE, GROUPS, 0)["mode"] == OTHER
    # The draft model's passes: DRAFT on every rank, the busy ones (their runner says so) and an idle
    # one, whose forward context SGLang opens before the draft runner's forward (its input says so).
    draft = dict(mode=DRAFT, num_rows=2, requests=0)
    assert dp_attention.gathered_step(forward_batch([2, 3]), DRAFT, VERIFY, GROUPS, 2) == draft
    assert dp_attention.gathered_step(forward_batch([2, 3], idle=True, draft=True), OTHER, VERIFY, GROUPS, 2) == draft


def test_a_capture_pass_is_every_group_at_the_bucket():
    step = dp_attention.gathered_step(forward_batch(None, batch_size=4), DECODE, DECODE, GROUPS, 4)
    assert step == dict(mode=DECODE, num_rows=8, requests=8, groups=GROUPS, group_rows=())


def test_a_nested_context_describes_its_outer_pass_or_its_graphs_batch():
    """SGLang opens a second forward context after padding a pass's batch: it describes the outer
    pass (the padded local view changes nothing); inside a graph (a capture, or a debug re-run of a
    replay) the graph's batch: every group at the bucket of the local view, its real rows unknown."""
    outer = StepInfo(mode=DECODE, num_rows=5, requests=5, groups=GROUPS, group_rows=(3, 2))
    rt = types.SimpleNamespace(step=outer, groups=GROUPS, routed_mode=DECODE)
    padded = forward_batch([3, 2], batch_size=3)
    local = dict(mode=DECODE, num_rows=3, requests=3)
    assert dp_attention.describe(rt, padded, local, False, False) == described(DECODE, [3, 2], [3, 2])
    assert dp_attention.describe(rt, padded, local, False, True) == dict(mode=DECODE, num_rows=6, requests=6,
                                                                         groups=GROUPS, group_rows=())
    assert dp_attention.describe(rt, padded, local, True, False) == described(DECODE, [3, 2], [3, 2])


class StubCheck:
    """RankCheck's schedule, recording the checks it runs."""

    def __init__(self, every):
        self.every, self.calls = every, []

    def due(self, step):
        return step % self.every == 0

    def check(self, snapshot, step):
        self.calls.append(step)


def test_after_pass_checks_when_due_and_exports_for_an_idle_rank(monkeypatch):
    reports = []
    monkeypatch.setattr(dp_attention, "_report_every", 3)
    monkeypatch.setattr(metrics, "report", lambda runtime, snapshot: reports.append((runtime.routed_steps, snapshot)))
    check = StubCheck(2)
    rt = types.SimpleNamespace(routed_steps=0, rank_check=check, read_snapshot=lambda: f"snap{rt.routed_steps}")
    routed, graph, other = StepInfo(mode=DECODE), StepInfo(mode=DECODE, graph=True), StepInfo(mode=OTHER)
    for done in range(1, 7):  # neither a graph pass nor an unrouted pass checks or exports
        rt.routed_steps = done
        for step in (graph, other):
            dp_attention.after_pass(rt, step, idle_here=True)
    assert not check.calls and not reports
    for done in range(1, 7):
        rt.routed_steps = done
        dp_attention.after_pass(rt, routed, idle_here=done != 3)
    assert check.calls == [2, 4, 6]
    assert reports == [(6, "snap6")]  # pass 3's rank was busy: SGLang's own report ran there
