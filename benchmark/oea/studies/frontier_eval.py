"""The frontier's evaluator: teacher-forced forwards of a transformers MoE model in which each
decode position's rows are routed batch by batch by the policy under test (policies.py).

Shape legend: n = sequences, B = rows routed together (a static batch), P = prompt length,
L = decode positions, S = P + L, N = routed experts, K = the router's top-k, V = vocabulary.

The routing is swapped at each MoE block's router (`mlp.gate`, which returns (logits, weights,
ids) in both families): the wrapper keeps the router's own output for prompt positions and
replaces decode positions' rows. Why this computes lockstep decoding: see frontier.py.
"""

import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from sglang_oea.routing import RouterSpec, score_experts
from studies import policies as pol


def router_spec(gate: torch.nn.Module) -> RouterSpec:
    """The RouterSpec of a transformers Qwen3-MoE, GLM-4-MoE or DeepSeek-V3 router module."""
    bias = getattr(gate, "e_score_correction_bias", None)
    if bias is None:
        return RouterSpec("softmax")
    groups = gate.num_group
    return RouterSpec("sigmoid", bias.detach().float(), groups, gate.topk_group < groups)


def group_mask(gate: torch.nn.Module, selection: torch.Tensor) -> torch.Tensor:
    """[R, N] bool: the experts of the groups the router selects for each row (all True when
    ungrouped), by the same ops as Glm4MoeTopkRouter.forward so that the groups are its own.

    Args:
        selection: [R, N] float32 sigmoid + correction bias (routing.score_experts).
    """
    rows, experts = selection.shape
    groups = getattr(gate, "num_group", 1)
    if groups <= 1 or gate.topk_group >= groups:
        return torch.ones(rows, experts, dtype=torch.bool, device=selection.device)
    group_scores = selection.view(rows, groups, experts // groups).topk(2, dim=-1)[0].sum(dim=-1)
    chosen = torch.topk(group_scores, k=gate.topk_group, dim=-1, sorted=False)[1]
    picked = torch.zeros_like(group_scores).scatter_(1, chosen, 1).bool()  # [R, G]
    return picked.repeat_interleave(experts // groups, dim=1)


class BatchRoutedGate(torch.nn.Module):
    """Wraps one MoE router: prompt rows keep the router's output, decode rows get the policy's.

    configure() before a forward of [R, S] tokens, R a multiple of the routing batch B: at each
    decode position, rows [g * B, (g + 1) * B) are one static batch, routed together and apart
    from the others (several batches share a forward only because a forward's rows do not mix).
    `steps` collects, per forward, T of each (decode position, batch): [L, R // B] int64. With
    policy None the router runs untouched.
    """

    def __init__(self, gate: torch.nn.Module):
        super().__init__()
        self.gate = gate
        self.spec = router_spec(gate)
        self.configure(None)

    def configure(self, policy: Optional[pol.Policy], batch: int = 0, seq_len: int = 0, prompt_len: int = 0):
        """Route the next forwards of [R, seq_len] tokens by `policy`, batches of `batch` rows,
        from position prompt_len on."""
        self.policy, self.batch, self.seq_len, self.prompt_len = policy, batch, seq_len, prompt_len
        self.steps: List[torch.Tensor] = []

    def by_step(self, tensor: torch.Tensor) -> torch.Tensor:
        """[R * S, X] (rows sequence-major, as the model flattens them) -> [S, R, X] contiguous."""
        return tensor.reshape(-1, self.seq_len, tensor.shape[-1]).transpose(0, 1).contiguous()

    def step_scores(self, logits, weights, ids):
        """(t, first row, StepScores [B, N]) of each decode position t and static batch, in that
        order (position-major)."""
        selection, weight = score_experts(logits, self.spec)
        mask = group_mask(self.gate, selection)
        parts = [self.by_step(x) for x in (logits.float(), selection, weight, ids.long(), weights.float(), mask)]
        for t in range(self.prompt_len, self.seq_len):
            for rows in range(0, parts[0].shape[1], self.batch):
                yield t, rows, pol.StepScores(*(x[t, rows:rows + self.batch] for x in parts), spec=self.spec)

    def forward(self, hidden_states: torch.Tensor):
        logits, weights, ids = self.gate(hidden_states)
        if self.policy is None:
            return logits, weights, ids
        routed = [self.policy(scores) for _, _, scores in self.step_scores(logits, weights, ids)]
        decode = self.seq_len - self.prompt_len
        step_ids = torch.stack([r[0] for r in routed]).view(decode, -1, ids.shape[1])  # [L, R, K]
        step_weights = torch.stack([r[1] for r in routed]).view(decode, -1, ids.shape[1])
        self.steps.append(distinct_per_batch(step_ids, self.batch, logits.shape[1]))
        new_ids, new_weights = self.by_step(ids.long()), self.by_step(weights)
        # An unused slot runs expert 0 at weight 0: it adds exactly nothing to the output.
        new_ids[self.prompt_len:] = step_ids.clamp_min(0)
        new_weights[self.prompt_len:] = torch.where(step_ids >= 0, step_weights.to(weights.dtype), 0)
        unstep = lambda x: x.transpose(0, 1).reshape(ids.shape)  # noqa: E731
        return logits, unstep(new_weights), unstep(new_ids).to(ids.dtype)


def distinct_per_batch(ids: torch.Tensor, batch: int, num_experts: int) -> torch.Tensor:
    """T of each (step, static batch): ids [L, R, K] (-1 = unused) -> [L, R // batch] int64,
    what policies.distinct_used counts for each [batch, K] block."""
    steps = ids.shape[0]
    blocks = ids.reshape(steps, -1, batch * ids.shape[2])  # [L, G, B * K]
    used = torch.zeros(*blocks.shape[:2], num_experts + 1, dtype=torch.bool)
    used.scatter_(2, torch.where(blocks >= 0, blocks, num_experts), True)
    return used[..., :num_experts].sum(dim=2)


def load_model(model_dir: str):
    """The float32 transformers model of a checkpoint, eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def install(model) -> List[BatchRoutedGate]:
    """Wrap every MoE layer's router of a Qwen3-MoE, GLM-4-MoE or DeepSeek-V3 model (dense layers are left
    alone; idempotent)."""
    wrapped = []
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if hasattr(gate, "top_k"):  # a router not yet wrapped
            gate = layer.mlp.gate = BatchRoutedGate(gate)
        if not isinstance(gate, BatchRoutedGate):
            continue
        wrapped.append(gate)
    return wrapped


@dataclass
class Scored:
    """One policy over all sequences: nll [n] (sum over the L predictions), correct [n] (count),
    steps [batches, layers, L] int (T of each layer-step), tokens L, seconds."""

    nll: torch.Tensor
    correct: torch.Tensor
    steps: torch.Tensor
    tokens: int
    seconds: float = 0.0


def continuation_scores(logits: torch.Tensor, windows: torch.Tensor,
                        prompt_len: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence NLL sum and correct count over the predictions of decode positions.

    Args:
        logits: [B, S, V] of a forward over windows[:, :S].
        windows: [B, S + 1] token ids.
    Returns:
        nll [B] float64, correct [B] int64.
    """
    pred = logits[:, prompt_len:].float()  # [B, L, V]
    target = windows[:, prompt_len + 1:]
    # Flat rows: cross_entropy over a transposed [B, V, L] view is many times slower on the CPU.
    nll = F.cross_entropy(pred.reshape(-1, pred.shape[-1]), target.reshape(-1), reduction="none")
    return nll.view(target.shape).double().sum(dim=1), (pred.argmax(dim=-1) == target).sum(dim=1)


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch: int, prompt_len: int, policy: Optional[pol.Policy],
             chunk: int = 64) -> Scored:
    """Score `policy` on windows [n, P + L + 1] in static batches of `batch` consecutive rows.

    Forwards take `chunk` rows at a time (rounded to a multiple of batch; n % batch == 0).
    policy None means plain routing (policies.plain), T recorded.
    """
    gates = install(model)
    count, length = windows.shape
    assert count % batch == 0, f"{count=} {batch=}"
    seq_len = length - 1
    nll, correct = [], []
    start = time.perf_counter()
    for gate in gates:
        gate.configure(policy or pol.plain, batch, seq_len, prompt_len)
    for rows in windows.split(max(1, chunk // batch) * batch):
        got = continuation_scores(model(input_ids=rows[:, :seq_len], use_cache=False).logits, rows, prompt_len)
        nll.append(got[0])
        correct.append(got[1])
    # Per gate: [L, batches] over the forwards; stacked: [layers, L, batches] -> [batches, layers, L].
    steps = torch.stack([torch.cat(gate.steps, dim=1) for gate in gates]).permute(2, 0, 1)
    for gate in gates:
        gate.configure(None)
    return Scored(torch.cat(nll), torch.cat(correct), steps, seq_len - prompt_len, time.perf_counter() - start)


@torch.no_grad()
def plain_nll(model, windows: torch.Tensor, prompt_len: int, chunk: int = 64) -> torch.Tensor:
    """[n] float64 per-sequence NLL sums of forwards of `chunk` rows with no wrapper active (the
    model alone)."""
    for gate in install(model):
        gate.configure(None)
    parts = [continuation_scores(model(input_ids=rows[:, :-1], use_cache=False).logits, rows, prompt_len)[0]
             for rows in windows.split(chunk)]
    return torch.cat(parts)


def run_policy(model, windows, batch, prompt_len, name, knob) -> Scored:
    """evaluate() for a named policy at a knob."""
    return evaluate(model, windows, batch, prompt_len, pol.make_policy(name, knob))
