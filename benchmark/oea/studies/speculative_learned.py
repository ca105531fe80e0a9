"""OEA in verify passes, on the trained checkpoints: accept length, T, throughput and next-token
accuracy under speculative decoding, against the same k0 without it.

For each model and each decoding mode (none: no speculative decoding; ngram; eagle: the model's own
MTP layer as the draft, for checkpoints that have one) one server is started, float32, armed and off
(--oea-k0 0, the default --oea-min-batch 4, no cap). For each concurrency C, OEA is set live to each
k0 in turn (0 first: off, what --oea-verify off gives under speculative decoding), and the same
held-out prompts run through it: token ids, greedy, exactly --continuation-len tokens, C in flight.

    python benchmark/oea/studies/speculative_learned.py --out-dir benchmark/oea/results/cpu-2026-12-02-speculative

Per arm (one server, one C, one k0):
- accept length: SGLang's own, per request (completion tokens / verify steps, returned with
  return_spec_tokens_details), and the mean of the 'accept len' of its 'Decode batch' lines;
- T: distinct experts per MoE layer per verify (or decode) step, before -> after OEA, the mean over
  the arm's 'Decode batch' lines that carry it (--decode-log-interval 1: one line per step; the
  arm's first line is left out, as it may summarise the previous arm's last step);
- output throughput: generated tokens / the arm's wall time (one run; this machine's speed drifts);
- next-token accuracy against the held-out continuation (quality_scoring.reference_match).
Paired over prompts (95% percentile bootstrap): each k0 against k0 0 on the same server and C
(accept length, accuracy), and each speculative arm against the no-speculation arm of the same k0
and C (accuracy).

Writes OUT/speculative.json (every arm and comparison), OUT/speculative.md, OUT/per_prompt.jsonl and
OUT/command.txt; server logs go to --work-dir.
"""

import argparse
import json
import os
import re
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmark/oea
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)  # its folders import as packages

from common import stats  # noqa: E402
from serving import live_settings, quality_client  # noqa: E402
from serving.quality_inputs import Item  # noqa: E402
from serving.quality_report import write_json  # noqa: E402
from serving.quality_scoring import BOOTSTRAP_RESAMPLES, reference_matches  # noqa: E402
from serving.servers import child_env, cpu_server, terminate_as_interrupt  # noqa: E402
from studies.quality_learned import (MODELS_DIR, delta, experts_cell, experts_from_log, read_from,  # noqa: E402
                                     write_command, write_prompts)

# The machine and the day of the run, in every report.
LABEL = (f"{os.cpu_count()}-core CPU machine, {time.strftime('%Y-%m-%d')}, tiny trained models; says nothing "
         "about GLM-5")
DRAFT_TOKENS = 4
MODES = {
    "none": (),
    "ngram": ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(DRAFT_TOKENS),
              "--speculative-ngram-capacity", "100000"),  # the default 10M-entry corpus takes ~1.8 GiB
    "eagle": ("--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(DRAFT_TOKENS - 1),
              "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(DRAFT_TOKENS)),
}
SERVER_FLAGS = ("--dtype", "float32", "--random-seed", "0", "--enable-metrics", "--decode-log-interval", "1",
                "--max-total-tokens", "16384", "--oea-k0", "0")
ACCEPT = re.compile(r"Decode batch.*?accept len: ([0-9.]+)")


def log(msg: str) -> None:
    print(f"[speculative-learned] {msg}", flush=True)


def has_mtp(model_dir: str) -> bool:
    with open(os.path.join(model_dir, "config.json")) as f:
        return bool(json.load(f).get("num_nextn_predict_layers"))


def mean(values: Sequence[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def run_arm(url: str, items: Sequence[Item], mode: str, c: int, k0: int, log_path: str,
            args: argparse.Namespace) -> Dict:
    """k0 set live, then every prompt at concurrency c: the arm's record (outputs and figures)."""
    settings = live_settings.arm_settings(k0)
    live_settings.apply_settings(url, settings)
    offset = os.path.getsize(log_path)
    opts = argparse.Namespace(model=None, max_tokens=args.continuation_len, ignore_eos=True, timeout=600.0,
                              concurrency=c, spec_details=mode != "none")
    arm = quality_client.run_arm(f"{mode}-c{c}-k0{k0}", url, items, opts)
    live_settings.confirm_settings(url, settings)
    settle(log_path)
    # The arm's 'Decode batch' lines, each naming the k0 in force, less the first: a line
    # summarises the steps since the line before it, so the first can hold the previous arm's last.
    in_force = re.compile(rf"Decode batch.*OEA k0={k0}\b")
    lines = [line for line in read_from(log_path, offset).splitlines(True) if in_force.search(line)]
    text = "".join(lines[1:])
    tokens = sum(len(o["token_ids"]) for o in arm["outputs"])
    accept_lines = [float(v) for v in ACCEPT.findall(text)]
    return {"mode": mode, "concurrency": c, "k0": k0, "elapsed_s": arm["elapsed_s"], "tokens": tokens,
            "output_throughput": tokens / arm["elapsed_s"], "experts": experts_from_log(text),
            "oea_steps": arm["oea_steps"], "accept_length_log_mean": mean(accept_lines),
            "accept_length": [o["spec"]["accept_length"] for o in arm["outputs"]] if mode != "none" else None,
            "accuracy": reference_matches(items, arm["outputs"]),
            "token_ids": [o["token_ids"] for o in arm["outputs"]]}


def settle(log_path: str, quiet_s: float = 1.0, limit_s: float = 15.0) -> None:
    """Wait until the server log stops growing: a step's 'Decode batch' line can be written just
    after its request's answer has reached the client."""
    deadline, size = time.time() + limit_s, -1
    while time.time() < deadline and os.path.getsize(log_path) != size:
        size = os.path.getsize(log_path)
        time.sleep(quiet_s)


def mode_arms(model_dir: str, mode: str, items: Sequence[Item], work: str, args: argparse.Namespace) -> List[Dict]:
    """One server for (model, mode): every C, every k0 (0 first), in that order."""
    log_path = os.path.join(work, f"server_{mode}.log")
    arms = []
    with cpu_server(model_dir, (*SERVER_FLAGS, *MODES[mode]), lambda: log_path, child_env(),
                    args.start_timeout) as (url, _):
        for c in args.concurrency:
            for k0 in [0, *args.k0]:
                arms.append(run_arm(url, items, mode, c, k0, log_path, args))
                a = arms[-1]
                log(f"{mode} C={c} k0={k0}: {a['output_throughput']:.1f} tok/s, accept "
                    f"{a['accept_length_log_mean']}, T {a['experts']['before']} -> {a['experts']['after']}")
    return arms


def paired(base: Sequence[Optional[float]], other: Sequence[Optional[float]]) -> Dict:
    """other - base per prompt (prompts where both are defined), with its bootstrap interval."""
    pairs = [(b, o) for b, o in zip(base, other) if b is not None and o is not None]
    return stats.paired_mean_difference([b for b, _ in pairs], [o for _, o in pairs], BOOTSTRAP_RESAMPLES)


def comparisons(arms: Sequence[Dict]) -> List[Dict]:
    """Per OEA arm: against k0 0 of its server and C, and (speculative arms) against the
    no-speculation arm of the same k0 and C."""
    by_key = {(a["model"], a["mode"], a["concurrency"], a["k0"]): a for a in arms}
    rows = []
    for a in arms:
        off = by_key[(a["model"], a["mode"], a["concurrency"], 0)]
        plain = by_key.get((a["model"], "none", a["concurrency"], a["k0"]))
        row = {key: a[key] for key in ("model", "mode", "concurrency", "k0")}
        row["throughput_ratio_to_off"] = a["output_throughput"] / off["output_throughput"]
        row["accuracy_vs_off"] = paired(off["accuracy"], a["accuracy"])
        if a["accept_length"] is not None:
            row["accept_length_vs_off"] = paired(off["accept_length"], a["accept_length"])
        if plain is not None and a["mode"] != "none":
            row["accuracy_vs_no_speculation"] = paired(plain["accuracy"], a["accuracy"])
            row["identical_to_no_speculation"] = sum(x == y for x, y in zip(plain["token_ids"], a["token_ids"]))
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def table(arms: Sequence[Dict], rows: Sequence[Dict], model: str) -> List[str]:
    lines = ["| mode | C | k0 | accept len (log) | accept len per request, k0 - off [95%] | T before -> after | "
             "tok/s (ratio to off) | accuracy | accuracy k0 - off [95%] | accuracy spec - none [95%] | "
             "identical to none |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    by_key = {(r["mode"], r["concurrency"], r["k0"]): r for r in rows if r["model"] == model}
    for a in (a for a in arms if a["model"] == model):
        r = by_key[(a["mode"], a["concurrency"], a["k0"])]
        accept = "n/a" if a["accept_length_log_mean"] is None else f"{a['accept_length_log_mean']:.2f}"
        per_request = delta(r["accept_length_vs_off"], 3) if "accept_length_vs_off" in r and a["k0"] else "-"
        vs_none = delta(r["accuracy_vs_no_speculation"], 3) if "accuracy_vs_no_speculation" in r else "-"
        same = f"{r['identical_to_no_speculation']}/{len(a['accuracy'])}" if "identical_to_no_speculation" in r else "-"
        lines.append(f"| {a['mode']} | {a['concurrency']} | {a['k0'] or 'off'} | {accept} | {per_request} | "
                     f"{experts_cell(a['experts'])} | {a['output_throughput']:.1f} ({r['throughput_ratio_to_off']:.2f}x) | "
                     f"{mean([x for x in a['accuracy'] if x is not None]):.4f} | "
                     f"{delta(r['accuracy_vs_off']) if a['k0'] else '-'} | {vs_none} | {same} |")
    return lines


def render_markdown(study: Dict) -> str:
    s = study["settings"]
    lines = ["# OEA in verify passes: accept length, T, throughput and accuracy", "", f"**{LABEL}.**", "",
             f"{s['num_prompts']} held-out windows per model (seed {s['seed']}): {s['prompt_len']} prompt tokens "
             f"as ids, {s['continuation_len']} generated tokens (greedy, ignore_eos), C requests in flight. One "
             f"server per model and mode ({' '.join(SERVER_FLAGS)}, default --oea-min-batch 4), k0 set live; "
             f"speculative modes draft {DRAFT_TOKENS} tokens per request and step (EAGLE: "
             f"{DRAFT_TOKENS - 1} MTP steps, top-1). Differences are paired over prompts, 95% percentile "
             "bootstrap. Throughput: one run per arm, on a machine whose speed drifts by up to 2x; read it "
             "as a rough figure.", ""]
    for model in study["models"]:
        lines += [f"## {model}", ""] + table(study["arms"], study["rows"], model) + [""]
    lines += ["- accept len (log): the mean of SGLang's `accept len` over the arm's `Decode batch` lines (one "
              "per step); per request: completion tokens / verify steps (SGLang's `spec_accept_length`).",
              "- T: distinct experts per MoE layer per step, before -> after OEA, over the lines that carry it.",
              "- accuracy: next-token accuracy against the held-out continuation (free-running greedy).",
              "- identical to none: prompts whose generated ids equal the no-speculation arm's at the same k0 and C.",
              f"- wall time of the whole study: {study['runtime_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def write_outputs(out_dir: str, study: Dict, argv: Sequence[str]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    write_json(os.path.join(out_dir, "speculative.json"), {**study, "arms": [
        {k: v for k, v in a.items() if k not in ("token_ids", "accuracy", "accept_length")} for a in study["arms"]]})
    with open(os.path.join(out_dir, "speculative.md"), "w") as f:
        f.write(render_markdown(study))
    with open(os.path.join(out_dir, "per_prompt.jsonl"), "w") as f:
        for a in study["arms"]:
            f.write(json.dumps({k: a[k] for k in ("model", "mode", "concurrency", "k0", "accuracy", "accept_length",
                                                  "token_ids")}) + "\n")
    write_command(out_dir, __file__, argv)


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["qwen3_moe_stdlib", "deepseek_v3_stdlib"],
                   help="folders under benchmark/oea/models")
    p.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["none", "ngram", "eagle"],
                   help="eagle runs only on models with an MTP layer")
    p.add_argument("--k0", type=int, nargs="+", default=[4, 5, 6], help="set live after the off arm (k0 0)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[4, 16], help="requests in flight")
    p.add_argument("--num-prompts", type=int, default=48, help="held-out windows per model")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens")
    p.add_argument("--continuation-len", type=int, default=32, help="generated (and reference) tokens")
    p.add_argument("--seed", type=int, default=0, help="which held-out windows (training/heldout.py)")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--work-dir", help="server logs and prompts (default: a new temporary folder)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for a server")
    return p


def check_args(args: argparse.Namespace) -> None:
    for model in args.models:
        if not os.path.isfile(os.path.join(MODELS_DIR, model, "config.json")):
            raise SystemExit(f"--models: no checkpoint {model} in {MODELS_DIR}")
    if min(args.k0) < 1 or min(args.concurrency) < 1 or args.num_prompts < 2:
        raise SystemExit("--k0 and --concurrency values must be at least 1, --num-prompts at least 2")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    check_args(args)
    args.work_dir = args.work_dir or tempfile.mkdtemp(prefix="speculative_learned_")
    log(f"work dir {args.work_dir}")
    start, arms = time.time(), []
    for model in args.models:
        model_dir, work = os.path.join(MODELS_DIR, model), os.path.join(args.work_dir, model)
        os.makedirs(work, exist_ok=True)
        items = write_prompts(model_dir, os.path.join(work, "prompts.jsonl"), args)
        for mode in args.modes:
            if mode == "eagle" and not has_mtp(model_dir):
                log(f"{model}: no MTP layer, no eagle arms")
                continue
            arms += [{"model": model, **a} for a in mode_arms(model_dir, mode, items, work, args)]
    settings = {key: getattr(args, key) for key in ("num_prompts", "prompt_len", "continuation_len", "seed", "k0",
                                                    "concurrency", "modes")}
    study = {"label": LABEL, "settings": {**settings, "server_flags": list(SERVER_FLAGS),
                                          "mode_flags": {m: list(MODES[m]) for m in args.modes}},
             "models": args.models, "arms": arms, "rows": comparisons(arms), "runtime_s": time.time() - start}
    write_outputs(args.out_dir, study, argv)
    print(render_markdown(study), end="")
    return 0


if __name__ == "__main__":
    with terminate_as_interrupt():  # SIGTERM stops the servers started, as Ctrl-C does
        sys.exit(main())
