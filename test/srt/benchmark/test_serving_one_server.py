"""The one-server A/B sweep (serving/one_server.py, serving/live_settings.py) against the stand-in
server and bench of serving_fakes.py: the order of switches (POST /set_internal_state), their
confirmations (GET /server_info), warm-ups and measured runs; per-run counter deltas; refusal when
the server does not take or confirm a setting; --url mode with an admin key, putting the server's
settings back. No SGLang server, a few seconds each.
"""

import json
import os
import sys

import pytest

from common import report
from serving import ab_serving, live_settings, one_server, quality_ab, servers
from serving.sweep import Arm
import serving_fakes  # noqa: I001  (this folder's stand-ins)

APPLIED = 'sglang:oea_decode_steps_applied_total{tp_rank="0",mode="decode"}'
SKIPPED = 'sglang:oea_decode_steps_skipped_total{tp_rank="0",mode="decode",reason="off"}'
INTERVAL = 5  # the fake server's decode_log_interval: a switch warm-up decodes 5 + 8 tokens
OUT = 8  # measured runs' output tokens


def post(k0, max_batch=None):
    return ("post", {"oea_k0": k0, **({"oea_max_batch": max_batch} if max_batch is not None else {})})


def run(k0, c, seed, n=4, out=OUT):
    return ("run", k0, c, seed, n, out)


def warm(k0, c):
    """A switch warm-up: one wave at C, seed + 10000, decode-log interval + 8 tokens."""
    return run(k0, c, 10_001, n=c, out=INTERVAL + 8)


INFO = ("info",)


def measured(k0, c, seed, **kw):
    """A measured run and the /server_info read that confirms its settings right before it."""
    return [INFO, run(k0, c, seed, **kw)]


def sequence(events):
    """The events that matter for the order, compactly: post (settings), info, run (k0, c, seed, n, out)."""
    out = []
    for e in events:
        if e["event"] == "post":
            out.append(("post", e["settings"]))
        elif e["event"] == "info":
            out.append(INFO)
        elif e["event"] == "run":
            out.append(run(e["k0"], e["c"], e["seed"], e["n"], e["out"]))
    return out


def test_plan_runs_reverses_every_other_block():
    a, b, c = Arm("baseline", None), Arm("oea-k0=3", 3), Arm("oea-k0=5", 5)
    plan = [(block, conc, rep, arm.name[-1]) for block, conc, rep, arm in one_server.plan_runs([a, b, c], [1, 4], 3)]
    assert plan == [(0, 1, 0, "e"), (0, 1, 0, "3"), (0, 1, 0, "5"),
                    (1, 1, 1, "5"), (1, 1, 1, "3"), (1, 1, 1, "e"),
                    (2, 1, 2, "e"), (2, 1, 2, "3"), (2, 1, 2, "5"),
                    (3, 4, 0, "5"), (3, 4, 0, "3"), (3, 4, 0, "e"),  # blocks count over the whole sweep
                    (4, 4, 1, "e"), (4, 4, 1, "3"), (4, 4, 1, "5"),
                    (5, 4, 2, "5"), (5, 4, 2, "3"), (5, 4, 2, "e")]


def _argv(tmp_path, fake_server, fake_bench, *extra):
    return ["--model-path", str(tmp_path), "--port", str(servers.free_port()), "--concurrency", "1", "4",
            "--repeats", "2", "--num-prompts", "4", "--output-len", str(OUT), "--warmup-prompts", "2",
            "--ready-timeout", "30", "--out-dir", str(tmp_path / "out"),
            "--launcher", f"{sys.executable} {fake_server}", "--bench-module", str(fake_bench), *extra]


def test_one_server_sweep_order_and_per_run_deltas(tmp_path, monkeypatch):
    fake_server, fake_bench, events, _ = serving_fakes.install(tmp_path, monkeypatch)
    argv = _argv(tmp_path, fake_server, fake_bench, "--k0", "3", "5", "--oea-max-batch", "64",
                 "--", "--load-format", "dummy")
    assert ab_serving.main(argv) == 0
    ev = serving_fakes.read_events(events)
    life = [e for e in ev if e["event"] in ("start", "stop")]
    assert [e["event"] for e in life] == ["start", "stop"]  # one server for every arm
    assert (life[0]["k0"], life[0]["max_batch"], life[0]["metrics"]) == (0, 64, True)  # armed, off, metrics
    with pytest.raises(ProcessLookupError):
        os.kill(life[0]["child"], 0)  # its whole process group is gone

    def to(k0, c):
        """A switch to k0 at C: the POST, the check that it was accepted (pending), the warm-up."""
        return [post(k0, 64 if k0 else None), INFO, warm(k0, c)]

    assert sequence(ev) == [
        INFO, post(0), INFO, run(0, 2, 10_001, n=2, out=32),  # settings read, baseline accepted, start-up warm-up
        # C=1, repeat 0: baseline, k0=3, k0=5; each switch is accepted, warmed up, confirmed in force
        warm(0, 1), *measured(0, 1, 1), *to(3, 1), *measured(3, 1, 1), *to(5, 1), *measured(5, 1, 1),
        # C=1, repeat 1: reversed; k0=5 is in force and warm at C=1
        *measured(5, 1, 2), *to(3, 1), *measured(3, 1, 2), *to(0, 1), *measured(0, 1, 2),
        # C=4, repeat 0: forward again; the baseline is in force, but C changed: a warm-up
        warm(0, 4), *measured(0, 4, 1), *to(3, 4), *measured(3, 4, 1), *to(5, 4), *measured(5, 4, 1),
        # C=4, repeat 1
        *measured(5, 4, 2), *to(3, 4), *measured(3, 4, 2), *to(0, 4), *measured(0, 4, 2),
    ]

    recs = report.load_jsonl(str(tmp_path / "out" / "results.jsonl"))
    assert [(r["arm"], r["concurrency"], r["repeat"], r["position"]) for r in recs[:6]] == [
        ("baseline", 1, 0, 0), ("oea-k0=3", 1, 0, 1), ("oea-k0=5", 1, 0, 2),
        ("oea-k0=5", 1, 1, 0), ("oea-k0=3", 1, 1, 1), ("baseline", 1, 1, 2)]
    for r in recs:
        k0 = r["k0"] or 0
        assert r["server_mode"] == "one-server" and r["oea_live"]["oea_k0"] == k0
        assert [(s["k0"], s.get("pending")) for s in r["oea_states"]] == [(k0, None)] * 2  # in force on both
        # each run's own 8 steps, none of the 13-step warm-up before it, none of another arm's
        assert r["oea_metrics_delta"] == ({APPLIED: OUT, SKIPPED: 0.0} if k0 else {APPLIED: 0.0, SKIPPED: OUT})
    s = report.summarize(recs)
    assert s.warnings == [] and s.arms == ["baseline", "oea-k0=3", "oea-k0=5"]
    r = s.ratios[(4, "oea-k0=3")]  # (400 * 1.5 + seed) / (400 + seed), seeds 1 and 2
    assert (r.lo, r.hi, r.n) == (pytest.approx(602 / 402), pytest.approx(601 / 401), 2)
    for arm, k0 in (("baseline", 0), ("oea-k0=3", 3), ("oea-k0=5", 5)):
        info = (tmp_path / "out" / f"server_info_{arm}.json").read_text()  # the first switch's: pending
        assert live_settings.oea_states(json.loads(info))[0]["pending"]["k0"] == k0
    assert (tmp_path / "out" / "results.md").stat().st_size > 0


@pytest.mark.parametrize("live, message", [("lie", "did not accept"), ("refuse", "refused"),
                                           ("stuck", "did not have in force")])
def test_one_server_sweep_stops_when_a_setting_is_not_confirmed(tmp_path, monkeypatch, capsys, live, message):
    fake_server, fake_bench, events, _ = serving_fakes.install(tmp_path, monkeypatch, live=live)
    assert ab_serving.main(_argv(tmp_path, fake_server, fake_bench, "--k0", "4")) == 2
    ev = serving_fakes.read_events(events)
    stop = {"lie": [INFO],  # scheduler 1 reports neither k0 4 nor a pending 4
            "refuse": [],  # [false]
            "stuck": [INFO, warm(0, 1), INFO]}  # accepted as pending, still pending after the warm-up
    assert sequence(ev) == [INFO, post(0), INFO, run(0, 2, 10_001, n=2, out=32), warm(0, 1), *measured(0, 1, 1),
                            post(4)] + stop[live]  # nothing is measured after it
    printed = capsys.readouterr().out
    assert "stopped: http://127.0.0.1:" in printed and message in printed
    if live == "lie":
        assert "scheduler 1: k0=0, pending" not in printed and "scheduler 1: k0=0" in printed
    if live == "stuck":
        assert "scheduler 0: k0=0, pending {'k0': 4" in printed  # the change it never applied
    assert [e["event"] for e in ev if e["event"] in ("start", "stop")] == ["start", "stop"]
    recs = report.load_jsonl(str(tmp_path / "out" / "results.jsonl"))
    assert [(r["arm"], r["concurrency"]) for r in recs] == [("baseline", 1)]  # what was measured is kept
    assert (tmp_path / "out" / "results.md").exists()


@pytest.fixture
def running_server(tmp_path, monkeypatch):
    """A stand-in server we run ourselves (--url mode): --oea-k0 2 and an admin key."""
    fake_server, fake_bench, events, _ = serving_fakes.install(tmp_path, monkeypatch)
    port = servers.free_port()
    server = servers.Server([sys.executable, str(fake_server), "--model-path", "m", "--host", "127.0.0.1",
                             "--port", str(port), "--oea-k0", "2", "--admin-api-key", "secret"],
                            str(tmp_path / "server.log"), dict(os.environ))
    try:
        url = f"http://127.0.0.1:{port}"
        servers.wait_ready(url, 30, server.proc, server.log_path)
        yield url, fake_bench, events
    finally:
        server.stop()


def _url_argv(url, fake_bench, out, *extra):
    return ["--url", url, "--tokenizer", "t", "--k0", "4", "--concurrency", "2", "--repeats", "1",
            "--num-prompts", "2", "--output-len", "4", "--warmup-prompts", "0", "--switch-warmup-prompts", "0",
            "--bench-module", str(fake_bench), "--out-dir", str(out), *extra]


def test_url_mode_sends_the_admin_key_and_puts_the_settings_back(running_server, tmp_path):
    url, fake_bench, events = running_server
    assert ab_serving.main(_url_argv(url, fake_bench, tmp_path / "out", "--admin-api-key", "secret")) == 0
    ev = serving_fakes.read_events(events)
    # no warm-ups (--switch-warmup-prompts 0): a pending change is enough before a run, whose first pass
    # applies it; the server's k0 2 is put back at the end
    assert sequence(ev) == [INFO, post(0), INFO, *measured(0, 2, 1, n=2, out=4), post(4), INFO,
                            *measured(4, 2, 1, n=2, out=4), post(2), INFO]
    assert not any(e["event"] in ("unauthorized", "stop") for e in ev)  # the user's server keeps running
    recs = report.load_jsonl(str(tmp_path / "out" / "results.jsonl"))
    assert {r["server_mode"] for r in recs} == {"url"} and len(recs) == 2
    assert [r["oea_states"][0]["pending"]["k0"] for r in recs] == [0, 4]  # accepted, not yet in force


def test_url_mode_without_the_admin_key_is_refused(running_server, tmp_path, capsys):
    url, fake_bench, events = running_server
    assert ab_serving.main(_url_argv(url, fake_bench, tmp_path / "out")) == 2
    assert "HTTP 401" in capsys.readouterr().out
    assert [e["event"] for e in serving_fakes.read_events(events)].count("unauthorized") == 2  # the switch, the restore


def test_a_server_without_live_settings_is_refused(tmp_path, monkeypatch, capsys):
    """--url on a server with no OEA state (a plain server, or one without --oea-k0)."""
    fake_server, fake_bench, events, _ = serving_fakes.install(tmp_path, monkeypatch)
    port = servers.free_port()
    server = servers.Server([sys.executable, str(fake_server), "--model-path", "m", "--host", "127.0.0.1",
                             "--port", str(port)], str(tmp_path / "server.log"), dict(os.environ))
    try:
        servers.wait_ready(f"http://127.0.0.1:{port}", 30, server.proc, server.log_path)
        assert ab_serving.main(_url_argv(f"http://127.0.0.1:{port}", fake_bench, tmp_path / "out")) == 2
    finally:
        server.stop()
    assert "report no OEA state" in capsys.readouterr().out
    assert not any(e["event"] in ("post", "run") for e in serving_fakes.read_events(events))


def test_mode_flags_and_server_flags():
    for argv, message in ((["--url", "u", "--two-servers"], "--url"),
                          (["--url", "u", "--baseline-url", "b"], "--url"),
                          (["--baseline-url", "b", "--two-servers"], "--two-servers"),
                          (["--model-path", "m", "--k0", "0"], ">= 1")):
        with pytest.raises(SystemExit, match=message):
            args = ab_serving.parse_args(argv, argv)
            ab_serving.apply_defaults(args)
            ab_serving.check_mode(args)
    args = ab_serving.parse_args(["--model-path", "m", "--oea-min-batch", "2", "--port", "0"], [])
    ab_serving.apply_defaults(args)
    assert 0 < args.port < 65536  # --port 0: a free one
    assert one_server.one_server_flags(args, ["--tp", "8"]) == ["--oea-k0", "0", "--oea-min-batch", "2",
                                                                 "--enable-metrics"]
    assert one_server.one_server_flags(args, ["--enable-metrics"])[-1] == "2"  # not given twice
    with pytest.raises(SystemExit, match="remove --oea-k0"):
        one_server.one_server_flags(args, ["--oea-k0=4"])


def test_live_settings_checks():
    states = [{"k0": 4, "min_batch": 2, "max_batch": 0}, {"k0": 4, "min_batch": 3, "max_batch": 0}]
    live_settings.check_states(states, {"oea_k0": 4, "oea_max_batch": 0})
    with pytest.raises(live_settings.LiveSettingsError, match=r"scheduler 1: k0=4, min_batch=3$"):
        live_settings.check_states(states, {"oea_k0": 4, "oea_min_batch": 2})
    with pytest.raises(live_settings.LiveSettingsError, match="disagree on their OEA settings"):
        live_settings.current_settings(states)  # the schedulers disagree on min_batch
    assert live_settings.current_settings(states[:1]) == {"oea_k0": 4, "oea_min_batch": 2, "oea_max_batch": 0}
    # a change not yet applied: accepted (it reaches the next pass), not in force
    pending = [{"k0": 0, "min_batch": 2, "max_batch": 0, "pending": {"k0": 4, "min_batch": 2, "max_batch": 0}}]
    live_settings.check_states(pending, {"oea_k0": 4}, in_force=False)
    with pytest.raises(live_settings.LiveSettingsError, match="did not have in force"):
        live_settings.check_states(pending, {"oea_k0": 4})
    with pytest.raises(live_settings.LiveSettingsError, match="did not have in force"):
        live_settings.check_states(pending, {"oea_k0": 0})  # in force, but about to change
    assert live_settings.current_settings(pending) == {"oea_k0": 4, "oea_min_batch": 2, "oea_max_batch": 0}
    assert live_settings.arm_settings(3, None, 64) == {"oea_k0": 3, "oea_max_batch": 64}
    assert live_settings.decode_log_interval({"decode_log_interval": 1}) == 1
    assert live_settings.decode_log_interval({}) == live_settings.DEFAULT_DECODE_LOG_INTERVAL


def test_quality_ab_compares_off_and_on_on_one_server(running_server, tmp_path):
    """quality_ab.py --url: baseline at oea_k0 0, OEA at --k0, the noise floor at 0 again, then the
    server's own k0 back; the fake's completions are the k0 in force, so the arms must differ."""
    url, _, events = running_server
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": [1, 2]}\n{"prompt": "c"}\n')
    out = tmp_path / "q"
    argv = ["--url", url, "--k0", "4", "--admin-api-key", "secret", "--prompts", str(prompts), "--concurrency", "2",
            "--max-tokens", "3", "--noise-floor", "--out", str(out)]
    assert quality_ab.main(argv) == 0
    ev = serving_fakes.read_events(events)
    steps = [("completion", e["k0"]) if e["event"] == "completion" else sequence([e])[0]
             for e in ev if e["event"] in ("post", "info", "completion")]
    # each arm: the POST, accepted (INFO), the k0 its steps are labelled with (INFO), the completions,
    # in force after (INFO); the server's own k0 2 put back at the end
    assert steps == [INFO, post(0), INFO, INFO, *[("completion", 0)] * 3, INFO, post(4), INFO, INFO,
                     *[("completion", 4)] * 3, INFO, post(0), INFO, INFO, *[("completion", 0)] * 3, INFO, post(2), INFO]
    report_ = json.loads((out / "quality.json").read_text())
    assert report_["agreement"]["token_agreement"] == 0.0  # every OEA token is 4, every baseline token 0
    assert report_["noise_floor"]["token_agreement"] == 1.0
    assert report_["warnings"] == []  # the baseline arm's counters applied nothing: no warning
    arm = json.loads((out / "arm_oea.json").read_text())
    assert arm["oea_live"] == {"oea_k0": 4}
    assert [(s["k0"], s.get("pending")) for s in arm["oea_states"]] == [(4, None)] * 2  # in force after the arm


def test_quality_ab_live_mode_flags(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    common = ["--prompts", str(prompts), "--concurrency", "1", "--max-tokens", "1", "--out", str(tmp_path / "q")]
    for extra, message in ((["--url", "http://127.0.0.1:9"], "--url needs --k0 >= 1"),
                           (["--url", "http://127.0.0.1:9", "--k0", "4", "--base-url", "http://b"], "--url runs both"),
                           (["--base-url", "http://b", "--oea-url", "http://o", "--k0", "4"], "--k0 goes with --url")):
        assert quality_ab.main(extra + common) == 2
        assert message in capsys.readouterr().err
