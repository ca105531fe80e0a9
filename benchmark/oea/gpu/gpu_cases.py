"""The case grid of the fused OEA kernel checks and the inputs of each case: cases, router inputs,
and one kernel call. Used by gpu_check.py (with gpu_compare.py, its checks 1 and 2, and
gpu_score_bits.py) and by test/srt/test_oea_kernel.py.

Importing this module imports torch, not triton: the kernel module is imported on first use, so a
caller can set TRITON_INTERPRET=1 first.
"""

import math
import random
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parents[3]
if str(REPO / "python") not in sys.path:
    sys.path.insert(0, str(REPO / "python"))

import torch  # noqa: E402

from sglang_oea.routing import RouterSpec, score_experts  # noqa: E402

N_VALUES = (8, 64, 128, 160, 256, 384, 512)
K_VALUES = (1, 2, 4, 6, 8, 10, 16)
SEED = 20251104


def kernels():
    """The kernel module, imported on first use (so TRITON_INTERPRET can be set before)."""
    import importlib

    return importlib.import_module("sglang_oea.kernels.oea_route")


# ------------------------------------------------------------------------------------------------
# Cases: the sampled grid shared with test/srt/test_oea_kernel.py
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One routing problem. nv: real rows (None = all); nv_kind: how the kernel receives it."""

    B: int
    N: int
    K: int
    k0: int
    nv: Optional[int] = None
    nv_kind: str = "0d"  # "0d" / "1d" int32 device tensor, or "int"
    scoring: str = "softmax"
    bias: bool = False
    groups: int = 1
    restrict: bool = False
    ties: str = "none"  # "none": float32 logits, "bf16": bf16 logits, "few": 5 distinct values
    ids_dtype: torch.dtype = torch.int32
    w_dtype: torch.dtype = torch.float32
    min_batch: int = 1
    max_batch: int = 0
    stats: bool = False  # pass the expert counters (oea_route's stats=) and check them
    checksum: bool = False  # pass a rank-check checksum slot (oea_route's checksum=) and check it

    def __str__(self) -> str:
        parts = [f"B{self.B}", f"N{self.N}", f"K{self.K}", f"k0{self.k0}", f"nv{self.nv}", self.scoring]
        parts += ["bias"] * self.bias + [f"G{self.groups}r"] * self.restrict + [self.ties]
        parts += [str(self.ids_dtype).split(".")[-1], str(self.w_dtype).split(".")[-1]]
        return "-".join(parts + [f"gate{self.min_batch}:{self.max_batch}"] + ["stats"] * self.stats
                        + ["checksum"] * self.checksum)


def group_count(N: int, K: int, rng: random.Random) -> Optional[int]:
    """A group count G, N % G == 0, for which a router picking < G groups can still hold K experts."""
    options = [g for g in (2, 4, 8) if N % g == 0 and math.ceil(K / (N // g)) < g]
    return rng.choice(options) if options else None


def _random_case(rng: random.Random, N: int, K: int, k0: int, B: int) -> Case:
    scoring = rng.choice(("softmax", "sigmoid"))
    groups = group_count(N, K, rng) if rng.random() < 0.4 else None
    nv = rng.choice((None, B, max(B - 1, 0), rng.randint(0, B), 0 if rng.random() < 0.3 else B // 2))
    return Case(
        B=B,
        N=N,
        K=K,
        k0=k0,
        nv=nv,
        nv_kind=rng.choice(("0d", "1d", "int")),
        scoring=scoring,
        bias=scoring == "sigmoid" and rng.random() < 0.7,
        groups=groups or 1,
        restrict=groups is not None,
        ties=rng.choice(("none", "bf16", "few", "few")),
        ids_dtype=torch.int32 if rng.random() < 0.85 else torch.int64,
        w_dtype=torch.float32 if rng.random() < 0.8 else torch.bfloat16,
    )


def sampled_cases(seed: int = SEED) -> List[Case]:
    """A sampled grid in which every N, every K and every k0 < K appears (not the full product)."""
    rng = random.Random(seed)
    small_b = (1, 2, 3, 5, 7, 9, 13, 16, 24, 31)
    cases = []
    # Every K with every k0 < K; N cycles through the values that can hold K.
    for K in K_VALUES:
        ns = [n for n in N_VALUES if n >= K]
        for k0 in range(1, K):
            cases.append(_random_case(rng, ns[(K + k0) % len(ns)], K, k0, rng.choice(small_b)))
    # Every N with a few settings each, forcing the rarer features to appear.
    for N in N_VALUES:
        K = rng.choice([k for k in K_VALUES if 2 <= k <= N])
        base = _random_case(rng, N, K, rng.randint(1, K - 1), rng.choice(small_b))
        cases.append(replace(base, scoring="sigmoid", bias=True, ties="few"))
        groups = group_count(N, K, rng)
        if groups:
            cases.append(replace(base, groups=groups, restrict=True, ties="bf16", B=13))
        cases.append(replace(base, nv=0, B=7, nv_kind="1d", min_batch=0))  # gate open, all rows padded
    # Free draws over the whole grid.
    for _ in range(30):
        N = rng.choice(N_VALUES)
        K = rng.choice([k for k in K_VALUES if 2 <= k <= N])
        cases.append(_random_case(rng, N, K, rng.randint(1, K - 1), rng.randint(1, 40)))
    cases += [
        Case(B=1, N=8, K=8, k0=1),  # K == N: every expert is routed
        Case(B=1, N=8, K=2, k0=1, nv=1, ties="few"),
        Case(B=13, N=160, K=6, k0=2, nv=20, nv_kind="int"),  # more real rows than rows
        Case(B=7, N=8, K=1, k0=1),  # k0 >= K: the router's own
        Case(B=9, N=256, K=8, k0=3, scoring="sigmoid", bias=True, groups=8, restrict=True, ties="bf16"),
        Case(B=1024, N=64, K=8, k0=3, nv=1001, ties="bf16"),
    ]
    # Every other case also counts distinct experts (the other half keeps the plain path tested),
    # and every other pair adds the checksum: all four combinations of the two.
    return [replace(c, stats=i % 2 == 0, checksum=i // 2 % 2 == 0) for i, c in enumerate(cases)]


def large_cases() -> List[Case]:
    """Extra cases for the GPU: the benchmark shapes at large B (the interpreter is too slow)."""
    out = []
    for B, nv in ((256, 250), (1024, 1024), (1024, 77)):
        out.append(Case(B=B, N=128, K=8, k0=3, nv=nv, ties="bf16"))
        out.append(Case(B=B, N=256, K=8, k0=4, nv=nv, scoring="sigmoid", bias=True, groups=8, restrict=True))
        out.append(Case(B=B, N=512, K=16, k0=5, nv=nv, ties="few"))
    return out


def router_inputs(case: Case, gen: torch.Generator, device="cpu"):
    """Logits and the router's own top-K with columns shuffled per row, like SGLang's select_experts.

    Returns logits [B, N], topk_ids [B, K], topk_weights [B, K] on `device`, and the RouterSpec.
    """
    B, N, K = case.B, case.N, case.K
    if case.ties == "few":
        logits = torch.randint(-2, 3, (B, N), generator=gen).float() * 0.75
        bias = torch.randint(-2, 3, (N,), generator=gen).float() * 0.05
    else:
        logits = torch.randn(B, N, generator=gen) * 2
        bias = torch.randn(N, generator=gen) * 0.1
    if case.ties == "bf16":
        logits = logits.to(torch.bfloat16)
    spec = RouterSpec(case.scoring, bias if case.bias else None, case.groups, case.restrict)
    selection, weight = score_experts(logits, spec)
    if case.restrict:
        group_size = N // case.groups
        topk_group = math.ceil(K / group_size)
        group_scores = selection.view(B, case.groups, group_size).max(dim=-1).values
        chosen = group_scores.topk(topk_group, dim=-1).indices
        keep = torch.zeros(B, case.groups, dtype=torch.bool).scatter(1, chosen, True)
        selection = selection.masked_fill(~keep.repeat_interleave(group_size, dim=1), float("-inf"))
    ids = selection.topk(K, dim=-1).indices
    ids = ids.gather(1, torch.rand(B, K, generator=gen).argsort(dim=1))
    w = weight.gather(1, ids)
    w = w / w.sum(dim=1, keepdim=True) * 2.5  # renormalised, then a routed scaling factor
    spec = replace(spec, correction_bias=None if spec.correction_bias is None else spec.correction_bias.to(device))
    return logits.to(device), ids.to(case.ids_dtype).to(device), w.to(case.w_dtype).to(device), spec


def num_valid_arg(case: Case, device):
    """num_valid_rows as the kernel receives it: None, int, or an int32 device tensor."""
    if case.nv is None or case.nv_kind == "int":
        return case.nv
    shape = () if case.nv_kind == "0d" else (1,)
    return torch.full(shape, case.nv, dtype=torch.int32, device=device)


def case_control(case: Case, device) -> torch.Tensor:
    """The case's settings as a device control block int32 [3] (k0, min_batch, max_batch), as the
    runtime holds them (persistent: a captured call reads it at every replay)."""
    return torch.tensor([case.k0, case.min_batch, case.max_batch], dtype=torch.int32).to(device)


def run_kernel(case: Case, logits, ids, w, spec: RouterSpec, num_valid=None, workspace=None, stats=None,
               checksum=None, control=None, lost=None):
    """The fused kernel on one case; num_valid defaults to num_valid_arg(case). The settings are the
    case's ints (written into the workspace's control slot by every call), or `control`, a device
    control block holding them (case_control: nothing written per call, as the runtime runs it)."""
    settings = dict(k0=case.k0, min_batch=case.min_batch, max_batch=case.max_batch) if control is None else dict(
        control=control)
    return kernels().oea_route(
        logits,
        ids,
        w,
        scoring_func=spec.scoring_func,
        correction_bias=spec.correction_bias,
        num_groups=spec.num_groups,
        restrict_groups=spec.restrict_groups,
        num_valid_rows=num_valid_arg(case, logits.device) if num_valid is None else num_valid,
        workspace=workspace,
        stats=stats,
        checksum=checksum,
        lost=lost,
        **settings,
    )
