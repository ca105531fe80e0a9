"""What one --oea-check-ranks comparison costs: two gloo processes on this machine, each holding
the per-layer checksums, run RankCheck.check (device-to-host copy, all_gather, compare) back to
back. The per-step cost of checking every N steps is this divided by N; the checksum each layer
adds to routing is timed by cpu_routing_cost.py (variant oea+stats+check).

    python benchmark/oea/cost/rank_check_cost.py [--iters 500 --repeats 5]

CPU and gloo timings only: on GPUs the copy waits for the device queue and the group is gloo too
(SGLang's CPU group), so the GPU figure is that wait plus a similar collective.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
if str(REPO / "python") not in sys.path:
    sys.path.insert(0, str(REPO / "python"))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from sglang_oea.rank_check import RankCheck  # noqa: E402
from sglang_oea.runtime import MAX_LAYERS  # noqa: E402


def rank_main(rank: int, init: str, iters: int, repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    checksums = torch.arange(MAX_LAYERS, dtype=torch.int64)
    check = RankCheck(1, None, 2)
    for _ in range(20):
        check.check(checksums, 1)
    per_check = []
    for _ in range(repeats):
        torch.distributed.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            check.check(checksums, 1)
        per_check.append((time.perf_counter() - start) / iters * 1e6)
    if rank == 0:
        torch.save(per_check, out)
    torch.distributed.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.pt")
        mp.spawn(rank_main, args=(os.path.join(tmp, "init"), args.iters, args.repeats, out), nprocs=2, join=True)
        times = torch.load(out)
    median = statistics.median(times)
    print(f"one rank check, 2 gloo ranks, {MAX_LAYERS} layer checksums, {args.repeats} repeats of {args.iters}: "
          f"median {median:.1f} us (min {min(times):.1f}, max {max(times):.1f})")
    for every in (1, 10, 100, 1000):
        print(f"  --oea-check-ranks {every}: {median / every:.2f} us per decode step")


if __name__ == "__main__":
    main()
