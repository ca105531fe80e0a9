"""How steady is this machine's CPU? Times one fixed pure-Python loop, back to back.

    python benchmark/oea/studies/host_steadiness.py [--seconds 12] [--block 1.0] [--out FILE.json]

A CPU A/B ratio can only be as steady as the host that runs it. The loop does the same work every
time (no allocation, no I/O, one thread), so on a steady machine its time barely moves; on a shared
virtual machine it shows the host's own speed changes (another tenant, frequency scaling), which
no pairing or interleaving of benchmark runs can remove at a timescale shorter than one run.

Prints the loop's time (ms) per block of about --block seconds: median, min and max; and overall.
Run it with nothing else running (an SGLang server, even idle, spins a core).
"""

import argparse
import json
import statistics
import time
from typing import Dict, List

LOOP_ITERATIONS = 1_000_000


def fixed_work() -> int:
    """The same pure-Python work every call (a sum over a range)."""
    total = 0
    for i in range(LOOP_ITERATIONS):
        total += i
    return total


def sample(seconds: float) -> List[float]:
    """Back-to-back timings (seconds) of fixed_work for about `seconds`."""
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        fixed_work()
        times.append(time.perf_counter() - start)
    return times


def summarize(times: List[float], block_seconds: float) -> Dict:
    """{"overall": {median, min, max, n}, "blocks": [...]} in milliseconds; a block is the run of
    consecutive timings that adds up to about block_seconds."""
    def stats(values: List[float]) -> Dict:
        ms = [1000.0 * v for v in values]
        return {"median": statistics.median(ms), "min": min(ms), "max": max(ms), "n": len(ms)}

    blocks, current = [], []
    for t in times:
        current.append(t)
        if sum(current) >= block_seconds:
            blocks.append(stats(current))
            current = []
    if current:
        blocks.append(stats(current))
    return {"overall": stats(times), "blocks": blocks, "loop_iterations": LOOP_ITERATIONS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--block", type=float, default=1.0, help="seconds per reported block")
    p.add_argument("--out", help="also write the summary as JSON here")
    args = p.parse_args()
    summary = summarize(sample(args.seconds), args.block)
    for i, b in enumerate(summary["blocks"]):
        print(f"block {i:3d}: median {b['median']:6.1f} ms  min {b['min']:6.1f}  max {b['max']:6.1f}  (n={b['n']})")
    o = summary["overall"]
    print(f"overall  : median {o['median']:6.1f} ms  min {o['min']:6.1f}  max {o['max']:6.1f}  "
          f"max/min {o['max'] / o['min']:.2f}  (n={o['n']})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
