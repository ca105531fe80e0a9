"""benchmark/oea/serving/quality_ab.py and its modules: its measures and input checks (pure; the
intervals are tested in test_common_stats.py), the measures of studies/quality_learned.py (the
trained-model study; no server), then both arms on real servers.

The server tests share one CPU server (a start costs a minute or more on 2 cores), started at
k0 = top-k (a no-op): both arms on it at once with a noise-floor rerun, all identical; that
baseline arm is saved and reused (--baseline-from) after k0 1 is set live, which diverges. That
k0 >= top-k equals plain SGLang is test_live_settings.py's and test_speculative.py's; a report
whose OEA server exports no counters is checked without a server below.

The tiny model has a checkpoint with real random weights (tiny_model --random-weights) instead of
--load-format dummy: dummy weights are uniform in +-1e-3 for every tensor, norms included, so the
MoE output is some 1e-9 of the residual stream and no routing change can move a greedy token
(k0=1 applied on every decode step and left all outputs identical).
"""

import hashlib
import json
import os
import subprocess
import sys
from random import Random

import pytest

from common import stats
from common import oea_metrics
from serving import quality_ab as qa, quality_client, quality_inputs as qi, quality_scoring as qs
from serving.quality_report import write_json
from studies import quality_learned as ql
from test_server_e2e import TOP_K, make_model, serve, set_live


NUM_PROMPTS, CONCURRENCY, MAX_TOKENS = 24, 8, 16
# Flags of every server; the OEA arms add only --oea-*. Metrics are exported every decode step.
COMMON_FLAGS = ("--enable-metrics", "--decode-log-interval", "1")
server = pytest.mark.server  # the tests that start real servers
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(qa.__file__)), "quality_ab.py")


# ----------------------------------------------------------------------------- measures


def test_paired_difference_normal_ci_and_mcnemar():
    base = [True, True, False, False, True]
    oea = [True, False, True, True, True]  # d = 0, -1, 1, 1, 0: mean 0.2, sd sqrt(0.7)
    diff = qs.paired_difference(base, oea)
    half = stats.Z95 * 0.7 ** 0.5 / 5 ** 0.5
    assert diff["mean"] == pytest.approx(0.2)
    assert diff["ci95"] == pytest.approx((0.2 - half, 0.2 + half))
    assert (diff["oea_only_correct"], diff["baseline_only_correct"]) == (2, 1)
    assert diff["mcnemar_exact_p"] == pytest.approx(1.0)
    assert qs.paired_difference([True] * 4, [True] * 4)["ci95"] == (0.0, 0.0)
    assert qs.paired_difference([True], [False])["ci95"] is None


def test_first_divergence_and_agreement():
    assert qs.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert qs.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert qs.first_divergence([1, 2], [1, 2, 3]) == 2
    assert qs.first_divergence([], [4]) == 0
    pairs = [([1, 2, 3], [1, 2, 3]), ([1, 2, 3, 4], [1, 9, 3]), ([5], [])]
    agreement = qs.token_agreement(pairs)
    assert (agreement["positions_agreeing"], agreement["positions_compared"]) == (5, 6)
    assert agreement["token_agreement"] == pytest.approx(5 / 6)
    assert (agreement["identical"], agreement["identical_share"]) == (1, pytest.approx(1 / 3))
    assert qs.token_agreement([([], [])])["token_agreement"] is None


def test_divergence_distribution():
    positions = [0, 1, 2, 3, 5, 9]
    summary = qs.divergence_summary(positions)
    assert (summary["count"], summary["min"], summary["max"]) == (6, 0, 9)
    assert summary["median"] == pytest.approx(2.5)
    assert summary["p25"] == pytest.approx(1.25) and summary["p75"] == pytest.approx(4.5)
    assert summary["histogram"] == [{"bucket": "0", "count": 1}, {"bucket": "1", "count": 1},
                                    {"bucket": "2-3", "count": 2}, {"bucket": "4-7", "count": 1},
                                    {"bucket": "8-15", "count": 1}]
    assert qs.divergence_summary([])["median"] is None and qs.divergence_summary([])["histogram"] == []
    buckets = (("0", 0), ("1", 0), ("2-3", 0), ("4-7", 1))
    assert qs.divergence_histogram([4]) == [{"bucket": b, "count": c} for b, c in buckets]


def test_extract_answer():
    regex = qi.compile_regex(r"= *(-?\d+)", "x")
    assert qs.extract_answer(" 3 + 4 = 7, so", regex) == "7"
    assert qs.extract_answer("no number", regex) is None
    assert qs.extract_answer("a 12 b", qi.compile_regex(r"\d+", "x")) == "12"  # no group: the whole match
    assert qs.extract_answer("  yes \n", None) == "yes"


METRICS_BEFORE = """\
# TYPE sglang:oea_decode_steps_applied_total counter
sglang:oea_decode_steps_applied_total{model_name="m",tp_rank="1"} 10.0
sglang:oea_decode_steps_applied_total{model_name="m",tp_rank="0"} 10.0
sglang:oea_decode_steps_skipped_total{model_name="m",reason="not_decode",tp_rank="0"} 3.0
sglang:oea_decode_steps_skipped_total{model_name="m",reason="not_decode",tp_rank="1"} 3.0
"""
METRICS_AFTER = """\
sglang:oea_decode_steps_applied_total{model_name="m",tp_rank="10"} 99.0
sglang:oea_decode_steps_applied_total{model_name="m",tp_rank="1"} 40.0
sglang:oea_decode_steps_applied_total{model_name="m",tp_rank="0"} 40.0
sglang:oea_decode_steps_skipped_total{model_name="m",reason="not_decode",tp_rank="0"} 9.0
sglang:oea_decode_steps_skipped_total{model_name="m",reason="below_min_batch",tp_rank="0"} 10.0
sglang:oea_decode_steps_skipped_total{model_name="m",reason="below_min_batch",tp_rank="1"} 10.0
sglang:num_running_reqs{model_name="m"} 0.0
"""


def test_applied_share_from_metrics():
    applied = oea_metrics.applied_share(METRICS_BEFORE, METRICS_AFTER)
    assert applied["tp_rank"] == "0"  # the lowest rank, numerically ("10" > "1" > "0")
    assert (applied["applied_steps"], applied["decode_steps"]) == (30.0, 40.0)  # not_decode is not a decode step
    assert applied["share"] == pytest.approx(0.75)
    assert applied["skipped_steps"] == {"not_decode": 6.0, "below_min_batch": 10.0}
    assert oea_metrics.applied_share("sglang:num_running_reqs 0\n", "sglang:num_running_reqs 0\n") is None
    assert oea_metrics.applied_share(None, METRICS_AFTER) is None


def test_reference_match():
    assert qs.reference_match([1, 2, 3, 4], [1, 9, 3, 9]) == pytest.approx(0.5)
    assert qs.reference_match([1, 2], [1, 2, 3]) == 1.0  # positions of the shorter only
    assert qs.reference_match([], [1]) is None and qs.reference_match([1], []) is None


def test_reference_section_pairs_by_prompt():
    items = [qi.Item((1, 2), reference=(5, 6)), qi.Item("text"), qi.Item((3,), reference=(7, 8))]
    base = [{"token_ids": [5, 6]}, {"token_ids": [1]}, {"token_ids": [7, 0]}]
    oea = [{"token_ids": [5, 0]}, {"token_ids": [2]}, {"token_ids": [7, 0]}]
    assert qs.reference_matches(items, base) == [1.0, None, 0.5]
    section = qs.reference_section(items, base, oea)  # the prompt without reference_ids is left out
    assert (section["n"], section["baseline"], section["oea"]) == (2, 0.75, 0.5)
    assert section["mean"] == pytest.approx(-0.25)
    assert qs.reference_section(items[1:2], base[1:2], oea[1:2]) is None


# ----------------------------------------------------------------------------- input validation


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_load_prompts_ok(tmp_path):
    lines = ['{"prompt": "a", "answer": 3}', "", '{"prompt": "b", "answer": "x", "answer_regex": "(x)"}',
             '{"prompt": "c"}']
    path = write_lines(tmp_path / "p.jsonl", lines)
    items = qi.load_prompts(path, qi.compile_regex(r"(\d+)", "--answer-regex"))
    assert [(it.prompt, it.answer) for it in items] == [("a", "3"), ("b", "x"), ("c", None)]
    assert items[0].regex.pattern == r"(\d+)" and items[1].regex.pattern == "(x)"


def test_load_prompts_token_ids(tmp_path):
    lines = ['{"prompt": [5, 0, 17], "reference_ids": [3, 4]}', '{"prompt": "text"}']
    items = qi.load_prompts(write_lines(tmp_path / "p.jsonl", lines))
    assert items[0].prompt == (5, 0, 17) and items[0].reference == (3, 4)
    assert items[1].prompt == "text" and items[1].reference is None
    # The digest of text prompts is what it was before ids were accepted: saved arms stay valid.
    assert qi.prompts_digest(items[1:]) == hashlib.sha256(b'["text"]').hexdigest()


def test_token_id_prompts_are_sent_as_id_lists(monkeypatch):
    sent = []

    def answer(url, payload, timeout):
        sent.append(payload)
        return {"choices": [{"text": "x", "token_ids": [9], "finish_reason": "length"}]}

    monkeypatch.setattr(quality_client, "http_json", answer)
    opts = qa.build_parser().parse_args(["--prompts", "p", "--concurrency", "1", "--max-tokens", "1", "--out", "o"])
    assert quality_client.complete("http://h", "m", (4, 5), opts)["token_ids"] == [9]
    assert quality_client.complete("http://h", "m", "text", opts)["token_ids"] == [9]
    assert [p["prompt"] for p in sent] == [[4, 5], "text"]


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": []}'], "p.jsonl:1: field 'prompt' must be a non-empty string or a non-empty list of token ids"),
    (['{"prompt": [1, -2]}'], "p.jsonl:1: field 'prompt'"),
    (['{"prompt": [1, true]}'], "p.jsonl:1: field 'prompt'"),
    (['{"prompt": [1, 2.0]}'], "p.jsonl:1: field 'prompt'"),
    (['{"prompt": [1, "2"]}'], "p.jsonl:1: field 'prompt'"),
    (['{"prompt": [1], "reference_ids": []}'], "p.jsonl:1: field 'reference_ids'"),
    (['{"prompt": "a"}', '{"prompt": "a", "reference_ids": "12"}'], "p.jsonl:2: field 'reference_ids'"),
    (['{"prompt": "a"}', '{"prompt": "b"'], "p.jsonl:2: not valid JSON"),
    (['{"prompt": "a"}', "", '{"answer": 1}'], "p.jsonl:3: field 'prompt'"),
    (['{"prompt": 5}'], "p.jsonl:1: field 'prompt'"),
    (['["prompt"]'], "p.jsonl:1: expected a JSON object"),
    (['{"prompt": "a", "answer": [1]}'], "p.jsonl:1: field 'answer'"),
    (['{"prompt": "a", "answer_regex": "(unclosed"}'], "p.jsonl:1: field 'answer_regex': invalid regex"),
    ([""], "holds no prompts"),
])
def test_load_prompts_errors(tmp_path, lines, message):
    path = write_lines(tmp_path / "p.jsonl", lines)
    with pytest.raises(qi.InputError, match=message):
        qi.load_prompts(path)


def test_cli_input_errors_exit_nonzero(tmp_path, capsys):
    prompts = write_lines(tmp_path / "p.jsonl", ['{"prompt": "a"}'])
    common = ["--concurrency", "2", "--max-tokens", "4", "--out", str(tmp_path / "out")]
    url = ["--base-url", "http://127.0.0.1:9", "--oea-url", "http://127.0.0.1:9"]
    cases = [(["--prompts", str(tmp_path / "missing.jsonl")], "no such file"),
             (["--prompts", prompts, "--answer-regex", "a("], "--answer-regex: invalid regex"),
             (["--prompts", prompts, "--concurrency", "0"], "--concurrency must be at least 1")]
    for extra, message in cases:
        assert qa.main(url + common + extra) == 2
        assert message in capsys.readouterr().err
    assert qa.main(["--prompts", prompts] + common) == 2
    assert "--base-url" in capsys.readouterr().err
    saved = write_lines(tmp_path / "arm.json", [json.dumps({"prompts_sha256": "0" * 64})])
    assert qa.main(["--prompts", prompts, "--oea-url", "http://127.0.0.1:9", "--baseline-from", saved] + common) == 2
    assert "prompts_sha256" in capsys.readouterr().err
    assert qa.main(["--prompts", prompts] + url + common) == 1  # nothing listens on port 9
    assert "server error" in capsys.readouterr().err


def saved_arm(items, name, outputs, concurrency=2, max_tokens=2):
    """An arm record as run_arm writes it (no server)."""
    return {"name": name, "url": "saved", "model": "m", "concurrency": concurrency, "max_tokens": max_tokens,
            "ignore_eos": True, "prompts_sha256": qi.prompts_digest(items), "cache_flushed": True,
            "elapsed_s": 1.0, "outputs": [{"text": "", "token_ids": ids, "finish_reason": "length"} for ids in outputs],
            "oea_steps": None}


def test_report_from_two_saved_arms(tmp_path):
    """Token-id prompts with references, both arms saved: the report needs no server."""
    lines = ['{"prompt": [1, 2], "reference_ids": [3, 4]}', '{"prompt": [5], "reference_ids": [6, 7]}']
    prompts = write_lines(tmp_path / "p.jsonl", lines)
    items = qi.load_prompts(prompts)
    arms = {"baseline": saved_arm(items, "baseline", [[3, 4], [6, 0]]),
            "oea": saved_arm(items, "oea", [[3, 0], [6, 0]])}
    for name, arm in arms.items():
        write_json(str(tmp_path / f"arm_{name}.json"), arm)
    argv = ["--prompts", prompts, "--concurrency", "2", "--max-tokens", "2", "--ignore-eos", "--out", str(tmp_path),
            "--baseline-from", str(tmp_path / "arm_baseline.json"), "--oea-from", str(tmp_path / "arm_oea.json")]
    assert qa.main(argv) == 0
    report = json.load(open(tmp_path / "quality.json"))
    assert report["agreement"]["token_agreement"] == pytest.approx(3 / 4)
    ref = report["reference_match"]
    assert (ref["baseline"], ref["oea"], ref["mean"]) == (0.75, 0.5, pytest.approx(-0.25))
    assert "reference match OEA - baseline" in open(tmp_path / "quality.md").read()
    rows = [json.loads(line) for line in open(tmp_path / "outputs.jsonl")]
    assert rows[0]["prompt"] == [1, 2] and rows[0]["reference_match"] == {"baseline": 1.0, "oea": 0.5}


def test_baseline_counters_are_flagged_only_when_oea_applied():
    """A baseline armed with OEA off (one server, k0 0) exports OEA counters that applied nothing."""
    items = [qi.Item("a")]
    steps = {"share": 0.0, "applied_steps": 0.0, "decode_steps": 9.0, "skipped_steps": {}, "tp_rank": "0"}
    base, oea = saved_arm(items, "baseline", [[1]]), saved_arm(items, "oea", [[1]])
    oea["oea_steps"] = {**steps, "applied_steps": 9.0, "share": 1.0}
    assert qs.build_report(items, {**base, "oea_steps": steps}, oea)["warnings"] == []
    warned = qs.build_report(items, {**base, "oea_steps": {**steps, "applied_steps": 3.0}}, oea)["warnings"]
    assert warned == ["OEA applied in 3 decode steps of the baseline arm: is OEA really off there?"]
    plain = qs.build_report(items, base, {**oea, "oea_steps": None})  # an OEA "arm" without the plugin
    assert plain["oea_applied"] is None
    assert plain["warnings"] == ["the OEA server exports no OEA counters (start it with --enable-metrics): "
                                 "oea_applied is null"]


def test_script_exits_nonzero_on_bad_line(tmp_path):
    prompts = write_lines(tmp_path / "p.jsonl", ['{"prompt": "a"}', "not json"])
    argv = ["--base-url", "http://127.0.0.1:9", "--oea-url", "http://127.0.0.1:9", "--prompts", prompts,
            "--concurrency", "1", "--max-tokens", "1", "--out", str(tmp_path / "o")]
    proc = subprocess.run([sys.executable, SCRIPT, *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "p.jsonl:2: not valid JSON" in proc.stderr


# ----------------------------------------------------------------------------- quality_learned.py (no server)


DECODE_LOG = """\
[t] Decode batch, #running-req: 4, OEA k0=4: applied 0/3 decode steps
[t] Decode batch, #running-req: 4, OEA k0=4: applied 1/4 decode steps, experts/layer/step 30.0 -> 20.0 (0.67x)
[t] Decode batch, #running-req: 4, OEA k0=4: applied 2/5 decode steps, experts/layer/step 50.0 -> 20.0 (0.40x)
"""


def test_experts_from_log():
    experts = ql.experts_from_log(DECODE_LOG)
    assert (experts["before"], experts["after"], experts["lines"]) == (40.0, 20.0, 2)
    assert experts["ratio"] == pytest.approx(0.5)
    assert ql.experts_from_log("no decode lines")["before"] is None


@pytest.fixture(scope="module")
def tiny_scorer(tmp_path_factory):
    """A tiny random Qwen3-MoE saved and reloaded the way the study loads its scorer."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=48, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                            num_experts=8, num_experts_per_tok=2, max_position_embeddings=64)
    path = str(tmp_path_factory.mktemp("scorer"))
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    return ql.load_scorer(path)


def test_continuation_nll_equals_direct_computation(tiny_scorer):
    import torch

    prompts = [[1, 2, 3], [4, 5, 6], [7, 8], [9, 10, 11]]
    continuations = [[12, 13], [14, 15], [16, 17, 18], [19]]  # three (prompt, continuation) length pairs
    got = ql.continuation_nll(tiny_scorer, prompts, continuations, batch_size=1)
    for p, c, value in zip(prompts, continuations, got):
        with torch.no_grad():
            logits = tiny_scorer(input_ids=torch.tensor([p + c])).logits[0]  # [P + L, V]
        logp = torch.log_softmax(logits.double(), dim=-1)
        direct = -sum(logp[len(p) - 1 + i, token].item() for i, token in enumerate(c)) / len(c)
        assert value == pytest.approx(direct, abs=1e-5)
    assert ql.continuation_nll(tiny_scorer, prompts, continuations) == pytest.approx(got, abs=1e-5)  # batched
    with pytest.raises(ValueError, match="at least one token"):
        ql.continuation_nll(tiny_scorer, [[1]], [[]])


def test_study_markdown_has_the_label_and_a_row_per_k0_and_c():
    items = [qi.Item((1, 2), reference=(3, 4)), qi.Item((5,), reference=(6, 7)), qi.Item((8,), reference=(9, 9))]
    base = saved_arm(items, "baseline", [[3, 4], [6, 0], [9, 1]])
    oea = saved_arm(items, "oea", [[3, 0], [6, 0], [9, 9]])
    row = ql.compare_row(items, base, oea, qs.build_report(items, base, oea), [1.0, 2.0, 3.0], [1.5, 2.0, 3.5])
    assert row["nll"]["mean"] == pytest.approx(1 / 3) and row["next_token_accuracy"]["mean"] == pytest.approx(0.0)
    experts = {"before": 40.0, "after": 20.0, "ratio": 0.5, "lines": 2}
    rows = [{"model": "m", "k0": k0, "concurrency": c, **row, "experts_per_layer_step": experts,
             "oea_applied": {"share": 0.9}} for k0 in (3, 4) for c in (4, 16)]
    baselines = [{"model": "m", "concurrency": 4, "noise_floor": ql.compare_row(
        items, base, base, qs.build_report(items, base, base), [1.0] * 3, [1.0] * 3), "heldout_nll": {"mean": 2.9},
        "batch_floor": {"against_concurrency": 4, "token_agreement": 1.0, "identical_share": 1.0}}]
    settings = {"num_prompts": 3, "seed": 0, "prompt_len": 2, "continuation_len": 2, "oea_min_batch": 4}
    study = {"settings": settings, "models": ["m"], "baselines": baselines, "rows": rows, "runtime_s": 1.0}
    markdown = ql.render_markdown(study)
    assert ql.LABEL in markdown
    table = [line for line in markdown.splitlines() if line.startswith(("| 3 |", "| 4 |"))]
    assert len(table) == 4 + 1  # four (k0, C) rows and the baseline's C=4 row
    assert "| 3 | 16 | 0.6667 | 0.333 | 0.6667 -> 0.6667 | +0.0000 [" in markdown
    assert "40.0 -> 20.0 (0.50x) | 0.900 |" in markdown
    assert "| 4 | 0.6667 | 1.0000 | 2.9000 | 1.0000 | +0.0000 [+0.0000, +0.0000] |" in markdown
    assert "| 1.0000 (1.000) |" in markdown and "wall time of the whole study: 1 s." in markdown


# ----------------------------------------------------------------------------- real servers


def arithmetic_prompts(count, seed=0):
    """Synthetic sums with answers: half carry their own regex, half use --answer-regex."""
    rng = Random(seed)
    lines = []
    for i in range(count):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        line = {"prompt": f"Q: What is {a} plus {b}?\nA: {a} + {b} =", "answer": a + b}
        if i % 2:
            line["answer_regex"] = r"(-?\d+)"
        lines.append(json.dumps(line))
    return lines


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("quality_model") / "qwen3_moe"), "qwen3_moe", "--random-weights")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_lines(tmp_path_factory.mktemp("quality_prompts") / "sums.jsonl", arithmetic_prompts(NUM_PROMPTS))


@pytest.fixture(scope="module")
def oea_url(tmp_path_factory, model):
    """The one server's base URL: OEA started at k0 = top-k (a no-op), min-batch 1."""
    with serve(tmp_path_factory, model, *COMMON_FLAGS, "--oea-k0", str(TOP_K), "--oea-min-batch", "1") as (base, _):
        yield base


def run_tool(prompts, out, *arms):
    """quality_ab.main at the test's concurrency; quality.json (None when only one arm ran)."""
    argv = ["--prompts", prompts, "--answer-regex", r"(-?\d+)", "--concurrency", str(CONCURRENCY),
            "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--out", str(out), *arms]
    assert qa.main(argv) == 0
    path = os.path.join(out, "quality.json")
    return json.load(open(path)) if os.path.exists(path) else None


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, prompts, oea_url):
    """The server at k0 = top-k against itself (with a noise-floor rerun); its saved baseline arm and report."""
    out = tmp_path_factory.mktemp("quality_baseline")
    report = run_tool(prompts, out, "--base-url", oea_url, "--oea-url", oea_url, "--noise-floor")
    return {"arm": str(out / "arm_baseline.json"), "report": report, "out": out}


def check_report_structure(report, out):
    """Fields present and every interval well formed (values are near random with dummy weights)."""
    assert (report["n_prompts"], report["concurrency"], report["max_tokens"]) == (NUM_PROMPTS, CONCURRENCY, MAX_TOKENS)
    assert report["agreement"]["positions_compared"] == NUM_PROMPTS * MAX_TOKENS  # --ignore-eos: full length
    accuracy = report["accuracy"]
    assert accuracy["n"] == NUM_PROMPTS
    for arm in ("baseline", "oea"):
        low, high = accuracy[arm]["ci95"]
        assert 0 <= low <= accuracy[arm]["accuracy"] <= high <= 1 and high > low
    diff = accuracy["paired_difference"]
    assert diff["ci95"][0] <= diff["mean"] <= diff["ci95"][1] and 0 <= diff["mcnemar_exact_p"] <= 1
    assert diff["mean"] == pytest.approx(accuracy["oea"]["accuracy"] - accuracy["baseline"]["accuracy"])
    markdown = open(os.path.join(out, "quality.md")).read()
    assert markdown.startswith("| metric | value |") and "token agreement (positional)" in markdown
    rows = [json.loads(line) for line in open(os.path.join(out, "outputs.jsonl"))]
    assert len(rows) == NUM_PROMPTS and all("extracted" in row for row in rows)


@server
def test_same_server_in_both_arms_is_identical(baseline):
    report = baseline["report"]
    check_report_structure(report, baseline["out"])
    for section in (report["agreement"], report["noise_floor"]):
        assert section["identical_share"] == 1.0 and section["token_agreement"] == 1.0
        assert section["first_divergence"]["count"] == 0
    assert report["oea_applied"] is not None and not report["oea_applied"]["applied_steps"], "counters, none applied"
    assert not report["warnings"]


@server
def test_k0_1_set_live_diverges_from_the_saved_baseline(tmp_path_factory, prompts, baseline, oea_url):
    """k0 1 at min-batch 2 set live on the same server; the baseline arm comes from its file."""
    set_live(oea_url, oea_k0=1, oea_min_batch=2)
    out = tmp_path_factory.mktemp("quality_k0_1")
    report = run_tool(prompts, out, "--oea-url", oea_url, "--baseline-from", baseline["arm"])
    check_report_structure(report, out)
    agreement = report["agreement"]
    assert agreement["identical_share"] < 1 and agreement["token_agreement"] < 1
    divergence = agreement["first_divergence"]
    assert divergence["count"] == NUM_PROMPTS - agreement["identical"]
    assert 0 <= divergence["min"] <= divergence["median"] <= divergence["max"] < MAX_TOKENS
    assert sum(h["count"] for h in divergence["histogram"]) == divergence["count"]
    applied = report["oea_applied"]
    assert applied["tp_rank"] == "0" and applied["share"] > 0 and applied["applied_steps"] > 0
    assert not report["warnings"]
