"""The fused Triton OEA kernel (sglang_oea.kernels) against its pure-torch oracle.

On CUDA the kernels run on the GPU. Without CUDA they run in Triton's CPU interpreter, which must
be chosen before triton is first imported, so the process has to start with TRITON_INTERPRET=1:

    TRITON_INTERPRET=1 PYTHONPATH=python python -m pytest test/srt/test_oea_kernel.py -q

In a plain `pytest test/srt` on a CPU machine (no TRITON_INTERPRET), the kernel tests are skipped
here and test_whole_file_in_the_interpreter runs this file in a child process that has it.

The interpreter costs ~20-40 ms per row, so the grid is sampled: every listed N, K and every
k0 < K appears in some case. Half of the grid also passes the expert counters (`stats=`) and
checks them against sglang_oea.reference.distinct_experts and batch_gate, with the lost router
mass (`lost=`) against a brute-force computation (gpu_compare.expected_lost); half (crossed with it)
passes the rank-check checksum (`checksum=`) and checks it against reference.ids_checksum. The
grid and the inputs live in benchmark/oea/gpu/gpu_cases.py, the comparison in gpu_compare.py, which
benchmark/oea/gpu/gpu_check.py also runs on a GPU, together with its bitwise score check
(gpu_score_bits.check_score_bits), which these tests run in the interpreter.

In the interpreter the kernel's exp is numpy's, while the torch path's is torch's CPU exp, which
differs in the last bit for many inputs (and even between its vectorised body and scalar tail):
sigmoid scores agree here only up to such ulps. Softmax selection is the logit itself, the same
bits on both paths everywhere.
"""

import importlib
import os
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "python") not in sys.path:
    sys.path.insert(0, str(REPO / "python"))

pytest.importorskip("triton", reason="the OEA kernel needs triton (pip install triton)")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
IN_PROCESS = INTERPRET or torch.cuda.is_available()
DEVICE = "cpu" if INTERPRET else "cuda"
needs_kernel = pytest.mark.skipif(
    not IN_PROCESS, reason="no CUDA and TRITON_INTERPRET unset: run by test_whole_file_in_the_interpreter"
)


# benchmark/oea/gpu (on sys.path through conftest.py): the GPU check's case grid and inputs, its
# comparison with the reference, and its score-bits check.
from gpu import gpu_cases, gpu_compare, gpu_score_bits  # noqa: E402

Case, N_VALUES, K_VALUES, SEED = gpu_cases.Case, gpu_cases.N_VALUES, gpu_cases.K_VALUES, gpu_cases.SEED
CASES = gpu_cases.sampled_cases()
if IN_PROCESS:
    kernel_module = importlib.import_module("sglang_oea.kernels.oea_route")
    oea_route, OEAWorkspace = kernel_module.oea_route, kernel_module.OEAWorkspace


def _inputs(case: Case, seed: int):
    return gpu_cases.router_inputs(case, torch.Generator().manual_seed(seed), DEVICE)


def _assert_matches_oracle(case: Case, out_ids, out_w, logits, ids, w, spec):
    err = gpu_compare.compare(case, out_ids, out_w, logits, ids, w, spec)
    assert err is None, err


def test_grid_covers_every_listed_value():
    assert {c.N for c in CASES} >= set(N_VALUES)
    assert {c.K for c in CASES} >= set(K_VALUES)
    for K in K_VALUES:
        assert {c.k0 for c in CASES if c.K == K} >= set(range(1, K)), K
    assert {1, 7, 13, 1024} <= {c.B for c in CASES}
    assert any(c.nv is not None and 0 < c.nv < c.B for c in CASES)
    assert any(c.nv == 0 and c.min_batch == 0 for c in CASES)  # all rows padded, gate open
    assert any(c.nv == 0 and c.min_batch == 1 for c in CASES)  # gate closed
    assert {"softmax", "sigmoid"} == {c.scoring for c in CASES} and any(c.bias for c in CASES)
    assert any(c.restrict for c in CASES) and {"none", "bf16", "few"} == {c.ties for c in CASES}
    counted = [c for c in CASES if c.stats]
    assert 0 < len(counted) < len(CASES)  # both paths of the kernel
    assert any(c.nv is not None and 0 < c.nv < c.B for c in counted)  # padded rows
    assert any(c.nv == 0 for c in counted) and any(c.nv is None for c in counted)
    assert {"0d", "1d", "int"} <= {c.nv_kind for c in counted} and any(c.restrict for c in counted)
    summed = [c for c in CASES if c.checksum]
    assert 0 < len(summed) < len(CASES) and {(True, True), (True, False), (False, True), (False, False)} == {
        (c.stats, c.checksum) for c in CASES}
    assert any(c.nv is not None and 0 < c.nv < c.B for c in summed) and any(c.nv == 0 for c in summed)
    assert {"softmax", "sigmoid"} == {c.scoring for c in summed} and any(c.bias for c in summed)
    assert {torch.int32, torch.int64} == {c.ids_dtype for c in summed}


@needs_kernel
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_matches_oracle(case: Case):
    err = gpu_compare.check_case(case, DEVICE)
    assert err is None, err


GATE_CASES = [
    # (min_batch, max_batch, real rows, rows): closed below min_batch or above max_batch.
    (4, 0, 3, 8),
    (4, 0, 0, 5),
    (2, 8, 10, 12),
    (1, 6, 7, 7),
    (3, 5, 9, 16),
]


@needs_kernel
@pytest.mark.parametrize("min_batch,max_batch,nv,B", GATE_CASES)
@pytest.mark.parametrize("nv_kind", ["0d", "1d"])
def test_gate_closed_returns_router_output_bit_for_bit(min_batch, max_batch, nv, B, nv_kind):
    case = Case(B=B, N=64, K=8, k0=3, nv=nv, nv_kind=nv_kind, min_batch=min_batch, max_batch=max_batch)
    logits, ids, w, spec = _inputs(case, SEED)
    sums, row = gpu_compare.new_stats(DEVICE)
    out_ids, out_w = gpu_cases.run_kernel(case, logits, ids, w, spec, stats=row)
    assert out_ids.dtype == ids.dtype and out_w.dtype == w.dtype
    assert torch.equal(out_ids, ids)
    assert torch.equal(out_w.view(torch.int32), w.view(torch.int32))
    assert not sums.any()  # a closed gate counts nothing


@needs_kernel
@pytest.mark.parametrize("min_batch,max_batch,nv", [(4, 0, 4), (2, 8, 8), (3, 3, 3)])
def test_gate_open_at_its_bounds(min_batch, max_batch, nv):
    case = Case(B=10, N=128, K=8, k0=4, nv=nv, min_batch=min_batch, max_batch=max_batch, ties="bf16")
    logits, ids, w, spec = _inputs(case, SEED + 1)
    sums, row = gpu_compare.new_stats(DEVICE)
    out_ids, out_w = gpu_cases.run_kernel(case, logits, ids, w, spec, stats=row)
    assert not torch.equal(out_ids, ids)  # OEA changed something
    _assert_matches_oracle(case, out_ids, out_w, logits, ids, w, spec)
    want = gpu_compare.expected_stats(case, logits, ids, w, spec)
    assert want[0] == 1 and gpu_compare.stats_error(case, sums, 1, want) is None, (sums, want)


@needs_kernel
def test_workspace_is_reused_and_left_clean():
    """Back-to-back calls on one workspace: U and the counter are zero after each call."""
    ws = OEAWorkspace.allocate(160, 6, 16, torch.int32, torch.float32, DEVICE)
    calls = [(16, 16, "softmax"), (5, 13, "sigmoid"), (0, 9, "softmax"), (9, 9, "sigmoid")]
    for i, (nv, B, scoring) in enumerate(calls):
        case = Case(B=B, N=160, K=6, k0=2, nv=nv, scoring=scoring, bias=scoring == "sigmoid", ties="bf16")
        logits, ids, w, spec = _inputs(case, SEED + 2 + i)
        out_ids, out_w = gpu_cases.run_kernel(case, logits, ids, w, spec, workspace=ws)
        assert out_ids.data_ptr() == ws.out_ids.data_ptr() and out_ids.shape == (B, 6)
        assert int(ws.union.count_nonzero()) == 0 and int(ws.counter.item()) == 0
        assert int(ws.routed.count_nonzero()) == 0
        _assert_matches_oracle(case, out_ids, out_w, logits, ids, w, spec)


# (B, real rows, nv_kind, scoring, restrict, min_batch, max_batch, stats?): one persistent
# workspace and one [L, 3] buffer over all calls, so every call adds to what the previous left.
STATS_CALLS = [
    (16, 16, "1d", "softmax", False, 1, 0, True),  # full batch
    (13, 5, "0d", "sigmoid", True, 1, 0, True),  # padded rows, grouped
    (9, 1, "0d", "softmax", False, 1, 0, True),  # one real row: T after = max(|U|, K) = K
    (12, 3, "1d", "softmax", False, 4, 0, True),  # gate closed: below min_batch
    (16, 14, "int", "sigmoid", False, 2, 12, True),  # gate closed: above max_batch
    (7, 0, "1d", "softmax", False, 0, 0, True),  # gate open, no real row: (1, 0, 0)
    (11, 11, "0d", "softmax", False, 1, 0, False),  # no stats: the buffer is untouched
    (6, 20, "int", "sigmoid", True, 1, 0, True),  # more real rows than rows: all 6 count
    (14, 8, "1d", "softmax", False, 2, 8, True),  # gate open at max_batch
]


@needs_kernel
def test_stats_count_distinct_experts_and_accumulate():
    """stats += gate * (1, T before, T after): T from reference.distinct_experts over the valid rows
    of the router's ids (before) and of the OEA ids (after); the gate from reference.batch_gate."""
    from sglang_oea.reference import batch_gate, distinct_experts

    N, K, k0, layer = 96, 6, 2, 2
    ws = OEAWorkspace.allocate(N, K, 16, torch.int32, torch.float32, DEVICE)
    sums = torch.zeros(4, 3, dtype=torch.int64, device=DEVICE)
    want = [0, 0, 0]
    groups = gpu_cases.group_count(N, K, random.Random(SEED)) or 4
    for i, (B, nv, kind, scoring, restrict, lo, hi, counted) in enumerate(STATS_CALLS):
        case = Case(B=B, N=N, K=K, k0=k0, nv=nv, nv_kind=kind, scoring=scoring, bias=scoring == "sigmoid",
                    groups=groups if restrict else 1, restrict=restrict, ties="bf16", min_batch=lo, max_batch=hi)
        logits, ids, w, spec = _inputs(case, SEED + 40 + i)
        out_ids, out_w = gpu_cases.run_kernel(case, logits, ids, w, spec, workspace=ws,
                                              stats=sums[layer] if counted else None)
        _assert_matches_oracle(case, out_ids, out_w, logits, ids, w, spec)
        if counted:
            added = gpu_compare.expected_stats(case, logits, ids, w, spec)
            gate = bool(batch_gate(nv, lo, hi))
            # The counters' definition, spelled out once against the kernel's own output.
            assert added == ([1, int(distinct_experts(ids, N, nv)), int(distinct_experts(out_ids, N, nv))]
                             if gate else [0, 0, 0]), (case, added)
            want = [a + b for a, b in zip(want, added)]
        err = gpu_compare.stats_error(case, sums, layer, want)
        assert err is None, f"call {i}: {err}"
        assert int(ws.union.count_nonzero()) == 0 and int(ws.routed.count_nonzero()) == 0
        assert int(ws.counter.item()) == 0
    assert want[0] == 6 and want[1] > want[2] > 0  # the sequence opened the gate 6 times


@needs_kernel
def test_stats_argument_is_checked():
    case = Case(B=4, N=64, K=4, k0=2)
    logits, ids, w, spec = _inputs(case, SEED)
    for bad in (torch.zeros(3, dtype=torch.int32, device=DEVICE), torch.zeros(4, dtype=torch.int64, device=DEVICE),
                torch.zeros(3, 2, dtype=torch.int64, device=DEVICE)[:, 0]):
        with pytest.raises(AssertionError, match="stats"):
            gpu_cases.run_kernel(case, logits, ids, w, spec, stats=bad)


@needs_kernel
def test_k0_at_least_k_returns_the_router_tensors():
    case = Case(B=5, N=64, K=4, k0=4)
    logits, ids, w, spec = _inputs(case, SEED)
    table, row, slot, _ = gpu_compare.new_counters(DEVICE)
    out_ids, out_w = oea_route(logits, ids, w, k0=4, num_valid_rows=None, stats=row, checksum=slot)
    assert out_ids is ids and out_w is w
    assert not table.any()  # no launch, nothing counted or summed (documented)


@needs_kernel
def test_strided_logits_rows():
    """Router logits are often a slice of a wider GEMM output: only the last dim is unit-stride."""
    case = Case(B=6, N=64, K=8, k0=2, nv=4)
    logits, ids, w, spec = _inputs(case, SEED + 3)
    wide = torch.cat([logits, torch.randn(6, 7, device=DEVICE)], dim=1)[:, :64]
    assert not wide.is_contiguous()
    out_ids, out_w = gpu_cases.run_kernel(case, wide, ids, w, spec)
    _assert_matches_oracle(case, out_ids, out_w, logits, ids, w, spec)


@needs_kernel
@pytest.mark.parametrize("min_batch", [1, 8])
def test_padded_rows_may_hold_minus_one(min_batch):
    """SGLang may set topk_ids of padded rows to -1: the kernel ignores their content (gate open)
    and passes it through unchanged (gate closed). The oracle itself cannot gather at -1, so it
    is run with the original ids, which it ignores on padded rows."""
    case = Case(B=12, N=64, K=8, k0=3, nv=7, min_batch=min_batch, ties="bf16")
    logits, ids, w, spec = _inputs(case, SEED + 4)
    masked = ids.clone()
    masked[case.nv :] = -1
    ws = OEAWorkspace.allocate(64, 8, 12, ids.dtype, w.dtype, DEVICE)
    table, row, _, lost = gpu_compare.new_counters(DEVICE)
    out_ids, out_w = gpu_cases.run_kernel(case, logits, masked, w, spec, workspace=ws, stats=row, lost=lost)
    if min_batch <= case.nv:
        _assert_matches_oracle(case, out_ids, out_w, logits, ids, w, spec)
    else:
        assert torch.equal(out_ids, masked) and torch.equal(out_w, w)
    # Padded rows' -1 ids are not counted (the expected counts use the unmasked ids, valid rows only),
    # nor is their lost router mass.
    want_lost = gpu_compare.expected_lost(case, logits, ids, w, spec)
    err = (gpu_compare.stats_error(case, table[:, :3], 1, gpu_compare.expected_stats(case, logits, ids, w, spec))
           or gpu_compare.lost_error(case, table, 1, want_lost))
    assert err is None, err
    assert (want_lost[0] > 0) == (min_batch <= case.nv)
    assert int(ws.routed.count_nonzero()) == 0 and int(ws.union.count_nonzero()) == 0


def _route(case: Case, logits, ids, w, spec, **kwargs):
    return oea_route(logits, ids, w, k0=case.k0, scoring_func=spec.scoring_func, correction_bias=spec.correction_bias,
                     num_groups=spec.num_groups, restrict_groups=spec.restrict_groups, min_batch=case.min_batch,
                     max_batch=case.max_batch, **kwargs)


@needs_kernel
@pytest.mark.parametrize("min_batch", [1, 20])
def test_shared_expert_columns_pass_through(min_batch):
    """Fused shared-expert columns after the K routed ones are copied through, gate open or closed,
    and the routed columns are routed as without them."""
    case = Case(B=9, N=64, K=8, k0=3, nv=7, min_batch=min_batch, ties="bf16")
    logits, ids, w, spec = _inputs(case, SEED + 5)
    shared_ids = torch.tensor([[64, 65]], dtype=ids.dtype, device=DEVICE).expand(9, 2)
    shared_w = torch.rand(9, 2, generator=torch.Generator().manual_seed(1)).to(device=DEVICE, dtype=w.dtype)
    full_ids, full_w = torch.cat([ids, shared_ids], 1), torch.cat([w, shared_w], 1)
    table, _, slot, lost = gpu_compare.new_counters(DEVICE)
    out_ids, out_w = _route(case, logits, full_ids, full_w, spec, num_routed=8, num_valid_rows=case.nv, checksum=slot,
                            lost=lost)
    assert out_ids.shape == (9, 10) and torch.equal(out_ids[:, 8:], shared_ids) and torch.equal(out_w[:, 8:], shared_w)
    assert gpu_compare.checksum_error(case, table, 1, gpu_compare.expected_checksum(case, logits, ids, w, spec)) is None
    # The shared columns count in neither sum of the lost router mass (the expected value never sees them).
    assert gpu_compare.lost_error(case, table, 1, gpu_compare.expected_lost(case, logits, ids, w, spec)) is None
    if min_batch <= case.nv:
        _assert_matches_oracle(case, out_ids[:, :8].contiguous(), out_w[:, :8].contiguous(), logits, ids, w, spec)
    else:
        assert torch.equal(out_ids, full_ids) and torch.equal(out_w, full_w)


@needs_kernel
def test_int_and_tensor_row_counts_launch_one_variant():
    """The row count is always read on the device, so eager calls (an int) and CUDA-graph capture
    (a persistent tensor) need the same compiled kernels."""
    variants = {}
    for kind in ("int", "0d", "1d"):
        case = Case(B=6, N=64, K=8, k0=3, nv=4, nv_kind=kind)
        logits, ids, w, spec = _inputs(case, SEED)
        ws = OEAWorkspace.allocate(64, 8, 16, ids.dtype, w.dtype, DEVICE)
        launched = []
        out_ids, out_w = _route(case, logits, ids, w, spec, num_valid_rows=gpu_cases.num_valid_arg(case, DEVICE),
                                workspace=ws, before_launch=launched.append)
        _assert_matches_oracle(case, out_ids, out_w, logits, ids, w, spec)
        variants[kind] = [launch.variant() for launch in launched]
    assert len(variants["int"]) == 2 and variants["int"] == variants["0d"] == variants["1d"]


@needs_kernel
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_control_block_equals_int_settings_for_every_k0(scoring):
    """Live settings: k0 and the gate bounds read from a device control block, as a graph captured
    once reads them at every replay. For every k0 in 0..K+1, with padded rows and a shared-expert
    column, the kernel equals the torch path with the same ints (the router's own bits when k0 is
    outside [1, K) or the gate is closed), and one compiled variant serves them all."""
    from sglang_oea.routing import route_from_logits

    K, nv = 6, 7
    case = Case(B=9, N=64, K=K, k0=3, nv=nv, scoring=scoring, bias=scoring == "sigmoid", ties="bf16")
    logits, ids, w, spec = _inputs(case, SEED + 80)
    full_ids = torch.cat([ids, torch.full((9, 1), 64, dtype=ids.dtype, device=DEVICE)], dim=1)
    full_w = torch.cat([w, torch.full((9, 1), 0.5, dtype=w.dtype, device=DEVICE)], dim=1)
    ws = OEAWorkspace.allocate(64, K + 1, 16, ids.dtype, w.dtype, DEVICE)
    control, rows = torch.zeros(3, dtype=torch.int32, device=DEVICE), torch.full((1,), nv, dtype=torch.int32,
                                                                                device=DEVICE)
    variants = set()
    settings = [(k0, 1, 0) for k0 in range(K + 2)] + [(3, 8, 0), (3, 2, 6), (3, 7, 7)]
    for k0, lo, hi in settings:
        for i, value in enumerate((k0, lo, hi)):
            control[i].fill_(value)
        out_ids, out_w = oea_route(logits, full_ids, full_w, control=control, num_routed=K, scoring_func=spec.scoring_func,
                                   correction_bias=spec.correction_bias, num_valid_rows=rows, workspace=ws,
                                   before_launch=lambda launch: variants.add(launch.variant()))
        assert torch.equal(out_ids[:, K:], full_ids[:, K:]) and torch.equal(out_w[:, K:], full_w[:, K:])
        want_ids, _ = route_from_logits(logits, ids, w, spec, k0, nv, lo, hi)
        assert torch.equal(out_ids[:, :K].long(), want_ids), (k0, lo, hi)
        if 1 <= k0 < K and lo <= nv and (hi == 0 or nv <= hi):
            _assert_matches_oracle(replace(case, k0=k0, min_batch=lo, max_batch=hi), out_ids[:, :K].contiguous(),
                                   out_w[:, :K].contiguous(), logits, ids, w, spec)
            assert not torch.equal(out_ids[:, :K], ids), (k0, lo, hi)
        else:
            assert torch.equal(out_ids, full_ids) and torch.equal(out_w.view(torch.int32), full_w.view(torch.int32))
    assert len(variants) == 2, "k0 and the bounds are not compile-time constants"


@needs_kernel
def test_device_gate_equals_host_gate_at_the_largest_allowed_values():
    """At the settings' upper bounds (min_batch and max_batch 65536, 16384 draft tokens per request)
    the kernel's int32 gate, the torch path's and the host's agree: min_batch x rows per request
    cannot wrap."""
    from sglang_oea.config import MAX_BATCH, MAX_ROWS_PER_REQUEST, LiveSettings
    from sglang_oea.passes import VERIFY, skip_reason
    from sglang_oea.routing import control_gate

    case = Case(B=6, N=64, K=8, k0=1)
    logits, ids, w, spec = _inputs(case, SEED + 90)
    ws = OEAWorkspace.allocate(64, 8, 8, ids.dtype, w.dtype, DEVICE)
    per_request, floor = MAX_ROWS_PER_REQUEST, MAX_BATCH * MAX_ROWS_PER_REQUEST
    # (min_batch, max_batch, real token rows): just below and at the floor; at and above the cap.
    for lo, hi, rows in ((MAX_BATCH, 0, floor - 1), (MAX_BATCH, 0, floor), (1, MAX_BATCH, MAX_BATCH),
                         (1, MAX_BATCH, MAX_BATCH + 1)):
        per = per_request if hi == 0 else 1
        control = torch.tensor([1, lo, hi], dtype=torch.int32, device=DEVICE)
        count = torch.full((1,), rows, dtype=torch.int32, device=DEVICE)
        out_ids, _ = oea_route(logits, ids, w, control=control, num_routed=8, scoring_func=spec.scoring_func,
                               correction_bias=spec.correction_bias, num_valid_rows=count, workspace=ws,
                               rows_per_request=per)
        host_open = skip_reason(LiveSettings(1, lo, hi), True, VERIFY, rows // per, rows) is None
        device_open = not torch.equal(out_ids, ids)
        torch_open = bool(control_gate(count[0], control, 8, per))
        assert device_open == host_open == torch_open, (lo, hi, rows, device_open, host_open, torch_open)
        assert host_open == (rows >= lo * per and (hi == 0 or rows <= hi))


# (B, real rows, nv_kind, scoring, shared-expert columns, min_batch, max_batch, stats?, ids dtype): one
# persistent [L, 4] table over all calls, so every call adds to the checksum the previous ones left.
CHECKSUM_CALLS = [
    (16, 16, "1d", "softmax", 0, 1, 0, True, torch.int32),  # full batch
    (13, 5, "0d", "sigmoid", 0, 1, 0, False, torch.int32),  # padded rows, biased sigmoid
    (12, 3, "int", "softmax", 1, 4, 0, True, torch.int64),  # gate closed: the router's own ids
    (9, 9, "1d", "sigmoid", 2, 1, 0, True, torch.int32),  # two shared-expert columns (not summed)
    (7, 0, "0d", "softmax", 0, 0, 0, False, torch.int64),  # gate open, no real row: adds 0
    (6, 20, "int", "sigmoid", 1, 1, 0, False, torch.int64),  # more real rows than rows: all 6
    (14, 8, "1d", "softmax", 0, 2, 8, True, torch.int32),  # gate open at max_batch
    (10, 9, "0d", "sigmoid", 0, 2, 8, False, torch.int32),  # gate closed above max_batch
]


@needs_kernel
def test_checksum_matches_the_reference_and_accumulates():
    """checksum += reference.ids_checksum(out_ids[:, :K], rows) on every call, gate open or closed,
    with or without stats and shared-expert columns, for int32 and int64 ids; the stats beside it
    (columns 0-2 of the same table row) stay right, and no other slot is written."""
    from sglang_oea.reference import ids_checksum

    N, K, k0, layer = 96, 6, 2, 2
    table = torch.zeros(4, 4, dtype=torch.int64, device=DEVICE)
    want_sum, want_stats = 0, [0, 0, 0]
    for i, (B, nv, kind, scoring, shared, lo, hi, counted, ids_dtype) in enumerate(CHECKSUM_CALLS):
        case = Case(B=B, N=N, K=K, k0=k0, nv=nv, nv_kind=kind, scoring=scoring, bias=scoring == "sigmoid",
                    ties="bf16", min_batch=lo, max_batch=hi, ids_dtype=ids_dtype)
        logits, ids, w, spec = _inputs(case, SEED + 60 + i)
        full_ids = torch.cat([ids, torch.full((B, shared), N, dtype=ids.dtype, device=DEVICE)], dim=1)
        full_w = torch.cat([w, torch.full((B, shared), 0.5, dtype=w.dtype, device=DEVICE)], dim=1)
        out_ids, out_w = _route(case, logits, full_ids, full_w, spec, num_routed=K,
                                num_valid_rows=gpu_cases.num_valid_arg(case, DEVICE),
                                stats=table[layer, :3] if counted else None, checksum=table[layer, 3:])
        _assert_matches_oracle(case, out_ids[:, :K].contiguous(), out_w[:, :K].contiguous(), logits, ids, w, spec)
        added = int(ids_checksum(out_ids[:, :K], nv))
        assert added == gpu_compare.expected_checksum(case, logits, ids, w, spec), f"call {i}"
        assert (added == 0) == (nv == 0), f"call {i}: {added=}"
        want_sum = gpu_compare.wrapping_sum(want_sum, added)
        if counted:
            want_stats = [a + b for a, b in zip(want_stats, gpu_compare.expected_stats(case, logits, ids, w, spec))]
        err = gpu_compare.checksum_error(case, table, layer, want_sum)
        assert err is None, f"call {i}: {err}"
        assert table[layer, :3].tolist() == want_stats, f"call {i}"
        assert not torch.cat([table[:layer], table[layer + 1:]]).any(), f"call {i}: wrote outside the row"


@needs_kernel
def test_checksum_argument_is_checked():
    case = Case(B=4, N=64, K=4, k0=2)
    logits, ids, w, spec = _inputs(case, SEED)
    for bad in (torch.zeros(1, dtype=torch.int32, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE)):
        with pytest.raises(AssertionError, match="checksum"):
            gpu_cases.run_kernel(case, logits, ids, w, spec, checksum=bad)


@needs_kernel
def test_checksum_slots_of_every_layer_share_one_variant():
    """The checksum pointer is never specialised on alignment: the slots of an [L, 4] table (8 mod
    16 bytes) and a 16-byte-aligned tensor need one binary; the checksum itself, a second one."""
    case = Case(B=6, N=64, K=8, k0=3, nv=4)
    logits, ids, w, spec = _inputs(case, SEED)
    table = torch.zeros(3, 4, dtype=torch.int64, device=DEVICE)
    variants = []
    for slot in (table[0, 3:], table[1, 3:], table[2, 3:], torch.zeros(1, dtype=torch.int64, device=DEVICE), None):
        launched = []
        _route(case, logits, ids, w, spec, num_valid_rows=4, checksum=slot, before_launch=launched.append)
        variants.append(launched[1].variant())
    assert table[0, 3].data_ptr() % 16 == 8 and len(set(variants[:4])) == 1 and variants[4] != variants[0]
    assert dict(variants[0][2])["CHECKSUM"] and not dict(variants[4][2])["CHECKSUM"]


@needs_kernel
def test_softmax_ranks_by_logit_where_probabilities_tie():
    """Probabilities that underflow to 0 or round to one value, from logits that differ: both paths
    rank by the logit (reference on logits), which picks other ids than ranking by probability (the
    old selection score: ties to the lower id); a -inf logit is never piggybacked."""
    from sglang_oea.reference import opportunistic_route

    logits, ids, w, spec = gpu_score_bits.probability_tie_inputs(DEVICE)
    probs = logits.softmax(dim=1)
    case = Case(B=5, N=64, K=8, k0=3)
    by_logit = opportunistic_route(logits, probs, ids, w, 3)[0]
    by_probability = opportunistic_route(probs, probs, ids, w, 3)[0]
    assert (by_logit != by_probability).any(dim=1).all()  # every row tells the two apart
    out_ids, out_w = gpu_cases.run_kernel(case, logits, ids, w, spec)
    assert torch.equal(out_ids.long(), by_logit)
    _assert_matches_oracle(case, out_ids, out_w, logits, ids, w, spec)
    assert 16 in out_ids[0, :3].tolist() and 16 not in out_ids[4][out_w[4] > 0].tolist()


@needs_kernel
def test_score_bits_check_in_the_interpreter(monkeypatch):
    """gpu_check's score-bits check runs here: the kernel's `_scores` is numpy's float32
    1 / (1 + exp(-x)) (+ bias, one add) bit for bit, softmax's selection is the logit, and the
    near-tie batches route alike on both paths. Against torch's CPU sigmoid (another exp) the
    bitwise comparison must fail: it can tell."""
    errors, lines = gpu_score_bits.check_score_bits(DEVICE)
    assert errors == [], errors
    assert len(lines) == 3 and "near tie" in lines[1] and "ok" in lines[2], lines
    monkeypatch.setattr(gpu_score_bits, "reference_sigmoid", torch.sigmoid)
    x, bias = gpu_score_bits.score_inputs(4 * gpu_score_bits.SCORE_BLOCK, torch.Generator().manual_seed(3), DEVICE)
    errors, _ = gpu_score_bits.score_bits(x, bias)
    assert any("sigmoid w:" in e for e in errors), errors


@needs_kernel
def test_is_available(monkeypatch):
    from sglang_oea.kernels import is_available

    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert is_available() and is_available("cpu")
        monkeypatch.delenv("TRITON_INTERPRET")
        assert not is_available("cpu")
    else:
        assert is_available("cuda") and not is_available("cpu")


@needs_kernel
def test_gpu_check_dry_run():
    """The prepared GPU script's CPU mode: correctness subset, the runtime path's warm-up / capture /
    replay sequence (is_capturing forced on), the same on DP attention's gathered batch, live settings
    changed between replays of one capture, and the kernel's graph-free replay sequence."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO / "python"))
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmark/oea/gpu/gpu_check.py"), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=360,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "check 5 (runtime path" in proc.stdout and "FAIL" not in proc.stdout, proc.stdout[-3000:]
    assert "check 10 (live settings" in proc.stdout, proc.stdout[-3000:]
    assert "check 11 (DP attention" in proc.stdout, proc.stdout[-3000:]
    assert "dry run: all checks passed" in proc.stdout


@pytest.mark.skipif(IN_PROCESS, reason="the kernel tests ran in this process")
def test_whole_file_in_the_interpreter():
    """CPU machine, TRITON_INTERPRET unset: run this file again in a child process that has it."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
