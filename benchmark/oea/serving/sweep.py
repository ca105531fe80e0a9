"""The A/B serving benchmark's sweep: every arm, one server at a time, every (repeat, concurrency)
run of each, one results.jsonl line per run, and the report from those lines.

An arm's server is started only after the previous one has stopped and its port is free; its
bench client starts alongside (its import overlaps the server's start-up). A record holds the run's
settings, bench_serving's metrics and the OEA samples of the server's /metrics around the run.
"""

import json
import os
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from common import report
from serving.bench_client import BenchClient
from common.oea_metrics import counter_deltas, scrape_oea_metrics, steps_share
from serving.prompt_files import num_prompts_for
from common.http import http_get, redact
from serving.servers import Server, child_env, launcher_command, log, log_tail, port_in_use, wait_ready

# bench_serving result keys kept in results.jsonl (the rest, e.g. server_info, is left out).
_DROP_KEYS = ("server_info", "input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")


@dataclass
class Arm:
    """One side of the comparison: the baseline (k0 None) or an OEA server."""

    name: str
    k0: Optional[int]
    url: Optional[str] = None  # URL mode
    extra_args: Sequence[str] = ()  # --oea-* flags (two-server launch mode)
    live: Optional[Dict[str, int]] = None  # one-server mode: the settings it POSTs (live_settings.arm_settings)


def run_arms(arms: Sequence[Arm], args, server_args: Sequence[str], jsonl_path: str) -> int:
    """Measure every arm, one after the other: a URL arm as it is, a launch arm on its own server
    (stopped, port freed, --cooldown waited before the next). Returns the number of failed runs."""
    total = len(arms) * len(args.concurrency) * args.repeats
    counter = [0]
    failures = 0
    for i, arm in enumerate(arms):
        if arm.url:
            wait_ready(arm.url, args.ready_timeout)
            failures += measure_arm(arm, arm.url, args, jsonl_path, None, counter, total)
            continue
        failures += launch_and_measure(arm, args, server_args, jsonl_path, counter, total)
        if i + 1 < len(arms):
            time.sleep(args.cooldown)
    return failures


def launch_and_measure(arm: Arm, args, server_args: Sequence[str], jsonl_path: str, counter: List[int],
                       total: int) -> int:
    """Start arm's server on --host/--port, measure it, stop its process group and wait (60 s at
    most) for the port to be free. Returns the number of failed runs."""
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
        failures = measure_arm(arm, base_url, args, jsonl_path, server, counter, total, client)
    finally:
        client.close()
        server.stop()
    deadline = time.time() + 60
    while port_in_use(args.host, args.port) and time.time() < deadline:
        time.sleep(1.0)
    return failures


def measure_arm(arm: Arm, base_url: str, args, jsonl_path: str, server: Optional[Server],
                counter: List[int], total_runs: int, client: Optional[BenchClient] = None) -> int:
    """Warm-up, then every (repeat, concurrency) run of one arm; appends records to jsonl_path.

    Runs bench_serving through `client` (a new one, closed at the end, when None). Returns the
    number of failed runs; stops early when the arm's server died.
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
    save_server_info(arm, base_url, args.out_dir)
    if args.warmup_prompts > 0:
        warm_up(arm, base_url, args, client, runs_dir)
    failures = 0
    for rep in range(args.repeats):
        for conc in args.concurrency:
            counter[0] += 1
            stem = os.path.join(runs_dir, f"{arm.name}_c{conc}_r{rep}")
            if measure_run(arm, base_url, args, client, server, conc, rep, stem, jsonl_path,
                           f"[run {counter[0]}/{total_runs}]"):
                continue
            failures += 1
            if server is not None and not server.alive():
                log(f"{arm.name}: server died; skipping its remaining runs")
                return failures
    return failures


def save_server_info(arm: Arm, base_url: str, out_dir: str) -> None:
    """The server's /server_info as server_info_<arm>.json, keys redacted (SGLang 0.5.23 returns
    api_key, admin_api_key and the launch command in plain text); nothing when it does not answer."""
    info = http_get(base_url + "/server_info")
    if info is not None:
        try:
            text = json.dumps(redact(json.loads(info)), indent=1)
        except json.JSONDecodeError:
            text = redact(info)
        with open(os.path.join(out_dir, f"server_info_{arm.name}.json"), "w") as f:
            f.write(text)


def warm_up(arm: Arm, base_url: str, args, client: BenchClient, runs_dir: str) -> None:
    """--warmup-prompts prompts at min(that, largest C), seed --seed + 10000; not recorded."""
    wc = min(args.warmup_prompts, max(args.concurrency))
    run_warm_up(client, base_url, args, wc, args.warmup_prompts, args.warmup_output_len or args.output_len,
                os.path.join(runs_dir, f"{arm.name}_warmup"), arm.name)


def run_warm_up(client: BenchClient, base_url: str, args, conc: int, prompts: int, output_len: int, stem: str,
                label: str) -> None:
    """One unrecorded bench_serving run: `prompts` prompts at concurrency conc, output_len tokens each,
    seed --seed + 10000, its output in stem.jsonl / stem.log."""
    t0 = time.time()
    client.run(base_url, conc, prompts, args.seed + 10_000, output_len, stem + ".jsonl", stem + ".log")
    log(f"{label}: warm-up ({prompts} prompts x {output_len} tokens at C={conc}) done in {time.time() - t0:.0f}s")


def new_record(arm: Arm, base_url: str, args, conc: int, rep: int) -> dict:
    """The settings part of one run's record: what must match for two runs to be compared."""
    return {"arm": arm.name, "k0": arm.k0, "concurrency": conc, "repeat": rep, "seed": args.seed + rep,
            "num_prompts": num_prompts_for(conc, args), "input_len": args.input_len, "output_len": args.output_len,
            "prompts": args.prompts,
            "oea_min_batch": args.oea_min_batch if arm.k0 is not None else None,
            "oea_max_batch": args.oea_max_batch if arm.k0 is not None else None,
            "url": base_url, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S")}


def measure_run(arm: Arm, base_url: str, args, client: BenchClient, server: Optional[Server], conc: int, rep: int,
                stem: str, jsonl_path: str, progress: str, extra: Optional[dict] = None) -> bool:
    """One bench_serving run at concurrency conc, repeat rep (seed --seed + rep), its output in
    stem.jsonl / stem.log; appends its record (an `error` one on failure), with `extra`'s fields
    added. True when it measured. The OEA counters are scraped right before and after the run:
    oea_metrics_delta holds every counter's growth over the run, and oea_steps the share of decode
    steps OEA applied, counting only the steps labelled with the arm's own k0 (an earlier arm's
    steps that reach /metrics during this run are not this run's; oea_metrics)."""
    record = {**new_record(arm, base_url, args, conc, rep), **(extra or {})}
    before = scrape_oea_metrics(base_url)
    t0 = time.time()
    try:
        if server is not None and not server.alive():
            raise RuntimeError("server process died" + log_tail(server.log_path, 20))
        result = client.run(base_url, conc, record["num_prompts"], record["seed"], args.output_len,
                            stem + ".jsonl", stem + ".log")
    except RuntimeError as e:
        record["error"] = str(e).splitlines()[0]
        record["wall_s"] = round(time.time() - t0, 2)
        _append(jsonl_path, record)
        log(f"{arm.name:>10}  C={conc:<5} rep {rep + 1}/{args.repeats}  FAILED: {e}")
        return False
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
            record["oea_steps"] = steps_share(before, after, arm.live["oea_k0"] if arm.live else arm.k0)
            warn_if_gated_off(arm, conc, record["oea_steps"])
    _append(jsonl_path, record)
    log(f"{arm.name:>10}  C={conc:<5} rep {rep + 1}/{args.repeats}  seed {record['seed']}  "
        f"{result.get('output_throughput', float('nan')):9.1f} tok/s  "
        f"TPOT {result.get('median_tpot_ms') or float('nan'):8.2f} ms  "
        f"({record['wall_s']:.0f}s)  {progress}")
    return True


def warn_if_gated_off(arm: Arm, conc: int, steps: Optional[dict]) -> None:
    """Say so when an OEA run applied OEA in none of its decode steps: its ratio then reads about
    1.0x for a reason that is not OEA's effect (most often the batch gate)."""
    if arm.k0 and steps and steps["decode_steps"] and not steps["applied_steps"]:
        log(f"WARNING: {arm.name} at C={conc}: OEA applied in none of the run's {steps['decode_steps']:.0f} decode "
            f"steps ({', '.join(f'{r} {n:.0f}' for r, n in steps['skipped_steps'].items() if n)}). "
            "--oea-max-batch counts token rows: requests x draft tokens under speculative decoding")


def _append(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")


def write_report(jsonl_path: str, out_dir: str, title: Optional[str] = None) -> report.Summary:
    """results.md and results.png from a JSONL; prints the table."""
    records = report.load_jsonl(jsonl_path)
    summary = report.summarize(records)
    table = report.markdown_table(summary, title)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(table)
    png = os.path.join(out_dir, "results.png")
    if summary.concurrencies:
        report.plot(summary, png, title)
    print()
    print(table)
    log(f"wrote {os.path.join(out_dir, 'results.md')} and {png}")
    return summary
