"""Router inputs the way SGLang hands them to the routing hook, shared by the runtime tests."""

import os
import subprocess
import sys
import types

import torch

from sglang_oea.reference import opportunistic_route
from sglang_oea.routing import RouterSpec, score_experts

NUM_EXPERTS, TOP_K = 64, 8


def topk_config(shared: int = 0, top_k: int = TOP_K) -> types.SimpleNamespace:
    """The TopKConfig attributes OEARuntime reads: a softmax router (Qwen3-MoE) with `shared` fused
    shared-expert columns."""
    return types.SimpleNamespace(
        top_k=top_k + shared, num_shared_topk_slots=shared, allow_routed_experts_capture=True,
        scoring_func="softmax", correction_bias=None, num_expert_group=None, topk_group=None, use_grouped_topk=False,
        custom_routing_function=None, renormalize=True,
    )


def router_inputs(rows: int, seed: int, shared: int = 0, shared_weight: float = 0.25):
    """logits [rows, N] float32, the router's top-K ids [rows, K + shared] int32 (columns unsorted,
    shared-expert ids N.. last) and weights [rows, K + shared] float32."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, NUM_EXPERTS, generator=gen)
    weights, ids = torch.topk(logits.softmax(1), TOP_K, sorted=False)
    ids = ids.int()
    if shared:
        ids = torch.cat([ids, torch.full((rows, shared), NUM_EXPERTS, dtype=ids.dtype)], 1)
        weights = torch.cat([weights, torch.full((rows, shared), shared_weight)], 1)
    return logits, ids, weights


def assert_reference_routing(routed, logits, ids, weights, k0: int, real_rows: int) -> None:
    """routed (ids, weights) of a softmax router's layer equals sglang_oea.reference over the first
    real_rows rows; the padded rows after them stay inside the real rows' union, at weight 0."""
    got_ids, got_weights = routed
    selection, weight = score_experts(logits, RouterSpec("softmax"))
    want_ids, want_weights = opportunistic_route(selection, weight, ids, weights, k0, real_rows)
    assert torch.equal(got_ids.long(), want_ids) and got_ids.dtype == ids.dtype
    torch.testing.assert_close(got_weights, want_weights)
    union = set(got_ids[:real_rows][got_weights[:real_rows] > 0].tolist())
    assert set(got_ids[real_rows:].flatten().tolist()) <= union, "padded rows stay inside the union"
    assert bool((got_weights[real_rows:] == 0).all())


def run_in_interpreter(test_file: str, deselect: str, timeout: int = 900) -> None:
    """Run `test_file` again in a child process with TRITON_INTERPRET=1 (Triton reads it once, at
    import), without the tests matching `deselect`; assert that every test ran and passed."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", f"not {deselect}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


def marked_processes(mark: str) -> list:
    """Pids of the processes, other than this one, whose environment holds `mark` (every child a
    tool under test started, when the mark was put in its environment)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark.encode() in f.read() and int(pid) != os.getpid():
                    found.append(int(pid))
        except OSError:
            continue
    return found
