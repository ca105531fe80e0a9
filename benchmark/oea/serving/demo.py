"""CPU A/B demo of Opportunistic Expert Activation (what `make demo` runs).

    python benchmark/oea/serving/demo.py --out-dir out/demo [--k0 4] [--concurrency 4 16] [--repeats 3]
                                 [--oea-min-batch 2] [--oea-max-batch 0] [--random-weights]
                                 [--model-path DIR] [--prompts heldout|random-ids] [--two-servers] [--no-cost]

1. Model: by default the shipped trained checkpoint benchmark/oea/models/qwen3_moe_stdlib (Qwen3-MoE, 128 experts,
   top-8, hidden 128, expert FFN 32, 4 layers, trained on Python standard-library source by
   training/train_moe.py), served with its weights. --random-weights serves the same checkpoint with
   --load-format dummy: same architecture, tokenizer and prompts, random weights (a router with no
   preferences), to set the two side by side.
2. Prompts: by default held-out windows of the model's heldout.txt (documents it never trained on;
   training/heldout.py), written to <out-dir>/heldout_prompts.json and given to ab_serving.py as
   --prompt-file: 64-token prompts, sent as token ids, and 64 output tokens with EOS ignored, so
   every arm decodes the same number of tokens from the same prompts. --prompts random-ids brings
   back random token ids (any model).
3. Runs ab_serving.py in CPU mode on one server (--oea-k0 0: the plugin armed, OEA off), the
   baseline arm at k0 0 and each OEA arm at its k0 set live; per concurrency and repeat the arms
   run one after the other, in reversed order every other repeat, with a short warm-up after each
   switch (see serving/one_server.py). --two-servers brings back one server per arm. Each run is
   sglang.benchmark.serving with max(8*C, 8) prompts (eight waves of C requests), the same seeds,
   hence the same prompts, in every arm.
4. Prints the table (arms side by side per concurrency; a paired ratio whose per-repeat values
   spread beyond +-5% of their median, or that has fewer than 3 repeats, shows as "not resolved"
   with its spread), the distinct experts per decode step before and after OEA (the server's
   metrics), what OEA's own work costs per decode step next to the MoE work it saved (micro-
   benchmarks on this machine, serving/demo_cost.py; --no-cost skips them), then ab_serving's full
   table; writes results.jsonl, results.md, results.png (ab_serving) and demo.md into --out-dir.

The defaults (k0 4, C = 4 and 16, 3 repeats, 8*C prompts per run) take about 8 minutes on 2 cores.
They were meant to resolve the C=16 ratio within +-5%; on this 2-core machine they do not, because
the host's own speed swings by up to 2x from second to second (measured 2026-12-02 with
studies/host_steadiness.py, see serving/README.md), and the table then says "not resolved" with
the spread. These are CPU numbers on a tiny model: they show that OEA acts end to end in a real
SGLang server (fewer distinct experts per decode step) and how that moves decode time on this
machine, not what a GPU deployment of a large model gains. See benchmark/oea/serving/README.md.
"""

import argparse
import json
import os
import sys
import time
from typing import List, Optional, Sequence

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmark/oea
_REPO = os.path.dirname(os.path.dirname(BENCH))
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)  # its folders import as packages

from common import report  # noqa: E402
from serving import ab_serving  # noqa: E402
from serving.demo_cost import cost_section  # noqa: E402
from common.oea_metrics import run_experts  # noqa: E402
from serving.prompt_files import write_prompt_file  # noqa: E402
from serving.servers import free_port, terminate_as_interrupt  # noqa: E402

TRAINED_MODEL = os.path.join(BENCH, "models", "qwen3_moe_stdlib")
LABEL = "CPU, tiny model, not GPU/GLM-5"  # on every title, table and plot the demo writes

# OEA gating of the OEA arms (passed as --oea-min-batch / --oea-max-batch; max 0 = no cap).
DEFAULT_MIN_BATCH = 2
DEFAULT_MAX_BATCH = 0

# One OEA arm, two concurrencies, three repeats of eight waves: the time goes to few long runs
# rather than many short ones, since the ratio's min-max over repeats widens with their number.
DEFAULT_K0 = (4,)
DEFAULT_CONCURRENCY = (4, 16)
DEFAULT_REPEATS = 3
INPUT_LEN = 64
OUTPUT_LEN = 64
PROMPTS_PER_CONCURRENCY = 8  # prompts per run = max(8 * C, MIN_PROMPTS): eight waves
MIN_PROMPTS = 8
WARMUP_PROMPTS = 8
PROMPT_FILE = "heldout_prompts.json"
HELDOUT_SEED = 0  # picks the held-out windows; ab_serving's --seed then picks among them per run

# Server flags of every arm. --enable-metrics lets the harness record OEA's expert counters per run.
# The KV pool is sized by tokens (cpu_serve's default is 32768 as well): 32768 tokens hold C=64 x 128
# tokens several times over. --mem-fraction-static only has to pass SGLang's start-up check that free
# RAM did not drop by that fraction while the weights loaded.
SERVER_ARGS = ["--enable-metrics", "--mem-fraction-static", "0.3", "--max-total-tokens", "32768"]
DUMMY_WEIGHTS = ["--load-format", "dummy"]


# One OpenMP thread per process (servers and bench client; the caller's own OMP_NUM_THREADS wins).
# With torch's default of one thread per core, the server's OpenMP team spin-waits at every barrier
# whenever the client, the tokenizer or another job holds one of the 2 cores: decode steps then
# slowed down 5-10x at random in our runs, swamping any A/B difference (and the time budget).
THREAD_ENV = {"OMP_NUM_THREADS": "1"}


def log(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def _shown_path(path: str) -> str:
    """path relative to the repository when it lies inside it (shorter in tables)."""
    rel = os.path.relpath(os.path.abspath(path), _REPO)
    return path if rel.startswith("..") else rel


def describe_model(model_dir: str, random_weights: bool) -> str:
    """One line on the served model, from its config.json (and training.json when there is one)."""
    cfg = {}
    if os.path.exists(os.path.join(model_dir, "config.json")):
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
    experts = cfg.get("num_experts", cfg.get("num_local_experts", cfg.get("n_routed_experts", "?")))
    shape = (f"{experts} experts, top-{cfg.get('num_experts_per_tok', '?')}, hidden {cfg.get('hidden_size', '?')}, "
             f"expert FFN {cfg.get('moe_intermediate_size', '?')}, {cfg.get('num_hidden_layers', '?')} layers")
    arch = (cfg.get("architectures") or [cfg.get("model_type", "?")])[0]
    if random_weights:
        weights = "DUMMY weights (--load-format dummy: random, a router with no preferences)"
    else:
        source = _training_source(model_dir)
        weights = "trained weights" + (f" ({source})" if source else "")
    return f"{_shown_path(model_dir)}: {arch}, {shape}; {weights}"


def _training_source(model_dir: str) -> Optional[str]:
    path = os.path.join(model_dir, "training.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f).get("corpus", {}).get("source")


def prompt_count(concurrency: Sequence[int]) -> int:
    """Prompts the largest run (or the warm-up) of the sweep sends: the prompt file's size."""
    return max(PROMPTS_PER_CONCURRENCY * max(concurrency), MIN_PROMPTS, WARMUP_PROMPTS)


def describe_prompts(args) -> str:
    if args.prompts == "random-ids":
        return "random token ids (bench_serving's random-ids dataset)"
    return (f"held-out text of the model (heldout.txt: documents it never trained on), "
            f"{prompt_count(args.concurrency)} windows of {INPUT_LEN} tokens ({PROMPT_FILE}), sent as token ids")


def header(args) -> str:
    k0s = ", ".join(str(k) for k in args.k0)
    max_batch = "no cap" if not args.oea_max_batch else str(args.oea_max_batch)
    return "\n".join([
        "=" * 100,
        f"OEA CPU demo ({LABEL}): SGLang serving with Opportunistic Expert Activation vs without",
        f"  model     {describe_model(args.model_path, args.random_weights)}",
        f"  prompts   {describe_prompts(args)}",
        f"  arms      baseline (plain top-k routing) vs --oea-k0 {k0s} "
        f"(--oea-min-batch {args.oea_min_batch}, --oea-max-batch {args.oea_max_batch}: {max_batch});",
        ("            one server per arm, one at a time, identical settings apart from the --oea-* flags"
         if args.two_servers else
         "            one server (--oea-k0 0: plugin armed, OEA off), k0 set live; arms interleaved per repeat"),
        f"  workload  sglang.benchmark.serving, concurrency {' '.join(map(str, args.concurrency))}, "
        f"{INPUT_LEN} tokens in / {OUTPUT_LEN} out (EOS ignored), max({PROMPTS_PER_CONCURRENCY}*C, {MIN_PROMPTS}) "
        f"prompts per run, {args.repeats} repeat(s), same prompts in every arm",
        f"  threads   OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', THREAD_ENV['OMP_NUM_THREADS'])} "
        "in the servers and the client (see THREAD_ENV in demo.py)",
        f"  NOTE      {LABEL}: CPU numbers on a 2-core machine (other work may run beside it);",
        "            they show that OEA acts end to end (fewer distinct experts per decode step) and what",
        "            that does to decode time here, NOT what a GPU deployment of a large model gains.",
        "=" * 100,
    ])


def write_heldout_prompts(model_dir: str, path: str, count: int, prompt_len: int = INPUT_LEN,
                          continuation_len: int = OUTPUT_LEN, seed: int = HELDOUT_SEED) -> str:
    """`count` held-out windows of model_dir (heldout.prompt_continuations) as ab_serving's
    --prompt-file: each prompt's text, with its true continuation as the second turn. Returns path.

    bench_serving tokenizes the text again, so each prompt is checked to tokenize back to exactly
    its window's `prompt_len` ids; ValueError otherwise.
    """
    from training import heldout  # torch and the training code: only when prompts are written
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    pairs = []
    for i, row in enumerate(heldout.prompt_continuations(model_dir, count, prompt_len, continuation_len, seed)):
        text = tok.decode(row["prompt_ids"], skip_special_tokens=False)
        if tok.encode(text).ids != row["prompt_ids"]:
            raise ValueError(f"held-out window {i} of {model_dir} does not tokenize back to its {prompt_len} ids")
        pairs.append((text, tok.decode(row["continuation_ids"], skip_special_tokens=False)))
    return write_prompt_file(path, pairs)


def ab_argv(args, prompt_file: Optional[str] = None) -> List[str]:
    """ab_serving.py's command line for the demo (prompt_file: its --prompt-file, if any)."""
    argv = ["--cpu", "--model-path", os.path.abspath(args.model_path), "--out-dir", args.out_dir,
            "--port", str(args.port), "--k0", *map(str, args.k0), "--oea-min-batch", str(args.oea_min_batch),
            "--oea-max-batch", str(args.oea_max_batch),
            "--concurrency", *map(str, args.concurrency), "--repeats", str(args.repeats),
            "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
            "--prompts-per-concurrency", str(PROMPTS_PER_CONCURRENCY), "--min-prompts", str(MIN_PROMPTS),
            "--warmup-prompts", str(WARMUP_PROMPTS),
            "--title", f"OEA demo, {LABEL}: {os.path.basename(os.path.normpath(args.model_path))}"
                       + (", DUMMY weights" if args.random_weights else "")]
    if prompt_file:
        argv += ["--prompt-file", prompt_file]
    if args.bench_subprocess:
        argv.append("--bench-subprocess")
    if args.two_servers:
        argv += ["--two-servers", "--cooldown", "2"]
    return argv + ["--", *SERVER_ARGS, *(DUMMY_WEIGHTS if args.random_weights else [])]


def expert_table(records: Sequence[dict], summary: report.Summary, min_batch: int, max_batch: int) -> str:
    """Per (C, OEA arm): distinct experts per layer and decode step before -> after OEA (mean over
    layers) and their ratio, from the server's OEA metrics scraped after each run where OEA applied
    (oea_metrics.run_experts: gauges averaged over the OEA-routed steps of the last decode-log
    interval, 40 steps by default: the run's tail); the median run by ratio. Concurrencies outside
    [min_batch, max_batch] are marked as gated off. Empty when no run recorded OEA metrics."""
    oea_arms = [a for a in summary.arms if a != report.BASELINE]
    rows, seen = [], False
    for conc in summary.concurrencies:
        cells = [str(conc)]
        for arm in oea_arms:
            found = sorted((e["ratio"], e["before"], e["after"]) for r in records
                           if r.get("arm") == arm and r.get("concurrency") == conc and (e := run_experts(r)))
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
    p.add_argument("--model-path", default=TRAINED_MODEL,
                   help="model directory (default: the shipped trained Qwen3-MoE, benchmark/oea/models/qwen3_moe_stdlib)")
    p.add_argument("--random-weights", action="store_true",
                   help="serve the model with --load-format dummy: same architecture, tokenizer and prompts, "
                        "random weights")
    p.add_argument("--prompts", choices=("heldout", "random-ids"), default="heldout",
                   help="heldout: windows of the model's heldout.txt (a train_moe.py checkpoint); "
                        "random-ids: random token ids, any model (default heldout)")
    p.add_argument("--k0", type=int, nargs="+", default=list(DEFAULT_K0), help="one OEA arm per value")
    p.add_argument("--concurrency", type=int, nargs="+", default=list(DEFAULT_CONCURRENCY))
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                   help=f"repeats per (arm, concurrency) (default {DEFAULT_REPEATS}; a ratio needs 3 to be "
                        "resolved)")
    p.add_argument("--oea-min-batch", type=int, default=DEFAULT_MIN_BATCH,
                   help=f"OEA arms: no OEA below this decode batch (default {DEFAULT_MIN_BATCH})")
    p.add_argument("--oea-max-batch", type=int, default=DEFAULT_MAX_BATCH,
                   help=f"OEA arms: no OEA above this decode batch, 0 = no cap (default {DEFAULT_MAX_BATCH})")
    p.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    p.add_argument("--bench-subprocess", action="store_true",
                   help="one bench_serving process per run (slower; see ab_serving.py)")
    p.add_argument("--two-servers", action="store_true",
                   help="one server per arm, one after the other (ab_serving.py --two-servers), instead of one "
                        "server with k0 set live")
    p.add_argument("--no-cost", dest="cost", action="store_false",
                   help="skip the micro-benchmarks of OEA's own cost per decode step (about 20 s)")
    return p


def prepare_prompts(args) -> Optional[str]:
    """The --prompt-file for ab_serving (written into --out-dir), or None for random ids.
    SystemExit naming --prompts when the model has no held-out text."""
    if args.prompts == "random-ids":
        return None
    if not os.path.exists(os.path.join(args.model_path, "heldout.txt")):
        raise SystemExit(f"--prompts heldout: {args.model_path} has no heldout.txt (not a train_moe.py "
                         "checkpoint); use --prompts random-ids for this model")
    path = os.path.join(os.path.abspath(args.out_dir), PROMPT_FILE)
    log(f"writing {prompt_count(args.concurrency)} held-out prompts to {path}")
    return write_heldout_prompts(args.model_path, path, prompt_count(args.concurrency))


def demo_markdown(args, t_start: float) -> str:
    """demo.md's text (the report printed at the end is its first part); runs the cost
    micro-benchmarks unless --no-cost. The wall time counts from t_start to the end of those."""
    records = report.load_jsonl(os.path.join(args.out_dir, "results.jsonl"))
    summary = report.summarize(records)
    experts = expert_table(records, summary, args.oea_min_batch, args.oea_max_batch)
    parts = ["```", header(args), "```", "",
             f"## Arms side by side ({LABEL})", "",
             "Output tok/s (OEA arms: x = paired ratio vs baseline, median over repeats) and median TPOT ms. "
             f"\"not resolved\": the per-repeat ratios spread beyond ±{100 * report.RESOLVED_WITHIN:.0f}% of their "
             f"median (or there are fewer than {report.RESOLVED_MIN_REPEATS} repeats), so this machine's noise "
             "hides the size of the effect there; their min-max and spread are shown instead.", "",
             report.side_by_side_table(summary, report.RESOLVED_WITHIN)]
    if experts:
        parts += [f"## Distinct experts per layer and decode step, router's choice -> after OEA ({LABEL})", "",
                  "From the server's OEA metrics after each run (sglang:oea_active_experts_ratio: the OEA-routed "
                  "decode steps of the server's last decode-log interval, i.e. the run's tail). Baseline: 1.", "",
                  experts]
    if args.cost:
        parts += [cost_section(records, summary, args.model_path, LABEL)]
    if summary.warnings:
        parts += ["Warnings: " + "; ".join(summary.warnings), ""]
    wall = time.time() - t_start
    parts += [f"Wall time: {wall / 60:.1f} min ({wall:.0f} s).", ""]
    return "\n".join(parts)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    args.port = args.port or free_port()
    for key, value in THREAD_ENV.items():
        os.environ.setdefault(key, value)  # inherited by ab_serving's servers and bench driver
    t_start = time.time()
    print(header(args), flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    prompt_file = prepare_prompts(args)

    rc = ab_serving.main(ab_argv(args, prompt_file))
    if not os.path.exists(os.path.join(args.out_dir, "results.jsonl")):
        log(f"no results (ab_serving exit code {rc}); see the logs in {args.out_dir}")
        return rc or 1
    text = demo_markdown(args, t_start)
    wall = time.time() - t_start
    with open(os.path.join(args.out_dir, "results.md")) as f:
        full = f.read()
    with open(os.path.join(args.out_dir, "demo.md"), "w") as f:
        f.write("\n".join([f"# OEA CPU demo ({LABEL})", "", text, full]))
    print("\n" + text)
    log(f"wrote {', '.join(os.path.join(args.out_dir, n) for n in ('results.jsonl', 'results.md', 'results.png', 'demo.md'))}")
    log(f"wall time {wall / 60:.1f} min ({wall:.0f} s); ab_serving exit code {rc}")
    return rc


if __name__ == "__main__":
    with terminate_as_interrupt():  # SIGTERM stops the server and the cost subprocesses, as Ctrl-C does
        sys.exit(main())
