"""OEA's premise on one GPU in about two minutes: does the MoE kernel SGLang runs get faster when a
decode batch touches fewer distinct experts T?

Runs in the operator's own SGLang 0.5.23 environment on one GPU and times the MoE function that
SGLang itself calls for the backend (gpu/premise_calls.py): flashinfer's cutlass_fused_moe with
NVFP4 weights (--backend flashinfer_cutlass, sm_100 and sm_120), or SGLang's Triton fused_experts
with bf16 or block-fp8 weights (--backend triton, sm_90). Random weights, the model's per-rank shapes.

Shape legend: R = rows (a decode batch's token rows), E = experts, K = top-k, T = distinct experts.

For each batch of R rows (--rows; 16, 32 and 64 when absent):
  - synthetic top-k ids [R, K] that touch exactly T experts, each row K distinct ones, for T on a
    grid from K to min(R K, E) (--points values);
  - the ids real routing gives on uniform random scores: plain top-k, and OEA at k0 3-6 over the
    same scores (sglang_oea.reference, the project's definition of OEA), --draws batches each;
  - each batch timed under CUDA-graph replay: 10 calls per graph, the median of --replays replays
    with its p20-p80.
The report (gpu/premise_report.py): a table (markdown and JSON) and a plot of time against T, a
least-squares line per batch size with R^2, the time per extra expert and the fixed part, the
predicted and measured MoE-layer ratio of OEA at each k0, a verdict per row count swept (pass, fail or
not judged, with its thresholds) and, printed last, one go/no-go line.

--rows are the row counts the server's decode batches route, and the ones judged: C requests route
C rows in plain decode, C x D under speculative decoding with D draft tokens
(--speculative-num-draft-tokens; EAGLE with 4 draft tokens at C = 16-64 routes 64-256 rows).

Exit code: 0 GO (at least one judged row count passes; the line names them, and the largest one is a
value for --oea-max-batch); 3 NO-GO (none passes); 4 a dry run that judged at least one row count
(never a GPU verdict); 2 bad arguments, an error, or no row count could be judged.

    python benchmark/oea/gpu/moe_premise.py --model-config glm5-nvfp4 --tp 8 --rows 64 128 192 256  # EAGLE, D = 4
    python benchmark/oea/gpu/moe_premise.py --model-config glm5-fp8 --tp 8          # H100, H200: 16, 32, 64 rows
    python benchmark/oea/gpu/moe_premise.py --model-config /models/GLM-5/config.json --tp 8 --rows 8 24
    python benchmark/oea/gpu/moe_premise.py --dry-run      # the CPU: a plain-torch stand-in, small shapes

Reports go to --out (default: $OUT when set, else benchmark/oea/results/moe_premise-<date>/).
The dry run tests the whole pipeline (shapes, id synthesis, timing loop without graphs, fit,
verdict, report files) and labels everything it writes as not a GPU result.
"""

import argparse
import datetime
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

BENCH = Path(__file__).resolve().parents[1]  # benchmark/oea
REPO = BENCH.parents[1]
for _path in (REPO / "python", BENCH):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))  # sglang_oea from this checkout; the benchmark folders as packages

import torch  # noqa: E402

from gpu import premise_calls as calls  # noqa: E402
from gpu.premise_report import EXIT_ERROR, OEA, SYNTHETIC, TOPK, Point, write_report  # noqa: E402
from sglang_oea.reference import distinct_experts, opportunistic_route  # noqa: E402

DEFAULT_ROWS = (16, 32, 64)
DRY_RUN_ROWS = (4, 8)
MIN_ROWS, MAX_ROWS = 2, 65536  # the upper bound is --oea-max-batch's
DEFAULT_K0 = (3, 4, 5, 6)
INNER = 10  # calls per captured graph: amortises the graph launch
DRY_INNER = 2
DEFAULT_BUDGET_S = 150.0
SEED = 20251104


def distinct_ids(rows: int, top_k: int, experts: int, distinct: int, gen: torch.Generator) -> torch.Tensor:
    """[rows, top_k] int32 ids with K distinct experts per row that touch exactly `distinct` (T)
    experts in all, top_k <= T <= min(rows * top_k, experts).

    T random experts; the first ceil(T / K) rows walk them in a cycle, K consecutive a row (distinct,
    as T >= K, and together covering all T), the other rows draw K of the T at random (an uneven
    load, as real routing has); then the rows are shuffled."""
    if not top_k <= distinct <= min(rows * top_k, experts):
        raise ValueError(f"T = {distinct} outside [{top_k}, min({rows} x {top_k}, {experts})]")
    chosen = torch.randperm(experts, generator=gen)[:distinct]
    cover = math.ceil(distinct / top_k)
    cycle = (torch.arange(cover * top_k) % distinct).view(cover, top_k)
    drawn = [torch.randperm(distinct, generator=gen)[:top_k] for _ in range(rows - cover)]
    positions = torch.cat([cycle] + [d[None] for d in drawn])[torch.randperm(rows, generator=gen)]
    return chosen[positions].to(torch.int32)


def row_weights(rows: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """[rows, top_k] float32 positive weights summing to 1 per row."""
    w = torch.rand(rows, top_k, generator=gen) + 0.05
    return w / w.sum(dim=1, keepdim=True)


def t_grid(rows: int, top_k: int, experts: int, points: int) -> List[int]:
    """Up to `points` distinct T values, evenly spread from top_k to min(rows * top_k, experts)."""
    hi = min(rows * top_k, experts)
    return sorted({round(top_k + (hi - top_k) * i / max(1, points - 1)) for i in range(points)})


def routed_batches(rows: int, shape: calls.PremiseShape, k0s: Sequence[int], draws: int,
                   gen: torch.Generator) -> Iterator[Tuple[str, Optional[int], int, torch.Tensor, torch.Tensor]]:
    """(kind, k0, draw, ids [rows, K], weights [rows, K]) of plain top-k and of OEA at each k0 on
    the same uniform random scores [rows, E]."""
    for draw in range(draws):
        scores = torch.rand(rows, shape.experts, generator=gen)
        top_w, top_ids = scores.topk(shape.top_k, dim=1)
        top_w = top_w / top_w.sum(dim=1, keepdim=True)
        yield TOPK, None, draw, top_ids.to(torch.int32), top_w
        for k0 in k0s:
            ids, w = opportunistic_route(scores, scores, top_ids, top_w, k0)
            yield OEA, k0, draw, ids.to(torch.int32), w.float()


def cpu_time_us(fn: Callable[[], object], replays: int, inner: int = DRY_INNER) -> Tuple[float, float, float, str]:
    """(median, p20, p80) microseconds per call on the CPU, `inner` calls per sample, and "cpu"."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(replays):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t) * 1e6 / inner)
    q = torch.tensor(samples, dtype=torch.float64).quantile(torch.tensor([0.5, 0.2, 0.8], dtype=torch.float64))
    return float(q[0]), float(q[1]), float(q[2]), "cpu"


def timer(device: str, replays: int) -> Callable[[Callable[[], object]], Tuple[float, float, float, str]]:
    if device == "cpu":
        return lambda fn: cpu_time_us(fn, replays)
    from gpu.gpu_timing import graph_time_us

    return lambda fn: graph_time_us(fn, inner=INNER, replays=replays)


def sweep_rows(bench, shape: calls.PremiseShape, rows: int, args, time_fn, gen: torch.Generator,
               deadline: float) -> Tuple[List[Point], str, List[str]]:
    """All points of one batch size (the synthetic grid, then the routed batches), how the backend
    was tuned for it, and notes."""
    tuning, notes = bench.prepare(rows), []
    offset = 0.0
    if hasattr(bench, "restore"):  # Triton's inplace call restores its input first: take that copy off
        offset = time_fn(bench.restore())[0]
        notes.append(f"{rows} rows: the input restore ({offset:.2f} us) is subtracted from every point")
    batches = [(SYNTHETIC, None, 0, distinct_ids(rows, shape.top_k, shape.experts, T, gen),
                row_weights(rows, shape.top_k, gen)) for T in t_grid(rows, shape.top_k, shape.experts, args.points)]
    batches += list(routed_batches(rows, shape, args.k0, args.draws, gen))
    points = []
    for kind, k0, draw, ids, weights in batches:
        if time.time() > deadline:
            notes.append(f"{rows} rows: out of --budget-s after {len(points)} of {len(batches)} batches")
            break
        median, p20, p80, mode = time_fn(bench.bind(ids, weights))
        T = int(distinct_experts(ids, shape.experts))
        points.append(Point(rows, kind, k0, draw, T, median - offset, p20 - offset, p80 - offset, mode))
        print(f"  rows {rows} {kind}{'' if k0 is None else f' k0={k0}'} T={T}: {median - offset:.2f} us ({mode})")
    return points, tuning, notes


def warm_up(bench, shape: calls.PremiseShape, rows: int, gen: torch.Generator) -> None:
    """One call before the clock starts: flashinfer and Triton build their kernels on first use."""
    t = time.time()
    bench.prepare(rows)
    bench.bind(distinct_ids(rows, shape.top_k, shape.experts, shape.top_k, gen), row_weights(rows, shape.top_k, gen))()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    print(f"warm-up ({time.time() - t:.0f} s)")


def machine(device: str) -> str:
    if device == "cpu":
        return f"CPU ({platform.processor() or platform.machine()}), {calls.cpu_count()} cores: DRY RUN"
    cap = torch.cuda.get_device_capability()
    return f"{torch.cuda.get_device_name()} ({calls.arch_name(cap)}), {calls.cpu_count()} CPU cores"


def default_out(dry_run: bool) -> Path:
    """$OUT when set (the device tool returns what is written there), else benchmark/oea/results/."""
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    name = "moe_premise-dry-run" if dry_run else "moe_premise"
    return REPO / "benchmark/oea/results" / f"{name}-{datetime.date.today().isoformat()}"


def parse_args(argv: Optional[Sequence[str]]) -> Tuple[argparse.Namespace, calls.PremiseShape, Optional[tuple]]:
    """Arguments, the shape and the GPU's compute capability (None on a dry run); bad ones refused."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Exit code: 0 GO (at least one judged row count passes), 3 NO-GO, 4 dry run (never a GPU verdict), "
               "2 bad arguments, an error or no row count judged. The go/no-go line is printed last.")
    parser.add_argument("--model-config", default=None,
                        help=f"a HF config.json (or its folder) or a preset: {', '.join(calls.PRESETS)} "
                             "(default: glm5-fp8 on sm_90, glm5-nvfp4 on sm_100/sm_120, tiny on a dry run)")
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: the preset's, else 1)")
    parser.add_argument("--backend", choices=sorted(calls.BACKEND_ALIASES), default=None,
                        help="SGLang's --moe-runner-backend (default: flashinfer_cutlass for nvfp4, else triton)")
    parser.add_argument("--dtype", choices=calls.DTYPES, default=None,
                        help="expert weights (default: the preset's; else bf16 on sm_90, nvfp4 on sm_100/sm_120)")
    parser.add_argument("--rows", type=int, nargs="+", default=None,
                        help="the row counts to time and judge at: C under plain decode, C x draft tokens under "
                             "EAGLE (default 16 32 64; a dry run 4 8)")
    parser.add_argument("--points", type=int, default=12, help="synthetic T values per batch size (>= 3)")
    parser.add_argument("--k0", type=int, nargs="+", default=list(DEFAULT_K0),
                        help="OEA k0 values (1 <= k0 < top-k); the verdict judges k0 5 when swept, else the largest")
    parser.add_argument("--draws", type=int, default=3, help="random-score batches per routing (>= 1)")
    parser.add_argument("--replays", type=int, default=None, help="timed replays per point (>= 3; GPU 40, CPU 5)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help="seconds for the sweep, after set-up; batches not started by then are left out")
    parser.add_argument("--no-autotune", action="store_true", help="flashinfer: skip the tactic autotune")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--out", type=Path, default=None, help="report folder (default: see above)")
    parser.add_argument("--dry-run", action="store_true", help="the CPU, a plain-torch stand-in, small shapes")
    args = parser.parse_args(argv)
    capability = None
    if not args.dry_run:
        if not torch.cuda.is_available():
            parser.error("no CUDA device (use --dry-run on a CPU machine)")
        capability = torch.cuda.get_device_capability()
    if args.model_config is None:
        args.model_config = "tiny" if args.dry_run else ("glm5-fp8" if capability[0] == 9 else "glm5-nvfp4")
    try:
        shape, preset_dtype = calls.load_shape(args.model_config, args.tp)
        args.dtype = args.dtype or calls.default_dtype(preset_dtype, capability)
        args.backend = calls.BACKEND_ALIASES[args.backend or calls.default_backend(args.dtype)]
        calls.check_supported(args.backend, args.dtype, capability)
        calls.check_shape_for(args.dtype, shape)
    except ValueError as e:
        parser.error(str(e))
    args.rows = sorted(set(args.rows or (DRY_RUN_ROWS if args.dry_run else DEFAULT_ROWS)))
    bad_k0 = [k for k in args.k0 if not 1 <= k < shape.top_k]
    checks = [(any(not MIN_ROWS <= r <= MAX_ROWS for r in args.rows),
               f"--rows {args.rows}: each must be in [{MIN_ROWS}, {MAX_ROWS}] (one row always touches exactly "
               f"top-k experts: nothing to judge)"),
              (bool(bad_k0), f"--k0 {bad_k0}: each must be in [1, {shape.top_k - 1}] (top-k is {shape.top_k})"),
              (args.points < 3, f"--points {args.points}: must be >= 3"),
              (args.draws < 1, f"--draws {args.draws}: must be >= 1"),
              (args.replays is not None and args.replays < 3, f"--replays {args.replays}: must be >= 3")]
    for bad, message in checks:
        if bad:
            parser.error(message)
    args.k0 = sorted(set(args.k0))
    args.replays = args.replays or (5 if args.dry_run else 40)
    return args, shape, capability


def report_meta(args, shape: calls.PremiseShape, capability: Optional[tuple], function: str, command: str,
                tuning: str, notes: List[str]) -> dict:
    """The report's header: where, when, what was called and how it was timed."""
    site = calls.call_site(args.backend)
    inner = DRY_INNER if args.dry_run else INNER
    return dict(
        dry_run=args.dry_run, machine=machine("cpu" if args.dry_run else "cuda"),
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        versions=calls.versions() + f", python {platform.python_version()}",
        command=f"python benchmark/oea/gpu/moe_premise.py {command}", function=function,
        call_site=(f"{site} (the call SGLang makes)" if site else
                   "not found in the installed SGLang: check that it still calls this function"),
        shape=shape.describe() + (f", float32 stand-in (on a GPU: {args.backend}, {args.dtype})" if args.dry_run
                                  else f", {args.dtype} weights ({args.backend})"),
        timing=(f"{'CPU loop, no CUDA graph' if args.dry_run else 'CUDA-graph replay'}: {inner} calls per sample, "
                f"median of {args.replays} samples (p20-p80)"),
        tuning=tuning, notes=notes, arch=calls.arch_name(capability) if capability else None,
        backend=args.backend, dtype=args.dtype, rows=args.rows, judged_rows=args.rows, k0=args.k0, draws=args.draws)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The exit code: 0 go, 3 no-go, 4 dry run, 2 bad arguments (argparse), an error or no verdict."""
    try:
        return run(*parse_args(argv), argv)  # parse_args exits 2 itself on bad arguments
    except Exception:  # the operator's script reads the exit code: an error must not read as no-go
        traceback.print_exc()
        print(f"\nERROR: the premise check did not finish: no verdict (exit {EXIT_ERROR})")
        return EXIT_ERROR


def run(args, shape: calls.PremiseShape, capability: Optional[tuple], argv: Optional[Sequence[str]]) -> int:
    """Set up, sweep every row count, write the report; the judgement's exit code."""
    device = "cpu" if args.dry_run else "cuda"
    gen = torch.Generator().manual_seed(args.seed)
    if args.dry_run:
        bench = calls.TorchStandIn(shape, gen)
        function = calls.FUNCTIONS["torch"] + f"; on a GPU: {calls.FUNCTIONS[args.backend]}"
    else:
        t = time.time()
        bench = calls.make_backend(args.backend, args.dtype, shape, torch.Generator(device="cuda").manual_seed(args.seed),
                                   max(args.rows), not args.no_autotune)
        function = calls.FUNCTIONS[args.backend]
        print(f"set-up ({time.time() - t:.0f} s): {function}")
    warm_up(bench, shape, args.rows[0], gen)
    time_fn = timer(device, args.replays)
    deadline = time.time() + args.budget_s
    points, tuning, notes = [], [], []
    for rows in args.rows:
        got, tuned, said = sweep_rows(bench, shape, rows, args, time_fn, gen, deadline)
        points += got
        tuning += [tuned] if tuned not in tuning else []
        notes += said
    eager = sum(p.mode == "eager" for p in points)
    if eager:
        notes.append(f"{eager} of {len(points)} points timed eagerly: their CUDA-graph capture failed (see the log)")
    command = " ".join(sys.argv[1:] if argv is None else argv)
    meta = report_meta(args, shape, capability, function, command, "; ".join(tuning), notes)
    paths, judgement = write_report(args.out or default_out(args.dry_run), meta, points)
    print()
    for verdict in judgement.per_rows:
        print("\n".join([verdict.line] + [f"  caveat: {c}" for c in verdict.caveats]))
    print("report: " + ", ".join(str(p) for p in paths.values()))
    print("\n" + judgement.line)  # last: the line an operator's script and eye look for
    return judgement.exit_code


if __name__ == "__main__":
    sys.exit(main())
