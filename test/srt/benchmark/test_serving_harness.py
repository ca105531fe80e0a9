"""The A/B serving harness (benchmark/oea/serving/ab_serving.py and its modules): no SGLang server,
no GPU, a few seconds. Defaults and command lines, prompt files, process groups, the orchestration
(servers one at a time, process groups killed) against a stand-in server and a stand-in bench
client, run both in one bench driver process per arm (the default) and as a subprocess per run;
the bench driver itself.
"""

import hashlib
import json
import os
import shlex
import sys
import textwrap
import time

import pytest

from common import report
from serving import ab_serving, bench_client, prompt_files, servers
import serving_fakes  # noqa: I001  (this folder's stand-ins)

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TRAINED_MODEL = os.path.join(_ROOT, "benchmark", "oea", "models", "qwen3_moe_stdlib")
APPLIED = 'sglang:oea_decode_steps_applied_total{tp_rank="0",mode="decode"}'  # the fake server's counters
SKIPPED = 'sglang:oea_decode_steps_skipped_total{tp_rank="0",mode="decode",reason="off"}'


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-12)


def _parse(argv):
    args = ab_serving.build_parser().parse_args(argv)
    ab_serving.apply_defaults(args)
    return args


def test_defaults_and_prompt_scaling():
    gpu = _parse(["--model-path", "m"])
    assert gpu.concurrency == [16, 32, 64] and gpu.repeats == 3
    assert gpu.k0 == [4]
    assert [prompt_files.num_prompts_for(c, gpu) for c in (1, 8, 16, 1024)] == [32, 32, 64, 4096]
    cpu = _parse(["--cpu", "--model-path", "m", "--k0", "3", "4", "5"])
    assert cpu.concurrency == [1, 4, 16, 32, 64] and cpu.k0 == [3, 4, 5]
    assert [prompt_files.num_prompts_for(c, cpu) for c in (1, 4, 16)] == [8, 8, 32]
    fixed = _parse(["--cpu", "--model-path", "m", "--num-prompts", "5"])
    assert prompt_files.num_prompts_for(64, fixed) == 5
    smoke = _parse(["--smoke"])
    assert smoke.cpu and smoke.concurrency == [1, 2] and smoke.repeats == 1 and smoke.num_prompts == 4


def test_bench_command_and_flags():
    args = _parse(["--cpu", "--model-path", "/m", "--oea-min-batch", "2", "--oea-max-batch", "64"])
    cmd = bench_client.bench_command(args, "http://127.0.0.1:31000", 16, 32, 7, 64, "/tmp/o.jsonl")
    joined = " ".join(cmd)
    for part in ("-m sglang.benchmark.serving", "--backend sglang", "--host 127.0.0.1", "--port 31000",
                 "--tokenizer /m", "--dataset-name random-ids", "--tokenize-prompt", "--random-input-len 64",
                 "--random-output-len 64", "--random-range-ratio 1.0", "--num-prompts 32",
                 "--max-concurrency 16", "--seed 7", "--output-file /tmp/o.jsonl", "--flush-cache"):
        assert part in joined, part
    assert ab_serving.oea_flags(3, args) == ["--oea-k0", "3", "--oea-min-batch", "2", "--oea-max-batch", "64"]
    assert servers.launcher_command(args)[-2:] == ["-m", "sglang_oea.cpu_serve"]
    own, passthrough = ab_serving._split_passthrough(["--cpu", "--", "--tp", "8"])
    assert own == ["--cpu"] and passthrough == ["--tp", "8"]
    # a prompt file swaps only the dataset: same token-id prompts, fixed lengths, EOS ignored
    fixed = _parse(["--cpu", "--model-path", "/m", "--prompt-file", "/p.json"])
    cmd = bench_client.bench_arguments(fixed, "http://127.0.0.1:31000", 16, 32, 7, 64, "/tmp/o.jsonl")
    assert cmd[cmd.index("--dataset-name"):][:4] == ["--dataset-name", "random", "--dataset-path", "/p.json"]
    assert "random-ids" not in cmd and "--disable-ignore-eos" not in cmd
    for flag in ("--tokenize-prompt", "--random-input-len", "--random-output-len", "--random-range-ratio"):
        assert flag in cmd


def _write_prompts(path, n, words=40):
    return prompt_files.write_prompt_file(str(path), [(" ".join(["def f(x):"] * words), "return x") for _ in range(n)])


def test_prompt_file_is_validated_naming_the_option(tmp_path):
    args = _parse(["--cpu", "--model-path", TRAINED_MODEL, "--concurrency", "4", "16", "--input-len", "16",
                   "--prompt-file", _write_prompts(tmp_path / "p.json", 32)])
    label = prompt_files.check_prompt_file(args)
    assert label.startswith("p.json sha256:") and len(label.split(":")[1]) == 12
    assert len(prompt_files.load_prompt_file(args.prompt_file)) == 32

    def refused(content=None, n=None, input_len=16, name="bad.json"):
        path = tmp_path / name
        if content is not None:
            path.write_text(content)
        elif n is not None:
            _write_prompts(path, n)
        args.prompt_file, args.input_len = str(path), input_len
        with pytest.raises(SystemExit) as e:
            prompt_files.check_prompt_file(args)
        assert str(e.value).startswith(f"--prompt-file {path}: "), e.value
        return str(e.value)

    assert "cannot read" in refused(name="missing.json")
    assert "not JSON" in refused("{")
    assert "non-empty JSON list" in refused("[]")
    assert "entry 1" in refused(json.dumps([{"conversations": [{"value": "a"}, {"value": "b"}]},
                                            {"conversations": [{"value": "a"}]}]))
    assert "entry 0" in refused(json.dumps([{"conversations": [{"value": ""}, {"value": "b"}]}]))
    assert "31 prompts, but a run of this sweep sends 32" in refused(n=31)  # 2 * C=16
    assert "shorter than --input-len 4096" in refused(n=32, input_len=4096)


def test_server_stop_kills_whole_process_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    code = (f"import subprocess, time\np = subprocess.Popen(['sleep', '300'])\n"
            f"open({str(pidfile)!r}, 'w').write(str(p.pid))\ntime.sleep(300)\n")
    server = servers.Server([sys.executable, "-c", code], str(tmp_path / "s.log"), dict(os.environ))
    for _ in range(100):
        if pidfile.exists() and pidfile.read_text():
            break
        time.sleep(0.05)
    child = int(pidfile.read_text())
    server.stop(grace_s=5)
    assert server.proc.returncode is not None
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


@pytest.mark.parametrize("mode", ["driver", "subprocess"])
def test_two_server_mode_end_to_end_with_stand_ins(tmp_path, monkeypatch, mode):
    fake_server, fake_bench, events, bench_events = serving_fakes.install(tmp_path, monkeypatch)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    out = tmp_path / "out"
    # driver mode also reads a prompt file (its tokenizer cannot load here: lengths go unchecked)
    prompts = _write_prompts(tmp_path / "prompts.json", 8)
    client = (["--bench-module", str(fake_bench), "--prompt-file", prompts] if mode == "driver"
              else ["--bench-cmd", f"{sys.executable} {fake_bench}"])
    argv = ["--two-servers", "--model-path", str(tmp_path), "--port", str(servers.free_port()), "--k0", "3", "5",
            "--oea-max-batch", "64", "--concurrency", "1", "4", "--repeats", "2", "--num-prompts", "4",
            "--warmup-prompts", "2", "--cooldown", "0", "--ready-timeout", "30", "--out-dir", str(out),
            "--launcher", f"{sys.executable} {fake_server}", *client, "--", "--load-format", "dummy"]
    assert ab_serving.main(argv) == 0
    command = (out / "command.txt").read_text().splitlines()
    assert command[0] == shlex.join([sys.executable, ab_serving.__file__, *argv])
    assert "# environment: OMP_NUM_THREADS=3" in command  # thread settings travel with the results

    # driver: one client process (one import) per arm, serving its warm-up and its 4 runs;
    # subprocess: a fresh process (and import) per run
    ev = serving_fakes.read_events(events)
    runs = [e for e in ev if e["event"] == "run"]
    assert len(runs) == 3 * (1 + 2 * 2)
    data = ["random", prompts] if mode == "driver" else ["random-ids", None]
    assert all(e["data"] == data for e in runs)  # warm-up included
    imports = [e["pid"] for e in serving_fakes.read_events(bench_events) if e["event"] == "import"]
    if mode == "driver":
        assert len(imports) == 3 and len(set(imports)) == 3
        for k0 in (None, 3, 5):
            assert len({e["pid"] for e in runs if e["k0"] == k0}) == 1
        for pid in imports:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)  # every driver is gone
        log_text = (out / "runs" / "oea-k0=3_c4_r1.log").read_text()
        assert "-m sglang" not in log_text.splitlines()[0] and "fake_bench.py" in log_text.splitlines()[0]
        assert "fake bench run 4 2" in log_text  # the run's own stdout lands in its log
    else:
        assert len(imports) == len(runs) and len(set(imports)) == len(runs)

    life = [e for e in ev if e["event"] in ("start", "stop")]
    assert [(e["event"], e["k0"]) for e in life] == [("start", None), ("stop", None), ("start", 3), ("stop", 3),
                                                     ("start", 5), ("stop", 5)]
    assert life[0]["max_batch"] is None and life[2]["max_batch"] == 64  # only OEA arms get --oea-* flags
    assert not any(e["event"] == "post" for e in ev)  # nothing is set live
    for stop, start in zip(life[1::2], life[2::2]):
        assert stop["t"] <= start["t"]  # never two servers at once
    for e in life[::2]:
        with pytest.raises(ProcessLookupError):
            os.kill(e["child"], 0)  # the server's whole process group is gone

    recs = report.load_jsonl(str(out / "results.jsonl"))
    assert len(recs) == 3 * 2 * 2
    assert {(r["arm"], r["concurrency"], r["repeat"]) for r in recs} == {
        (a, c, r) for a in ("baseline", "oea-k0=3", "oea-k0=5") for c in (1, 4) for r in (0, 1)}
    assert all("server_info" not in r for r in recs)
    assert all(r["bench_concurrency"] == 0.97 for r in recs)  # bench's achieved mean kept apart
    label = "prompts.json sha256:" + hashlib.sha256(open(prompts, "rb").read()).hexdigest()[:12]
    assert {r["prompts"] for r in recs} == {label if mode == "driver" else "random-ids"}
    assert {r["seed"] for r in recs if r["repeat"] == 1} == {2}
    # counters are differenced over the run (256 output tokens = 256 fake steps); gauges kept as read
    for r in recs:
        steps = (256.0, 0.0) if r["k0"] else (0.0, 256.0)
        assert r["oea_metrics_delta"] == {APPLIED: steps[0], SKIPPED: steps[1]}  # only samples named *oea*
        assert r["oea_metrics"]['sglang:oea_k0{tp_rank="0"}'] == (r["k0"] or 0)
    s = report.summarize(recs)
    assert s.warnings == []
    # k0=3 at C=4: repeat 0 (400*1.5 + 1) / (400 + 1), repeat 1 (600 + 2) / (400 + 2)
    r = s.ratios[(4, "oea-k0=3")]
    assert (r.lo, r.hi, r.n) == (approx(602 / 402), approx(601 / 401), 2)
    assert (out / "results.png").stat().st_size > 0 and (out / "results.md").stat().st_size > 0


_DRIVER_TARGET = textwrap.dedent('''
    import os, sys, time
    print("imported")
    def cli_main():
        what = sys.argv[1]
        print("stdout", what, flush=True)
        os.write(2, b"fd2 " + what.encode() + b"\\n")
        if what == "sleep":
            time.sleep(60)
        elif what == "exit3":
            sys.exit(3)
        elif what == "raise":
            raise ValueError("boom")
        elif what == "parser":
            sys.exit("usage: bad flag")
''')


def test_bench_driver_runs_and_timeouts(tmp_path):
    target = tmp_path / "target.py"
    target.write_text(_DRIVER_TARGET)
    drv = bench_client.BenchDriver(str(target), str(tmp_path / "driver.log"), dict(os.environ), 60)
    try:
        assert drv.wait_ready()["ready"] is True
        for what, rc in (("ok", 0), ("exit3", 3), ("raise", 1), ("parser", 1), ("ok", 0)):
            log_path = tmp_path / f"{what}.log"
            assert drv.run([what], str(log_path), 30) == rc, what
            text = log_path.read_text()
            assert f"stdout {what}" in text and f"fd2 {what}" in text
        assert "ValueError: boom" in (tmp_path / "raise.log").read_text()
        assert "usage: bad flag" in (tmp_path / "parser.log").read_text()
        assert "imported" in (tmp_path / "driver.log").read_text()  # import chatter: driver log, not protocol
        pid = drv.proc.pid
        t0 = time.time()
        with pytest.raises(bench_client.DriverTimeout):
            drv.run(["sleep"], str(tmp_path / "sleep.log"), 1.0)
        assert time.time() - t0 < 20
        assert not drv.alive()
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
    finally:
        drv.close()


def test_run_bench_through_driver_maps_timeout(tmp_path):
    target = tmp_path / "target.py"
    target.write_text(_DRIVER_TARGET)
    drv = bench_client.BenchDriver(str(target), str(tmp_path / "driver.log"), dict(os.environ), 60)
    try:
        with pytest.raises(RuntimeError, match="bench_serving timed out after 1s"):
            bench_client.run_bench(["x", "sleep"], str(tmp_path / "o.jsonl"), str(tmp_path / "s.log"), 1.0, None,
                                 driver=drv, argv=["sleep"])
        with pytest.raises(RuntimeError, match="bench driver is not running"):
            bench_client.run_bench(["x", "ok"], str(tmp_path / "o.jsonl"), str(tmp_path / "s.log"), 1.0, None,
                                 driver=drv, argv=["ok"])  # the dead driver is reported, not hung on
    finally:
        drv.close()


def test_url_mode_needs_tokenizer(tmp_path):
    with pytest.raises(SystemExit):
        ab_serving.main(["--baseline-url", "http://127.0.0.1:1", "--oea-url", "http://127.0.0.1:2",
                         "--out-dir", str(tmp_path)])


def test_wait_ready_gives_up_at_once_when_the_port_was_taken(tmp_path):
    """uvicorn logs the bind error and the server hangs: waiting would last the whole timeout."""
    log = tmp_path / "server.log"
    log.write_text("INFO: Application startup complete.\nERROR: [Errno 98] error while attempting to bind on "
                   "address ('127.0.0.1', 1): address already in use\n")
    start = time.time()
    with pytest.raises(servers.PortTakenError, match="could not bind its port"):
        servers.wait_ready(f"http://127.0.0.1:{servers.free_port()}", 300, None, str(log))
    assert time.time() - start < 30


def test_no_key_reaches_the_ab_files(tmp_path, monkeypatch):
    """ab_serving's command.txt and sweep's server_info_<arm>.json hold no key: SGLang 0.5.23's
    /server_info returns api_key, admin_api_key and the launch line in plain text."""
    import json
    import types

    from serving import ab_serving, sweep

    args = types.SimpleNamespace(out_dir=str(tmp_path), argv=["--url", "http://h", "--admin-api-key", "s3cret-admin"])
    ab_serving.write_command(args)
    info = {"api_key": "s3cret-api", "admin_api_key": "s3cret-admin", "internal_states": [{"oea": {"k0": 0}}],
            "launch_command": "sglang serve --model-path m --admin-api-key s3cret-admin --api-key=s3cret-api"}
    monkeypatch.setattr(sweep, "http_get", lambda url: json.dumps(info))
    sweep.save_server_info(sweep.Arm("baseline", None), "http://h", str(tmp_path))
    written = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert set(written) == {"command.txt", "server_info_baseline.json"}
    assert not [name for name, text in written.items() if "s3cret" in text], written
    assert json.loads(written["server_info_baseline.json"])["internal_states"] == [{"oea": {"k0": 0}}]
