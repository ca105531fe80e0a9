"""The quality A/B's measures: how two arms' outputs agree, where they first diverge, their
accuracy and reference match, and quality.json's content from two arm records.

Pure functions over token ids and texts; the intervals come from common/stats.py.
"""

from typing import Dict, List, Optional, Pattern, Sequence, Tuple

import numpy as np

from common import stats
from serving.quality_inputs import Item

AGREEMENT_DEFINITION = ("positional: position i of a prompt agrees when both arms generated the same token id "
                        "at i; counted for i < the shorter output's length, pooled over all prompts")
DIVERGENCE_DEFINITION = ("first index i where the token ids differ; when one output is a prefix of the other, "
                         "the shorter length; over the outputs that are not identical")
REFERENCE_DEFINITION = ("per prompt: the share of positions i < min(output length, reference length) where the "
                        "generated token id equals reference_ids[i] (free-running: after a miss the output "
                        "continues from its own tokens); then the mean over prompts")
BOOTSTRAP_RESAMPLES = 4000


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
    names, quantiles = ("min", "p25", "median", "p75", "max"), (0.0, 0.25, 0.5, 0.75, 1.0)
    values = np.quantile(positions, quantiles).tolist() if positions else [None] * len(names)  # linear
    return {"count": len(positions), **dict(zip(names, values)), "histogram": divergence_histogram(positions),
            "definition": DIVERGENCE_DEFINITION}


def paired_difference(base: Sequence[bool], oea: Sequence[bool], z: float = stats.Z95) -> Dict:
    """OEA minus baseline accuracy over paired outcomes, with a normal-approximation CI.

    d_i = oea_i - base_i in {-1, 0, 1}; CI = mean(d) +- z * sd(d) / sqrt(n), sd with n - 1
    (None for n < 2). Also the discordant counts and the exact McNemar p-value.
    """
    assert len(base) == len(oea), f"{len(base)=} {len(oea)=}"
    diffs = [int(o) - int(b) for b, o in zip(base, oea)]
    mean, ci = stats.normal_mean_ci(diffs, z)
    oea_only, base_only = diffs.count(1), diffs.count(-1)
    return {"mean": mean, "ci95": ci, "oea_only_correct": oea_only, "baseline_only_correct": base_only,
            "mcnemar_exact_p": stats.mcnemar_exact_p(base_only, oea_only),
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
            "ci95": stats.wilson_ci(sum(correct), n)}


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
    """Whether the answer extracted from `text` equals the item's answer (whitespace stripped)."""
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
    return {**stats.paired_mean_difference([b for b, _ in pairs], [o for _, o in pairs], BOOTSTRAP_RESAMPLES),
            "definition": REFERENCE_DEFINITION}


def build_report(items: Sequence[Item], base: Dict, oea: Dict, repeat: Optional[Dict] = None) -> Dict:
    """quality.json's content from the arm records (`repeat`: a second baseline run, or None)."""
    warnings = []
    applied = (base["oea_steps"] or {}).get("applied_steps") or 0
    if applied:  # a baseline armed with OEA off (--oea-k0 0, or k0 0 set live) exports counters, applying none
        warnings.append(f"OEA applied in {applied:g} decode steps of the baseline arm: is OEA really off there?")
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
