"""studies/speculative_learned.py without a server: the comparisons it draws from saved arms, its
table, and the client's reading of SGLang's per-request speculative figures."""

import pytest

from serving import quality_client
from studies import speculative_learned as sl


def arm(mode, c, k0, accuracy, accept=None, throughput=100.0, ids=None):
    return {"model": "m", "mode": mode, "concurrency": c, "k0": k0, "output_throughput": throughput,
            "accuracy": accuracy, "accept_length": accept, "accept_length_log_mean": None if accept is None else 2.0,
            "token_ids": ids or [[1, 2]] * len(accuracy),
            "experts": {"before": 20.0, "after": 10.0, "ratio": 0.5} if k0 else {"before": None}}


def test_each_oea_arm_is_compared_with_off_on_its_server_and_with_no_speculation_at_its_k0():
    arms = [arm("none", 4, 0, [0.5, 0.25, 0.0]), arm("none", 4, 4, [0.5, 0.0, 0.0], throughput=150.0),
            arm("ngram", 4, 0, [0.5, 0.25, 0.0], [2.0, 1.5, 1.0]),
            arm("ngram", 4, 4, [0.75, 0.25, None], [1.5, 1.5, 1.0], throughput=50.0, ids=[[1, 2], [3], [1, 2]])]
    rows = {(r["mode"], r["k0"]): r for r in sl.comparisons(arms)}
    assert rows[("none", 4)]["throughput_ratio_to_off"] == 1.5
    assert rows[("none", 4)]["accuracy_vs_off"]["mean"] == pytest.approx(-0.25 / 3)
    assert "accept_length_vs_off" not in rows[("none", 4)] and "accuracy_vs_no_speculation" not in rows[("none", 4)]
    spec = rows[("ngram", 4)]
    assert spec["accept_length_vs_off"]["mean"] == pytest.approx(-0.5 / 3)
    # a prompt without a defined accuracy (None) is left out of the pairs
    assert spec["accuracy_vs_off"]["n"] == 2 and spec["accuracy_vs_off"]["mean"] == pytest.approx(0.125)
    assert spec["accuracy_vs_no_speculation"]["mean"] == pytest.approx(0.25)
    assert spec["identical_to_no_speculation"] == 2
    assert rows[("ngram", 0)]["identical_to_no_speculation"] == 3

    study = {"settings": {"num_prompts": 3, "seed": 0, "prompt_len": 8, "continuation_len": 2}, "models": ["m"],
             "arms": arms, "rows": sl.comparisons(arms), "runtime_s": 1.0}
    table = sl.render_markdown(study)
    assert sl.LABEL in table
    assert "| ngram | 4 | 4 | 2.00 | -0.167 [" in table and "| 0.50 -> " not in table
    assert "| none | 4 | off | n/a | - | n/a | 100.0 (1.00x) |" in table


def test_the_client_reads_sglangs_speculative_figures_and_refuses_their_absence():
    answer = {"sglext": {"spec_tokens_details": {"spec_accept_length": 2.5, "spec_verify_ct": 4}}}
    assert quality_client.spec_figures(answer, "http://s") == {"accept_length": 2.5, "verify_steps": 4}
    for missing in ({}, {"sglext": None}, {"sglext": {"spec_tokens_details": {"spec_verify_ct": 0}}}):
        with pytest.raises(RuntimeError, match="--speculative-algorithm"):
            quality_client.spec_figures(missing, "http://s")


def test_arguments_are_checked(capsys):
    with pytest.raises(SystemExit, match="no checkpoint nope"):
        sl.check_args(sl.build_parser().parse_args(["--models", "nope", "--out-dir", "x"]))
    with pytest.raises(SystemExit, match="at least 1"):
        sl.check_args(sl.build_parser().parse_args(["--models", "qwen3_moe_stdlib", "--k0", "0", "--out-dir", "x"]))
