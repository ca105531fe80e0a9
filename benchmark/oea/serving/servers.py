"""SGLang servers for the serving benchmarks: start one, wait until it answers, stop its whole
process group.

Standard library only. A server runs in its own session (process group), so that `Server.stop`
also ends the scheduler and detokenizer processes it forks; `cpu_server` picks a free port and
retries when another process takes that port before the server binds it.

Every script that starts servers runs its main under `terminate_as_interrupt()`: SIGTERM and
SIGHUP then unwind the stack like Ctrl-C, so the `with` blocks and `finally` clauses that stop
servers (and put a server's settings back) run. Without it, SIGTERM ends Python at once and the
server's process group is left running.
"""

import importlib.util
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import threading
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from common.http import auth_for, http_get, http_status, redact_argv  # noqa: F401  (http_get: imported from here too)

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# Environment variables written to command.txt when set.
RECORDED_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "CUDA_VISIBLE_DEVICES")


def log(msg: str) -> None:
    print(f"[ab] {msg}", flush=True)


class PortTakenError(RuntimeError):
    """The server could not bind its HTTP port: another process took it after free_port() chose it."""


PORT_TAKEN = "error while attempting to bind on address"  # uvicorn's line; the server then hangs


def wait_ready(base_url: str, timeout_s: float, proc: Optional[subprocess.Popen] = None,
               log_path: Optional[str] = None) -> None:
    """Wait until /health answers 200 and /v1/models answers (200, or 401 from a server started with
    --api-key whose key is not registered: its HTTP app is up); raise on timeout or if proc exits,
    and PortTakenError as soon as the log says the HTTP port was taken."""
    start = time.time()
    while True:
        if http_get(base_url + "/health") is not None and http_status(base_url + "/v1/models") in (200, 401):
            log(f"server at {base_url} ready after {time.time() - start:.0f}s")
            return
        if log_path and os.path.exists(log_path) and PORT_TAKEN in open(log_path, errors="replace").read():
            raise PortTakenError(f"server at {base_url} could not bind its port" + log_tail(log_path))
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before becoming ready"
                               + log_tail(log_path))
        if time.time() - start > timeout_s:
            raise TimeoutError(f"server at {base_url} not ready after {timeout_s:.0f}s" + log_tail(log_path))
        time.sleep(1.0)


def log_tail(path: Optional[str], lines: int = 40) -> str:
    """The last `lines` lines of a log, headed for an error message ("" when there is no log)."""
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


class Server:
    """One server in its own session (process group); `stop` kills the whole group."""

    def __init__(self, cmd: List[str], log_path: str, env: Dict[str, str]):
        self.cmd, self.log_path = cmd, log_path
        self._log = open(log_path, "w")
        log("starting: " + shlex.join(redact_argv(cmd)))  # a key flag's value never reaches a log
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the server (its own clean shutdown), then to the whole group, then SIGKILL."""
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        if self.proc.poll() is None:
            send_signal(os.kill, pgid, signal.SIGTERM)
            wait_until(lambda: self.proc.poll() is not None, grace_s)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not group_alive(pgid):
                break
            send_signal(os.killpg, pgid, sig)
            wait_until(lambda: self.proc.poll() is not None and not group_alive(pgid), 10.0)
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


def send_signal(fn, pid: int, sig: int) -> None:
    """fn(pid, sig) (os.kill or os.killpg), where a process already gone is not an error."""
    try:
        fn(pid, sig)
    except ProcessLookupError:
        pass


def wait_until(cond, timeout_s: float) -> None:
    """Poll cond() every 0.25 s until it holds or timeout_s has passed."""
    deadline = time.time() + timeout_s
    while not cond() and time.time() < deadline:
        time.sleep(0.25)


def group_alive(pgid: int) -> bool:
    """Whether any process of group pgid is left (one we may not signal counts as alive)."""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def launcher_command(args) -> List[str]:
    """The server command without its arguments: --launcher, else cpu_serve (--cpu), else `sglang serve`
    (the venv's own when `sglang` is not on PATH)."""
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


# The trial's own key variables: read by the trial, never handed to a child.
KEY_VARIABLES = ("OEA_API_KEY", "OEA_ADMIN_API_KEY")


def child_env() -> Dict[str, str]:
    """The environment of servers and clients: sglang_oea importable from this checkout if needed,
    without the trial's key variables (KEY_VARIABLES)."""
    env = {k: v for k, v in os.environ.items() if k not in KEY_VARIABLES}
    if importlib.util.find_spec("sglang_oea") is None:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (os.path.join(_REPO, "python"), env.get("PYTHONPATH")) if p)
    return env


def client_env(base_url: Optional[str], admin_api_key: Optional[str] = None) -> Dict[str, str]:
    """child_env() for a client that sends its own requests to base_url (bench_serving, lm-eval):
    OPENAI_API_KEY set to the server's API key when one is registered (common/http.use_auth); both
    read it and send it as `Authorization: Bearer`. Never the admin key."""
    env = child_env()
    api_key = auth_for(base_url or "", admin_api_key).api_key
    if api_key:
        env["OPENAI_API_KEY"] = api_key
    return env



class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised where the main thread was, so that the stack unwinds as on Ctrl-C."""


@contextmanager
def terminate_as_interrupt(signals: Sequence[int] = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)) -> Iterator[None]:
    """Within: the first of `signals` raises Terminated (KeyboardInterrupt for SIGINT) in the main
    thread; any later one is logged and ignored, so that the clean-up it set off (stopping process
    groups, putting settings back) is not cut short. SIGKILL still ends everything at once. The
    previous handlers come back on exit. Outside the main thread it does nothing (Python allows
    signal handlers there only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = []

    def handler(signum, _frame):
        if fired:
            log(f"signal {signum} again: still stopping what was started (SIGKILL ends at once, leaving it)")
            return
        fired.append(signum)
        log(f"signal {signum}: stopping; every server and client started is stopped, settings put back")
        raise KeyboardInterrupt() if signum == signal.SIGINT else Terminated(f"signal {signum}")

    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def signals_held(signals: Sequence[int] = HELD_SIGNALS) -> Iterator[None]:
    """Within: `signals` are held, so no Ctrl-C or SIGTERM cuts short what runs inside (putting a
    server's settings back): a handler that only notes them replaces the ones in force, and on exit
    those come back and each noted signal is raised again, in order, for them to handle. (Python
    runs signal handlers in the main thread whichever thread the signal reached; blocking it there
    with pthread_sigmask would not hold one delivered to another thread.) SIGKILL cannot be held.
    Outside the main thread it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: List[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: held.append(signum)) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        if held:
            log(f"signal(s) {held} held until the settings were put back")
        for sig in held:
            signal.raise_signal(sig)
