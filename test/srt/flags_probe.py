"""SGLang's process entries, run with one SGLang import for all of test_flags.py's cases.

Run as `python flags_probe.py` with a JSON list of cases on stdin; prints one JSON line mapping each
case's name to {"result": ..., "status": exit status, "stdout": str, "stderr": str}. The parent
imports SGLang once, then runs each case in a forked copy of itself that has not loaded any plugin,
so each case starts as a fresh process would and no two share plugin state or environment.

Case kinds and their "result":
  {"kind": "role", "role": R, "config": dict | None}: R is scheduler, detokenizer, dp_controller or
      launcher; the process runs from its SGLang entry up to its first statement after
      load_plugins(), with `config` published -> {"routing_missing", "control_missing", "cli_missing"}
      (lists of hook targets whose patch is not in place).
  {"kind": "launch", "argv": [...]}: `python -m sglang.launch_server ARGV`, run in-process, with the
      HTTP server's launch replaced by a marker -> {"code": exit code, "launched": bool}.
  {"kind": "engine", "kwargs": {...}}: the process's first sglang.Engine(**kwargs) -> {"error": the
      ValueError's message, or None}.
"""

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback

CASE_TIMEOUT_S = 120  # one case takes seconds; the import before them, minutes at most


class PluginsLoaded(Exception):
    """Stops a process entry of SGLang's right after its load_plugins()."""


# role: (its entry's module, the entry, the entry's arguments after server_args, the first function the
# entry calls after load_plugins(), which the probe replaces by its report)
ENTRIES = {
    "scheduler": ("sglang.srt.managers.scheduler", "run_scheduler_process", (None, 0, 0, 0, None, None),
                  "resolve_spawn_dp_rank"),
    "detokenizer": ("sglang.srt.managers.detokenizer_manager", "run_detokenizer_process", (None,), "configure_logger"),
    "dp_controller": ("sglang.srt.managers.data_parallel_controller", "run_data_parallel_controller_process",
                      (None, None), "publish"),
}


def hook_report():
    """The hook targets whose patch is not in place in this process, by group."""
    from sglang_oea import hooks

    return {"routing_missing": hooks.missing_hooks(hooks.ROUTING_TARGETS),
            "control_missing": hooks.missing_hooks(hooks.CONTROL_TARGETS),
            "cli_missing": hooks.missing_hooks(hooks.CLI_TARGETS)}


def run_until_plugins(role, server_args, report):
    """SGLang's process entry of `role` run up to its first statement after load_plugins(), where
    `report()` is called. The launcher (launch_server, sglang serve, Engine) calls load_plugins() itself."""
    if role == "launcher":
        from sglang.srt.plugins import load_plugins

        load_plugins()
        report()
        return
    module_name, entry, args, first_call = ENTRIES[role]
    module = importlib.import_module(module_name)

    def stop(*_args, **_kwargs):
        report()
        raise PluginsLoaded

    setattr(module, first_call, stop)
    try:
        getattr(module, entry)(server_args, *args)
    except PluginsLoaded:
        return
    raise RuntimeError(f"the {role} entry returned without reaching {first_call}")


def report_scheduler_config(queue, server_args):
    """A spawned scheduler process (multiprocessing target): puts its config as seen after its plugins."""
    from sglang_oea import hooks

    run_until_plugins("scheduler", server_args, lambda: queue.put({
        "oea": getattr(server_args, "_oea", None),
        "published": hooks.published_config().as_dict(),
        "missing": hooks.missing_hooks(hooks.ROUTING_TARGETS),
    }))


def run_role(case):
    found = {}
    run_until_plugins(case["role"], None, lambda: found.update(hook_report()))
    return found


def exit_code(exc):
    """The exit status Python gives an uncaught SystemExit (a message goes to stderr, status 1)."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def run_launch(case):
    """The launcher module run as __main__, as `python -m sglang.launch_server` runs it."""
    import runpy

    from sglang.srt.entrypoints import http_server

    launched = []

    def launch_server(*args, **kwargs):  # the arguments passed every check: the server would start
        launched.append(True)
        raise SystemExit("flags_probe: reached launch_server")

    http_server.launch_server = launch_server
    sys.argv = ["sglang.launch_server", *case["argv"]]
    try:
        runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exit_code(exc)
    return {"code": code, "launched": bool(launched)}


def run_engine(case):
    import sglang

    try:
        sglang.Engine(**case["kwargs"]).shutdown()
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": None}


RUNNERS = {"role": run_role, "launch": run_launch, "engine": run_engine}


def _child(case, out):
    """In the forked copy: fresh environment and output files, the case, its result; never returns."""
    status = 1
    try:
        os.setsid()  # its own process group, so that anything it starts is stopped with it
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(f"{out}.{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        from sglang_oea import hooks

        os.environ.pop(hooks.CONFIG_ENV, None)
        if case.get("config") is not None:
            os.environ[hooks.CONFIG_ENV] = json.dumps(case["config"])
        result = RUNNERS[case["kind"]](case)
        with open(f"{out}.json", "w") as f:
            json.dump(result, f)
        status = 0
    except BaseException:  # noqa: B036 -- reported through stderr; the copy must not unwind into the parent's code
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _wait(pid, deadline):
    """The exit status of `pid`, or None after killing its process group at `deadline`."""
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def run_case(case, out):
    """{"result", "status", "stdout", "stderr"} of one case, run in a forked copy of this process."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _child(case, out)
    status = _wait(pid, time.monotonic() + CASE_TIMEOUT_S)
    try:
        os.killpg(pid, signal.SIGKILL)  # whatever the case started and left behind
    except ProcessLookupError:
        pass
    texts = {}
    for name in ("stdout", "stderr", "json"):
        path = f"{out}.{name}"
        texts[name] = open(path).read() if os.path.exists(path) else None
    return {"result": json.loads(texts["json"]) if texts["json"] else None, "status": status,
            "stdout": texts["stdout"] or "", "stderr": texts["stderr"] or ""}


def preload():
    """Import what the cases run, so that each forked copy starts with it (loading no plugin)."""
    import pkgutil

    from sglang_oea import hooks

    for module in ("sglang", "sglang.srt.plugins", "sglang.srt.server_args", "sglang.srt.entrypoints.engine",
                   "sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler",
                   "sglang.srt.managers.detokenizer_manager", "sglang.srt.managers.data_parallel_controller",
                   "transformers"):
        importlib.import_module(module)
    for target in hooks.CLI_TARGETS + hooks.ROUTING_TARGETS + hooks.CONTROL_TARGETS:
        owner = target.rpartition(".")[0]
        try:
            pkgutil.resolve_name(owner)
        except (ImportError, AttributeError):  # gone in this SGLang: the case reports it missing
            pass


def probe(cases, env):
    """{case name: {"result", "status", "stdout", "stderr"}} for `cases`, from one child running this
    module with environment `env`."""
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], input=json.dumps(cases), env=env,
                          capture_output=True, text=True, timeout=CASE_TIMEOUT_S * (len(cases) + 2))
    if proc.returncode != 0:
        raise RuntimeError(f"flags_probe.py exited with {proc.returncode}: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    cases = json.load(sys.stdin)
    preload()
    with tempfile.TemporaryDirectory(prefix="flags_probe_") as tmp:
        results = {case["name"]: run_case(case, os.path.join(tmp, str(i))) for i, case in enumerate(cases)}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
