"""An independent, per-row, pure-Python statement of Simplified OEA, used only as a test oracle.

Written from the paper's Algorithm 1 and docs/how-it-works.md ("Semantics"), without looking at
sglang_oea.reference's tensor formulation: plain lists, sets and sorts.
"""

import math
from typing import List, Optional, Sequence, Tuple


def rank(experts: Sequence[int], scores: Sequence[float]) -> List[int]:
    """Experts by score descending, ties to the lower id."""
    return sorted(experts, key=lambda e: (-scores[e], e))


def brute_force_oea(
    scores: List[List[float]],
    topk: List[List[int]],
    k0: int,
    num_valid: Optional[int] = None,
) -> Tuple[List[List[int]], List[List[bool]]]:
    """Returns (ids, active) per row, as documented in docs/how-it-works.md."""
    num_rows, num_experts, k = len(scores), len(scores[0]), len(topk[0])
    valid = num_rows if num_valid is None else num_valid
    if k0 >= k:
        return [rank(topk[r], scores[r]) for r in range(num_rows)], [[True] * k for _ in range(num_rows)]
    bases = [rank(topk[r], scores[r])[:k0] for r in range(valid)]
    union = set().union(*bases) if bases else set()
    fill_order = sorted(union) + sorted(set(range(num_experts)) - union)
    ids, active = [], []
    for r in range(num_rows):
        if r >= valid:
            ids.append(fill_order[:k])
            active.append([False] * k)
            continue
        base = bases[r]
        candidates = [e for e in union if e not in base and scores[r][e] != -math.inf]
        row = base + rank(candidates, scores[r])[: k - k0]
        carried = len(row)
        row += [e for e in fill_order if e not in row][: k - carried]
        ids.append(row)
        active.append([True] * carried + [False] * (k - carried))
    return ids, active


def brute_force_weights(
    probs: List[List[float]], ids: List[List[int]], active: List[List[bool]], row_sums: List[float]
) -> List[List[float]]:
    out = []
    for r, row in enumerate(ids):
        picked = [probs[r][e] if a else 0.0 for e, a in zip(row, active[r])]
        total = sum(picked)
        out.append([p / total * row_sums[r] if total > 0 else 0.0 for p in picked])
    return out
