"""Decode-step routing policies for the quality-against-T frontier (frontier.py). Pure torch.

Shape legend: B = rows routed together (one decode step of a batch), N = routed experts,
K = the router's top-k.

Every policy maps one step's StepScores to (ids [B, K] int64, weights [B, K] float32). A slot
with id -1 is unused (weight 0): policies that give a row fewer than K experts pad with -1.
Experts rank by selection score, descending, ties to the lower expert id (as in
sglang_oea.reference); weights are the router's weight scores renormalised over a row's final
set and scaled to the row sum of the router's own weights (reference.opportunistic_weights), so a
GLM row keeps its routed scaling factor.

Policies:
    plain              the router's own top-K.
    pruned(k0)         each row's k0 best routed experts.
    oea(k0)            Opportunistic Expert Activation: sglang_oea.routing.route_from_logits, which
                       is bit for bit sglang_oea.reference.opportunistic_route.
    budget(E)          the E experts of highest summed top-K weight over the batch are kept; each
                       row routes to its top-K among them (batch-level expert sharing: vLLM XShare
                       PR #35551 / arXiv 2602.07265, MoE-Spec arXiv 2602.16052).
    top_p(p)           per row, the routed experts in score order until their renormalised weight
                       reaches p, at least 1 and at most K (ik_llama.cpp SER, adaptive-k routing).
    oea_budget(k0, E)  OEA with a demand-driven union: every row keeps its k0 best; experts the
                       batch still wants (summed renormalised weight of the routed top-K slots
                       outside the bases) are added until the union holds E experts; each row fills its other slots
                       from that union by its own scores. E <= |union of bases| is oea(k0).
    oea_mass(p)        OEA with an adaptive base: a row's base is its top_p(p) set, then it fills
                       its other slots from the union of the bases by its own scores.

Grouped routers (GLM: topk_group < n_group): budget and top_p choose inside the groups the router
selected for the row (StepScores.group_mask); oea, oea_budget and oea_mass piggyback only inside
the groups of the row's own routed top-K, as the SGLang plugin does (routing.mask_foreign_groups).
"""

from dataclasses import dataclass
from typing import Callable, Dict, NamedTuple, Tuple

import torch

from sglang_oea.reference import opportunistic_weights, rank_routed_columns
from sglang_oea.routing import RouterSpec, mask_foreign_groups, route_from_logits

Routing = Tuple[torch.Tensor, torch.Tensor]


@dataclass
class StepScores:
    """What SGLang's router knows at one MoE layer for one decode step of B rows.

    logits: [B, N] float32 raw router logits.
    selection: [B, N] float32 ranking scores (routing.score_experts: the logit, or sigmoid + bias).
    weight: [B, N] float32 unbiased scores (softmax or sigmoid).
    topk_ids: [B, K] int64 the router's own (group-limited) top-K, any column order.
    topk_weights: [B, K] float32 the router's weights for them (renormalised, scaled).
    group_mask: [B, N] bool, the experts of the groups the router selected (all True ungrouped).
    spec: the router's RouterSpec.
    """

    logits: torch.Tensor
    selection: torch.Tensor
    weight: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    group_mask: torch.Tensor
    spec: RouterSpec

    @property
    def k(self) -> int:
        return self.topk_ids.shape[1]

    def own_group_selection(self) -> torch.Tensor:
        """[B, N] float32 selection, -inf outside the groups of each row's own routed top-K."""
        if self.spec.restrict_groups and self.spec.num_groups > 1:
            return mask_foreign_groups(self.selection, self.topk_ids, self.spec.num_groups)
        return self.selection


Policy = Callable[[StepScores], Routing]


def ranked_order(scores: torch.Tensor) -> torch.Tensor:
    """[B, N] -> [B, N] int64 expert ids by score descending, ties to the lower id."""
    return torch.sort(scores, dim=1, descending=True, stable=True).indices


def topk_within(selection: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's k best allowed experts; -1 where a row has fewer than k allowed.

    Args:
        selection: [B, N] float scores; an expert at -inf is never taken.
        allowed: [B, N] or [1, N] bool.
    Returns:
        [B, k] int64 ids, best first.
    """
    keep = allowed & (selection > float("-inf"))
    order = ranked_order(selection.masked_fill(~keep, float("-inf")))[:, :k]
    return torch.where(keep.expand_as(selection).gather(1, order), order, torch.full_like(order, -1))


def finish(scores: StepScores, ids: torch.Tensor) -> Routing:
    """Pad ids [B, <=K] (-1 = unused) to K columns and weigh them: (ids [B, K], weights [B, K])."""
    ids = torch.cat([ids, ids.new_full((ids.shape[0], scores.k - ids.shape[1]), -1)], dim=1)
    active = ids >= 0
    weights = opportunistic_weights(scores.weight, ids.clamp_min(0), active, scores.topk_weights.sum(dim=1))
    return ids, weights


def keep_prefix(scores: StepScores, counts: torch.Tensor) -> Routing:
    """The first counts[r] of each row's ranked routed experts: the rest unused.

    Args:
        counts: [B] int64 in [1, K].
    """
    ranked = rank_routed_columns(scores.selection, scores.topk_ids)  # [B, K]
    slots = torch.arange(scores.k, device=ranked.device)[None, :]
    return finish(scores, torch.where(slots < counts[:, None], ranked, torch.full_like(ranked, -1)))


def routed_mass(scores: StepScores) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each row's routed experts ranked, with their weights renormalised to sum 1 over the K
    (the router's own weights up to its scaling): (ids [B, K] int64, mass [B, K] float32)."""
    ranked = rank_routed_columns(scores.selection, scores.topk_ids)
    mass = scores.weight.gather(1, ranked)
    return ranked, mass / mass.sum(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


def constant_counts(scores: StepScores, count: int) -> torch.Tensor:
    """[B] int64 filled with min(count, K)."""
    return torch.full((scores.topk_ids.shape[0],), min(count, scores.k), dtype=torch.long)


def top_p_counts(scores: StepScores, p: float, min_count: int = 1) -> torch.Tensor:
    """[B] int64: how many of its ranked routed experts each row needs to reach weight mass p
    (routed_mass), clamped to [min_count, K]."""
    mass = routed_mass(scores)[1]
    below = (mass.cumsum(dim=1) < p).sum(dim=1)  # slots before the one that reaches p
    return (below + 1).clamp(min_count, scores.k)


def plain(scores: StepScores) -> Routing:
    """The router's own top-K, untouched."""
    return scores.topk_ids, scores.topk_weights


def pruned(k0: int) -> Policy:
    """Each row keeps only its k0 best routed experts, weights renormalised over them."""
    def route(scores: StepScores) -> Routing:
        return keep_prefix(scores, constant_counts(scores, k0))
    return route


def oea(k0: int) -> Policy:
    """OEA(k0) by the product's own routing (routing.route_from_logits); fill slots become -1."""
    def route(scores: StepScores) -> Routing:
        ids, weights = route_from_logits(scores.logits, scores.topk_ids, scores.topk_weights, scores.spec, k0)
        if k0 >= scores.k:
            return ids, weights
        # Fill slots carry weight exactly 0; active ones carry a positive router score.
        return torch.where(weights > 0, ids, torch.full_like(ids, -1)), weights
    return route


def expert_demand(ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[N] float32: the summed weight each expert gets over the slots ids [B, J], weights [B, J]
    (ids -1 ignored)."""
    used = ids >= 0
    demand = torch.zeros(num_experts + 1, dtype=torch.float32, device=ids.device)
    demand.scatter_add_(0, torch.where(used, ids, num_experts).reshape(-1), (weights.float() * used).reshape(-1))
    return demand[:num_experts]


def top_demand(demand: torch.Tensor, count: int) -> torch.Tensor:
    """[N] bool: the `count` experts of highest positive demand [N], ties to the lower id."""
    order = ranked_order(demand[None, :])[0, :max(count, 0)]
    keep = torch.zeros_like(demand, dtype=torch.bool)
    return keep.scatter(0, order, demand[order] > 0)


def budget(num_kept: int) -> Policy:
    """Keep the num_kept experts of highest summed top-K weight; rows route top-K among them."""
    def route(scores: StepScores) -> Routing:
        demand = expert_demand(scores.topk_ids, scores.topk_weights, scores.selection.shape[1])
        kept = top_demand(demand, num_kept)[None, :] & scores.group_mask
        return finish(scores, topk_within(scores.selection, kept, scores.k))
    return route


def top_p(p: float, min_count: int = 1) -> Policy:
    """Per row, the ranked routed experts until their renormalised weight reaches p."""
    def route(scores: StepScores) -> Routing:
        return keep_prefix(scores, top_p_counts(scores, p, min_count))
    return route


class Bases(NamedTuple):
    """Each row's base and their union, for OEA-like policies.

    ranked: [B, K] int64 routed ids, best first; mass: [B, K] their routed_mass.
    counts: [B] int64 base sizes; in_base: [B, K] bool, slot j < counts[r].
    held: [B, N] bool, the row's base experts; union: [N] bool, U0 = union of the bases.
    """

    ranked: torch.Tensor
    mass: torch.Tensor
    counts: torch.Tensor
    in_base: torch.Tensor
    held: torch.Tensor
    union: torch.Tensor


def bases_of(scores: StepScores, counts: torch.Tensor) -> Bases:
    """Bases of counts [B] (int64 in [1, K]) experts: each row's best routed ones."""
    (num_rows, num_experts), k = scores.selection.shape, scores.k
    ranked, mass = routed_mass(scores)
    in_base = torch.arange(k, device=ranked.device)[None, :] < counts[:, None]
    held = torch.zeros(num_rows, num_experts + 1, dtype=torch.bool, device=ranked.device)
    held = held.scatter(1, torch.where(in_base, ranked, num_experts), True)[:, :num_experts]
    return Bases(ranked, mass, counts, in_base, held, held.any(dim=0))


def refill(scores: StepScores, bases: Bases, union: torch.Tensor) -> Routing:
    """OEA's refill from a union [N] bool: row r keeps its base and fills K - counts[r] slots
    with its best experts of the union outside its base, in its own routed groups."""
    k = scores.k
    extra = topk_within(scores.own_group_selection(), union[None, :] & ~bases.held, k)  # [B, K]
    slots = torch.arange(k, device=extra.device)[None, :]
    extra_slot = (slots - bases.counts[:, None]).clamp_min(0)
    return finish(scores, torch.where(bases.in_base, bases.ranked, extra.gather(1, extra_slot)))


def grow_by_demand(bases: Bases, cap: int) -> torch.Tensor:
    """[N] bool: U0 plus the experts outside it of highest demand (summed routed_mass of the
    routed slots outside the bases) until the union holds cap experts."""
    rest = torch.where(bases.in_base, -1, bases.ranked)
    demand = expert_demand(rest, bases.mass, bases.held.shape[1]).masked_fill(bases.union, 0)
    return bases.union | top_demand(demand, cap - int(bases.union.sum()))


def extended_oea(scores: StepScores, base_counts: torch.Tensor, cap: int) -> Routing:
    """OEA with per-row base sizes and a union grown by demand to cap (grow_by_demand), then
    OEA's refill. cap <= |U0| is OEA's union.

    Args:
        base_counts: [B] int64 in [1, K].
        cap: target union size E.
    """
    bases = bases_of(scores, base_counts)
    return refill(scores, bases, grow_by_demand(bases, cap))


def oea_budget(k0: int, cap: int) -> Policy:
    """Every row's k0 best, a union grown by demand to cap experts, then OEA's refill."""
    def route(scores: StepScores) -> Routing:
        return extended_oea(scores, constant_counts(scores, k0), cap)
    return route


def oea_mass(p: float, min_count: int = 1) -> Policy:
    """A top_p(p) base per row, then OEA's refill from the union of the bases."""
    def route(scores: StepScores) -> Routing:
        return extended_oea(scores, top_p_counts(scores, p, min_count), 0)
    return route


POLICIES: Dict[str, Callable[..., Policy]] = {
    "plain": lambda knob=None: plain,
    "pruned": lambda knob: pruned(int(knob)),
    "oea": lambda knob: oea(int(knob)),
    "budget": lambda knob: budget(int(knob)),
    "top_p": lambda knob: top_p(float(knob)),
    "oea_budget": lambda knob: oea_budget(int(knob[0]), int(knob[1])),
    "oea_mass": lambda knob: oea_mass(float(knob)),
}


def make_policy(name: str, knob=None) -> Policy:
    """The policy `name` at `knob` (see POLICIES; oea_budget takes (k0, E))."""
    return POLICIES[name](knob)


def distinct_used(ids: torch.Tensor, num_experts: int) -> int:
    """T: how many distinct experts the used slots (id >= 0) of ids [B, K] touch."""
    used = torch.zeros(num_experts + 1, dtype=torch.bool, device=ids.device)
    return int(used.scatter(0, torch.where(ids >= 0, ids, num_experts).reshape(-1), True)[:num_experts].sum())
