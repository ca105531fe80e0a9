"""--oea-kernel, the startup self-check and the ranks' agreement on it, on the CPU.

The kernel is replaced here by stand-ins built on the torch path (one exact, some broken), so the
choice logic runs without a GPU; the "interpreter" tests run the real kernel in Triton's CPU
interpreter, in a child process (Triton reads TRITON_INTERPRET once, at import), and
test_graph_path.py runs it through the same choice (and requires its self-check to pass).
"""

import importlib
import logging
import os
import re
import subprocess
import sys
import types

import pytest
import torch

from oea_fixtures import NUM_EXPERTS, TOP_K, router_inputs, topk_config
from sglang_oea import routers
from sglang_oea.config import OEAConfig
from sglang_oea.routers import (CAPTURE, EAGER, WARMUP, GraphCaptureError, KernelSelfCheckError, RouterChoice,
                                TorchRouter)
from sglang_oea.routing import RouterSpec, route_from_logits
from sglang_oea.runtime import DECODE, OEARuntime
from sglang_oea.self_check import TRIALS, RoutingShape, ids_checksum, run_self_check, spec_key

SPEC = RouterSpec("softmax")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreter_only = pytest.mark.skipif(not INTERPRET, reason="runs in the TRITON_INTERPRET=1 child")
cpu_engine_only = pytest.mark.skipif(INTERPRET, reason="the interpreter makes the CPU a kernel device")


def torch_kernel(logits, ids, weights, spec, k0, num_routed, rows, min_batch, max_batch, workspace, stats=None,
                 before_launch=None, checksum=None, control=None, rows_per_request=1, lost=None):
    """A stand-in for the fused kernel with its exact contract, computed by the torch path."""
    new_ids, new_weights, _ = TorchRouter()(0, logits, ids, weights, spec, k0, num_routed, rows, min_batch, max_batch,
                                            control=control, rows_per_request=rows_per_request)
    from sglang_oea.reference import batch_gate, distinct_experts
    from sglang_oea.routing import control_gate

    gate = (batch_gate(rows, min_batch, max_batch) if control is None
            else control_gate(rows, control, num_routed, rows_per_request))
    if stats is not None:
        before = distinct_experts(ids[:, :num_routed], logits.shape[1], rows)
        after = distinct_experts(new_ids[:, :num_routed], logits.shape[1], rows)
        stats.add_(torch.stack([torch.ones_like(before), before, after]) * gate)
    if checksum is not None:
        checksum.add_(ids_checksum(new_ids[:, :num_routed], int(rows)))
    if lost is not None:
        from sglang_oea.reference import lost_router_mass_units

        units = lost_router_mass_units(ids[:, :num_routed], weights[:, :num_routed], new_ids[:, :num_routed],
                                       new_weights[:, :num_routed], logits.shape[1], rows)
        lost[k0 if control is None else int(control[0])] += (units * gate).sum()  # gate [1] with a tensor row count
    return new_ids, new_weights


def swapped_columns(*args, **kwargs):
    ids, weights = torch_kernel(*args, **kwargs)
    return ids[:, [1, 0] + list(range(2, ids.shape[1]))], weights


def failing_compile(*args, **kwargs):
    raise RuntimeError("PTX compilation failed: out of resource (stand-in)")


def wrong_checksum(*args, checksum=None, **kwargs):
    out = torch_kernel(*args, checksum=checksum, **kwargs)
    if checksum is not None:
        checksum.add_(1)
    return out


def lost_filed_elsewhere(*args, lost=None, **kwargs):
    """Right ids, weights and amount, but the lost mass filed under k0 + 1."""
    out = torch_kernel(*args, lost=lost, **kwargs)
    if lost is not None:
        lost.copy_(lost.roll(1))
    return out


def lost_off_by_rows(*args, lost=None, **kwargs):
    """The lost mass one unit per real row plus one too high: more than the kernel's rounding."""
    out = torch_kernel(*args, lost=lost, **kwargs)
    if lost is not None:
        lost[3] += int(args[6]) + 1  # args[6]: the real rows
    return out


class Agreement:
    """A stand-in for the hooks' MIN all-reduce: every verdict it was given; the other ranks pass
    iff `others_pass`."""

    def __init__(self, others_pass: bool = True):
        self.others_pass, self.calls = others_pass, []

    def __call__(self, passed_here: bool) -> bool:
        self.calls.append(passed_here)
        return passed_here and self.others_pass


@pytest.fixture
def kernel(monkeypatch):
    """Pretend the fused kernel can run here; `kernel.use(fn)` picks what it computes,
    `kernel.unavailable()` pretends Triton is missing on this CUDA device."""
    monkeypatch.setattr(RouterChoice, "kernel_device", lambda self, logits: True)
    monkeypatch.setattr(RouterChoice, "kernel_available", lambda self, device: True)
    monkeypatch.setattr(routers.TritonRouter, "workspace", lambda self, *a: None)
    calls = []

    def use(fn):
        monkeypatch.setattr(routers, "launch_kernel", lambda *a, **kw: calls.append(1) or fn(*a, **kw))

    def unavailable():
        monkeypatch.setattr(RouterChoice, "kernel_available", lambda self, device: False)
    use(torch_kernel)
    return types.SimpleNamespace(use=use, unavailable=unavailable, calls=calls)


def runtime(kernel="auto", agree=None):
    rt = OEARuntime(OEAConfig(k0=3, min_batch=2, kernel=kernel))
    rt.routers.agree = agree
    return rt


def routed_step(rt, rows=6, seed=0, shared=0, layers=(0,)):
    """One decode step over `layers`: (the last layer's OEA output or None, the torch path's)."""
    logits, ids, weights = router_inputs(rows, seed, shared)
    config = topk_config(shared)
    rt.begin_step(DECODE, rows)
    for layer in layers:
        out = rt.route(ids, weights, config, logits, layer)
    rt.end_step()
    want = route_from_logits(logits, ids[:, :TOP_K], weights[:, :TOP_K], SPEC, 3, rows)
    return out, want


def error_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]


# ----------------------------------------------------------------------------- one rank


def test_auto_routes_with_the_kernel_after_a_passing_self_check(kernel, caplog):
    rt = runtime()
    with caplog.at_level(logging.INFO, logger="sglang_oea"):
        (ids, weights), (want_ids, want_weights) = routed_step(rt, shared=1)
    assert rt.routers.status() == {("triton", "passed"): 1}
    assert rt.routers.describe() == "kernel auto: triton (self-check passed, 1 routing shape)"
    assert "kernel self-check passed (N=64 K=8 +1 shared softmax" in caplog.text
    assert torch.equal(ids[:, :TOP_K].long(), want_ids)
    calls = len(kernel.calls)
    routed_step(rt, seed=1, shared=1)
    assert len(kernel.calls) == calls + 1, "one self-check per routing shape, then one launch per call"


@pytest.mark.parametrize("broken,message", [
    (swapped_columns, "ids differ in"),
    (failing_compile, "RuntimeError: PTX compilation failed: out of resource"),
])
def test_auto_turns_oea_off_when_the_self_check_fails(kernel, caplog, broken, message):
    """No torch fallback on CUDA: the router's own ids stay, with one error line saying what to do."""
    kernel.use(broken)
    rt = runtime()
    out, _ = routed_step(rt)
    assert out is None, "OEA is off: the router's own ids are kept"
    assert rt.routers.status() == {("off", "failed"): 1}
    assert rt.routers.describe() == ("kernel auto: OEA off, the router's own experts "
                                     "(self-check failed, 1 routing shape)")
    (error,) = error_lines(caplog)
    assert error.startswith("sglang-oea rank 0: the kernel self-check failed (N=64 K=8 softmax") and message in error
    assert "OEA is OFF for this routing shape" in error and "--oea-kernel torch" in error and "report" in error
    calls = len(kernel.calls)
    assert routed_step(rt, seed=1)[0] is None and len(kernel.calls) == calls, "decided once, never launched after"
    assert len(error_lines(caplog)) == 1


def test_auto_turns_oea_off_when_the_kernel_is_unavailable_on_cuda(kernel, caplog):
    kernel.unavailable()
    rt = runtime()
    assert routed_step(rt)[0] is None and not kernel.calls
    assert rt.routers.status() == {("off", "unavailable"): 1}
    (error,) = error_lines(caplog)
    assert "the kernel is unavailable" in error and "is Triton installed?" in error and "OEA is OFF" in error
    with pytest.raises(KernelSelfCheckError, match="--oea-kernel triton, but the kernel is unavailable"):
        routed_step(runtime("triton"))


def test_triton_refuses_to_start_when_the_self_check_fails(kernel):
    kernel.use(swapped_columns)
    with pytest.raises(KernelSelfCheckError, match="--oea-kernel triton, but the kernel self-check failed .*ids differ"):
        routed_step(runtime("triton"))


def test_torch_never_touches_the_kernel(kernel):
    kernel.use(failing_compile)
    rt = runtime("torch")
    (ids, _), (want_ids, _) = routed_step(rt)
    assert torch.equal(ids.long(), want_ids) and not kernel.calls
    assert rt.routers.status() == {("torch", "not_run"): 1}


@cpu_engine_only
def test_without_cuda_auto_uses_torch_and_triton_refuses():
    rt = runtime()
    assert rt.routers.status() == {("auto", "pending"): 0}
    assert rt.routers.describe() == "kernel auto: chosen at the first decode step"
    (ids, _), (want_ids, _) = routed_step(rt)
    assert torch.equal(ids.long(), want_ids)
    assert rt.routers.status() == {("torch", "not_run"): 1}
    with pytest.raises(KernelSelfCheckError, match="cannot run on cpu"):
        routed_step(runtime("triton"))


# ----------------------------------------------------------------------------- tensor-parallel ranks


def test_another_ranks_failure_turns_oea_off_here(kernel, caplog):
    """This rank passed, another failed: ranks must route alike, so OEA is off here too."""
    agree = Agreement(others_pass=False)
    rt = runtime(agree=agree)
    assert routed_step(rt)[0] is None
    assert agree.calls == [True]
    assert rt.routers.status() == {("off", "failed_other_rank"): 1}
    assert "self-check failed on another rank" in rt.routers.describe()
    (error,) = error_lines(caplog)
    assert "the kernel self-check failed on another rank" in error and "it passed on this rank" in error


def test_every_rank_passing_routes_with_the_kernel(kernel, caplog):
    agree = Agreement(others_pass=True)
    rt = runtime(agree=agree)
    with caplog.at_level(logging.INFO, logger="sglang_oea"):
        (ids, _), (want_ids, _) = routed_step(rt)
    assert agree.calls == [True] and torch.equal(ids.long(), want_ids)
    assert rt.routers.status() == {("triton", "passed"): 1}
    assert ("kernel self-check passed (N=64 K=8 softmax logits float32 ids int32 weights float32) on every rank"
            in caplog.text)


def test_this_ranks_failure_is_what_it_tells_the_others(kernel, caplog):
    kernel.use(failing_compile)
    agree = Agreement(others_pass=True)
    rt = runtime(agree=agree)
    assert routed_step(rt)[0] is None
    assert agree.calls == [False] and rt.routers.status() == {("off", "failed"): 1}


def test_triton_refuses_on_every_rank_when_another_rank_fails(kernel):
    agree = Agreement(others_pass=False)
    with pytest.raises(KernelSelfCheckError, match="triton, but the kernel self-check failed on another rank"):
        routed_step(runtime("triton", agree))
    assert agree.calls == [True]


@pytest.mark.parametrize("flag,kernel_here,verdict,raises", [
    ("auto", torch_kernel, True, False),
    ("auto", failing_compile, False, False),
    ("auto", "unavailable", False, False),
    ("triton", torch_kernel, True, False),
    ("triton", failing_compile, False, True),
    ("torch", torch_kernel, False, False),
    pytest.param("auto", None, False, False, marks=cpu_engine_only, id="cpu-auto"),
    pytest.param("triton", None, False, True, marks=cpu_engine_only, id="cpu-triton"),
])
def test_agreement_runs_once_per_routing_shape_on_every_path(monkeypatch, request, flag, kernel_here, verdict, raises):
    """Collectives must pair up: every rank calls agree once per routing shape, whatever its path
    (even where the answer cannot change it), and before it raises."""
    if kernel_here is not None:
        fake = request.getfixturevalue("kernel")
        fake.unavailable() if kernel_here == "unavailable" else fake.use(kernel_here)
    agree = Agreement()
    rt = runtime(flag, agree)
    if raises:
        with pytest.raises(KernelSelfCheckError):
            routed_step(rt)
        assert agree.calls == [verdict]
        return
    routed_step(rt, layers=(0, 1, 2))
    routed_step(rt, seed=1, layers=(0, 1, 2))
    assert agree.calls == [verdict], "one routing shape: one agreement, however many layers and steps"
    routed_step(rt, shared=1, layers=(5,))  # a second routing shape (a fused shared-expert column)
    assert agree.calls == [verdict, verdict]


# ----------------------------------------------------------------------------- routers and the self-check


def test_torch_router_leaves_stats_and_checksum_to_the_runtime():
    logits, ids, weights = router_inputs(6, 0)
    stats, checksum = torch.zeros(3, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    *_, counted = TorchRouter()(0, logits, ids, weights, SPEC, 3, TOP_K, 6, 1, 0, EAGER, stats, checksum)
    assert counted is False and not stats.any() and not checksum.any()


def test_triton_router_hands_the_checksum_to_the_kernel(kernel):
    got = []
    kernel.use(lambda *a, **kw: got.append(a[12] if len(a) > 12 else kw.get("checksum")) or torch_kernel(*a, **kw))
    logits, ids, weights = router_inputs(6, 0)
    checksum = torch.zeros(1, dtype=torch.int64)
    router = routers.TritonRouter()
    new_ids, _, counted = router(0, logits, ids, weights, SPEC, 3, TOP_K, 6, 1, 0, EAGER, None, checksum)
    assert got == [checksum] and counted is True
    assert int(checksum) == int(ids_checksum(new_ids[:, :TOP_K], 6))


def test_launcher_hands_stats_and_checksum_to_the_kernel(monkeypatch):
    from sglang_oea import kernels

    seen = []
    monkeypatch.setattr(kernels, "oea_route", lambda *a, **kw: seen.append(kw) or (a[1], a[2]))
    logits, ids, weights = router_inputs(4, 0)
    stats, checksum = torch.zeros(3, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    routers.launch_kernel(logits, ids, weights, SPEC, 3, TOP_K, 4, 1, 0, None)
    routers.launch_kernel(logits, ids, weights, SPEC, 3, TOP_K, 4, 1, 0, None, stats, checksum=checksum)
    assert seen[0]["checksum"] is None and seen[0]["stats"] is None
    assert seen[1]["checksum"] is checksum and seen[1]["stats"] is stats


def shape_of(checksum=False, stats=False, ids_dtype=torch.int32, lost=False):
    return RoutingShape(NUM_EXPERTS, TOP_K, TOP_K, spec_key(SPEC), torch.float32, ids_dtype, torch.float32, stats,
                        checksum, lost)


def standin_route(kernel_fn, factor=1.0):
    def route(logits, ids, weights, rows, stats, checksum, lost):
        new_ids, new_weights = kernel_fn(logits, ids, weights, SPEC, 3, TOP_K, rows, 1, 0, None, stats,
                                         checksum=checksum, lost=lost)
        return new_ids, new_weights * factor
    return route


def test_self_check_weight_tolerance():
    """Weights may differ by float rounding (rtol 1e-5 for float32 weights), not by more."""
    assert run_self_check(standin_route(torch_kernel, 1 + 2e-7), shape_of(), SPEC, 3, "cpu") is None
    error = run_self_check(standin_route(torch_kernel, 1 + 1e-3), shape_of(), SPEC, 3, "cpu")
    assert error is not None and "weights differ by up to" in error and "rtol=1e-05" in error


def test_self_check_compares_the_checksum_when_the_shape_has_one():
    assert run_self_check(standin_route(torch_kernel), shape_of(checksum=True, stats=True), SPEC, 3, "cpu") is None
    assert run_self_check(standin_route(wrong_checksum), shape_of(checksum=False), SPEC, 3, "cpu") is None
    error = run_self_check(standin_route(wrong_checksum), shape_of(checksum=True), SPEC, 3, "cpu")
    assert error is not None and error.startswith("B=1 (1 real): ids checksum")


@pytest.mark.parametrize("broken,message", [
    (lost_filed_elsewhere, r"B=1 \(1 real\): lost router mass filed under k0=\[4\], expected k0=3 only"),
    (lost_off_by_rows, r"B=1 \(1 real\): lost router mass (\d+) units, expected (\d+) \(\+-1\)"),
], ids=["filed-under-another-k0", "off-by-more-than-rounding"])
def test_self_check_compares_the_lost_mass_when_the_shape_has_it(broken, message):
    """Serving passes lost= with the counts on: the lost mass must sit under k0 alone, within one
    unit per real row of the reference (the kernel rounds each row, the reference the sum)."""
    assert run_self_check(standin_route(torch_kernel), shape_of(stats=True, lost=True), SPEC, 3, "cpu") is None
    assert run_self_check(standin_route(broken), shape_of(stats=True, lost=False), SPEC, 3, "cpu") is None
    error = run_self_check(standin_route(broken), shape_of(stats=True, lost=True), SPEC, 3, "cpu")
    match = re.fullmatch(message, error or "")
    assert match is not None, error
    assert not match.groups() or int(match[1]) == int(match[2]) + 2


def test_a_failing_trial_setup_is_a_failed_self_check_not_a_raise(monkeypatch):
    """An OOM while making the trial inputs must not skip the agreement that follows."""
    from sglang_oea import self_check

    def out_of_memory(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")
    monkeypatch.setattr(self_check, "trial_inputs", out_of_memory)
    error = run_self_check(standin_route(torch_kernel), shape_of(), SPEC, 3, "cpu")
    assert error == "B=1 (1 real): OutOfMemoryError: CUDA out of memory (stand-in)"


@pytest.mark.parametrize("startup_k0,trial", [(0, 4), (3, 3), (1, 1), (TOP_K, 4), (TOP_K + 3, 4)])
def test_self_check_exercises_the_kernel_whatever_the_startup_k0(kernel, startup_k0, trial):
    """Live settings may set any k0 later, so the self-check routes with the startup k0 where it is in
    [1, top-k) and with top-k // 2 otherwise (0: armed but off; >= top-k: a no-op). The kernel reads
    it from a control block, as in serving; the torch path it is compared with runs with the same
    values (a stand-in that routes with what its control block says passes only then)."""
    seen = []

    def recording(*args, control=None, **kwargs):
        seen.append(control.tolist())
        return torch_kernel(*args, control=control, **kwargs)
    kernel.use(recording)
    choice = RouterChoice("auto", startup_k0)
    logits, ids, weights = router_inputs(6, 0)
    assert choice.router_for(0, logits, ids, weights, SPEC, TOP_K, False, False) is choice.triton
    assert seen == [[trial, 1, 0]] * len(TRIALS)


def test_one_layer_routes_two_id_dtypes_with_one_decision_each(kernel):
    """A torch.compile bucket's native top-k gives int64 ids where the layer's other calls give int32."""
    agree = Agreement()
    choice = RouterChoice("auto", 3, agree=agree)
    logits, ids, weights = router_inputs(6, 0)
    for dtype in (torch.int64, torch.int32, torch.int64):
        assert choice.router_for(0, logits, ids.to(dtype), weights, SPEC, TOP_K, False, False) is choice.triton
    assert agree.calls == [True, True] and choice.status() == {("triton", "passed"): 2}
    assert set(choice.by_slot) == {(0, torch.float32, dtype, torch.float32) for dtype in (torch.int64, torch.int32)}
    with pytest.raises(GraphCaptureError, match="self-check would run inside CUDA-graph capture"):
        choice.router_for(0, logits, ids, weights.bfloat16(), SPEC, TOP_K, False, True)


# ----------------------------------------------------------------------------- the real kernel, interpreted


def run_interpreted(selection: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", selection]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


def triton_call(router, slot, rows, ids_dtype, phase, seed=0, **kw):
    logits, ids, weights = router_inputs(rows, seed)
    ids = ids.to(ids_dtype)
    real = torch.full((1,), rows, dtype=torch.int32)
    new_ids, new_weights, counted = router(slot, logits, ids, weights, SPEC, 3, TOP_K, real, 1, 0, phase, **kw)
    want_ids, want_weights = route_from_logits(logits, ids, weights, SPEC, 3, rows)
    return new_ids, new_weights, want_ids, want_weights, counted


@interpreter_only
def test_interpreted_one_slot_routes_int64_then_int32_ids(monkeypatch):
    kernel_module = importlib.import_module("sglang_oea.kernels.oea_route")
    monkeypatch.setattr(routers.TritonRouter, "MIN_WORKSPACE_ROWS", 8)  # small, for the interpreter
    allocated = []
    original = kernel_module.OEAWorkspace.allocate.__func__
    monkeypatch.setattr(kernel_module.OEAWorkspace, "allocate", classmethod(
        lambda cls, *a, **kw: allocated.append(a[3]) or original(cls, *a, **kw)))
    router = routers.TritonRouter()
    ids64, w64, want64, want_w64, _ = triton_call(router, 0, 5, torch.int64, WARMUP)
    ids32, w32, want32, want_w32, _ = triton_call(router, 0, 5, torch.int32, WARMUP, seed=1)
    assert ids64.dtype == torch.int64 and ids32.dtype == torch.int32 and allocated == [torch.int64, torch.int32]
    assert torch.equal(ids32.long(), want32) and torch.equal(ids64, want64), "each dtype has its own workspace"
    torch.testing.assert_close(w64, want_w64)
    torch.testing.assert_close(w32, want_w32)
    assert set(router.workspaces) == {(0, torch.int64, torch.float32), (0, torch.int32, torch.float32)}
    for dtype in (torch.int64, torch.int32):  # both were warmed up: both may be captured
        got, _, want, _, _ = triton_call(router, 0, 5, dtype, CAPTURE, seed=2)
        assert torch.equal(got.long(), want)
    triton_call(router, 1, 5, torch.int32, WARMUP)
    with pytest.raises(GraphCaptureError, match="would allocate its routing workspace .*ids torch.int64"):
        triton_call(router, 1, 5, torch.int64, CAPTURE)
    assert len(allocated) == 3 and (1, torch.int64, torch.float32) not in router.workspaces


@interpreter_only
def test_interpreted_runtime_layer_with_int64_and_int32_ids():
    """The runtime routes one layer's int64 ids (the compiled bs=1 bucket) and its int32 ids."""
    rt = runtime(agree=Agreement())
    logits, ids, weights = router_inputs(6, 0)
    config = topk_config()  # one TopKConfig: one layer slot
    rt.begin_step(DECODE, 6)
    got64, _ = rt.route(ids.long(), weights, config, logits, 0)
    got32, _ = rt.route(ids, weights, config, logits, 0)
    rt.end_step()
    want, _ = route_from_logits(logits, ids, weights, SPEC, 3, 6)
    assert got64.dtype == torch.int64 and got32.dtype == torch.int32
    assert torch.equal(got64, want) and torch.equal(got32.long(), want)
    assert rt.routers.status() == {("triton", "passed"): 2} and rt.routers.agree.calls == [True, True]


@interpreter_only
def test_interpreted_kernel_folds_the_checksum():
    checksum = torch.zeros(1, dtype=torch.int64)
    got, _, want, _, counted = triton_call(routers.TritonRouter(), 0, 5, torch.int32, EAGER, checksum=checksum)
    assert counted is True and torch.equal(got.long(), want)
    assert int(checksum) == int(ids_checksum(want, 5))
    choice = RouterChoice("auto", 3)
    shape = shape_of(checksum=True, stats=True, lost=True)  # the variant that serves with the counts on
    assert run_self_check(choice.kernel_trial(SPEC, TOP_K), shape, SPEC, 3, "cpu") is None


def test_the_real_kernel_in_the_interpreter():
    """The interpreted tests above: one layer slot with two id dtypes, and the fused checksum."""
    if INTERPRET:
        pytest.skip("already running in the interpreter")
    run_interpreted("interpreted_")
