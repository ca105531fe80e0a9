"""benchmark/oea/studies/simulate.py: closed forms against Monte-Carlo, OEA's saving, fidelity
bounds, suggest_max_batch, router-logit dumps, the command line. No server, no GPU.
"""

import os

import pytest
import torch

from studies import simulate


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-12)


def test_closed_forms_values():
    assert simulate.expected_t_vanilla(128, 8, 1) == approx(8.0)
    assert simulate.expected_t_vanilla(128, 8, 16) == approx(128 * (1 - (120 / 128) ** 16))
    assert simulate.expected_t_oea(256, 3, 32) == approx(256 * (1 - (253 / 256) ** 32))
    assert simulate.expected_saving(128, 8, 8, 16) == approx(0.0)


@pytest.mark.parametrize("n,k,k0,b", [(128, 8, 4, 16), (256, 8, 3, 32)])
def test_closed_forms_match_monte_carlo(n, k, k0, b):
    cfg = simulate.ModelConfig("t", n, k)
    (p,) = simulate.simulate(cfg, "uniform", [k0], [b], trials=150, min_rows=0, seed=1)
    assert p.batches == 150
    assert p.t_vanilla == pytest.approx(simulate.expected_t_vanilla(n, k, b), rel=0.02)
    assert p.t_oea[k0] == pytest.approx(simulate.expected_t_oea(n, k0, b), rel=0.03)


def test_oea_saves_experts_and_fidelity_bounds():
    pts = simulate.simulate(simulate.ModelConfig("t", 64, 8, "sigmoid"), "zipf", [2, 5, 8], [1, 8, 64],
                            trials=6, min_rows=0, seed=2)
    for p in pts:
        assert p.t_oea[2] < p.t_oea[5] < p.t_vanilla
        assert p.t_oea[8] == p.t_vanilla
        for k0 in (2, 5, 8):
            assert 0.0 <= p.mass_kept[k0] <= 1.0 + 1e-6 and 0.0 <= p.overlap[k0] <= 1.0
            assert p.t_loaded[k0] >= max(p.t_oea[k0], 8)  # fills: each batch loads max(T_oea, k)
        assert p.mass_kept[8] == pytest.approx(1.0) and p.overlap[8] == 1.0
    assert pts[0].overlap[5] == pytest.approx(5 / 8)  # B=1: plain top-k0
    assert pts[0].t_loaded[2] == 8  # a lone row is filled up to k experts of weight 0


def test_closed_form_saving_below_vanilla_for_all_k0():
    for n in (128, 256):
        for k0 in range(1, 8):
            for b in (1, 16, 64):
                assert simulate.expected_t_oea(n, k0, b) < simulate.expected_t_vanilla(n, 8, b)


def test_suggest_max_batch():
    for n in (128, 256):
        got = [simulate.suggest_max_batch(n, 8, k0) for k0 in (1, 2, 3, 4, 5, 6, 7)]
        assert all(a >= b for a, b in zip(got, got[1:])), got  # smaller k0 keeps saving longer
        for k0, m in zip(range(1, 8), got):
            assert simulate.expected_saving(n, 8, k0, m) >= 0.05
            assert simulate.expected_saving(n, 8, k0, 2 * m) < 0.05
    assert simulate.suggest_max_batch(128, 8, 8) is None
    assert simulate.suggest_max_batch(128, 8, 7, min_saving=0.2) is None  # 1 - 7/8 < 0.2 even at B=1
    assert simulate.suggest_max_batch(128, 8, 3, min_saving=0.2) <= simulate.suggest_max_batch(128, 8, 3)


def _write_dump(d, rank, step, layer, logits, **kw):
    rec = {"router_logits": logits, "layer_id": layer, "step": step, "batch_size": kw.pop("batch_size", logits.shape[0]),
           "top_k": 4, "scoring_func": "softmax", "correction_bias": None, "num_expert_group": 1, "topk_group": 1}
    rec.update(kw)
    torch.save(rec, os.path.join(d, f"rank{rank}_step{step:06d}_layer{layer:03d}.pt"))


def test_dumps_softmax_and_grouped_sigmoid(tmp_path):
    gen = torch.Generator().manual_seed(0)
    soft, grouped = tmp_path / "soft", tmp_path / "grouped"
    soft.mkdir()
    grouped.mkdir()
    for step in range(3):
        for layer in range(2):
            _write_dump(str(soft), 0, step, layer, torch.randn(6, 32, generator=gen), batch_size=5)
            _write_dump(str(soft), 1, step, layer, torch.full((6, 32), float("nan")))  # other rank: unused
    bias = torch.randn(32, generator=gen) * 0.1
    for step in range(2):
        _write_dump(str(grouped), 0, step, 0, torch.randn(3 + step, 32, generator=gen), scoring_func="sigmoid",
                    correction_bias=bias, num_expert_group=4, topk_group=2)

    (p,) = simulate.simulate_dumps(str(soft), [2, 4])
    assert (p.num_experts, p.top_k, p.batch_size, p.batches) == (32, 4, 5, 6)  # 3 steps x 2 layers, rank 0
    assert p.t_oea[2] <= p.t_vanilla and p.mass_kept[4] == pytest.approx(1.0)

    pts = simulate.simulate_dumps(str(grouped), [1, 2])
    assert [p.batch_size for p in pts] == [3, 4]
    for p in pts:
        assert p.t_oea[1] <= p.t_oea[2] <= p.t_vanilla and 0 < p.mass_kept[1] <= 1

    assert simulate.main(["--dump-dir", str(soft), "--k0", "2", "3", "--out-dir", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "simulate.png").stat().st_size > 0
    assert "## dump (N=32, k=4)" in (tmp_path / "o" / "simulate.md").read_text()


def test_vanilla_grouped_topk_stays_in_selected_groups():
    sel = torch.tensor([[0.9, 0.8, 0.1, 0.1, 0.5, 0.5, 0.7, 0.0]])  # 4 groups of 2
    router = simulate.Router.make("sigmoid", 2, torch.zeros(8), num_expert_group=4, topk_group=1)
    assert sorted(simulate.vanilla_topk(sel, router)[0].tolist()) == [0, 1]
    router = simulate.Router.make("sigmoid", 3, None, num_expert_group=4, topk_group=2)
    assert sorted(simulate.vanilla_topk(sel, router)[0].tolist()) == [0, 1, 6]


def test_simulate_cli_small(tmp_path):
    argv = ["--config", "64/4", "--k0", "2", "3", "--batch-sizes", "1", "4", "--trials", "2", "--min-rows", "0",
            "--out-dir", str(tmp_path)]
    assert simulate.main(argv) == 0
    md = (tmp_path / "simulate.md").read_text()
    assert "## N=64,k=4 / uniform (N=64, k=4)" in md and "Suggested --oea-max-batch" in md
    assert (tmp_path / "simulate.png").stat().st_size > 0
