"""Kept router mass in the serving reports (benchmark/oea/common/oea_metrics.py, trial/verdict.py,
common/report.py), on synthetic /metrics samples: a window counts only the samples labelled with its
k0 on the lowest tp_rank, decode and verify pooled; absent counters give None; runs pool by
token-layers; the trial's table and ab_serving's table show the column. No server.
"""

import pytest

from common import report
from common import oea_metrics
from trial import verdict as tr
from trial.throughput import arm_rows


def lost(k0, value, mode="decode", rank=0):
    return (f'sglang:oea_router_mass_lost_total{{k0="{k0}",mode="{mode}",model_name="m",tp_rank="{rank}"}}',
            float(value))


def layers(k0, value, mode="decode", rank=0):
    return (f'sglang:oea_routed_token_layers_total{{k0="{k0}",mode="{mode}",model_name="m",tp_rank="{rank}"}}',
            float(value))


def page(*samples):
    """A /metrics page holding `samples`, with the HELP/TYPE lines Prometheus writes."""
    return "# HELP sglang:oea_router_mass_lost_total lost\n# TYPE sglang:oea_router_mass_lost_total counter\n" + \
        "".join(f"{k} {v}\n" for k, v in samples)


def test_a_window_counts_only_its_own_k0_on_the_lowest_rank():
    """The k0=4 arm's last 100 token-layers (lost 30) reach /metrics during the next arm's window
    (OEA off, k0 0, which counts 400 token-layers and loses nothing)."""
    end_k4 = dict([lost(4, 50), layers(4, 200), layers(0, 1000)])
    end_k0 = dict([lost(4, 80), layers(4, 300), layers(0, 1400),
                   lost(4, 999, rank=1), layers(4, 999, rank=1)])  # rank 1 differs: only rank 0 is read
    assert oea_metrics.kept_router_mass(end_k4, end_k0, k0=0) == 1.0  # the late lost mass is not its own
    assert oea_metrics.kept_router_mass(end_k4, end_k0, k0=4) == pytest.approx(1 - 30 / 100)
    # no k0: everything that reached /metrics in the window, labels ignored
    assert oea_metrics.kept_router_mass(end_k4, end_k0) == pytest.approx(1 - 30 / 500)
    # the same from /metrics pages
    assert oea_metrics.kept_router_mass(page(*end_k4.items()), page(*end_k0.items()), 4) == pytest.approx(0.7)


def test_modes_pool_and_the_lowest_rank_is_numeric():
    after = dict([lost(5, 10, "decode", 10), layers(5, 100, "decode", 10),
                  lost(5, 6, "decode", 2), layers(5, 40, "decode", 2), lost(5, 4, "verify", 2),
                  layers(5, 60, "verify", 2)])
    delta = oea_metrics.mass_delta({}, after, 5)
    assert delta == {"lost": 10.0, "token_layers": 100.0, "tp_rank": "2"}  # rank 2, not "10"
    assert oea_metrics.kept_router_mass({}, after, 5) == pytest.approx(0.9)


def test_absent_counters_or_no_token_give_none():
    steps_only = page(('sglang:oea_decode_steps_applied_total{k0="4",mode="decode",tp_rank="0"}', 7.0))
    assert oea_metrics.kept_router_mass(steps_only, steps_only, 4) is None  # a plugin without the counters
    counted = dict([lost(4, 5), layers(4, 50)])
    assert oea_metrics.kept_router_mass(counted, counted, 4) is None  # no token in the window
    assert oea_metrics.kept_router_mass({}, counted, 6) is None  # no sample at this k0
    assert oea_metrics.kept_router_mass(None, counted, 4) is None  # /metrics did not answer
    # the token-layer counter alone (no mass lost yet at that k0): all kept
    assert oea_metrics.kept_router_mass({}, dict([layers(0, 80)]), 0) == 1.0


def run(arm, k0, conc, rep, tput, delta, error=None):
    record = {"arm": arm, "k0": None if arm == report.BASELINE else k0, "concurrency": conc, "repeat": rep,
              "seed": rep, "output_throughput": tput, "median_tpot_ms": 10.0, "oea_live": {"oea_k0": k0},
              "oea_metrics_delta": dict(delta)}
    return {**record, "error": error} if error else record


def records():
    """C=4, two repeats: the off arm (k0 0) and k0=4; one k0=4 delta also holds the off arm's late
    token-layers, which are not its own."""
    return [run(report.BASELINE, 0, 4, 0, 100.0, [layers(0, 500)]),
            run("oea-k0=4", 4, 4, 0, 110.0, [lost(4, 10), layers(4, 100), layers(0, 60)]),
            run(report.BASELINE, 0, 4, 1, 100.0, [lost(4, 3), layers(4, 20), layers(0, 500)]),
            run("oea-k0=4", 4, 4, 1, 120.0, [lost(4, 90), layers(4, 300)]),
            run("oea-k0=4", 4, 4, 2, 120.0, [lost(4, 300), layers(4, 300)], error="bench failed")]


def test_runs_pool_by_token_layers():
    runs = [r for r in records() if r["arm"] == "oea-k0=4"]
    # (10 + 90) lost over (100 + 300) token-layers: 0.75, not the mean of 0.9 and 0.7; the failed run is left out
    assert oea_metrics.kept_mass_in_runs(runs) == pytest.approx(0.75)
    assert oea_metrics.kept_mass_in_runs([{**runs[0], "oea_metrics_delta": {}}]) is None


def test_the_trial_report_shows_the_column():
    rows = arm_rows(records())
    assert rows[(4, report.BASELINE)]["kept_router_mass"] == 1.0
    assert rows[(4, "oea-k0=4")]["kept_router_mass"] == pytest.approx(0.75)
    table = tr.arm_table(rows, speculative=False)
    assert table[0].endswith("| OEA applied | kept router mass |")
    assert table[2].startswith("| 4 | baseline | 2 |") and table[2].endswith("| 1.000 |")
    assert table[3].startswith("| 4 | oea-k0=4 | 2 |") and table[3].endswith("| 0.750 |")
    old = {key: {**row, "kept_router_mass": None} for key, row in rows.items()}  # a plugin without the counters
    assert tr.arm_table(old, speculative=False)[3].endswith("| - |")

    quality = {"tool": "quality-ab", "prompts": "p.jsonl", "metric": "accuracy", "concurrency": 4,
               "per_k0": {4: {"baseline": 0.5, "oea": 0.5, "n": 8, "delta": 0.0, "low": -0.1, "high": 0.1,
                              "margin": 0.02, "within": False,
                              "oea_applied": {"share": 0.9, "kept_router_mass": 0.8125}}}}
    assert "OEA applied in 90% of the arm's decode steps, kept router mass 0.812" in tr.quality_lines(quality)[2]

    markdown = tr.render_markdown(trial_result(rows))
    note = next(line for line in markdown.splitlines() if line.startswith("Kept router mass:"))
    for text in ("own top-k router weight", "lower means OEA gave up more of the router's own choice",
                 "docs/quality-signal.md", "docs/metrics.md"):
        assert text in note


def trial_result(rows):
    """results.json's content as trial.result_of builds it, with only what render_markdown reads."""
    return {"model": "m", "label": None, "url": "http://x", "started": "s", "finished": "f", "status": "done",
            "prompts": "p", "preflight": {"speculative": None, "lines": [], "warnings": [], "gates": []},
            "arms": list(rows.values()), "quality": None, "cells": [],
            "recommendation": {"k0": 0, "reason": "no k0 qualifies"}, "restored": {"oea_k0": 0},
            "restore_note": "the settings found at the start"}


def test_the_ab_table_shows_the_column_where_counted():
    summary = report.summarize(records())
    assert summary.kept_mass == {(4, report.BASELINE): 1.0, (4, "oea-k0=4"): pytest.approx(0.75)}
    lines = report.markdown_table(summary).splitlines()
    assert lines[2].endswith("| ratio vs baseline | kept router mass |")
    assert lines[4].startswith("| 4 | baseline |") and lines[4].endswith("| 1 (ref) | 1.000 |")
    assert lines[5].startswith("| 4 | oea-k0=4 |") and lines[5].endswith("| 0.750 |")
    assert any(line.startswith("Kept router mass:") for line in lines)

    older = [{**r, "oea_metrics_delta": {}} for r in records()]  # no counters in any run: no column
    table = report.markdown_table(report.summarize(older))
    assert "kept router mass" not in table.lower()
