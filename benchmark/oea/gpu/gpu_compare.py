"""Checks 1 and 2 of gpu_check.py: the fused kernel against sglang_oea.routing.route_from_logits
on the case grid (gpu_cases.py), with the expert counters, the lost router mass and the rank-check
checksum it writes (check 1), and under CUDA-graph replay with a persistent row count (check 2).
The lost router mass is checked against a brute-force computation (Python sets, float64 sums) on
the reference routing's output, independent of reference.lost_router_mass and of the kernel. Shared with
test/srt/test_oea_kernel.py, which runs them in Triton's interpreter.
"""

import time
import traceback
from dataclasses import replace
from typing import List, Optional, Sequence, Tuple

import torch

from gpu.gpu_cases import SEED, Case, kernels, router_inputs, run_kernel
from sglang_oea.routing import RouterSpec, route_from_logits


def new_stats(device, layers: int = 3, layer: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """A persistent [layers, 3] int64 counter buffer and its row `layer`, as the runtime holds them."""
    sums = torch.zeros(layers, 3, dtype=torch.int64, device=device)
    return sums, sums[layer]


def new_counters(device, layers: int = 3, layer: int = 1):
    """A persistent [layers, WIDTH] int64 table as the runtime holds it (sglang_oea.counters), with
    the stats row table[layer, :3], the checksum slot table[layer, 3:4] (8 mod 16 bytes aligned)
    and the lost row table[layer, LOST:] (one column per k0)."""
    from sglang_oea.counters import LOST, WIDTH

    table = torch.zeros(layers, WIDTH, dtype=torch.int64, device=device)
    return table, table[layer, :3], table[layer, 3:4], table[layer, LOST:]


def brute_force_lost_units(own_ids, own_w, new_ids, new_w, num_experts: int, rows: int) -> Tuple[int, int]:
    """(units, rows counted): the lost router mass of the first `rows` rows, each row's share
    rounded to the nearest 2^-20, computed with Python sets and float64 sums (not with
    reference.lost_router_mass): own experts (ids in [0, N)) not among the row's final experts of
    weight > 0, over all its own experts, by router weight."""
    from sglang_oea.reference import MASS_ONE

    units = 0
    for r in range(rows):
        final = {int(e) for e, x in zip(new_ids[r].tolist(), new_w[r].float().tolist()) if x > 0}
        own = [(int(e), float(x)) for e, x in zip(own_ids[r].tolist(), own_w[r].float().tolist()) if 0 <= e < num_experts]
        total = sum(x for _, x in own)
        gone = sum(x for e, x in own if e not in final)
        units += int(gone / total * MASS_ONE + 0.5) if total > 0 else 0
    return units, rows


def expected_lost(case: Case, logits, ids, w, spec: RouterSpec, nv=None) -> Tuple[int, int]:
    """What one call adds to its lost row at k0, (units, rows counted): brute_force_lost_units of
    the reference routing over the real rows where the gate is open; nothing otherwise."""
    from sglang_oea.reference import batch_gate

    nv = case.nv if nv is None else nv
    rows = case.B if nv is None else min(nv, case.B)
    if case.k0 >= case.K or case.B == 0 or not bool(batch_gate(rows, case.min_batch, case.max_batch)):
        return 0, 0
    ref_ids, ref_w = route_from_logits(logits, ids, w, spec, case.k0, nv, case.min_batch, case.max_batch)
    return brute_force_lost_units(ids.cpu(), w.cpu(), ref_ids.cpu(), ref_w.cpu(), case.N, rows)


def lost_error(case: Case, table: torch.Tensor, layer: int, want: Tuple[int, int], k0: Optional[int] = None) -> Optional[str]:
    """None when the lost row of `layer` holds want's units at k0 (to within one unit per counted
    row: float32 sums in another order) and zero everywhere else in the lost columns."""
    from sglang_oea.counters import LOST

    k0 = case.k0 if k0 is None else k0
    lost = table[:, LOST:].cpu()
    units, rows = want
    got = int(lost[layer, k0]) if k0 < lost.shape[1] else 0
    if abs(got - units) > rows:
        return f"{case}: lost router mass {got} units at k0={k0}, expected {units} (+-{rows})"
    rest = lost.clone()
    if k0 < lost.shape[1]:
        rest[layer, k0] = 0
    if rest.any():
        return f"{case}: lost router mass written outside its column: {rest.nonzero().tolist()}"
    return None


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
    case.checksum, the lost router mass with the stats, all in one counter table as the runtime has
    them); on CUDA, also require a bitwise-identical second run, which flips the counters on or off."""
    import zlib

    gen = torch.Generator().manual_seed(SEED + zlib.crc32(str(case).encode()))
    logits, ids, w, spec = router_inputs(case, gen, device)

    def run(with_stats: bool):
        # The runtime passes the lost row wherever it passes the stats row.
        table, row, slot, lost = new_counters(device)
        out = run_kernel(case, logits, ids, w, spec, stats=row if with_stats else None,
                         checksum=slot if case.checksum else None, lost=lost if with_stats else None)
        err = stats_error(case, table[:, :3], 1, expected_stats(case, logits, ids, w, spec) if with_stats else [0] * 3)
        want = expected_checksum(case, logits, ids, w, spec) if case.checksum else 0
        want_lost = expected_lost(case, logits, ids, w, spec) if with_stats else (0, 0)
        return out, err or checksum_error(case, table, 1, want) or lost_error(case, table, 1, want_lost)

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

    The expert counters, the lost router mass and the rank-check checksum are captured with the
    routing, into one persistent counter table as the runtime holds it: after every replay the stats
    row must hold the cumulative reference counts, the lost column at k0 the cumulative brute-force
    units (one unit per counted row of tolerance), and the checksum slot the cumulative (wrapping)
    sum of reference.ids_checksum over each replay's real rows.

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
        table, stats_row, checksum, lost = new_counters(device)  # persistent, captured like the runtime's table
        sums = table[:, :3]
        want_sums, want_checksum, want_lost = [0, 0, 0], 0, (0, 0)

        def route():
            return run_kernel(case, logits, ids, w, spec, num_valid=num_valid, workspace=ws, stats=stats_row,
                              checksum=checksum, lost=lost)

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
            want_lost = tuple(a + b for a, b in zip(want_lost, expected_lost(case, logits, ids, w, spec, nv=n)))
            if err is None:
                err = (stats_error(case, sums, 1, want_sums) or checksum_error(case, table, 1, want_checksum)
                       or lost_error(case, table, 1, want_lost))
            if int(ws.union.count_nonzero()) or int(ws.routed.count_nonzero()) or int(ws.counter.item()):
                err = (err or "") + " workspace not left clean"
            statuses.append(f"{n}:{'ok' if err is None else 'FAIL'}{'' if gate_open else '(gate closed)'}")
            if err:
                failures.append(f"graph replay {case} rows={n}: {err}")
        lines.append(f"| {case.N}/{case.K} k0={case.k0} {case.scoring} gate {case.min_batch}:{case.max_batch} | "
                     + " ".join(statuses) + f"; stats (steps, T before, T after) {sums[1].tolist()}, "
                     f"lost router mass {int(lost[case.k0])} units, "
                     f"checksum {int(table[1, 3]) & (1 << 64) - 1:#018x} |")
    return failures, lines
