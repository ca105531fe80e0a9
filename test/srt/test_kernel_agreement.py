"""Tensor-parallel ranks agree on the kernel choice: two real gloo processes, min_agreement.

Each rank routes through its own OEARuntime with a stand-in kernel (test_kernel_choice.py); one
rank's kernel fails its self-check. Every rank must make the same choice, and the collectives
must pair up on every path (a missed one would hang until the group's timeout).
"""

import json
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

from sglang_oea import routers
from sglang_oea.config import OEAConfig
from sglang_oea.routers import KernelSelfCheckError, RouterChoice, min_agreement
from sglang_oea.runtime import OEARuntime
from test_kernel_choice import failing_compile, routed_step, torch_kernel


def rank_process(rank, init_file, flag, failing_rank, out_dir):
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                                         timeout=timedelta(seconds=60))
    # This process pretends to be on CUDA, with a kernel that passes or fails its self-check.
    RouterChoice.kernel_device = lambda self, logits: True
    RouterChoice.kernel_available = lambda self, device: True
    routers.TritonRouter.workspace = lambda self, *a: None
    routers.launch_kernel = failing_compile if rank == failing_rank else torch_kernel
    rt = OEARuntime(OEAConfig(k0=3, min_batch=2, kernel=flag), rank=rank, world_size=2)
    agree, calls = min_agreement(), []
    rt.routers.agree = lambda passed: calls.append(passed) or agree(passed)
    try:
        out, _ = routed_step(rt, layers=(0, 1))
        routed_step(rt, seed=1, shared=1, layers=(2,))  # a second routing shape
        outcome = {"status": [list(key) for key in rt.routers.status()], "routed": out is not None}
    except KernelSelfCheckError as exc:
        outcome = {"raised": str(exc)}
    outcome["agree_calls"] = calls
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(outcome, f)
    torch.distributed.destroy_process_group()


def run_two_ranks(tmp_path, flag, failing_rank):
    mp.spawn(rank_process, args=(str(tmp_path / "init"), flag, failing_rank, str(tmp_path)), nprocs=2, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("flag,failing_rank,want", [
    ("auto", None, [[["triton", "passed"]], [["triton", "passed"]]]),
    ("auto", 1, [[["off", "failed_other_rank"]], [["off", "failed"]]]),
    ("torch", 1, [[["torch", "not_run"]], [["torch", "not_run"]]]),
])
def test_every_rank_makes_the_same_choice(tmp_path, flag, failing_rank, want):
    ranks = run_two_ranks(tmp_path, flag, failing_rank)
    assert [r["status"] for r in ranks] == want
    assert [r["routed"] for r in ranks] == [want[0][0][0] != "off"] * 2
    for rank, r in enumerate(ranks):  # one agreement per routing shape, on every path
        passed = flag != "torch" and rank != failing_rank
        assert r["agree_calls"] == [passed, passed]


def test_triton_stops_every_rank_when_one_fails(tmp_path):
    ranks = run_two_ranks(tmp_path, "triton", 0)
    assert "the kernel self-check failed (" in ranks[0]["raised"] and "PTX compilation failed" in ranks[0]["raised"]
    assert "the kernel self-check failed on another rank" in ranks[1]["raised"]
    assert [r["agree_calls"] for r in ranks] == [[False], [True]]
