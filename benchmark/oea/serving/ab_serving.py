r"""A/B serving benchmark: SGLang with Opportunistic Expert Activation (--oea-k0) against without.

Modes
  1. One server (default): starts one server with your arguments plus `--oea-k0 0 --enable-metrics`
     (the plugin armed, OEA off), and runs every arm on it, switching k0 live between runs
     (POST /set_internal_state, confirmed on every scheduler through /server_info; see
     serving/one_server.py for the order, the warm-ups and why). The baseline arm is k0 0. The
     server's whole process group is killed at the end, also on error or Ctrl-C.
  2. One running server: --url URL does the same on a server you run (started with --oea-k0, any
     value, and --enable-metrics), and puts its OEA settings back at the end.
  3. Two servers (--two-servers): the baseline server (no --oea-* flag at all, e.g. another build),
     measured and stopped, then one server per --k0, one after the other (never two at once).
  4. Two running servers: --baseline-url URL --oea-url URL [URL ...].
  5. Report only: --from-jsonl FILE rebuilds the table and the plot from an earlier run.

Every arm runs sglang.benchmark.serving (prompts of fixed length sent as token ids, a fixed number of
output tokens with EOS ignored, cache flushed before each run) at every concurrency in --concurrency,
--repeats times; repeat r uses seed --seed + r in every arm, so both arms see the same prompts. The
prompts are random token ids (bench_serving's random-ids dataset), or, with --prompt-file, a fixed
ShareGPT-format set (bench_serving's random dataset reading that file: each first turn tokenized
client side and cut to --input-len tokens; the seed picks which ones and in what order). A warm-up
run comes before the measured runs of each server (one server: also after every switch). By
default all runs of one arm (one server: all runs) share one client process
(serving/_bench_driver.py: imports the module once and calls its cli_main() per run, as
`python -m sglang.benchmark.serving ARGS` would); --bench-subprocess starts a fresh
`python -m sglang.benchmark.serving` per run instead.

Outputs in --out-dir: results.jsonl (one line per run), results.md (medians over repeats, and the
OEA/baseline throughput ratio paired by repeat with its min-max), results.png, server and bench logs.

    # GPU box, real model, one server (see benchmark/oea/serving/README.md)
    python benchmark/oea/serving/ab_serving.py --model-path /models/GLM-5-NVFP4 --k0 3 4 5 \
        --out-dir ab_glm5 -- --tp-size 8 --quantization modelopt_fp4 --moe-runner-backend flashinfer_cutlass \
        --disable-shared-experts-fusion
    # a server you run (started with --oea-k0 0 --enable-metrics)
    python benchmark/oea/serving/ab_serving.py --url http://127.0.0.1:30000 --tokenizer /models/GLM-5-NVFP4 \
        --k0 3 4 5 --out-dir ab_glm5_live
    # the baseline on its own server, without the plugin's flags
    python benchmark/oea/serving/ab_serving.py --two-servers --model-path /models/GLM-5-NVFP4 --k0 4 \
        --out-dir ab_glm5_two -- --tp-size 8 --quantization modelopt_fp4 --moe-runner-backend flashinfer_cutlass \
        --disable-shared-experts-fusion
    # this CPU machine, tiny dummy-weight model
    python benchmark/oea/serving/ab_serving.py --cpu --model-path /tmp/tiny --k0 4 --out-dir ab_cpu \
        -- --load-format dummy
    # this CPU machine, the shipped trained model on held-out text (demo.py writes the prompt file)
    python benchmark/oea/serving/ab_serving.py --cpu --model-path benchmark/oea/models/qwen3_moe_stdlib \
        --prompt-file out/demo/heldout_prompts.json --k0 4 --out-dir ab_cpu_trained
    # CI smoke (builds a tiny model when --model-path is absent)
    python benchmark/oea/serving/ab_serving.py --smoke --out-dir /tmp/oea_smoke
    # report only
    python benchmark/oea/serving/ab_serving.py --from-jsonl ab_cpu/results.jsonl --out-dir ab_cpu

Everything after `--` (and --server-args "...") goes to every server unchanged.
"""

import argparse
import os
import shlex
import subprocess
import sys
import time
from typing import List, Optional, Sequence

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmark/oea
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)  # its folders import as packages

from common import report  # noqa: E402
from common.http import redact_argv  # noqa: E402
from serving.bench_client import BENCH_MODULE  # noqa: E402
from serving.live_settings import LiveSettingsError, arm_settings  # noqa: E402
from serving.one_server import run_one_server  # noqa: E402
from serving.prompt_files import RANDOM_IDS, check_prompt_file  # noqa: E402
from serving.servers import RECORDED_ENV, child_env, free_port, log, terminate_as_interrupt  # noqa: E402
from serving.sweep import Arm, run_arms, write_report  # noqa: E402

GPU_CONCURRENCIES = [16, 32, 64]  # where a GLM-5-class server batches decode; the trial's default too
CPU_CONCURRENCIES = [1, 4, 16, 32, 64]
SMOKE_CONCURRENCIES = [1, 2]


def run(args, server_args: List[str]) -> int:
    """The whole sweep: arms from the flags, the prompt file checked, command.txt, every run, then
    results.md / results.png from what was measured (also after an error or Ctrl-C). Returns the
    number of failed runs."""
    check_mode(args)
    os.makedirs(args.out_dir, exist_ok=True)
    jsonl_path = os.path.join(args.out_dir, "results.jsonl")
    set_aside(jsonl_path)
    arms, server_args = make_arms(args, server_args)
    if args.prompt_file:
        args.prompt_file = os.path.abspath(args.prompt_file)
    args.prompts = check_prompt_file(args) if args.prompt_file else RANDOM_IDS
    total = len(arms) * len(args.concurrency) * args.repeats
    log(f"{len(arms)} arms x {len(args.concurrency)} concurrencies x {args.repeats} repeats = {total} runs; "
        f"prompts {args.prompts}, input {args.input_len}, output {args.output_len} tokens; out-dir {args.out_dir}")
    write_command(args)
    try:
        if arms[0].live is not None:
            return run_one_server(arms, args, server_args, jsonl_path)
        return run_arms(arms, args, server_args, jsonl_path)
    finally:
        if os.path.exists(jsonl_path):
            write_report(jsonl_path, args.out_dir, args.title)


def check_mode(args) -> None:
    """SystemExit for flags of different modes given together."""
    pair = args.baseline_url or args.oea_url
    if args.url and (pair or args.two_servers):
        raise SystemExit("--url (one running server) goes with neither --baseline-url/--oea-url nor --two-servers")
    if pair and args.two_servers:
        raise SystemExit("--baseline-url/--oea-url measure running servers: --two-servers launches them")
    if any(k0 < 1 for k0 in args.k0 or []):
        raise SystemExit("--k0 values must be >= 1 (the baseline arm is OEA off)")


def make_arms(args, server_args: List[str]):
    """(arms, server_args) of the mode the flags choose (see the module docstring)."""
    if args.baseline_url or args.oea_url:
        return url_arms(args), server_args
    if args.url:
        if not args.tokenizer:
            raise SystemExit("--url needs --tokenizer (the served model's tokenizer directory or id)")
        return live_arms(args), server_args
    arms, server_args = launch_arms(args, server_args)
    return (arms if args.two_servers else live_arms(args)), server_args


def live_arms(args) -> List[Arm]:
    """One-server arms: the baseline (oea_k0 0) unless --skip-baseline, then one per --k0 with the
    batch gate when given."""
    arms = [] if args.skip_baseline else [Arm(report.BASELINE, None, live=arm_settings(0))]
    arms += [Arm(report.arm_name(k0), k0, live=arm_settings(k0, args.oea_min_batch, args.oea_max_batch))
             for k0 in args.k0]
    return arms


def set_aside(jsonl_path: str) -> None:
    """Move an earlier results.jsonl to results.jsonl.<time>.bak: a sweep starts a fresh one."""
    if os.path.exists(jsonl_path):
        backup = jsonl_path + time.strftime(".%Y%m%d-%H%M%S.bak")
        os.replace(jsonl_path, backup)
        log(f"moved the previous {jsonl_path} to {backup}")


def url_arms(args) -> List[Arm]:
    """URL mode: the baseline (--baseline-url) and OEA servers (--oea-url, labelled by --k0) as they run."""
    if not args.tokenizer:
        raise SystemExit("URL mode needs --tokenizer (the served model's tokenizer directory or id)")
    arms = []
    if args.baseline_url:
        arms.append(Arm(report.BASELINE, None, url=args.baseline_url.rstrip("/")))
    labels = args.k0 if args.k0 and len(args.k0) == len(args.oea_url or []) else None
    if args.oea_url and args.k0 and labels is None:
        raise SystemExit("--k0 must give one value per --oea-url")
    for i, url in enumerate(args.oea_url or []):
        k0 = labels[i] if labels else None
        name = report.arm_name(k0) if k0 is not None else ("oea" if i == 0 else f"oea#{i + 1}")
        arms.append(Arm(name, k0, url=url.rstrip("/")))
    return arms


def launch_arms(args, server_args: List[str]):
    """Launch modes: (two-server arms, server_args): the baseline unless --skip-baseline, then one
    OEA arm per --k0. --smoke without --model-path builds a tiny dummy-weight model first."""
    if args.smoke and not args.model_path:
        args.model_path = make_tiny_model(args.out_dir)
        if "--load-format" not in server_args:
            server_args = server_args + ["--load-format", "dummy"]
    if not args.model_path:
        raise SystemExit("give --model-path (launch mode), --url, --baseline-url/--oea-url, or --from-jsonl")
    args.tokenizer = args.tokenizer or args.model_path
    arms = [] if args.skip_baseline else [Arm(report.BASELINE, None)]
    arms += [Arm(report.arm_name(k0), k0, extra_args=oea_flags(k0, args)) for k0 in args.k0]
    return arms, server_args


def write_command(args) -> None:
    """command.txt: this script's command line, and the thread settings when set (they change CPU
    and host-side timings)."""
    with open(os.path.join(args.out_dir, "command.txt"), "w") as f:
        f.write(shlex.join([sys.executable, __file__, *redact_argv(args.argv)]) + "\n")  # no key on disk
        env = {k: os.environ[k] for k in RECORDED_ENV if k in os.environ}
        if env:
            f.write("# environment: " + shlex.join(f"{k}={v}" for k, v in env.items()) + "\n")


def run_smoke(out_dir: str, model_path: Optional[str] = None, k0: int = 4,
              concurrencies: Sequence[int] = (1, 2), num_prompts: int = 4,
              server_args: Sequence[str] = (), port: int = 30000,
              prompt_file: Optional[str] = None, two_servers: bool = False,
              oea_min_batch: Optional[int] = None) -> report.Summary:
    """Baseline vs OEA k0 on a CPU server (one server, k0 set live; two_servers: one server per arm)
    at two concurrencies with a few prompts; raises on failure.

    Builds a tiny dummy-weight Qwen3-MoE when model_path is None; a given model loads its own weights
    (pass server_args=["--load-format", "dummy"] for a config-only one). prompt_file: --prompt-file
    (default random ids); oea_min_batch: --oea-min-batch (default the server's). Returns the report summary.
    """
    argv = ["--smoke", "--out-dir", out_dir, "--k0", str(k0), "--port", str(port),
            "--num-prompts", str(num_prompts), "--concurrency", *map(str, concurrencies)]
    argv += ["--two-servers"] if two_servers else []
    argv += ["--oea-min-batch", str(oea_min_batch)] if oea_min_batch is not None else []
    if model_path:
        argv += ["--model-path", model_path]
    if prompt_file:
        argv += ["--prompt-file", prompt_file]
    sargs = list(server_args)
    args = parse_args(argv, argv + (["--", *sargs] if sargs else []))
    apply_defaults(args)
    failures = run(args, sargs)
    summary = report.summarize(report.load_jsonl(os.path.join(out_dir, "results.jsonl")))
    check_smoke(summary, out_dir, len(concurrencies), failures)
    return summary


def check_smoke(summary: report.Summary, out_dir: str, n_conc: int, failures: int) -> None:
    """RuntimeError listing what the smoke run lacks: failed runs, arms, ratios, warnings, files."""
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


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def _split_passthrough(argv: Sequence[str]):
    """(the harness's own arguments, the server arguments after `--`)."""
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
    src.add_argument("--port", type=int, default=30000, help="launched servers' port (0: a free one)")
    src.add_argument("--two-servers", action="store_true",
                     help="launch a baseline server without any --oea-* flag (e.g. another build), then one "
                          "server per --k0, instead of one server switched live")
    src.add_argument("--url", help="one running server (started with --oea-k0 and --enable-metrics): every arm on "
                                   "it, k0 set live; its OEA settings are put back at the end")
    src.add_argument("--admin-api-key", help="the server's --admin-api-key, sent with the live-settings POSTs")
    src.add_argument("--baseline-url", help="two running servers: the one without OEA")
    src.add_argument("--oea-url", nargs="+", help="two running servers: the OEA one(s) (label them with --k0)")
    src.add_argument("--from-jsonl", help="only rebuild results.md/results.png from this JSONL")
    src.add_argument("--title", help="title of the table and plot")

    oea = p.add_argument_group("OEA arms")
    oea.add_argument("--k0", type=int, nargs="+", default=None, help="one OEA arm per value (default 4)")
    oea.add_argument("--oea-min-batch", type=int, help="the batch gate of every OEA arm (flag, or set live)")
    oea.add_argument("--oea-max-batch", type=int, help="the batch gate of every OEA arm (0 = no cap)")
    oea.add_argument("--skip-baseline", action="store_true", help="OEA arms only")

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
    wl.add_argument("--switch-warmup-prompts", type=int,
                    help="one server: prompts of the warm-up after every switch of arm or concurrency "
                         "(default C: one wave at the run's concurrency; 0 = none)")
    wl.add_argument("--switch-warmup-output-len", type=int,
                    help="one server: its output tokens (default the server's --decode-log-interval + 8, so that "
                         "OEA's counters are exported at least once between arms)")
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
    ops.add_argument("--cooldown", type=float, default=5.0, help="--two-servers: seconds between stopping and "
                                                                     "starting servers")
    ops.add_argument("--smoke", action="store_true",
                     help="CI smoke: --cpu, C=1 2, 4 prompts, 1 repeat, tiny model if none given; "
                          "exits non-zero unless every run produced a result")
    return p


def apply_defaults(args) -> None:
    """Fill the flags left unset: --smoke's small run, then the GPU or --cpu defaults."""
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
    args.port = args.port or free_port()
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
    """The only server flags an OEA arm adds: --oea-k0, and the batch gate when given."""
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit status: 0 done, 1 a run failed (or the smoke check), 2 the server did not take or confirm an
    OEA setting, 130 interrupted."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own, passthrough = _split_passthrough(argv)
    args = parse_args(own, argv)
    server_args = shlex.split(args.server_args) + passthrough

    if args.from_jsonl:
        summary = write_report(args.from_jsonl, args.out_dir, args.title)
        return 0 if summary.concurrencies else 1

    apply_defaults(args)
    try:
        with terminate_as_interrupt():
            failures = run(args, server_args)
    except KeyboardInterrupt:
        log("interrupted; servers stopped, partial results kept")
        return 130
    except LiveSettingsError as e:
        log(f"stopped: {e}")
        return 2
    if args.smoke:
        summary = report.summarize(report.load_jsonl(os.path.join(args.out_dir, "results.jsonl")))
        try:
            check_smoke(summary, args.out_dir, len(args.concurrency), failures)
        except RuntimeError as e:
            log(str(e))
            return 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
