"""The trial's guard: a small process that outlives the trial and puts the server's starting OEA
settings back when the trial dies without doing so (SIGKILL, an OOM kill). Standard library only.

trial.py starts it (GuardClient.start) before its first change, in its own session (so the
terminal's Ctrl-C does not reach it), and writes to its stdin one JSON object per line; the keys
travel this way, never on a command line or in the environment:

    {"url", "api_key", "admin_api_key", "start": {"oea_k0": K}, "trial_pid", "log"}   first, once
    {"set": {...}}    the trial is about to POST these settings (live_settings.watch_settings)
    {"done": true}    the trial has put its settings back (or said it could not) and ends

It answers "ready" on stdout once it has read the first line. Then it waits. "done" followed by the
end of input: it exits. The end of input without "done" (the pipe's only writer, the trial, is
gone), or the trial's process gone: the trial died. It then reads the settings in force and
- puts the starting settings back (live_settings.put_back: set, one pass, confirmed in force,
  retried) when they are the trial's last (or the one before, if that last POST did not take);
- does nothing when they already are the starting ones;
- leaves them alone when they are anything else: someone changed the server since.
It logs what it did (never a key) to the log file, acting within GUARD_DEADLINE_S of the trial's
death, and exits: it never leaves a process behind.
"""

import json
import os
import select
import subprocess
import sys
import time
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)  # benchmark/oea: run by path, its packages import from there
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

from common.http import Auth, use_auth  # noqa: E402
from serving.live_settings import put_back, settings_now, watch_settings  # noqa: E402

GUARD_DEADLINE_S = 25.0  # the settings are put back (or given up on) within this of the trial's death
GUARD_DELAYS = (1.0, 2.0, 4.0, 8.0)  # put_back's retries: 15 s of waits, inside the deadline
READY_TIMEOUT_S = 30.0


class GuardClient:
    """The trial's side: start the guard, tell it each setting before it is POSTed, and that the
    trial is done. A guard that is gone is said once in the log; the trial goes on (its own
    restore still runs)."""

    def __init__(self, url: str, auth: Auth, start: Dict[str, int], log_path: str, env: Dict[str, str],
                 log=print):
        self.url, self.log, self.broken = url.rstrip("/"), log, False
        with open(log_path, "a") as errors:
            self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=errors, env=env, start_new_session=True)
        self.send({"url": self.url, "api_key": auth.api_key, "admin_api_key": auth.admin_api_key,
                   "start": start, "trial_pid": os.getpid(), "log": os.path.abspath(log_path)})
        ready, _, _ = select.select([self.proc.stdout], [], [], READY_TIMEOUT_S)
        answer = self.proc.stdout.readline() if ready else b""
        self.proc.stdout.close()
        if answer.strip() != b"ready":
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"the guard did not start (exit code {self.proc.returncode}); see {log_path}")
        self.unwatch = watch_settings(self.note)

    def send(self, message: Dict) -> None:
        if self.broken:
            return
        try:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()
        except OSError as e:
            self.broken = True
            self.log(f"WARNING: the guard (pid {self.proc.pid}) is gone ({e}); the trial still puts its settings back")

    def note(self, base_url: str, settings: Dict[str, int]) -> None:
        """live_settings' watcher: the trial is about to POST `settings` to base_url."""
        if base_url.rstrip("/") == self.url:
            self.send({"set": settings})

    def finish(self) -> None:
        """The trial has put its settings back (or said it could not): the guard exits; waited for."""
        self.unwatch()
        self.send({"done": True})
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Log:
    """Lines appended to the guard's log file, each with the time and the guard's pid."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, msg: str) -> None:
        with open(self.path, "a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} [guard {os.getpid()}] {msg}\n")


def trial_alive(pid: int) -> bool:
    """Whether the trial's process runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True


def watch(fd: int, trial_pid: int, recent: List[Dict[str, int]], log: Log) -> bool:
    """Read the trial's messages until it ends; True when it said "done", False when it died.
    recent: the trial's settings, the last at the end (updated in place)."""
    buf, done = b"", False
    while True:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            if not trial_alive(trial_pid):
                return done
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return done
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            message = json.loads(line)
            if "set" in message:
                log(f"the trial sets {json.dumps(message['set'])}")
                recent.append(message["set"])
                del recent[:-2]
            done = done or bool(message.get("done"))


def restore_after_death(url: str, start: Dict[str, int], recent: List[Dict[str, int]], log: Log) -> None:
    """The trial died: put `start` back when the server is at the trial's last settings (module doc)."""
    deadline = time.time() + GUARD_DEADLINE_S
    keys = list(start)
    now = settings_now(url, keys)
    while now is None and time.time() + 2.0 < deadline - sum(GUARD_DELAYS):
        time.sleep(1.0)  # the server may be busy or restarting: ask again while a put_back still fits
        now = settings_now(url, keys)
    trials = [{k: s.get(k) for k in keys} for s in recent if all(k in s for k in keys)]
    if now == start:
        log(f"the trial died; the server is already at the starting settings {json.dumps(start)}: nothing to do")
    elif now is not None and now not in trials:
        log(f"the trial died; the server is at {json.dumps(now)}, not the trial's last settings "
            f"{json.dumps(trials[-1] if trials else None)}: someone changed it since, so it is left alone")
    else:
        seen = json.dumps(now) if now is not None else "unknown (the server did not say)"
        log(f"the trial died with the server at {seen}: putting back the starting settings {json.dumps(start)}")
        outcome = put_back(url, start, delays=GUARD_DELAYS, log=log)
        if outcome["ok"]:
            log(f"put back {json.dumps(start)} by the guard, confirmed in force on every scheduler "
                f"(attempt {outcome['attempts']})")
        else:
            log(f"FAILED to put back {json.dumps(start)} ({'; '.join(outcome['errors'])}); the server is left at "
                f"{json.dumps(outcome['left_at'])}: set it by hand")


def main() -> int:
    fd = sys.stdin.fileno()
    first = b""
    while not first.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            return 1  # the trial went before configuring its guard: nothing to guard
        first += chunk
    config = json.loads(first)
    log = Log(config["log"])
    use_auth(config["url"], Auth(config.get("api_key"), config.get("admin_api_key")))
    start = config["start"]
    log(f"guarding {config['url']} for the trial (pid {config['trial_pid']}): starting settings {json.dumps(start)}")
    print("ready", flush=True)
    sys.stdout.close()
    recent = [dict(start)]
    if watch(fd, int(config["trial_pid"]), recent, log):
        log("the trial put its settings back and ended: exiting")
        return 0
    restore_after_death(config["url"], start, recent, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
