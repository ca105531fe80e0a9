"""CPU A/B demo of Opportunistic Expert Activation (what `make demo` runs).

    python benchmark/oea/demo.py --out-dir out/demo [--k0 3 4 5] [--concurrency 1 4 16 32 64]
                                 [--repeats 1] [--oea-min-batch 2] [--oea-max-batch 0]

1. Builds a tiny Qwen3-MoE (128 experts, top-8, hidden 512, expert FFN 384, 4 layers; dummy
   weights, a small local tokenizer) in <out-dir>/model, unless it is there already.
2. Runs ab_serving.py in CPU mode: a baseline server (plain SGLang top-8 routing), then one server
   per k0 (--oea-k0 K0 plus the --oea-min-batch/--oea-max-batch below), one at a time; each is
   measured with sglang.benchmark.serving at every concurrency, 64 prompt tokens and 64 output
   tokens, max(2*C, 8) prompts (at least two waves of requests), the same seeds, hence the same
   prompts, in every arm.
3. Prints the table (arms side by side per concurrency, then ab_serving's full table) and writes
   results.jsonl, results.md, results.png (ab_serving) and demo.md into --out-dir.

These are CPU numbers on a dummy-weight tiny model: they show that OEA acts end to end in a real
SGLang server (fewer distinct experts per decode step) and how that moves decode time on this
machine, not what a GPU deployment gains. See benchmark/oea/README.md.
"""

import argparse
import os
import shlex
import subprocess
import sys
import time
from typing import List, Optional, Sequence

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import _report  # noqa: E402
import ab_serving  # noqa: E402

# OEA gating of the OEA arms (passed as --oea-min-batch / --oea-max-batch; max 0 = no cap).
DEFAULT_MIN_BATCH = 2
DEFAULT_MAX_BATCH = 0

DEFAULT_K0 = (3, 4, 5)
DEFAULT_CONCURRENCY = (1, 4, 16, 32, 64)
INPUT_LEN = 64
OUTPUT_LEN = 64
PROMPTS_PER_CONCURRENCY = 2  # prompts per run = max(2 * C, MIN_PROMPTS): at least two waves
MIN_PROMPTS = 8

MODEL_FLAGS = ["--arch", "qwen3_moe", "--num-experts", "128", "--top-k", "8", "--hidden-size", "512",
               "--moe-intermediate-size", "384", "--num-layers", "4"]
MODEL_DESC = "tiny Qwen3-MoE: 128 experts, top-8, hidden 512, expert FFN 384, 4 layers, dummy weights"

# Server flags of every arm. --enable-metrics lets the harness record OEA's expert counters per run.
# The KV pool is sized by tokens (cpu_serve's default is 32768 as well): 32768 tokens hold C=64 x 128
# tokens several times over. --mem-fraction-static only has to pass SGLang's start-up check that free
# RAM did not drop by that fraction while the weights loaded.
SERVER_ARGS = ["--load-format", "dummy", "--enable-metrics", "--mem-fraction-static", "0.3",
               "--max-total-tokens", "32768"]


# One OpenMP thread per process (servers and bench client; the caller's own OMP_NUM_THREADS wins).
# With torch's default of one thread per core, the server's OpenMP team spin-waits at every barrier
# whenever the client, the tokenizer or another job holds one of the 2 cores: decode steps then
# slowed down 5-10x at random in our runs, swamping any A/B difference (and the time budget).
THREAD_ENV = {"OMP_NUM_THREADS": "1"}


def log(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def header(args) -> str:
    k0s = ", ".join(str(k) for k in args.k0)
    max_batch = "no cap" if not args.oea_max_batch else str(args.oea_max_batch)
    return "\n".join([
        "=" * 100,
        "OEA CPU demo: SGLang serving with Opportunistic Expert Activation vs without",
        f"  model     {MODEL_DESC}",
        f"  arms      baseline (plain top-8 routing) vs --oea-k0 {k0s} "
        f"(--oea-min-batch {args.oea_min_batch}, --oea-max-batch {args.oea_max_batch}: {max_batch});",
        "            one server at a time, identical settings apart from the --oea-* flags",
        f"  workload  sglang.benchmark.serving, concurrency {' '.join(map(str, args.concurrency))}, "
        f"{INPUT_LEN} tokens in / {OUTPUT_LEN} out, max({PROMPTS_PER_CONCURRENCY}*C, {MIN_PROMPTS}) prompts "
        f"per run, {args.repeats} repeat(s), same prompts in every arm",
        f"  threads   OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', THREAD_ENV['OMP_NUM_THREADS'])} "
        "in the servers and the client (see THREAD_ENV in demo.py)",
        "  NOTE      CPU numbers on a dummy-weight tiny model (2-core machine, other work may run beside it):",
        "            they show that OEA acts end to end (fewer distinct experts per decode step) and what",
        "            that does to decode time here, NOT what a GPU deployment gains.",
        "=" * 100,
    ])


def build_model(model_dir: str) -> str:
    """The tiny model's directory; built with sglang_oea.tiny_model unless config.json exists."""
    if os.path.exists(os.path.join(model_dir, "config.json")):
        log(f"model already at {model_dir}")
        return model_dir
    cmd = [sys.executable, "-m", "sglang_oea.tiny_model", *MODEL_FLAGS[:2], "--out", model_dir, *MODEL_FLAGS[2:]]
    log("building the model: " + shlex.join(cmd))
    subprocess.run(cmd, check=True, env=ab_serving.child_env())
    return model_dir


def ab_argv(args, model_dir: str) -> List[str]:
    """ab_serving.py's command line for the demo."""
    argv = ["--cpu", "--model-path", model_dir, "--out-dir", args.out_dir, "--port", str(args.port),
            "--k0", *map(str, args.k0), "--oea-min-batch", str(args.oea_min_batch),
            "--oea-max-batch", str(args.oea_max_batch),
            "--concurrency", *map(str, args.concurrency), "--repeats", str(args.repeats),
            "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
            "--prompts-per-concurrency", str(PROMPTS_PER_CONCURRENCY), "--min-prompts", str(MIN_PROMPTS),
            "--cooldown", "2", "--title", f"OEA CPU demo ({MODEL_DESC})"]
    if args.bench_subprocess:
        argv.append("--bench-subprocess")
    return argv + ["--", *SERVER_ARGS]


def _metric(sample: dict, name: str) -> Optional[float]:
    """Mean of the samples of one metric over its labels (e.g. layers), or None when there is none."""
    vals = [v for k, v in sample.items() if k.split("{")[0] == name]
    return sum(vals) / len(vals) if vals else None


def expert_table(records: Sequence[dict], summary: _report.Summary, min_batch: int, max_batch: int) -> str:
    """Per (C, OEA arm): distinct experts per layer and decode step before -> after OEA (mean over
    layers) and their ratio, from the server's OEA metrics scraped after the run (gauges averaged over
    the OEA-routed steps of the last decode-log interval, 40 steps by default: the run's tail).
    Concurrencies outside [min_batch, max_batch] are marked as gated off: the server exports its
    counters once per interval, so a gauge read there would belong to an earlier run.
    Empty when no run recorded OEA metrics."""
    oea_arms = [a for a in summary.arms if a != _report.BASELINE]
    rows, seen = [], False
    for conc in summary.concurrencies:
        cells = [str(conc)]
        for arm in oea_arms:
            recs = [r for r in records if r.get("arm") == arm and r.get("concurrency") == conc
                    and not r.get("error") and r.get("oea_metrics") is not None]
            found = sorted((ratio, _metric(r["oea_metrics"], "sglang:oea_active_experts_before"),
                            _metric(r["oea_metrics"], "sglang:oea_active_experts_after")) for r in recs
                           if (ratio := _metric(r["oea_metrics"], "sglang:oea_active_experts_ratio")) is not None)
            seen = seen or bool(found)
            if conc < min_batch:
                cells.append(f"off (C < min batch {min_batch})")
            elif max_batch and conc > max_batch:
                cells.append(f"off (C > max batch {max_batch})")
            elif not found:
                cells.append("-")
            else:
                ratio, before, after = found[len(found) // 2]  # median run by ratio
                counts = f"{before:.1f} -> {after:.1f} " if before is not None and after is not None else ""
                cells.append(f"{counts}({ratio:.2f}x)")
        rows.append("| " + " | ".join(cells) + " |")
    if not seen:
        return ""
    head = ["| C | " + " | ".join(oea_arms) + " |", "|" + "|".join(["---"] * (len(oea_arms) + 1)) + "|"]
    return "\n".join(head + rows) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default="out/demo")
    p.add_argument("--k0", type=int, nargs="+", default=list(DEFAULT_K0), help="one OEA arm per value")
    p.add_argument("--concurrency", type=int, nargs="+", default=list(DEFAULT_CONCURRENCY))
    p.add_argument("--repeats", type=int, default=1, help="repeats per (arm, concurrency); 3+ to see the spread")
    p.add_argument("--oea-min-batch", type=int, default=DEFAULT_MIN_BATCH,
                   help=f"OEA arms: no OEA below this decode batch (default {DEFAULT_MIN_BATCH})")
    p.add_argument("--oea-max-batch", type=int, default=DEFAULT_MAX_BATCH,
                   help=f"OEA arms: no OEA above this decode batch, 0 = no cap (default {DEFAULT_MAX_BATCH})")
    p.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    p.add_argument("--bench-subprocess", action="store_true",
                   help="one bench_serving process per run (slower; see ab_serving.py)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    args.port = args.port or ab_serving.free_port()
    for key, value in THREAD_ENV.items():
        os.environ.setdefault(key, value)  # inherited by ab_serving's servers and bench driver
    t_start = time.time()
    print(header(args), flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    model_dir = build_model(os.path.abspath(os.path.join(args.out_dir, "model")))

    rc = ab_serving.main(ab_argv(args, model_dir))
    wall = time.time() - t_start

    jsonl = os.path.join(args.out_dir, "results.jsonl")
    if not os.path.exists(jsonl):
        log(f"no results (ab_serving exit code {rc}); see the logs in {args.out_dir}")
        return rc or 1
    records = _report.load_jsonl(jsonl)
    summary = _report.summarize(records)
    side = _report.side_by_side_table(summary)
    experts = expert_table(records, summary, args.oea_min_batch, args.oea_max_batch)
    with open(os.path.join(args.out_dir, "results.md")) as f:
        full = f.read()
    parts = ["# OEA CPU demo", "", "```", header(args), "```", "",
             "## Arms side by side", "",
             "Output tok/s (OEA arms: x = paired ratio vs baseline, median over repeats) and median TPOT ms.", "",
             side]
    if experts:
        parts += ["## Distinct experts per layer and decode step, router's choice -> after OEA", "",
                  "From the server's OEA metrics after each run (sglang:oea_active_experts_ratio: the OEA-routed "
                  "decode steps of the server's last decode-log interval, i.e. the run's tail). Baseline: 1.", "",
                  experts]
    parts += [f"Wall time: {wall / 60:.1f} min ({wall:.0f} s).", "", full]
    with open(os.path.join(args.out_dir, "demo.md"), "w") as f:
        f.write("\n".join(parts))

    print()
    print(header(args))
    print("\nArms side by side: output tok/s (OEA arms: paired ratio vs baseline) and median TPOT ms\n")
    print(side)
    if experts:
        print("Distinct experts per layer and decode step, router's choice -> after OEA (server metrics, the run's "
              "last decode-log interval)\n")
        print(experts)
    if summary.warnings:
        print("Warnings: " + "; ".join(summary.warnings) + "\n")
    log(f"wrote {', '.join(os.path.join(args.out_dir, n) for n in ('results.jsonl', 'results.md', 'results.png', 'demo.md'))}")
    log(f"wall time {wall / 60:.1f} min ({wall:.0f} s); ab_serving exit code {rc}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
