"""The trial on a protected server, and its restore whatever happens (benchmark/oea/trial/trial.py,
guard.py; common/http.py's keys): against serving_fakes.py's stand-in server, started with
--api-key and --admin-api-key (answering as SGLang 0.5.23 does: 401 bodies, /flush_cache needing
the admin key, one boolean per rank from /set_internal_state) at a non-zero k0, and its stand-in
bench (which sends OPENAI_API_KEY as bench_serving does).

- keys: each request carries the right key, the bench only the API key, the cache flushed with
  the admin key; no file the trial leaves holds a key; /server_info's keys and launch command
  redacted; a missing or wrong key named before anything is set;
- the restore: a POST failing once (retried), failing always (exit 2, what the server is left at),
  an exception while building the report, SIGTERM and a second one during the restore, a first
  SIGTERM during the restore, SIGKILL of the trial (the guard puts the settings back);
- the guard alone: it leaves a server someone else changed, and exits after the trial's "done".
No SGLang server: seconds each (the one CPU server's checks are in test_trial.py).
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from contextlib import contextmanager

import pytest

from common.http import Auth, http_json, redact, redact_argv
from serving import live_settings, servers
from serving.prompt_files import write_prompt_file
from trial import guard as tg, trial
import serving_fakes  # noqa: I001  (this folder's stand-ins)

TRIAL = os.path.abspath(trial.__file__)
TRAINED = os.path.join(os.path.dirname(os.path.dirname(TRIAL)), "models", "qwen3_moe_stdlib")  # its tokenizer
API, ADMIN = "api-Qx7-5ecret-key", "adm-Zk9-5ecret-key"
START_K0 = 2  # the fake starts here: a trial must put back this, not 0


class Fake:
    """A running stand-in server: its URL, the bench module, the event log."""

    def __init__(self, url, bench, events, tmp_path):
        self.url, self.bench, self.events, self.tmp_path = url, bench, events, tmp_path

    def ev(self):
        return serving_fakes.read_events(self.events)

    def state(self):
        """Scheduler 0's OEA state, read with the API key (never through the trial's registry)."""
        info = http_json(self.url + "/server_info", headers={"Authorization": f"Bearer {API}"})
        return info["internal_states"][0]["oea"]

    def k0(self):
        state = self.state()
        return (state.get("pending") or state)["k0"]

    def release(self, i):
        (self.tmp_path / f"hold.{i}").write_text("go")

    def wait_event(self, pred, timeout=120):
        servers.wait_until(lambda: any(pred(e) for e in self.ev()), timeout)
        assert any(pred(e) for e in self.ev()), self.ev()[-5:]


@contextmanager
def fake_server(tmp_path, monkeypatch, keys=True, **env):
    """The stand-in server on a port it picks itself, at k0 START_K0, both keys when `keys`."""
    server, bench, events, _ = serving_fakes.install(tmp_path, monkeypatch)
    monkeypatch.setenv("FAKE_HOLD_FILE", str(tmp_path / "hold"))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    flags = ["--api-key", API, "--admin-api-key", ADMIN] if keys else []
    proc = servers.Server([sys.executable, str(server), "--model-path", "m", "--host", "127.0.0.1", "--port", "0",
                           "--oea-k0", str(START_K0), "--enable-metrics", *flags], str(tmp_path / "server.log"),
                          dict(os.environ))
    try:
        servers.wait_until(lambda: any(e["event"] == "start" for e in serving_fakes.read_events(events)), 60)
        port = next(e["port"] for e in serving_fakes.read_events(events) if e["event"] == "start")
        url = f"http://127.0.0.1:{port}"
        servers.wait_ready(url, 60, proc.proc, proc.log_path)
        yield Fake(url, bench, events, tmp_path)
    finally:
        proc.stop()


def trial_argv(fake, out, *extra):
    """One short trial: OEA off and k0 4 at C=4 (the fake's gate opens at 4), one block."""
    prompts = fake.tmp_path / "prompts.json"
    write_prompt_file(str(prompts), [(f"prompt {i}: " + "some words of text " * 20, "") for i in range(12)])
    return ["--url", fake.url, "--tokenizer", TRAINED, "--k0", "4", "--concurrency", "4", "--prompt-file",
            str(prompts), "--input-len", "8", "--output-len", "8", "--prompts-per-concurrency", "2",
            "--min-prompts", "8", "--warmup-prompts", "0", "--max-repeats", "1", "--budget-minutes", "5",
            "--out-dir", str(out), *extra]


@pytest.fixture
def fake_bench_in_trial(monkeypatch):
    """The trial's sweep runs the stand-in bench (module path set after sweep_args builds the namespace)."""
    def use(bench):
        real = trial.sweep_args

        def patched(*args, **kwargs):
            sargs = real(*args, **kwargs)
            sargs.bench_module = str(bench)
            return sargs
        monkeypatch.setattr(trial, "sweep_args", patched)
    return use


def files_holding(root, *secrets):
    return sorted(str(p) for p in root.rglob("*") if p.is_file() and any(s.encode() in p.read_bytes() for s in secrets))


def posts(fake, settings):
    return [e for e in fake.ev() if e["event"] == "post" and e["settings"] == settings]


# ----------------------------------------------------------------------------- keys


def test_redaction_of_server_info_and_command_lines():
    info = {"api_key": API, "admin_api_key": ADMIN, "ssl_keyfile_password": "pw", "ssl_keyfile": "/k.pem",
            "watermark_key": None, "max_total_tokens": 8, "tokenizer_path": "/m",
            "launch_command": f"sglang serve --model /m --api-key {API} --admin-api-key={ADMIN} --port 1",
            "internal_states": [{"api_key": API, "oea": {"k0": 4}}], "argv": ["--hf-token", "t0k", "--tp", "8"]}
    out = redact(info)
    assert out["api_key"] == out["admin_api_key"] == out["ssl_keyfile_password"] == "<redacted>"
    assert (out["ssl_keyfile"], out["watermark_key"], out["max_total_tokens"]) == ("/k.pem", None, 8)
    assert out["launch_command"] == ("sglang serve --model /m --api-key <redacted> --admin-api-key=<redacted> "
                                     "--port 1")
    assert out["internal_states"] == [{"api_key": "<redacted>", "oea": {"k0": 4}}]
    assert out["argv"] == ["--hf-token", "<redacted>", "--tp", "8"]
    assert API not in json.dumps(redact({"note": f"said {API} here"}, [API]))  # a known key anywhere
    assert redact_argv(["trial.py", "--api-key", API, "--k0", "4"]) == ["trial.py", "--api-key", "<redacted>",
                                                                         "--k0", "4"]
    auth = Auth(API, ADMIN)
    assert API not in repr(auth) and ADMIN not in repr(auth)
    assert (auth.key_for("/metrics"), auth.key_for("/server_info"), auth.key_for("/flush_cache")) == (None, API, ADMIN)
    assert Auth(API).key_for("/set_internal_state") == API and not auth.bench_flushes() and Auth(API).bench_flushes()


def test_a_trial_on_a_protected_server_sends_each_key_where_needed_and_writes_none(
        tmp_path, monkeypatch, fake_bench_in_trial, capsys):
    monkeypatch.setenv("OEA_ADMIN_API_KEY", ADMIN)  # the admin key from the environment, the API key as a flag
    with fake_server(tmp_path, monkeypatch) as fake:
        fake_bench_in_trial(fake.bench)
        out = tmp_path / "trial"
        before = len(fake.ev())  # the fixture's own readiness check asked /v1/models without a key
        assert trial.main(trial_argv(fake, out, "--api-key", API)) == 0
        assert fake.k0() == START_K0 and "pending" not in fake.state()
        ev = fake.ev()[before:]
    assert not [e for e in ev if e["event"] == "unauthorized"]
    flushes = [e["auth"] for e in ev if e["event"] == "flush"]
    runs = [e for e in ev if e["event"] == "run"]
    assert flushes and set(flushes) == {"admin"} and len(flushes) == len(runs)  # by the trial, before each run
    assert {r["warmup"] for r in runs} == {0}  # bench_serving's own warm-up would fill the flushed cache again
    bench_env = {tuple(r["env_keys"]) for r in runs}
    assert bench_env == {("OPENAI_API_KEY",)}, bench_env  # the API key only, never the admin key's variable
    result = json.loads((out / "results.json").read_text())
    assert result["status"] == "done" and result["restore"]["by"] == "the trial"
    assert result["restored"] == {"oea_k0": START_K0} and "--api-key '<redacted>'" in result["command"]
    assert "keys: an API key and an admin key given" in " ".join(result["preflight"]["lines"])
    snapshot = json.loads((out / "server_info_baseline.json").read_text())
    assert snapshot["admin_api_key"] == snapshot["internal_states"][1]["api_key"] == "<redacted>"
    assert "--api-key <redacted>" in snapshot["launch_command"]
    assert (out / "guard.log").exists() and files_holding(out, API, ADMIN) == []
    printed = capsys.readouterr()
    assert API not in printed.out + printed.err and ADMIN not in printed.out + printed.err


@pytest.mark.parametrize("given, message, refused_at", [
    ({}, "the server needs its API key (HTTP 401 on /server_info", "/server_info"),
    ({"OEA_API_KEY": "wrong"}, "the server refused the API key given (HTTP 401 on /server_info)", "/server_info"),
    ({"OEA_API_KEY": API}, "live settings need the server's admin key (HTTP 401 on /set_internal_state with the API "
                           "key", "/set_internal_state"),
    ({"OEA_API_KEY": API, "OEA_ADMIN_API_KEY": "wrong"}, "the server refused the admin key given (HTTP 401 on "
                                                         "/set_internal_state)", "/set_internal_state"),
])
def test_a_missing_or_wrong_key_is_named_before_anything_is_set(tmp_path, monkeypatch, capsys, given, message,
                                                                 refused_at):
    for name in ("OEA_API_KEY", "OEA_ADMIN_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    with fake_server(tmp_path, monkeypatch, **given) as fake:
        before = len(fake.ev())
        assert trial.main(trial_argv(fake, tmp_path / "trial")) == 2
        assert message in capsys.readouterr().err
        ev = fake.ev()[before:]
    assert [e["path"] for e in ev if e["event"] == "unauthorized"] == [refused_at]
    assert not [e for e in ev if e["event"] in ("post", "run", "flush")]


def test_an_open_server_is_trialled_as_before(tmp_path, monkeypatch, fake_bench_in_trial):
    """No key anywhere: bench_serving flushes the cache itself (--flush-cache, with its warm-up)."""
    for name in ("OEA_API_KEY", "OEA_ADMIN_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    with fake_server(tmp_path, monkeypatch, keys=False) as fake:
        fake_bench_in_trial(fake.bench)
        assert trial.main(trial_argv(fake, tmp_path / "trial")) == 0
        ev = fake.ev()
        assert fake.k0() == START_K0
    assert {e["auth"] for e in ev if e["event"] == "flush"} == {None}
    assert {e["warmup"] for e in ev if e["event"] == "run"} == {1}


# ----------------------------------------------------------------------------- the restore, in process


def test_a_restore_post_failing_once_is_retried(tmp_path, monkeypatch, fake_bench_in_trial):
    monkeypatch.setenv("OEA_API_KEY", API)
    monkeypatch.setenv("OEA_ADMIN_API_KEY", ADMIN)
    monkeypatch.setattr(live_settings, "RESTORE_DELAYS", (0.1, 0.1))
    with fake_server(tmp_path, monkeypatch, FAKE_FAIL_SETTINGS=json.dumps({"oea_k0": START_K0})) as fake:
        fake_bench_in_trial(fake.bench)
        out = tmp_path / "trial"
        assert trial.main(trial_argv(fake, out)) == 0
        assert fake.k0() == START_K0
        assert [e["event"] for e in fake.ev() if e.get("settings") == {"oea_k0": START_K0}] == ["failed", "post"]
    restore = json.loads((out / "results.json").read_text())["restore"]
    assert restore["ok"] and restore["attempts"] == 2 and "HTTP 500" in restore["errors"][0]
    assert "(by the trial, the settings found at the start" in (out / "results.md").read_text()


def test_a_restore_that_fails_says_what_the_server_is_left_at(tmp_path, monkeypatch, fake_bench_in_trial):
    monkeypatch.setenv("OEA_API_KEY", API)
    monkeypatch.setenv("OEA_ADMIN_API_KEY", ADMIN)
    monkeypatch.setattr(live_settings, "RESTORE_DELAYS", (0.1,))
    with fake_server(tmp_path, monkeypatch, FAKE_FAIL_SETTINGS=json.dumps({"oea_k0": START_K0}),
                     FAKE_FAIL_TIMES="-1") as fake:
        fake_bench_in_trial(fake.bench)
        out = tmp_path / "trial"
        assert trial.main(trial_argv(fake, out)) == 2
        left = fake.k0()
    assert left != START_K0
    result = json.loads((out / "results.json").read_text())
    assert result["status"] == "done" and not result["restore"]["ok"]
    assert result["restore"]["left_at"] == {"oea_k0": left}
    markdown = (out / "results.md").read_text()
    assert "NOT put back" in markdown and f"left at {json.dumps({'oea_k0': left})}" in markdown
    assert "Authorization: Bearer $OEA_ADMIN_API_KEY" in markdown  # the rollback, never the key itself


def test_an_exception_while_building_the_report_does_not_skip_the_restore(tmp_path, monkeypatch,
                                                                          fake_bench_in_trial):
    monkeypatch.setenv("OEA_API_KEY", API)
    monkeypatch.setenv("OEA_ADMIN_API_KEY", ADMIN)

    def broken(*args, **kwargs):
        raise ValueError("a bug in the verdict")
    monkeypatch.setattr(trial, "build_cells", broken)
    with fake_server(tmp_path, monkeypatch) as fake:
        fake_bench_in_trial(fake.bench)
        out = tmp_path / "trial"
        assert trial.main(trial_argv(fake, out)) == 1
        assert fake.k0() == START_K0 and posts(fake, {"oea_k0": START_K0})
    result = json.loads((out / "results.json").read_text())
    assert "a bug in the verdict" in result["report_error"] and result["restore"]["ok"]
    assert "(by the trial, the settings found at the start" in (out / "results.md").read_text()
    assert "exiting" in (out / "guard.log").read_text()  # told, and gone: trial.main waited for it


# ----------------------------------------------------------------------------- signals and SIGKILL, a real process

WRAPPER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {bench_dir!r})
    from trial import trial
    real = trial.sweep_args

    def patched(*args, **kwargs):
        sargs = real(*args, **kwargs)
        sargs.bench_module = {fake_bench!r}
        return sargs

    trial.sweep_args = patched
    sys.exit(trial.main(sys.argv[1:]))
""")


@contextmanager
def trial_process(fake, out, mark):
    """trial.py with the stand-in bench, in its own process; keys in its environment."""
    script = fake.tmp_path / "run_trial.py"
    script.write_text(WRAPPER.format(bench_dir=os.path.dirname(os.path.dirname(TRIAL)), fake_bench=str(fake.bench)))
    env = {**os.environ, "OEA_API_KEY": API, "OEA_ADMIN_API_KEY": ADMIN, mark: "1", "PYTHONUNBUFFERED": "1"}
    log_path = fake.tmp_path / "trial.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(script), *trial_argv(fake, out)], stdout=log,
                                stderr=subprocess.STDOUT, env=env)
    try:
        yield proc, log_path
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def marked_processes(mark):
    """Live pids whose environment holds `mark`: what the trial started (its bench driver, its guard)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark.encode() in f.read() and int(pid) != os.getpid() and alive(pid):
                    found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("first_signal_at", ["an arm", "the restore"])
def test_signals_during_the_restore(tmp_path, monkeypatch, first_signal_at):
    """SIGTERM while k0 4 is being set, then a second one while the restore's POST is held by the
    fake; or the trial's first SIGTERM arriving during the restore at its normal end. Either way:
    the restore is made once, completes, and the trial ends as it should."""
    hold = [{"oea_k0": 4}, {"oea_k0": START_K0}] if first_signal_at == "an arm" else [{"oea_k0": START_K0}]
    mark = f"OEA_TRIAL_TEST_{uuid.uuid4().hex}"
    with fake_server(tmp_path, monkeypatch, FAKE_HOLD_SETTINGS=json.dumps(hold)) as fake:
        out = tmp_path / "trial"
        with trial_process(fake, out, mark) as (proc, log_path):
            if first_signal_at == "an arm":
                fake.wait_event(lambda e: e["event"] == "held" and e["index"] == 0)
                proc.send_signal(signal.SIGTERM)
                servers.wait_until(lambda: "signal 15: stopping" in log_path.read_text(), 120)
                fake.release(0)
            restore_hold = len(hold) - 1
            fake.wait_event(lambda e: e["event"] == "held" and e["index"] == restore_hold)
            proc.send_signal(signal.SIGTERM)
            fake.release(restore_hold)
            rc = proc.wait(timeout=300)
            printed = log_path.read_text()
        assert fake.k0() == START_K0 and "pending" not in fake.state()
        assert len(posts(fake, {"oea_k0": START_K0})) == 1, printed[-3000:]  # not cut short and made again
    assert rc == (130 if first_signal_at == "an arm" else 0), printed[-3000:]
    assert "held until the settings were put back" in printed
    result = json.loads((out / "results.json").read_text())
    assert result["status"] == ("interrupted" if first_signal_at == "an arm" else "done")
    assert result["restore"]["ok"] and result["restore"]["by"] == "the trial"
    assert not marked_processes(mark) and files_holding(tmp_path / "trial", API, ADMIN) == []


def test_sigkill_of_the_trial_while_an_arm_is_set_the_guard_puts_it_back(tmp_path, monkeypatch):
    mark = f"OEA_TRIAL_TEST_{uuid.uuid4().hex}"
    with fake_server(tmp_path, monkeypatch, FAKE_HOLD_SETTINGS=json.dumps([{"oea_k0": 4}])) as fake:
        out = tmp_path / "trial"
        with trial_process(fake, out, mark) as (proc, log_path):
            fake.wait_event(lambda e: e["event"] == "held")
            guard_pids = marked_processes(mark)
            proc.kill()  # SIGKILL: no clean-up of its own
            proc.wait()
            fake.release(0)  # the POST of k0 4 takes effect, after the trial is gone
            servers.wait_until(lambda: "put back" in (out / "guard.log").read_text(), 60)
            servers.wait_until(lambda: not marked_processes(mark), 60)
        guard_log = (out / "guard.log").read_text()
        assert fake.k0() == START_K0 and "pending" not in fake.state(), guard_log
    assert guard_pids and not marked_processes(mark)  # the guard (and the orphaned bench driver) are gone
    assert f'put back {{"oea_k0": {START_K0}}} by the guard' in guard_log
    assert 'the trial died with the server at {"oea_k0": 4}' in guard_log
    assert API not in guard_log and ADMIN not in guard_log


# ----------------------------------------------------------------------------- the guard alone


@pytest.mark.parametrize("ending", ["someone else changed it", "the trial died", "the trial said done"])
def test_the_guard(tmp_path, monkeypatch, ending):
    """The test plays the trial: the guard is told k0 4, then the 'trial' ends one way or another."""
    with fake_server(tmp_path, monkeypatch) as fake:
        log_path = tmp_path / "guard.log"
        client = tg.GuardClient(fake.url, Auth(API, ADMIN), {"oea_k0": START_K0}, str(log_path),
                                servers.child_env(), print)
        try:
            for where in (f"/proc/{client.proc.pid}/cmdline", f"/proc/{client.proc.pid}/environ"):
                with open(where, "rb") as f:
                    assert API.encode() not in f.read() and ADMIN.encode() not in f.read()
            live_settings.post_settings(fake.url, {"oea_k0": 4}, ADMIN)  # noted by the guard first
            if ending == "someone else changed it":
                http_json(fake.url + "/set_internal_state", {"server_args": {"oea_k0": 5}}, 30,
                          {"Authorization": f"Bearer {ADMIN}"})
            if ending == "the trial said done":
                client.finish()
            else:
                client.unwatch()
                client.proc.stdin.close()  # what the trial's death looks like from the guard
                client.proc.wait(timeout=60)
        finally:
            if client.proc.poll() is None:
                client.proc.kill()
        assert client.proc.returncode == 0
        text = log_path.read_text()
        expected = {"someone else changed it": 5, "the trial died": START_K0, "the trial said done": 4}[ending]
        assert fake.k0() == expected, text
    if ending == "someone else changed it":
        assert "someone changed it since, so it is left alone" in text
    elif ending == "the trial said done":
        assert "the trial put its settings back and ended" in text and "put back {" not in text
