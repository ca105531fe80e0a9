"""benchmark/oea/studies/quality_signals.py and signal_study.py: the candidate quality signals
against hand-computed cases and the product's OEA routing, the rank-correlation bootstrap, the
decision rule, and a smoke run of the study on a trained model."""

import json
import math
import os

import numpy as np
import pytest
import torch

from studies import frontier_eval as fe, policies as pol, quality_signals as qs, signal_study
from sglang_oea.routing import RouterSpec, route_from_logits, score_experts
from test_studies_frontier import tiny_model  # noqa: I001  (this folder's tiny random MoE models)

MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
                      "benchmark", "oea", "models")


def signals_of(weight, original, final, final_weights):
    """token_signals of one row given as lists: {name: float}."""
    got = qs.token_signals(torch.tensor([weight], dtype=torch.float64), torch.tensor([original]),
                           torch.tensor([final]), torch.tensor([final_weights], dtype=torch.float64))
    return {name: float(value[0]) for name, value in got.items()}


NO_CHANGE = {"mass_kept": 1.0, "final_mass": 1.0, "overlap": 1.0, "top1_kept": 1.0, "js": 0.0, "tv": 0.0}


def test_no_change_gives_one_and_zero_divergence():
    gen = torch.Generator().manual_seed(0)
    weight = torch.rand(32, 16, generator=gen, dtype=torch.float64)
    ids = weight.topk(4, dim=1).indices
    final = ids.flip(1)  # the same sets in another column order, at other (positive) weights
    got = qs.token_signals(weight, ids, final, torch.rand(32, 4, generator=gen) + 0.1)
    for name, value in NO_CHANGE.items():
        assert torch.allclose(got[name], torch.full((32,), value, dtype=torch.float64), atol=1e-12), name


def test_a_dropped_top1_gives_the_hand_computed_values():
    # w over 4 experts; S = {0, 1}; OEA keeps 1, drops the top-1 (0) and refills with 2.
    got = signals_of([0.6, 0.3, 0.1, 0.05], [0, 1], [1, 2], [0.75, 0.25])
    p, q = [2 / 3, 1 / 3, 0.0], [0.0, 0.75, 0.25]
    mid = [(a + b) / 2 for a, b in zip(p, q)]
    kl = lambda x: sum(a * math.log(a / m) for a, m in zip(x, mid) if a > 0)  # noqa: E731
    expected = {"mass_kept": 0.3 / 0.9, "final_mass": 0.4 / 0.9, "overlap": 0.5, "top1_kept": 0.0,
                "js": (kl(p) + kl(q)) / 2, "tv": 2 / 3}
    assert got == pytest.approx(expected, abs=1e-12)


def test_top1_ties_go_to_the_lower_id():
    weight = [0.1, 0.4, 0.2, 0.4]  # experts 1 and 3 tie for the top
    assert signals_of(weight, [1, 2, 3], [2, 3, 0], [1, 1, 1])["top1_kept"] == 0.0  # 1 dropped
    dropped_3 = signals_of(weight, [1, 2, 3], [1, 2, 0], [1, 1, 1])
    assert dropped_3["top1_kept"] == 1.0
    assert dropped_3["mass_kept"] == pytest.approx(0.6 / 1.0)


def test_shared_expert_columns_and_fill_slots_are_excluded():
    weight = [0.5, 0.3, 0.2, 0.1]
    plain = signals_of(weight, [0, 1, 2], [0, 1, 3], [0.5, 0.3, 0.1])
    # Column 4 = N is a fused shared expert (in both sets, at a large weight); a fill slot runs
    # expert 2 at weight 0, and an unused column is -1.
    fused = signals_of(weight, [0, 1, 2, 4], [0, 1, 3, 4, 2, -1], [0.5, 0.3, 0.1, 2.5, 0.0, 0.0])
    assert fused == pytest.approx(plain, abs=1e-12)
    assert plain["overlap"] == pytest.approx(2 / 3)


def test_disjoint_sets_give_the_finite_maxima():
    got = signals_of([0.4, 0.3, 0.2, 0.1], [0, 1], [2, 3], [1, 1])
    assert got["mass_kept"] == 0.0 and got["overlap"] == 0.0 and got["top1_kept"] == 0.0
    assert got["tv"] == pytest.approx(1.0) and got["js"] == pytest.approx(math.log(2))


@pytest.mark.parametrize("sigmoid", [False, True])
@pytest.mark.parametrize("k0", [1, 2, 3, 4])
def test_signals_of_the_products_oea_routing(sigmoid, k0):
    """On OEA's own routing: k0 = K changes nothing; below it every token keeps its k0 best routed
    experts (by selection score), so overlap >= k0 / K and the kept mass >= their share."""
    gen = torch.Generator().manual_seed(k0)
    rows, experts, k = 12, 16, 4
    logits = torch.randn(rows, experts, generator=gen) * 2
    spec = RouterSpec("sigmoid", torch.randn(experts, generator=gen) * 0.3) if sigmoid else RouterSpec("softmax")
    selection, weight = score_experts(logits, spec)
    ids = selection.topk(k, dim=1).indices
    topk_weights = weight.gather(1, ids) / weight.gather(1, ids).sum(dim=1, keepdim=True)
    final, final_weights = route_from_logits(logits, ids, topk_weights, spec, k0)
    got = qs.token_signals(weight, ids, final, final_weights)
    best = weight.gather(1, selection.topk(k0, dim=1).indices).sum(dim=1) / weight.gather(1, ids).sum(dim=1)
    assert bool((got["overlap"] >= k0 / k - 1e-12).all())
    assert bool((got["mass_kept"] >= best.double() - 1e-6).all())
    if k0 == k:
        for name, value in NO_CHANGE.items():
            assert torch.allclose(got[name], torch.full((rows,), value, dtype=torch.float64), atol=1e-6), name
    if not sigmoid:  # a softmax top-k holds the most mass of any k-set, so final_mass <= 1 ...
        assert bool((got["final_mass"] <= 1 + 1e-6).all())
        # ... and then tv = 1 - mass_kept exactly (all of q's excess lies on F).
        assert torch.allclose(got["tv"], 1 - got["mass_kept"], atol=1e-6)


@pytest.mark.parametrize("arch", ["qwen", "glm"])
def test_signal_gates_record_without_changing_the_result(arch):
    windows = torch.randint(0, 64, (8, 5 + 6 + 1), generator=torch.Generator().manual_seed(1))
    bare = fe.run_policy(tiny_model(arch), windows, 4, 5, "oea", 2)
    model = tiny_model(arch)
    gates = qs.install_signal_gates(model)
    got = fe.run_policy(model, windows, 4, 5, "oea", 2)
    assert torch.equal(got.nll, bare.nll) and torch.equal(got.steps, bare.steps)
    signals = qs.collect(gates)
    assert set(signals) == set(qs.SIGNALS)
    assert all(v.shape == (8, len(gates), 6) for v in signals.values())
    assert float(signals["overlap"].min()) >= 2 / 4 and float(signals["overlap"].mean()) < 1
    assert all(gate.records == [] for gate in gates)  # collect clears
    fe.evaluate(model, windows, 4, 5, pol.plain)
    plain = qs.collect(gates)
    assert bool((plain["mass_kept"] == 1).all()) and bool((plain["js"] == 0).all())


def test_spearman_ranks_ties_at_their_mean_and_refuses_constants():
    assert qs.spearman([1, 2, 3, 4], [10, 20, 25, 100]) == pytest.approx(1.0)
    assert qs.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # Ranks x = [1, 2.5, 2.5, 4] against [1, 2, 3, 4]: 4.5 / sqrt(4.5 * 5).
    assert qs.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(4.5 / math.sqrt(22.5))
    assert qs.spearman([1, 1, 1], [1, 2, 3]) is None and qs.spearman([1, 2], [1, 2]) is None


def test_rank_correlation_bootstrap_resamples_blocks():
    rng = np.random.default_rng(0)
    cost = np.linspace(0, 1, 6)[:, None] + rng.normal(0, 0.3, (6, 10))  # [cells, blocks]
    signal = -cost + rng.normal(0, 0.3, (6, 10))
    got = qs.rank_correlation([qs.Stratum(signal, cost)], resamples=500, seed=1)
    assert got["rho"] == pytest.approx(qs.spearman(signal.mean(axis=1), cost.mean(axis=1)))
    assert got["lo"] <= got["rho"] <= got["hi"] and got["hi"] - got["lo"] > 0.05
    assert got == qs.rank_correlation([qs.Stratum(signal, cost)], resamples=500, seed=1)  # seeded
    # Identical blocks: every resample computes the same cells, so the interval is the point.
    same = qs.rank_correlation([qs.Stratum(signal[:, :1].repeat(5, 1), cost[:, :1].repeat(5, 1))], 200)
    assert same["lo"] == same["hi"] == pytest.approx(same["rho"])
    assert qs.rank_correlation([qs.Stratum(signal[:, :1], cost[:, :1])], 200)["lo"] is None  # one block
    flipped = qs.oriented(got, qs.KEPT)
    assert (flipped["rho"], flipped["lo"], flipped["hi"]) == (-got["rho"], -got["hi"], -got["lo"])
    assert qs.oriented(got, qs.COST) == got


def test_pooled_rank_correlation_spans_the_strata():
    cost_a = np.array([[0.0, 0.0], [1.0, 1.2], [2.0, 1.8]])  # [cells, blocks]
    cost_b = np.array([[10.0, 10.0], [11.0, 11.0], [12.0, 12.0]])
    # Within each stratum the signal orders the cells perfectly; across them it inverts the order.
    signal_a, signal_b = cost_a + 20, cost_b - 20
    pooled = qs.rank_correlation([qs.Stratum(signal_a, cost_a), qs.Stratum(signal_b, cost_b)], 200)
    assert qs.rank_correlation([qs.Stratum(signal_a, cost_a)], 200)["rho"] == pytest.approx(1.0)
    assert pooled["cells"] == 6 and pooled["blocks"] == [2, 2]
    expected = qs.spearman(np.r_[signal_a.mean(1), signal_b.mean(1)], np.r_[cost_a.mean(1), cost_b.mean(1)])
    assert pooled["rho"] == pytest.approx(expected) and pooled["rho"] < 0


def test_histogram_quantiles_match_exact_ones_within_a_bin():
    values = np.random.default_rng(2).uniform(0.2, 0.9, (3, 1000))
    hist = qs.block_histograms(values, "mass_kept")
    for q in (0.05, 0.1, 0.9):
        got = qs.histogram_quantile(hist.sum(axis=0), "mass_kept", q)
        assert abs(float(got) - np.quantile(values, q)) <= 1 / qs.BINS + 1e-12


def test_the_decision_needs_the_threshold_on_every_model():
    def corr(a, b, pooled):
        return {"m1": {"rho": a}, "m2": {"rho": b}, "pooled": {"rho": pooled}}
    table = {"mass_kept/mean": corr(0.95, 0.91, 0.5), "js/mean": corr(0.99, 0.89, 0.9),
             "top1_kept/mean": corr(1.0, None, 1.0),  # undefined on m2: no candidate
             "t_ratio/mean": corr(0.99, 0.98, 0.9)}  # the reference is never a candidate
    got = signal_study.decide(table, ["m1", "m2"])
    assert got["best"] == got["ship"] == "mass_kept/mean" and got["reference_min_rho"] == 0.98
    assert [r["candidate"] for r in got["ranking"]] == ["mass_kept/mean", "js/mean"]  # top1_kept undefined on m2
    table["mass_kept/mean"] = corr(0.95, 0.85, 0.5)
    got = signal_study.decide(table, ["m1", "m2"])
    assert got["best"] == "js/mean" and got["ship"] is None


def test_smoke_run_on_a_trained_model(tmp_path):
    out = tmp_path / "run"
    assert signal_study.main(["--models", os.path.join(MODELS, "qwen3_moe_stdlib"), "--batches", "2", "4",
                              "--k0", "2", "7", "--count", "8", "--prompt-len", "8", "--continuation", "4",
                              "--resamples", "50", "--out-dir", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    cells = result["cells"]
    assert [(c["batch"], c["k0"]) for c in cells] == [(2, 2), (2, 7), (4, 2), (4, 7)]
    for c in cells:
        assert c["sequences"] == 8 and c["blocks"] == 2 and len(c["block_nll"]) == 2
        for name, entry in c["signals"].items():
            assert entry["q05"] <= entry["q10"] <= entry["q50"] <= entry["q90"] <= entry["q95"], name
    by = {(c["batch"], c["k0"]): c["signals"] for c in cells}
    assert by[(4, 7)]["overlap"]["mean"] > by[(4, 2)]["overlap"]["mean"] >= 2 / 8
    assert result["correlations"]["mass_kept/mean"]["qwen3_moe_stdlib"]["cells"] == 4
    for c in cells:  # T after OEA against plain routing's at the same B
        assert 0 < c["T_ratio"] <= 1 and c["T_plain"] >= c["mean_T"]
    assert by[(4, 2)]["overlap"]["mean"] < 1 and cells[2]["T_ratio"] < cells[3]["T_ratio"]
    assert result["decision"]["threshold"] == 0.9
    assert "## Decision" in (out / "results.md").read_text()
    with pytest.raises(SystemExit):  # --count not a multiple of the largest B
        signal_study.main(["--count", "6", "--batches", "4", "--out-dir", str(out)])


def test_settings_baseline_ranks_by_k0_and_batch():
    """signal_baselines: the settings-only predictor k0 + 0.5 log2(B) against the NLL increase, per
    model and pooled, beside the exported signals read from the study's block means."""
    from studies import signal_baselines as sb

    cells = []
    for model, scale in (("m1", 1.0), ("m2", 3.0)):
        for k0 in (1, 2, 3):
            for batch in (4, 16):
                cost = scale / (k0 + 0.5 * math.log2(batch))  # falls with the settings score
                # kept mass rises with k0 only: it cannot tell the two batch sizes apart
                kept = {"mass_kept": [0.1 * k0] * 4, sb.T_RATIO: [0.5 * k0 + batch / 64] * 4}
                cells.append({"model": model, "k0": k0, "batch": batch, "block_nll": [cost] * 4, "block_mean": kept})
    got = sb.correlations(cells, resamples=50)
    assert got[sb.SETTINGS]["m1"]["rho"] == pytest.approx(1.0) and got[sb.SETTINGS]["m2"]["rho"] == pytest.approx(1.0)
    assert got["mass_kept"]["m1"]["rho"] < 1.0, "ties within a k0 rank below the settings"
    assert set(got[sb.SETTINGS]) == {"m1", "m2", "m1+m2"}
    assert got[sb.SETTINGS]["m1+m2"]["rho"] < 1.0, "the two models' costs differ at the same settings"
    assert "| `k0 + 0.5 log2(B)`" in sb.markdown(got, "results.json")
