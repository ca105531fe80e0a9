"""A/B serving benchmark: SGLang with Opportunistic Expert Activation (--oea-k0) against without.

Modes
  1. Launch (default): starts the baseline server, measures it, stops it, then one OEA server per
     --k0 value, one after the other (never two at once), with identical settings: the OEA arms add
     only the --oea-* flags. Each server's whole process group is killed at the end, also on error
     or Ctrl-C.
  2. URLs: --baseline-url URL --oea-url URL [URL ...] measures servers that are already running.
  3. Report only: --from-jsonl FILE rebuilds the table and the plot from an earlier run.

Every arm runs sglang.benchmark.serving (prompts of fixed length sent as token ids, a fixed number of
output tokens with EOS ignored, cache flushed before each run) at every concurrency in --concurrency,
--repeats times; repeat r uses seed --seed + r in every arm, so both arms see the same prompts. The
prompts are random token ids (bench_serving's random-ids dataset), or, with --prompt-file, a fixed
ShareGPT-format set (bench_serving's random dataset reading that file: each first turn tokenized
client side and cut to --input-len tokens; the seed picks which ones and in what order). A warm-up
run comes before the measured runs of each server. By default all runs of one arm share one client
process (_bench_driver.py: imports the module once and calls its cli_main() per run, as
`python -m sglang.benchmark.serving ARGS` would); --bench-subprocess starts a fresh
`python -m sglang.benchmark.serving` per run instead.

Outputs in --out-dir: results.jsonl (one line per run), results.md (medians over repeats, and the
OEA/baseline throughput ratio paired by repeat with its min-max), results.png, server and bench logs.

    # GPU box, real model (see README.md)
    python benchmark/oea/ab_serving.py --model-path /models/GLM-5-NVFP4 --k0 3 4 5 \
        --out-dir ab_glm5 -- --tp-size 8 --moe-runner-backend flashinfer_cutlass
    # this CPU machine, tiny dummy-weight model
    python benchmark/oea/ab_serving.py --cpu --model-path /tmp/tiny --k0 4 --out-dir ab_cpu \
        -- --load-format dummy
    # this CPU machine, the shipped trained model on held-out text (demo.py writes the prompt file)
    python benchmark/oea/ab_serving.py --cpu --model-path benchmark/oea/models/qwen3_moe_stdlib \
        --prompt-file out/demo/heldout_prompts.json --k0 4 --out-dir ab_cpu_trained
    # CI smoke (builds a tiny model when --model-path is absent)
    python benchmark/oea/ab_serving.py --smoke --out-dir /tmp/oea_smoke
    # report only
    python benchmark/oea/ab_serving.py --from-jsonl ab_cpu/results.jsonl --out-dir ab_cpu

Everything after `--` (and --server-args "...") goes to both servers unchanged.
"""

import argparse
import hashlib
import importlib.util
import json
import os
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

import _report  # noqa: E402

GPU_CONCURRENCIES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
CPU_CONCURRENCIES = [1, 4, 16, 32, 64]
SMOKE_CONCURRENCIES = [1, 2]

# Environment variables written to command.txt when set.
RECORDED_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "CUDA_VISIBLE_DEVICES")
# bench_serving result keys kept in results.jsonl (the rest, e.g. server_info, is left out).
_DROP_KEYS = ("server_info", "input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")


def log(msg: str) -> None:
    print(f"[ab] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------
# HTTP helpers (standard library only)
# ----------------------------------------------------------------------------------------------


def http_get(url: str, timeout: float = 5.0) -> Optional[str]:
    """Body of a 200 answer, or None on any error."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            if resp.status == 200:
                return resp.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError, ValueError):
        pass
    return None


class PortTakenError(RuntimeError):
    """The server could not bind its HTTP port: another process took it after free_port() chose it."""


PORT_TAKEN = "error while attempting to bind on address"  # uvicorn's line; the server then hangs


def wait_ready(base_url: str, timeout_s: float, proc: Optional[subprocess.Popen] = None,
               log_path: Optional[str] = None) -> None:
    """Wait until /health and /v1/models both answer 200; raise on timeout or if proc exits, and
    PortTakenError as soon as the log says the HTTP port was taken."""
    start = time.time()
    while True:
        if http_get(base_url + "/health") is not None and http_get(base_url + "/v1/models") is not None:
            log(f"server at {base_url} ready after {time.time() - start:.0f}s")
            return
        if log_path and os.path.exists(log_path) and PORT_TAKEN in open(log_path, errors="replace").read():
            raise PortTakenError(f"server at {base_url} could not bind its port" + _log_tail(log_path))
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before becoming ready"
                               + _log_tail(log_path))
        if time.time() - start > timeout_s:
            raise TimeoutError(f"server at {base_url} not ready after {timeout_s:.0f}s" + _log_tail(log_path))
        time.sleep(1.0)


def _log_tail(path: Optional[str], lines: int = 40) -> str:
    if not path or not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        tail = f.readlines()[-lines:]
    return f"\n--- last {len(tail)} lines of {path} ---\n" + "".join(tail)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def scrape_oea_metrics(base_url: str) -> Optional[Dict[str, float]]:
    """Prometheus samples whose name contains 'oea' (case-insensitive), or None without /metrics."""
    body = http_get(base_url + "/metrics")
    if body is None:
        return None
    out = {}
    for line in body.splitlines():
        if not line or line.startswith("#") or "oea" not in line.split("{")[0].split(" ")[0].lower():
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


def counter_deltas(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, float]:
    """What each counter (a `*_total` sample) grew by during a run. Gauges are left out: the
    difference of two "most recent" readings means nothing."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if k.split("{")[0].endswith("_total")}


# ----------------------------------------------------------------------------------------------
# Servers
# ----------------------------------------------------------------------------------------------


@dataclass
class Arm:
    name: str
    k0: Optional[int]
    url: Optional[str] = None  # URL mode
    extra_args: Sequence[str] = ()  # --oea-* flags (launch mode)


class Server:
    """One server in its own session (process group); `stop` kills the whole group."""

    def __init__(self, cmd: List[str], log_path: str, env: Dict[str, str]):
        self.cmd, self.log_path = cmd, log_path
        self._log = open(log_path, "w")
        log("starting: " + shlex.join(cmd))
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the server (its own clean shutdown), then to the whole group, then SIGKILL."""
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        if self.proc.poll() is None:
            _send(os.kill, pgid, signal.SIGTERM)
            _wait_until(lambda: self.proc.poll() is not None, grace_s)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not _group_alive(pgid):
                break
            _send(os.killpg, pgid, sig)
            _wait_until(lambda: self.proc.poll() is not None and not _group_alive(pgid), 10.0)
        self.proc.poll()
        self._log.close()
        log(f"server stopped (exit code {self.proc.returncode})")


@contextmanager
def cpu_server(model_dir: str, flags: Sequence[str], log_path: Callable[[], str], env: Dict[str, str],
               timeout_s: float) -> Iterator[Tuple[str, str]]:
    """A ready `sglang_oea.cpu_serve` server for model_dir on a free 127.0.0.1 port; yields (its
    URL, its log's path) and stops its whole process group on exit. log_path() names each
    attempt's log. Another process may take the chosen port before the server binds it, so up to
    three ports are tried."""
    for attempt in range(3):
        port, path = free_port(), log_path()
        cmd = [sys.executable, "-m", "sglang_oea.cpu_serve", "--model-path", model_dir, "--host", "127.0.0.1",
               "--port", str(port), *flags]
        server = Server(cmd, path, env)
        try:
            wait_ready(f"http://127.0.0.1:{port}", timeout_s, server.proc, path)
            break
        except PortTakenError:
            server.stop()
            if attempt == 2:
                raise
        except BaseException:
            server.stop()
            raise
    try:
        yield f"http://127.0.0.1:{port}", path
    finally:
        server.stop()


def _send(fn, pid: int, sig: int) -> None:
    try:
        fn(pid, sig)
    except ProcessLookupError:
        pass


def _wait_until(cond, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while not cond() and time.time() < deadline:
        time.sleep(0.25)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def launcher_command(args) -> List[str]:
    if args.launcher:
        cmd = shlex.split(args.launcher)
    elif args.cpu:
        cmd = [sys.executable, "-m", "sglang_oea.cpu_serve"]
    else:
        cmd = ["sglang", "serve"]
    if cmd and cmd[0] == "sglang" and shutil.which("sglang") is None:
        sibling = os.path.join(os.path.dirname(sys.executable), "sglang")
        if os.path.exists(sibling):
            cmd[0] = sibling
    return cmd


def child_env() -> Dict[str, str]:
    """The environment of servers and clients: sglang_oea importable from this checkout if needed."""
    env = dict(os.environ)
    if importlib.util.find_spec("sglang_oea") is None:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (os.path.join(_REPO, "python"), env.get("PYTHONPATH")) if p)
    return env


# ----------------------------------------------------------------------------------------------
# Prompt files (--prompt-file)
# ----------------------------------------------------------------------------------------------

RANDOM_IDS = "random-ids"  # the `prompts` of a record measured without --prompt-file


def write_prompt_file(path: str, pairs: Sequence[Tuple[str, str]]) -> str:
    """(prompt, continuation) texts as the ShareGPT-format JSON list bench_serving's file datasets read:
    [{"id": "p<i>", "conversations": [{"from": "human", "value": prompt},
    {"from": "gpt", "value": continuation}]}, ...], one entry per pair. Returns path."""
    rows = [{"id": f"p{i}", "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": cont}]}
            for i, (prompt, cont) in enumerate(pairs)]
    with open(path, "w") as f:
        json.dump(rows, f, indent=0)
    return path


def load_prompt_file(path: str) -> List[str]:
    """The prompts (first turns) of a ShareGPT-format file: [n] str. SystemExit naming --prompt-file
    when the file is missing, not JSON, or not a list of entries with two turns whose first is non-empty
    (bench_serving would skip such an entry without a word)."""
    def fail(why: str):
        raise SystemExit(f"--prompt-file {path}: {why}")

    try:
        with open(path) as f:
            rows = json.load(f)
    except OSError as e:
        fail(f"cannot read it ({e.strerror})")
    except ValueError as e:
        fail(f"not JSON ({e})")
    if not isinstance(rows, list) or not rows:
        fail('expected a non-empty JSON list of {"conversations": [{"value": PROMPT}, {"value": ...}]}')
    prompts = []
    for i, row in enumerate(rows):
        turns = row.get("conversations") if isinstance(row, dict) else None
        if (not isinstance(turns, list) or len(turns) < 2
                or not all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns[:2])
                or not turns[0]["value"]):
            fail(f'entry {i} is not {{"conversations": [{{"value": PROMPT}}, {{"value": ...}}]}} '
                 "with a non-empty PROMPT")
        prompts.append(turns[0]["value"])
    return prompts


def _token_counts(tokenizer: str, prompts: Sequence[str]) -> Optional[List[int]]:
    """Tokens per prompt as bench_serving counts them (the tokenizer's encode): [n] int, or None
    when transformers cannot load the tokenizer."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
    except Exception as e:  # noqa: BLE001 - only a check; bench_serving loads it its own way
        log(f"--prompt-file: could not load tokenizer {tokenizer} ({type(e).__name__}); prompt lengths unchecked")
        return None
    return [len(tok.encode(p)) for p in prompts]


def check_prompt_file(args) -> str:
    """Validate --prompt-file for this sweep; returns its label for results.jsonl, 'NAME sha256:HEX12'.

    Every run (the warm-up too) must find enough prompts in it, since bench_serving would silently
    send fewer, and every prompt must hold at least --input-len tokens, since bench_serving would
    repeat a shorter one to fill. SystemExit naming --prompt-file otherwise.
    """
    path = args.prompt_file
    prompts = load_prompt_file(path)
    needed = max([num_prompts_for(c, args) for c in args.concurrency] + [args.warmup_prompts])
    if len(prompts) < needed:
        raise SystemExit(f"--prompt-file {path}: {len(prompts)} prompts, but a run of this sweep sends {needed} "
                         "(lower --concurrency/--prompts-per-concurrency/--num-prompts or give more prompts)")
    counts = _token_counts(args.tokenizer, prompts)
    short = [i for i, n in enumerate(counts or []) if n < args.input_len]
    if short:
        raise SystemExit(f"--prompt-file {path}: {len(short)} prompt(s) (entry {short[0]} first, "
                         f"{counts[short[0]]} tokens) shorter than --input-len {args.input_len}")
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    return f"{os.path.basename(path)} sha256:{digest}"


# ----------------------------------------------------------------------------------------------
# bench_serving
# ----------------------------------------------------------------------------------------------


def num_prompts_for(concurrency: int, args) -> int:
    if args.num_prompts:
        return args.num_prompts
    return max(args.prompts_per_concurrency * concurrency, args.min_prompts)


BENCH_MODULE = "sglang.benchmark.serving"
DRIVER = os.path.join(_HERE, "_bench_driver.py")


def bench_command(args, base_url: str, concurrency: int, num_prompts: int, seed: int,
                  output_len: int, output_file: str) -> List[str]:
    """The bench_serving command line of one run (in driver mode: the equivalent command)."""
    if args.bench_cmd:
        prefix = shlex.split(args.bench_cmd)
    else:
        module = args.bench_module
        prefix = [sys.executable] + ([module] if module.endswith(".py") else ["-m", module])
    return prefix + bench_arguments(args, base_url, concurrency, num_prompts, seed, output_len, output_file)


def bench_arguments(args, base_url: str, concurrency: int, num_prompts: int, seed: int,
                    output_len: int, output_file: str) -> List[str]:
    """bench_serving's arguments for one run, without the program."""
    host_port = urllib.parse.urlparse(base_url)
    # "random" with a --dataset-path takes its prompts from that file; --tokenize-prompt sends them
    # as token ids and --random-range-ratio 1.0 fixes both lengths, as for random-ids.
    dataset = (["--dataset-name", "random", "--dataset-path", args.prompt_file] if args.prompt_file
               else ["--dataset-name", "random-ids"])
    cmd = ["--backend", "sglang",
           "--host", host_port.hostname, "--port", str(host_port.port),
           "--tokenizer", args.tokenizer, *dataset, "--tokenize-prompt",
           "--random-input-len", str(args.input_len), "--random-output-len", str(output_len),
           "--random-range-ratio", "1.0", "--num-prompts", str(num_prompts),
           "--max-concurrency", str(concurrency), "--seed", str(seed),
           "--output-file", output_file, "--disable-tqdm"]
    if args.flush_cache:
        cmd.append("--flush-cache")
    return cmd + shlex.split(args.bench_args or "")


class DriverTimeout(RuntimeError):
    """A bench driver did not answer in time (it has been killed)."""


class BenchDriver:
    """One `_bench_driver.py` process: imports bench_serving once, then runs it once per request.

    It lives in its own session; `close` (or a timed-out run) kills its whole process group.
    """

    def __init__(self, module: str, log_path: str, env: Dict[str, str], start_timeout_s: float):
        self.log_path = log_path
        self._log = open(log_path, "a")
        self._buf = b""
        self._start_timeout_s = start_timeout_s
        self.proc = subprocess.Popen([sys.executable, DRIVER, "--module", module], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, env=env, start_new_session=True)
        self.ready: Optional[dict] = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self) -> dict:
        """Block until the import is done (at most start_timeout_s); raise RuntimeError otherwise."""
        if self.ready is None:
            try:
                self.ready = self._read(self._start_timeout_s)
            except BaseException as e:
                self.close(kill=True)
                if not isinstance(e, RuntimeError):
                    raise
                raise RuntimeError(f"bench driver did not start ({e})" + _log_tail(self.log_path, 20)) from None
        return self.ready

    def run(self, argv: List[str], log_path: str, timeout_s: float) -> int:
        """One bench_serving run with `argv` (output appended to log_path); its exit status."""
        self.wait_ready()
        if self.proc.poll() is not None or self.proc.stdin.closed:
            raise RuntimeError(f"bench driver is not running (exit code {self.proc.poll()})")
        try:
            try:
                self.proc.stdin.write((json.dumps({"argv": argv, "log": log_path}) + "\n").encode())
                self.proc.stdin.flush()
            except OSError as e:
                raise RuntimeError(f"bench driver is gone ({e})") from None
            return int(self._read(timeout_s)["rc"])
        except BaseException:
            self.close(kill=True)
            raise

    def _read(self, timeout_s: float) -> dict:
        """The next protocol line, or RuntimeError on timeout / exit."""
        deadline = time.time() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.time()
            if left <= 0:
                raise DriverTimeout(f"timed out after {timeout_s:.0f}s")
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                self.proc.wait()
                raise RuntimeError(f"bench driver exited with code {self.proc.returncode}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def close(self, kill: bool = False) -> None:
        """End of input (a clean exit; skipped with kill), then SIGKILL to the whole group if anything is left."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        if not kill:
            _wait_until(lambda: self.proc.poll() is not None, 5.0)
        if _group_alive(self.proc.pid):
            _send(os.killpg, self.proc.pid, signal.SIGKILL)
            _wait_until(lambda: self.proc.poll() is not None and not _group_alive(self.proc.pid), 10.0)
        self.proc.wait()
        self.proc.stdout.close()
        self._log.close()


def run_bench(cmd: List[str], output_file: str, log_path: str, timeout_s: float, env,
              driver: Optional[BenchDriver] = None, argv: Optional[List[str]] = None) -> dict:
    """Run one bench_serving; return its JSON result (the last line it appended).

    With a driver, `argv` (the arguments of `cmd` without the program) runs in the driver's process;
    `cmd` is still written at the top of the log, as the equivalent command line.
    """
    if os.path.exists(output_file):
        os.remove(output_file)
    if driver is not None:
        with open(log_path, "w") as logf:
            logf.write(shlex.join(cmd) + "\n")
            logf.write(f"# run in the bench driver process (pid {driver.proc.pid}, log {driver.log_path})\n")
        try:
            rc = driver.run(argv, log_path, timeout_s)
        except DriverTimeout:
            raise RuntimeError(f"bench_serving timed out after {timeout_s:.0f}s" + _log_tail(log_path, 20)) from None
        except RuntimeError as e:
            if str(e).startswith("bench driver did not start"):
                raise
            raise RuntimeError(f"bench_serving failed ({e})" + _log_tail(log_path, 20)) from None
        return _read_result(rc, output_file, log_path)
    with open(log_path, "w") as logf:
        logf.write(shlex.join(cmd) + "\n")
        logf.flush()
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"bench_serving timed out after {timeout_s:.0f}s" + _log_tail(log_path, 20))
        except BaseException:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            raise
    return _read_result(rc, output_file, log_path)


def _read_result(rc: int, output_file: str, log_path: str) -> dict:
    if rc != 0 or not os.path.exists(output_file):
        raise RuntimeError(f"bench_serving failed (exit code {rc})" + _log_tail(log_path, 20))
    with open(output_file) as f:
        lines = [line for line in f if line.strip()]
    if not lines:
        raise RuntimeError("bench_serving wrote no result" + _log_tail(log_path, 20))
    return json.loads(lines[-1])


class BenchClient:
    """How one arm runs bench_serving: in one driver process (default) or a subprocess per run.

    The driver (see _bench_driver.py) imports the bench module once for the arm; a run that times
    out or kills it gets a fresh one for the next run. Subprocess mode (--bench-subprocess, or any
    --bench-cmd) starts `python -m sglang.benchmark.serving` (or the --bench-cmd) for every run.
    """

    def __init__(self, args, arm_name: str, env: Optional[Dict[str, str]] = None):
        self.args = args
        self.env = child_env() if env is None else env
        self.in_process = not (args.bench_cmd or args.bench_subprocess)
        runs_dir = os.path.join(args.out_dir, "runs")
        os.makedirs(runs_dir, exist_ok=True)
        self.driver_log = os.path.join(runs_dir, f"{arm_name}_driver.log")
        self.driver: Optional[BenchDriver] = None

    def start(self) -> None:
        """Start the driver (no-op in subprocess mode or when one is running); does not wait."""
        if self.in_process and (self.driver is None or not self.driver.alive()):
            if self.driver is not None:
                self.driver.close()
            self.driver = BenchDriver(self.args.bench_module, self.driver_log, self.env, self.args.run_timeout)

    def ensure_ready(self) -> None:
        """Wait for the driver's import; if it cannot start, fall back to subprocess mode."""
        if not self.in_process:
            return
        try:
            self._wait()
        except RuntimeError as e:
            log(f"{e.args[0].splitlines()[0]}; falling back to one bench_serving subprocess per run")
            self.close()
            self.in_process = False

    def _wait(self) -> None:
        self.start()
        first = self.driver.ready is None
        self.driver.wait_ready()
        if first:
            log(f"bench driver ready (pid {self.driver.proc.pid}, import took {self.driver.ready['import_s']:.0f}s)")

    def run(self, base_url: str, concurrency: int, num_prompts: int, seed: int, output_len: int,
            output_file: str, log_path: str) -> dict:
        cmd = bench_command(self.args, base_url, concurrency, num_prompts, seed, output_len, output_file)
        if not self.in_process:
            return run_bench(cmd, output_file, log_path, self.args.run_timeout, self.env)
        self._wait()
        argv = bench_arguments(self.args, base_url, concurrency, num_prompts, seed, output_len, output_file)
        return run_bench(cmd, output_file, log_path, self.args.run_timeout, self.env, driver=self.driver, argv=argv)

    def close(self) -> None:
        if self.driver is not None:
            self.driver.close()
            self.driver = None


def measure_arm(arm: Arm, base_url: str, args, jsonl_path: str, server: Optional[Server],
                counter: List[int], total_runs: int, client: Optional[BenchClient] = None) -> int:
    """Warm-up, then every (repeat, concurrency) run of one arm; appends records to jsonl_path.

    Runs bench_serving through `client` (a new one, closed at the end, when None).
    """
    if client is None:
        client = BenchClient(args, arm.name)
        try:
            return measure_arm(arm, base_url, args, jsonl_path, server, counter, total_runs, client)
        finally:
            client.close()
    runs_dir = os.path.join(args.out_dir, "runs")
    os.makedirs(runs_dir, exist_ok=True)
    client.ensure_ready()
    info = http_get(base_url + "/get_server_info")
    if info is not None:
        with open(os.path.join(args.out_dir, f"server_info_{arm.name}.json"), "w") as f:
            f.write(info)

    if args.warmup_prompts > 0:
        wc = min(args.warmup_prompts, max(args.concurrency))
        out = os.path.join(runs_dir, f"{arm.name}_warmup.jsonl")
        t0 = time.time()
        client.run(base_url, wc, args.warmup_prompts, args.seed + 10_000, args.warmup_output_len or args.output_len,
                   out, out.replace(".jsonl", ".log"))
        log(f"{arm.name}: warm-up ({args.warmup_prompts} prompts at C={wc}) done in {time.time() - t0:.0f}s")

    failures = 0
    for rep in range(args.repeats):
        for conc in args.concurrency:
            counter[0] += 1
            seed = args.seed + rep
            n = num_prompts_for(conc, args)
            stem = os.path.join(runs_dir, f"{arm.name}_c{conc}_r{rep}")
            record = {"arm": arm.name, "k0": arm.k0, "concurrency": conc, "repeat": rep, "seed": seed,
                      "num_prompts": n, "input_len": args.input_len, "output_len": args.output_len,
                      "prompts": args.prompts,
                      "oea_min_batch": args.oea_min_batch if arm.k0 is not None else None,
                      "oea_max_batch": args.oea_max_batch if arm.k0 is not None else None,
                      "url": base_url, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
            before = scrape_oea_metrics(base_url)
            t0 = time.time()
            try:
                if server is not None and not server.alive():
                    raise RuntimeError("server process died" + _log_tail(server.log_path, 20))
                result = client.run(base_url, conc, n, seed, args.output_len, stem + ".jsonl", stem + ".log")
            except RuntimeError as e:
                failures += 1
                record["error"] = str(e).splitlines()[0]
                record["wall_s"] = round(time.time() - t0, 2)
                _append(jsonl_path, record)
                log(f"{arm.name:>10}  C={conc:<5} rep {rep + 1}/{args.repeats}  FAILED: {e}")
                if server is not None and not server.alive():
                    log(f"{arm.name}: server died; skipping its remaining runs")
                    return failures
                continue
            for key, value in result.items():
                if key not in _DROP_KEYS:
                    # bench_serving's "concurrency" is the achieved mean; ours is the requested C
                    record[f"bench_{key}" if key in record else key] = value
            record["wall_s"] = round(time.time() - t0, 2)
            after = scrape_oea_metrics(base_url)
            if after is not None:
                record["oea_metrics"] = after
                if before is not None:
                    record["oea_metrics_delta"] = counter_deltas(before, after)
            _append(jsonl_path, record)
            log(f"{arm.name:>10}  C={conc:<5} rep {rep + 1}/{args.repeats}  seed {seed}  "
                f"{result.get('output_throughput', float('nan')):9.1f} tok/s  "
                f"TPOT {result.get('median_tpot_ms') or float('nan'):8.2f} ms  "
                f"({record['wall_s']:.0f}s)  [run {counter[0]}/{total_runs}]")
    return failures


def _append(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def write_report(jsonl_path: str, out_dir: str, title: Optional[str] = None) -> _report.Summary:
    """results.md and results.png from a JSONL; prints the table."""
    records = _report.load_jsonl(jsonl_path)
    summary = _report.summarize(records)
    table = _report.markdown_table(summary, title)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(table)
    png = os.path.join(out_dir, "results.png")
    if summary.concurrencies:
        _report.plot(summary, png, title)
    print()
    print(table)
    log(f"wrote {os.path.join(out_dir, 'results.md')} and {png}")
    return summary


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def _split_passthrough(argv: Sequence[str]):
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def parse_args(own: Sequence[str], command: Sequence[str]) -> argparse.Namespace:
    """The harness's own flags, parsed; `command` (everything it was given, server arguments
    included) goes to command.txt, also when the harness is called as a function."""
    args = build_parser().parse_args(own)
    args.argv = list(command)
    return args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("what to measure")
    src.add_argument("--model-path", help="model directory or hub id (launch mode)")
    src.add_argument("--tokenizer", help="tokenizer for bench_serving (default: --model-path)")
    src.add_argument("--server-args", default="", help="extra server arguments, one string (also: after --)")
    src.add_argument("--launcher", help="server command (default 'sglang serve'; with --cpu "
                                        "'python -m sglang_oea.cpu_serve')")
    src.add_argument("--cpu", action="store_true", help="CPU-only machine: sglang_oea.cpu_serve, CPU-sized defaults")
    src.add_argument("--host", default="127.0.0.1")
    src.add_argument("--port", type=int, default=30000)
    src.add_argument("--baseline-url", help="URL mode: an already running server without OEA")
    src.add_argument("--oea-url", nargs="+", help="URL mode: already running OEA server(s) (label them with --k0)")
    src.add_argument("--from-jsonl", help="only rebuild results.md/results.png from this JSONL")
    src.add_argument("--title", help="title of the table and plot")

    oea = p.add_argument_group("OEA arms")
    oea.add_argument("--k0", type=int, nargs="+", default=None, help="one OEA arm per value (default 4)")
    oea.add_argument("--oea-min-batch", type=int, help="passed to every OEA server")
    oea.add_argument("--oea-max-batch", type=int, help="passed to every OEA server (0 = no cap)")
    oea.add_argument("--skip-baseline", action="store_true", help="launch mode: OEA arms only")

    wl = p.add_argument_group("workload")
    wl.add_argument("--concurrency", type=int, nargs="+",
                    help=f"default {GPU_CONCURRENCIES}; with --cpu {CPU_CONCURRENCIES}")
    wl.add_argument("--repeats", type=int, help="default 3 (--smoke: 1)")
    wl.add_argument("--seed", type=int, default=1, help="repeat r uses seed + r in every arm")
    wl.add_argument("--prompt-file",
                    help="fixed prompt set instead of random token ids: a ShareGPT-format JSON list "
                         '([{"conversations": [{"value": PROMPT}, {"value": ...}]}, ...], e.g. demo.py\'s '
                         "held-out text); each PROMPT is cut to --input-len tokens and sent as token ids, "
                         "the seed picks which and in what order; needs as many prompts as the largest "
                         "run and at least --input-len tokens each")
    wl.add_argument("--input-len", type=int, help="prompt tokens (default 1024; --cpu 64)")
    wl.add_argument("--output-len", type=int, help="output tokens (default 256; --cpu 64)")
    wl.add_argument("--num-prompts", type=int, help="fixed prompt count for every concurrency")
    wl.add_argument("--prompts-per-concurrency", type=int, help="num prompts = max(this * C, --min-prompts) "
                                                                "(default 4; --cpu 2)")
    wl.add_argument("--min-prompts", type=int, help="default 32; --cpu 8")
    wl.add_argument("--warmup-prompts", type=int, help="warm-up prompts per server (default 64; --cpu 8; 0 = none)")
    wl.add_argument("--warmup-output-len", type=int, default=32)
    wl.add_argument("--no-flush-cache", dest="flush_cache", action="store_false",
                    help="do not flush the server's prefix cache before each measured run")
    wl.add_argument("--bench-args", help="extra bench_serving arguments, one string")
    wl.add_argument("--bench-cmd", help="client command, started afresh for every run (implies "
                                        "--bench-subprocess; default: sglang.benchmark.serving run in one "
                                        "driver process per arm)")
    wl.add_argument("--bench-module", default=BENCH_MODULE,
                    help="module (or .py file) whose cli_main() the bench driver calls for each run")
    wl.add_argument("--bench-subprocess", action="store_true",
                    help="start a fresh `python -m sglang.benchmark.serving` for every run (the import "
                         "costs 10-30 s per run on a small CPU machine) instead of one driver per arm")

    ops = p.add_argument_group("operation")
    ops.add_argument("--out-dir", default="oea_ab_out")
    ops.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds to wait for a server")
    ops.add_argument("--run-timeout", type=float, default=3600.0, help="seconds for one bench_serving run")
    ops.add_argument("--cooldown", type=float, default=5.0, help="seconds between stopping and starting servers")
    ops.add_argument("--smoke", action="store_true",
                     help="CI smoke: --cpu, C=1 2, 4 prompts, 1 repeat, tiny model if none given; "
                          "exits non-zero unless every run produced a result")
    return p


def apply_defaults(args) -> None:
    if args.smoke:
        args.cpu = True
        args.concurrency = args.concurrency or SMOKE_CONCURRENCIES
        args.repeats = args.repeats or 1
        args.num_prompts = args.num_prompts or 4
        args.input_len = args.input_len or 16
        args.output_len = args.output_len or 8
        args.warmup_prompts = 0 if args.warmup_prompts is None else args.warmup_prompts  # bench warms up too
        args.warmup_output_len = min(args.warmup_output_len, 8)
        args.ready_timeout = min(args.ready_timeout, 600.0)
        args.run_timeout = min(args.run_timeout, 600.0)
    cpu = args.cpu
    args.repeats = args.repeats or 3
    args.tokenizer = args.tokenizer or args.model_path
    args.k0 = args.k0 or ([4] if not args.oea_url else None)
    args.concurrency = args.concurrency or (CPU_CONCURRENCIES if cpu else GPU_CONCURRENCIES)
    args.input_len = args.input_len or (64 if cpu else 1024)
    args.output_len = args.output_len or (64 if cpu else 256)
    args.prompts_per_concurrency = args.prompts_per_concurrency or (2 if cpu else 4)
    args.min_prompts = args.min_prompts or (8 if cpu else 32)
    args.warmup_prompts = (8 if cpu else 64) if args.warmup_prompts is None else args.warmup_prompts


def oea_flags(k0: int, args) -> List[str]:
    flags = ["--oea-k0", str(k0)]
    if args.oea_min_batch is not None:
        flags += ["--oea-min-batch", str(args.oea_min_batch)]
    if args.oea_max_batch is not None:
        flags += ["--oea-max-batch", str(args.oea_max_batch)]
    return flags


def make_tiny_model(out_dir: str) -> str:
    """A tiny Qwen3-MoE config + tokenizer (dummy weights) for the smoke run."""
    model_dir = os.path.join(out_dir, "tiny_model")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        cmd = [sys.executable, "-m", "sglang_oea.tiny_model", "--arch", "qwen3_moe", "--out", model_dir,
               "--num-experts", "32", "--top-k", "4", "--hidden-size", "128",
               "--moe-intermediate-size", "64", "--num-layers", "2"]
        log("building tiny model: " + shlex.join(cmd))
        subprocess.run(cmd, check=True, env=child_env())
    return model_dir


def run(args, server_args: List[str]) -> int:
    os.makedirs(args.out_dir, exist_ok=True)
    jsonl_path = os.path.join(args.out_dir, "results.jsonl")
    if os.path.exists(jsonl_path):
        backup = jsonl_path + time.strftime(".%Y%m%d-%H%M%S.bak")
        os.replace(jsonl_path, backup)
        log(f"moved the previous {jsonl_path} to {backup}")

    url_mode = bool(args.baseline_url or args.oea_url)
    if url_mode:
        if not args.tokenizer:
            raise SystemExit("URL mode needs --tokenizer (the served model's tokenizer directory or id)")
        arms = []
        if args.baseline_url:
            arms.append(Arm(_report.BASELINE, None, url=args.baseline_url.rstrip("/")))
        labels = args.k0 if args.k0 and len(args.k0) == len(args.oea_url or []) else None
        if args.oea_url and args.k0 and labels is None:
            raise SystemExit("--k0 must give one value per --oea-url")
        for i, url in enumerate(args.oea_url or []):
            k0 = labels[i] if labels else None
            name = _report.arm_name(k0) if k0 is not None else ("oea" if i == 0 else f"oea#{i + 1}")
            arms.append(Arm(name, k0, url=url.rstrip("/")))
    else:
        if args.smoke and not args.model_path:
            args.model_path = make_tiny_model(args.out_dir)
            if "--load-format" not in server_args:
                server_args = server_args + ["--load-format", "dummy"]
        if not args.model_path:
            raise SystemExit("give --model-path (launch mode), --baseline-url/--oea-url, or --from-jsonl")
        args.tokenizer = args.tokenizer or args.model_path
        arms = [] if args.skip_baseline else [Arm(_report.BASELINE, None)]
        arms += [Arm(_report.arm_name(k0), k0, extra_args=oea_flags(k0, args)) for k0 in args.k0]

    if args.prompt_file:
        args.prompt_file = os.path.abspath(args.prompt_file)
    args.prompts = check_prompt_file(args) if args.prompt_file else RANDOM_IDS
    total = len(arms) * len(args.concurrency) * args.repeats
    log(f"{len(arms)} arms x {len(args.concurrency)} concurrencies x {args.repeats} repeats = {total} runs; "
        f"prompts {args.prompts}, input {args.input_len}, output {args.output_len} tokens; out-dir {args.out_dir}")
    with open(os.path.join(args.out_dir, "command.txt"), "w") as f:
        f.write(shlex.join([sys.executable, __file__, *args.argv]) + "\n")
        # Thread settings change CPU (and host-side) timings: keep them with the command line.
        env = {k: os.environ[k] for k in RECORDED_ENV if k in os.environ}
        if env:
            f.write("# environment: " + shlex.join(f"{k}={v}" for k, v in env.items()) + "\n")

    counter = [0]
    failures = 0
    try:
        for i, arm in enumerate(arms):
            if arm.url:
                wait_ready(arm.url, args.ready_timeout)
                failures += measure_arm(arm, arm.url, args, jsonl_path, None, counter, total)
                continue
            client = BenchClient(args, arm.name)
            if port_in_use(args.host, args.port):
                raise RuntimeError(f"{args.host}:{args.port} is already in use; stop that server or pick --port")
            base_url = f"http://{args.host}:{args.port}"
            cmd = launcher_command(args) + ["--model-path", args.model_path, "--host", args.host,
                                            "--port", str(args.port)] + list(server_args) + list(arm.extra_args)
            server = Server(cmd, os.path.join(args.out_dir, f"server_{arm.name}.log"), child_env())
            try:
                client.start()  # its import overlaps the server's start-up
                wait_ready(base_url, args.ready_timeout, server.proc, server.log_path)
                failures += measure_arm(arm, base_url, args, jsonl_path, server, counter, total, client)
            finally:
                client.close()
                server.stop()
            deadline = time.time() + 60
            while port_in_use(args.host, args.port) and time.time() < deadline:
                time.sleep(1.0)
            if i + 1 < len(arms):
                time.sleep(args.cooldown)
    finally:
        if os.path.exists(jsonl_path):
            write_report(jsonl_path, args.out_dir, args.title)
    return failures


def run_smoke(out_dir: str, model_path: Optional[str] = None, k0: int = 4,
              concurrencies: Sequence[int] = (1, 2), num_prompts: int = 4,
              server_args: Sequence[str] = (), port: int = 30000,
              prompt_file: Optional[str] = None) -> _report.Summary:
    """Baseline vs OEA k0 on CPU servers at two concurrencies with a few prompts; raises on failure.

    Builds a tiny dummy-weight Qwen3-MoE when model_path is None; a given model loads its own weights
    (pass server_args=["--load-format", "dummy"] for a config-only one). prompt_file: --prompt-file
    (default random ids). Returns the report summary.
    """
    argv = ["--smoke", "--out-dir", out_dir, "--k0", str(k0), "--port", str(port),
            "--num-prompts", str(num_prompts), "--concurrency", *map(str, concurrencies)]
    if model_path:
        argv += ["--model-path", model_path]
    if prompt_file:
        argv += ["--prompt-file", prompt_file]
    sargs = list(server_args)
    args = parse_args(argv, argv + (["--", *sargs] if sargs else []))
    apply_defaults(args)
    failures = run(args, sargs)
    summary = _report.summarize(_report.load_jsonl(os.path.join(out_dir, "results.jsonl")))
    check_smoke(summary, out_dir, len(concurrencies), failures)
    return summary


def check_smoke(summary: _report.Summary, out_dir: str, n_conc: int, failures: int) -> None:
    problems = []
    if failures:
        problems.append(f"{failures} run(s) failed")
    if len(summary.arms) != 2 or len(summary.concurrencies) != n_conc:
        problems.append(f"expected 2 arms x {n_conc} concurrencies, got {summary.arms} x {summary.concurrencies}")
    if len(summary.ratios) != n_conc:
        problems.append(f"expected {n_conc} ratios, got {len(summary.ratios)}")
    problems += summary.warnings
    for name in ("results.md", "results.png"):
        path = os.path.join(out_dir, name)
        if not os.path.exists(path) or os.path.getsize(path) == 0:
            problems.append(f"{name} missing or empty")
    if problems:
        raise RuntimeError("smoke check failed: " + "; ".join(problems))
    log("smoke check passed")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, passthrough = _split_passthrough(argv)
    args = parse_args(own, argv)
    server_args = shlex.split(args.server_args) + passthrough

    if args.from_jsonl:
        summary = write_report(args.from_jsonl, args.out_dir, args.title)
        return 0 if summary.concurrencies else 1

    apply_defaults(args)

    def _terminate(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {sig: signal.signal(sig, _terminate) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        failures = run(args, server_args)
    except KeyboardInterrupt:
        log("interrupted; servers stopped, partial results kept")
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if args.smoke:
        summary = _report.summarize(_report.load_jsonl(os.path.join(args.out_dir, "results.jsonl")))
        try:
            check_smoke(summary, args.out_dir, len(args.concurrency), failures)
        except RuntimeError as e:
            log(str(e))
            return 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
