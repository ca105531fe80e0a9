"""The trial's quality arms and accept-length probe (trial.py), all on the one server, k0 set live.

Quality, per arm (OEA off, then each k0), at each quality concurrency (quality_concurrencies): by
default the smallest concurrency at which the server's gate opens (--oea-min-batch requests per
replica, under DP attention counted over every attention-DP group together: where OEA gives up the
most routing), and the largest swept concurrency with an open gate;
--quality-concurrency replaces both. Each is one run of:
- lm-eval: lm-evaluation-harness's `local-completions` model against the server's
  /v1/completions, the operator's task, samples logged. It runs in one long-lived process
  (serving/_bench_driver.py, entry lm_eval.__main__:cli_evaluate: exactly what the `lm_eval`
  command runs, imported once for every arm), in its own process group, started at the preflight
  to check the task (`lm_eval validate`) and killed at the end (LmEvalClient).
- quality-ab: quality_ab.py's client and measures on the operator's JSONL prompts: accuracy
  (prompts with an answer) or reference match (prompts with reference_ids).
Each k0 is compared with OEA off per sample (doc or prompt), paired: the mean difference with a 95%
percentile bootstrap interval (common/stats.paired_mean_difference). It is within its bound when
the interval's worse end stays within --quality-margin of zero. A quality concurrency past the
first runs only when it fits the budget (budget.Budget.quality_fits).

Accept length, under speculative decoding: SGLang's own per-request figure (completion tokens /
verify passes, asked with return_spec_tokens_details), greedy, at each open concurrency, per arm,
on fresh prompts of the prompt file round after round; OEA against off paired by prompt:
mean(OEA - off) / mean(off) with the bootstrap interval of the numerator. Non-inferior when the
interval's lower end is above -ACCEPT_BOUND (-5%). The probe is sized for that bound: a first round
of the floor's prompts (--accept-prompts, at least 2 C), then rounds sized from the interval's width
until every k0's interval is clear of the bound (all above it, or all below), the concurrency's
share of the budget is spent, or the prompt file runs out; each check says which ("sized").
"""

import argparse
import glob
import importlib.util
import json
import math
import os
import random
import shlex
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from common import stats
from serving.bench_client import BenchDriver
from serving.live_settings import apply_settings, arm_settings, confirm_settings
from common.oea_metrics import applied_share, kept_router_mass
from serving.quality_client import fetch_text, run_arm, served_model
from serving.quality_inputs import Item, load_prompts
from serving.quality_report import write_report
from serving.quality_scoring import BOOTSTRAP_RESAMPLES, grade, reference_matches
from serving.servers import child_env, log
from trial.budget import Budget, share_of

ACCEPT_BOUND = 0.05  # accept length: OEA - off may lose at most 5% of off's mean (lower 95% bound)
ACCEPT_FLOOR = 32  # the accept-length probe's first round, in prompts, at the least (--accept-prompts)
ACCEPT_POOL = 1024  # default prompts written for the probe to draw from, at most (prompts.py)
LM_EVAL_PACKAGES = ("lm_eval", "tenacity", "aiohttp")  # lm-eval[api]: what local-completions imports
LM_EVAL_INSTALL = ("pip install 'sglang-oea[trial]' (or: pip install 'lm-eval[api]>=0.4,<0.5'; "
                   "lm-evaluation-harness 0.4.x)")
HELDOUT_TASK = "oea_heldout_lines"


def lm_eval_missing() -> Optional[str]:
    """Why --quality lm-eval cannot run here (None when it can): the packages it needs, and the install line."""
    missing = [p for p in LM_EVAL_PACKAGES if importlib.util.find_spec(p) is None]
    if not missing:
        return None
    return f"--quality lm-eval needs lm-evaluation-harness with its API extra ({', '.join(missing)} missing): " \
           f"{LM_EVAL_INSTALL}"


def paired_check(base: Sequence[float], oea: Sequence[float], margin: float, higher_is_better: bool = True) -> Dict:
    """OEA minus off of a per-sample measure paired by sample: {"n", "baseline", "oea", "delta",
    "low", "high", "margin", "within"}: within when the worse end of the 95% bootstrap interval is
    no further than `margin` from zero (the low end when higher is better, else the high end)."""
    diff = stats.paired_mean_difference(base, oea, BOOTSTRAP_RESAMPLES)
    low, high = diff["ci95"] if diff["ci95"] else (diff["mean"], diff["mean"])
    within = (low >= -margin) if higher_is_better else (high <= margin)
    return {"n": diff["n"], "baseline": diff["baseline"], "oea": diff["oea"], "delta": diff["mean"], "low": low,
            "high": high, "margin": margin, "higher_is_better": higher_is_better, "within": bool(within),
            "method": diff["method"]}


def accept_check(off: Sequence[float], oea: Sequence[float], bound: float = ACCEPT_BOUND) -> Dict:
    """Accept length's non-inferiority, paired by prompt: {"off", "oea" (means), "change" (mean(OEA -
    off) / mean(off)), "low", "high" (its 95% bootstrap interval, same scale), "bound",
    "non_inferior": low > -bound}."""
    diff = stats.paired_mean_difference(off, oea, BOOTSTRAP_RESAMPLES)
    scale = diff["baseline"]
    low, high = diff["ci95"] if diff["ci95"] else (diff["mean"], diff["mean"])
    return {"n": diff["n"], "off": scale, "oea": diff["oea"], "change": diff["mean"] / scale, "low": low / scale,
            "high": high / scale, "bound": -bound, "non_inferior": bool(low / scale > -bound),
            "method": "paired by prompt: mean(OEA - off) / mean(off); interval: percentile bootstrap of the "
                      f"numerator ({BOOTSTRAP_RESAMPLES} resamples) over mean(off)"}


def each_arm(url: str, k0s: Sequence[int], admin_api_key: Optional[str],
             run: Callable[[str, int], object]) -> Tuple[Dict[int, object], Dict[int, Optional[Dict]]]:
    """run(name, k0) for OEA off then every k0, each set live first (accepted on every scheduler)
    and confirmed in force after. Returns ({k0: what run returned}, {k0: the share of decode steps
    OEA applied during it, counted by the k0 label (oea_metrics.applied_share), with its mean
    "kept_router_mass" added (oea_metrics.kept_router_mass; None without the counters)})."""
    out, applied = {}, {}
    for k0 in [0, *k0s]:
        apply_settings(url, arm_settings(k0), admin_api_key)
        before = fetch_text(url + "/metrics")
        out[k0] = run("off" if k0 == 0 else f"k0_{k0}", k0)
        after = fetch_text(url + "/metrics")
        applied[k0] = applied_share(before, after, k0)
        if applied[k0] is not None:
            applied[k0]["kept_router_mass"] = kept_router_mass(before, after, k0)
        confirm_settings(url, arm_settings(k0))
    return out, applied


def exercised(check: Dict, applied: Optional[Dict]) -> Dict:
    """check with the OEA arm's applied share added; a comparison in which OEA applied in no decode
    step compared SGLang's routing with itself, so it is not taken as within its bound."""
    check = {**check, "oea_applied": applied}
    if not applied or not applied.get("applied_steps"):
        check.update(within=False, note="OEA applied in no decode step of this arm: the comparison did not exercise "
                                        "it (too few requests in flight for the gate, or a task that only prefills, "
                                        "such as a loglikelihood task)")
    return check


# ----------------------------------------------------------------------------- lm-eval


def lm_eval_argv(args, url: str, model: str, concurrency: int, output_path: str) -> List[str]:
    """The `lm_eval` arguments of one arm: local-completions against the server, samples logged."""
    model_args = (f"model={model},base_url={url}/v1/completions,num_concurrent={concurrency},max_retries=3,"
                  f"tokenized_requests=False,tokenizer={args.tokenizer},tokenizer_backend=huggingface")
    argv = ["--model", "local-completions", "--model_args", model_args, "--tasks", args.lm_eval_task,
            "--log_samples", "--output_path", output_path, "--gen_kwargs", "temperature=0,do_sample=False"]
    argv += ["--include_path", os.path.abspath(args.lm_eval_include)] if args.lm_eval_include else []
    argv += ["--limit", str(args.lm_eval_limit)] if args.lm_eval_limit else []
    return argv + shlex.split(args.lm_eval_args or "")


def lm_eval_samples(output_path: str, metric: Optional[str], filter_name: Optional[str]) -> Tuple[Dict, Dict]:
    """({(task, doc_id): value}, {"metric", "filter", "higher_is_better"}) from one arm's logged
    samples; metric and filter default to the first ones the samples name. RuntimeError without samples."""
    files = sorted(glob.glob(os.path.join(output_path, "**", "samples_*.jsonl"), recursive=True))
    if not files:
        raise RuntimeError(f"lm-eval logged no samples under {output_path} (see its log)")
    values, meta = {}, {"metric": metric, "filter": filter_name}
    for path in files:
        task = os.path.basename(path)[len("samples_"):].rsplit("_", 1)[0]
        with open(path) as f:
            for row in map(json.loads, filter(str.strip, f)):
                meta["filter"] = meta["filter"] or row.get("filter")
                meta["metric"] = meta["metric"] or (row.get("metrics") or [None])[0]
                if row.get("filter") == meta["filter"] and meta["metric"] in row:
                    values[(task, row["doc_id"])] = float(row[meta["metric"]])
    meta["higher_is_better"] = higher_is_better(output_path, meta["metric"])
    return values, meta


def higher_is_better(output_path: str, metric: Optional[str]) -> bool:
    """The task's own word on `metric` (results_*.json), True when it gives none."""
    for path in glob.glob(os.path.join(output_path, "**", "results_*.json"), recursive=True):
        with open(path) as f:
            for per_task in json.load(f).get("higher_is_better", {}).values():
                if metric in per_task:
                    return bool(per_task[metric])
    return True


class LmEvalClient:
    """lm-eval in one long-lived process, in its own process group: the driver imports
    lm_eval.__main__ once, then runs `lm_eval ARGS` (cli_evaluate) per request. Started at the
    preflight to check the task (`lm_eval validate`), kept for the arms, killed by close()."""

    def __init__(self, out_dir: str, timeout_s: float, env: Optional[Dict[str, str]] = None):
        """env: the driver's environment (default child_env(); the trial passes servers.client_env,
        whose OPENAI_API_KEY local-completions sends as the server's API key)."""
        os.makedirs(out_dir, exist_ok=True)
        self.out_dir, self.timeout_s = out_dir, timeout_s
        self.driver = BenchDriver("lm_eval.__main__", os.path.join(out_dir, "lm_eval_driver.log"),
                                  child_env() if env is None else env, timeout_s, entry="cli_evaluate")

    def run(self, argv: List[str], name: str) -> Tuple[int, str]:
        """`lm_eval ARGV` in the driver; (its exit status, its log's path)."""
        log_path = os.path.join(self.out_dir, f"lm_eval_{name}.log")
        with open(log_path, "w") as f:
            f.write(shlex.join(["lm_eval", *argv]) + "\n# run in the lm-eval driver process\n")
        return self.driver.run(argv, log_path, self.timeout_s), log_path

    def check_task(self, task: str, include: Optional[str]) -> Optional[str]:
        """Why the task cannot run (None when lm-eval finds it): `lm_eval validate`."""
        argv = ["validate", "--tasks", task] + (["--include_path", os.path.abspath(include)] if include else [])
        try:
            rc, log_path = self.run(argv, "validate")
        except RuntimeError as e:
            return f"lm-eval did not start ({str(e).splitlines()[0]}); see {self.driver.log_path}"
        if rc == 0:
            return None
        with open(log_path) as f:
            said = " ".join(line.strip() for line in f.readlines()[2:] if line.strip())[-300:]
        return f"lm-eval does not know --lm-eval-task {task} ({said}); see {log_path}"

    def close(self) -> None:
        self.driver.close(kill=True)


def run_lm_eval(args, url: str, k0s: Sequence[int], concurrency: int, client: LmEvalClient,
                budget: Optional[Budget] = None) -> Dict:
    """Every arm through lm-eval (client) at one concurrency, its files under lm_eval_<arm>_c<C>;
    each k0 paired with off. The first arm's time goes to the budget's estimates."""
    model = served_model(url)

    def arm(name: str, k0: int) -> Tuple[Dict, Dict]:
        output_path = os.path.join(client.out_dir, f"lm_eval_{name}_c{concurrency}")
        log(f"quality: lm-eval {args.lm_eval_task}, arm {name}, {concurrency} requests in flight")
        t0 = time.time()
        rc, log_path = client.run(lm_eval_argv(args, url, model, concurrency, output_path), f"{name}_c{concurrency}")
        if rc != 0:
            raise RuntimeError(f"lm_eval failed (exit code {rc}) in arm {name}; see {log_path}")
        if budget is not None:
            budget.quality_arm_s.setdefault(concurrency, time.time() - t0)
        return lm_eval_samples(output_path, args.lm_eval_metric, args.lm_eval_filter)

    arms, applied = each_arm(url, k0s, args.admin_api_key, arm)
    base, meta = arms[0]
    results = {}
    for k0 in k0s:
        values = arms[k0][0]
        keys = sorted(set(base) & set(values))
        results[k0] = exercised(paired_check([base[k] for k in keys], [values[k] for k in keys], args.quality_margin,
                                             meta["higher_is_better"]), applied[k0])
    return {"tool": "lm-eval", "task": args.lm_eval_task, "metric": meta["metric"], "filter": meta["filter"],
            "concurrency": concurrency, "per_k0": results}


# ----------------------------------------------------------------------------- quality_ab


def sample_scores(items: Sequence[Item], outputs: Sequence[Dict]) -> Tuple[str, List[Optional[float]]]:
    """(measure, per-prompt score): accuracy (1 or 0) where the prompts have answers, else the
    reference match of prompts with reference_ids; None for a prompt without either."""
    if any(it.answer is not None for it in items):
        return "accuracy", [None if it.answer is None else float(grade(it, out["text"]))
                            for it, out in zip(items, outputs)]
    return "reference match", reference_matches(items, outputs)


def run_quality_ab(args, url: str, k0s: Sequence[int], concurrency: int, out_dir: str,
                   budget: Optional[Budget] = None) -> Dict:
    """Every arm through quality_ab's client at one concurrency; each k0 paired with off (quality_ab's
    own report files for each k0 in out_dir/quality_ab_k0_<k0>_c<C>/). The first arm's time goes to
    the budget's estimates."""
    items = load_prompts(args.quality_prompts)
    opts = argparse.Namespace(concurrency=concurrency, max_tokens=args.quality_max_tokens, ignore_eos=False,
                              model=None, timeout=args.run_timeout)
    arms, applied = each_arm(url, k0s, args.admin_api_key,
                             lambda name, k0: run_arm(f"{name}_c{concurrency}", url, items, opts))
    if budget is not None and arms[0].get("elapsed_s"):
        budget.quality_arm_s.setdefault(concurrency, arms[0]["elapsed_s"])
    results, measure = {}, None
    for k0 in k0s:
        report_dir = os.path.join(out_dir, f"quality_ab_k0_{k0}_c{concurrency}")
        os.makedirs(report_dir, exist_ok=True)
        write_report(report_dir, items, {"baseline": arms[0], "oea": arms[k0]})
        measure, base = sample_scores(items, arms[0]["outputs"])
        _, oea = sample_scores(items, arms[k0]["outputs"])
        pairs = [(b, o) for b, o in zip(base, oea) if b is not None and o is not None]
        results[k0] = exercised(paired_check([b for b, _ in pairs], [o for _, o in pairs], args.quality_margin),
                                applied[k0])
    return {"tool": "quality-ab", "prompts": args.quality_prompts, "metric": measure, "concurrency": concurrency,
            "per_k0": results}


# ----------------------------------------------------------------------------- accept length


def decided(check: Dict) -> bool:
    """Whether an accept_check's interval is clear of its bound: wholly above it (non-inferior) or
    wholly below it (shown worse); more prompts would not change the verdict."""
    return check["low"] > check["bound"] or check["high"] < check["bound"]


def next_round(checks: Dict[int, Dict], used: int, conc: int, available: int, affordable: int) -> int:
    """Prompts of the accept probe's next round: enough for the least decided k0's interval to
    clear the bound, its half-width taken to shrink as 1/sqrt(n) (x 1.2 for margin), at least C and
    at most 3 x the prompts used so far; no more than the prompts still available or affordable in
    time; 0 when not even C (or what is left of the file) fits."""
    need = 0
    for check in checks.values():
        if decided(check):
            continue
        half, gap = (check["high"] - check["low"]) / 2, abs(check["change"] - check["bound"])
        total = used * 1.2 * (half / gap) ** 2 if gap > 0 else 3 * used
        need = max(need, math.ceil(total) - used)
    size = min(max(need, conc), 3 * used, available)
    if size <= affordable:
        return size
    return affordable if affordable >= min(conc, available) else 0


def accept_at(url: str, k0s: Sequence[int], conc: int, prompts: Sequence[str], output_len: int,
              admin_api_key: Optional[str], timeout: float, floor: int, time_left: Callable[[], float],
              budget: Optional[Budget] = None) -> Dict[int, Dict]:
    """{k0: accept_check} at one concurrency, sized for its bound (see the module doc), each with
    "prompts" (paired prompts), "rounds", "floor" and "sized" (why the probe stopped there)."""
    opts = argparse.Namespace(concurrency=conc, max_tokens=output_len, ignore_eos=True, model=None,
                              timeout=timeout, spec_details=True)
    lengths: Dict[int, List[float]] = {k0: [] for k0 in [0, *k0s]}
    first = min(max(floor, 2 * conc), len(prompts))
    size, used, rounds = first, 0, 0
    while True:
        items = [Item(p) for p in prompts[used:used + size]]
        log(f"accept length: round {rounds + 1}, {len(items)} prompts at C={conc}, OEA off and k0 "
            f"{' '.join(map(str, k0s))}")
        t0 = time.time()
        arms, _ = each_arm(url, k0s, admin_api_key,
                           lambda name, k0: run_arm(f"{name}_c{conc}_round{rounds}", url, items, opts))
        per_prompt = (time.time() - t0) / len(items)
        for k0, arm in arms.items():
            lengths[k0] += [o["spec"]["accept_length"] for o in arm["outputs"]]
            if budget is not None and arm.get("elapsed_s"):
                budget.speed.add(conc, len(items) * output_len / arm["elapsed_s"], "the accept-length probe")
        used, rounds = used + len(items), rounds + 1
        checks = {k0: accept_check(lengths[0], lengths[k0]) for k0 in k0s}
        if all(decided(c) for c in checks.values()):
            stop = f"its interval cleared the bound after {used} prompts"
            break
        if used >= len(prompts):
            stop = f"the prompt file ran out at {used} prompts, the interval not clear of the bound"
            break
        left = time_left()
        affordable = len(prompts) if math.isinf(left) or per_prompt <= 0 else int(max(left, 0.0) // per_prompt)
        size = next_round(checks, used, conc, len(prompts) - used, affordable)
        if size <= 0:
            stop = f"the budget ended at {used} prompts, the interval not clear of the bound"
            break
    for check in checks.values():
        check.update(prompts=used, rounds=rounds, floor=first,
                     sized=f"cleared the bound after {used} prompts" if decided(check) else stop)
    return checks


def accept_probe(url: str, k0s: Sequence[int], concurrencies: Sequence[int], prompts: Sequence[str], output_len: int,
                 admin_api_key: Optional[str], timeout: float, floor: int = ACCEPT_FLOOR,
                 time_left: Callable[[], float] = lambda: math.inf,
                 budget: Optional[Budget] = None) -> Dict[int, Dict[int, Dict]]:
    """{C: {k0: accept_check}} at each open concurrency (accept_at), each concurrency sharing what
    time_left() gives with those after it; every concurrency's probe draws the same prompts."""
    out = {}
    for i, conc in enumerate(concurrencies):
        share = share_of(time_left, len(concurrencies) - i)
        out[conc] = accept_at(url, k0s, conc, prompts, output_len, admin_api_key, timeout, floor, share, budget)
    return out


def quality_concurrencies(pre, override: Optional[Sequence[int]]) -> List[Dict]:
    """[{"concurrency", "why", "rows"}] of the quality step: --quality-concurrency, else the smallest
    concurrency at which the server's gate opens and the largest swept one with an open gate (once
    when they are equal); rows: the token rows of the pass OEA routes there (one replica's, or under
    DP attention every group's gathered)."""
    if override:
        chosen = [(c, "--quality-concurrency") for c in dict.fromkeys(override)]
    else:
        smallest, largest = pre.smallest_open_concurrency(), max(pre.open_concurrencies)
        floor, replicas, groups = pre.original.get("oea_min_batch", 1), pre.limits.replicas, pre.limits.groups
        where = (f"min_batch {floor} request{'s' if floor != 1 else ''}"
                 + (f" on each of {replicas} replicas" if replicas > 1 else "")
                 + (f" counted over {groups} attention-DP groups together" if groups > 1 else "")
                 + (f", {pre.rows_per_request} rows each" if pre.rows_per_request > 1 else ""))
        chosen = [(smallest, f"the smallest concurrency at which the gate opens ({where}): where OEA gives up the "
                             "most routing")]
        if largest != smallest:
            chosen.append((largest, "the largest swept concurrency with an open gate"))
    return [{"concurrency": c, "why": why, "rows": pre.gate(c).rows} for c, why in chosen]


def run_quality(args, url: str, k0s: Sequence[int], quality_at: Sequence[Dict], budget: Budget,
                lm_eval: Optional["LmEvalClient"]) -> Optional[List[Dict]]:
    """The quality step at each of its concurrencies (quality_concurrencies), a later one only when it
    fits the budget; [one result per concurrency run, with its "why" and "rows"], or None with
    --quality none."""
    if args.quality == "none":
        return None
    runs = []
    for i, where in enumerate(quality_at):
        conc = where["concurrency"]
        if not budget.quality_fits(conc, first=i == 0):
            continue
        if args.quality == "lm-eval":
            result = run_lm_eval(args, url, k0s, conc, lm_eval, budget)
        else:
            out = os.path.join(args.out_dir, "quality")
            os.makedirs(out, exist_ok=True)
            result = run_quality_ab(args, url, k0s, conc, out, budget)
        runs.append({**result, "why": where["why"], "rows": where["rows"]})
    return runs


# ----------------------------------------------------------------------------- a local task


def write_heldout_task(model_dir: str, out_dir: str, count: int, seed: int = 0) -> str:
    """An lm-eval task from a trained checkpoint's heldout.txt, with local data only (no download):
    each doc is 400 characters of held-out Python source plus the first part of a line; the target
    is the rest of that line; generate_until a newline, exact match. Writes out_dir/<task>.yaml and
    its data file; returns the task name (give out_dir as --lm-eval-include)."""
    from training import train_moe  # the held-out reader of the trained checkpoints (imports torch)

    candidates = []
    for _, text in train_moe.read_heldout(os.path.join(model_dir, "heldout.txt")):
        pos = 0
        for line in text.splitlines(keepends=True):
            body = line.rstrip("\n")
            if pos >= 400 and len(body.strip()) >= 24 and " " in body.strip():
                candidates.append((text[pos - 400:pos], body))
            pos += len(line)
    random.Random(seed).shuffle(candidates)
    os.makedirs(out_dir, exist_ok=True)
    data = os.path.join(os.path.abspath(out_dir), f"{HELDOUT_TASK}.jsonl")
    with open(data, "w") as f:
        for before, body in candidates[:count]:
            indent = len(body) - len(body.lstrip())
            spaces = [i for i, c in enumerate(body) if c == " " and indent + 4 < i < len(body) - 4] or [len(body) // 2]
            cut = spaces[len(spaces) // 2]
            f.write(json.dumps({"context": before + body[:cut], "target": body[cut:]}) + "\n")
    with open(os.path.join(out_dir, f"{HELDOUT_TASK}.yaml"), "w") as f:
        f.write(HELDOUT_YAML.format(task=HELDOUT_TASK, data=data))
    return HELDOUT_TASK


HELDOUT_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 24
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
