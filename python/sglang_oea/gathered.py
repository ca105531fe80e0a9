"""The gathered batch of DP attention: which of its rows are real, in what order OEA routes them. No SGLang import.

Under DP attention (`--attn-dp-size G > 1`) each of G attention-DP groups schedules its own
requests, and before every MoE layer SGLang gathers the groups' hidden states into one buffer that
every rank's router sees whole. Group g owns a slot of the buffer, in group order, padded: its real
token rows come first in the slot, then padding. The padding holds whatever memory it holds (an idle
group's rows are never written: NaN router logits were seen there), so it must never join the union
of experts OEA refills from, nor any count.

Shape legend: N = gathered rows (the buffer), G = attention-DP groups.

OEA routes the real rows as one batch. `gathered_order` gives a permutation of the N rows that puts
the real rows first, in buffer order, then the padding; routed in that order, the real rows are a
prefix of `total` rows, which is what every router, counter and kernel of OEA already handles (real
rows first, padding after, as in a padded CUDA graph). `inverse` puts the rows back.

Two layouts, the ones SGLang's gather produces:
    eager passes: slot g starts at `starts[g]`, the sum of the earlier groups' padded token counts
        (SGLang pads every slot to the largest group's count, or to the attention-TP alignment);
    CUDA graphs: every slot holds N / G rows (a decode graph captures [bucket x rows per request] x
        G), so the layout is fixed by the captured N alone and only the real counts change per
        replay: `starts` is None.
Every rank sees the same counts and the same N, so every rank computes the same order.
"""

from typing import List, Optional, Sequence, Tuple

import torch


def slot_starts(padded: Sequence[int]) -> List[int]:
    """[G] first buffer row of each group's slot, from the groups' padded token counts."""
    starts, at = [], 0
    for count in padded:
        starts.append(at)
        at += int(count)
    return starts


def layout_problem(num_rows: int, real: Sequence[int], padded: Optional[Sequence[int]]) -> Optional[str]:
    """Why the buffer of `num_rows` rows cannot hold the groups' real rows as described, or None.
    padded: the slots' sizes (eager), or None for equal slots (graphs). Host ints only."""
    groups = len(real)
    if padded is None:
        if groups == 0 or num_rows % groups:
            return f"{num_rows} gathered rows do not split into {groups} equal slots"
        padded = [num_rows // groups] * groups
    if len(padded) != groups:
        return f"{len(padded)} slots for {groups} attention-DP groups"
    if sum(padded) != num_rows:
        return f"slots of {list(padded)} rows do not add up to the {num_rows} gathered rows"
    if any(r < 0 or r > p for r, p in zip(real, padded)):
        return f"real rows {list(real)} do not fit slots of {list(padded)} rows"
    return None


def real_row_mask(num_rows: int, real: Sequence[int], padded: Sequence[int]) -> List[bool]:
    """[N] host reference: True for the real rows of the buffer."""
    mask = [False] * num_rows
    for start, count in zip(slot_starts(padded), real):
        mask[start:start + count] = [True] * count
    return mask


def gathered_order(num_rows: int, real: torch.Tensor, starts: Optional[torch.Tensor] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(order, inverse): [N] int64 each, on real's device; device ops only (no host sync, graph-safe).

    real: [G] int32, each group's real rows. starts: [G] int32, each slot's first row (eager), or
    None for G equal slots of N / G rows (graphs). order[i] is the buffer row routed i-th: the real
    rows in buffer order, then the padding in buffer order; inverse[row] is where `row` went, so
    x[order][inverse] == x.
    """
    groups = real.shape[0]
    row = torch.arange(num_rows, device=real.device)
    if starts is None:
        slot = max(1, num_rows // groups)
        group = torch.div(row, slot, rounding_mode="floor").clamp_(max=groups - 1)
        offset = row - group * slot
    else:
        starts = starts.to(torch.int64)
        group = (torch.bucketize(row, starts, right=True) - 1).clamp_(min=0)
        offset = row - starts[group]
    is_real = offset < real.to(torch.int64)[group]  # [N]
    real_before = torch.cumsum(is_real, 0)  # real rows up to and including each row
    total = real_before[-1:]
    padding_before = row + 1 - real_before
    inverse = torch.where(is_real, real_before - 1, total + padding_before - 1)
    order = torch.empty_like(inverse).scatter_(0, inverse, row)
    return order, inverse
