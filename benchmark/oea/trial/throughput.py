"""The trial's throughput A/B (trial.py): ab_serving's one-server sweep on the operator's server
(serving/one_server.py's LiveSweep: switches confirmed on every scheduler, warm-ups after each
switch, one bench client), repeated until every cell is resolved or the budget is spent.

Arms: OEA off (k0 0, the baseline) and each --k0, set live. Only the concurrencies where OEA's gate
can open are run (preflight.py). Per concurrency, blocks of one run per arm follow each other,
the arm order reversed every other block (one_server.block_order), until each OEA arm's paired
throughput ratio is resolved (common/report.resolved: at least 3 repeats, min and max within +-5%
of the median), --max-repeats blocks ran, or the concurrency's share of the budget is spent (the
time throughput may still use, budget.Budget.throughput_left, divided by the concurrencies left; a
block starts only when one like the last still fits). At least one block runs at every open
concurrency. Every run's throughput feeds the budget's speed (the start-up warm-up's first).

Per (concurrency, arm), from results.jsonl: output tok/s and median TPOT (medians over repeats),
T before -> after OEA per routed step (the gauges after each run that applied OEA at its own k0;
oea_metrics.run_experts), the share of decode steps OEA applied (pooled over the runs, counting
only the steps labelled with the arm's k0), the mean kept router mass (pooled over the runs, same
attribution; oea_metrics.kept_mass_in_runs), and under speculative decoding SGLang's accept length
(oea_metrics.accept_length_in_run).
"""

import os
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from common import report
from serving import ab_serving
from serving.bench_client import BenchClient
from serving.live_settings import arm_settings
from common.oea_metrics import accept_length_in_run, kept_mass_in_runs, run_experts
from serving.one_server import LiveSweep, block_order
from serving.prompt_files import check_prompt_file, num_prompts_for, switch_warmup_prompts
from serving.servers import log
from serving.sweep import Arm
from trial.budget import Budget, share_of

MIN_REPEATS = report.RESOLVED_MIN_REPEATS
MAX_FAILED_IN_A_ROW = 3  # bench runs failing one after the other: the server is not serving; stop


def sweep_args(args, url: str, concurrencies: Sequence[int]):
    """ab_serving's namespace for the sweep: --url mode, the trial's workload, no prompt file yet."""
    argv = ["--url", url, "--tokenizer", args.tokenizer, "--k0", *map(str, args.k0),
            "--concurrency", *map(str, concurrencies), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--prompts-per-concurrency", str(args.prompts_per_concurrency),
            "--min-prompts", str(args.min_prompts), "--warmup-prompts", str(args.warmup_prompts),
            "--run-timeout", str(args.run_timeout), "--out-dir", args.out_dir]
    argv += ["--admin-api-key", args.admin_api_key] if args.admin_api_key else []
    argv += ["--bench-subprocess"] if args.bench_subprocess else []
    sargs = ab_serving.parse_args(argv, argv)
    ab_serving.apply_defaults(sargs)
    sargs.repeats = args.max_repeats  # the most a concurrency may run (the progress lines count against it)
    return sargs


def prompts_needed(sargs) -> int:
    """Prompts the largest run or warm-up of the sweep sends: what the prompt file must hold."""
    return max([num_prompts_for(c, sargs) for c in sargs.concurrency] + [sargs.warmup_prompts]
               + [switch_warmup_prompts(c, sargs) for c in sargs.concurrency])


def use_prompt_file(sargs, path: str) -> None:
    """Point the sweep at the prompt file and label its records with its name and hash (checked
    again by prompt_files.check_prompt_file: SystemExit naming --prompt-file if it cannot serve)."""
    sargs.prompt_file = path
    sargs.prompts = check_prompt_file(sargs)


def trial_arms(k0s: Sequence[int]) -> List[Arm]:
    """OEA off (the baseline, k0 0), then one arm per k0, each set live."""
    return ([Arm(report.BASELINE, None, live=arm_settings(0))]
            + [Arm(report.arm_name(k0), k0, live=arm_settings(k0)) for k0 in k0s])


def run_throughput(url: str, sargs, concurrencies: Sequence[int], budget: Budget, max_repeats: int) -> List[dict]:
    """Every block at every open concurrency, in order; returns the records of results.jsonl.
    LiveSettingsError when the server does not take or confirm a setting; RuntimeError when bench
    runs keep failing."""
    jsonl = os.path.join(sargs.out_dir, "results.jsonl")
    ab_serving.set_aside(jsonl)
    arms = trial_arms(sargs.k0)
    client = BenchClient(sargs, "trial")
    try:
        sweep = LiveSweep(arms, url, sargs, client, None, jsonl)
        sweep.start()
        warm = os.path.join(sweep.runs_dir, f"{arms[0].name}_warmup.jsonl")
        for r in report.load_jsonl(warm) if os.path.exists(warm) else []:
            budget.speed.add(int(r.get("max_concurrency") or 0), r.get("output_throughput"), "the start-up warm-up")
        block, feed = 0, speed_feeder(budget, jsonl)
        for i, conc in enumerate(concurrencies):
            budget.announce()
            share = share_of(budget.throughput_left, len(concurrencies) - i, budget.clock)
            block, reps, stopped = run_concurrency(sweep, arms, conc, block, share, max_repeats, jsonl, feed,
                                                   budget.clock)
            if stopped == "budget":
                budget.cut(f"throughput at C={conc}: {reps} of up to {max_repeats} blocks, not resolved")
    finally:
        client.close()
    return report.load_jsonl(jsonl) if os.path.exists(jsonl) else []


def speed_feeder(budget: Budget, jsonl: str) -> Callable[[], None]:
    """A function that feeds each new run's throughput into the budget's speed, then prints the plan
    once the speed is known."""
    seen = [0]

    def feed() -> None:
        records = report.load_jsonl(jsonl) if os.path.exists(jsonl) else []
        for r in records[seen[0]:]:
            if not r.get("error"):
                budget.speed.add(int(r["concurrency"]), r.get("output_throughput"), "the first throughput run")
        seen[0] = len(records)
        budget.announce()
    return feed


def run_concurrency(sweep: LiveSweep, arms: Sequence[Arm], conc: int, block: int, time_left: Callable[[], float],
                    max_repeats: int, jsonl: str, after_block: Callable[[], None] = lambda: None,
                    clock: Callable[[], float] = time.time) -> Tuple[int, int, str]:
    """Blocks at one concurrency until resolved, max_repeats, or the next block, taken to last as
    long as the last, would not fit time_left() (see the module doc); after_block() runs after each.
    Returns (the next block number, the blocks run, why it stopped: "resolved", "max_repeats" or
    "budget")."""
    rep, failed = 0, 0
    while rep < max_repeats:
        t0 = clock()
        for arm in block_order(arms, block):
            ok = sweep.measure(arm, conc, rep, block, f"[C={conc} block {rep + 1}]")
            failed = 0 if ok else failed + 1
            if failed >= MAX_FAILED_IN_A_ROW:
                raise RuntimeError(f"{failed} bench runs in a row failed at C={conc}; see {sweep.runs_dir}")
        block, rep = block + 1, rep + 1
        after_block()
        if rep >= MIN_REPEATS and resolved_at(jsonl, conc):
            log(f"C={conc}: every ratio resolved after {rep} repeats")
            return block, rep, "resolved"
        if rep < max_repeats and clock() - t0 > time_left():
            log(f"C={conc}: this concurrency's share of --budget-minutes is spent after {rep} repeat(s)")
            return block, rep, "budget"
    return block, rep, "max_repeats"


def resolved_at(jsonl: str, conc: int) -> bool:
    """Whether every OEA arm's paired ratio at conc is resolved (common/report.resolved)."""
    summary = report.summarize(report.load_jsonl(jsonl))
    ratios = [r for (c, arm), r in summary.ratios.items() if c == conc]
    oea_arms = [a for a in summary.arms if a != report.BASELINE]
    return len(ratios) == len(oea_arms) and all(report.resolved(r) for r in ratios)


def median(values: Sequence[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def arm_rows(records: Sequence[dict]) -> Dict[tuple, Dict]:
    """{(concurrency, arm): its figures} from the sweep's records (see the module doc)."""
    rows: Dict[tuple, Dict] = {}
    summary = report.summarize(records)
    for (conc, arm), stats in summary.stats.items():
        runs = [r for r in records if r["arm"] == arm and r["concurrency"] == conc and not r.get("error")]
        experts = [e for e in (run_experts(r) for r in runs) if e]
        steps = [r["oea_steps"] for r in runs if r.get("oea_steps")]
        applied, decode = sum(s["applied_steps"] for s in steps), sum(s["decode_steps"] for s in steps)
        tput, tpot = stats.get("output_throughput"), stats.get("median_tpot_ms")
        rows[(conc, arm)] = {
            "concurrency": conc, "arm": arm, "k0": (runs[0].get("k0") or 0) if runs else None, "repeats": len(runs),
            "output_throughput": tput.median if tput else None, "median_tpot_ms": tpot.median if tpot else None,
            "t_before": median([e["before"] for e in experts]), "t_after": median([e["after"] for e in experts]),
            "applied_share": applied / decode if steps and decode else None,
            "applied_steps": applied if steps else None, "decode_steps": decode if steps else None,
            "kept_router_mass": kept_mass_in_runs(runs),
            "accept_length": median([accept_length_in_run(r) for r in runs])}
    return rows
