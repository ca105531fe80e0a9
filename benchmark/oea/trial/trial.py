"""The operator's trial of OEA on a server they already run: one command, one report.

Start the server with your own flags (EAGLE / MTP included) plus `--oea-k0 0 --enable-metrics`
(the plugin armed, OEA off), then:

    python benchmark/oea/serving/trial.py --url http://127.0.0.1:30000 --tokenizer /models/GLM-5-NVFP4 \
        --k0 4 5 6 --concurrency 16 32 64 --prompt-file my_prompts.json \
        --quality lm-eval --lm-eval-task gsm8k --budget-minutes 90 --out-dir trial_glm5

1. Preflight, before any load (trial_preflight.py): OEA armed on every scheduler, each rank's
   routing kernel and self-check, the startup envelope, speculative decoding and its draft tokens,
   metrics on; for every concurrency whether OEA's batch gate can open (requests x rows per request
   against the cap, requests against the floor). A trial that cannot mean anything is refused with
   the reason (exit status 2), before any request.
2. Throughput (trial_throughput.py): ab_serving's one-server interleaved A/B on this server, OEA
   off against each k0 set live, at every concurrency where the gate opens, repeated until each
   cell's paired ratio is resolved to +-5% or --budget-minutes is spent. Per arm: output tok/s,
   TPOT, T per routed step, the share of steps OEA applied and the mean kept router mass (both by
   the k0 label), accept length.
3. Under speculative decoding, accept length per request, OEA against off paired by prompt
   (trial_quality.accept_probe): non-inferior when the lower 95% bound is above -5%.
4. Quality (trial_quality.py), the same server: lm-evaluation-harness (--quality lm-eval) or
   quality_ab's prompts (--quality quality-ab), per arm, paired per sample with a bootstrap interval.
5. The verdict (trial_report.py): results.md, results.json and results.png in --out-dir, ending
   with the k0 to leave on, or "keep OEA off".

It always restores: on success, error, Ctrl-C or SIGTERM it puts back the OEA settings it found and
stops every process it started (bench and lm-eval clients). With --apply it sets the recommended
k0 instead, after a complete trial. Exit status: 0 done, 1 failed, 2 refused (or a setting not
confirmed by the server), 130 interrupted.
"""

import argparse
import os
import shlex
import sys
import time
from typing import Dict, Optional, Sequence, Tuple

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmark/oea
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)  # its folders import as packages

from common import report  # noqa: E402
from serving import trial_quality as tq  # noqa: E402
from serving.live_settings import LiveSettingsError, apply_settings, confirm_settings  # noqa: E402
from serving.quality_inputs import InputError, load_prompts  # noqa: E402
from serving.servers import http_json, log, terminate_as_interrupt  # noqa: E402
from serving.trial_preflight import Preflight, TrialRefused, kernel_lines, preflight, read_states  # noqa: E402
from serving.trial_prompts import prompt_texts, trial_prompt_file  # noqa: E402
from serving.trial_report import build_cells, recommend, write_outputs  # noqa: E402
from serving.trial_throughput import arm_rows, prompts_needed, run_throughput, sweep_args, use_prompt_file  # noqa: E402

DEFAULT_CONCURRENCY = (16, 32, 64)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the server, started with --oea-k0 0 --enable-metrics")
    p.add_argument("--tokenizer", help="the served model's tokenizer directory or id (default: the server's "
                                       "tokenizer_path, when it is a directory on this machine)")
    p.add_argument("--k0", type=int, nargs="+", default=[4], help="one OEA arm per value, each 1..top-k-1 (default 4)")
    p.add_argument("--concurrency", type=int, nargs="+", default=list(DEFAULT_CONCURRENCY),
                   help="requests in flight (default 16 32 64); where OEA's gate cannot open the cell is 'gate closed'")
    p.add_argument("--prompt-file", help="your prompts, ShareGPT format (see prompt_files.py); default: labelled "
                                         "real-text windows (trial_prompts.py), not your traffic")
    p.add_argument("--input-len", type=int, default=256,
                   help="prompt tokens per request (shorter prompts are left out)")
    p.add_argument("--output-len", type=int, default=256, help="output tokens per request (EOS ignored)")
    p.add_argument("--prompts-per-concurrency", type=int, default=4,
                   help="prompts per run = max(this x C, --min-prompts)")
    p.add_argument("--min-prompts", type=int, default=32)
    p.add_argument("--warmup-prompts", type=int, default=32, help="the start-up warm-up's prompts (0 = none)")
    p.add_argument("--budget-minutes", type=float, default=60.0,
                   help="time for the throughput repeats (default 60); quality and accept length come on top")
    p.add_argument("--max-repeats", type=int, default=10, help="blocks per concurrency at most (default 10)")
    q = p.add_argument_group("quality")
    q.add_argument("--quality", choices=("lm-eval", "quality-ab", "none"), default="none")
    q.add_argument("--quality-concurrency", type=int, help="requests in flight in the quality arms (default: the "
                                                           "smallest concurrency where the gate opens)")
    q.add_argument("--quality-margin", type=float, default=0.02,
                   help="the largest loss, OEA - off in the metric's units, the bound allows (default 0.02)")
    q.add_argument("--lm-eval-task", help="lm-eval task name(s), comma-separated")
    q.add_argument("--lm-eval-include", help="a folder of your own task YAMLs (lm-eval's --include_path)")
    q.add_argument("--lm-eval-limit", type=int, help="documents per task (lm-eval's --limit)")
    q.add_argument("--lm-eval-metric", help="the per-sample metric compared (default: the task's first)")
    q.add_argument("--lm-eval-filter", help="the filter whose samples are compared (default: the first logged)")
    q.add_argument("--lm-eval-args", help="more lm_eval arguments, one string")
    q.add_argument("--quality-prompts", help="quality_ab JSONL prompts with answers or reference_ids")
    q.add_argument("--quality-max-tokens", type=int, default=256, help="quality-ab: max output tokens")
    o = p.add_argument_group("operation")
    o.add_argument("--admin-api-key", help="the server's --admin-api-key, sent with every setting")
    o.add_argument("--apply", action="store_true", help="after a complete trial, set the recommended k0 live "
                                                        "(needs --quality lm-eval or quality-ab)")
    o.add_argument("--out-dir", required=True)
    o.add_argument("--label", help="a line on every report, e.g. the machine and model")
    o.add_argument("--run-timeout", type=float, default=3600.0, help="seconds for one bench or lm-eval run")
    o.add_argument("--bench-subprocess", action="store_true", help="a fresh bench_serving process per run")
    return p


def check_args(args) -> None:
    """TrialRefused for flags that cannot work together, before anything is sent."""
    if args.apply and args.quality == "none":
        raise TrialRefused("--apply leaves OEA on: it needs a quality comparison (--quality lm-eval or quality-ab)")
    if args.quality == "lm-eval":
        missing = tq.lm_eval_missing()
        if missing:
            raise TrialRefused(missing)
        if not args.lm_eval_task:
            raise TrialRefused("--quality lm-eval needs --lm-eval-task (e.g. gsm8k, or a task of --lm-eval-include)")
    if args.quality == "quality-ab":
        try:
            items = load_prompts(args.quality_prompts or "")
        except InputError as e:
            raise TrialRefused(f"--quality quality-ab needs --quality-prompts FILE: {e}") from None
        if not any(it.answer is not None or it.reference is not None for it in items):
            raise TrialRefused(f"--quality-prompts {args.quality_prompts}: no prompt has an answer or reference_ids, "
                               "so there is no quality to compare")
    for flag in ("budget_minutes", "max_repeats", "input_len", "output_len"):
        if getattr(args, flag) <= 0:
            raise TrialRefused(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")


def resolve_tokenizer(args, pre: Preflight) -> None:
    """--tokenizer, else the server's tokenizer_path when it is a directory here; TrialRefused otherwise."""
    if args.tokenizer:
        return
    path = pre.info.get("tokenizer_path") or pre.info.get("model_path")
    if not (path and os.path.isdir(path)):
        raise TrialRefused(f"give --tokenizer (the served model's tokenizer directory or id); the server's "
                           f"tokenizer_path {path!r} is not a directory on this machine")
    args.tokenizer = path


def prepare(args) -> Tuple[Preflight, argparse.Namespace]:
    """Preflight and the prompt file, before any load; TrialRefused when the trial cannot mean anything."""
    check_args(args)
    url = args.url.rstrip("/")
    pre = preflight(url, args.tokenizer, args.k0, args.concurrency)
    resolve_tokenizer(args, pre)
    log("preflight:\n  " + "\n  ".join(pre.lines + [f"WARNING: {w}" for w in pre.warnings]
                                       + [f"C={g.concurrency}: gate {'open' if g.open else 'CLOSED'} ({g.why})"
                                          for g in pre.gates]))
    sargs = sweep_args(args, url, pre.open_concurrencies)
    try:
        path, label = trial_prompt_file(args.prompt_file, args.tokenizer, args.input_len, prompts_needed(sargs),
                                        args.out_dir)
        use_prompt_file(sargs, path)
    except SystemExit as e:
        raise TrialRefused(str(e)) from None
    sargs.prompts_label = label
    return pre, sargs


def start_lm_eval(args) -> Optional[tq.LmEvalClient]:
    """--quality lm-eval: the lm-eval process, started now and its task checked (TrialRefused,
    the process stopped, when lm-eval does not know it); None for the other quality steps."""
    if args.quality != "lm-eval":
        return None
    client = tq.LmEvalClient(os.path.join(args.out_dir, "quality"), args.run_timeout)
    problem = client.check_task(args.lm_eval_task, args.lm_eval_include)
    if problem:
        client.close()
        raise TrialRefused(problem)
    return client


def measure(args, pre: Preflight, sargs, state: Dict) -> None:
    """Throughput, accept length (speculative decoding only), quality; fills `state` as it goes."""
    deadline = time.time() + 60 * args.budget_minutes
    state["records"] = run_throughput(pre.url, sargs, pre.open_concurrencies, deadline, args.max_repeats)
    if pre.speculative:
        prompts = prompt_texts(sargs.prompt_file, max(2 * max(pre.open_concurrencies), 32))
        state["accept"] = tq.accept_probe(pre.url, args.k0, pre.open_concurrencies, prompts, args.output_len,
                                          args.admin_api_key, args.run_timeout)
    conc = args.quality_concurrency or min(pre.open_concurrencies)
    if args.quality == "lm-eval":
        state["quality"] = tq.run_lm_eval(args, pre.url, args.k0, conc, state["lm_eval"])
    elif args.quality == "quality-ab":
        out = os.path.join(args.out_dir, "quality")
        os.makedirs(out, exist_ok=True)
        state["quality"] = tq.run_quality_ab(args, pre.url, args.k0, conc, out)


def finish_settings(args, pre: Preflight, rec: Dict, complete: bool) -> Tuple[Dict[str, int], str]:
    """Put back the k0 found (or, with --apply after a complete trial, set the recommended one) and
    confirm it in force; (the settings set, a note). A failure is noted, never raised: it must not
    hide the trial's own."""
    settings = {"oea_k0": pre.original.get("oea_k0", 0)}
    note = "the settings found at the start"
    if args.apply and complete and rec["k0"]:
        settings, note = {"oea_k0": rec["k0"]}, "--apply: the recommended k0"
    try:
        apply_settings(pre.url, settings, args.admin_api_key)
        # A change takes effect at the next forward pass: one 1-token request runs one, so that the
        # settings are confirmed in force, not only pending, before the trial ends.
        http_json(pre.url + "/generate", {"text": "0", "sampling_params": {"max_new_tokens": 1}}, 120.0)
        confirm_settings(pre.url, settings)
        log(f"set {settings} ({note}); in force on every scheduler")
    except (RuntimeError, OSError) as e:
        note = f"FAILED to set {settings} ({note}): {e}; set it by hand"
        log(note)
    return settings, note


def result_of(args, pre: Preflight, sargs, state: Dict, status: str, started: str) -> Dict:
    """results.json's content from what was measured (also after an error or an interrupt)."""
    records = state.get("records") or (report.load_jsonl(os.path.join(args.out_dir, "results.jsonl"))
                                       if os.path.exists(os.path.join(args.out_dir, "results.jsonl")) else [])
    state["records"] = records
    rows = arm_rows(records)
    cells = build_cells(pre, args.k0, report.summarize(records), rows, state.get("quality"), state.get("accept"))
    if status != "done":  # an incomplete trial recommends nothing
        rec = {"k0": 0, "reason": f"the trial did not complete ({status})", "problems": {}}
    else:
        rec = recommend(args.k0, cells, state.get("quality"), bool(pre.speculative))
    return {"url": pre.url, "model": pre.info.get("served_model_name") or pre.info.get("model_path"),
            "label": args.label, "started": started, "status": status, "command": shlex.join(sys.argv),
            "prompts": getattr(sargs, "prompts_label", None), "k0": args.k0,
            "preflight": {"lines": pre.lines, "warnings": pre.warnings, "original": pre.original,
                          "speculative": pre.speculative, "rows_per_request": pre.rows_per_request,
                          "top_k": pre.top_k, "gates": [vars(g) for g in pre.gates]},
            "arms": list(rows.values()), "cells": cells, "quality": state.get("quality"),
            "accept_length_probe": state.get("accept"), "recommendation": rec, "kernel_after": kernel_after(pre.url)}


def kernel_after(url: str) -> Optional[list]:
    """Each scheduler's routing kernel once the trial has decoded (on the CPU and under --oea-kernel
    auto it is chosen at the first decode step); None when /server_info does not answer."""
    try:
        return kernel_lines(read_states(url)[1])[0]
    except TrialRefused:
        return None


def run_trial(args) -> int:
    os.makedirs(args.out_dir, exist_ok=True)
    try:
        pre, sargs = prepare(args)
        lm_eval = start_lm_eval(args)
    except TrialRefused as e:
        log(f"refused: {e}")
        print(f"trial.py: refused: {e}", file=sys.stderr)
        return 2
    started, state = time.strftime("%Y-%m-%d %H:%M:%S"), {"lm_eval": lm_eval}
    status, rc = "failed: unexpected error (traceback above)", 1
    try:
        measure(args, pre, sargs, state)
        status, rc = "done", 0
    except KeyboardInterrupt:
        status, rc = "interrupted", 130
    except LiveSettingsError as e:
        status, rc = f"stopped: {e}", 2
    except (RuntimeError, OSError) as e:
        status, rc = f"failed: {e}", 1
    finally:
        if lm_eval is not None:
            lm_eval.close()
        result = result_of(args, pre, sargs, state, status, started)
        result["restored"], result["restore_note"] = finish_settings(args, pre, result["recommendation"],
                                                                    status == "done")
        result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        write_outputs(args.out_dir, result, state["records"])
    return rc


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with terminate_as_interrupt():
            return run_trial(args)
    except KeyboardInterrupt:  # before any load (the preflight): nothing to put back
        log("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
