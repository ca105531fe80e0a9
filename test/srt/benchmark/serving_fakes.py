"""Stand-ins for the serving harness's tests: a `sglang serve` with OEA's live settings, and a
bench_serving client. Both write one JSON line per event to $FAKE_LOG, in the order things happen
(the harness runs one thing at a time), so a test reads the whole sequence from one file.

The server (FAKE_SERVER) answers /health, /v1/models, /metrics, /server_info (with two schedulers'
OEA state when started with --oea-k0), POST /flush_cache, POST /v1/completions (max_tokens ids,
each the k0 in force) and POST /set_internal_state (with --admin-api-key: only
with `Authorization: Bearer KEY`). As on the real server, a change is reported under "pending"
until the next forward pass (a bench run or a completion) applies it. $FAKE_LIVE: "ok"
(default), "refuse" (replies [false] to any nonzero k0), "lie" (replies [true] but scheduler 1
takes no nonzero k0) or "stuck" (changes stay pending). Its OEA counters count the
decode steps the fake bench reports (applied when k0 > 0, else skipped); it starts a child that
must die with it. Events: start, stop, info (a GET /server_info), post (the settings),
unauthorized, completion (k0).

The bench (FAKE_BENCH), a script or a module whose cli_main() the bench driver calls, asks the
server for its k0, reports output_len steps, writes one result line whose throughput depends on
k0, seed and concurrency, and logs a run event (k0, c, seed, n prompts, out tokens, pid); every
import is noted in $FAKE_BENCH_LOG.
"""

import json
import os
import textwrap

FAKE_SERVER = textwrap.dedent('''
    import argparse, json, os, signal, subprocess, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    p = argparse.ArgumentParser()
    p.add_argument("--model-path"); p.add_argument("--host"); p.add_argument("--port", type=int)
    for flag in ("--oea-k0", "--oea-min-batch", "--oea-max-batch"):
        p.add_argument(flag, type=int)
    p.add_argument("--load-format"); p.add_argument("--admin-api-key")
    p.add_argument("--enable-metrics", action="store_true")
    a = p.parse_args()
    LOG, MODE = os.environ["FAKE_LOG"], os.environ.get("FAKE_LIVE", "ok")
    child = subprocess.Popen(["sleep", "300"])
    live = a.oea_k0 is not None
    state = [{"k0": a.oea_k0, "min_batch": a.oea_min_batch or 4, "max_batch": a.oea_max_batch or 0, "mode": "x"}
             for _ in range(2)]
    steps = {"applied": 0, "skipped": 0}

    def note(event, **kw):
        with open(LOG, "a") as f:
            f.write(json.dumps({"event": event, "t": time.time(), **kw}) + "\\n")

    def metrics():
        skipped = 'sglang:oea_decode_steps_skipped_total{tp_rank="0",mode="decode",reason="off"}'
        return (f'sglang:oea_decode_steps_applied_total{{tp_rank="0",mode="decode"}} {steps["applied"]}.0\\n'
                f'{skipped} {steps["skipped"]}.0\\nsglang:oea_k0{{tp_rank="0"}} {state[0]["k0"] or 0}.0\\n'
                'other_total 1.0\\n')

    def server_info():
        states = [{"oea": dict(s)} if live else {} for s in state]
        return {"oea_k0": a.oea_k0, "decode_log_interval": 5, "load_format": a.load_format,
                "internal_states": states}

    def set_state(settings):
        """A change is pending until the next forward pass (apply_pending), as on the real server."""
        if MODE == "refuse" and settings.get("oea_k0"):
            return [False]
        for i, s in enumerate(state):
            if not (MODE == "lie" and i == 1 and settings.get("oea_k0")):
                now = s.get("pending") or {k: s[k] for k in ("k0", "min_batch", "max_batch")}
                s["pending"] = {**now, **{k[len("oea_"):]: v for k, v in settings.items()}}
        return [True]

    def apply_pending():
        """A forward pass: every pending change takes effect ("stuck": never)."""
        for s in state:
            if s.get("pending") and MODE != "stuck":
                s.update(s.pop("pending"))

    class H(BaseHTTPRequestHandler):
        def log_message(self, *x): pass
        def reply(self, obj, code=200):
            body = (obj if isinstance(obj, str) else json.dumps(obj)).encode()
            self.send_response(code); self.end_headers(); self.wfile.write(body)
        def do_GET(self):
            if self.path == "/metrics":
                self.reply(metrics())
            elif self.path in ("/health", "/v1/models"):
                self.reply({})
            elif self.path == "/server_info":
                note("info"); self.reply(server_info())
            elif self.path == "/fake_k0":
                apply_pending(); self.reply({"k0": state[0]["k0"]})
            else:
                self.reply({}, 404)
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            if self.path == "/fake_run":
                steps["applied" if state[0]["k0"] else "skipped"] += body["steps"]
                self.reply({})
            elif self.path == "/flush_cache":
                self.reply({})
            elif self.path == "/v1/completions":
                apply_pending(); note("completion", k0=state[0]["k0"])
                ids = [state[0]["k0"]] * body["max_tokens"]
                self.reply({"choices": [{"text": "x", "token_ids": ids, "finish_reason": "length"}]})
            elif self.path != "/set_internal_state" or not live:
                self.reply({}, 404)
            elif a.admin_api_key and self.headers.get("Authorization") != f"Bearer {a.admin_api_key}":
                note("unauthorized"); self.reply({"detail": "unauthorized"}, 401)
            else:
                note("post", settings=body["server_args"]); self.reply(set_state(body["server_args"]))

    def bye(*_):
        note("stop", k0=a.oea_k0); sys.exit(0)
    signal.signal(signal.SIGTERM, bye)
    time.sleep(0.3)
    srv = HTTPServer((a.host, a.port), H)
    note("start", k0=a.oea_k0, max_batch=a.oea_max_batch, min_batch=a.oea_min_batch, metrics=a.enable_metrics,
         child=child.pid)
    srv.serve_forever()
''')

FAKE_BENCH = textwrap.dedent('''
    import argparse, json, os, sys, time, urllib.request
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
        base = f"http://{a.host}:{a.port}"
        k0 = json.loads(urllib.request.urlopen(base + "/fake_k0").read())["k0"]
        req = urllib.request.Request(base + "/fake_run", json.dumps({"steps": a.random_output_len}).encode())
        urllib.request.urlopen(req).read()
        tput = 100.0 * a.max_concurrency * (1.0 + (0.1 * (8 - k0) if k0 else 0.0)) + a.seed
        res = {"max_concurrency": a.max_concurrency, "concurrency": 0.97, "completed": a.num_prompts,
               "output_throughput": tput,
               "median_tpot_ms": 1000.0 / tput, "median_itl_ms": 1000.0 / tput, "p99_ttft_ms": 5.0,
               "server_info": {"big": "dropped"}}
        with open(a.output_file, "a") as f:
            f.write(json.dumps(res) + "\\n")
        with open(os.environ["FAKE_LOG"], "a") as f:
            f.write(json.dumps({"event": "run", "t": time.time(), "pid": os.getpid(), "k0": k0,
                                "c": a.max_concurrency, "seed": a.seed, "n": a.num_prompts,
                                "out": a.random_output_len, "data": [a.dataset_name, a.dataset_path]}) + "\\n")

    if __name__ == "__main__":
        cli_main()
''')


def install(tmp_path, monkeypatch, live: str = "ok"):
    """Write both stand-ins into tmp_path and point $FAKE_LOG / $FAKE_BENCH_LOG / $FAKE_LIVE at
    tmp_path. Returns (server script, bench script, event log, bench import log)."""
    server, bench = tmp_path / "fake_server.py", tmp_path / "fake_bench.py"
    server.write_text(FAKE_SERVER)
    bench.write_text(FAKE_BENCH)
    events, imports = tmp_path / "events.jsonl", tmp_path / "bench_events.jsonl"
    monkeypatch.setenv("FAKE_LOG", str(events))
    monkeypatch.setenv("FAKE_BENCH_LOG", str(imports))
    monkeypatch.setenv("FAKE_LIVE", live)
    return server, bench, events, imports


def read_events(path) -> list:
    """The JSON lines of an event log ([] when it does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
