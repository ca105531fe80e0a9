"""The A/B harness's smoke path against a real CPU server (serving/ab_serving.run_smoke), as `make demo`
runs it: the shipped trained Qwen3-MoE (benchmark/oea/models/qwen3_moe_stdlib) with its own weights,
prompts from its held-out text (demo.write_heldout_prompts, given as --prompt-file); baseline and
OEA k0=4 at two concurrencies, a few prompts each, on ONE server started with --oea-k0 0, k0 set
live between runs (POST /set_internal_state, confirmed through /server_info); bench_serving runs in
one driver process (the default). A few minutes on 2 cores: the server start dominates.

Needs the plugin's live settings (the server side of `/set_internal_state` for oea_k0): without
them ab_serving stops at the first switch (exit code 2) and this test fails.
"""

import json
import os

import pytest

pytestmark = pytest.mark.server

from common import report  # noqa: E402  (benchmark/oea, on sys.path through conftest.py)
from serving import ab_serving, demo  # noqa: E402
from common.oea_metrics import applied_in_run  # noqa: E402
from serving.servers import free_port  # noqa: E402

CONCURRENCIES = (1, 2)
NUM_PROMPTS = 4
INPUT_LEN, OUTPUT_LEN = 16, 8  # --smoke's lengths


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ab_smoke"))
    prompts = demo.write_heldout_prompts(demo.TRAINED_MODEL, os.path.join(out, demo.PROMPT_FILE), NUM_PROMPTS,
                                         INPUT_LEN, OUTPUT_LEN)
    # OEA may apply from 2 requests on; counters exported every decode step, so each run's deltas are its own
    summary = ab_serving.run_smoke(out, model_path=demo.TRAINED_MODEL, k0=4, concurrencies=CONCURRENCIES,
                                   num_prompts=NUM_PROMPTS, port=free_port(), prompt_file=prompts,
                                   oea_min_batch=2, server_args=["--decode-log-interval", "1"])
    return out, summary


def test_smoke_records_both_arms_at_both_concurrencies(smoke):
    out, summary = smoke
    records = report.load_jsonl(os.path.join(out, "results.jsonl"))
    assert sorted((r["arm"], r["concurrency"]) for r in records) == sorted(
        (arm, c) for arm in ("baseline", "oea-k0=4") for c in CONCURRENCIES)
    for r in records:
        assert "error" not in r, r.get("error")
        assert r["repeat"] == 0 and r["seed"] == 1 and r["num_prompts"] == NUM_PROMPTS
        assert r["k0"] == (4 if r["arm"] == "oea-k0=4" else None)
        # one server; every scheduler confirmed the arm's k0 before its runs (the baseline: 0, OEA off)
        assert r["server_mode"] == "one-server" and r["url"] == records[0]["url"]
        assert {s["k0"] for s in r["oea_states"]} == {r["k0"] or 0}
        # OEA acted in the k0=4 arm's C=2 runs only: off in the baseline, below min batch at C=1
        applied = applied_in_run(r)
        assert applied > 0 if (r["k0"], r["concurrency"]) == (4, 2) else applied == 0, (r["arm"], r["concurrency"])
        assert r["completed"] == NUM_PROMPTS and r["max_concurrency"] == r["concurrency"]
        assert r["output_throughput"] > 0 and r["median_tpot_ms"] > 0
        assert "server_info" not in r
        # the same held-out prompts, cut to the same length, and every output token decoded (EOS ignored)
        assert r["prompts"] == records[0]["prompts"] and r["prompts"].startswith(demo.PROMPT_FILE + " sha256:")
        assert r["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
        assert r["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert summary.arms == ["baseline", "oea-k0=4"] and summary.concurrencies == list(CONCURRENCIES)
    assert set(summary.ratios) == {(c, "oea-k0=4") for c in CONCURRENCIES}
    assert summary.warnings == []


def test_smoke_writes_table_plot_and_logs(smoke):
    out, _ = smoke
    table = open(os.path.join(out, "results.md")).read()
    for c in CONCURRENCIES:
        assert f"| {c} | baseline | 1 |" in table and f"| {c} | oea-k0=4 | 1 |" in table
    assert "Warnings" not in table
    with open(os.path.join(out, "results.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    command = open(os.path.join(out, "command.txt")).read().splitlines()[0]
    assert f"--concurrency {CONCURRENCIES[0]} {CONCURRENCIES[1]} " in command and "--smoke" in command
    assert command.endswith(f"--prompt-file {os.path.join(out, demo.PROMPT_FILE)} -- --decode-log-interval 1")
    info = json.load(open(os.path.join(out, "server_info_oea-k0=4.json")))
    assert isinstance(info, dict) and info.get("load_format") != "dummy"  # the trained weights
    # what the switch's check read: k0 4 accepted (pending until the next forward pass, or in force)
    assert [(s["oea"].get("pending") or s["oea"])["k0"] for s in info["internal_states"]] == [4]
    # every run went through the one bench driver, each run's output in its log
    assert os.path.getsize(os.path.join(out, "runs", "one-server_driver.log")) > 0
    for arm in ("baseline", "oea-k0=4"):
        for c in CONCURRENCIES:
            text = open(os.path.join(out, "runs", f"{arm}_c{c}_r0.log")).read()
            assert text.splitlines()[0].split()[1:3] == ["-m", "sglang.benchmark.serving"]
            assert "bench driver process" in text and "Output token throughput" in text
            assert "--dataset-name random --dataset-path " in text.splitlines()[0]
