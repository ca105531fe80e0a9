"""The lean sglang_oea.routing.route_from_logits against the readable composition it replaces.

Oracle: score_experts, then mask_foreign_groups (grouped routers), then
reference.opportunistic_route: what route_from_logits computed before it became a handful of ops.
Every case must give equal ids (int64, same column order) and weights of the same dtype with the
same bits (stricter than torch.equal: -0.0 is not +0.0). About 6,000 cases: a random grid, every
K and k0 per N and scoring, hypothesis, and edge cases. Also checked: graph safety (no host sync,
shapes that do not depend on the device row count) and the number of torch ops per call.
"""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from cost.cpu_routing_cost import torch_ops  # benchmark/oea: the op count it reports, same rule
from sglang_oea import routing
from sglang_oea.reference import opportunistic_route
from sglang_oea.routing import RouterSpec, mask_foreign_groups, route_from_logits, score_experts

N_VALUES = (8, 64, 128, 160, 256, 384, 512)
OP_BUDGET = 30


def oracle(logits, ids, weights, spec: RouterSpec, k0, num_valid=None, min_batch=1, max_batch=0):
    """route_from_logits as it was: the reference composition."""
    selection, weight = score_experts(logits, spec)
    if spec.restrict_groups:
        selection = mask_foreign_groups(selection, ids, spec.num_groups)
    return opportunistic_route(selection, weight, ids, weights, k0, num_valid, min_batch, max_batch)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so that -0.0 and +0.0 (and NaNs) are told apart."""
    return tensor.view({4: torch.int32, 2: torch.int16}[tensor.element_size()])


def assert_same(got, want, context=""):
    (got_ids, got_w), (want_ids, want_w) = got, want
    assert got_ids.dtype == torch.int64 and got_w.dtype == want_w.dtype, context
    assert torch.equal(got_ids, want_ids), f"ids differ {context}\n{got_ids}\n{want_ids}"
    # Bits, not values: -0.0 must stay +0.0, and the NaNs of NaN router weights must match too.
    assert torch.equal(bits(got_w), bits(want_w)), (
        f"weights differ {context}\n{got_w}\n{want_w}"
    )


def make_logits(gen: torch.Generator, rows: int, experts: int, kind: str) -> torch.Tensor:
    """randn (f32 or bf16), few distinct values (ties), or with +-0.0 and -inf entries."""
    if kind == "few":
        return torch.randint(-2, 3, (rows, experts), generator=gen).float() * 0.75
    logits = torch.randn(rows, experts, generator=gen) * 2
    if kind == "bf16":
        return logits.to(torch.bfloat16)
    if kind == "zeros_inf":
        pick = torch.randint(0, 8, (rows, experts), generator=gen)
        logits = torch.where(pick == 0, torch.tensor(-0.0), logits)
        logits = torch.where(pick == 1, torch.tensor(0.0), logits)
        # -inf logits: softmax and sigmoid scores of exactly +0.0, tied (not every column, so no
        # softmax row is all -inf).
        logits[:, 1:] = torch.where(pick[:, 1:] == 2, torch.tensor(float("-inf")), logits[:, 1:])
    return logits


def make_case(rng: random.Random, rows: int, experts: int, k: int, scoring: str, groups: int,
              logits_kind: str, ids_kind: str, ids_dtype=torch.int32, weights_dtype=torch.float32):
    """Router inputs: logits, the routed ids (the router's top-K, the top-K of its best groups, or
    any distinct ids, in shuffled columns) and their weights (maybe renormalised and scaled)."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    logits = make_logits(gen, rows, experts, logits_kind)
    bias = None
    if scoring == "sigmoid+bias":
        bias = torch.randint(-2, 3, (experts,), generator=gen).float() * 0.25
        bias = torch.where(bias == 0, torch.tensor(-0.0), bias) if rng.random() < 0.5 else bias
        if logits_kind != "few":
            bias = bias + torch.randn(experts, generator=gen) * 0.5
    spec = RouterSpec(scoring.split("+")[0], bias, groups, groups > 1)
    selection, weight = score_experts(logits, spec)
    if ids_kind == "router":
        ids = selection.topk(k, dim=1).indices
    elif ids_kind == "grouped":  # a group-limited router: the top-K within the best groups
        size = experts // groups
        best = selection.view(rows, groups, size).amax(dim=2).topk(-(-k // size), dim=1).indices
        keep = torch.zeros(rows, groups, dtype=torch.bool).scatter(1, best, True).repeat_interleave(size, dim=1)
        ids = selection.masked_fill(~keep, float("-inf")).topk(k, dim=1).indices
    else:  # any k distinct experts
        ids = torch.rand(rows, experts, generator=gen).argsort(dim=1)[:, :k]
    ids = ids.gather(1, torch.rand(rows, k, generator=gen).argsort(dim=1))  # shuffled columns
    weights = weight.gather(1, ids)
    if rng.random() < 0.5:
        weights = weights / weights.sum(dim=1, keepdim=True) * rng.choice([1.0, 2.5, 16.0])
    return logits, ids.to(ids_dtype), weights.to(weights_dtype), spec


def row_count(rng: random.Random, rows: int):
    """num_valid_rows: None, an int (0 and > B included) or a 0-d / [1] int device tensor."""
    kind = rng.choice(["none", "int", "0d", "1d"])
    if kind == "none":
        return None
    count = rng.choice([0, rows, rows + 3, rng.randint(0, rows)])
    if kind == "int":
        return count
    return torch.tensor(count if kind == "0d" else [count], dtype=rng.choice([torch.int32, torch.int64]))


def random_case(rng: random.Random):
    experts = rng.choice(N_VALUES)
    k = rng.randint(1, min(16, experts))
    groups = rng.choice([g for g in (1, 2, 4, 8) if experts % g == 0])
    case = make_case(
        rng, rng.choice([1, 2, 3, 5, 8, 13, 32, 64]), experts, k,
        scoring=rng.choice(["softmax", "sigmoid", "sigmoid+bias"]), groups=groups,
        logits_kind=rng.choice(["randn", "bf16", "few", "zeros_inf"]),
        ids_kind=rng.choice(["router", "grouped" if groups > 1 else "router", "any"]),
        ids_dtype=rng.choice([torch.int32, torch.int64]),
        weights_dtype=rng.choice([torch.float32, torch.float32, torch.bfloat16]),
    )
    k0 = rng.choice([rng.randint(1, k), rng.randint(1, k), k, k + 1])
    min_batch, max_batch = rng.choice([(1, 0), (1, 0), (2, 0), (3, 6), (1, 4), (5, 3)])
    return case, k0, row_count(rng, case[0].shape[0]), min_batch, max_batch


def check(case, k0, num_valid, min_batch=1, max_batch=0):
    logits, ids, weights, spec = case
    got = route_from_logits(logits, ids, weights, spec, k0, num_valid, min_batch, max_batch)
    want = oracle(logits, ids, weights, spec, k0, num_valid, min_batch, max_batch)
    assert_same(got, want, f"{spec.scoring_func=} bias={spec.correction_bias is not None} {spec.num_groups=} "
                           f"{k0=} {num_valid=} {min_batch=} {max_batch=} {logits.dtype=} {tuple(ids.shape)=}")


def test_random_grid_matches_the_reference():
    """3000 random cases over every N, K in 1..16, k0 in 1..K+1, scorings, groups, row counts."""
    rng = random.Random(0)
    for _ in range(3000):
        check(*random_case(rng))


@pytest.mark.parametrize("experts", N_VALUES)
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "sigmoid+bias"])
def test_every_k_and_k0(experts, scoring):
    """Each N x scoring: every K in 1..16 with every k0 in 1..K, ties and row counts varying."""
    rng = random.Random(experts * 7 + len(scoring))
    for k in range(1, min(16, experts) + 1):
        groups = 4 if experts % 4 == 0 and k % 2 else 1
        for k0 in range(1, k + 1):
            case = make_case(rng, rng.choice([1, 4, 16]), experts, k, scoring, groups,
                             rng.choice(["bf16", "few", "zeros_inf"]), rng.choice(["router", "grouped", "any"]))
            check(case, k0, row_count(rng, case[0].shape[0]))


@settings(max_examples=400, deadline=None)
@given(
    rows=st.integers(1, 40),
    experts=st.sampled_from(N_VALUES),
    k=st.integers(1, 16),
    k0=st.integers(1, 17),
    scoring=st.sampled_from(["softmax", "sigmoid", "sigmoid+bias"]),
    groups=st.sampled_from([1, 2, 4, 8]),
    logits_kind=st.sampled_from(["randn", "bf16", "few", "zeros_inf"]),
    ids_kind=st.sampled_from(["router", "grouped", "any"]),
    ids_dtype=st.sampled_from([torch.int32, torch.int64]),
    weights_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    valid=st.one_of(st.none(), st.integers(0, 45)),
    valid_kind=st.sampled_from(["int", "0d", "1d"]),
    gate=st.sampled_from([(1, 0), (2, 0), (1, 8), (4, 30)]),
    seed=st.integers(0, 1 << 20),
)
def test_hypothesis_matches_the_reference(rows, experts, k, k0, scoring, groups, logits_kind, ids_kind,
                                          ids_dtype, weights_dtype, valid, valid_kind, gate, seed):
    k = min(k, experts)
    if experts % groups:
        groups = 1
    case = make_case(random.Random(seed), rows, experts, k, scoring, groups, logits_kind, ids_kind,
                     ids_dtype, weights_dtype)
    if valid is not None and valid_kind != "int":
        valid = torch.tensor(valid if valid_kind == "0d" else [valid], dtype=torch.int32)
    check(case, k0, valid, *gate)


def test_short_rows_and_minus_inf_candidates():
    """B = 1 and tiny unions (rows run short), and grouped rows whose union lies in foreign groups."""
    rng = random.Random(5)
    for _ in range(300):
        experts, k = rng.choice([(8, 8), (64, 8), (256, 8), (160, 6), (512, 16)])
        groups = rng.choice([2, 4, 8])
        case = make_case(rng, rng.randint(1, 3), experts, k, rng.choice(["softmax", "sigmoid+bias"]), groups,
                         rng.choice(["randn", "few"]), "grouped")
        check(case, rng.randint(1, k - 1), rng.choice([None, 1, torch.tensor(2, dtype=torch.int32)]))


def test_ties_minus_zero_and_minus_inf_keys_order_like_a_stable_sort():
    """_score_keys orders like torch.sort(stable, descending): -0.0 ties +0.0, ids break ties."""
    values = [0.0, -0.0, 1.0, -1.0, float("-inf"), 1e-45, -1e-45, 3.4e38, -3.4e38, 0.5, -0.5]
    gen = torch.Generator().manual_seed(1)
    for signed in (False, True):
        pool = values if signed else [v for v in values if v >= 0 or v == float("-inf")]
        for _ in range(50):
            picks = torch.randint(0, len(pool), (6, 40), generator=gen)
            scores = torch.tensor(pool)[picks]
            if not signed:  # softmax / sigmoid scores are never -0.0
                scores = scores.abs().where(scores != float("-inf"), scores)
            keys = routing._score_keys(scores.clone(), signed)
            by_key = keys.argsort(dim=1, descending=True)
            assert torch.equal(by_key, torch.sort(scores, dim=1, descending=True, stable=True).indices)


def test_scores_are_never_minus_zero():
    """Why the unsigned keys may skip the mapping: plain sigmoid selection (its weight) is +0.0, never
    -0.0, and so are the softmax weights. The softmax selection is the logit: signed keys."""
    logits = torch.tensor([[-0.0, 0.0, float("-inf"), -200.0, 1e4]])
    for scoring in ("softmax", "sigmoid"):
        _, weight = score_experts(logits, RouterSpec(scoring))
        assert not bool(torch.signbit(weight).any()), scoring
    selection, _ = score_experts(logits, RouterSpec("sigmoid"))
    assert not bool(torch.signbit(selection).any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_selection_is_the_float32_logit(dtype):
    """Bit for bit, -0.0 and -inf included; the weights stay the softmax."""
    logits = torch.tensor([[-0.0, 0.0, float("-inf"), -200.0, 3.5, 1e4, -1e-40]]).to(dtype)
    selection, weight = score_experts(logits, RouterSpec("softmax"))
    assert selection.dtype == torch.float32 and torch.equal(bits(selection), bits(logits.float()))
    assert torch.equal(bits(weight), bits(routing.softmax_rows(logits.float())))


def test_softmax_ranks_by_logit_where_probabilities_tie():
    """Probabilities that underflow to 0 or round to one value, from logits that differ: the torch
    path ranks by the logit, which picks other ids than ranking by probability (the old selection
    score, ties to the lower id), and never piggybacks an expert whose logit is -inf."""
    from gpu.gpu_score_bits import probability_tie_inputs

    logits, ids, weights, spec = probability_tie_inputs()
    probs = logits.softmax(dim=1)
    for num_valid in (None, 5, torch.tensor(5, dtype=torch.int32)):
        got = route_from_logits(logits, ids, weights, spec, 3, num_valid)
        assert_same(got, oracle(logits, ids, weights, spec, 3, num_valid))
        by_probability = opportunistic_route(probs, probs, ids, weights, 3, num_valid)[0]
        assert (got[0] != by_probability).any(dim=1).all()
    new_ids, new_weights = got
    assert 16 in new_ids[0, :3].tolist() and 16 not in new_ids[4][new_weights[4] > 0].tolist()


def test_k0_at_least_k_and_closed_gate_return_the_routers_own_tensors():
    rng = random.Random(3)
    logits, ids, weights, spec = make_case(rng, 6, 64, 8, "softmax", 1, "bf16", "router", torch.int64)
    for k0, valid, min_batch, max_batch in [(8, None, 1, 0), (9, 2, 1, 0), (3, 5, 6, 0), (3, None, 1, 4)]:
        new_ids, new_weights = route_from_logits(logits, ids, weights, spec, k0, valid, min_batch, max_batch)
        assert new_weights is weights and torch.equal(new_ids, ids) and new_ids.dtype == torch.int64
    for valid, min_batch, max_batch in [(torch.tensor(5), 6, 0), (torch.tensor([7]), 1, 6), (torch.tensor(0), 1, 0)]:
        new_ids, new_weights = route_from_logits(logits, ids.int(), weights, spec, 3, valid, min_batch, max_batch)
        assert torch.equal(new_ids, ids) and torch.equal(bits(new_weights), bits(weights))


def test_empty_batch_and_sliced_router_columns():
    """B = 0 returns the router's (empty) tensors; routed columns sliced off fused shared-expert
    columns (non-contiguous, as TorchRouter passes them) route like contiguous ones."""
    spec = RouterSpec("sigmoid", torch.zeros(64), 4, True)
    empty = (torch.randn(0, 64), torch.zeros(0, 8, dtype=torch.int32), torch.zeros(0, 8), spec)
    for valid in (None, 0, torch.tensor(0)):
        assert_same(route_from_logits(*empty, 3, valid), oracle(*empty, 3, valid))
    logits, ids, weights, spec = make_case(random.Random(8), 9, 64, 10, "softmax", 1, "bf16", "router")
    for valid in (None, 4, torch.tensor([6], dtype=torch.int32)):
        sliced = (logits, ids[:, :8], weights[:, :8], spec)
        assert_same(route_from_logits(*sliced, 3, valid), oracle(*sliced, 3, valid))


def test_device_row_count_equals_the_int():
    rng = random.Random(9)
    for scoring, groups in [("softmax", 1), ("sigmoid+bias", 8), ("sigmoid", 4)]:
        case = make_case(rng, 16, 128, 8, scoring, groups, "bf16", "router")
        for count in (0, 1, 7, 16, 20):
            as_int = route_from_logits(*case, 3, count)
            for as_tensor in (torch.tensor(count, dtype=torch.int32), torch.tensor([count], dtype=torch.int64)):
                assert_same(route_from_logits(*case, 3, as_tensor), as_int, f"{scoring} {count}")


@pytest.mark.parametrize("scoring,groups", [("softmax", 1), ("sigmoid+bias", 8), ("sigmoid", 2)])
def test_device_settings_equal_the_ints(scoring, groups):
    """Live settings: k0 and the gate bounds as 0-d device tensors, read from a control block as a
    captured graph reads them (routing.control_values). For every k0 in 0..K+1 (0: off, >= K: a
    no-op) and with padded rows, the same ids and weight bits as the int path; the device gate
    (routing.control_gate) says whether OEA applied."""
    case = make_case(random.Random(11), 12, 64, 6, scoring, groups, "bf16", "router")
    gates = [(None, 1, 0), (7, 1, 0), (torch.tensor(7, dtype=torch.int32), 2, 10), (torch.tensor([9]), 10, 0),
             (12, 1, 11), (torch.tensor(5, dtype=torch.int32), 1, 5)]
    for k0 in range(0, 8):
        for valid, lo, hi in gates:
            control = torch.tensor([k0, lo, hi], dtype=torch.int32)
            k0_d, lo_d, hi_d = routing.control_values(control)
            want = route_from_logits(*case, k0, valid, lo, hi)
            assert_same(route_from_logits(*case, k0_d, valid, lo_d, hi_d), want, f"{k0=} {valid=} {lo=} {hi=}")
            rows = 12 if valid is None else valid
            opened = bool(routing.control_gate(rows, control, 6))
            assert opened == (1 <= k0 < 6 and lo <= int(rows) and (hi == 0 or int(rows) <= hi))
            assert opened or torch.equal(want[0], case[1].long())


def test_device_settings_scale_the_floor_by_rows_per_request():
    control = torch.tensor([3, 2, 12], dtype=torch.int32)
    assert [bool(routing.control_gate(rows, control, 8, rows_per_request=4)) for rows in (4, 8, 12, 16)] == [
        False, True, True, False]


# ----------------------------------------------------------------------------- graph safety

HOST_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "item", "unique",
                 "_unique2", "bincount", "repeat_interleave.Tensor"}


class OpLog(TorchDispatchMode):
    """Records every aten op with its output shapes; fails on ops that read values on the host."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        overload = str(func.overloadpacket.__name__)
        assert overload not in HOST_SYNC_OPS and name not in HOST_SYNC_OPS, f"host sync: {func}"
        if overload.startswith("index"):  # boolean-mask indexing: a data-dependent shape
            indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else []
            assert not any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices), f"{func}"
        out = func(*args, **(kwargs or {}))
        shapes = [tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else [out])
                  if isinstance(t, torch.Tensor)]
        self.calls.append((str(func), shapes))
        return out


@pytest.mark.parametrize("scoring,groups", [("softmax", 1), ("sigmoid+bias", 8), ("sigmoid", 2)])
def test_no_host_sync_and_fixed_shapes_with_a_device_row_count(scoring, groups):
    """The CUDA-graph contract: the same ops with the same shapes whatever the device row count."""
    case = make_case(random.Random(4), 12, 64, 6, scoring, groups, "bf16", "router")
    route_from_logits(*case, 2, torch.tensor(1, dtype=torch.int32), 2, 10)  # builds the cached tables
    logs = []
    for count in (0, 1, 5, 12, 40):
        with OpLog() as log:
            route_from_logits(*case, 2, torch.tensor(count, dtype=torch.int32), 2, 10)
        logs.append(log.calls)
    assert all(calls == logs[0] for calls in logs)


def test_no_host_sync_and_fixed_shapes_with_device_settings():
    """The same ops with the same shapes whatever the control block holds (k0 0..K+1, any bounds)."""
    case = make_case(random.Random(5), 12, 64, 6, "sigmoid+bias", 8, "bf16", "router")
    rows = torch.tensor(9, dtype=torch.int32)
    k0, lo, hi = routing.control_values(torch.tensor([2, 1, 0], dtype=torch.int32))
    route_from_logits(*case, k0, rows, lo, hi)  # builds the cached tables
    logs = []
    for values in ((0, 1, 0), (2, 4, 10), (5, 1, 0), (6, 1, 0), (7, 20, 3)):
        control = torch.tensor(values, dtype=torch.int32)
        k0, lo, hi = routing.control_values(control)
        with OpLog() as log:
            route_from_logits(*case, k0, rows, lo, hi)
        logs.append(log.calls)
    assert all(calls == logs[0] for calls in logs)


# ----------------------------------------------------------------------------- op budget


BUDGET_CASES = {
    # name: (scoring, groups, num_valid_rows, budget); bf16 logits, int32 ids and float32 weights, as
    # SGLang passes them. The softmax case takes 28 ops: the logit is its selection score, whose keys
    # need the signed mapping (3 ops) that probabilities did not. A device row count costs 7 more:
    # the real rows, the padded rows' logits masked to -inf, their base lift, activity read from the
    # keys (one op more than weighting by U), the gate and its two selects: 35, five over OP_BUDGET.
    "softmax": ("softmax", 1, None, OP_BUDGET),
    "sigmoid+bias+groups": ("sigmoid+bias", 8, None, OP_BUDGET),
    "softmax, int tensor row count": ("softmax", 1, torch.tensor(10, dtype=torch.int32), OP_BUDGET + 5),
}


@pytest.mark.parametrize("name", BUDGET_CASES)
def test_op_budget(name):
    """At most OP_BUDGET (30) torch ops per routing call; the device row count case takes 35.

    Counting rule (cpu_routing_cost.torch_ops): the torch.profiler events of one call that are
    aten ops without a parent event, i.e. the ops the Python code dispatches itself. An op's
    internal sub-ops are not counted; views (Tensor.view) are. Counted on the second call with
    the same shapes: the first also builds the cached index tables (routing._constant).
    """
    scoring, groups, num_valid, budget = BUDGET_CASES[name]
    case = make_case(random.Random(0), 16, 128, 8, scoring, groups, "bf16", "router")
    ops = torch_ops(lambda: route_from_logits(*case, 4, num_valid))
    assert len(ops) <= budget, f"{len(ops)} ops: {ops}"
