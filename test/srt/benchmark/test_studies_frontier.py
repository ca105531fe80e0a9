"""benchmark/oea/studies/frontier*.py and policies.py: the evaluator's self-checks on tiny random Qwen3-MoE,
GLM-4-MoE and DeepSeek-V3 models built here, each policy against brute force or a hand-computed case, T
counting, and the frontier.json row keys."""

import json

import pytest
import torch

from common import stats
from studies import frontier_compare as fc, frontier_eval as fe, frontier_report as frep, policies as pol
from sglang_oea.reference import opportunistic_route
from sglang_oea.routing import RouterSpec, mask_foreign_groups, score_experts

K = 4
N = 16
PROMPT = 5


def tiny_model(arch: str):
    """A 16-expert, top-4 random model with 2 MoE layers (GLM: 4 groups, 2 selected, a correction
    bias; DeepSeek-V3: MLA, one group, a correction bias, after a dense first layer)."""
    from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=8,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                  num_experts_per_tok=K, norm_topk_prob=True)
    sigmoid = dict(n_routed_experts=N, n_shared_experts=1, routed_scaling_factor=2.5)
    torch.manual_seed(0)
    if arch == "qwen":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(num_experts=N, **common))
    elif arch == "glm":
        model = Glm4MoeForCausalLM(Glm4MoeConfig(n_group=4, topk_group=2, first_k_dense_replace=0, **sigmoid, **common))
    else:
        mla = dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**common, "num_hidden_layers": 3, "head_dim": 8}, n_group=1,
                                                       topk_group=1, first_k_dense_replace=1, **sigmoid, **mla))
    with torch.no_grad():  # skewed, distinct router scores, so that policies differ
        for layer in fe_moe_layers(model):
            layer.mlp.gate.weight.normal_(0, 0.5)
            if hasattr(layer.mlp.gate, "e_score_correction_bias"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    return model.float().eval()


def fe_moe_layers(model):
    """The decoder layers with a router (a DeepSeek-V3 model's first layer is dense)."""
    return [layer for layer in model.model.layers if hasattr(layer.mlp, "gate")]


@pytest.fixture(scope="module", params=["qwen", "glm", "deepseek"])
def model(request):
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def windows():
    return torch.randint(0, 64, (8, PROMPT + 6 + 1), generator=torch.Generator().manual_seed(1))


def step_scores(seed: int, rows: int = 6, grouped: bool = False) -> pol.StepScores:
    """A random routing step from router logits, routed as the models route."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, N, generator=gen) * 2
    if grouped:
        spec = RouterSpec("sigmoid", torch.randn(N, generator=gen) * 0.1, 4, True)
        selection, weight = score_experts(logits, spec)
        class Gate:  # what group_mask reads from a GLM router
            num_group, topk_group = 4, 2
        mask = fe.group_mask(Gate, selection)
        ids = selection.masked_fill(~mask, float("-inf")).topk(K, dim=1).indices
        w = weight.gather(1, ids)
        w = w / w.sum(dim=1, keepdim=True) * 2.5
    else:
        spec = RouterSpec("softmax")
        selection, weight = score_experts(logits, spec)
        mask = torch.ones(rows, N, dtype=torch.bool)
        ids = logits.topk(K, dim=1).indices
        w = weight.gather(1, ids)
        w = w / w.sum(dim=1, keepdim=True)
    return pol.StepScores(logits, selection, weight, ids, w, mask, spec)


def used_sets(ids: torch.Tensor):
    return [set(row[row >= 0].tolist()) for row in ids]


def assert_same_routing(got, expected):
    """Same experts and the same weight on each, whatever the slot order: (ids, weights) pairs."""
    (ids, weights), (ref_ids, ref_w) = got, expected
    for r in range(ids.shape[0]):
        mine, ref = ids[r].sort(), ref_ids[r].sort()
        assert torch.equal(mine.values, ref.values)
        torch.testing.assert_close(weights[r][mine.indices], ref_w[r][ref.indices])


# ---- evaluator self-checks ----

def routed_logits(model, rows: torch.Tensor, policy) -> torch.Tensor:
    """[B, S, V] logits of one forward over all of rows[:, :-1], decode positions by `policy`."""
    gates = fe.install(model)
    for gate in gates:
        gate.configure(policy, rows.shape[0], rows.shape[1] - 1, PROMPT)
    with torch.no_grad():
        out = model(input_ids=rows[:, :-1], use_cache=False).logits
    for gate in gates:
        gate.configure(None)
    return out


def test_plain_routing_equals_a_plain_forward(model, windows):
    got = fe.evaluate(model, windows, 4, PROMPT, pol.plain)
    assert torch.equal(got.nll, fe.plain_nll(model, windows, PROMPT))
    assert got.steps.shape == (2, 2, 6)  # batches, layers, decode steps


def test_forwards_of_several_batches_route_each_batch_apart(model, windows):
    """A forward of 8 rows routes its two batches of 4 as two forwards of 4 rows would."""
    together = fe.run_policy(model, windows, 4, PROMPT, "oea", 1)
    apart = fe.evaluate(model, windows, 4, PROMPT, pol.oea(1), chunk=4)
    assert torch.equal(together.steps, apart.steps)
    torch.testing.assert_close(together.nll, apart.nll, rtol=1e-6, atol=1e-5)
    # 8 rows routed together: layer 0 sees the same inputs, the union of bases of 8 rows holds both.
    one_batch = fe.run_policy(model, windows, 8, PROMPT, "oea", 1)
    assert (one_batch.steps[0, 0] >= together.steps[:, 0].amax(dim=0)).all()


@pytest.mark.parametrize("k0", [K, K + 3])
def test_oea_with_k0_at_least_k_is_plain(model, windows, k0):
    assert torch.equal(fe.run_policy(model, windows, 4, PROMPT, "oea", k0).nll,
                       fe.evaluate(model, windows, 4, PROMPT, None).nll)


def test_prompt_positions_keep_the_model_routing(model, windows):
    """Prefill is never rerouted: logits before P are the plain model's (up to the rounding of
    expert matmuls whose other rows changed); after P they move."""
    outs = [routed_logits(model, windows, policy) for policy in (pol.plain, pol.pruned(1))]
    torch.testing.assert_close(outs[0][:, :PROMPT], outs[1][:, :PROMPT], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(outs[0][:, PROMPT:], outs[1][:, PROMPT:])


def test_a_position_depends_on_earlier_positions_only(model, windows):
    """What makes one teacher-forced forward equal to lockstep decoding: cutting the sequences
    short leaves the routing and the NLL of the kept decode positions unchanged."""
    full = fe.run_policy(model, windows, 8, PROMPT, "oea", 1)
    short = fe.run_policy(model, windows[:, :-2], 8, PROMPT, "oea", 1)
    assert torch.equal(full.steps[..., :4], short.steps)
    logits = [routed_logits(model, rows, pol.oea(1)) for rows in (windows, windows[:, :-2])]
    torch.testing.assert_close(logits[0][:, :logits[1].shape[1]], logits[1], rtol=1e-5, atol=1e-5)


def test_glm_group_mask_reproduces_the_router_top_k():
    model = tiny_model("glm")
    gate = model.model.layers[0].mlp.gate
    hidden = torch.randn(40, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, _, ids = gate(hidden)
    spec = fe.router_spec(gate)
    assert spec.scoring_func == "sigmoid" and spec.num_groups == 4 and spec.restrict_groups
    selection, _ = score_experts(logits, spec)
    mine = pol.topk_within(selection, fe.group_mask(gate, selection), K)
    assert used_sets(mine) == used_sets(ids)


# ---- policies ----

@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("k0", [1, 2, 3])
def test_oea_policy_is_the_reference(grouped, k0):
    s = step_scores(k0, grouped=grouped)
    ids, weights = pol.oea(k0)(s)
    selection = mask_foreign_groups(s.selection, s.topk_ids, 4) if grouped else s.selection
    ref_ids, ref_w = opportunistic_route(selection, s.weight, s.topk_ids, s.topk_weights, k0)
    assert torch.equal(torch.where(ref_w > 0, ref_ids, -1), ids)
    assert torch.equal(ref_w, weights)


@pytest.mark.parametrize("k0", [1, 2, 3])
def test_pruned_keeps_exactly_the_k0_best(k0):
    s = step_scores(10 + k0)
    ids, weights = pol.pruned(k0)(s)
    assert ((ids >= 0).sum(dim=1) == k0).all()
    best = s.selection.topk(k0, dim=1).indices
    assert used_sets(ids) == used_sets(best)
    torch.testing.assert_close(weights.sum(dim=1), s.topk_weights.sum(dim=1))
    assert (weights[ids < 0] == 0).all()


def brute_budget(s: pol.StepScores, kept_count: int):
    """Summed top-K weight per expert by loops, top E (ties to lower id), each row's top-K among them."""
    demand = [0.0] * N
    for r in range(s.topk_ids.shape[0]):
        for j in range(K):
            demand[int(s.topk_ids[r, j])] += float(s.topk_weights[r, j])
    positive = sorted((e for e in range(N) if demand[e] > 0), key=lambda e: (-demand[e], e))
    kept = set(positive[:kept_count])
    rows = []
    for r in range(s.topk_ids.shape[0]):
        allowed = [e for e in kept if s.group_mask[r, e]]
        rows.append(set(sorted(allowed, key=lambda e: (-float(s.selection[r, e]), e))[:K]))
    return kept, rows


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("kept_count", [3, 6, 9])
def test_budget_matches_brute_force(grouped, kept_count):
    s = step_scores(20 + kept_count, grouped=grouped)
    ids, weights = pol.budget(kept_count)(s)
    kept, rows = brute_budget(s, kept_count)
    assert used_sets(ids) == rows
    assert len(kept) == kept_count
    if not grouped:  # every row can reach every kept expert: exactly E experts are used
        assert pol.distinct_used(ids, N) == kept_count
    torch.testing.assert_close(weights.sum(dim=1), s.topk_weights.sum(dim=1))


def test_budget_breaks_demand_ties_by_lower_id():
    logits = torch.full((2, N), -5.0)
    logits[0, [3, 7, 1, 2]] = torch.tensor([4.0, 4.0, 3.0, 3.0])
    logits[1, [7, 3, 1, 2]] = torch.tensor([4.0, 4.0, 3.0, 3.0])
    weight = torch.softmax(logits, dim=1)
    ids = logits.topk(K, dim=1).indices
    w = weight.gather(1, ids) / weight.gather(1, ids).sum(dim=1, keepdim=True)
    s = pol.StepScores(logits, logits, weight, ids, w, torch.ones(2, N, dtype=torch.bool), RouterSpec("softmax"))
    out, _ = pol.budget(3)(s)
    assert used_sets(out) == [{1, 3, 7}, {1, 3, 7}]  # 1 and 2 tie on demand: 1 stays


@pytest.mark.parametrize("p", [0.3, 0.6, 0.9, 1.0])
def test_top_p_reaches_the_mass_with_the_fewest_experts(p):
    s = step_scores(30)
    for min_count in (1, 2):
        ids, weights = pol.top_p(p, min_count)(s)
        ranked = s.selection.topk(K, dim=1).indices
        mass = s.weight.gather(1, ranked)
        mass = mass / mass.sum(dim=1, keepdim=True)
        for r in range(ids.shape[0]):
            n = int((ids[r] >= 0).sum())
            assert set(ids[r, :n].tolist()) == set(ranked[r, :n].tolist())
            assert min_count <= n <= K
            if n > min_count:  # one expert fewer would not reach p
                assert float(mass[r, :n - 1].sum()) < p
            assert n == K or float(mass[r, :n].sum()) >= p - 1e-6
        torch.testing.assert_close(weights.sum(dim=1), s.topk_weights.sum(dim=1))


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("k0", [1, 2, 3])
def test_oea_budget_at_a_small_cap_is_oea(grouped, k0):
    s = step_scores(40 + k0, grouped=grouped)
    assert_same_routing(pol.oea_budget(k0, 0)(s), pol.oea(k0)(s))


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("k0,cap", [(1, 4), (1, 8), (2, 10), (1, 100)])
def test_oea_budget_invariants(grouped, k0, cap):
    s = step_scores(50 + cap, rows=8, grouped=grouped)
    ids, weights = pol.oea_budget(k0, cap)(s)
    base = s.selection.masked_fill(~s.group_mask, float("-inf")).topk(k0, dim=1).indices
    union_of_bases = set(base.reshape(-1).tolist())
    assert torch.equal(ids[:, :k0], base)  # every row keeps its k0 best
    used = pol.distinct_used(ids, N)
    assert used <= max(cap, len(union_of_bases))
    assert used >= min(cap, len(union_of_bases))
    routed = set(s.topk_ids.reshape(-1).tolist())
    assert set().union(*used_sets(ids)) <= routed | union_of_bases  # added experts are wanted ones
    own = s.own_group_selection()
    assert all(own[r, e] > float("-inf") for r, row in enumerate(used_sets(ids)) for e in row)
    assert all(len(row) == int((r >= 0).sum()) for row, r in zip(used_sets(ids), ids))  # distinct ids
    torch.testing.assert_close(weights.sum(dim=1), s.topk_weights.sum(dim=1))


def test_oea_budget_adds_experts_by_demand():
    """Rows 0-2 all want expert 9 (not in any base): a cap of |U0| + 1 adds it, not expert 12."""
    logits = torch.full((3, N), -6.0)
    for r, top in enumerate((0, 1, 2)):
        logits[r, top] = 5.0
        logits[r, 9] = 2.0
        logits[r, [4, 5, 6][r]] = 1.0
        logits[r, 12] = 0.5 if r == 0 else -6.0
    weight = torch.softmax(logits, dim=1)
    ids = logits.topk(K, dim=1).indices
    w = weight.gather(1, ids) / weight.gather(1, ids).sum(dim=1, keepdim=True)
    s = pol.StepScores(logits, logits, weight, ids, w, torch.ones(3, N, dtype=torch.bool), RouterSpec("softmax"))
    out, _ = pol.oea_budget(1, 4)(s)
    assert used_sets(out) == [{0, 1, 2, 9}] * 3


def test_oea_mass_bases_are_the_top_p_sets():
    s = step_scores(60, rows=8)
    ids, weights = pol.oea_mass(0.6)(s)
    base_ids, _ = pol.top_p(0.6)(s)
    union = set().union(*used_sets(base_ids))
    for r in range(ids.shape[0]):
        assert used_sets(base_ids)[r] <= used_sets(ids)[r] <= union
    assert pol.distinct_used(ids, N) == len(union)
    full, _ = pol.oea_mass(1.0)(s)  # a base of all K: plain routing's sets
    assert used_sets(full) == used_sets(s.topk_ids)


@pytest.mark.parametrize("grouped", [False, True])
def test_p_zero_keeps_one_expert_per_row(grouped):
    """top_p(0) is pruned(1) and oea_mass(0) is oea(1): the study reuses those runs for p = 0."""
    s = step_scores(70, rows=8, grouped=grouped)
    assert [torch.equal(a, b) for a, b in zip(pol.top_p(0.0)(s), pol.pruned(1)(s))] == [True, True]
    assert_same_routing(pol.oea_mass(0.0)(s), pol.oea(1)(s))


def test_topk_within_breaks_score_ties_by_lower_id():
    selection = torch.tensor([[1.0, 2.0, 2.0, 2.0, float("-inf")]])
    allowed = torch.tensor([[True, True, False, True, True]])
    assert pol.topk_within(selection, allowed, 3).tolist() == [[1, 3, 0]]
    assert pol.topk_within(selection, allowed, 5).tolist() == [[1, 3, 0, -1, -1]]


# ---- T counting and rows ----

def test_distinct_used_counts_used_slots_only():
    ids = torch.tensor([[0, 3, -1], [3, 5, -1], [-1, -1, -1]])
    assert pol.distinct_used(ids, 8) == 3


def test_plain_T_is_the_union_of_each_step(model, windows):
    got = fe.evaluate(model, windows, 4, PROMPT, pol.plain)
    recorded = []
    hooks = [layer.mlp.gate.gate.register_forward_hook(lambda m, i, o: recorded.append(o[2]))
             for layer in fe_moe_layers(model)]
    with torch.no_grad():
        model(input_ids=windows[:4, :-1], use_cache=False)
    for h in hooks:
        h.remove()
    seq_len = windows.shape[1] - 1
    for layer, ids in enumerate(recorded):
        per_step = ids.view(4, seq_len, K)[:, PROMPT:]
        expect = [len(set(per_step[:, t].reshape(-1).tolist())) for t in range(per_step.shape[1])]
        assert got.steps[0, layer].tolist() == expect


def fake_scored(nll, steps):
    return fe.Scored(torch.tensor(nll, dtype=torch.float64), torch.tensor([3, 4]), torch.tensor(steps), 4)


def test_rows_carry_the_keys_and_the_report_writes(tmp_path):
    base = fake_scored([4.0, 8.0], [[[10, 12]]])
    rows = [fc.summary_row("m", "plain", None, 2, base, base)]
    per_seq = {fc.row_id(rows[0]): base.nll / 4}
    for name, knob, nll, t in (("oea", 1, [4.4, 8.8], 5), ("oea", 2, [4.2, 8.2], 8),
                               ("budget", 6, [4.8, 8.4], 6), ("oea_budget", [1, 6], [4.6, 8.4], 6)):
        got = fake_scored(nll, [[[t, t]]])
        rows.append(fc.summary_row("m", name, knob, 2, got, base))
        per_seq[fc.row_id(rows[-1])] = got.nll / 4
    for row in rows:
        assert tuple(row)[:len(fc.ROW_KEYS)] == fc.ROW_KEYS
    assert rows[1]["mean_T"] == 5 and rows[1]["T_plain"] == 11
    # One batch of 2: one cluster, so the interval is the point.
    assert rows[1]["clusters"] == 1
    assert rows[1]["nll_delta_lo"] == rows[1]["nll_delta_hi"] == pytest.approx(rows[1]["nll_delta"])
    frep.write_all(str(tmp_path), rows, per_seq, {"count": 2, "seed": 0, "prompt_len": 1, "continuation": 4}, 1.0)
    saved = json.loads((tmp_path / "frontier.json").read_text())
    assert [tuple(r)[:len(fc.ROW_KEYS)] for r in saved] == [fc.ROW_KEYS] * len(rows)
    assert [r["clusters"] for r in saved] == [1] * len(rows)
    assert (tmp_path / "frontier.png").stat().st_size > 0
    md = (tmp_path / "frontier.md").read_text()
    assert "B=2" in md and "inconclusive (1 batch)" in md and "| better |" not in md
    frep.rewrite_report(str(tmp_path))  # --report-only: the same rows from the saved files
    again = json.loads((tmp_path / "frontier.json").read_text())
    assert [list(r) for r in again] == [list(r) for r in saved]
    for key in ("nll_delta_lo", "nll_delta_hi"):
        assert [r[key] for r in again] == pytest.approx([r[key] for r in saved])


def test_interpolation_at_matched_T():
    rows = [{"model": "m", "policy": "a", "knob": k, "batch": 1, "mean_T": t} for k, t in ((1, 2.0), (2, 6.0))]
    per_seq = {fc.row_id(rows[0]): torch.tensor([1.0, 3.0]), fc.row_id(rows[1]): torch.tensor([0.0, 1.0])}
    torch.testing.assert_close(fc.curve_at(rows, per_seq, 3.0), torch.tensor([0.75, 2.5]))
    assert fc.curve_at(rows, per_seq, 7.0) is None
    lo, hi = stats.bootstrap_mean_ci(torch.full((5,), 0.25), fc.BOOTSTRAP_RESAMPLES)
    assert lo == pytest.approx(0.25) and hi == pytest.approx(0.25)


def test_distinct_per_batch_is_distinct_used_per_block():
    ids = torch.randint(-1, 10, (3, 8, 4), generator=torch.Generator().manual_seed(3))
    got = fe.distinct_per_batch(ids, 4, 10)
    assert got.tolist() == [[pol.distinct_used(ids[t, g * 4:(g + 1) * 4], 10) for g in range(2)] for t in range(3)]


# ---- paired batch-cluster intervals ----

def test_paired_intervals_cancel_what_both_arms_share_and_few_batches_are_inconclusive():
    """Both arms of a paired difference get the same drawn batches: a batch effect common to
    both cancels. With 4 batches the verdict is inconclusive whatever the interval."""
    gen = torch.Generator().manual_seed(6)
    a = (5 * torch.randn(4, 1, generator=gen, dtype=torch.float64) + torch.zeros(4, 8)).reshape(-1)
    rows = [{"model": "m", "policy": name, "knob": 1, "batch": 8, "mean_T": 3.0} for name in ("a", "b")]
    per_seq = {fc.row_id(rows[0]): a, fc.row_id(rows[1]): a + 0.01}
    got = fc.paired_at(rows[:1], rows[1:], per_seq, 3.0)
    assert got["clusters"] == 4
    assert got["lo"] == pytest.approx(-0.01) and got["hi"] == pytest.approx(-0.01)
    assert fc.verdict_of(got) == "inconclusive"
    assert fc.verdict_of(dict(got, clusters=fc.MIN_CLUSTERS)) == "better"
    assert fc.verdict_text("inconclusive", 4) == "inconclusive (4 batches)"
