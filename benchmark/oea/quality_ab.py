"""Output quality A/B: the same prompts through a baseline server and an OEA server, as served.

OEA changes outputs only in decode batches of at least --oea-min-batch requests, so both arms send
the same prompts, in the same order, at the same fixed concurrency (a pool of N requests in
flight), greedy (temperature 0). The arms run one after the other, never at the same time.

    python benchmark/oea/quality_ab.py --base-url http://127.0.0.1:30000 \
        --oea-url http://127.0.0.1:30001 --prompts prompts.jsonl --concurrency 16 \
        --max-tokens 256 --out quality_out

    # one machine, one server at a time: save the baseline arm, restart with --oea-k0, compare
    python benchmark/oea/quality_ab.py --base-url URL --prompts p.jsonl --concurrency 16 --out q
    python benchmark/oea/quality_ab.py --oea-url URL --baseline-from q/arm_baseline.json \
        --prompts p.jsonl --concurrency 16 --out q
    # both arms saved: the report alone, no server
    python benchmark/oea/quality_ab.py --baseline-from q/arm_baseline.json --oea-from q/arm_oea.json \
        --prompts p.jsonl --concurrency 16 --out q

Prompts: JSONL, one object a line: {"prompt": str | [token id, ...], "answer": str|number
(optional), "answer_regex": str (optional), "reference_ids": [token id, ...] (optional)}. A prompt
given as token ids is sent as ids (the completion `prompt` may be a list of ids), so the server sees
exactly those tokens. The extracted answer is the first group (or the whole match) of the first
match of the line's answer_regex, else --answer-regex, else the whole output; it is correct when it
equals the answer after stripping surrounding whitespace. `reference_ids` is a true continuation
(e.g. held-out text): each arm's reference match is the share of its generated positions whose
token id equals the reference's at that position.

Tokens are compared by id: SGLang's /v1/completions returns the generated ids in
choices[0].token_ids when asked with "return_token_ids": true (logprobs tokens are display
strings, and two ids can render the same).

Writes DIR/quality.json, DIR/quality.md (printed too), DIR/outputs.jsonl (per prompt) and
DIR/arm_<name>.json (each arm's raw outputs, reusable with --baseline-from / --oea-from).
"""

import argparse
import hashlib
import json
import math
import os
import random
import re
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Optional, Pattern, Sequence, Tuple, Union

Z95 = 1.959963984540054  # two-sided 95% normal quantile
METRIC_PREFIX = "sglang:oea_"
APPLIED = METRIC_PREFIX + "decode_steps_applied_total"
SKIPPED = METRIC_PREFIX + "decode_steps_skipped_total"
NOT_DECODE = "not_decode"  # skip reason of prefill / extend passes: not decode steps
AGREEMENT_DEFINITION = ("positional: position i of a prompt agrees when both arms generated the same token id "
                        "at i; counted for i < the shorter output's length, pooled over all prompts")
APPLIED_DEFINITION = ("applied / (applied + skipped for every reason but not_decode), counter deltas of the "
                      "OEA server's /metrics over the OEA arm, lowest tp_rank; OEA exports its counters once per "
                      "--decode-log-interval, so start that server with --decode-log-interval 1 for exact counts")
DIVERGENCE_DEFINITION = ("first index i where the token ids differ; when one output is a prefix of the other, "
                         "the shorter length; over the outputs that are not identical")
REFERENCE_DEFINITION = ("per prompt: the share of positions i < min(output length, reference length) where the "
                        "generated token id equals reference_ids[i] (free-running: after a miss the output "
                        "continues from its own tokens); then the mean over prompts")
BOOTSTRAP_RESAMPLES = 4000


class InputError(ValueError):
    """Bad user input (file, JSONL line, regex, flag); main prints it and exits with 2."""


Prompt = Union[str, Tuple[int, ...]]  # text, or token ids sent as ids


@dataclass(frozen=True)
class Item:
    """One prompt; `answer` None when it has none, `reference` (true continuation ids) None likewise."""

    prompt: Prompt
    answer: Optional[str] = None
    regex: Optional[Pattern] = None
    reference: Optional[Tuple[int, ...]] = None


# ----------------------------------------------------------------------------------------------
# Input
# ----------------------------------------------------------------------------------------------


def compile_regex(text: object, where: str) -> Pattern:
    """`text` compiled; InputError naming `where` when it is not a valid regex string."""
    if not isinstance(text, str):
        raise InputError(f"{where}: must be a string, got {type(text).__name__}")
    try:
        return re.compile(text)
    except re.error as e:
        raise InputError(f"{where}: invalid regex {text!r}: {e}") from None


def token_ids(value: object) -> Optional[Tuple[int, ...]]:
    """`value` as a tuple of token ids when it is a non-empty list of non-negative ints, else None."""
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return None
    return tuple(value)


def parse_prompt(value: object, where: str) -> Prompt:
    """A line's 'prompt': a non-empty string, or a non-empty list of token ids (tuple)."""
    if isinstance(value, str) and value:
        return value
    ids = token_ids(value)
    if ids is None:
        raise InputError(f"{where}: field 'prompt' must be a non-empty string or a non-empty list of "
                         "token ids (integers >= 0)")
    return ids


def parse_item(line: str, where: str, default_regex: Optional[Pattern]) -> Item:
    """One JSONL line; `where` is 'FILE:LINE' for the error messages."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    prompt = parse_prompt(obj.get("prompt"), where)
    answer = obj.get("answer")
    if answer is not None and (isinstance(answer, bool) or not isinstance(answer, (str, int, float))):
        raise InputError(f"{where}: field 'answer' must be a string or a number")
    regex = default_regex
    if "answer_regex" in obj:
        regex = compile_regex(obj["answer_regex"], f"{where}: field 'answer_regex'")
    reference = None
    if "reference_ids" in obj:
        reference = token_ids(obj["reference_ids"])
        if reference is None:
            raise InputError(f"{where}: field 'reference_ids' must be a non-empty list of token ids (integers >= 0)")
    return Item(prompt, None if answer is None else str(answer), regex, reference)


def load_prompts(path: str, default_regex: Optional[Pattern] = None) -> List[Item]:
    """The items of a JSONL file (blank lines skipped); InputError on any problem."""
    if not os.path.isfile(path):
        raise InputError(f"--prompts: no such file: {path}")
    with open(path, encoding="utf-8") as f:
        items = [parse_item(line, f"{path}:{n}", default_regex) for n, line in enumerate(f, 1) if line.strip()]
    if not items:
        raise InputError(f"--prompts: {path} holds no prompts")
    return items


def prompts_digest(items: Sequence[Item]) -> str:
    """sha256 of the prompts (texts or id lists) in order: ties a saved arm to its prompts."""
    return hashlib.sha256(json.dumps([it.prompt for it in items]).encode()).hexdigest()


# ----------------------------------------------------------------------------------------------
# Statistics (pure)
# ----------------------------------------------------------------------------------------------


def first_divergence(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """First index where `a` and `b` differ (the shorter length if one is a prefix); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def token_agreement(pairs: Sequence[Tuple[Sequence[int], Sequence[int]]]) -> Dict:
    """Positional agreement and identical share over (baseline ids, oea ids) pairs.

    Returns {"token_agreement": agreeing / compared (None when nothing to compare), "positions_compared",
    "positions_agreeing", "identical", "n", "identical_share", "definition"}.
    """
    compared = sum(min(len(a), len(b)) for a, b in pairs)
    agreeing = sum(x == y for a, b in pairs for x, y in zip(a, b))
    identical = sum(list(a) == list(b) for a, b in pairs)
    return {"token_agreement": agreeing / compared if compared else None, "positions_compared": compared,
            "positions_agreeing": agreeing, "identical": identical, "n": len(pairs),
            "identical_share": identical / len(pairs) if pairs else None, "definition": AGREEMENT_DEFINITION}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1) of non-empty `values`, linear between order statistics."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def bucket_label(index: int) -> str:
    """Power-of-two bucket of a position: 0, 1, 2-3, 4-7, 8-15, ..."""
    if index < 2:
        return str(index)
    low = 1 << (index.bit_length() - 1)
    return f"{low}-{2 * low - 1}"


def divergence_histogram(positions: Sequence[int]) -> List[Dict]:
    """[{"bucket", "count"}] over power-of-two buckets from 0 up to the largest position's bucket."""
    if not positions:
        return []
    top = max(positions).bit_length()  # bucket number: 0 -> 0, 1 -> 1, 2-3 -> 2, ...
    counts = [0] * (top + 1)
    for p in positions:
        counts[p.bit_length()] += 1
    labels = [bucket_label(0)] + [bucket_label(1 << (b - 1)) for b in range(1, top + 1)]
    return [{"bucket": label, "count": c} for label, c in zip(labels, counts)]


def divergence_summary(positions: Sequence[int]) -> Dict:
    """min/p25/median/p75/max and the histogram of first-divergence positions (None stats if empty)."""
    stats = {name: (percentile(positions, q) if positions else None)
             for name, q in (("min", 0.0), ("p25", 0.25), ("median", 0.5), ("p75", 0.75), ("max", 1.0))}
    return {"count": len(positions), **stats, "histogram": divergence_histogram(positions),
            "definition": DIVERGENCE_DEFINITION}


def wilson_interval(successes: int, n: int, z: float = Z95) -> Optional[Tuple[float, float]]:
    """Wilson score interval of a binomial proportion; None when n == 0."""
    if n == 0:
        return None
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # Exact ends at 0 and n: rounding would otherwise put the bound a hair inside the estimate.
    low = 0.0 if successes == 0 else max(0.0, center - half)
    high = 1.0 if successes == n else min(1.0, center + half)
    return low, high


def mcnemar_exact_p(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: binomial(b + c, 1/2) test of the discordant counts."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def normal_interval(values: Sequence[float], z: float = Z95) -> Tuple[Optional[float], Optional[Tuple[float, float]]]:
    """(mean, mean +- z * sd / sqrt(n)) of `values`, sd with n - 1; (None, None) when empty, CI None for n < 2."""
    n = len(values)
    if n == 0:
        return None, None
    mean = sum(values) / n
    if n < 2:
        return mean, None
    half = z * math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) / math.sqrt(n)
    return mean, (mean - half, mean + half)


def bootstrap_interval(values: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES,
                       seed: int = 0) -> Optional[Tuple[float, float]]:
    """Percentile bootstrap 95% interval of the mean of `values` (n >= 2, else None).

    `resamples` means of n draws with replacement from a Random(seed); the 2.5% and 97.5%
    percentiles of those means. Seeded, so a report is reproducible from its inputs.
    """
    n = len(values)
    if n < 2:
        return None
    rng = random.Random(seed)
    means = [math.fsum(rng.choices(values, k=n)) / n for _ in range(resamples)]
    return percentile(means, 0.025), percentile(means, 0.975)


def paired_mean_difference(base: Sequence[float], oea: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES,
                           seed: int = 0) -> Dict:
    """OEA minus baseline of a per-prompt measure: [n] floats each arm, paired by prompt.

    d_i = oea_i - base_i; returns {"n", "baseline", "oea" (arm means), "mean" (mean d), "ci95" (percentile
    bootstrap over prompts), "ci95_normal" (mean +- 1.96 sd/sqrt(n)), "method"}.
    """
    assert len(base) == len(oea), f"{len(base)=} {len(oea)=}"
    diffs = [o - b for b, o in zip(base, oea)]
    mean, normal = normal_interval(diffs)
    return {"n": len(diffs), "baseline": normal_interval(base)[0], "oea": normal_interval(oea)[0], "mean": mean,
            "ci95": bootstrap_interval(diffs, resamples, seed), "ci95_normal": normal,
            "method": f"paired over prompts; ci95: percentile bootstrap of the mean difference ({resamples} "
                      f"resamples, seed {seed}); ci95_normal: mean +- 1.96 sd/sqrt(n), sd with n-1"}


def paired_difference(base: Sequence[bool], oea: Sequence[bool], z: float = Z95) -> Dict:
    """OEA minus baseline accuracy over paired outcomes, with a normal-approximation CI.

    d_i = oea_i - base_i in {-1, 0, 1}; CI = mean(d) +- z * sd(d) / sqrt(n), sd with n - 1
    (None for n < 2). Also the discordant counts and the exact McNemar p-value.
    """
    assert len(base) == len(oea), f"{len(base)=} {len(oea)=}"
    diffs = [int(o) - int(b) for b, o in zip(base, oea)]
    mean, ci = normal_interval(diffs, z)
    oea_only, base_only = diffs.count(1), diffs.count(-1)
    return {"mean": mean, "ci95": ci, "oea_only_correct": oea_only, "baseline_only_correct": base_only,
            "mcnemar_exact_p": mcnemar_exact_p(base_only, oea_only),
            "method": "normal approximation on paired differences (sd with n-1); exact McNemar p on discordant pairs"}


def extract_answer(text: str, regex: Optional[Pattern]) -> Optional[str]:
    """First group (or the whole match) of the first match of `regex`; the whole text without one."""
    if regex is None:
        return text.strip()
    match = regex.search(text)
    if match is None:
        return None
    return (match.group(1) if regex.groups else match.group(0)).strip()


def reference_match(generated: Sequence[int], reference: Sequence[int]) -> Optional[float]:
    """Share of positions i < min(len) where generated[i] == reference[i]; None when either is empty."""
    compared = min(len(generated), len(reference))
    if compared == 0:
        return None
    return sum(g == r for g, r in zip(generated, reference)) / compared


def arm_accuracy(correct: Sequence[bool]) -> Dict:
    """Correct count, accuracy and its Wilson 95% interval."""
    n = len(correct)
    return {"correct": sum(correct), "n": n, "accuracy": sum(correct) / n if n else None,
            "ci95": wilson_interval(sum(correct), n)}


# ----------------------------------------------------------------------------------------------
# /metrics: OEA step counters
# ----------------------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([^#\s{]+)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_oea_counters(text: str) -> Dict[str, Dict]:
    """Applied / skipped step counters of a /metrics page, per tp_rank ('' when unlabelled).

    Returns {rank: {"applied": float, "skipped": {reason: float}}}; labels other than tp_rank and
    reason (model_name) are summed over.
    """
    out: Dict[str, Dict] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or match.group(1) not in (APPLIED, SKIPPED):
            continue
        labels = dict(_LABEL.findall(match.group(2) or ""))
        rank = out.setdefault(labels.get("tp_rank", ""), {"applied": 0.0, "skipped": {}})
        if match.group(1) == APPLIED:
            rank["applied"] += float(match.group(3))
        else:
            reason = labels.get("reason", "")
            rank["skipped"][reason] = rank["skipped"].get(reason, 0.0) + float(match.group(3))
    return out


def lowest_rank(counters: Dict[str, Dict]) -> Optional[str]:
    """The smallest tp_rank label (numerically when it is a number); None without counters."""
    if not counters:
        return None
    return min(counters, key=lambda r: (0, int(r), r) if r.isdigit() else (1, 0, r))


def counter_delta(before: Dict[str, Dict], after: Dict[str, Dict], rank: str) -> Dict:
    """after - before of one rank's counters (a rank or reason absent before counts from 0)."""
    old = before.get(rank, {"applied": 0.0, "skipped": {}})
    new = after[rank]
    skipped = {r: v - old["skipped"].get(r, 0.0) for r, v in new["skipped"].items()}
    return {"applied": new["applied"] - old["applied"], "skipped": skipped}


def applied_share(before: Optional[str], after: Optional[str]) -> Optional[Dict]:
    """Share of decode steps where OEA applied during an arm, from two /metrics pages.

    Decode steps = applied + every skip reason except not_decode (prefill / extend passes). Reads
    the lowest tp_rank only (each rank of a TP server counts the same steps). None when the server
    exports no OEA counters.
    """
    if before is None or after is None:
        return None
    after_counters = parse_oea_counters(after)
    rank = lowest_rank(after_counters)
    if rank is None:
        return None
    delta = counter_delta(parse_oea_counters(before), after_counters, rank)
    decode = delta["applied"] + sum(v for r, v in delta["skipped"].items() if r != NOT_DECODE)
    return {"share": delta["applied"] / decode if decode else None, "applied_steps": delta["applied"],
            "decode_steps": decode, "skipped_steps": delta["skipped"], "tp_rank": rank or None,
            "definition": APPLIED_DEFINITION}


# ----------------------------------------------------------------------------------------------
# HTTP (standard library only)
# ----------------------------------------------------------------------------------------------


def http_json(url: str, payload: Optional[Dict] = None, timeout: float = 600.0) -> Dict:
    """GET (payload None) or POST JSON; the decoded answer. RuntimeError with the body on HTTP errors."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')[:500]}") from None
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        raise RuntimeError(f"{url}: the answer is not JSON: {body[:200]!r}") from None


def fetch_text(url: str, timeout: float = 30.0) -> Optional[str]:
    """Body of a GET, or None when the server does not serve it (404, connection refused...)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return None


def served_model(base_url: str) -> str:
    """The first id of /v1/models, or 'default' when the server lists none."""
    body = fetch_text(base_url + "/v1/models")
    try:
        models = json.loads(body)["data"] if body else []
    except (ValueError, KeyError, TypeError):
        models = []
    return models[0]["id"] if models and isinstance(models[0], dict) and "id" in models[0] else "default"


def flush_cache(base_url: str) -> bool:
    """Ask SGLang to drop its prefix cache (so both arms prefill alike); False if not supported."""
    request = urllib.request.Request(base_url + "/flush_cache", b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def complete(base_url: str, model: str, prompt: Prompt, opts: argparse.Namespace) -> Dict:
    """One greedy completion: {"text", "token_ids", "finish_reason"}."""
    payload = {"model": model, "prompt": prompt if isinstance(prompt, str) else list(prompt),
               "max_tokens": opts.max_tokens, "temperature": 0, "return_token_ids": True}
    if opts.ignore_eos:
        payload["ignore_eos"] = True
    choice = http_json(base_url + "/v1/completions", payload, opts.timeout)["choices"][0]
    if choice.get("token_ids") is None:
        raise RuntimeError(f"{base_url}: no choices[0].token_ids in the answer; the server must support "
                           "SGLang's return_token_ids")
    return {"text": choice["text"], "token_ids": choice["token_ids"], "finish_reason": choice.get("finish_reason")}


def run_arm(name: str, base_url: str, items: Sequence[Item], opts: argparse.Namespace) -> Dict:
    """All prompts through one server, `opts.concurrency` in flight, in order; the arm record."""
    base_url = base_url.rstrip("/")
    model = opts.model or served_model(base_url)
    flushed = flush_cache(base_url)
    metrics_before = fetch_text(base_url + "/metrics")
    start = time.time()
    print(f"[quality] arm {name}: {len(items)} prompts at concurrency {opts.concurrency} -> {base_url}", flush=True)
    with ThreadPoolExecutor(opts.concurrency) as pool:
        outputs = list(pool.map(lambda it: complete(base_url, model, it.prompt, opts), items))
    elapsed = time.time() - start
    return {"name": name, "url": base_url, "model": model, "concurrency": opts.concurrency,
            "max_tokens": opts.max_tokens, "ignore_eos": opts.ignore_eos, "prompts_sha256": prompts_digest(items),
            "cache_flushed": flushed, "elapsed_s": elapsed, "outputs": outputs,
            "oea_steps": applied_share(metrics_before, fetch_text(base_url + "/metrics"))}


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------


def compare_outputs(base: Sequence[Dict], other: Sequence[Dict]) -> Dict:
    """Agreement, identical share and first-divergence distribution of two arms' outputs."""
    pairs = [(b["token_ids"], o["token_ids"]) for b, o in zip(base, other)]
    positions = [p for p in (first_divergence(a, b) for a, b in pairs) if p is not None]
    return {**token_agreement(pairs), "first_divergence": divergence_summary(positions)}


def accuracy_section(items: Sequence[Item], base: Sequence[Dict], oea: Sequence[Dict]) -> Optional[Dict]:
    """Per-arm accuracy and the paired difference over the items that have an answer; None if none."""
    graded = [i for i, it in enumerate(items) if it.answer is not None]
    if not graded:
        return None
    base_ok = [grade(items[i], base[i]["text"]) for i in graded]
    oea_ok = [grade(items[i], oea[i]["text"]) for i in graded]
    return {"n": len(graded), "baseline": arm_accuracy(base_ok), "oea": arm_accuracy(oea_ok),
            "paired_difference": paired_difference(base_ok, oea_ok),
            "grading": "extracted answer == answer after stripping whitespace; interval: Wilson 95%"}


def grade(item: Item, text: str) -> bool:
    return extract_answer(text, item.regex) == item.answer.strip()


def reference_matches(items: Sequence[Item], outputs: Sequence[Dict]) -> List[Optional[float]]:
    """Each prompt's reference match (None without reference_ids or with an empty output): [n]."""
    return [None if it.reference is None else reference_match(out["token_ids"], it.reference)
            for it, out in zip(items, outputs)]


def reference_section(items: Sequence[Item], base: Sequence[Dict], oea: Sequence[Dict]) -> Optional[Dict]:
    """Mean reference match per arm and the paired difference, over the prompts where both arms have
    one; None when no prompt has reference_ids."""
    pairs = [(b, o) for b, o in zip(reference_matches(items, base), reference_matches(items, oea))
             if b is not None and o is not None]
    if not pairs:
        return None
    return {**paired_mean_difference([b for b, _ in pairs], [o for _, o in pairs]),
            "definition": REFERENCE_DEFINITION}


def build_report(items: Sequence[Item], base: Dict, oea: Dict, repeat: Optional[Dict] = None) -> Dict:
    """quality.json's content from the arm records (`repeat`: a second baseline run, or None)."""
    warnings = []
    if base["oea_steps"] is not None:
        warnings.append("the baseline server exports OEA counters: is OEA really off there?")
    if oea["oea_steps"] is None:
        warnings.append("the OEA server exports no OEA counters (start it with --enable-metrics): oea_applied is null")
    arms = {a["name"]: {k: a[k] for k in ("url", "model", "elapsed_s", "cache_flushed")} for a in (base, oea)}
    return {"n_prompts": len(items), "concurrency": base["concurrency"], "max_tokens": base["max_tokens"],
            "ignore_eos": base["ignore_eos"], "token_source": "choices[0].token_ids (return_token_ids)",
            "arms": arms, "agreement": compare_outputs(base["outputs"], oea["outputs"]),
            "noise_floor": compare_outputs(base["outputs"], repeat["outputs"]) if repeat else None,
            "accuracy": accuracy_section(items, base["outputs"], oea["outputs"]),
            "reference_match": reference_section(items, base["outputs"], oea["outputs"]),
            "oea_applied": oea["oea_steps"], "warnings": warnings}


def fmt(value, digits: int = 4) -> str:
    """A number for the table ('n/a' for None)."""
    if value is None:
        return "n/a"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.{digits}f}"
    return str(int(value)) if isinstance(value, float) else str(value)


def fmt_ci(ci) -> str:
    return "n/a" if ci is None else f"[{ci[0]:.4f}, {ci[1]:.4f}]"


def agreement_rows(label: str, section: Dict) -> List[Tuple[str, str]]:
    div = section["first_divergence"]
    hist = ", ".join(f"{h['bucket']}: {h['count']}" for h in div["histogram"]) or "none"
    spread = "/".join(fmt(div[k], 1) for k in ("min", "p25", "median", "p75", "max")) if div["count"] else "n/a"
    return [(f"{label}token agreement (positional)", f"{fmt(section['token_agreement'])} "
             f"({section['positions_agreeing']}/{section['positions_compared']} positions)"),
            (f"{label}identical outputs", f"{fmt(section['identical_share'])} ({section['identical']}/{section['n']})"),
            (f"{label}first divergence min/p25/median/p75/max", f"{spread} (over {div['count']} differing)"),
            (f"{label}first divergence histogram", hist)]


def accuracy_rows(acc: Optional[Dict]) -> List[Tuple[str, str]]:
    if acc is None:
        return [("accuracy", "n/a (no prompt has an answer)")]
    rows = [(f"accuracy {arm} (Wilson 95%)", f"{fmt(acc[arm]['accuracy'])} {fmt_ci(acc[arm]['ci95'])} "
             f"({acc[arm]['correct']}/{acc[arm]['n']})") for arm in ("baseline", "oea")]
    diff = acc["paired_difference"]
    counts = f"{diff['oea_only_correct']} / {diff['baseline_only_correct']}"
    mean = f"{fmt(diff['mean'])} {fmt_ci(diff['ci95'])}"
    return rows + [("accuracy OEA - baseline (paired, normal approx. 95%)", mean),
                   ("discordant pairs (OEA only / baseline only correct)",
                    f"{counts}, exact McNemar p = {fmt(diff['mcnemar_exact_p'])}")]


def reference_rows(ref: Optional[Dict]) -> List[Tuple[str, str]]:
    if ref is None:
        return []
    return [("reference match baseline / OEA (mean over prompts)", f"{fmt(ref['baseline'])} / {fmt(ref['oea'])} "
             f"({ref['n']} prompts)"),
            ("reference match OEA - baseline (paired, bootstrap 95%)", f"{fmt(ref['mean'])} {fmt_ci(ref['ci95'])}")]


def applied_rows(applied: Optional[Dict]) -> List[Tuple[str, str]]:
    if applied is None:
        return [("OEA applied (share of decode steps)", "n/a (no OEA counters on the OEA server's /metrics)")]
    return [("OEA applied (share of decode steps)", f"{fmt(applied['share'])} ({fmt(applied['applied_steps'])}/"
             f"{fmt(applied['decode_steps'])} steps, tp_rank {applied['tp_rank'] or 'unlabelled'})")]


def render_markdown(report: Dict) -> str:
    """quality.md: one two-column table, then the definitions and warnings."""
    sizes = f"{report['n_prompts']} / {report['concurrency']} / {report['max_tokens']}"
    rows = [("prompts / concurrency / max tokens", sizes)]
    rows += agreement_rows("", report["agreement"])
    if report["noise_floor"] is not None:
        rows += agreement_rows("noise floor (baseline vs baseline): ", report["noise_floor"])
    rows += accuracy_rows(report["accuracy"]) + reference_rows(report.get("reference_match"))
    rows += applied_rows(report["oea_applied"])
    lines = ["| metric | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    notes = [f"- token agreement: {AGREEMENT_DEFINITION}.", f"- first divergence: {DIVERGENCE_DEFINITION}."]
    notes += [f"- reference match: {REFERENCE_DEFINITION}."] if report.get("reference_match") else []
    notes += [f"- OEA applied: {APPLIED_DEFINITION}."] if report["oea_applied"] is not None else []
    notes += [f"- warning: {w}" for w in report["warnings"]]
    return "\n".join(lines + [""] + notes) + "\n"


def per_prompt_rows(items: Sequence[Item], base: Dict, oea: Dict) -> List[Dict]:
    """outputs.jsonl: each prompt's outputs, divergence, extracted answers and reference match."""
    rows = []
    for item, b, o in zip(items, base["outputs"], oea["outputs"]):
        row = {"prompt": item.prompt, "answer": item.answer, "baseline": b, "oea": o,
               "first_divergence": first_divergence(b["token_ids"], o["token_ids"])}
        if item.answer is not None:
            row["extracted"] = {"baseline": extract_answer(b["text"], item.regex),
                                "oea": extract_answer(o["text"], item.regex)}
        if item.reference is not None:
            row["reference_ids"] = item.reference
            row["reference_match"] = {"baseline": reference_match(b["token_ids"], item.reference),
                                      "oea": reference_match(o["token_ids"], item.reference)}
        rows.append(row)
    return rows


def write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def write_report(out_dir: str, items: Sequence[Item], arms: Dict[str, Dict]) -> Dict:
    """Writes quality.json, quality.md, outputs.jsonl; prints the table; returns the report."""
    report = build_report(items, arms["baseline"], arms["oea"], arms.get("baseline_repeat"))
    write_json(os.path.join(out_dir, "quality.json"), report)
    markdown = render_markdown(report)
    with open(os.path.join(out_dir, "quality.md"), "w") as f:
        f.write(markdown)
    with open(os.path.join(out_dir, "outputs.jsonl"), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in per_prompt_rows(items, arms["baseline"], arms["oea"]))
    print(markdown, end="")
    return report


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", help="baseline server (OpenAI-compatible), e.g. http://127.0.0.1:30000")
    p.add_argument("--oea-url", help="OEA server, same model and flags plus --oea-*")
    p.add_argument("--baseline-from", help="reuse a saved baseline arm (arm_baseline.json) instead of --base-url")
    p.add_argument("--oea-from", help="reuse a saved OEA arm (arm_oea.json) instead of --oea-url")
    p.add_argument("--prompts", required=True,
                   help="JSONL: prompt (text or token ids), optional answer, answer_regex, reference_ids")
    p.add_argument("--answer-regex", help="default answer-extraction regex (first group, or the whole match)")
    p.add_argument("--concurrency", type=int, required=True, help="requests in flight, both arms")
    p.add_argument("--max-tokens", type=int, required=True, help="max output tokens per request")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens (SGLang's ignore_eos)")
    p.add_argument("--model", help="model name in requests (default: the server's /v1/models, else 'default')")
    p.add_argument("--noise-floor", action="store_true",
                   help="run the baseline arm a second time and report baseline-vs-baseline agreement")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", required=True, help="output directory")
    return p


def check_args(args: argparse.Namespace) -> None:
    """InputError naming the flag for values argparse cannot check."""
    if args.concurrency < 1:
        raise InputError("--concurrency must be at least 1")
    if args.max_tokens < 1:
        raise InputError("--max-tokens must be at least 1")
    if args.noise_floor and not args.base_url:
        raise InputError("--noise-floor needs --base-url")
    for url, saved, name in ((args.base_url, args.baseline_from, "baseline"), (args.oea_url, args.oea_from, "oea")):
        if url and saved:
            raise InputError(f"give either the {name} URL or a saved {name} arm, not both")
    if not (args.base_url or args.oea_url or (args.baseline_from and args.oea_from)):
        raise InputError("give --base-url and/or --oea-url (a missing arm may come from --baseline-from / --oea-from)")


def load_arm(path: str, items: Sequence[Item], args: argparse.Namespace) -> Dict:
    """A saved arm, checked against these prompts and settings."""
    if not os.path.isfile(path):
        raise InputError(f"no such saved arm: {path}")
    try:
        with open(path) as f:
            arm = json.load(f)
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not a saved arm ({e})") from None
    want = {"prompts_sha256": prompts_digest(items), "concurrency": args.concurrency,
            "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos}
    for key, value in want.items():
        if arm.get(key) != value:
            raise InputError(f"{path}: {key} is {arm.get(key)!r}, this run has {value!r}")
    return arm


def collect_arms(items: Sequence[Item], args: argparse.Namespace) -> Dict[str, Dict]:
    """Loads the saved arms (checked first: a bad file fails before any request), then runs the
    arms that have a URL one after the other, saving each as DIR/arm_<name>.json."""
    arms = {name: load_arm(path, items, args)
            for name, path in (("baseline", args.baseline_from), ("oea", args.oea_from)) if path}
    plan = [("baseline", args.base_url), ("oea", args.oea_url)]
    plan += [("baseline_repeat", args.base_url)] if args.noise_floor else []
    for name, url in plan:
        if url:
            arms[name] = run_arm(name, url, items, args)
            write_json(os.path.join(args.out, f"arm_{name}.json"), arms[name])
    return arms


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit status: 0 done, 2 bad input, 1 a server failed."""
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        default_regex = compile_regex(args.answer_regex, "--answer-regex") if args.answer_regex else None
        items = load_prompts(args.prompts, default_regex)
        os.makedirs(args.out, exist_ok=True)
        arms = collect_arms(items, args)
    except InputError as e:
        print(f"quality_ab.py: error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as e:  # HTTP errors, refused connections, timeouts
        print(f"quality_ab.py: server error: {e}", file=sys.stderr)
        return 1
    if "baseline" not in arms or "oea" not in arms:
        print(f"[quality] saved {', '.join(arms)} in {args.out}; run again for the other arm to get the report")
        return 0
    write_report(args.out, items, arms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
