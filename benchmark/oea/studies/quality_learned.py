"""OEA's output quality on the two trained checkpoints (benchmark/oea/models/), through the server.

For each model: held-out (prompt, true continuation) token windows (training/heldout.py); a baseline server
(plain routing, the plugin loaded, OEA off) and then one OEA server per --k0, one at a time, each
started once and serving every --concurrency. Each arm is a serving/quality_ab.py run: the prompts are sent
as token ids, greedy, exactly --continuation-len tokens (ignore_eos), C requests in flight. The
baseline server runs every concurrency twice (quality_ab's --noise-floor), the OEA servers once
each, compared against the saved baseline arm of the same concurrency (--baseline-from).

Measures, per (model, k0, C), paired by prompt, OEA minus baseline, 95% intervals over prompts:
- token agreement with the baseline (quality_ab's positional agreement, identical share);
- next-token accuracy against the held-out continuation (quality_ab's reference match);
- NLL: the plain model's mean negative log-likelihood per token of each arm's generated
  continuation given its prompt, scored in transformers (float32) after the servers have stopped;
- from the OEA server: the share of decode steps OEA applied to (quality_ab's oea_applied) and T,
  the distinct experts per layer per step before -> after OEA, averaged over the arm's
  'Decode batch' log lines (--decode-log-interval 1: one line per decode step).

    python benchmark/oea/studies/quality_learned.py --out-dir benchmark/oea/results/cpu-2026-12-01-quality-learned

Writes OUT/quality.json (every row), OUT/quality.md (a k0 x C table per model), OUT/per_prompt.jsonl
(each arm's per-prompt accuracy and NLL) and OUT/command.txt. The raw arms, quality_ab reports and
server logs go to --work-dir; --reuse takes the arms found there instead of running their server.
"""

import argparse
import json
import os
import re
import shlex
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmark/oea
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)  # its folders import as packages

from common import stats  # noqa: E402
from serving import quality_ab  # noqa: E402
from common.oea_metrics import APPLIED_DEFINITION  # noqa: E402
from serving.quality_inputs import Item, load_prompts  # noqa: E402
from serving.quality_report import write_json  # noqa: E402
from serving.quality_scoring import (AGREEMENT_DEFINITION, BOOTSTRAP_RESAMPLES, REFERENCE_DEFINITION,  # noqa: E402
                                     build_report, compare_outputs, reference_matches)
from serving.servers import RECORDED_ENV, child_env, cpu_server, terminate_as_interrupt  # noqa: E402

MODELS_DIR = os.path.join(BENCH, "models")
DEFAULT_MODELS = ("qwen3_moe_stdlib", "glm4_moe_stdlib", "deepseek_v3_stdlib")
# The machine and the day of the run, in every report.
LABEL = (f"{os.cpu_count()}-core CPU machine, {time.strftime('%Y-%m-%d')}, tiny trained models; says nothing "
         "about GLM-5 quality")
# Every server's flags; OEA servers add only --oea-k0. Metrics every decode step: exact step
# counters, and one 'Decode batch' line (with T before -> after) per decode step.
SERVER_FLAGS = ("--random-seed", "0", "--enable-metrics", "--decode-log-interval", "1")
EXPERTS = re.compile(r"experts/layer/step ([0-9.]+) -> ([0-9.]+)")
MIN_BATCH = re.compile(r"sglang-oea rank 0: OEA on, k0=\d+ min_batch=(\d+)")
NLL_DEFINITION = ("per prompt: the plain model's (transformers, float32) mean negative log-likelihood, nats per "
                  "token, of the arm's generated continuation given the prompt; then the mean over prompts")
T_DEFINITION = ("distinct experts per MoE layer per decode step, before -> after OEA: the mean over the OEA arm's "
                "'Decode batch' log lines that carry it (decode-log interval 1: one line per applied step)")


def log(msg: str) -> None:
    print(f"[quality-learned] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------
# Prompts and servers
# ----------------------------------------------------------------------------------------------


def write_prompts(model_dir: str, path: str, args: argparse.Namespace) -> List[Item]:
    """Held-out windows as quality_ab prompts ({"prompt": ids, "reference_ids": ids} a line): [n] items."""
    from training import heldout

    rows = heldout.prompt_continuations(model_dir, args.num_prompts, args.prompt_len, args.continuation_len,
                                        args.seed)
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt": r["prompt_ids"], "reference_ids": r["continuation_ids"]}) + "\n"
                     for r in rows)
    return load_prompts(path)


@contextmanager
def server(model_dir: str, flags: Sequence[str], log_path: str, timeout_s: float) -> Iterator[str]:
    """A cpu_serve server with SERVER_FLAGS and `flags` (servers.cpu_server): yields its URL."""
    with cpu_server(model_dir, (*SERVER_FLAGS, *flags), lambda: log_path, child_env(),
                               timeout_s) as (url, _):
        yield url


def quality_args(prompts: str, concurrency: int, out: str, args: argparse.Namespace, *arms: str) -> List[str]:
    """quality_ab argv of one arm pair: greedy, exactly --continuation-len tokens."""
    return ["--prompts", prompts, "--concurrency", str(concurrency), "--max-tokens", str(args.continuation_len),
            "--ignore-eos", "--out", out, *arms]


def run_quality(argv: List[str]) -> None:
    """quality_ab.main; RuntimeError when it fails (its message is on stderr)."""
    rc = quality_ab.main(argv)
    if rc != 0:
        raise RuntimeError(f"quality_ab.py exited with {rc}: {shlex.join(argv)}")


def experts_from_log(text: str) -> Dict:
    """T before/after from 'Decode batch' lines: {"before", "after", "ratio", "lines"} (None values
    when no line carries expert counts)."""
    pairs = [(float(b), float(a)) for b, a in EXPERTS.findall(text)]
    if not pairs:
        return {"before": None, "after": None, "ratio": None, "lines": 0, "definition": T_DEFINITION}
    before, after = (sum(p[i] for p in pairs) / len(pairs) for i in (0, 1))
    return {"before": before, "after": after, "ratio": after / before, "lines": len(pairs),
            "definition": T_DEFINITION}


def read_from(path: str, offset: int) -> str:
    with open(path, errors="replace") as f:
        f.seek(offset)
        return f.read()


def run_dir(work: str, arm: str, concurrency: int) -> str:
    return os.path.join(work, f"{arm}_c{concurrency}")


def done(paths: Sequence[str], args: argparse.Namespace) -> bool:
    return args.reuse and all(os.path.exists(p) for p in paths)


def baseline_server(model_dir: str, prompts: str, work: str, args: argparse.Namespace) -> bool:
    """Baseline arms (and a repeat each, the noise floor) at every concurrency, from one server.
    False when --reuse found them all and no server ran."""
    if done([os.path.join(run_dir(work, "baseline", c), "arm_baseline_repeat.json") for c in args.concurrency], args):
        log(f"reusing the baseline arms in {work}")
        return False
    with server(model_dir, (), os.path.join(work, "server_baseline.log"), args.start_timeout) as url:
        for c in args.concurrency:
            out = run_dir(work, "baseline", c)
            run_quality(quality_args(prompts, c, out, args, "--base-url", url, "--noise-floor"))
    return True


def oea_server(model_dir: str, k0: int, prompts: str, work: str, args: argparse.Namespace) -> bool:
    """One OEA server's arms at every concurrency, each compared with the saved baseline arm; writes
    each run's experts.json (T before/after, from the server log lines of that arm). False when
    --reuse found them all and no server ran."""
    name = f"k0_{k0}"
    if done([os.path.join(run_dir(work, name, c), "experts.json") for c in args.concurrency], args):
        log(f"reusing the k0={k0} arms in {work}")
        return False
    log_path = os.path.join(work, f"server_{name}.log")
    with server(model_dir, ("--oea-k0", str(k0)), log_path, args.start_timeout) as url:
        for c in args.concurrency:
            out, offset = run_dir(work, name, c), os.path.getsize(log_path)
            baseline = os.path.join(run_dir(work, "baseline", c), "arm_baseline.json")
            run_quality(quality_args(prompts, c, out, args, "--oea-url", url, "--baseline-from", baseline))
            experts = experts_from_log(read_from(log_path, offset))
            match = MIN_BATCH.search(read_from(log_path, 0))
            experts["oea_min_batch"] = int(match.group(1)) if match else None
            write_json(os.path.join(out, "experts.json"), experts)
    return True


# ----------------------------------------------------------------------------------------------
# NLL under the plain model (transformers)
# ----------------------------------------------------------------------------------------------


def load_scorer(model_dir: str):
    """The plain model in transformers, float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def continuation_nll(model, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
                     batch_size: int = 32) -> List[float]:
    """Mean NLL per token (nats) of each continuation given its prompt: [n] floats.

    Rows of the same total length are scored together (no padding, so nothing to mask): prompt +
    continuation [B, P + L] through train_moe.token_nll, the last L predictions of each row.
    """
    import torch

    from training import train_moe

    if any(len(p) == 0 or len(c) == 0 for p, c in zip(prompts, continuations)):
        raise ValueError("every prompt and continuation needs at least one token")
    out: List[Optional[float]] = [None] * len(prompts)
    groups: Dict[Tuple[int, int], List[int]] = {}
    for i, (p, c) in enumerate(zip(prompts, continuations)):
        groups.setdefault((len(p), len(c)), []).append(i)
    with torch.no_grad():
        for (_, cont_len), rows in groups.items():
            for start in range(0, len(rows), batch_size):
                chunk = rows[start:start + batch_size]
                ids = torch.tensor([list(prompts[i]) + list(continuations[i]) for i in chunk])
                nll = train_moe.token_nll(model, ids)[:, -cont_len:].double().mean(dim=1)  # [B]
                for i, value in zip(chunk, nll.tolist()):
                    out[i] = value
    return out


def arm_nll(model, items: Sequence[Item], arm: Dict) -> List[float]:
    """The plain model's per-prompt NLL of one arm's outputs: [n]."""
    return continuation_nll(model, [it.prompt for it in items], [o["token_ids"] for o in arm["outputs"]])


# ----------------------------------------------------------------------------------------------
# Rows
# ----------------------------------------------------------------------------------------------


def load_json(path: str):
    with open(path) as f:
        return json.load(f)


def agreement_of(report: Dict) -> Dict:
    """The agreement figures of a quality_ab report that the study tables show."""
    section = report["agreement"]
    return {"token_agreement": section["token_agreement"], "identical_share": section["identical_share"],
            "first_divergence_median": section["first_divergence"]["median"]}


def compare_row(items, base: Dict, other: Dict, report: Dict, base_nll, other_nll) -> Dict:
    """Agreement, accuracy and NLL of one arm against the baseline arm of its concurrency."""
    return {"n_prompts": len(items), "agreement": agreement_of(report),
            "next_token_accuracy": report["reference_match"],
            "nll": {**stats.paired_mean_difference(base_nll, other_nll, BOOTSTRAP_RESAMPLES), "definition": NLL_DEFINITION},
            "elapsed_s": {"baseline": base["elapsed_s"], "other": other["elapsed_s"]}}


def model_rows(name: str, model_dir: str, items: Sequence[Item], work: str, args: argparse.Namespace,
               per_prompt: List[Dict]) -> Tuple[List[Dict], List[Dict]]:
    """(baseline rows: one per C, with the noise floor; OEA rows: one per (k0, C)) of one model.
    Appends each arm's per-prompt accuracy and NLL to `per_prompt`."""
    model = load_scorer(model_dir)
    reference = [list(it.reference) for it in items]
    reference_nll = continuation_nll(model, [it.prompt for it in items], reference)
    baselines, rows = [], []
    first = load_json(os.path.join(run_dir(work, "baseline", args.concurrency[0]), "arm_baseline.json"))
    for c in args.concurrency:
        base_dir = run_dir(work, "baseline", c)
        base = load_json(os.path.join(base_dir, "arm_baseline.json"))
        base_nll = arm_nll(model, items, base)
        keep(per_prompt, name, c, "baseline", items, base, base_nll)
        repeat = load_json(os.path.join(base_dir, "arm_baseline_repeat.json"))
        repeat_nll = arm_nll(model, items, repeat)
        keep(per_prompt, name, c, "baseline_repeat", items, repeat, repeat_nll)
        floor = compare_row(items, base, repeat, build_report(items, base, repeat), base_nll, repeat_nll)
        held_out = dict(zip(("mean", "ci95_normal"), stats.normal_mean_ci(reference_nll)))
        # Plain routing at another batch size: how far batch-dependent numerics alone move greedy output.
        batch_floor = {"against_concurrency": args.concurrency[0],
                       **agreement_of({"agreement": compare_outputs(first["outputs"], base["outputs"])})}
        baselines.append({"model": name, "concurrency": c, "noise_floor": floor, "batch_floor": batch_floor,
                          "heldout_nll": held_out})
        for k0 in args.k0:
            out = run_dir(work, f"k0_{k0}", c)
            oea = load_json(os.path.join(out, "arm_oea.json"))
            oea_nll = arm_nll(model, items, oea)
            keep(per_prompt, name, c, f"k0={k0}", items, oea, oea_nll)
            report = load_json(os.path.join(out, "quality.json"))
            rows.append({"model": name, "k0": k0, "concurrency": c,
                         **compare_row(items, base, oea, report, base_nll, oea_nll),
                         "oea_applied": report["oea_applied"],
                         "experts_per_layer_step": load_json(os.path.join(out, "experts.json"))})
    return baselines, rows


def keep(per_prompt: List[Dict], model: str, c: int, arm: str, items, outputs: Dict, nll: List[float]) -> None:
    accuracy = reference_matches(items, outputs["outputs"])
    per_prompt.append({"model": model, "concurrency": c, "arm": arm,
                       "next_token_accuracy": [None if a is None else round(a, 6) for a in accuracy],
                       "nll": [round(v, 6) for v in nll]})


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def signed(value: Optional[float], digits: int = 4) -> str:
    return "n/a" if value is None else f"{value:+.{digits}f}"


def delta(section: Dict, digits: int = 4) -> str:
    """'+0.0123 [-0.0050, +0.0300]' of a paired difference (bootstrap interval)."""
    ci = section["ci95"]
    bounds = "n/a" if ci is None else f"[{signed(ci[0], digits)}, {signed(ci[1], digits)}]"
    return f"{signed(section['mean'], digits)} {bounds}"


def experts_cell(experts: Dict) -> str:
    if experts["before"] is None:
        return "n/a"
    return f"{experts['before']:.1f} -> {experts['after']:.1f} ({experts['ratio']:.2f}x)"


def applied_cell(applied: Optional[Dict]) -> str:
    return "n/a" if applied is None or applied["share"] is None else f"{applied['share']:.3f}"


def model_table(rows: Sequence[Dict]) -> List[str]:
    lines = ["| k0 | C | token agreement | identical | accuracy base -> OEA | accuracy OEA - base [95%] | "
             "NLL base -> OEA | NLL OEA - base [95%] | T before -> after | OEA applied |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["k0"], r["concurrency"])):
        acc, nll, agree = r["next_token_accuracy"], r["nll"], r["agreement"]
        lines.append(f"| {r['k0']} | {r['concurrency']} | {agree['token_agreement']:.4f} | "
                     f"{agree['identical_share']:.3f} | {acc['baseline']:.4f} -> {acc['oea']:.4f} | {delta(acc)} | "
                     f"{nll['baseline']:.4f} -> {nll['oea']:.4f} | {delta(nll)} | "
                     f"{experts_cell(r['experts_per_layer_step'])} | {applied_cell(r['oea_applied'])} |")
    return lines


def baseline_table(baselines: Sequence[Dict]) -> List[str]:
    lines = ["| C | accuracy | NLL of output | NLL of held-out text | noise floor: agreement | "
             "accuracy repeat - base | NLL repeat - base | agreement with the baseline at C = "
             f"{baselines[0]['batch_floor']['against_concurrency']} (identical) |", "|---|---|---|---|---|---|---|---|"]
    for b in baselines:
        floor, batch = b["noise_floor"], b["batch_floor"]
        lines.append(f"| {b['concurrency']} | {floor['next_token_accuracy']['baseline']:.4f} | "
                     f"{floor['nll']['baseline']:.4f} | {b['heldout_nll']['mean']:.4f} | "
                     f"{floor['agreement']['token_agreement']:.4f} | {delta(floor['next_token_accuracy'])} | "
                     f"{delta(floor['nll'])} | {batch['token_agreement']:.4f} ({batch['identical_share']:.3f}) |")
    return lines


def render_markdown(study: Dict) -> str:
    """quality.md: the label, the settings, then per model its baseline and k0 x C tables."""
    s = study["settings"]
    lines = [f"# OEA output quality on the trained checkpoints, through the server", "",
             f"**{LABEL}.**", "",
             f"{s['num_prompts']} held-out windows per model (seed {s['seed']}): {s['prompt_len']} prompt tokens "
             f"sent as ids, {s['continuation_len']} generated tokens (greedy, ignore_eos), C requests in flight; "
             f"OEA servers: --oea-k0 K, --oea-min-batch {s['oea_min_batch']} (default), no max batch. "
             f"Differences are OEA - baseline, paired by prompt, 95% percentile bootstrap over prompts.", ""]
    for name in study["models"]:
        lines += [f"## {name}", "", "Baseline (plain routing), its noise floor (the same server, the same "
                  "prompts, run again) and its output at another concurrency:", ""]
        lines += baseline_table([b for b in study["baselines"] if b["model"] == name]) + [""]
        lines += model_table([r for r in study["rows"] if r["model"] == name]) + [""]
    lines += ["## Definitions", "",
              f"- token agreement: {AGREEMENT_DEFINITION}; identical: share of prompts whose outputs are equal.",
              f"- accuracy: next-token accuracy against the held-out continuation; {REFERENCE_DEFINITION}.",
              f"- NLL: {NLL_DEFINITION}. The baseline arm is this model's own greedy output, so any change "
              "moves it away from what the plain model prefers: this measure favours the baseline by design.",
              f"- T: {T_DEFINITION}.", f"- OEA applied: {APPLIED_DEFINITION}.",
              f"- wall time of the whole study: {study['runtime_s']:.0f} s" + reuse_note(study) + "."]
    return "\n".join(lines) + "\n"


def reuse_note(study: Dict) -> str:
    reused = study.get("reused_servers")
    return f" (not counting the servers whose arms --reuse took: {', '.join(reused)})" if reused else ""


def write_outputs(out_dir: str, study: Dict, per_prompt: List[Dict], argv: Sequence[str]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    write_json(os.path.join(out_dir, "quality.json"), study)
    with open(os.path.join(out_dir, "quality.md"), "w") as f:
        f.write(render_markdown(study))
    with open(os.path.join(out_dir, "per_prompt.jsonl"), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in per_prompt)
    write_command(out_dir, __file__, argv)


def write_command(out_dir: str, script: str, argv: Sequence[str]) -> None:
    """OUT/command.txt: the recorded environment and the command line that ran `script`."""
    env = " ".join(f"{k}={os.environ[k]}" for k in RECORDED_ENV if k in os.environ)
    with open(os.path.join(out_dir, "command.txt"), "w") as f:
        f.write((env + " " if env else "") + shlex.join([sys.executable, os.path.relpath(script), *argv]) + "\n")


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), help="folders under benchmark/oea/models")
    p.add_argument("--k0", type=int, nargs="+", default=[3, 4, 5, 6], help="one OEA server per value")
    p.add_argument("--concurrency", type=int, nargs="+", default=[4, 16], help="requests in flight, every server")
    p.add_argument("--num-prompts", type=int, default=128, help="held-out windows per model")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens")
    p.add_argument("--continuation-len", type=int, default=32, help="generated (and reference) tokens")
    p.add_argument("--seed", type=int, default=0, help="which held-out windows (training/heldout.py)")
    p.add_argument("--out-dir", required=True, help="quality.json, quality.md, per_prompt.jsonl, command.txt")
    p.add_argument("--work-dir", help="arms, quality_ab reports, server logs (default: a new temporary folder)")
    p.add_argument("--reuse", action="store_true", help="take the arms already in --work-dir instead of "
                                                        "starting their servers")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for a server")
    return p


def check_args(args: argparse.Namespace) -> None:
    for model in args.models:
        if not os.path.isfile(os.path.join(MODELS_DIR, model, "config.json")):
            raise SystemExit(f"--models: no checkpoint {model} in {MODELS_DIR}")
    if min(args.k0) < 1 or min(args.concurrency) < 1:
        raise SystemExit("--k0 and --concurrency values must be at least 1")
    if args.reuse and not args.work_dir:
        raise SystemExit("--reuse needs --work-dir")


def study_model(name: str, args: argparse.Namespace, per_prompt: List[Dict],
                reused: List[str]) -> Tuple[List[Dict], List[Dict]]:
    """Every server of one model, then its scoring: (baseline rows, OEA rows). Appends the servers
    that --reuse skipped to `reused`."""
    model_dir = os.path.join(MODELS_DIR, name)
    work = os.path.join(args.work_dir, name)
    os.makedirs(work, exist_ok=True)
    prompts = os.path.join(work, "prompts.jsonl")
    items = write_prompts(model_dir, prompts, args)
    start = time.time()
    ran = [baseline_server(model_dir, prompts, work, args)]
    ran += [oea_server(model_dir, k0, prompts, work, args) for k0 in args.k0]
    reused += [f"{name} {arm}" for arm, r in zip(["baseline"] + [f"k0={k}" for k in args.k0], ran) if not r]
    log(f"{name}: servers done in {time.time() - start:.0f} s; scoring")
    return model_rows(name, model_dir, items, work, args, per_prompt)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    check_args(args)
    args.work_dir = args.work_dir or tempfile.mkdtemp(prefix="quality_learned_")
    log(f"work dir {args.work_dir}")
    start = time.time()
    per_prompt, baselines, rows, reused = [], [], [], []
    for name in args.models:
        b, r = study_model(name, args, per_prompt, reused)
        baselines += b
        rows += r
    min_batch = {r["experts_per_layer_step"]["oea_min_batch"] for r in rows}
    settings = {key: getattr(args, key) for key in ("num_prompts", "prompt_len", "continuation_len", "seed", "k0",
                                                    "concurrency")}
    settings.update(server_flags=list(SERVER_FLAGS), oea_min_batch=min_batch.pop() if len(min_batch) == 1 else None)
    study = {"label": LABEL, "settings": settings, "models": args.models, "baselines": baselines, "rows": rows,
             "runtime_s": time.time() - start, "reused_servers": reused}
    write_outputs(args.out_dir, study, per_prompt, argv)
    print(render_markdown(study), end="")
    return 0


if __name__ == "__main__":
    with terminate_as_interrupt():  # SIGTERM stops the servers started, as Ctrl-C does
        sys.exit(main())
