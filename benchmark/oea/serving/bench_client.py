"""How the A/B serving benchmark runs sglang.benchmark.serving: one bench driver process per arm
(serving/_bench_driver.py: the module imported once, then run once per request), or a fresh
subprocess per run (--bench-subprocess, --bench-cmd).

A driver or a run lives in its own session; a timeout, an error or Ctrl-C kills its whole process
group. Each run's result is the last JSON line bench_serving appends to its --output-file.

Keys (common/http.py): bench_serving sends OPENAI_API_KEY, and only that, as `Authorization:
Bearer` on every request, its --flush-cache included; its environment gets the server's API key
(servers.client_env). When /flush_cache needs an admin key that differs from it, bench_serving
cannot flush: the client then flushes the cache itself, with the admin key, right before the run,
and runs bench_serving without --flush-cache and without its own warm-up request (which would
fill the cache again), so that each measured run starts with an empty prefix cache as before.
"""

import json
import os
import select
import shlex
import signal
import subprocess
import sys
import time
import urllib.parse
from typing import Dict, List, Optional

from common.http import auth_for, flush_cache, redact
from serving.servers import client_env, group_alive, log, log_tail, send_signal, wait_until

BENCH_MODULE = "sglang.benchmark.serving"
DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bench_driver.py")


def bench_command(args, base_url: str, concurrency: int, num_prompts: int, seed: int,
                  output_len: int, output_file: str, self_flush: bool = True) -> List[str]:
    """The bench_serving command line of one run (in driver mode: the equivalent command)."""
    if args.bench_cmd:
        prefix = shlex.split(args.bench_cmd)
    else:
        module = args.bench_module
        prefix = [sys.executable] + ([module] if module.endswith(".py") else ["-m", module])
    return prefix + bench_arguments(args, base_url, concurrency, num_prompts, seed, output_len, output_file,
                                    self_flush)


def bench_arguments(args, base_url: str, concurrency: int, num_prompts: int, seed: int,
                    output_len: int, output_file: str, self_flush: bool = True) -> List[str]:
    """bench_serving's arguments for one run, without the program. self_flush False: the client
    flushes the cache itself before the run (module doc), so no --flush-cache and no warm-up request."""
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
        cmd += ["--flush-cache"] if self_flush else ["--warmup-requests", "0"]
    return cmd + shlex.split(args.bench_args or "")


class DriverTimeout(RuntimeError):
    """A bench driver did not answer in time (it has been killed)."""


class BenchDriver:
    """One `_bench_driver.py` process: imports bench_serving once, then runs it once per request
    (or another command-line module: `entry` is the function its console script calls, e.g.
    lm_eval.__main__'s cli_evaluate).

    It lives in its own session; `close` (or a timed-out run) kills its whole process group.
    """

    def __init__(self, module: str, log_path: str, env: Dict[str, str], start_timeout_s: float,
                 entry: str = "cli_main"):
        self.log_path = log_path
        self._log = open(log_path, "a")
        self._buf = b""
        self._start_timeout_s = start_timeout_s
        self.proc = subprocess.Popen([sys.executable, DRIVER, "--module", module, "--entry", entry],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env,
                                     start_new_session=True)
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
                raise RuntimeError(f"bench driver did not start ({e})" + log_tail(self.log_path, 20)) from None
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
            wait_until(lambda: self.proc.poll() is not None, 5.0)
        if group_alive(self.proc.pid):
            send_signal(os.killpg, self.proc.pid, signal.SIGKILL)
            wait_until(lambda: self.proc.poll() is not None and not group_alive(self.proc.pid), 10.0)
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
            raise RuntimeError(f"bench_serving timed out after {timeout_s:.0f}s" + log_tail(log_path, 20)) from None
        except RuntimeError as e:
            if str(e).startswith("bench driver did not start"):
                raise
            raise RuntimeError(f"bench_serving failed ({e})" + log_tail(log_path, 20)) from None
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
            raise RuntimeError(f"bench_serving timed out after {timeout_s:.0f}s" + log_tail(log_path, 20))
        except BaseException:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            raise
    return _read_result(rc, output_file, log_path)


def _read_result(rc: int, output_file: str, log_path: str) -> dict:
    """The run's result, the last line of its output file; the file is rewritten redacted first
    (bench_serving copies the server's /server_info, keys included, into each result)."""
    if rc != 0 or not os.path.exists(output_file):
        raise RuntimeError(f"bench_serving failed (exit code {rc})" + log_tail(log_path, 20))
    with open(output_file) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines:
        raise RuntimeError("bench_serving wrote no result" + log_tail(log_path, 20))
    lines = [redact(line) for line in lines]
    with open(output_file, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    return lines[-1]


class BenchClient:
    """How one arm runs bench_serving: in one driver process (default) or a subprocess per run.

    The driver (see _bench_driver.py) imports the bench module once for the arm; a run that times
    out or kills it gets a fresh one for the next run. Subprocess mode (--bench-subprocess, or any
    --bench-cmd) starts `python -m sglang.benchmark.serving` (or the --bench-cmd) for every run.
    """

    def __init__(self, args, arm_name: str, env: Optional[Dict[str, str]] = None):
        self.args = args
        # ab_serving's own --admin-api-key; the trial registers its keys (common/http.use_auth)
        self.admin_api_key = getattr(args, "admin_api_key", None)
        self.env = client_env(getattr(args, "url", None), self.admin_api_key) if env is None else env
        self.flush_failed = False  # said once in the log
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
        self_flush = auth_for(base_url, self.admin_api_key).bench_flushes()
        cmd = bench_command(self.args, base_url, concurrency, num_prompts, seed, output_len, output_file, self_flush)
        if not self.in_process:
            self.flush_before(base_url, self_flush)
            return run_bench(cmd, output_file, log_path, self.args.run_timeout, self.env)
        self._wait()
        argv = bench_arguments(self.args, base_url, concurrency, num_prompts, seed, output_len, output_file,
                               self_flush)
        self.flush_before(base_url, self_flush)
        return run_bench(cmd, output_file, log_path, self.args.run_timeout, self.env, driver=self.driver, argv=argv)

    def flush_before(self, base_url: str, self_flush: bool) -> None:
        """Flush the prefix cache with the admin key when bench_serving cannot (module doc); a
        failure is said once and the run goes on (both arms alike, with what the cache holds)."""
        if self_flush or not self.args.flush_cache:
            return
        problem = flush_cache(base_url, self.admin_api_key)
        if problem and not self.flush_failed:
            self.flush_failed = True
            log(f"WARNING: {base_url}/flush_cache failed ({problem}): runs start with what the prefix cache holds")

    def close(self) -> None:
        if self.driver is not None:
            self.driver.close()
            self.driver = None
