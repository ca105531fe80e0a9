"""Stand-ins for the serving harness's tests: a `sglang serve` with OEA's live settings, and a
bench_serving client. Both write one JSON line per event to $FAKE_LOG, in the order things happen
(the harness runs one thing at a time), so a test reads the whole sequence from one file.

The server (FAKE_SERVER) answers /health, /v1/models, /metrics, /server_info (with two schedulers'
OEA state when started with --oea-k0), POST /flush_cache, POST /generate and /v1/completions
(max_tokens ids, each the k0 in force) and POST /set_internal_state (one boolean per scheduler:
each stands for a data-parallel rank). As on the real server, a change is reported under "pending"
until the next forward pass (a bench run, a completion or a /generate) applies it. $FAKE_LIVE: "ok"
(default), "refuse" (replies false to any nonzero k0), "lie" (replies true but scheduler 1
takes no nonzero k0) or "stuck" (changes stay pending). Its OEA counters count the
decode steps the fake bench reports (applied when k0 > 0, else skipped); it starts a child that
must die with it; started with --port 0 it binds a free port and names it in its start event.
Events: start (port, ...), stop, info (a GET /server_info), post (the settings), failed (the
settings), held (the settings, index), unauthorized (path), flush (which key it carried: "admin",
"api" or null), completion (k0).

Keys, as SGLang 0.5.23 (utils/auth.py) with --api-key and/or --admin-api-key: /health*, /ready*,
/metrics open; /set_internal_state and /flush_cache need the admin key when there is one, else the
API key; every other path needs the API key when there is one. A refusal is HTTP 401 with
UNAUTHORIZED as its body. /server_info shows both keys in plain text, top level and in every
scheduler's state, and the launch command line (launch_command), as SGLang's does.

Faults for the restore's tests: $FAKE_FAIL_SETTINGS (a JSON settings object) makes the first
$FAKE_FAIL_TIMES (default 1; -1: every) POSTs of exactly those settings answer HTTP 500 without
applying them; $FAKE_HOLD_SETTINGS (a JSON list of settings) makes the first POST of its i-th
settings note "held" (index i) and wait until the file $FAKE_HOLD_FILE.i exists before it is
applied and answered (the fake serves one request at a time: everything else waits too).

The bench (FAKE_BENCH), a script or a module whose cli_main() the bench driver calls, sends its key
as bench_serving does (OPENAI_API_KEY as `Bearer`, else API_KEY as is) on every request, asks the
server for its k0, reports output_len steps, flushes the cache with --flush-cache (failing on
any refusal, as bench_serving does), writes one result line whose throughput depends on k0, seed
and concurrency (with the server's /server_info in it, as bench_serving's), and logs a run event
(k0, c, seed, n prompts, out tokens, pid, warmup requests, the names of its *API_KEY environment
variables); every import is noted in $FAKE_BENCH_LOG.
"""

import json
import os
import textwrap

UNAUTHORIZED = {"error": "Unauthorized"}  # SGLang 0.5.23's 401 body (checked against a real server in test_trial.py)

FAKE_SERVER = textwrap.dedent('''
    import argparse, json, os, signal, subprocess, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    p = argparse.ArgumentParser()
    p.add_argument("--model-path"); p.add_argument("--host"); p.add_argument("--port", type=int)
    for flag in ("--oea-k0", "--oea-min-batch", "--oea-max-batch"):
        p.add_argument(flag, type=int)
    p.add_argument("--load-format"); p.add_argument("--admin-api-key"); p.add_argument("--api-key")
    p.add_argument("--enable-metrics", action="store_true")
    a = p.parse_args()
    LOG, MODE = os.environ["FAKE_LOG"], os.environ.get("FAKE_LIVE", "ok")
    FAIL = json.loads(os.environ.get("FAKE_FAIL_SETTINGS") or "null")
    fail_left = [int(os.environ.get("FAKE_FAIL_TIMES", "1"))]
    HOLD, HOLD_FILE = json.loads(os.environ.get("FAKE_HOLD_SETTINGS") or "[]"), os.environ.get("FAKE_HOLD_FILE")
    OPEN, ADMIN = ("/health", "/ready", "/metrics"), ("/set_internal_state", "/flush_cache")
    UNAUTHORIZED = __UNAUTHORIZED__
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
        keys = {"api_key": a.api_key, "admin_api_key": a.admin_api_key}  # in plain text, as SGLang 0.5.23
        states = [{"oea": dict(s), **keys} if live else dict(keys) for s in state]
        return {"oea_k0": a.oea_k0, "decode_log_interval": 5, "load_format": a.load_format,
                "enable_metrics": a.enable_metrics, **keys, "launch_command": " ".join(sys.argv),
                "internal_states": states}

    def allowed(path, header):
        """SGLang 0.5.23's decide_request_auth, for the paths this fake serves."""
        if path.startswith(OPEN):
            return True
        key = (a.admin_api_key or a.api_key) if path.startswith(ADMIN) else a.api_key
        return not key or header == f"Bearer {key}"

    def key_class(header):
        return {f"Bearer {a.admin_api_key}": "admin", f"Bearer {a.api_key}": "api"}.get(header)

    def set_state(settings):
        """A change is pending until the next forward pass (apply_pending), as on the real server."""
        if MODE == "refuse" and settings.get("oea_k0"):
            return [False] * len(state)
        for i, s in enumerate(state):
            if not (MODE == "lie" and i == 1 and settings.get("oea_k0")):
                now = s.get("pending") or {k: s[k] for k in ("k0", "min_batch", "max_batch")}
                s["pending"] = {**now, **{k[len("oea_"):]: v for k, v in settings.items()}}
        return [True] * len(state)

    def fails(settings):
        if settings != FAIL or fail_left[0] == 0:
            return False
        fail_left[0] -= 1
        return True

    def hold(settings):
        """The first POST of HOLD[i] waits for the file HOLD_FILE + "." + i (the tests' release)."""
        if settings in HOLD:
            i = HOLD.index(settings)
            HOLD[i] = "released"
            note("held", settings=settings, index=i)
            while not os.path.exists(f"{HOLD_FILE}.{i}"):
                time.sleep(0.05)

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
        def refused(self):
            path = self.path.split("?")[0]
            if allowed(path, self.headers.get("Authorization")):
                return False
            note("unauthorized", path=path); self.reply(UNAUTHORIZED, 401)
            return True
        def do_GET(self):
            if self.refused():
                return
            if self.path == "/metrics":
                self.reply(metrics())
            elif self.path in ("/health", "/v1/models"):
                self.reply({})
            elif self.path == "/server_info":  # the fake bench's own read is no "info" event: not the harness's
                if not self.headers.get("X-Fake-Bench"):
                    note("info")
                self.reply(server_info())
            elif self.path == "/fake_k0":
                apply_pending(); self.reply({"k0": state[0]["k0"]})
            else:
                self.reply({}, 404)
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.refused():
                return
            path = self.path.split("?")[0]
            if path == "/fake_run":
                steps["applied" if state[0]["k0"] else "skipped"] += body["steps"]
                self.reply({})
            elif path == "/flush_cache":
                note("flush", auth=key_class(self.headers.get("Authorization")))
                self.reply("Cache flushed.\\n")
            elif path == "/generate":
                apply_pending(); self.reply({"text": "x", "meta_info": {"k0": state[0]["k0"]}})
            elif path == "/v1/completions":
                apply_pending(); note("completion", k0=state[0]["k0"])
                ids = [state[0]["k0"]] * body["max_tokens"]
                self.reply({"choices": [{"text": "x", "token_ids": ids, "finish_reason": "length"}]})
            elif path != "/set_internal_state" or not live:
                self.reply({}, 404)
            elif fails(body["server_args"]):
                note("failed", settings=body["server_args"]); self.reply({"error": "fake failure"}, 500)
            else:
                hold(body["server_args"])
                note("post", settings=body["server_args"]); self.reply(set_state(body["server_args"]))

    def bye(*_):
        note("stop", k0=a.oea_k0); sys.exit(0)
    signal.signal(signal.SIGTERM, bye)
    time.sleep(0.3)
    srv = HTTPServer((a.host, a.port), H)
    note("start", k0=a.oea_k0, max_batch=a.oea_max_batch, min_batch=a.oea_min_batch, metrics=a.enable_metrics,
         child=child.pid, port=srv.server_address[1])
    srv.serve_forever()
''')

FAKE_BENCH = textwrap.dedent('''
    import argparse, json, os, sys, time, urllib.request
    with open(os.environ["FAKE_BENCH_LOG"], "a") as f:
        f.write(json.dumps({"event": "import", "pid": os.getpid()}) + "\\n")

    def auth_headers():
        """bench_serving's get_auth_headers: OPENAI_API_KEY as Bearer, else API_KEY as is."""
        if os.environ.get("OPENAI_API_KEY"):
            return {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]}
        return {"Authorization": os.environ["API_KEY"]} if os.environ.get("API_KEY") else {}

    def call(url, payload=None):
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(url, data, {**auth_headers(), "X-Fake-Bench": "1"})
        return json.loads(urllib.request.urlopen(request).read() or b"{}")

    def cli_main():
        p = argparse.ArgumentParser()
        for f in ("--backend", "--host", "--tokenizer", "--dataset-name", "--dataset-path", "--output-file"):
            p.add_argument(f)
        for f in ("--port", "--random-input-len", "--random-output-len", "--num-prompts", "--max-concurrency",
                  "--seed"):
            p.add_argument(f, type=int)
        p.add_argument("--random-range-ratio", type=float)
        p.add_argument("--tokenize-prompt", action="store_true"); p.add_argument("--disable-tqdm", action="store_true")
        p.add_argument("--flush-cache", action="store_true"); p.add_argument("--warmup-requests", type=int, default=1)
        a = p.parse_args()
        print("fake bench run", a.max_concurrency, a.seed)
        base = f"http://{a.host}:{a.port}"
        k0 = call(base + "/fake_k0")["k0"]
        if a.flush_cache:  # after its warm-up, as bench_serving: an HTTP error ends the run
            urllib.request.urlopen(urllib.request.Request(base + "/flush_cache", b"", auth_headers())).read()
        call(base + "/fake_run", {"steps": a.random_output_len})
        tput = 100.0 * a.max_concurrency * (1.0 + (0.1 * (8 - k0) if k0 else 0.0)) + a.seed
        res = {"max_concurrency": a.max_concurrency, "concurrency": 0.97, "completed": a.num_prompts,
               "output_throughput": tput,
               "median_tpot_ms": 1000.0 / tput, "median_itl_ms": 1000.0 / tput, "p99_ttft_ms": 5.0,
               "server_info": call(base + "/server_info")}  # as bench_serving: the server's, keys included
        with open(a.output_file, "a") as f:
            f.write(json.dumps(res) + "\\n")
        with open(os.environ["FAKE_LOG"], "a") as f:
            f.write(json.dumps({"event": "run", "t": time.time(), "pid": os.getpid(), "k0": k0,
                                "c": a.max_concurrency, "seed": a.seed, "n": a.num_prompts,
                                "out": a.random_output_len, "data": [a.dataset_name, a.dataset_path],
                                "warmup": a.warmup_requests,
                                "env_keys": sorted(k for k in os.environ if k.endswith("API_KEY"))}) + "\\n")

    if __name__ == "__main__":
        cli_main()
''')
FAKE_SERVER = FAKE_SERVER.replace("__UNAUTHORIZED__", json.dumps(UNAUTHORIZED))


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
