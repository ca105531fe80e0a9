"""The live quality signal, kept router mass: its definition (sglang_oea.reference.lost_router_mass)
against a brute-force computation, the torch path's per-layer counting, and what the metrics make of
the counters (sglang_oea.metrics). The fused kernel is checked against the same brute force on the
GPU check's case grid (test_oea_kernel.py) and under graph replay (test_graph_path.py).
"""

import torch

from gpu.gpu_compare import brute_force_lost_units
from oea_fixtures import NUM_EXPERTS, TOP_K, router_inputs, topk_config
from sglang_oea import metrics
from sglang_oea.config import LiveSettings, OEAConfig
from sglang_oea.counters import LOST
from sglang_oea.reference import MASS_ONE, lost_router_mass, lost_router_mass_units, opportunistic_route
from sglang_oea.routing import RouterSpec, score_experts
from sglang_oea.runtime import DECODE, OEARuntime

SHARED_CONFIG = topk_config(1)
LAYERS = (1, 2, 4)


def reference_route(logits, ids, weights, k0, rows=None):
    selection, weight = score_experts(logits, RouterSpec("softmax"))
    return opportunistic_route(selection, weight, ids, weights, k0, rows)


def test_definition_matches_brute_force_on_random_routings():
    for seed, rows, k0 in ((1, 16, 1), (2, 16, 3), (3, 5, 6), (4, 64, 2)):
        logits, ids, weights = router_inputs(rows, seed)
        new_ids, new_weights = reference_route(logits, ids, weights, k0)
        units = lost_router_mass_units(ids, weights, new_ids, new_weights, NUM_EXPERTS)
        want, counted = brute_force_lost_units(ids, weights, new_ids, new_weights, NUM_EXPERTS, rows)
        assert abs(int(units) - want) <= counted and want > 0


def test_definition_on_adversarial_rows():
    """Ties (every score equal: the lower ids win), a -1 id and a zero-weight row, padded rows."""
    logits = torch.zeros(6, NUM_EXPERTS)  # all tied
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=torch.Generator().manual_seed(r))[:TOP_K]
                       for r in range(6)]).int()
    weights = torch.full((6, TOP_K), 1.0 / TOP_K)
    new_ids, new_weights = reference_route(logits, ids, weights, 2, rows=4)
    share = lost_router_mass(ids, weights, new_ids, new_weights, NUM_EXPERTS)
    for r in range(4):
        final = set(new_ids[r][new_weights[r] > 0].tolist())
        assert share[r].item() == sum(1 for e in ids[r].tolist() if e not in final) / TOP_K
    ids[0, 5], weights[1] = -1, 0.0  # a -1 column counts in neither sum; no own weight: nothing lost
    share = lost_router_mass(ids, weights, new_ids, new_weights, NUM_EXPERTS)
    final = set(new_ids[0][new_weights[0] > 0].tolist())
    mine = [e for e in ids[0].tolist() if e >= 0]
    assert abs(share[0].item() - sum(1 for e in mine if e not in final) / len(mine)) < 1e-6 and share[1].item() == 0.0
    want, _ = brute_force_lost_units(ids, weights, new_ids, new_weights, NUM_EXPERTS, 4)
    assert int(lost_router_mass_units(ids, weights, new_ids, new_weights, NUM_EXPERTS, rows=4)) == want


def test_unchanged_routing_loses_nothing_exactly():
    logits, ids, weights = router_inputs(9, seed=7)
    assert int(lost_router_mass_units(ids, weights, ids.flip(1), weights.flip(1), NUM_EXPERTS)) == 0
    scaled = lost_router_mass(ids, weights * 2.5, ids[:, :TOP_K // 2], weights[:, :TOP_K // 2], NUM_EXPERTS)
    assert torch.allclose(scaled, 1 - weights[:, :TOP_K // 2].sum(1) / weights.sum(1)), "scale cancels"


def routed_passes(rt: OEARuntime, k0s, rows: int = 8):
    """One eager decode pass per k0 (changed live before it) through LAYERS, with a fused shared
    column; returns the brute-force lost units per (layer, k0)."""
    want = {}
    for i, k0 in enumerate(k0s):
        rt.request_settings(LiveSettings(k0=k0, min_batch=1, max_batch=0))
        rt.begin_step(DECODE, rows)
        for layer in LAYERS:
            logits, ids, weights = router_inputs(rows, seed=100 * i + layer, shared=1)
            out = rt.route(ids, weights, SHARED_CONFIG, logits, layer)
            if out is not None:
                units, _ = brute_force_lost_units(ids[:, :TOP_K], weights[:, :TOP_K], out[0][:, :TOP_K],
                                                  out[1][:, :TOP_K], NUM_EXPERTS, rows)
                want[(layer, k0)] = want.get((layer, k0), 0) + units
        rt.end_step()
    return want


def test_torch_path_files_each_layer_under_the_k0_of_the_pass():
    rt = OEARuntime(OEAConfig(k0=2, min_batch=1, kernel="torch"))
    want = routed_passes(rt, (2, 3, 2, 0, 8))
    lost = rt.counters.table[:, LOST:]
    for (layer, k0), units in want.items():
        assert abs(int(lost[layer, k0]) - units) <= 16, (layer, k0)
    assert {tuple(pair) for pair in lost.nonzero().tolist()} == {
        (layer, k0) for layer in LAYERS for k0 in (2, 3)}


def test_kept_mass_per_k0_is_exactly_one_where_oea_changed_nothing():
    rt = OEARuntime(OEAConfig(k0=2, min_batch=1, kernel="torch"))
    routed_passes(rt, (2, 2, 0, 0, 8, 8, 1, 1))
    # The ring's second-newest snapshot: every pass but the last (k0 = 1).
    parts = {p.k0: p for p in metrics.kept_mass_between(rt.read_snapshot(), None, rt.moe_layers())}
    assert sorted(parts) == [0, 1, 2, 8] and rt.moe_layers() == LAYERS
    assert parts[0].kept == 1.0 and parts[8].kept == 1.0 and parts[0].token_layers == 2 * 8 * len(LAYERS)
    assert parts[1].tokens == 8 and 0 < parts[1].kept < parts[2].kept < 1.0, "k0 = 1 keeps the least"
    lost = rt.counters.table[:, LOST:]
    assert parts[2].lost == {layer: int(lost[layer, 2]) for layer in LAYERS}
    assert abs(parts[2].layer_kept(4) - (1 - int(lost[4, 2]) / (MASS_ONE * 16))) < 1e-12
    first = rt.read_snapshot()
    line = metrics.summary(rt, None, [parts[0], parts[2]])
    assert "kept router mass" not in line, "no part at the k0 in force (1)"
    routed_passes(rt, (1,))
    later = metrics.kept_mass_between(rt.read_snapshot(), first, LAYERS)
    assert [p.k0 for p in later] == [1] and later[0].tokens == 8, "the interval holds the eighth pass only"
    lowest = min(later[0].layer_kept(layer) for layer in LAYERS)
    line = metrics.summary(rt, None, later)
    assert line.endswith(f", kept router mass {later[0].kept:.3f} (lowest layer {lowest:.3f})"), line


def test_intervals_add_up_to_the_whole():
    rt = OEARuntime(OEAConfig(k0=2, min_batch=1, kernel="torch"))
    routed_passes(rt, (2, 3))
    first = rt.read_snapshot()
    routed_passes(rt, (3, 2, 2))
    second = rt.read_snapshot()
    parts = [metrics.kept_mass_between(first, None, LAYERS), metrics.kept_mass_between(second, first, LAYERS)]
    whole = {p.k0: p for p in metrics.kept_mass_between(second, None, LAYERS)}
    for k0 in (2, 3):
        pieces = [p for ps in parts for p in ps if p.k0 == k0]
        assert sum(p.tokens for p in pieces) == whole[k0].tokens
        assert sum(p.lost[4] for p in pieces) == whole[k0].lost[4]


def test_prometheus_series(monkeypatch):
    import prometheus_client

    registry = prometheus_client.CollectorRegistry()
    for kind in ("Counter", "Gauge"):
        cls = getattr(prometheus_client, kind)
        monkeypatch.setattr(prometheus_client, kind, lambda *a, _cls=cls, **kw: _cls(*a, registry=registry, **kw))
    rt = OEARuntime(OEAConfig(k0=2, min_batch=1, kernel="torch"))
    export = metrics.PrometheusExport("m", 0, rt.settings)
    routed_passes(rt, (2, 2, 0, 0, 0))
    parts = metrics.kept_mass_between(rt.read_snapshot(), None, rt.moe_layers())
    export.publish(rt, None, parts)
    by_k0 = {p.k0: p for p in parts}

    def value(name, **labels):
        return registry.get_sample_value(name, dict(model_name="m", tp_rank="0", mode="decode", **labels))

    assert value("sglang:oea_kept_router_mass", k0="0") == 1.0
    assert value("sglang:oea_kept_router_mass", k0="2") == by_k0[2].kept < 1.0
    assert value("sglang:oea_routed_token_layers_total", k0="2") == 16 * len(LAYERS)
    assert abs(value("sglang:oea_router_mass_lost_total", k0="2") - by_k0[2].lost_mass) < 1e-9
    assert value("sglang:oea_router_mass_lost_total", k0="0") == 0.0
    assert value("sglang:oea_layer_kept_router_mass", k0="2", layer="4") == by_k0[2].layer_kept(4)
    assert value("sglang:oea_layer_kept_router_mass", k0="0", layer="1") == 1.0
