"""The shared case grid of the fused OEA kernel checks: cases, router inputs, the comparison with
sglang_oea.routing.route_from_logits, check 1 (kernel == reference, expert counters and rank-check
checksum included), check 2 (CUDA-graph replay with a persistent row count) and the score-bits
check (`check_score_bits`: the kernel's selection scores against torch's, bit for bit, and
near-ties at the base boundary). Used by benchmark/oea/gpu_check.py and test/srt/test_oea_kernel.py.

Importing this module imports torch, not triton: the kernel module is imported on first use, so a
caller can set TRITON_INTERPRET=1 first.
"""

import contextlib
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


def run_kernel(case: Case, logits, ids, w, spec: RouterSpec, num_valid=None, workspace=None, stats=None,
               checksum=None):
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
        checksum=checksum,
    )


def new_stats(device, layers: int = 3, layer: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """A persistent [layers, 3] int64 counter buffer and its row `layer`, as the runtime holds them."""
    sums = torch.zeros(layers, 3, dtype=torch.int64, device=device)
    return sums, sums[layer]


def new_counters(device, layers: int = 3, layer: int = 1) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A persistent [layers, 4] int64 table as the runtime holds it (sglang_oea.counters), the stats
    row table[layer, :3] and the checksum slot table[layer, 3:] (8 mod 16 bytes aligned)."""
    table = torch.zeros(layers, 4, dtype=torch.int64, device=device)
    return table, table[layer, :3], table[layer, 3:]


def expected_checksum(case: Case, logits, ids, w, spec: RouterSpec, nv=None) -> int:
    """What one call adds to its checksum slot: reference.ids_checksum of the reference routing's
    ids over the real rows, gate open or closed; nothing when k0 >= K (no launch)."""
    from sglang_oea.reference import ids_checksum

    nv = case.nv if nv is None else nv
    if case.k0 >= case.K or case.B == 0:
        return 0
    ref_ids, _ = route_from_logits(logits, ids, w, spec, case.k0, nv, case.min_batch, case.max_batch)
    return int(ids_checksum(ref_ids.cpu(), nv))


def checksum_error(case: Case, table: torch.Tensor, layer: int, want: int) -> Optional[str]:
    """None when table[layer, 3] holds `want` (an int64 value) and column 3 is zero elsewhere."""
    got = table[:, 3].cpu()
    if int(got[layer]) != want:
        return f"{case}: checksum {int(got[layer])}, expected {want}"
    if torch.cat([got[:layer], got[layer + 1 :]]).any():
        return f"{case}: checksum wrote outside its slot: {got.tolist()}"
    return None


def wrapping_sum(a: int, b: int) -> int:
    """a + b as int64 arithmetic does it (mod 2^64, signed)."""
    total = (a + b) & ((1 << 64) - 1)
    return total - (1 << 64) if total >> 63 else total


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
    """Run one case against the reference (with the expert counters if case.stats, the checksum if
    case.checksum, both in one [L, 4] table as the runtime has them); on CUDA, also require a
    bitwise-identical second run, which flips the counters on or off."""
    import zlib

    gen = torch.Generator().manual_seed(SEED + zlib.crc32(str(case).encode()))
    logits, ids, w, spec = router_inputs(case, gen, device)

    def run(with_stats: bool):
        table, row, slot = new_counters(device)
        out = run_kernel(case, logits, ids, w, spec, stats=row if with_stats else None,
                         checksum=slot if case.checksum else None)
        err = stats_error(case, table[:, :3], 1, expected_stats(case, logits, ids, w, spec) if with_stats else [0] * 3)
        want = expected_checksum(case, logits, ids, w, spec) if case.checksum else 0
        return out, err or checksum_error(case, table, 1, want)

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

    The expert counters and the rank-check checksum are captured with the routing, into one
    persistent [L, 4] table as the runtime holds it: after every replay the stats row must hold the
    cumulative reference counts, and the checksum slot the cumulative (wrapping) sum of
    reference.ids_checksum over each replay's real rows.

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
        table, stats_row, checksum = new_counters(device)  # persistent, captured like the runtime's table
        sums = table[:, :3]
        want_sums, want_checksum = [0, 0, 0], 0

        def route():
            return run_kernel(case, logits, ids, w, spec, num_valid=num_valid, workspace=ws, stats=stats_row,
                              checksum=checksum)

        if use_graph:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                route()  # compile and load outside the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out_ids, out_w = route()
            table.zero_()  # the eager warm-up call counted too
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
            want_checksum = wrapping_sum(want_checksum, expected_checksum(case, logits, ids, w, spec, nv=n))
            if err is None:
                err = stats_error(case, sums, 1, want_sums) or checksum_error(case, table, 1, want_checksum)
            if int(ws.union.count_nonzero()) or int(ws.routed.count_nonzero()) or int(ws.counter.item()):
                err = (err or "") + " workspace not left clean"
            statuses.append(f"{n}:{'ok' if err is None else 'FAIL'}{'' if gate_open else '(gate closed)'}")
            if err:
                failures.append(f"graph replay {case} rows={n}: {err}")
        lines.append(f"| {case.N}/{case.K} k0={case.k0} {case.scoring} gate {case.min_batch}:{case.max_batch} | "
                     + " ".join(statuses) + f"; stats (steps, T before, T after) {sums[1].tolist()}, "
                     f"checksum {int(table[1, 3]) & (1 << 64) - 1:#018x} |")
    return failures, lines


# ------------------------------------------------------------------------------------------------
# Score bits: the kernel's selection scores against torch's, and near-ties at the base boundary
# ------------------------------------------------------------------------------------------------

SCORE_BLOCK = 1024
_SCORE_BLOCKS_KERNEL = None


def score_blocks_kernel():
    """A one-launch Triton kernel, built on first use: program p writes the routing kernels' own
    `_scores` jit helper of x[p * BLOCK : (p + 1) * BLOCK] (bias alike) into sel and w.

    Triton resolves a kernel's names in its module's globals (the interpreter even re-executes the
    source there, so closures are not seen): the imports below bind module globals on purpose.
    """
    global _SCORE_BLOCKS_KERNEL, triton, tl, _scores
    if _SCORE_BLOCKS_KERNEL is None:
        import triton
        import triton.language as tl

        _scores = kernels()._scores

        @triton.jit
        def _score_blocks(x_ptr, bias_ptr, sel_ptr, w_ptr, numel, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK: tl.constexpr):
            start = tl.program_id(0) * BLOCK
            cols = tl.arange(0, BLOCK)
            sel, w = _scores(x_ptr + start, bias_ptr + start, cols, numel - start, SIGMOID, HAS_BIAS)
            tl.store(sel_ptr + start + cols, sel, mask=cols < numel - start)
            tl.store(w_ptr + start + cols, w, mask=cols < numel - start)

        _SCORE_BLOCKS_KERNEL = _score_blocks
    return _SCORE_BLOCKS_KERNEL


def kernel_scores(x: torch.Tensor, bias: Optional[torch.Tensor], sigmoid: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sel, w) of the flat float32 x [M], M a multiple of SCORE_BLOCK (softmax: one row per block),
    as the routing kernels score a row, compiled with their options."""
    sel, w = torch.empty_like(x), torch.empty_like(x)
    with contextlib.ExitStack() as quiet:
        if not x.is_cuda:  # the interpreter's numpy warns on the deliberate overflows (exp(inf), inf - inf)
            import numpy as np

            quiet.enter_context(np.errstate(over="ignore", invalid="ignore"))
        score_blocks_kernel()[(x.numel() // SCORE_BLOCK,)](
            x, x if bias is None else bias, sel, w, x.numel(), SIGMOID=sigmoid, HAS_BIAS=bias is not None,
            BLOCK=SCORE_BLOCK, **dict(kernels().COMPILE_OPTIONS))
    return sel, w


def score_inputs(size: int, gen: torch.Generator, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [M] float32 and a bias [M] on `device`, M = size rounded up to SCORE_BLOCK: mostly uniform
    over [-30, 30]; sweeps where exp over- or underflows (|x| in 80..110) and where sigmoid
    saturates (|x| near 16.6); tiny |x|; the special values (+-0, subnormal, FLT_MIN, huge,
    FLT_MAX, +-inf). The bias is normal * 0.5, with +0.0 and -0.0 in every tenth element."""
    f32 = torch.finfo(torch.float32)
    special = [0.0, -0.0, 1e-45, -1e-45, f32.tiny, -f32.tiny, 1e-30, -1e-30, 1e30, -1e30, f32.max, -f32.max,
               float("inf"), float("-inf"), 88.72283, -88.72283, 87.33654, -87.33654, 103.97208, -103.97208]
    sweep = max(size // 50, 64)
    parts = [
        torch.tensor(special),
        torch.linspace(-110.0, -80.0, sweep), torch.linspace(80.0, 110.0, sweep),
        torch.linspace(-17.5, -15.5, sweep), torch.linspace(15.5, 17.5, sweep),
        (torch.rand(sweep, generator=gen) * 2 - 1) * 1e-6,
    ]
    used = sum(p.numel() for p in parts)
    total = -(-max(size, used) // SCORE_BLOCK) * SCORE_BLOCK
    x = torch.cat(parts + [torch.rand(total - used, generator=gen) * 60 - 30])
    bias = torch.randn(total, generator=gen) * 0.5
    bias[::20] = 0.0
    bias[1::20] = -0.0
    return x.to(device), bias.to(device)


def reference_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """What the kernel's sigmoid must equal bit for bit on x's device: torch.sigmoid on CUDA (the
    torch path); on the CPU, where the kernel runs in Triton's interpreter, numpy's float32
    1 / (1 + exp(-x)) (torch's CPU sigmoid is another implementation, off in the last bit)."""
    if x.is_cuda:
        return torch.sigmoid(x)
    import numpy as np

    one = np.float32(1.0)
    with np.errstate(over="ignore"):
        return torch.from_numpy(one / (one + np.exp(-x.numpy())))


def bit_mismatches(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """[M] bool: float32 elements whose bits differ (-0.0 is not +0.0)."""
    return got.view(torch.int32) != want.view(torch.int32)


def score_bits(x: torch.Tensor, bias: torch.Tensor) -> Tuple[List[str], List[str]]:
    """The kernel's scores against the torch path's, bit for bit, on x's device (see check_score_bits)."""
    from sglang_oea.routing import softmax_rows

    w_ref = reference_sigmoid(x)
    _, w = kernel_scores(x, None, sigmoid=True)
    sel, w_of_biased = kernel_scores(x, bias, sigmoid=True)
    soft_sel, soft_w = kernel_scores(x, None, sigmoid=False)
    checks = {  # name: (kernel, torch path)
        "sigmoid w": (w, w_ref),
        "sigmoid w, biased call": (w_of_biased, w_ref),
        "sigmoid + bias sel": (sel, w_ref + bias),  # routing.score_experts: one float32 add
        "softmax sel (the logit)": (soft_sel, x),
    }
    errors, counts = [], []
    for name, (got, want) in checks.items():
        bad = bit_mismatches(got, want)
        counts.append(f"{name}: {int(bad.sum())}")
        if bad.any():
            first = int(bad.nonzero()[0])
            errors.append(f"score bits: {name}: {int(bad.sum())} of {x.numel()} values differ from the torch path "
                          f"(first x = {float(x[first])!r}: kernel {float(got[first])!r}, "
                          f"torch {float(want[first])!r})")
    # Softmax weights only need the weight tolerance: the sum's order differs between the paths.
    rows = x.view(-1, SCORE_BLOCK)
    finite = rows.isfinite().all(dim=1)
    want_w, got_w = softmax_rows(rows[finite]), soft_w.view(-1, SCORE_BLOCK)[finite]
    worst = float(((got_w - want_w).abs() / want_w.clamp_min(1e-30)).max())
    if not torch.allclose(got_w, want_w, rtol=1e-5, atol=1e-12):
        errors.append(f"score bits: softmax weights off from the torch path by up to {worst:.2e} (relative)")
    against = "torch on CUDA" if x.is_cuda else (
        "numpy's formula (torch's CPU sigmoid differs in "
        f"{int(bit_mismatches(w_ref, torch.sigmoid(x)).sum())} of them)")
    line = (f"| score bits vs {against} | {x.numel()} values | differing: " + ", ".join(counts)
            + f"; softmax weights max rel. diff {worst:.1e} |")
    return errors, [line]


def _ulp_neighbours(x: torch.Tensor, span: int) -> torch.Tensor:
    """[R, 2 * span + 1] float32: the floats within `span` ulps of each positive finite x [R]."""
    steps = torch.arange(-span, span + 1, dtype=torch.int32, device=x.device)
    return (x.view(torch.int32)[:, None] + steps).view(torch.float32)


def _sigmoid_score_pairs(device, gen: torch.Generator, beta: torch.Tensor):
    """Candidates x_a, x_b [R] float32, x_a in [1, 2], with sigmoid(x_b) + beta 1 ulp below
    sigmoid(x_a) + beta as reference_sigmoid computes them elementwise, and found [R] bool (False
    where no x_b lies within 64 ulps of the closed-form guess)."""
    x_a = (torch.rand(beta.numel(), generator=gen) + 1).to(device)
    sel_a = reference_sigmoid(x_a) + beta
    target = torch.nextafter(sel_a, torch.full_like(sel_a, float("-inf")))
    goal = (target.double() - beta.double()).clamp(1e-6, 1 - 1e-6)
    cand = _ulp_neighbours((goal / (1 - goal)).log().float(), 64)  # [R, C]
    match = reference_sigmoid(cand.flatten()).view_as(cand) + beta[:, None] == target[:, None]
    x_b = cand.gather(1, match.int().argmax(dim=1, keepdim=True))[:, 0]
    return x_a, x_b, match.any(dim=1)


def _one_ulp_apart(logits: torch.Tensor, spec: RouterSpec, a: torch.Tensor, b: torch.Tensor):
    """(selection, weight, ok [R] bool): the torch path's scores of logits, and whether
    selection[r, a_r] lies 1 ulp above selection[r, b_r] (both positive). On the CPU (interpreted
    kernel), with sigmoid, ok also needs the torch path's weights there to be numpy's bits."""
    selection, weight = score_experts(logits, spec)
    both = torch.stack([a, b], dim=1)
    sel = selection.gather(1, both)
    ok = (sel[:, 1] > 0) & (sel[:, 0].view(torch.int32) - sel[:, 1].view(torch.int32) == 1)
    if spec.scoring_func == "sigmoid" and not logits.is_cuda:
        ok &= (weight.gather(1, both) == reference_sigmoid(logits.gather(1, both).contiguous())).all(dim=1)
    return selection, weight, ok


def near_tie_inputs(scoring: str, device, gen: torch.Generator, rows: int = 16, k: int = 8, k0: int = 3):
    """Router inputs [rows, 64] where, in every row r, the k0-th and (k0+1)-th routed experts a_r and
    b_r (one of experts 2r, 2r + 1 each, drawn at random) have selection scores exactly 1 ulp apart
    as the torch path (routing.score_experts) computes them on `device`: sigmoid + correction bias
    (the bias of a_r and b_r is the row's beta) or softmax (logits 1 ulp apart). Every row also
    routes experts 32 and 33 (the best: bias +1) and four of 34..47 (below b_r, bias 0); experts
    48..63 have bias -1; unrouted logits are -6. Returns logits, topk_ids (int32, columns
    shuffled), topk_weights, spec, a [rows], b [rows]."""
    num_experts = 64
    assert 2 * rows <= 32 and (k, k0) == (8, 3)
    sigmoid = scoring == "sigmoid"
    beta = ((torch.rand(rows, generator=gen) - 0.5) * 0.4).to(device)
    swap = torch.rand(rows, generator=gen) < 0.5
    a = (2 * torch.arange(rows) + swap.long()).to(device)
    b = (2 * torch.arange(rows) + 1 - swap.long()).to(device)
    bias = torch.zeros(num_experts, device=device)
    bias[a], bias[b] = beta, beta
    bias[32:34], bias[48:] = 1.0, -1.0
    spec = RouterSpec(scoring, bias if sigmoid else None)
    logits = torch.full((rows, num_experts), -6.0, device=device)
    logits[:, 32:34] = (torch.rand(rows, 2, generator=gen) * 2 + 2).to(device)
    lower = (torch.rand(rows, 14, generator=gen).argsort(dim=1)[:, : k - k0 - 1] + 34).to(device)
    logits.scatter_(1, lower, (-torch.rand(rows, k - k0 - 1, generator=gen)).to(device))
    r = torch.arange(rows, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    for _ in range(40):  # redraw the rows that are not 1 ulp apart yet
        if sigmoid:
            x_a, x_b, found = _sigmoid_score_pairs(device, gen, beta)
        else:
            x_a = (torch.rand(rows, generator=gen) + 0.5).to(device)
            x_b, found = torch.nextafter(x_a, torch.full_like(x_a, float("-inf"))), torch.ones_like(done)
        take = found & ~done
        logits[r, a] = torch.where(take, x_a, logits[r, a])
        logits[r, b] = torch.where(take, x_b, logits[r, b])
        # Checked on the whole batch: torch's CPU sigmoid differs in the last bit between its
        # vectorised body and its scalar tail, so the element's position matters there.
        selection, weight, done = _one_ulp_apart(logits, spec, a, b)
        if bool(done.all()):
            break
    assert bool(done.all()), f"{scoring}: rows {(~done).nonzero().flatten().tolist()} found no 1-ulp pair"
    ids = selection.topk(k, dim=1).indices
    assert torch.equal(ids[:, k0 - 1], a) and torch.equal(ids[:, k0], b), "the near tie is not at the boundary"
    ids = ids.gather(1, torch.rand(rows, k, generator=gen).argsort(dim=1).to(device))
    w = weight.gather(1, ids)
    w = w / w.sum(dim=1, keepdim=True) * 2.5
    return logits, ids.int(), w, spec, a, b


def near_ties(device) -> Tuple[List[str], List[str]]:
    """Kernel ids == torch path ids (and a_r, not b_r, in every base) on near_tie_inputs."""
    errors, lines = [], []
    gen = torch.Generator().manual_seed(SEED + 11)
    for scoring in ("sigmoid", "softmax"):
        logits, ids, w, spec, a, b = near_tie_inputs(scoring, device, gen)
        case = Case(B=logits.shape[0], N=logits.shape[1], K=8, k0=3, scoring=scoring, bias=scoring == "sigmoid")
        out_ids, out_w = run_kernel(case, logits, ids, w, spec)
        err = compare(case, out_ids, out_w, logits, ids, w, spec)
        base = out_ids[:, : case.k0].long()
        if err is None and not bool(((base == a[:, None]).any(dim=1) & ~(base == b[:, None]).any(dim=1)).all()):
            err = f"{case}: some base holds b_r (1 ulp below a_r) instead of a_r: {base.tolist()}"
        if err:
            errors.append(f"near tie ({scoring}): {err}")
        lines.append(f"| near tie at the base boundary, {scoring}{' + bias' * (scoring == 'sigmoid')} | "
                     f"{case.B} rows, selection 1 ulp apart | {'ok' if err is None else 'FAIL'} |")
    return errors, lines


def check_score_bits(device, size: Optional[int] = None) -> Tuple[List[str], List[str]]:
    """The kernel's selection scores are the torch path's, bit for bit: `_scores` (the routing
    kernels' own helper, compiled with their options) over ~1e6 float32 values (uniform over
    [-30, 30], over/underflow sweeps, special values) against torch.sigmoid(x) (+ bias) on the same
    device, and softmax's selection against the logit itself; expected 0 differing values. Then two
    near-tie batches whose a_r / b_r selection scores are 1 ulp apart at the base boundary (sigmoid +
    bias and softmax): kernel ids == route_from_logits ids.

    On the CPU (TRITON_INTERPRET=1; size defaults to 16 blocks) the kernel's exp is numpy's, so the
    bits are checked against numpy's float32 formula instead, and the near-ties use values where
    numpy and torch agree.

    Returns (failures, report lines).
    """
    device = torch.device(device)
    size = size or (1 << 20 if device.type == "cuda" else 16 * SCORE_BLOCK)
    x, bias = score_inputs(size, torch.Generator().manual_seed(SEED + 10), device)
    errors, lines = score_bits(x, bias)
    tie_errors, tie_lines = near_ties(device)
    return errors + tie_errors, lines + tie_lines


def probability_tie_inputs(device="cpu"):
    """Softmax router inputs [5, 64] whose probabilities tie where the logits do not, so that ranking
    by probability (the old selection score) and by logit (the current one) choose different ids:
      rows 0-1: the routed experts after the best one have logits around -100 (ascending with the
          id), so their probabilities underflow to 0;
      rows 2-3: routed logits 1.0 and the next float up, 1 ulp apart, at a max of 20: x - max rounds
          to the same float, so their probabilities are equal;
      row 4: expert 16 (in row 0's base) has logit -inf: never a piggyback candidate there.
    Returns logits, topk_ids (int32, the top 8 by logit, columns shuffled), topk_weights (float32,
    renormalised) and the RouterSpec."""
    num_rows, num_experts, k = 5, 64, 8
    gen = torch.Generator().manual_seed(SEED + 12)
    logits = torch.rand(num_rows, num_experts, generator=gen) * 4 - 150  # unrouted: far below
    logits[:, 5] = 20.0
    for r in (0, 1):
        ids = torch.arange(10, 17) + 20 * r
        logits[r, ids] = -100.0 + torch.arange(7.0)  # higher id, higher logit; exp(x - 20) == 0
    for r in (2, 3):
        logits[r, 40 + r] = 1.0
        logits[r, 41 + r] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
        logits[r, torch.arange(50, 55) + r] = -1.0 - torch.arange(5.0)
    logits[4, 10:17] = torch.arange(7.0)
    logits[4, 16] = float("-inf")
    logits[4, 30] = 10.0
    ids = logits.topk(k, dim=1).indices
    ids = ids.gather(1, torch.rand(num_rows, k, generator=gen).argsort(dim=1))
    weights = logits.softmax(dim=1).gather(1, ids)
    weights = weights / weights.sum(dim=1, keepdim=True).clamp_min(1e-30)
    return logits.to(device), ids.int().to(device), weights.to(device), RouterSpec("softmax")
