"""benchmark/oea/cost/: cpu_routing_cost.py and step_cost.py (with moe_layer_cost.py) end to end, tiny
iteration counts, no timing asserted; moe_layer_cost's top-k ids."""

import pytest
import torch

from cost import cpu_routing_cost, moe_layer_cost, step_cost


def test_cpu_routing_cost_reports_every_batch_size_and_refuses_bad_k0(capsys):
    table = cpu_routing_cost.main(["--batch-sizes", "2", "8", "--repeats", "2", "--iters", "2", "--warmup", "1"])
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["2", "8"]
    width = 1 + 2 * len(cpu_routing_cost.VARIANTS)  # B, the variants, the op count, a ratio per variant but plain
    assert all(len(row.strip("|").split("|")) == width and row.rstrip("|").endswith("x ") for row in rows)
    ops = 2 + len(cpu_routing_cost.VARIANTS)
    assert all(int(row.split("|")[ops]) > 0 for row in rows)  # the torch ops of one oea call
    assert table in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--k0"):
        cpu_routing_cost.main(["--k0", "8"])


@pytest.mark.parametrize("batch, top_k, distinct", [(16, 8, 8), (16, 8, 38), (16, 8, 64), (3, 8, 24), (5, 4, 7)])
def test_spread_ids_use_exactly_t_distinct_experts(batch, top_k, distinct):
    ids = moe_layer_cost.spread_ids(batch, top_k, 128, distinct)
    assert ids.shape == (batch, top_k) and ids.dtype == torch.int32
    assert len(set(ids.flatten().tolist())) == distinct
    assert all(len(set(row)) == top_k for row in ids.tolist())  # no expert twice in a row


def test_step_cost_end_to_end():
    """Both micro-benchmarks on the demo model's shapes (tiny iteration counts; no timing is asserted
    beyond being positive); the MoE layer runs in a subprocess under the CPU engine's environment."""
    cost = step_cost.main(["--batch", "4", "--t-before", "20.4", "--t-after", "10", "--repeats", "1", "--iters", "2"])
    assert (cost.batch, cost.layers, cost.t_before, cost.t_after) == (4, 4, 20.4, 10)
    assert min(cost.plain_us, cost.oea_us, cost.moe_before_us, cost.moe_after_us) > 0
    assert cost.saved_ms == pytest.approx(4 * (cost.moe_before_us - cost.moe_after_us) / 1000)
    assert cost.net_ms == pytest.approx(cost.saved_ms - 4 * cost.oea_us / 1000)
    text = step_cost.describe(cost)
    assert "OEA's own work (measured" in text and "MoE work saved (measured" in text and "(estimated" in text
    shapes = step_cost.Shapes()
    assert [step_cost.feasible_t(t, 4, shapes) for t in (20.4, 3, 100)] == [20, 8, 32]  # within [K, B * K]
    config = {"num_local_experts": 128, "num_experts_per_tok": 8, "hidden_size": 128, "moe_intermediate_size": 32,
              "num_hidden_layers": 4, "mlp_only_layers": [3]}
    assert step_cost.Shapes.of_config(config) == step_cost.Shapes(128, 8, 128, 32, 3)
