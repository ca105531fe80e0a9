r"""The operator's trial of OEA on a server they already run: one command, one report.

Start the server with your own flags (EAGLE / MTP included) plus `--oea-k0 0 --enable-metrics`
(the plugin armed, OEA off), then:

    python benchmark/oea/trial/trial.py --url http://127.0.0.1:30000 --tokenizer /models/GLM-5-NVFP4 \
        --k0 4 5 6 --concurrency 16 32 64 --prompt-file my_prompts.json \
        --quality lm-eval --lm-eval-task gsm8k --budget-minutes 90 --out-dir trial_glm5

1. Preflight, before any load (preflight.py): OEA armed on every scheduler, each rank's
   routing kernel and self-check, the startup envelope, speculative decoding and its draft tokens,
   metrics on, SGLang's limits (running requests per replica or attention-DP group, decode CUDA
   graphs, DP replicas, attention-DP groups); for every concurrency whether OEA's batch gate can open
   on the batch OEA routes (a replica's; under DP attention every group's requests gathered into one
   batch, which the gate counts). A trial that
   cannot mean anything is refused with the reason (exit status 2), before any request. Then the
   plan (budget.py): --budget-minutes covers the whole trial; an estimate per phase (with times
   once the first run has measured the speed) and what will be cut to fit.
2. Throughput (throughput.py): ab_serving's one-server interleaved A/B on this server, OEA
   off against each k0 set live, at every concurrency where the gate opens, repeated until each
   cell's paired ratio is resolved to +-5% or its share of the budget is spent. Per arm: output
   tok/s, TPOT, T per routed step, the share of steps OEA applied and the mean kept router mass
   (both by the k0 label), accept length (context only).
3. Under speculative decoding, accept length per request, OEA against off paired by prompt
   (quality.accept_probe): non-inferior when the lower 95% bound is above -5%; sized for that
   bound (round after round until the interval is clear of it, --accept-prompts as the floor).
4. Quality (quality.py), the same server: lm-evaluation-harness (--quality lm-eval) or
   quality_ab's prompts (--quality quality-ab), per arm, paired per sample with a bootstrap
   interval, at the smallest concurrency at which the gate opens and at the largest swept one with
   an open gate (--quality-concurrency replaces them).
5. The verdict (verdict.py): results.md, results.json and results.png in --out-dir, ending
   with the k0 to leave on and the launch flags to keep (--oea-k0 K --oea-min-batch M
   --oea-max-batch R, the cap narrowed where a k0 is slower only at high concurrency), or "keep
   OEA off" with how to take it off the routing path.

Keys: a server started with --api-key and/or --admin-api-key takes them from OEA_API_KEY and
OEA_ADMIN_API_KEY (or --api-key / --admin-api-key, which `ps` shows). Each request carries the key
its endpoint needs (common/http.py); bench_serving and lm-eval get the API key as OPENAI_API_KEY.
A missing or wrong key is named before any load. No key is written to any file the trial leaves.

It always restores: on success, error, Ctrl-C or SIGTERM, first thing in its clean-up, with
SIGINT and SIGTERM held off meanwhile, it puts back the OEA settings it found (retried with
backoff, confirmed in force), then stops every process it started (bench and lm-eval clients)
and writes the report, which says who put the settings back. A guard process (guard.py), started
before the first change, puts them back if the trial is killed without doing so (SIGKILL, OOM).
With --apply it then sets the recommended k0, after a complete trial. Exit status: 0 done, 1
failed, 2 refused, the settings not put back (the report says what the server is left at) or a
setting not confirmed by the server, 130 interrupted.
"""

import argparse
import json
import os
import shlex
import sys
import time
import traceback
from typing import Dict, Optional, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
TRIAL_SCRIPT = os.path.abspath(__file__)
BENCH = os.path.dirname(HERE)  # benchmark/oea
# Run as a script, this folder comes first on sys.path, where `trial` would be this file rather than
# the package of the trial's modules: the folders of benchmark/oea import as packages instead.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

from common import report  # noqa: E402
from common.http import Auth, HTTPStatusError, http_json, redact_argv, use_auth  # noqa: E402
from trial import quality as tq  # noqa: E402
from trial.guard import GuardClient  # noqa: E402
from serving.live_settings import LiveSettingsError, put_back  # noqa: E402
from serving.quality_inputs import InputError, load_prompts  # noqa: E402
from serving.servers import child_env, client_env, log, signals_held, terminate_as_interrupt  # noqa: E402
from trial.budget import Budget, work_of  # noqa: E402
from trial.preflight import Preflight, TrialRefused, kernel_lines, preflight, read_states  # noqa: E402
from trial.prompts import prompt_texts, trial_prompt_file  # noqa: E402
from trial.verdict import build_cells, recommend, write_outputs  # noqa: E402
from trial.throughput import arm_rows, prompts_needed, run_throughput, sweep_args, use_prompt_file  # noqa: E402

DEFAULT_CONCURRENCY = (16, 32, 64)
API_KEY_VAR, ADMIN_KEY_VAR = "OEA_API_KEY", "OEA_ADMIN_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the server, started with --oea-k0 0 --enable-metrics")
    p.add_argument("--tokenizer", help="the served model's tokenizer directory or id (default: the server's "
                                       "tokenizer_path, when it is a directory on this machine)")
    p.add_argument("--k0", type=int, nargs="+", default=[4], help="one OEA arm per value, each 1..top-k-1 (default 4)")
    p.add_argument("--concurrency", type=int, nargs="+", default=list(DEFAULT_CONCURRENCY),
                   help="requests in flight (default 16 32 64); where OEA's gate cannot open the cell is 'gate closed'")
    p.add_argument("--prompt-file", help="your prompts, ShareGPT format (see prompt_files.py); default: labelled "
                                         "real-text windows (prompts.py), not your traffic")
    p.add_argument("--input-len", type=int, default=256,
                   help="prompt tokens per request (shorter prompts are left out)")
    p.add_argument("--output-len", type=int, default=256, help="output tokens per request (EOS ignored)")
    p.add_argument("--prompts-per-concurrency", type=int, default=4,
                   help="prompts per run = max(this x C, --min-prompts)")
    p.add_argument("--min-prompts", type=int, default=32)
    p.add_argument("--warmup-prompts", type=int, default=32, help="the start-up warm-up's prompts (0 = none)")
    p.add_argument("--budget-minutes", type=float, default=60.0,
                   help="time for the whole trial: throughput, accept length and quality (default 60); the "
                        "preflight prints an estimate per phase and what is cut to fit")
    p.add_argument("--max-repeats", type=int, default=10, help="blocks per concurrency at most (default 10)")
    q = p.add_argument_group("quality")
    q.add_argument("--quality", choices=("lm-eval", "quality-ab", "none"), default="none")
    q.add_argument("--quality-concurrency", type=int, nargs="+",
                   help="requests in flight in the quality arms (default: the smallest concurrency at which the "
                        "server's gate opens, and the largest swept one with an open gate)")
    q.add_argument("--accept-prompts", type=int, default=tq.ACCEPT_FLOOR,
                   help="speculative decoding: the accept-length probe's floor, prompts per concurrency (default "
                        f"{tq.ACCEPT_FLOOR}, at least 2 C); it runs on until its interval is clear of the bound or "
                        "its share of the budget is spent")
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
    o.add_argument("--api-key", help=f"the server's --api-key (default ${API_KEY_VAR}; the variable keeps it out "
                                     "of `ps`)")
    o.add_argument("--admin-api-key", help=f"the server's --admin-api-key, for the live settings and the cache "
                                           f"flush (default ${ADMIN_KEY_VAR})")
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
    for flag in ("budget_minutes", "max_repeats", "input_len", "output_len", "accept_prompts"):
        if getattr(args, flag) <= 0:
            raise TrialRefused(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.quality_concurrency and min(args.quality_concurrency) <= 0:
        raise TrialRefused(f"--quality-concurrency must be positive integers, got {args.quality_concurrency}")


def resolve_tokenizer(args, pre: Preflight) -> None:
    """--tokenizer, else the server's tokenizer_path when it is a directory here; TrialRefused otherwise."""
    if args.tokenizer:
        return
    path = pre.info.get("tokenizer_path") or pre.info.get("model_path")
    if not (path and os.path.isdir(path)):
        raise TrialRefused(f"give --tokenizer (the served model's tokenizer directory or id); the server's "
                           f"tokenizer_path {path!r} is not a directory on this machine")
    args.tokenizer = path


def resolve_keys(args) -> Auth:
    """--api-key / --admin-api-key, else $OEA_API_KEY / $OEA_ADMIN_API_KEY, registered for --url
    (common/http.use_auth): every request to the server then carries the key it needs."""
    args.api_key = args.api_key or os.environ.get(API_KEY_VAR) or None
    args.admin_api_key = args.admin_api_key or os.environ.get(ADMIN_KEY_VAR) or None
    auth = Auth(args.api_key, args.admin_api_key)
    use_auth(args.url, auth)
    return auth


def check_keys(url: str, auth: Auth) -> str:
    """Before any load: GET /server_info (the API key) and an empty POST /set_internal_state (it
    changes nothing; the key live settings need). TrialRefused naming the missing or wrong key on
    an HTTP 401; else the preflight's line on the keys. A server that does not answer is left to
    the preflight to report."""
    for path, payload in (("/server_info", None), ("/set_internal_state", {"server_args": {}})):
        try:
            http_json(url + path, payload, 30.0)
        except HTTPStatusError as e:
            if e.code == 401:
                raise TrialRefused(key_problem(path, auth)) from None
        except (RuntimeError, OSError):
            return "keys: not checked (the server did not answer)"
    given = " and ".join(name for name, key in (("an API key", auth.api_key), ("an admin key", auth.admin_api_key))
                         if key) or "no key"
    flush = ("" if auth.bench_flushes() else
             "; the prefix cache is flushed by the trial before each run (bench_serving sends only the API key)")
    return f"keys: {given} given, each sent where the server needs it{flush}"


def key_problem(path: str, auth: Auth) -> str:
    """Why the server answered 401 on `path`, naming the key to give."""
    if path == "/server_info":
        if auth.api_key:
            return (f"the server refused the API key given (HTTP 401 on {path}): ${API_KEY_VAR} / --api-key is not "
                    "the server's --api-key")
        return (f"the server needs its API key (HTTP 401 on {path}: it runs with --api-key): give it in "
                f"${API_KEY_VAR} (or --api-key)")
    if auth.admin_api_key:
        return (f"the server refused the admin key given (HTTP 401 on {path}): ${ADMIN_KEY_VAR} / --admin-api-key is "
                "not the server's --admin-api-key")
    if auth.api_key:
        return (f"live settings need the server's admin key (HTTP 401 on {path} with the API key: it runs with "
                f"--admin-api-key): give it in ${ADMIN_KEY_VAR} (or --admin-api-key)")
    return (f"live settings need a key (HTTP 401 on {path}): give the server's --admin-api-key in ${ADMIN_KEY_VAR}, "
            f"or its --api-key in ${API_KEY_VAR} when it has no admin key")


def prepare(args) -> Tuple[Preflight, argparse.Namespace]:
    """Keys, preflight and the prompt file, before any load; TrialRefused when the trial cannot mean anything."""
    check_args(args)
    url = args.url.rstrip("/")
    keys = check_keys(url, resolve_keys(args))
    pre = preflight(url, args.tokenizer, args.k0, args.concurrency)
    pre.lines.append(keys)
    resolve_tokenizer(args, pre)
    log("preflight:\n  " + "\n  ".join(pre.lines + [f"WARNING: {w}" for w in pre.warnings]
                                       + [f"C={g.concurrency}: gate {'open' if g.open else 'CLOSED'} ({g.why})"
                                          for g in pre.gates]))
    sargs = sweep_args(args, url, pre.open_concurrencies)
    try:
        path, label = trial_prompt_file(args.prompt_file, args.tokenizer, args.input_len, prompts_needed(sargs),
                                        args.out_dir, tq.ACCEPT_POOL if pre.speculative else 0)
        use_prompt_file(sargs, path)
    except SystemExit as e:
        raise TrialRefused(str(e)) from None
    sargs.prompts_label = label
    sargs.quality_at = tq.quality_concurrencies(pre, args.quality_concurrency) if args.quality != "none" else []
    sargs.budget = Budget(args.budget_minutes, work_of(args, pre, sargs, sargs.quality_at))
    log("plan:\n  " + "\n  ".join(sargs.budget.plan_lines()))
    return pre, sargs


def start_lm_eval(args) -> Optional[tq.LmEvalClient]:
    """--quality lm-eval: the lm-eval process, started now and its task checked (TrialRefused,
    the process stopped, when lm-eval does not know it); None for the other quality steps."""
    if args.quality != "lm-eval":
        return None
    client = tq.LmEvalClient(os.path.join(args.out_dir, "quality"), args.run_timeout, env=client_env(args.url))
    problem = client.check_task(args.lm_eval_task, args.lm_eval_include)
    if problem:
        client.close()
        raise TrialRefused(problem)
    return client


def measure(args, pre: Preflight, sargs, state: Dict) -> None:
    """Throughput, accept length (speculative decoding only), quality, within one budget
    (sargs.budget, budget.py); fills `state` as it goes."""
    budget = sargs.budget
    with budget.phase("throughput"):
        state["records"] = run_throughput(pre.url, sargs, pre.open_concurrencies, budget, args.max_repeats)
    if pre.speculative:
        with budget.phase("accept length"):
            state["accept"] = tq.accept_probe(pre.url, args.k0, pre.open_concurrencies, prompt_texts(sargs.prompt_file),
                                              args.output_len, args.admin_api_key, args.run_timeout,
                                              args.accept_prompts, budget.accept_left, budget)
    if args.quality != "none":
        with budget.phase("quality"):
            state["quality"] = tq.run_quality(args, pre.url, args.k0, sargs.quality_at, budget, state["lm_eval"])


def restore_first(pre: Preflight, guard: Optional[GuardClient], lm_eval: Optional[tq.LmEvalClient]) -> Dict:
    """The clean-up's first step: put back the settings found at the start (live_settings.put_back:
    set, one pass, confirmed in force, retried with backoff), tell the guard, stop lm-eval; SIGINT,
    SIGTERM and SIGHUP held off meanwhile (servers.signals_held). Never raises an Exception;
    returns put_back's outcome with "by" and "note" (the report's line) added."""
    settings = {"oea_k0": pre.original.get("oea_k0", 0)}
    steps: Dict[str, object] = {}
    while len(steps) < 3:
        try:
            with signals_held():
                if "outcome" not in steps:
                    steps["outcome"] = put_back(pre.url, settings, log=log)
                if "guard" not in steps:
                    steps["guard"] = guard.finish() if guard is not None else None
                if "lm_eval" not in steps:
                    steps["lm_eval"] = lm_eval.close() if lm_eval is not None else None
        except KeyboardInterrupt:  # a signal held meanwhile (or already on its way in): the steps go on
            log("a signal came during the clean-up: putting the settings back first, then the report")
    outcome = dict(steps["outcome"], by="the trial")
    outcome["note"] = restore_note(pre.url, outcome)
    log(f"settings {'put back' if outcome['ok'] else 'NOT put back'}: {json.dumps(settings)} ({outcome['note']})")
    return outcome


def restore_note(url: str, outcome: Dict) -> str:
    """One line on put_back's outcome: who, what, after how many attempts; or what the server is left at."""
    settings = json.dumps(outcome["settings"])
    if outcome["ok"]:
        retried = (f", at attempt {outcome['attempts']} ({'; '.join(outcome['errors'])})"
                   if outcome["attempts"] > 1 else "")
        return f"by {outcome['by']}, the settings found at the start, in force on every scheduler{retried}"
    left = json.dumps(outcome["left_at"]) if outcome["left_at"] else "unknown (the server did not say)"
    return (f"{outcome['attempts']} attempts to set {settings} failed ({'; '.join(outcome['errors'])}); "
            f"the server is left at {left}. Set it by hand: curl -X POST {url}/set_internal_state "
            f"-H \"Authorization: Bearer ${ADMIN_KEY_VAR}\" -H 'Content-Type: application/json' "
            f"-d '{{\"server_args\": {settings}}}'")


def apply_recommended(url: str, settings: Dict[str, int]) -> Dict:
    """--apply after a complete trial: set the recommended settings (verdict.recommend's "settings":
    k0, and the cap when one is suggested; put_back) after the restore; the outcome with its note."""
    outcome = dict(put_back(url, settings, log=log), by="--apply")
    what = json.dumps(settings)
    outcome["note"] = (f"--apply: the recommended {what} set, in force on every scheduler" if outcome["ok"] else
                       f"--apply: setting {what} FAILED ({'; '.join(outcome['errors'])}); the server is left at "
                       f"{json.dumps(outcome['left_at'])}")
    log(outcome["note"])
    return outcome


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
        rec = recommend(args.k0, cells, state.get("quality"), bool(pre.speculative), pre.original,
                        pre.rows_per_request)
    return {"url": pre.url, "model": pre.info.get("served_model_name") or pre.info.get("model_path"),
            "label": args.label, "started": started, "status": status, "command": command_line(args),
            "prompts": getattr(sargs, "prompts_label", None), "k0": args.k0,
            "preflight": {"lines": pre.lines, "warnings": pre.warnings, "original": pre.original,
                          "speculative": pre.speculative, "rows_per_request": pre.rows_per_request,
                          "top_k": pre.top_k, "gates": [vars(g) for g in pre.gates]},
            "arms": list(rows.values()), "cells": cells, "quality": state.get("quality"),
            "accept_length_probe": state.get("accept"), "recommendation": rec,
            "budget": sargs.budget.as_dict() if getattr(sargs, "budget", None) else None,
            "kernel_after": kernel_after(pre.url)}


def kernel_after(url: str) -> Optional[list]:
    """Each scheduler's routing kernel once the trial has decoded (on the CPU and under --oea-kernel
    auto it is chosen at the first decode step); None when /server_info does not answer."""
    try:
        return kernel_lines(read_states(url)[1])[0]
    except TrialRefused:
        return None


def command_line(args) -> str:
    """The trial's command line for the report, key flag values redacted (common/http.redact_argv)."""
    return shlex.join(redact_argv(getattr(args, "argv", None) or sys.argv))


def start_guard(pre: Preflight, args) -> GuardClient:
    """The guard (guard.py), holding the settings found; TrialRefused when it does not start."""
    try:
        return GuardClient(pre.url, Auth(args.api_key, args.admin_api_key), {"oea_k0": pre.original.get("oea_k0", 0)},
                           os.path.join(args.out_dir, "guard.log"), child_env(), log)
    except (RuntimeError, OSError) as e:
        raise TrialRefused(f"{e}: without it, a trial killed (SIGKILL, OOM) would leave its k0 on the server") from None


def run_trial(args) -> int:
    os.makedirs(args.out_dir, exist_ok=True)
    lm_eval = None
    try:
        pre, sargs = prepare(args)
        lm_eval = start_lm_eval(args)
        guard = start_guard(pre, args)
    except TrialRefused as e:
        if lm_eval is not None:
            lm_eval.close()
        log(f"refused: {e}")
        print(f"trial.py: refused: {e}", file=sys.stderr)
        return 2
    started, state = time.strftime("%Y-%m-%d %H:%M:%S"), {"lm_eval": lm_eval}
    status, rc = "failed: unexpected error", 1
    try:
        measure(args, pre, sargs, state)
        status, rc = "done", 0
    except KeyboardInterrupt:
        status, rc = "interrupted", 130
    except LiveSettingsError as e:
        status, rc = f"stopped: {e}", 2
    except (RuntimeError, OSError) as e:
        status, rc = f"failed: {e}", 1
    except Exception as e:  # reported like the others, after the settings are put back
        traceback.print_exc()
        status, rc = f"failed: unexpected error {type(e).__name__}: {e}", 1
    finally:
        restore = restore_first(pre, guard, lm_eval)
    problem, applied = write_report(args, pre, sargs, state, status, started, restore)
    if not restore["ok"] or (applied is not None and not applied["ok"]):
        return 2
    return 1 if problem and rc == 0 else rc


def write_report(args, pre: Preflight, sargs, state: Dict, status: str, started: str,
                 restore: Dict) -> Tuple[Optional[str], Optional[Dict]]:
    """results.json, results.md, results.png (verdict.write_outputs), after --apply's change when it
    is due. Returns (None, or why the report could not be built, then a short results.json and
    results.md with the status and the restore are written instead; --apply's outcome or None)."""
    applied = None
    try:
        result = result_of(args, pre, sargs, state, status, started)
        result["restore"] = restore
        result["restored"], result["restore_note"] = restore["settings"], restore["note"]
        if args.apply and status == "done" and result["recommendation"]["k0"]:
            applied = apply_recommended(pre.url, result["recommendation"]["settings"])
            result["applied"] = applied
            result["restored"], result["restore_note"] = applied["settings"], f"{restore['note']}; {applied['note']}"
        result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        write_outputs(args.out_dir, result, state.get("records") or [])
        return None, applied
    except Exception as e:  # the report must not hide the restore's outcome: a short one is written instead
        traceback.print_exc()
        problem = f"the report could not be built ({type(e).__name__}: {e})"
        log(problem)
        short = {"url": pre.url, "status": status, "command": command_line(args), "started": started,
                 "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "report_error": problem, "restore": restore,
                 "applied": applied}
        write_short_report(args.out_dir, short)
        return problem, applied


def write_short_report(out_dir: str, short: Dict) -> None:
    """results.json and results.md when the full report could not be built: the status, the error
    and the restore."""
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(short, f, indent=1, default=str)
    restore = short["restore"]
    settings = (f"Settings put back: {json.dumps(restore['settings'])} ({restore['note']})." if restore["ok"]
                else f"**Settings NOT put back.** {restore['note']}.")
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(f"# OEA trial: {short['url']}\n\nStatus: {short['status']}. {short['report_error'].capitalize()}; "
                f"see the trial's log.\n\n{settings}\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = [sys.argv[0] if argv is None else TRIAL_SCRIPT, *(sys.argv[1:] if argv is None else argv)]
    try:
        with terminate_as_interrupt():
            return run_trial(args)
    except KeyboardInterrupt:  # before any change (the preflight), or after the restore
        log("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
