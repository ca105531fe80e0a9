"""The shared case grid of the fused OEA kernel checks: cases, router inputs, the comparison with
sglang_oea.routing.route_from_logits, check 1 (kernel == reference) and check 2 (CUDA-graph replay
with a persistent row count). Used by benchmark/oea/gpu_check.py and test/srt/test_oea_kernel.py.

Importing this module imports torch, not triton: the kernel module is imported on first use, so a
caller can set TRITON_INTERPRET=1 first.
"""

import math
import random
import sys
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "python") not in sys.path:
    sys.path.insert(0, str(REPO / "python"))

import torch  # noqa: E402

from sglang_oea.routing import RouterSpec, route_from_logits, score_experts  # noqa: E402

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

    def __str__(self) -> str:
        parts = [f"B{self.B}", f"N{self.N}", f"K{self.K}", f"k0{self.k0}", f"nv{self.nv}", self.scoring]
        parts += ["bias"] * self.bias + [f"G{self.groups}r"] * self.restrict + [self.ties]
        parts += [str(self.ids_dtype).split(".")[-1], str(self.w_dtype).split(".")[-1]]
        return "-".join(parts + [f"gate{self.min_batch}:{self.max_batch}"] + ["stats"] * self.stats)


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
    # Every other case also counts distinct experts (the other half keeps the plain path tested).
    return [replace(c, stats=i % 2 == 0) for i, c in enumerate(cases)]


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


def run_kernel(case: Case, logits, ids, w, spec: RouterSpec, num_valid=None, workspace=None, stats=None):
    """The fused kernel on one case; num_valid defaults to num_valid_arg(case)."""
    return kernels().oea_route(
        logits,
        ids,
        w,
        k0=case.k0,
        scoring_func=spec.scoring_func,
        correction_bias=spec.correction_bias,
        num_groups=spec.num_groups,
        restrict_groups=spec.restrict_groups,
        num_valid_rows=num_valid_arg(case, logits.device) if num_valid is None else num_valid,
        min_batch=case.min_batch,
        max_batch=case.max_batch,
        workspace=workspace,
        stats=stats,
    )


def new_stats(device, layers: int = 3, layer: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """A persistent [layers, 3] int64 counter buffer and its row `layer`, as the runtime holds them."""
    sums = torch.zeros(layers, 3, dtype=torch.int64, device=device)
    return sums, sums[layer]


def expected_stats(case: Case, logits, ids, w, spec: RouterSpec, nv=None) -> List[int]:
    """What one call adds to its stats row: gate * (1, T before, T after), from sglang_oea.reference;
    nothing when k0 >= K (the launcher returns the router's tensors without a launch)."""
    from sglang_oea.reference import batch_gate, distinct_experts

    nv = case.nv if nv is None else nv
    if case.k0 >= case.K or case.B == 0:
        return [0, 0, 0]
    if not bool(batch_gate(case.B if nv is None else nv, case.min_batch, case.max_batch)):
        return [0, 0, 0]
    ref_ids, _ = route_from_logits(logits, ids, w, spec, case.k0, nv, case.min_batch, case.max_batch)
    before = distinct_experts(ids.cpu(), case.N, nv)
    after = distinct_experts(ref_ids.cpu(), case.N, nv)
    return [1, int(before), int(after)]


def stats_error(case: Case, sums: torch.Tensor, layer: int, want: List[int]) -> Optional[str]:
    """None when row `layer` of sums holds `want` and every other row is still zero."""
    got = sums.cpu()
    if got[layer].tolist() != want:
        return f"{case}: stats (steps, T before, T after) = {got[layer].tolist()}, expected {want}"
    if torch.cat([got[:layer], got[layer + 1 :]]).any():
        return f"{case}: stats wrote outside its row: {got.tolist()}"
    return None


def compare(case: Case, out_ids, out_w, logits, ids, w, spec: RouterSpec, nv=None) -> Optional[str]:
    """None when the kernel output equals the reference (ids exactly, weights to tolerance)."""
    nv = case.nv if nv is None else nv
    ref_ids, ref_w = route_from_logits(logits, ids, w, spec, case.k0, nv, case.min_batch, case.max_batch)
    out_ids, out_w, ref_ids, ref_w, ids = out_ids.cpu(), out_w.cpu(), ref_ids.cpu(), ref_w.cpu(), ids.cpu()
    if out_ids.dtype != ids.dtype or out_w.dtype != w.dtype or out_ids.shape != ids.shape:
        return f"{case}: dtype/shape {out_ids.dtype} {out_w.dtype} {tuple(out_ids.shape)}"
    bad = (out_ids.long() != ref_ids).any(dim=1).nonzero().flatten()
    if bad.numel():
        r = bad[0].item()
        return (
            f"{case}: {bad.numel()} rows differ; row {r}: kernel {out_ids[r].tolist()} "
            f"reference {ref_ids[r].tolist()} routed {ids[r].tolist()}"
        )
    if w.dtype == torch.float32:
        tol = dict(rtol=1e-5, atol=1e-6)
    else:
        tol = dict(rtol=1.6e-2, atol=1e-5)
    try:
        torch.testing.assert_close(out_w, ref_w, **tol)
    except AssertionError as e:
        return f"{case}: weights: {e}"
    if (out_w[ref_w == 0] != 0).any():
        return f"{case}: an inactive slot carries weight"
    return None


def check_case(case: Case, device="cpu") -> Optional[str]:
    """Run one case against the reference (with the expert counters if case.stats); on CUDA, also
    require a bitwise-identical second run, which flips the counters on or off."""
    import zlib

    gen = torch.Generator().manual_seed(SEED + zlib.crc32(str(case).encode()))
    logits, ids, w, spec = router_inputs(case, gen, device)

    def run(with_stats: bool):
        sums, row = new_stats(device) if with_stats else (None, None)
        out = run_kernel(case, logits, ids, w, spec, stats=row)
        err = None
        if with_stats:
            err = stats_error(case, sums, 1, expected_stats(case, logits, ids, w, spec))
        return out, err

    (out_ids, out_w), stats_err = run(case.stats)
    err = compare(case, out_ids, out_w, logits, ids, w, spec) or stats_err
    if err is None and device != "cpu":
        out_ids, out_w = out_ids.clone(), out_w.clone()  # a workspace-less call: fresh buffers anyway
        (again_ids, again_w), err = run(not case.stats)
        if err is None and not (torch.equal(again_ids, out_ids) and torch.equal(again_w, out_w)):
            err = f"{case}: second run (stats={not case.stats}) differs (non-deterministic)"
    return err


def _check_cases_worker(payload: Tuple[List[Case], str]) -> List[Tuple[str, Optional[str], float]]:
    cases, device = payload
    results = []
    for case in cases:
        t = time.time()
        try:
            err = check_case(case, device)
        except Exception:  # a crash is a failure of that case, reported with its traceback
            err = f"{case}: exception\n{traceback.format_exc()}"
        results.append((str(case), err, time.time() - t))
    return results


def check_correctness(cases: Sequence[Case], device: str, workers: int) -> Tuple[List[str], float]:
    """Check 1. Returns failure messages and wall seconds; workers > 1 spreads the (mostly Triton
    compile) work over processes that share Triton's on-disk kernel cache."""
    t = time.time()
    chunks = [list(cases[i::workers]) for i in range(workers)] if workers > 1 else [list(cases)]
    results = []
    if workers > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        try:
            with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
                for part in pool.map(_check_cases_worker, [(c, device) for c in chunks]):
                    results += part
        except Exception as e:  # e.g. no spawn support: fall back to this process
            print(f"  worker pool failed ({e!r}); checking in-process")
            results = _check_cases_worker((list(cases), device))
    else:
        results = _check_cases_worker((list(cases), device))
    errors = [err for _, err, _ in results if err]
    return errors, time.time() - t


# ------------------------------------------------------------------------------------------------
# Check 2: CUDA-graph replay with a persistent row count
# ------------------------------------------------------------------------------------------------


def _fill_order_errors(case: Case, out_ids: torch.Tensor, ref_ids: torch.Tensor, nv: int) -> List[str]:
    """Padded rows hold experts of U only (all of U when |U| < K); the batch loads max(|U|, K)."""
    errors = []
    union = set(ref_ids[:nv, : case.k0].flatten().tolist())
    for r in range(nv, out_ids.shape[0]):
        row = set(out_ids[r].tolist())
        ok = row <= union if len(union) >= case.K else union <= row
        if not ok:
            errors.append(f"padded row {r} {sorted(row)} vs |U| = {len(union)}")
            break
    distinct = len(set(out_ids.flatten().tolist()))
    if distinct != max(len(union), case.K):
        errors.append(f"batch loads {distinct} experts, expected max(|U|, K) = {max(len(union), case.K)}")
    return errors


def check_graph_replay(device: str, use_graph: bool) -> Tuple[List[str], List[str]]:
    """Check 2 (use_graph=False: the same sequence of calls without a graph, for the CPU).

    Returns (failures, report lines).
    """
    oea = kernels()
    bucket, counts = 16, (16, 13, 9, 1)
    configs = [
        Case(B=bucket, N=128, K=8, k0=3, ties="bf16"),
        Case(B=bucket, N=256, K=8, k0=4, scoring="sigmoid", bias=True, groups=8, restrict=True),
        Case(B=bucket, N=128, K=8, k0=3, ties="bf16", min_batch=4, max_batch=12),  # gate under replay
    ]
    if not use_graph:
        configs = [replace(c, N=64 if c.N == 128 else c.N) for c in configs]
    failures, lines = [], []
    gen = torch.Generator().manual_seed(SEED + 7)
    for case in configs:
        logits, ids, w, spec = router_inputs(case, gen, device)
        num_valid = torch.full((1,), bucket, dtype=torch.int32, device=device)
        ws = oea.OEAWorkspace.allocate(case.N, case.K, bucket, ids.dtype, w.dtype, device)
        sums, stats_row = new_stats(device)  # persistent, captured like the runtime's [L, 3] sums
        want_sums = [0, 0, 0]

        def route():
            return run_kernel(case, logits, ids, w, spec, num_valid=num_valid, workspace=ws, stats=stats_row)

        if use_graph:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                route()  # compile and load outside the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out_ids, out_w = route()
            sums.zero_()  # the eager warm-up call counted too
        statuses = []
        for n in counts:
            new_logits, new_ids, new_w, _ = router_inputs(case, gen, device)
            logits.copy_(new_logits)
            ids.copy_(new_ids)
            w.copy_(new_w)
            num_valid.fill_(n)  # the only thing that changes between replays of one bucket
            if use_graph:
                graph.replay()
                torch.cuda.synchronize()
            else:
                out_ids, out_w = route()
            err = compare(case, out_ids, out_w, logits, ids, w, spec, nv=n)
            gate_open = n >= case.min_batch and (case.max_batch == 0 or n <= case.max_batch)
            if err is None and gate_open:
                ref_ids, _ = route_from_logits(logits, ids, w, spec, case.k0, n, case.min_batch, case.max_batch)
                err = "; ".join(_fill_order_errors(case, out_ids.cpu(), ref_ids.cpu(), n)) or None
            if err is None and not gate_open and not (torch.equal(out_ids, ids) and torch.equal(out_w, w)):
                err = f"{case}: gate closed at {n} rows but the output is not the router's own"
            added = expected_stats(case, logits, ids, w, spec, nv=n)
            want_sums = [a + b for a, b in zip(want_sums, added)]
            if err is None:
                err = stats_error(case, sums, 1, want_sums)
            if int(ws.union.count_nonzero()) or int(ws.routed.count_nonzero()) or int(ws.counter.item()):
                err = (err or "") + " workspace not left clean"
            statuses.append(f"{n}:{'ok' if err is None else 'FAIL'}{'' if gate_open else '(gate closed)'}")
            if err:
                failures.append(f"graph replay {case} rows={n}: {err}")
        lines.append(f"| {case.N}/{case.K} k0={case.k0} {case.scoring} gate {case.min_batch}:{case.max_batch} | "
                     + " ".join(statuses) + f"; stats (steps, T before, T after) {sums[1].tolist()} |")
    return failures, lines

