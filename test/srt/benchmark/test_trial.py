"""benchmark/oea/trial/trial.py: the operator's one-command trial of OEA on a running server.

Without a server: the step counters attributed by their k0 label (a previous arm's late counts
arriving in the next arm's window), accept length from SGLang's counters, the batch gate per
concurrency, the preflight's refusals on stand-in /server_info answers, the verdict and the
recommendation (the speculative branch on made-up accept lengths), the lm-eval sample reader and
the held-out task, and SIGTERM unwinding a script's clean-up.

With ONE CPU server (the shipped trained Qwen3-MoE, started with --oea-k0 0 --enable-metrics, gate
2..8 requests, counters exported every 4 decode steps, protected by --api-key and --admin-api-key,
k0 STARTING_K0 set live before any trial, so that each trial must put back the k0 it found; the
keys go to the trial through its environment): SGLang answers as serving_fakes' stand-in assumes
(401 bodies, the keys each endpoint needs); a refused preflight sends nothing; the
whole trial runs (C=1 gate closed, C=4 interleaved A/B, quality through lm-eval on a local task
made from held-out text at C=2, where the gate opens, its C=4 run cut by the budget, the verdict,
the settings put back, no process left, the real bench_serving run with the API key and the cache
flushed with the admin key, no key in any file left); SIGTERM in the middle puts the setting back
and leaves no process behind.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
import uuid

import pytest

from oea_fixtures import marked_processes

from common import report
from common import oea_metrics
from common.http import Auth, http_json, use_auth
from serving import live_settings, servers
from trial import preflight as tp, quality as tq, trial, verdict as tr
from test_server_e2e import serve
import serving_fakes  # noqa: I001  (this folder's stand-ins)

TRIAL = os.path.join(os.path.dirname(os.path.abspath(trial.__file__)), "trial.py")
TRAINED = os.path.join(os.path.dirname(os.path.dirname(TRIAL)), "models", "qwen3_moe_stdlib")  # has heldout.txt
MODEL = 'model_name="m",tp_rank="0"'


def applied(k0, n, mode="decode"):
    return f'sglang:oea_decode_steps_applied_total{{k0="{k0}",mode="{mode}",{MODEL}}}', float(n)


def skipped(k0, reason, n, mode="decode"):
    return f'sglang:oea_decode_steps_skipped_total{{k0="{k0}",mode="{mode}",{MODEL},reason="{reason}"}}', float(n)


def scrape(*samples):
    return dict(samples)


# ----------------------------------------------------------------------------- attribution by the k0 label


def test_counts_are_attributed_by_the_k0_label_not_by_the_window():
    """The k0=4 arm ran 40 steps, but only 32 reached /metrics before its window closed; the last 8
    arrive during the next arm's window (OEA off, k0 0), together with that arm's own 20 steps."""
    after_k4 = scrape(applied(4, 32), skipped(4, "below_min_batch", 4), skipped(0, "oea_off", 10))
    after_k0 = scrape(applied(4, 40), skipped(4, "below_min_batch", 4), skipped(0, "oea_off", 30),
                      skipped(0, "not_decode", 2, mode="other"))
    off = oea_metrics.steps_share(after_k4, after_k0, k0=0)
    assert (off["applied_steps"], off["decode_steps"], off["share"]) == (0.0, 20.0, 0.0)  # the late 8 are not its
    late = oea_metrics.steps_share(after_k4, after_k0, k0=4)
    assert (late["applied_steps"], late["decode_steps"]) == (8.0, 8.0)  # they are the k0=4 arm's, by label
    by_window = oea_metrics.steps_share(after_k4, after_k0)  # no k0: the old time-window reading
    assert (by_window["applied_steps"], by_window["decode_steps"]) == (8.0, 28.0)

    # one benchmark record of the off arm (one server): applied_in_run and the gauges follow the label
    record = {"arm": "baseline", "k0": None, "oea_live": {"oea_k0": 0},
              "oea_metrics_delta": oea_metrics.counter_deltas(after_k4, after_k0),
              "oea_metrics": {"sglang:oea_active_experts_ratio{tp_rank=\"0\"}": 0.5}}
    assert oea_metrics.applied_in_run(record) == 0
    assert oea_metrics.run_experts(record) is None  # the gauge is the k0=4 arm's, not this run's
    assert oea_metrics.applied_in_run({**record, "oea_live": {"oea_k0": 4}}) == 8

    # the quality tools read /metrics pages: the same through the text parser
    text = lambda d: "".join(f"{k} {v}\n" for k, v in d.items())  # noqa: E731
    assert oea_metrics.applied_share(text(after_k4), text(after_k0), 0)["applied_steps"] == 0.0
    # a plugin without the k0 label: every sample counts, as before
    old = {"sglang:oea_decode_steps_applied_total{tp_rank=\"0\"}": 5.0}
    assert oea_metrics.steps_share({}, old, k0=0)["applied_steps"] == 5.0


def test_accept_length_from_sglang_counters():
    record = {"oea_metrics_delta": {'sglang:generation_tokens_total{model_name="m",is_streaming="false"}': 300.0,
                                    'sglang:generation_tokens_total{model_name="m",is_streaming="true"}': 100.0,
                                    'sglang:spec_verify_calls_total{model_name="m"}': 160.0}}
    assert oea_metrics.accept_length_in_run(record) == pytest.approx(2.5)
    assert oea_metrics.accept_length_in_run({"oea_metrics_delta": {}}) is None  # no speculative decoding
    kept = oea_metrics.oea_samples('sglang:spec_verify_calls_total{a="b"} 3\nsglang:num_requests_total 9\n')
    assert kept == {'sglang:spec_verify_calls_total{a="b"}': 3.0}


# ----------------------------------------------------------------------------- preflight


def test_batch_gate_per_concurrency():
    gate = {"oea_min_batch": 4, "oea_max_batch": 128}
    assert tp.gate_at(32, gate, 4, None).open  # EAGLE, 4 draft tokens: 32 x 4 = 128 rows
    c64 = tp.gate_at(64, gate, 4, None)
    assert not c64.open and c64.why == "64 requests x 4 rows = 256 rows > max_batch 128 token rows"
    assert tp.gate_at(64, gate, 1, None).open  # without speculation 64 rows
    assert tp.gate_at(2, gate, 1, None).why == "2 requests < min_batch 4"
    assert tp.gate_at(16, {"oea_min_batch": 4, "oea_max_batch": 0}, 4, None).open  # no cap
    capped = tp.gate_at(64, gate, 4, 24)  # the server runs at most 24 requests: 96 rows
    assert capped.open and capped.requests == 24 and "at most 24 requests" in capped.why


def fake_info(tmp_path, k0=0, spec=None, draft=None, metrics=True, verify=True, kernel="default", max_batch=128,
              model=True):
    """/server_info as SGLang 0.5.23 answers with the plugin armed (one OEA state per scheduler, with
    the model's routing shape; the model path is the server's, not readable here); model=False: a
    state without it, where the preflight falls back to the checkpoint's config.json."""
    if not model:
        (tmp_path / "config.json").write_text(json.dumps({"num_experts_per_tok": 8}))
    oea = {"k0": k0, "min_batch": 4, "max_batch": max_batch, "envelope": {"min_batch": 4, "max_batch": max_batch},
           "verify": verify}
    if model:
        oea["model"] = {"num_experts": 256, "top_k": 8}
    if kernel == "default":
        oea["kernel"] = {"flag": "auto", "paths": [{"router": "triton", "self_check": "passed", "shapes": 2}],
                         "tp_size": 8}
    elif kernel is not None:
        oea["kernel"] = kernel
    return {"internal_states": [{"oea": oea}, {"oea": dict(oea)}], "enable_metrics": metrics, "tp_size": 8, "dp_size": 1,
            "speculative_algorithm": spec, "speculative_num_draft_tokens": draft, "model_path": str(tmp_path),
            "decode_log_interval": 40}


@pytest.mark.parametrize("kwargs, k0s, concurrencies, message", [
    ({"metrics": False}, [4], [16], "without --enable-metrics"),
    ({}, [8], [16], "top-k is 8"),
    ({"model": False}, [8], [16], "top-k is 8"),
    ({}, [0], [16], "0 is the baseline arm"),
    ({"spec": "EAGLE", "draft": 4, "verify": False}, [4], [16], "--oea-verify off"),
    ({"kernel": {"flag": "auto", "paths": [{"router": "off", "self_check": "failed", "shapes": 2}]}}, [4], [16],
     "turned itself off"),
    ({"spec": "EAGLE", "draft": 4}, [4], [64, 2], "C=64 with 4 draft tokens needs --oea-max-batch 256"),
])
def test_preflight_refuses_what_cannot_mean_anything(tmp_path, monkeypatch, kwargs, k0s, concurrencies, message):
    monkeypatch.setattr(tp, "read_server_info", lambda url: fake_info(tmp_path, **kwargs))
    with pytest.raises(tp.TrialRefused, match=message):
        tp.preflight("http://x", None, k0s, concurrencies)


def test_preflight_reads_what_it_can(tmp_path, monkeypatch):
    info = fake_info(tmp_path, k0=5, spec="EAGLE", draft=4, kernel=None)
    monkeypatch.setattr(tp, "read_server_info", lambda url: info)
    pre = tp.preflight("http://x", None, [4, 5], [16, 32, 64])
    assert pre.top_k == 8 and pre.rows_per_request == 4 and pre.original["oea_k0"] == 5
    assert pre.open_concurrencies == [16, 32]  # 64 x 4 rows > 128
    assert "scheduler 0: kernel not reported by this plugin version" in " ".join(pre.lines)
    assert "EAGLE, 4 draft tokens per request" in " ".join(pre.lines)
    assert pre.warnings and "puts k0 5 back" in pre.warnings[0]  # OEA on now: allowed, and said


def test_flags_that_cannot_work_are_refused_before_anything_is_sent(tmp_path):
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"prompt": "no answer here"}\n')
    graded = tmp_path / "graded.jsonl"
    graded.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n')
    base = ["--url", "http://127.0.0.1:9", "--out-dir", str(tmp_path / "out")]
    for extra, message in ((["--apply"], "--apply leaves OEA on: it needs a quality comparison"),
                           (["--quality", "quality-ab"], "--quality quality-ab needs --quality-prompts FILE"),
                           (["--quality", "quality-ab", "--quality-prompts", str(plain)], "no prompt has an answer"),
                           (["--budget-minutes", "0"], "--budget-minutes must be positive")):
        with pytest.raises(tp.TrialRefused, match=message):
            trial.check_args(trial.build_parser().parse_args(base + extra))
    trial.check_args(trial.build_parser().parse_args(base + ["--quality", "quality-ab", "--quality-prompts",
                                                             str(graded), "--apply"]))


def test_lm_eval_absent_says_how_to_install_it(tmp_path, monkeypatch):
    real = tq.importlib.util.find_spec
    monkeypatch.setattr(tq.importlib.util, "find_spec", lambda name: None if name == "tenacity" else real(name))
    args = trial.build_parser().parse_args(["--url", "u", "--out-dir", str(tmp_path), "--quality", "lm-eval",
                                            "--lm-eval-task", "gsm8k"])
    with pytest.raises(tp.TrialRefused, match=r"\(tenacity missing\): pip install 'sglang-oea\[trial\]'"):
        trial.check_args(args)


# ----------------------------------------------------------------------------- verdict


def cell(k0, conc, lo, med, hi, n=3, accept=None, gate_open=True):
    ratio = report.Spread(med, lo, hi, n)
    return {"k0": k0, "concurrency": conc, "gate_open": gate_open, "ratio": med, "ratio_low": lo, "ratio_high": hi,
            "resolved": report.resolved(ratio), "verdict": tr.cell_verdict(gate_open, ratio), "accept_length": accept}


def test_cell_verdicts():
    assert tr.cell_verdict(False, None) == "gate closed"
    assert tr.cell_verdict(True, report.Spread(1.10, 1.07, 1.13, 3)) == "faster by 10% [+7%, +13%]"
    assert tr.cell_verdict(True, report.Spread(0.90, 0.88, 0.92, 3)).startswith("slower by 10%")
    assert tr.cell_verdict(True, report.Spread(1.01, 0.98, 1.04, 3)).startswith("no change beyond ±5%")
    assert tr.cell_verdict(True, report.Spread(1.10, 0.90, 1.30, 3)).startswith("not resolved (0.90-1.30")
    assert tr.cell_verdict(True, report.Spread(1.10, 1.09, 1.11, 2)).startswith("not resolved")  # 2 repeats


def quality(conc=16, **per_k0):
    """The quality step's result: one run, at concurrency conc."""
    return [{"concurrency": conc, "per_k0": {int(k[2:]): {"within": v} for k, v in per_k0.items()}}]


def test_recommendation_rules():
    cells = [cell(4, 16, 1.10, 1.12, 1.15), cell(4, 32, 1.02, 1.04, 1.06),
             cell(5, 16, 1.08, 1.10, 1.12), cell(5, 32, 1.01, 1.03, 1.05),
             cell(6, 16, 0.90, 0.92, 0.94), cell(6, 32, 1.0, 1.02, 1.04)]
    # k0=4 is best, k0=5 overlaps it at both C: the larger k0 is taken; k0=6 is slower at C=16
    rec = tr.recommend([4, 5, 6], cells, quality(k04=True, k05=True, k06=True), speculative=False)
    assert rec["k0"] == 5 and "slower at C=16" in rec["problems"][6]
    assert tr.recommend([4, 5], cells, quality(k04=True, k05=False), False)["k0"] == 4  # 5 fails its quality
    rec = tr.recommend([4], cells, None, False)  # no quality measured: said in the reason
    assert rec["k0"] == 4 and "--quality none" in rec["reason"]
    unresolved = [cell(4, 16, 0.9, 1.1, 1.3)]
    rec = tr.recommend([4], unresolved, None, False)
    assert (rec["k0"], rec["reason"], rec["problems"], rec["flags"]) == (
        0, "no k0 qualifies (k0=4: not resolved faster at any concurrency)",
        {4: ["not resolved faster at any concurrency"]}, None)


def test_accept_length_non_inferiority_decides_under_speculative_decoding():
    off = [2.4, 2.6, 2.5, 2.3, 2.7, 2.5] * 8
    same = tq.accept_check(off, [a + d for a, d in zip(off, [0.05, -0.05] * 24)])
    lower = tq.accept_check(off, [a * 0.85 for a in off])  # 15% shorter accept lengths
    assert same["non_inferior"] and same["low"] > -0.05 and abs(same["change"]) < 1e-9
    assert not lower["non_inferior"] and lower["change"] == pytest.approx(-0.15) and lower["high"] < -0.05
    cells = [cell(4, 16, 1.10, 1.12, 1.15, accept=same), cell(4, 32, 1.05, 1.07, 1.09, accept=same)]
    assert tr.recommend([4], cells, quality(k04=True), speculative=True)["k0"] == 4
    cells[1]["accept_length"] = lower
    rec = tr.recommend([4], cells, quality(k04=True), speculative=True)
    assert rec["k0"] == 0 and "accept length not shown non-inferior at C=32" in rec["reason"]


def test_quality_bound_and_an_unexercised_comparison():
    base, oea = [1.0, 0.0, 1.0, 1.0] * 10, [1.0, 0.0, 1.0, 1.0] * 10
    check = tq.paired_check(base, oea, margin=0.02)
    assert check["within"] and check["delta"] == 0.0
    worse = tq.paired_check(base, [0.0, 0.0, 1.0, 1.0] * 10, margin=0.02)  # 10 of 40 lost
    assert not worse["within"] and worse["delta"] == pytest.approx(-0.25)
    unexercised = tq.exercised(check, {"applied_steps": 0.0, "share": 0.0})
    assert not unexercised["within"] and "did not exercise" in unexercised["note"]


def test_lm_eval_samples_and_the_heldout_task(tmp_path):
    out = tmp_path / "arm" / "model"
    out.mkdir(parents=True)
    rows = [{"doc_id": i, "filter": f, "metrics": ["exact_match"], "exact_match": float(i % 2 == 0 or f == "b")}
            for i in range(4) for f in ("a", "b")]
    (out / "samples_t_2026-12-03T10-00-00.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = {"higher_is_better": {"t": {"exact_match": True}}}
    (out / "results_2026-12-03T10-00-00.json").write_text(json.dumps(results))
    values, meta = tq.lm_eval_samples(str(tmp_path / "arm"), None, None)
    assert meta == {"metric": "exact_match", "filter": "a", "higher_is_better": True}  # the first filter logged
    assert values == {("t", 0): 1.0, ("t", 1): 0.0, ("t", 2): 1.0, ("t", 3): 0.0}
    assert set(tq.lm_eval_samples(str(tmp_path / "arm"), None, "b")[0].values()) == {1.0}
    with pytest.raises(RuntimeError, match="no samples"):
        tq.lm_eval_samples(str(tmp_path / "none"), None, None)

    name = tq.write_heldout_task(TRAINED, str(tmp_path / "task"), 5)
    docs = [json.loads(line) for line in open(tmp_path / "task" / f"{name}.jsonl")]
    assert len(docs) == 5 and all(d["target"] and "\n" not in d["target"] for d in docs)
    heldout = open(os.path.join(TRAINED, "heldout.txt")).read()
    assert all(d["context"] + d["target"] in heldout for d in docs)  # held-out text, cut inside a line
    assert f"test: {tmp_path / 'task' / name}.jsonl" in (tmp_path / "task" / f"{name}.yaml").read_text()


def test_sigterm_unwinds_like_ctrl_c(tmp_path):
    """A script under terminate_as_interrupt runs its finally clauses on SIGTERM (a second one
    during the clean-up is ignored), and its child's process group can be stopped there."""
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, subprocess, sys, time
        sys.path.insert(0, {os.path.dirname(os.path.dirname(TRIAL))!r})
        from serving.servers import terminate_as_interrupt
        child = subprocess.Popen(["sleep", "300"], start_new_session=True)
        open({str(tmp_path / 'child')!r}, "w").write(str(child.pid))
        with terminate_as_interrupt():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(30)
            finally:
                os.kill(os.getpid(), signal.SIGTERM)  # again, during the clean-up: ignored
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                open({str(tmp_path / 'cleaned')!r}, "w").write("yes")
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "Terminated: signal 15" in proc.stderr
    assert (tmp_path / "cleaned").read_text() == "yes"
    assert "signal 15 again" in proc.stdout
    assert not servers.group_alive(int((tmp_path / "child").read_text()))


# ----------------------------------------------------------------------------- one CPU server

API_KEY, ADMIN_KEY = "trial-api-Kq3-secret", "trial-admin-Vw8-secret"
STARTING_K0 = 2  # set live before the trials: each must put this back, not the 0 of the flags
FLAGS = ("--oea-k0", "0", "--enable-metrics", "--oea-min-batch", "2", "--oea-max-batch", "8",
         "--decode-log-interval", "4", "--mem-fraction-static", "0.3", "--max-total-tokens", "8192",
         "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY)
SMALL = ["--input-len", "32", "--output-len", "16", "--prompts-per-concurrency", "2", "--min-prompts", "8",
         "--warmup-prompts", "0"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The trained Qwen3-MoE, armed, both keys, OEA's gate 2..8 requests, k0 STARTING_K0 in force;
    yields its URL. This process's requests to it carry the keys (common/http.use_auth)."""
    with serve(tmp_path_factory, TRAINED, *FLAGS) as (url, _):
        use_auth(url, Auth(API_KEY, ADMIN_KEY))
        assert live_settings.put_back(url, {"oea_k0": STARTING_K0}, delays=())["ok"]
        yield url


@pytest.fixture
def keys(monkeypatch):
    """The trial's keys, in its environment as the docs advise."""
    monkeypatch.setenv("OEA_API_KEY", API_KEY)
    monkeypatch.setenv("OEA_ADMIN_API_KEY", ADMIN_KEY)


def oea_state(url):
    return http_json(url + "/server_info", timeout=30)["internal_states"][0]["oea"]


def files_holding(root, *secrets):
    return sorted(str(p) for p in root.rglob("*") if p.is_file() and any(s.encode() in p.read_bytes() for s in secrets))


@pytest.mark.server
def test_sglang_answers_as_the_stand_in_assumes(server):
    """serving_fakes' server imitates these answers of SGLang 0.5.23 with both keys; nothing is set."""
    def status_and_body(path, key, payload=None):
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(server + path, data, {"Content-Type": "application/json",
                                                               "Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    code, body = status_and_body("/server_info", "wrong")
    assert (code, json.loads(body)) == (401, serving_fakes.UNAUTHORIZED)
    assert status_and_body("/server_info", ADMIN_KEY)[0] == 401  # the admin key does not do for the API key
    assert status_and_body("/flush_cache", API_KEY, {})[0] == 401  # nor the API key for the admin key
    assert status_and_body("/set_internal_state", API_KEY, {"server_args": {}})[0] == 401
    assert status_and_body("/metrics", "wrong")[0] == 200  # open, for Prometheus
    code, body = status_and_body("/set_internal_state", ADMIN_KEY, {"server_args": {}})  # the preflight's probe
    info = json.loads(status_and_body("/server_info", API_KEY)[1])
    assert code == 200 and json.loads(body) == [True] * len(info["internal_states"])  # one boolean per DP rank
    assert (info["api_key"], info["admin_api_key"]) == (API_KEY, ADMIN_KEY)  # in plain text: redacted before saving
    assert info["internal_states"][0]["admin_api_key"] == ADMIN_KEY and ADMIN_KEY in str(info["launch_command"])
    assert oea_state(server)["k0"] == STARTING_K0 and "pending" not in oea_state(server)  # the probe changed nothing
    saved = json.dumps(live_settings.read_server_info(server))
    assert API_KEY not in saved and ADMIN_KEY not in saved


def requests_served(url):
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        return sum(float(line.rsplit(" ", 1)[1]) for line in r.read().decode().splitlines()
                   if line.startswith("sglang:num_requests_total"))


@pytest.mark.server
def test_a_refused_preflight_sends_nothing(server, keys, tmp_path, capsys):
    served = requests_served(server)
    for extra, message in ((["--k0", "8", "--concurrency", "4"], "the model's top-k is 8"),
                           (["--k0", "4", "--concurrency", "1"], "cannot open at any --concurrency (C=1: 1 request "
                                                                  "< min_batch 2)")):
        assert trial.main(["--url", server, "--out-dir", str(tmp_path / "refused"), *extra]) == 2
        assert message in capsys.readouterr().err
    assert requests_served(server) == served  # no load, nothing set
    assert oea_state(server)["k0"] == STARTING_K0 and "pending" not in oea_state(server)


@pytest.mark.server
def test_the_whole_trial(server, keys, tmp_path, monkeypatch, capsys):
    mark = f"OEA_TRIAL_TEST_{uuid.uuid4().hex}"
    monkeypatch.setenv(mark, "1")
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):  # lm-eval reads only the local task
        monkeypatch.setenv(var, "1")
    task = tq.write_heldout_task(TRAINED, str(tmp_path / "task"), 16)
    out = tmp_path / "trial"
    argv = ["--url", server, "--k0", "4", "--concurrency", "1", "4", *SMALL, "--budget-minutes", "0.1",
            "--max-repeats", "1", "--quality", "lm-eval", "--lm-eval-task", task, "--lm-eval-include",
            str(tmp_path / "task"), "--label", "CPU test, tiny trained model", "--out-dir", str(out)]
    assert trial.main(argv) == 0
    result = json.loads((out / "results.json").read_text())
    assert result["status"] == "done" and result["restored"] == {"oea_k0": STARTING_K0}
    assert result["restore"]["by"] == "the trial" and result["restore"]["attempts"] == 1
    assert oea_state(server)["k0"] == STARTING_K0 and "pending" not in oea_state(server)
    assert not marked_processes(mark)  # the bench driver, the lm-eval driver and the guard are gone
    # the real bench_serving, in its driver, the cache flushed by the trial with the admin key before each run
    run_log = (out / "runs" / "oea-k0=4_c4_r0.log").read_text()
    assert " -m sglang.benchmark.serving " in run_log.splitlines()[0] and "--warmup-requests 0" in run_log
    printed = capsys.readouterr().out
    assert "flush_cache failed" not in printed and API_KEY not in printed and ADMIN_KEY not in printed
    assert files_holding(tmp_path, API_KEY, ADMIN_KEY) == []  # results, logs, snapshots, lm-eval's files
    assert json.loads((out / "server_info_baseline.json").read_text())["admin_api_key"] == "<redacted>"

    closed, opened = result["cells"]
    assert (closed["concurrency"], closed["gate_open"], closed["verdict"], closed["ratio"]) == (1, False,
                                                                                              "gate closed", None)
    assert not (out / "runs" / "baseline_c1_r0.jsonl").exists()  # a closed cell is not run
    assert opened["concurrency"] == 4 and opened["gate_open"] and opened["repeats"] == 1
    assert opened["ratio_low"] <= opened["ratio"] <= opened["ratio_high"] and opened["ratio"] > 0
    assert not opened["resolved"] and opened["verdict"].startswith("not resolved")  # one repeat never resolves
    assert opened["accept_length"] is None  # no speculative decoding on this server
    off, oea = opened["off"], opened["oea"]
    assert off["applied_share"] == 0.0 and off["decode_steps"] > 0  # k0 0 steps, by their label
    assert 0 < oea["applied_share"] <= 1 and oea["t_after"] < oea["t_before"]
    assert off["accept_length"] is None and oea["output_throughput"] > 0 and oea["median_tpot_ms"] > 0

    # quality where the gate opens first, min_batch 2 requests; C=4, the largest open one, does not fit the
    # 6-second budget once the first has run: cut, and said
    (run,) = result["quality"]
    q = run["per_k0"]["4"]
    assert run["tool"] == "lm-eval" and run["metric"] == "exact_match" and run["concurrency"] == 2
    assert run["why"].startswith("the smallest concurrency at which the gate opens (min_batch 2 requests)")
    assert q["n"] == 16 and q["low"] <= q["delta"] <= q["high"] and q["oea_applied"]["applied_steps"] > 0
    assert q["within"] == (q["low"] >= -q["margin"])
    assert opened["quality_delta"] is None  # quality did not run at C=4
    assert [c.split(" (")[0] for c in result["budget"]["cuts"]] == ["quality at C=4"]
    assert set(result["budget"]["phases"]) == {"throughput", "quality"}
    rec = result["recommendation"]
    assert rec["k0"] == 0 and "not resolved faster" in rec["reason"]  # nothing resolved faster in one repeat
    assert rec["flags"] is None and "restart the server without --oea-k0" in rec["off"]

    markdown = (out / "results.md").read_text()
    for text in ("CPU test, tiny trained model", "| 1 | closed | 1 request < min_batch 2 |", "gate closed",
                 "**Recommendation: keep OEA off.**", f"Settings put back: {{\"oea_k0\": {STARTING_K0}}}",
                 "default: held-out text",
                 "## Budget", "Cut: quality at C=4", "What arming costs meanwhile: not measured on a GPU yet"):
        assert text in markdown
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((out / "quality" / "lm_eval_k0_4_c2").rglob("samples_*.jsonl"))


@pytest.mark.server
def test_sigterm_in_the_middle_puts_the_setting_back(server, tmp_path):
    """The keys in the environment (OEA_API_KEY, OEA_ADMIN_API_KEY), none on the command line."""
    mark = f"OEA_TRIAL_TEST_{uuid.uuid4().hex}"
    out = tmp_path / "trial"
    argv = [sys.executable, TRIAL, "--url", server, "--k0", "4", "--concurrency", "4", *SMALL,
            "--output-len", "64", "--budget-minutes", "30", "--out-dir", str(out)]
    with open(tmp_path / "trial.log", "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, mark: "1", "OEA_API_KEY": API_KEY, "OEA_ADMIN_API_KEY": ADMIN_KEY})
    try:
        deadline = time.time() + 600
        while proc.poll() is None and time.time() < deadline:  # until the k0=4 arm is set
            state = oea_state(server)
            if (state.get("pending") or state)["k0"] == 4:
                break
            time.sleep(0.5)
        assert proc.poll() is None, (tmp_path / "trial.log").read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    state = oea_state(server)
    assert state["k0"] == STARTING_K0 and "pending" not in state
    assert not marked_processes(mark)  # the bench driver and the guard went with it
    result = json.loads((out / "results.json").read_text())
    assert result["status"] == "interrupted" and result["restored"] == {"oea_k0": STARTING_K0}
    assert result["restore"]["by"] == "the trial" and files_holding(tmp_path, API_KEY, ADMIN_KEY) == []
    assert result["recommendation"]["k0"] == 0
