"""Long-lived bench client for ab_serving.py: imports the bench module once, then runs it many times.

Starting `python -m sglang.benchmark.serving` afresh for every measured run costs the import of
sglang each time (12-30 s on a 2-core machine). ab_serving.py instead starts this script once per
arm; it imports the module (default `sglang.benchmark.serving`, or a .py file) once and then, for
every request, sets sys.argv and calls the module's entry point (default `cli_main`), exactly what
`python -m MODULE ARGS...` would do, with the run's stdout and stderr (file descriptors 1 and 2,
so library output and logging too) sent to that run's log file.

Protocol (one JSON object per line):
    stdin   {"argv": [ARG, ...], "log": PATH}    run once; PATH receives the output (appended)
    stdout  {"ready": true, "import_s": S}       once, after the import
            {"rc": RC, "elapsed_s": S}           after every run; RC is what the process exit
                                                 status would have been (SystemExit's code, 1 on
                                                 an exception)
End of stdin ends the driver. Anything else the driver prints goes to its stderr (ab_serving keeps
it in runs/<arm>_driver.log). Timeouts are the caller's job: it kills this process's group.
"""

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time
import traceback


def load_module(spec: str):
    """A module by dotted name, or a Python file by path."""
    if spec.endswith(".py") or os.sep in spec:
        name = "_bench_driver_target"
        mod_spec = importlib.util.spec_from_file_location(name, spec)
        if mod_spec is None or mod_spec.loader is None:
            raise ImportError(f"cannot load {spec}")
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = module
        mod_spec.loader.exec_module(module)
        return module
    return importlib.import_module(spec)


def _exit_code(code) -> int:
    """The process exit status SystemExit(code) would give."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def run_once(entry, prog: str, argv, log_path: str) -> int:
    """entry() with sys.argv = [prog, *argv] and fds 1 and 2 appended to log_path."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    saved_argv = sys.argv
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        sys.argv = [prog, *argv]
        try:
            entry()  # what `python -m MODULE` runs; its return value is not an exit status
            rc = 0
        except SystemExit as e:
            rc = _exit_code(e.code)
        except KeyboardInterrupt:
            raise
        except BaseException:  # noqa: BLE001 - reported as the run's failure, like an uncaught exception
            traceback.print_exc()
            rc = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            sys.argv = saved_argv
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in (*saved, log_fd):
                os.close(fd)
    return rc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--module", default="sglang.benchmark.serving", help="dotted module name or a .py file")
    p.add_argument("--entry", default="cli_main", help="function called for each run (reads sys.argv)")
    a = p.parse_args(argv)

    # The protocol gets its own copy of stdout; fd 1 then points at stderr so that nothing the
    # module prints (at import or between runs) can corrupt the protocol.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def send(msg: dict) -> None:
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    t0 = time.time()
    module = load_module(a.module)
    entry = getattr(module, a.entry)
    prog = getattr(module, "__file__", None) or a.module
    send({"ready": True, "import_s": round(time.time() - t0, 2), "pid": os.getpid()})
    while True:
        line = sys.stdin.readline()
        if not line:
            return 0
        if not line.strip():
            continue
        req = json.loads(line)
        t0 = time.time()
        rc = run_once(entry, prog, req["argv"], req["log"])
        send({"rc": rc, "elapsed_s": round(time.time() - t0, 2)})


if __name__ == "__main__":
    sys.exit(main())
