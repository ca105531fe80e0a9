"""studies/host_steadiness.py: the block summary of a timing series."""

from studies.host_steadiness import sample, summarize


def test_blocks_split_the_series_by_time_and_report_milliseconds():
    times = [0.04, 0.06, 0.5, 0.5, 0.03, 0.07]  # seconds
    summary = summarize(times, block_seconds=0.1)
    assert [b["n"] for b in summary["blocks"]] == [2, 1, 1, 2]
    assert summary["blocks"][0] == {"median": 50.0, "min": 40.0, "max": 60.0, "n": 2}
    assert summary["overall"]["min"] == 30.0 and summary["overall"]["max"] == 500.0
    assert summary["overall"]["n"] == 6


def test_a_trailing_partial_block_is_kept():
    summary = summarize([0.2, 0.01], block_seconds=0.1)
    assert [b["n"] for b in summary["blocks"]] == [1, 1]


def test_sample_times_the_loop_for_about_the_given_time():
    times = sample(0.2)
    assert times and all(t > 0 for t in times)
    assert 0.2 <= sum(times) < 0.2 + 2 * max(times)
