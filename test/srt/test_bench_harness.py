"""Tests of the OEA benchmark harness (benchmark/oea): no SGLang server, no GPU, a few seconds.

- _report / ab_serving: medians, paired ratios and their min-max on recorded JSONL fixtures
  (test/srt/data/ab_*.jsonl; every expected number below is worked out by hand from them), the
  flagging of runs that cannot be paired, the PNG, and the orchestration (servers one at a time,
  process groups killed) against a stand-in server and a stand-in bench client, run both in one
  bench driver process per arm (the default) and as a subprocess per run; the bench driver itself.
- simulate: closed forms against Monte-Carlo, OEA's saving, fidelity bounds, suggest_max_batch,
  router-logit dumps.
"""

import hashlib
import json
import os
import shlex
import sys
import textwrap
import time

import pytest
import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
sys.path.insert(0, os.path.join(_ROOT, "benchmark", "oea"))
sys.path.insert(0, os.path.join(_ROOT, "python"))

import _report  # noqa: E402
import ab_serving  # noqa: E402
import simulate  # noqa: E402

CLEAN = os.path.join(_DATA, "ab_clean.jsonl")
TRAINED_MODEL = os.path.join(_ROOT, "benchmark", "oea", "models", "qwen3_moe_stdlib")
MISMATCH = os.path.join(_DATA, "ab_mismatch.jsonl")


def approx(x):
    return pytest.approx(x, rel=1e-9, abs=1e-12)


# ------------------------------------------------------------------------------------------------
# Report logic on recorded JSONL
# ------------------------------------------------------------------------------------------------


def test_clean_fixture_medians():
    s = _report.summarize(_report.load_jsonl(CLEAN))
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
    s = _report.summarize(_report.load_jsonl(CLEAN))
    # C=1: 130/100, 121/110, 108/90 = 1.3, 1.1, 1.2 (the ratio of medians would be 1.21)
    r1 = s.ratios[(1, "oea-k0=4")]
    assert (r1.median, r1.lo, r1.hi, r1.n) == (approx(1.2), approx(1.1), approx(1.3), 3)
    # C=4: 190/200, 242/220, 171/180 = 0.95, 1.1, 0.95
    r4 = s.ratios[(4, "oea-k0=4")]
    assert (r4.median, r4.lo, r4.hi, r4.n) == (approx(0.95), approx(0.95), approx(1.1), 3)
    assert (1, "baseline") not in s.ratios


def test_clean_fixture_table():
    table = _report.markdown_table(_report.summarize(_report.load_jsonl(CLEAN)), "clean")
    rows = [line for line in table.splitlines() if line.startswith("| 1 ") or line.startswith("| 4 ")]
    assert rows == [
        "| 1 | baseline | 3 | 100.0 (90.00-110.0) | 10.00 | 10.00 | 50.00 | 1 (ref) |",
        "| 1 | oea-k0=4 | 3 | 121.0 (108.0-130.0) | 8.500 | 8.200 | 42.00 | 1.200 (1.100-1.300) |",
        "| 4 | baseline | 3 | 200.0 (180.0-220.0) | 20.00 | 19.00 | 80.00 | 1 (ref) |",
        "| 4 | oea-k0=4 | 3 | 190.0 (171.0-242.0) | 21.00 | 20.00 | 85.00 | 0.950 (0.950-1.100) |",
    ]
    assert "Warnings" not in table


def test_mismatch_fixture_is_flagged_not_compared():
    s = _report.summarize(_report.load_jsonl(MISMATCH))
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
    table = _report.markdown_table(s)
    assert "| 8 | oea-k0=4 | 1 | 500.0 | 8.000 | 8.000 | 40.00 | not compared |" in table
    assert "**Warnings**" in table


def test_disagreeing_concurrency_reported_by_bench_is_flagged():
    recs = _report.load_jsonl(CLEAN)
    recs[3]["max_concurrency"] = 2  # oea-k0=4 C=1 repeat 0 ran at another concurrency
    s = _report.summarize(recs)
    assert any("bench_serving reports max_concurrency=2" in w for w in s.warnings)


def test_runs_on_different_prompt_sets_are_not_compared():
    recs = _report.load_jsonl(CLEAN)  # recorded before records named their prompts: all compared
    recs[3]["prompts"] = "p.json sha256:0123456789ab"  # oea-k0=4 C=1 repeat 0
    s = _report.summarize(recs)
    assert any("workload differs from baseline (prompts None vs p.json sha256:0123456789ab)" in w
               for w in s.warnings)
    assert s.ratios[(1, "oea-k0=4")].n == _report.summarize(_report.load_jsonl(CLEAN)).ratios[(1, "oea-k0=4")].n - 1


def test_plot_writes_png(tmp_path):
    s = _report.summarize(_report.load_jsonl(MISMATCH))
    path = _report.plot(s, str(tmp_path / "ab.png"), "mismatch")
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


# ------------------------------------------------------------------------------------------------
# Harness pieces
# ------------------------------------------------------------------------------------------------


def _parse(argv):
    args = ab_serving.build_parser().parse_args(argv)
    ab_serving.apply_defaults(args)
    return args


def test_defaults_and_prompt_scaling():
    gpu = _parse(["--model-path", "m"])
    assert gpu.concurrency == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024] and gpu.repeats == 3
    assert gpu.k0 == [4]
    assert [ab_serving.num_prompts_for(c, gpu) for c in (1, 8, 16, 1024)] == [32, 32, 64, 4096]
    cpu = _parse(["--cpu", "--model-path", "m", "--k0", "3", "4", "5"])
    assert cpu.concurrency == [1, 4, 16, 32, 64] and cpu.k0 == [3, 4, 5]
    assert [ab_serving.num_prompts_for(c, cpu) for c in (1, 4, 16)] == [8, 8, 32]
    fixed = _parse(["--cpu", "--model-path", "m", "--num-prompts", "5"])
    assert ab_serving.num_prompts_for(64, fixed) == 5
    smoke = _parse(["--smoke"])
    assert smoke.cpu and smoke.concurrency == [1, 2] and smoke.repeats == 1 and smoke.num_prompts == 4


def test_bench_command_and_flags():
    args = _parse(["--cpu", "--model-path", "/m", "--oea-min-batch", "2", "--oea-max-batch", "64"])
    cmd = ab_serving.bench_command(args, "http://127.0.0.1:31000", 16, 32, 7, 64, "/tmp/o.jsonl")
    joined = " ".join(cmd)
    for part in ("-m sglang.benchmark.serving", "--backend sglang", "--host 127.0.0.1", "--port 31000",
                 "--tokenizer /m", "--dataset-name random-ids", "--tokenize-prompt", "--random-input-len 64",
                 "--random-output-len 64", "--random-range-ratio 1.0", "--num-prompts 32",
                 "--max-concurrency 16", "--seed 7", "--output-file /tmp/o.jsonl", "--flush-cache"):
        assert part in joined, part
    assert ab_serving.oea_flags(3, args) == ["--oea-k0", "3", "--oea-min-batch", "2", "--oea-max-batch", "64"]
    assert ab_serving.launcher_command(args)[-2:] == ["-m", "sglang_oea.cpu_serve"]
    own, passthrough = ab_serving._split_passthrough(["--cpu", "--", "--tp", "8"])
    assert own == ["--cpu"] and passthrough == ["--tp", "8"]
    # a prompt file swaps only the dataset: same token-id prompts, fixed lengths, EOS ignored
    fixed = _parse(["--cpu", "--model-path", "/m", "--prompt-file", "/p.json"])
    cmd = ab_serving.bench_arguments(fixed, "http://127.0.0.1:31000", 16, 32, 7, 64, "/tmp/o.jsonl")
    assert cmd[cmd.index("--dataset-name"):][:4] == ["--dataset-name", "random", "--dataset-path", "/p.json"]
    assert "random-ids" not in cmd and "--disable-ignore-eos" not in cmd
    for flag in ("--tokenize-prompt", "--random-input-len", "--random-output-len", "--random-range-ratio"):
        assert flag in cmd


def _write_prompts(path, n, words=40):
    return ab_serving.write_prompt_file(str(path), [(" ".join(["def f(x):"] * words), "return x") for _ in range(n)])


def test_prompt_file_is_validated_naming_the_option(tmp_path):
    args = _parse(["--cpu", "--model-path", TRAINED_MODEL, "--concurrency", "4", "16", "--input-len", "16",
                   "--prompt-file", _write_prompts(tmp_path / "p.json", 32)])
    label = ab_serving.check_prompt_file(args)
    assert label.startswith("p.json sha256:") and len(label.split(":")[1]) == 12
    assert len(ab_serving.load_prompt_file(args.prompt_file)) == 32

    def refused(content=None, n=None, input_len=16, name="bad.json"):
        path = tmp_path / name
        if content is not None:
            path.write_text(content)
        elif n is not None:
            _write_prompts(path, n)
        args.prompt_file, args.input_len = str(path), input_len
        with pytest.raises(SystemExit) as e:
            ab_serving.check_prompt_file(args)
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
    server = ab_serving.Server([sys.executable, "-c", code], str(tmp_path / "s.log"), dict(os.environ))
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


# A stand-in `sglang serve`: answers /health, /v1/models, /get_server_info, /metrics; records when it
# ran; starts a child that must die with it.
_FAKE_SERVER = textwrap.dedent('''
    import argparse, json, os, signal, subprocess, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    p = argparse.ArgumentParser()
    p.add_argument("--model-path"); p.add_argument("--host"); p.add_argument("--port", type=int)
    p.add_argument("--oea-k0", type=int); p.add_argument("--oea-max-batch", type=int)
    p.add_argument("--load-format")
    a = p.parse_args()
    log = os.environ["FAKE_LOG"]
    child = subprocess.Popen(["sleep", "300"])
    def note(event):
        with open(log, "a") as f:
            f.write(json.dumps({"event": event, "k0": a.oea_k0, "max_batch": a.oea_max_batch,
                                "t": time.time(), "child": child.pid}) + "\\n")
    steps = [0]
    class H(BaseHTTPRequestHandler):
        def log_message(self, *x): pass
        def do_GET(self):
            if self.path == "/metrics":
                steps[0] += 10
                body = (f"# HELP sglang_oea_steps x\\nsglang_oea_steps_total {steps[0]}.0\\nother 1.0\\n"
                        f"sglang:oea_active_experts_after{{layer=\\"0\\"}} {steps[0] % 7}.0\\n")
            elif self.path in ("/health", "/v1/models", "/get_server_info"):
                body = json.dumps({"oea_k0": a.oea_k0})
            else:
                self.send_response(404); self.end_headers(); return
            self.send_response(200); self.end_headers(); self.wfile.write(body.encode())
    def bye(*_):
        note("stop"); sys.exit(0)
    signal.signal(signal.SIGTERM, bye)
    time.sleep(0.3)
    srv = HTTPServer((a.host, a.port), H)
    note("start")
    srv.serve_forever()
''')

# A stand-in bench_serving client: asks the server for its k0 and writes one result line whose
# throughput depends on k0, seed and concurrency. Runs as a script (--bench-cmd, a process per run) or
# as a module whose cli_main() the bench driver calls (--bench-module); it notes each import and the
# pid of every run in $FAKE_BENCH_LOG.
_FAKE_BENCH = textwrap.dedent('''
    import argparse, json, os, sys, urllib.request
    with open(os.environ["FAKE_BENCH_LOG"], "a") as f:
        f.write(json.dumps({"event": "import", "pid": os.getpid()}) + "\\n")

    def cli_main():
        p = argparse.ArgumentParser()
        for f in ("--backend", "--host", "--tokenizer", "--dataset-name", "--dataset-path", "--output-file"):
            p.add_argument(f)
        for f in ("--port", "--random-input-len", "--random-output-len", "--num-prompts", "--max-concurrency",
                  "--seed"):
            p.add_argument(f, type=int)
        p.add_argument("--random-range-ratio", type=float)
        p.add_argument("--tokenize-prompt", action="store_true"); p.add_argument("--disable-tqdm", action="store_true")
        p.add_argument("--flush-cache", action="store_true")
        a = p.parse_args()
        print("fake bench run", a.max_concurrency, a.seed)
        info = json.loads(urllib.request.urlopen(f"http://{a.host}:{a.port}/get_server_info").read())
        k0 = info["oea_k0"]
        tput = 100.0 * a.max_concurrency * (1.0 + (0.1 * (8 - k0) if k0 else 0.0)) + a.seed
        res = {"max_concurrency": a.max_concurrency, "concurrency": 0.97, "completed": a.num_prompts,
               "output_throughput": tput,
               "median_tpot_ms": 1000.0 / tput, "median_itl_ms": 1000.0 / tput, "p99_ttft_ms": 5.0,
               "server_info": {"big": "dropped"}}
        with open(a.output_file, "a") as f:
            f.write(json.dumps(res) + "\\n")
        with open(os.environ["FAKE_BENCH_LOG"], "a") as f:
            f.write(json.dumps({"event": "run", "pid": os.getpid(), "k0": k0, "c": a.max_concurrency,
                                "data": [a.dataset_name, a.dataset_path]}) + "\\n")

    if __name__ == "__main__":
        cli_main()
''')


@pytest.mark.parametrize("mode", ["driver", "subprocess"])
def test_launch_mode_end_to_end_with_stand_ins(tmp_path, monkeypatch, mode):
    (tmp_path / "fake_server.py").write_text(_FAKE_SERVER)
    (tmp_path / "fake_bench.py").write_text(_FAKE_BENCH)
    events = tmp_path / "events.jsonl"
    bench_events = tmp_path / "bench_events.jsonl"
    monkeypatch.setenv("FAKE_LOG", str(events))
    monkeypatch.setenv("FAKE_BENCH_LOG", str(bench_events))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    out = tmp_path / "out"
    # driver mode also reads a prompt file (its tokenizer cannot load here: lengths go unchecked)
    prompts = _write_prompts(tmp_path / "prompts.json", 8)
    client = (["--bench-module", str(tmp_path / "fake_bench.py"), "--prompt-file", prompts] if mode == "driver"
              else ["--bench-cmd", f"{sys.executable} {tmp_path / 'fake_bench.py'}"])
    argv = ["--model-path", str(tmp_path), "--port", str(ab_serving.free_port()), "--k0", "3", "5",
            "--oea-max-batch", "64", "--concurrency", "1", "4", "--repeats", "2", "--num-prompts", "4",
            "--warmup-prompts", "2", "--cooldown", "0", "--ready-timeout", "30", "--out-dir", str(out),
            "--launcher", f"{sys.executable} {tmp_path / 'fake_server.py'}",
            *client, "--", "--load-format", "dummy"]
    assert ab_serving.main(argv) == 0
    command = (out / "command.txt").read_text().splitlines()
    assert command[0] == shlex.join([sys.executable, ab_serving.__file__, *argv])
    assert "# environment: OMP_NUM_THREADS=3" in command  # thread settings travel with the results

    # driver: one client process (one import) per arm, serving its warm-up and its 4 runs;
    # subprocess: a fresh process (and import) per run
    bev = [json.loads(line) for line in bench_events.read_text().splitlines()]
    runs = [e for e in bev if e["event"] == "run"]
    assert len(runs) == 3 * (1 + 2 * 2)
    data = ["random", prompts] if mode == "driver" else ["random-ids", None]
    assert all(e["data"] == data for e in runs)  # warm-up included
    imports = [e["pid"] for e in bev if e["event"] == "import"]
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

    ev = [json.loads(line) for line in events.read_text().splitlines()]
    assert [(e["event"], e["k0"]) for e in ev] == [("start", None), ("stop", None), ("start", 3), ("stop", 3),
                                                   ("start", 5), ("stop", 5)]
    assert ev[1]["max_batch"] is None and ev[2]["max_batch"] == 64  # only OEA arms get --oea-* flags
    for stop, start in zip(ev[1::2], ev[2::2]):
        assert stop["t"] <= start["t"]  # never two servers at once
    for e in ev[::2]:
        with pytest.raises(ProcessLookupError):
            os.kill(e["child"], 0)  # the server's whole process group is gone

    recs = _report.load_jsonl(str(out / "results.jsonl"))
    assert len(recs) == 3 * 2 * 2
    assert {(r["arm"], r["concurrency"], r["repeat"]) for r in recs} == {
        (a, c, r) for a in ("baseline", "oea-k0=3", "oea-k0=5") for c in (1, 4) for r in (0, 1)}
    assert all("server_info" not in r for r in recs)
    assert all(r["bench_concurrency"] == 0.97 for r in recs)  # bench's achieved mean kept apart
    label = "prompts.json sha256:" + hashlib.sha256(open(prompts, "rb").read()).hexdigest()[:12]
    assert {r["prompts"] for r in recs} == {label if mode == "driver" else "random-ids"}
    assert {r["seed"] for r in recs if r["repeat"] == 1} == {2}
    # counters are differenced over the run; the gauge is kept as read, never differenced
    assert all(r["oea_metrics_delta"] == {"sglang_oea_steps_total": 10.0} for r in recs)
    assert all('sglang:oea_active_experts_after{layer="0"}' in r["oea_metrics"] for r in recs)
    s = _report.summarize(recs)
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
    drv = ab_serving.BenchDriver(str(target), str(tmp_path / "driver.log"), dict(os.environ), 60)
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
        with pytest.raises(ab_serving.DriverTimeout):
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
    drv = ab_serving.BenchDriver(str(target), str(tmp_path / "driver.log"), dict(os.environ), 60)
    try:
        with pytest.raises(RuntimeError, match="bench_serving timed out after 1s"):
            ab_serving.run_bench(["x", "sleep"], str(tmp_path / "o.jsonl"), str(tmp_path / "s.log"), 1.0, None,
                                 driver=drv, argv=["sleep"])
        with pytest.raises(RuntimeError, match="bench driver is not running"):
            ab_serving.run_bench(["x", "ok"], str(tmp_path / "o.jsonl"), str(tmp_path / "s.log"), 1.0, None,
                                 driver=drv, argv=["ok"])  # the dead driver is reported, not hung on
    finally:
        drv.close()


def test_side_by_side_table():
    table = _report.side_by_side_table(_report.summarize(_report.load_jsonl(CLEAN)))
    lines = table.splitlines()
    assert lines[0] == "| C | baseline tok/s | oea-k0=4 tok/s | baseline TPOT ms | oea-k0=4 TPOT ms |"
    assert lines[2:] == ["| 1 | 100.0 | 121.0 (1.20x) | 10.00 | 8.500 |",
                         "| 4 | 200.0 | 190.0 (0.95x) | 20.00 | 21.00 |"]


def test_demo_command_line():
    import demo

    args = demo.build_parser().parse_args(["--out-dir", "/tmp/d", "--port", "31999"])
    assert (args.oea_min_batch, args.oea_max_batch) == (demo.DEFAULT_MIN_BATCH, demo.DEFAULT_MAX_BATCH)
    assert args.k0 == [3, 4, 5] and args.concurrency == [4, 16, 64] and args.repeats == 1
    assert args.model_path == demo.TRAINED_MODEL and args.prompts == "heldout" and not args.random_weights
    assert demo.prompt_count(args.concurrency) == 128
    argv = demo.ab_argv(args, "/tmp/d/heldout_prompts.json")
    own, server_args = ab_serving._split_passthrough(argv)
    ab = _parse(own)
    assert ab.cpu and ab.model_path == os.path.abspath(TRAINED_MODEL) and ab.port == 31999 and not ab.bench_subprocess
    assert ab.prompt_file == "/tmp/d/heldout_prompts.json"
    assert ab.k0 == [3, 4, 5] and ab.concurrency == [4, 16, 64] and ab.repeats == 1
    assert (ab.input_len, ab.output_len, ab.warmup_prompts) == (64, 64, 8)
    assert (ab.oea_min_batch, ab.oea_max_batch) == (demo.DEFAULT_MIN_BATCH, demo.DEFAULT_MAX_BATCH)
    assert [ab_serving.num_prompts_for(c, ab) for c in ab.concurrency] == [8, 32, 128]  # >= 2 waves
    assert max(ab_serving.num_prompts_for(c, ab) for c in ab.concurrency) == demo.prompt_count(ab.concurrency)
    assert ab_serving.oea_flags(4, ab)[:2] == ["--oea-k0", "4"]
    assert "--load-format" not in server_args and "--enable-metrics" in server_args  # the trained weights
    assert demo.LABEL in ab.title
    head = demo.header(args)
    assert demo.LABEL in head and "qwen3_moe_stdlib: Qwen3MoeForCausalLM, 128 experts, top-8, hidden 128" in head
    assert "trained weights (Python standard library source" in head and "held-out text" in head

    # the random-weight comparison: same checkpoint (architecture, tokenizer, prompts), dummy weights
    rand = demo.build_parser().parse_args(["--random-weights", "--k0", "4", "--concurrency", "2", "8",
                                           "--repeats", "3", "--oea-min-batch", "4", "--oea-max-batch", "32"])
    own, server_args = ab_serving._split_passthrough(demo.ab_argv(rand, "p.json"))
    ab = _parse(own)
    assert (ab.k0, ab.concurrency, ab.repeats, ab.oea_min_batch, ab.oea_max_batch) == ([4], [2, 8], 3, 4, 32)
    assert ab.model_path == os.path.abspath(TRAINED_MODEL) and ab.prompt_file == "p.json"
    assert server_args[-2:] == ["--load-format", "dummy"] and "DUMMY weights" in ab.title
    assert "DUMMY weights" in demo.header(rand)

    ids = demo.build_parser().parse_args(["--prompts", "random-ids", "--model-path", "/elsewhere"])
    assert demo.prepare_prompts(ids) is None and "--prompt-file" not in demo.ab_argv(ids)
    assert "random token ids" in demo.header(ids)
    with pytest.raises(SystemExit, match="--prompts heldout: /elsewhere has no heldout.txt"):
        demo.prepare_prompts(demo.build_parser().parse_args(["--model-path", "/elsewhere"]))


def test_demo_prompts_are_heldout_windows_token_for_token(tmp_path):
    import demo
    import heldout
    from transformers import AutoTokenizer

    path = demo.write_heldout_prompts(TRAINED_MODEL, str(tmp_path / "p.json"), 6, prompt_len=16, continuation_len=8)
    rows = heldout.prompt_continuations(TRAINED_MODEL, 6, 16, 8, demo.HELDOUT_SEED)
    tok = AutoTokenizer.from_pretrained(TRAINED_MODEL)  # as bench_serving tokenizes the prompts
    entries = json.load(open(path))
    assert [tok.encode(e["conversations"][0]["value"]) for e in entries] == [r["prompt_ids"] for r in rows]
    assert [tok.encode(e["conversations"][1]["value"]) for e in entries] == [r["continuation_ids"] for r in rows]
    args = _parse(["--cpu", "--model-path", TRAINED_MODEL, "--prompt-file", path, "--num-prompts", "6",
                   "--warmup-prompts", "6", "--input-len", "16"])
    assert ab_serving.check_prompt_file(args).startswith("p.json sha256:")


def test_demo_expert_table():
    import demo

    def rec(arm, c, ratio=None):
        r = {"arm": arm, "k0": None if arm == "baseline" else 4, "concurrency": c, "repeat": 0, "seed": 1,
             "num_prompts": 8, "input_len": 64, "output_len": 64, "output_throughput": 100.0}
        if ratio is not None:
            r["oea_metrics"] = {'sglang:oea_active_experts_before{layer="0"}': 40.0,
                                'sglang:oea_active_experts_before{layer="1"}': 44.0,
                                'sglang:oea_active_experts_after{layer="0"}': 20.0,
                                'sglang:oea_active_experts_after{layer="1"}': 22.0,
                                'sglang:oea_active_experts_ratio{tp_rank="0"}': ratio}
        return r

    recs = [rec("baseline", c) for c in (1, 4, 64)] + [rec("oea-k0=4", 1, 0.3), rec("oea-k0=4", 4, 0.5),
                                                       rec("oea-k0=4", 64, 0.9)]
    table = demo.expert_table(recs, _report.summarize(recs), min_batch=2, max_batch=32)
    assert table.splitlines()[2:] == ["| 1 | off (C < min batch 2) |", "| 4 | 42.0 -> 21.0 (0.50x) |",
                                      "| 64 | off (C > max batch 32) |"]
    assert demo.expert_table(recs[:3] + [rec("oea-k0=4", 4)], _report.summarize(recs), 2, 0) == ""


def test_url_mode_needs_tokenizer(tmp_path):
    with pytest.raises(SystemExit):
        ab_serving.main(["--baseline-url", "http://127.0.0.1:1", "--oea-url", "http://127.0.0.1:2",
                         "--out-dir", str(tmp_path)])


# ------------------------------------------------------------------------------------------------
# Simulator
# ------------------------------------------------------------------------------------------------


def test_closed_forms_values():
    assert simulate.expected_t_vanilla(128, 8, 1) == approx(8.0)
    assert simulate.expected_t_vanilla(128, 8, 16) == approx(128 * (1 - (120 / 128) ** 16))
    assert simulate.expected_t_oea(256, 3, 32) == approx(256 * (1 - (253 / 256) ** 32))
    assert simulate.expected_saving(128, 8, 8, 16) == approx(0.0)


@pytest.mark.parametrize("n,k,k0,b", [(128, 8, 4, 16), (256, 8, 3, 32)])
def test_closed_forms_match_monte_carlo(n, k, k0, b):
    cfg = simulate.ModelConfig("t", n, k)
    (p,) = simulate.simulate(cfg, "uniform", [k0], [b], trials=150, min_rows=0, seed=1)
    assert p.batches == 150
    assert p.t_vanilla == pytest.approx(simulate.expected_t_vanilla(n, k, b), rel=0.02)
    assert p.t_oea[k0] == pytest.approx(simulate.expected_t_oea(n, k0, b), rel=0.03)


def test_oea_saves_experts_and_fidelity_bounds():
    pts = simulate.simulate(simulate.ModelConfig("t", 64, 8, "sigmoid"), "zipf", [2, 5, 8], [1, 8, 64],
                            trials=6, min_rows=0, seed=2)
    for p in pts:
        assert p.t_oea[2] < p.t_oea[5] < p.t_vanilla
        assert p.t_oea[8] == p.t_vanilla
        for k0 in (2, 5, 8):
            assert 0.0 <= p.mass_kept[k0] <= 1.0 + 1e-6 and 0.0 <= p.overlap[k0] <= 1.0
            assert p.t_loaded[k0] >= max(p.t_oea[k0], 8)  # fills: each batch loads max(T_oea, k)
        assert p.mass_kept[8] == pytest.approx(1.0) and p.overlap[8] == 1.0
    assert pts[0].overlap[5] == pytest.approx(5 / 8)  # B=1: plain top-k0
    assert pts[0].t_loaded[2] == 8  # a lone row is filled up to k experts of weight 0


def test_closed_form_saving_below_vanilla_for_all_k0():
    for n in (128, 256):
        for k0 in range(1, 8):
            for b in (1, 16, 64):
                assert simulate.expected_t_oea(n, k0, b) < simulate.expected_t_vanilla(n, 8, b)


def test_suggest_max_batch():
    for n in (128, 256):
        got = [simulate.suggest_max_batch(n, 8, k0) for k0 in (1, 2, 3, 4, 5, 6, 7)]
        assert all(a >= b for a, b in zip(got, got[1:])), got  # smaller k0 keeps saving longer
        for k0, m in zip(range(1, 8), got):
            assert simulate.expected_saving(n, 8, k0, m) >= 0.05
            assert simulate.expected_saving(n, 8, k0, 2 * m) < 0.05
    assert simulate.suggest_max_batch(128, 8, 8) is None
    assert simulate.suggest_max_batch(128, 8, 7, min_saving=0.2) is None  # 1 - 7/8 < 0.2 even at B=1
    assert simulate.suggest_max_batch(128, 8, 3, min_saving=0.2) <= simulate.suggest_max_batch(128, 8, 3)


def _write_dump(d, rank, step, layer, logits, **kw):
    rec = {"router_logits": logits, "layer_id": layer, "step": step, "batch_size": kw.pop("batch_size", logits.shape[0]),
           "top_k": 4, "scoring_func": "softmax", "correction_bias": None, "num_expert_group": 1, "topk_group": 1}
    rec.update(kw)
    torch.save(rec, os.path.join(d, f"rank{rank}_step{step:06d}_layer{layer:03d}.pt"))


def test_dumps_softmax_and_grouped_sigmoid(tmp_path):
    gen = torch.Generator().manual_seed(0)
    soft, grouped = tmp_path / "soft", tmp_path / "grouped"
    soft.mkdir()
    grouped.mkdir()
    for step in range(3):
        for layer in range(2):
            _write_dump(str(soft), 0, step, layer, torch.randn(6, 32, generator=gen), batch_size=5)
            _write_dump(str(soft), 1, step, layer, torch.full((6, 32), float("nan")))  # other rank: unused
    bias = torch.randn(32, generator=gen) * 0.1
    for step in range(2):
        _write_dump(str(grouped), 0, step, 0, torch.randn(3 + step, 32, generator=gen), scoring_func="sigmoid",
                    correction_bias=bias, num_expert_group=4, topk_group=2)

    (p,) = simulate.simulate_dumps(str(soft), [2, 4])
    assert (p.num_experts, p.top_k, p.batch_size, p.batches) == (32, 4, 5, 6)  # 3 steps x 2 layers, rank 0
    assert p.t_oea[2] <= p.t_vanilla and p.mass_kept[4] == pytest.approx(1.0)

    pts = simulate.simulate_dumps(str(grouped), [1, 2])
    assert [p.batch_size for p in pts] == [3, 4]
    for p in pts:
        assert p.t_oea[1] <= p.t_oea[2] <= p.t_vanilla and 0 < p.mass_kept[1] <= 1

    assert simulate.main(["--dump-dir", str(soft), "--k0", "2", "3", "--out-dir", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "simulate.png").stat().st_size > 0
    assert "## dump (N=32, k=4)" in (tmp_path / "o" / "simulate.md").read_text()


def test_vanilla_grouped_topk_stays_in_selected_groups():
    sel = torch.tensor([[0.9, 0.8, 0.1, 0.1, 0.5, 0.5, 0.7, 0.0]])  # 4 groups of 2
    router = simulate.Router.make("sigmoid", 2, torch.zeros(8), num_expert_group=4, topk_group=1)
    assert sorted(simulate.vanilla_topk(sel, router)[0].tolist()) == [0, 1]
    router = simulate.Router.make("sigmoid", 3, None, num_expert_group=4, topk_group=2)
    assert sorted(simulate.vanilla_topk(sel, router)[0].tolist()) == [0, 1, 6]


def test_simulate_cli_small(tmp_path):
    argv = ["--config", "64/4", "--k0", "2", "3", "--batch-sizes", "1", "4", "--trials", "2", "--min-rows", "0",
            "--out-dir", str(tmp_path)]
    assert simulate.main(argv) == 0
    md = (tmp_path / "simulate.md").read_text()
    assert "## N=64,k=4 / uniform (N=64, k=4)" in md and "Suggested --oea-max-batch" in md
    assert (tmp_path / "simulate.png").stat().st_size > 0


def test_cpu_routing_cost_reports_every_batch_size_and_refuses_bad_k0(capsys):
    """The routing-cost benchmark runs end to end (tiny iteration counts; no timing is asserted)."""
    import cpu_routing_cost

    table = cpu_routing_cost.main(["--batch-sizes", "2", "8", "--repeats", "2", "--iters", "2", "--warmup", "1"])
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["2", "8"]
    width = 1 + 2 * len(cpu_routing_cost.VARIANTS)  # B, the variants, the op count, a ratio per variant but plain
    assert all(len(row.strip("|").split("|")) == width and row.rstrip("|").endswith("x ") for row in rows)
    ops = 2 + len(cpu_routing_cost.VARIANTS)
    assert all(int(row.split("|")[ops]) > 0 for row in rows)  # the torch ops of one oea call
    assert table in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--k0"):
        cpu_routing_cost.main(["--k0", "8"])


def test_wait_ready_gives_up_at_once_when_the_port_was_taken(tmp_path):
    """uvicorn logs the bind error and the server hangs: waiting would last the whole timeout."""
    import ab_serving

    log = tmp_path / "server.log"
    log.write_text("INFO: Application startup complete.\nERROR: [Errno 98] error while attempting to bind on "
                   "address ('127.0.0.1', 1): address already in use\n")
    start = time.time()
    with pytest.raises(ab_serving.PortTakenError, match="could not bind its port"):
        ab_serving.wait_ready(f"http://127.0.0.1:{ab_serving.free_port()}", 300, None, str(log))
    assert time.time() - start < 30
