"""benchmark/oea/common/report.py (the A/B table, paired ratios, plot) and ab_serving's report-only
mode, on recorded JSONL fixtures (test/srt/data/ab_*.jsonl; every expected number below is worked out
by hand from them): medians, paired ratios and their min-max, the flagging of runs that cannot be
paired, the PNG. No server, no GPU.
"""

import os

import pytest

from common import report
from serving import ab_serving

_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
CLEAN = os.path.join(_DATA, "ab_clean.jsonl")
MISMATCH = os.path.join(_DATA, "ab_mismatch.jsonl")


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-12)


def test_clean_fixture_medians():
    s = report.summarize(report.load_jsonl(CLEAN))
    assert s.arms == ["baseline", "oea-k0=4"]
    assert s.concurrencies == [1, 4]
    assert s.warnings == []
    b1, o1 = s.stats[(1, "baseline")], s.stats[(1, "oea-k0=4")]
    assert (b1["output_throughput"].median, b1["output_throughput"].lo, b1["output_throughput"].hi) == (100, 90, 110)
    assert b1["median_tpot_ms"].median == 10 and b1["median_itl_ms"].median == 10 and b1["p99_ttft_ms"].median == 50
    assert (o1["output_throughput"].median, o1["output_throughput"].lo, o1["output_throughput"].hi) == (121, 108, 130)
    assert o1["median_tpot_ms"].median == 8.5 and o1["median_itl_ms"].median == 8.2 and o1["p99_ttft_ms"].median == 42
    b4, o4 = s.stats[(4, "baseline")], s.stats[(4, "oea-k0=4")]
    assert b4["output_throughput"].median == 200 and b4["median_tpot_ms"].median == 20
    assert b4["median_itl_ms"].median == 19 and b4["p99_ttft_ms"].median == 80
    assert (o4["output_throughput"].median, o4["output_throughput"].lo, o4["output_throughput"].hi) == (190, 171, 242)
    assert o4["median_tpot_ms"].median == 21 and o4["median_itl_ms"].median == 20 and o4["p99_ttft_ms"].median == 85
    assert all(st.n == 3 for cell in s.stats.values() for st in cell.values())


def test_clean_fixture_ratios_pair_by_repeat():
    s = report.summarize(report.load_jsonl(CLEAN))
    # C=1: 130/100, 121/110, 108/90 = 1.3, 1.1, 1.2 (the ratio of medians would be 1.21)
    r1 = s.ratios[(1, "oea-k0=4")]
    assert (r1.median, r1.lo, r1.hi, r1.n) == (approx(1.2), approx(1.1), approx(1.3), 3)
    # C=4: 190/200, 242/220, 171/180 = 0.95, 1.1, 0.95
    r4 = s.ratios[(4, "oea-k0=4")]
    assert (r4.median, r4.lo, r4.hi, r4.n) == (approx(0.95), approx(0.95), approx(1.1), 3)
    assert (1, "baseline") not in s.ratios


def test_clean_fixture_table():
    table = report.markdown_table(report.summarize(report.load_jsonl(CLEAN)), "clean")
    rows = [line for line in table.splitlines() if line.startswith("| 1 ") or line.startswith("| 4 ")]
    assert rows == [
        "| 1 | baseline | 3 | 100.0 (90.00-110.0) | 10.00 | 10.00 | 50.00 | 1 (ref) |",
        "| 1 | oea-k0=4 | 3 | 121.0 (108.0-130.0) | 8.500 | 8.200 | 42.00 | 1.200 (1.100-1.300) |",
        "| 4 | baseline | 3 | 200.0 (180.0-220.0) | 20.00 | 19.00 | 80.00 | 1 (ref) |",
        "| 4 | oea-k0=4 | 3 | 190.0 (171.0-242.0) | 21.00 | 20.00 | 85.00 | 0.950 (0.950-1.100) |",
    ]
    assert "Warnings" not in table


def test_mismatch_fixture_is_flagged_not_compared():
    s = report.summarize(report.load_jsonl(MISMATCH))
    assert s.arms == ["baseline", "oea-k0=3", "oea-k0=4"]
    assert s.concurrencies == [1, 4, 8]
    # C=8 exists only for k0=4: no baseline there, so no ratio
    assert (8, "oea-k0=4") in s.stats and (8, "oea-k0=4") not in s.ratios
    # C=1, k0=4 pairs normally: 150/100, 132/120
    r = s.ratios[(1, "oea-k0=4")]
    assert (r.median, r.lo, r.hi, r.n) == (approx(1.3), approx(1.1), approx(1.5), 2)
    # C=4, k0=3: repeat 0 differs in workload, repeat 2 has no baseline; only 300/240 remains
    r = s.ratios[(4, "oea-k0=3")]
    assert (r.median, r.lo, r.hi, r.n) == (approx(1.25), approx(1.25), approx(1.25), 1)
    w = "\n".join(s.warnings)
    assert "oea-k0=4 C=8: no baseline run at this concurrency; not compared" in w
    assert "oea-k0=4 C=4: baseline has runs at this concurrency, oea-k0=4 has none" in w
    assert "oea-k0=3 C=4 repeat 0: workload differs from baseline (num_prompts 8 vs 99)" in w
    assert "oea-k0=3 C=4: repeat 2 missing from baseline" in w
    assert "oea-k0=3 C=1 repeat 0: run failed" in w
    assert "oea-k0=3 C=1: baseline has runs at this concurrency, oea-k0=3 has none" in w
    table = report.markdown_table(s)
    assert "| 8 | oea-k0=4 | 1 | 500.0 | 8.000 | 8.000 | 40.00 | not compared |" in table
    assert "**Warnings**" in table


def test_disagreeing_concurrency_reported_by_bench_is_flagged():
    recs = report.load_jsonl(CLEAN)
    recs[3]["max_concurrency"] = 2  # oea-k0=4 C=1 repeat 0 ran at another concurrency
    s = report.summarize(recs)
    assert any("bench_serving reports max_concurrency=2" in w for w in s.warnings)


def test_runs_on_different_prompt_sets_are_not_compared():
    recs = report.load_jsonl(CLEAN)  # recorded before records named their prompts: all compared
    recs[3]["prompts"] = "p.json sha256:0123456789ab"  # oea-k0=4 C=1 repeat 0
    s = report.summarize(recs)
    assert any("workload differs from baseline (prompts None vs p.json sha256:0123456789ab)" in w
               for w in s.warnings)
    assert s.ratios[(1, "oea-k0=4")].n == report.summarize(report.load_jsonl(CLEAN)).ratios[(1, "oea-k0=4")].n - 1


def test_plot_writes_png(tmp_path):
    s = report.summarize(report.load_jsonl(MISMATCH))
    path = report.plot(s, str(tmp_path / "ab.png"), "mismatch")
    with open(path, "rb") as f:
        head = f.read(8)
    assert head == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 10_000


def test_from_jsonl_cli(tmp_path, capsys):
    assert ab_serving.main(["--from-jsonl", CLEAN, "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1.200 (1.100-1.300)" in out
    for name in ("results.md", "results.png"):
        assert os.path.getsize(tmp_path / name) > 0
    with open(tmp_path / "results.md") as f:
        assert "| 4 | oea-k0=4 | 3 | 190.0 (171.0-242.0)" in f.read()


def test_side_by_side_table():
    table = report.side_by_side_table(report.summarize(report.load_jsonl(CLEAN)))
    lines = table.splitlines()
    assert lines[0] == "| C | baseline tok/s | oea-k0=4 tok/s | baseline TPOT ms | oea-k0=4 TPOT ms |"
    assert lines[2:] == ["| 1 | 100.0 | 121.0 (1.20x) | 10.00 | 8.500 |",
                         "| 4 | 200.0 | 190.0 (0.95x) | 20.00 | 21.00 |"]
