"""benchmark/oea/serving/demo.py (`make demo`): its command line for ab_serving, its held-out prompt
file (token for token the held-out windows), its expert table. No server.
"""

import json
import os

import pytest

from common import report
from training import heldout
from serving import ab_serving, demo, demo_cost
from serving.prompt_files import check_prompt_file, num_prompts_for

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TRAINED_MODEL = os.path.join(_ROOT, "benchmark", "oea", "models", "qwen3_moe_stdlib")


def _parse(argv):
    args = ab_serving.build_parser().parse_args(argv)
    ab_serving.apply_defaults(args)
    return args


def test_demo_command_line():
    args = demo.build_parser().parse_args(["--out-dir", "/tmp/d", "--port", "31999"])
    assert (args.oea_min_batch, args.oea_max_batch) == (demo.DEFAULT_MIN_BATCH, demo.DEFAULT_MAX_BATCH)
    assert args.k0 == [4] and args.concurrency == [4, 16] and args.repeats == 3
    assert args.model_path == demo.TRAINED_MODEL and args.prompts == "heldout" and not args.random_weights
    assert not args.two_servers and args.cost
    assert demo.prompt_count(args.concurrency) == 128
    argv = demo.ab_argv(args, "/tmp/d/heldout_prompts.json")
    own, server_args = ab_serving._split_passthrough(argv)
    ab = _parse(own)
    assert ab.cpu and ab.model_path == os.path.abspath(TRAINED_MODEL) and ab.port == 31999 and not ab.bench_subprocess
    assert ab.prompt_file == "/tmp/d/heldout_prompts.json"
    assert ab.k0 == [4] and ab.concurrency == [4, 16] and ab.repeats == 3
    assert not ab.two_servers and ab.switch_warmup_prompts is None  # one server, k0 set live
    assert (ab.input_len, ab.output_len, ab.warmup_prompts) == (64, 64, 8)
    assert (ab.oea_min_batch, ab.oea_max_batch) == (demo.DEFAULT_MIN_BATCH, demo.DEFAULT_MAX_BATCH)
    assert [num_prompts_for(c, ab) for c in ab.concurrency] == [32, 128]  # eight waves
    assert max(num_prompts_for(c, ab) for c in ab.concurrency) == demo.prompt_count(ab.concurrency)
    assert ab_serving.oea_flags(4, ab)[:2] == ["--oea-k0", "4"]
    assert "--load-format" not in server_args and "--enable-metrics" in server_args  # the trained weights
    assert demo.LABEL in ab.title
    head = demo.header(args)
    assert demo.LABEL in head and "qwen3_moe_stdlib: Qwen3MoeForCausalLM, 128 experts, top-8, hidden 128" in head
    assert "trained weights (Python standard library source" in head and "held-out text" in head

    # the random-weight comparison: same checkpoint (architecture, tokenizer, prompts), dummy weights
    rand = demo.build_parser().parse_args(["--random-weights", "--k0", "3", "5", "--concurrency", "2", "8",
                                           "--repeats", "5", "--oea-min-batch", "4", "--oea-max-batch", "32",
                                           "--two-servers"])
    own, server_args = ab_serving._split_passthrough(demo.ab_argv(rand, "p.json"))
    ab = _parse(own)
    assert (ab.k0, ab.concurrency, ab.repeats, ab.oea_min_batch, ab.oea_max_batch) == ([3, 5], [2, 8], 5, 4, 32)
    assert ab.two_servers and "one server per arm" in demo.header(rand)
    assert ab.model_path == os.path.abspath(TRAINED_MODEL) and ab.prompt_file == "p.json"
    assert server_args[-2:] == ["--load-format", "dummy"] and "DUMMY weights" in ab.title
    assert "DUMMY weights" in demo.header(rand)

    ids = demo.build_parser().parse_args(["--prompts", "random-ids", "--model-path", "/elsewhere"])
    assert demo.prepare_prompts(ids) is None and "--prompt-file" not in demo.ab_argv(ids)
    assert "random token ids" in demo.header(ids)
    with pytest.raises(SystemExit, match="--prompts heldout: /elsewhere has no heldout.txt"):
        demo.prepare_prompts(demo.build_parser().parse_args(["--model-path", "/elsewhere"]))


def test_demo_prompts_are_heldout_windows_token_for_token(tmp_path):
    from transformers import AutoTokenizer

    path = demo.write_heldout_prompts(TRAINED_MODEL, str(tmp_path / "p.json"), 6, prompt_len=16, continuation_len=8)
    rows = heldout.prompt_continuations(TRAINED_MODEL, 6, 16, 8, demo.HELDOUT_SEED)
    tok = AutoTokenizer.from_pretrained(TRAINED_MODEL)  # as bench_serving tokenizes the prompts
    entries = json.load(open(path))
    assert [tok.encode(e["conversations"][0]["value"]) for e in entries] == [r["prompt_ids"] for r in rows]
    assert [tok.encode(e["conversations"][1]["value"]) for e in entries] == [r["continuation_ids"] for r in rows]
    args = _parse(["--cpu", "--model-path", TRAINED_MODEL, "--prompt-file", path, "--num-prompts", "6",
                   "--warmup-prompts", "6", "--input-len", "16"])
    assert check_prompt_file(args).startswith("p.json sha256:")


def _record(arm, c, rep=0, ratio=None, applied=None, tpot=10.0, tput=100.0):
    """A demo record; ratio: OEA gauges after the run (before 40/44, after 20/22 per layer); applied:
    the OEA steps its counter deltas show (None: no deltas, as in files from before they existed)."""
    r = {"arm": arm, "k0": None if arm == "baseline" else int(arm[-1]), "concurrency": c, "repeat": rep,
         "seed": 1 + rep, "num_prompts": 8, "input_len": 64, "output_len": 64, "output_throughput": tput,
         "median_tpot_ms": tpot}
    if ratio is not None:
        r["oea_metrics"] = {'sglang:oea_active_experts_before{layer="0"}': 40.0,
                            'sglang:oea_active_experts_before{layer="1"}': 44.0,
                            'sglang:oea_active_experts_after{layer="0"}': 20.0,
                            'sglang:oea_active_experts_after{layer="1"}': 22.0,
                            'sglang:oea_active_experts_ratio{tp_rank="0"}': ratio}
    if applied is not None:
        r["oea_metrics_delta"] = {'sglang:oea_decode_steps_applied_total{tp_rank="0",mode="decode"}': applied}
    return r


def test_demo_expert_table():
    recs = [_record("baseline", c) for c in (1, 4, 16, 64)] + [
        _record("oea-k0=4", 1, ratio=0.3), _record("oea-k0=4", 4, ratio=0.5),
        _record("oea-k0=4", 16, ratio=0.6, applied=0.0),  # one server: a gauge left by another run
        _record("oea-k0=4", 64, ratio=0.9)]
    table = demo.expert_table(recs, report.summarize(recs), min_batch=2, max_batch=32)
    assert table.splitlines()[2:] == ["| 1 | off (C < min batch 2) |", "| 4 | 42.0 -> 21.0 (0.50x) |",
                                      "| 16 | - |", "| 64 | off (C > max batch 32) |"]
    assert demo.expert_table(recs[:4] + [_record("oea-k0=4", 4)], report.summarize(recs), 2, 0) == ""


def test_not_resolved_cells():
    """A ratio is resolved with >= 3 repeats whose min and max lie within 5% of their median."""
    spread = report.Spread
    assert report.resolved(spread(1.10, 1.05, 1.15, 3))  # +-4.5%
    assert not report.resolved(spread(1.10, 1.04, 1.15, 3))  # -5.5%
    assert not report.resolved(spread(1.10, 1.10, 1.10, 2))  # too few repeats to tell
    recs = [_record(arm, c, rep, tput=tput) for arm, c, rep, tput in (
        ("baseline", 4, 0, 100), ("baseline", 4, 1, 100), ("baseline", 4, 2, 100),
        ("oea-k0=4", 4, 0, 112), ("oea-k0=4", 4, 1, 110), ("oea-k0=4", 4, 2, 114),  # 1.10-1.14: resolved
        ("baseline", 16, 0, 100), ("baseline", 16, 1, 100), ("baseline", 16, 2, 100),
        ("oea-k0=4", 16, 0, 95), ("oea-k0=4", 16, 1, 112), ("oea-k0=4", 16, 2, 120))]  # 0.95-1.20
    summary = report.summarize(recs)
    rows = report.side_by_side_table(summary, report.RESOLVED_WITHIN).splitlines()[2:]
    assert rows[0].startswith("| 4 | 100.0 | 112.0 (1.12x) |")
    assert rows[1].startswith("| 16 | 100.0 | 112.0 (not resolved: 0.95-1.20, 3 repeats, ±15%) |")
    assert report.side_by_side_table(summary).splitlines()[3].startswith("| 16 | 100.0 | 112.0 (1.12x) |")
    note = report.unresolved_note(summary)
    assert "oea-k0=4 at C=16 (0.95-1.20, 3 repeats, ±15%)" in note and "C=4" not in note
    assert note in report.markdown_table(summary)


def test_demo_cost_inputs():
    """The cost section's inputs: T from runs where OEA applied, TPOT paired by repeat."""
    recs = [_record("baseline", 16, rep, tpot=t) for rep, t in enumerate((40.0, 42.0, 41.0))] + [
        _record("oea-k0=4", 16, 0, ratio=0.5, applied=50.0, tpot=36.0),
        _record("oea-k0=4", 16, 1, ratio=0.5, applied=0.0, tpot=39.0),  # stale gauges: T not read here
        _record("oea-k0=4", 16, 2, tpot=35.5)]
    assert demo_cost.arm_experts(recs, "oea-k0=4", 16) == (42.0, 21.0)
    saving = demo_cost.paired_tpot_saving(recs, "oea-k0=4", 16)
    assert (saving.median, saving.lo, saving.hi, saving.n) == (4.0, 3.0, 5.5, 3)
    assert demo_cost.cost_cells(recs, report.summarize(recs)) == [(16, "oea-k0=4", 4, 42.0, 21.0)]
    assert "baseline - oea-k0=4 = +4.00 ms (min-max +3.00 to +5.50 over 3 repeats), against +1.50 ms" in \
        demo_cost.tpot_line(recs, "oea-k0=4", 16, 1.5)
