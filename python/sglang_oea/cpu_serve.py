"""Run the real `sglang serve` on a machine with no GPU.

    python -m sglang_oea.cpu_serve --model-path DIR --load-format dummy [--oea-k0 4 ...]

SGLang 0.5.23 serves a small MoE model on the CPU engine once the CUDA kernel wheel's imports
are satisfied. This sets that up and then hands over to `sglang serve` in a fresh process:
- SGLANG_USE_CPU_ENGINE=1 and --device cpu;
- OMP_NUM_THREADS = cores - 1 unless set (one core stays free for the other server processes);
- --attention-backend torch_native, --disable-cuda-graph, --mem-fraction-static 0.1;
- the stand-in `sgl_kernel` (sglang_oea/cpu_stub) first on PYTHONPATH, so every process,
  spawned schedulers included, imports it instead of the CUDA wheel. Any stand-in op without a
  CPU body that is called logs an error and raises;
- with --tp N > 1: SGLANG_CPU_OMP_THREADS_BIND (unless set) gives each rank its own share of
  the cores, since SGLang otherwise wants one NUMA node per rank; the `oea_cpu_harness` plugin
  (cpu_harness.py) keeps NCCL out of the CPU process groups;
- with --speculative-algorithm NGRAM: the stand-in's plain-torch speculative ops
  (cpu_stub/sgl_kernel/cpu_bodies.py) and the harness plugin's verify attention run it.
A default is added only when the caller did not give that flag.
"""

import os
import sys
from typing import Dict, List, Mapping, Optional, Sequence

STUB_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_stub")
CPU_DEFAULTS = (
    ("--device", "cpu"),
    ("--attention-backend", "torch_native"),
    ("--disable-cuda-graph", None),
    ("--mem-fraction-static", "0.1"),
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
    ranks = int(flag_value(argv, "--tp", flag_value(argv, "--tp-size", "1")))
    if ranks > 1:
        env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", thread_binding(ranks, os.cpu_count() or 1))
    os.execve(sys.executable, command, env)


if __name__ == "__main__":
    main()
