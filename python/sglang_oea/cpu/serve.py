"""Run the real `sglang serve` on a machine with no GPU.

    python -m sglang_oea.cpu_serve --model-path DIR --load-format dummy [--oea-k0 4 ...]

SGLang 0.5.23 serves a small MoE model on the CPU engine once the CUDA kernel wheel's imports
are satisfied. This sets that up and then hands over to `sglang serve` in a fresh process:
- SGLANG_USE_CPU_ENGINE=1 and --device cpu;
- OMP_NUM_THREADS = cores - 1 unless set (one core stays free for the other server processes);
- --attention-backend torch_native, --disable-cuda-graph;
- --max-total-tokens 32768 and --mem-fraction-static 0.9: the KV pool is sized in tokens, whatever
  RAM is free. SGLang on the CPU reads free RAM (psutil MemAvailable, capped by the cgroup's
  memory.max - memory.current) before the weights load (`pre`) and again when it sizes the KV pool
  (`now`), and refuses to start when now - pre * (1 - fraction) <= 0. With NGRAM the scheduler
  builds its n-gram corpus (about 1.8 GiB) between the two readings, so a fraction of 0.1 fails
  whenever less than about 18 GiB is free at start; 0.9 fails only if free RAM drops by 90% of
  what was free. The pool is min(that budget, --max-total-tokens) tokens, so the token cap, not
  the fraction, decides what is allocated (without it, 0.9 would size the pool at about 90% of
  free RAM);
- the stand-in `sgl_kernel` (sglang_oea/cpu/stub) first on PYTHONPATH, so every process,
  spawned schedulers included, imports it instead of the CUDA wheel. Any stand-in op without a
  CPU body that is called logs an error and raises;
- with more than one rank (--tp N x --dp-size M; with --nnodes K, each node starts N x M / K
  of them): SGLANG_CPU_OMP_THREADS_BIND (unless set) gives each rank of this node its own share
  of the cores, since SGLang otherwise wants one NUMA node per rank; it picks a rank's share by
  the rank's device index on its node (TP ranks first, then one block of them per data-parallel
  replica). SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=0 (unless set) turns SGLang's "memory
  capacity is unbalanced" start-up error into its warning: the ranks share one RAM (the tests
  run both "nodes" of --nnodes 2 on one machine too), so two readings of it a moment apart
  differ only when another process frees memory in between. With --tp > 1 (on one node or
  across nodes), the `oea_cpu_harness` plugin (cpu/harness.py) keeps NCCL out of the CPU
  process groups;
- with --speculative-algorithm NGRAM: the stand-in's plain-torch speculative ops
  (cpu/stub/sgl_kernel/cpu_bodies.py) and the harness plugin's verify attention run it; with
  --speculative-algorithm EAGLE (an MTP draft from the same checkpoint), also the EAGLE ops
  (cpu/stub/sgl_kernel/eagle_bodies.py) and the harness's draft backends (cpu/eagle.py).
A default is added only when the caller did not give that flag.
"""

import os
import sys
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from sglang_oea.cpu_entry import STUB_DIR

CPU_DEFAULTS = (
    ("--device", "cpu"),
    ("--attention-backend", "torch_native"),
    ("--disable-cuda-graph", None),
    # The KV pool in tokens (64 requests x 512 tokens); the fraction only has to pass SGLang's
    # start-up check, whatever RAM is free (see the module docstring).
    ("--max-total-tokens", "32768"),
    ("--mem-fraction-static", "0.9"),
)


def cpu_environment(base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """A copy of `base` (default os.environ) that makes SGLang run on the CPU."""
    env = dict(os.environ if base is None else base)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    # Leave a core to the tokenizer, detokenizer and HTTP processes: with one OpenMP thread per
    # core, libgomp's spin-waits collide with them and decode slows 5-10x at random (2-core host).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) - 1)))
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != STUB_DIR]
    env["PYTHONPATH"] = os.pathsep.join([STUB_DIR, *paths])
    return env


def flag_value(argv: Sequence[str], flag: str, default: str) -> str:
    """The value given for `flag` (as `--flag V` or `--flag=V`), or default."""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return default


def thread_binding(ranks: int, cores: int) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for `ranks` ranks on cores 0..cores-1: contiguous shares,
    e.g. (2, 2) -> "0|1", (2, 8) -> "0-3|4-7"; with more ranks than cores, ranks share cores."""
    if ranks > cores:
        return "|".join(str(rank % cores) for rank in range(ranks))
    share = cores // ranks
    spans = [(rank * share, rank * share + share - 1) for rank in range(ranks)]
    return "|".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in spans)


def with_cpu_defaults(argv: Sequence[str]) -> List[str]:
    """`argv` plus each CPU default whose flag the caller did not give."""
    given = {arg.split("=", 1)[0] for arg in argv if arg.startswith("--")}
    out = list(argv)
    for flag, value in CPU_DEFAULTS:
        if flag not in given:
            out += [flag] if value is None else [flag, value]
    return out


def serve_command(argv: Sequence[str]) -> List[str]:
    """The command line that runs `sglang serve` with `argv` and the CPU defaults."""
    launcher = "from sglang.cli.main import main; main()"
    return [sys.executable, "-c", launcher, "serve", *with_cpu_defaults(argv)]


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    command = serve_command(argv)
    env = cpu_environment()
    ranks, local = scheduler_ranks(argv)
    if ranks > 1:
        env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", thread_binding(local, os.cpu_count() or 1))
        env.setdefault("SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK", "0")
    os.execve(sys.executable, command, env)


def scheduler_ranks(argv: Sequence[str]) -> Tuple[int, int]:
    """(all scheduler ranks, those this launcher starts on its node): --tp x --dp-size, split
    evenly over --nnodes. SGLang wants a thread binding once there is more than one rank in all,
    even with one rank per node (it compares the world size with this machine's NUMA nodes)."""
    def size(*names: str) -> int:
        values = [flag_value(argv, name, "") for name in names]
        return int(next((value for value in values if value), "1"))

    ranks = size("--tp", "--tp-size", "--tensor-parallel-size") * size("--dp-size", "--data-parallel-size")
    return ranks, max(1, ranks // max(1, size("--nnodes")))


if __name__ == "__main__":
    main()
