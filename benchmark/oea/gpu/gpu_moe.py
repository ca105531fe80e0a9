"""Check 4 of benchmark/oea/gpu/gpu_check.py: MoE-layer time vs T (distinct experts) with a small Triton
grouped GEMM on bf16 Qwen3-30B-A3B shapes, vanilla routing vs OEA k0 in {3, 4, 5, 6}, next to the
paper's H100 ratios; a least-squares fit of time vs T. `check_grouped_gemm_small` also runs in the
CPU interpreter (the dry run). Import after TRITON_INTERPRET is set: the kernel is decorated here.
"""

import statistics
import traceback
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from gpu.gpu_cases import SEED, kernels
from gpu.gpu_timing import graph_time_us

PAPER_H100_RATIO = {3: 0.61, 5: 0.77}  # MoE-layer time OEA / vanilla, Qwen3-30B-A3B, B = 16


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    block_expert_ptr,
    a_rows_ptr,
    K_DIM,
    N_DIM,
    stride_a,
    stride_be,
    stride_bk,
    stride_c,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """C[m, :] = A[a_rows[m], :] @ B[block_expert[m // BLOCK_M]] for the rows m of one M block.

    A [*, K_DIM], B [E, K_DIM, N_DIM] (N contiguous), C [M_pad, N_DIM]. a_rows [M_pad] (-1 on
    padding rows, which are neither read nor written). Only the experts listed in block_expert
    are read, so the time grows with the number of distinct experts T.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    a_rows = tl.load(a_rows_ptr + rows).to(tl.int64)
    row_ok = a_rows >= 0
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N_DIM
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K_DIM, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        k_ok = ks < K_DIM
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(
            b_ptr + expert * stride_be + ks[:, None] * stride_bk + cols[None, :],
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        acc += tl.dot(a, b)
    c = c_ptr + rows.to(tl.int64)[:, None] * stride_c + cols[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def grouped_gemm(a, b, block_expert, a_rows, out, cfg: Dict[str, int]):
    """out[m] = a[a_rows[m]] @ b[block_expert[m // BLOCK_M]] (rows with a_rows = -1 untouched)."""
    grid = (block_expert.numel(), triton.cdiv(b.shape[2], cfg["BLOCK_N"]))
    _grouped_gemm_kernel[grid](
        a,
        b,
        out,
        block_expert,
        a_rows,
        b.shape[1],
        b.shape[2],
        a.stride(0),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
        num_warps=cfg.get("num_warps", 4),
        num_stages=cfg.get("num_stages", 3),
    )
    return out


@dataclass
class MoELayout:
    """(token, slot) pairs sorted by expert, each expert padded to whole BLOCK_M blocks."""

    block_expert: torch.Tensor  # [num_blocks] int32
    src_rows: torch.Tensor  # [M_pad] int32 token of the row, -1 on padding
    own_rows: torch.Tensor  # [M_pad] int32 the row itself, -1 on padding
    row_token: torch.Tensor  # [M_pad] int64 token, B (a dump row) on padding
    row_weight: torch.Tensor  # [M_pad] float32 routing weight, 0 on padding
    experts: List[int] = field(default_factory=list)  # the active experts (T = len)


def moe_layout(ids: torch.Tensor, weights: torch.Tensor, block_m: int, device) -> MoELayout:
    """Host-side sort of a routing decision into the grouped-GEMM layout (not timed)."""
    ids, weights = ids.cpu().long(), weights.cpu().float()
    B, K = ids.shape
    per_expert: Dict[int, List[Tuple[int, float]]] = {}
    for t in range(B):
        for j in range(K):
            per_expert.setdefault(int(ids[t, j]), []).append((t, float(weights[t, j])))
    blocks, src, token, weight = [], [], [], []
    for e in sorted(per_expert):
        pairs = per_expert[e]
        pad = -len(pairs) % block_m
        blocks += [e] * ((len(pairs) + pad) // block_m)
        src += [t for t, _ in pairs] + [-1] * pad
        token += [t for t, _ in pairs] + [B] * pad
        weight += [x for _, x in pairs] + [0.0] * pad
    own = [i if s >= 0 else -1 for i, s in enumerate(src)]
    as_t = lambda v, dt: torch.tensor(v, dtype=dt, device=device)  # noqa: E731
    return MoELayout(
        as_t(blocks, torch.int32), as_t(src, torch.int32), as_t(own, torch.int32),
        as_t(token, torch.int64), as_t(weight, torch.float32), sorted(per_expert),
    )


def moe_forward(x, w_up, w_down, lay: MoELayout, cfg, buffers=None):
    """Sum over a token's slots of weight * (silu(x W_gate) * (x W_up)) W_down, grouped by expert."""
    inter = w_down.shape[1]
    rows = lay.src_rows.numel()
    if buffers is None:
        buffers = (
            torch.zeros(rows, w_up.shape[2], dtype=x.dtype, device=x.device),
            torch.zeros(rows, w_down.shape[2], dtype=x.dtype, device=x.device),
        )
    up, down = buffers
    grouped_gemm(x, w_up, lay.block_expert, lay.src_rows, up, cfg)
    act = torch.nn.functional.silu(up[:, :inter]) * up[:, inter:]
    grouped_gemm(act, w_down, lay.block_expert, lay.own_rows, down, cfg)
    out = torch.zeros(x.shape[0] + 1, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, lay.row_token, down.float() * lay.row_weight[:, None])
    return out[:-1]


def moe_reference(x, w_up, w_down, ids, weights):
    """Plain loop over (token, slot) in float32: the grouped GEMM's correctness oracle."""
    inter = w_down.shape[1]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = x[t].float() @ w_up[e].float()
            out[t] += float(weights[t, j]) * ((torch.nn.functional.silu(h[:inter]) * h[inter:]) @ w_down[e].float())
    return out


def moe_loop_forward(x, w_up, w_down, groups):
    """One torch.matmul pair per active expert (the fallback when the Triton grouped GEMM fails, and
    moe_premise.py's dry-run stand-in): groups from loop_groups. x [B, H], w_up [E, H, 2I],
    w_down [E, I, H]; returns [B, H] float32."""
    inter = w_down.shape[1]
    out = torch.zeros(x.shape[0] + 1, x.shape[1], dtype=torch.float32, device=x.device)
    for e, tok, wt in groups:
        h = x.index_select(0, tok) @ w_up[e]
        y = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ w_down[e]
        out.index_add_(0, tok, y.float() * wt[:, None])
    return out[:-1]


def loop_groups(ids: torch.Tensor, weights: torch.Tensor, device):
    """[(expert, its rows [n] int64, their weights [n] float32)] for each expert in ids [B, K], by id."""
    ids, weights = ids.cpu().long(), weights.cpu().float()
    groups = []
    for e in sorted(set(ids.flatten().tolist())):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        groups.append((e, tok.to(device), weights[tok, slot].to(device)))
    return groups


def check_grouped_gemm_small(device: str) -> Optional[str]:
    """The grouped GEMM on tiny float32 shapes against moe_reference (runs in the interpreter)."""
    gen = torch.Generator().manual_seed(SEED + 11)
    B, H, I, E, K = 5, 64, 32, 8, 3
    x = torch.randn(B, H, generator=gen).to(device)
    w_up = (torch.randn(E, H, 2 * I, generator=gen) * 0.1).to(device)
    w_down = (torch.randn(E, I, H, generator=gen) * 0.1).to(device)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(B)])
    weights = torch.rand(B, K, generator=gen)
    lay = moe_layout(ids, weights, 16, device)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
    got = moe_forward(x, w_up, w_down, lay, cfg)
    want = moe_reference(x, w_up, w_down, ids, weights)
    try:
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    except AssertionError as e:
        return f"grouped GEMM: {e}"
    return None


GEMM_CONFIGS = (
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
    dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3),
)

# Opt-in shared memory per thread block, bytes, by compute capability (CUDA C++ Programming Guide,
# technical specifications): used when torch does not report shared_memory_per_block_optin.
SMEM_PER_BLOCK_OPTIN = {
    (8, 0): 166912, (8, 6): 101376, (8, 7): 166912, (8, 9): 101376, (9, 0): 232448,
    (10, 0): 232448, (10, 3): 232448, (12, 0): 101376, (12, 1): 101376,
}
SMEM_WITHOUT_OPTIN = 49152  # what every CUDA device gives a block without opting in


def tile_smem_bytes(cfg: Dict[str, int], elem_bytes: int) -> int:
    """Shared memory one grouped-GEMM tile config needs: Triton's software pipeline keeps num_stages
    copies of an A tile [BLOCK_M, BLOCK_K] and a B tile [BLOCK_K, BLOCK_N]. 16x128x128 with 3 stages
    in bf16: 3 * (16*128 + 128*128) * 2 = 110592 B, beyond sm_120's 101376."""
    return cfg["num_stages"] * (cfg["BLOCK_M"] * cfg["BLOCK_K"] + cfg["BLOCK_K"] * cfg["BLOCK_N"]) * elem_bytes


def smem_limit(capability: Tuple[int, int], reported: Optional[int]) -> Tuple[int, str]:
    """(bytes of shared memory a block may use, where the figure comes from)."""
    if reported:
        return reported, "shared_memory_per_block_optin reported by torch"
    if tuple(capability) in SMEM_PER_BLOCK_OPTIN:
        return SMEM_PER_BLOCK_OPTIN[tuple(capability)], f"table for sm_{capability[0]}{capability[1]}"
    return SMEM_WITHOUT_OPTIN, f"sm_{capability[0]}{capability[1]} not in the table: the 48 KB every block gets"


def fitting_configs(configs: Sequence[Dict[str, int]], limit: int, elem_bytes: int):
    """(the configs whose tiles fit in `limit` bytes, [(config, bytes)] of those that do not). When
    none fits, the smallest, with num_stages lowered until it fits (down to 1), is the one kept."""
    fit = [c for c in configs if tile_smem_bytes(c, elem_bytes) <= limit]
    left_out = [(c, tile_smem_bytes(c, elem_bytes)) for c in configs if c not in fit]
    if not fit:
        small = dict(min(configs, key=lambda c: tile_smem_bytes(c, elem_bytes)))
        while small["num_stages"] > 1 and tile_smem_bytes(small, elem_bytes) > limit:
            small["num_stages"] -= 1
        fit = [small]
    return fit, left_out


def device_smem_limit(device: str) -> Tuple[int, str]:
    props = torch.cuda.get_device_properties(device)
    return smem_limit(torch.cuda.get_device_capability(device), getattr(props, "shared_memory_per_block_optin", None))


def _fit(points: Sequence[Tuple[float, float]]) -> Tuple[float, float, float]:
    """Least squares y = a + b x: (slope b, intercept a, R^2)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    slope = sxy / sxx if sxx else float("nan")
    intercept = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys))
    return slope, intercept, (1 - ss_res / ss_tot) if ss_tot else float("nan")


def fastest_config(configs, x, w_up, w_down, lay, lines: List[str]) -> Dict[str, int]:
    """The config of `configs` with the lowest graph-replay time on layout `lay`; a config that
    fails to compile or launch (Triton's own shared-memory check included) is reported and skipped."""
    best = None
    for c in configs:
        bufs = (torch.zeros(lay.src_rows.numel(), w_up.shape[2], dtype=x.dtype, device=x.device),
                torch.zeros(lay.src_rows.numel(), w_down.shape[2], dtype=x.dtype, device=x.device))
        try:
            t = graph_time_us(lambda: moe_forward(x, w_up, w_down, lay, c, bufs), inner=5, replays=20)[0]
        except Exception as e:  # e.g. triton.runtime.errors.OutOfResources: the next config
            lines.append(f"- tile config {c}: failed, {type(e).__name__}: {str(e).splitlines()[0]}")
            continue
        lines.append(f"- tile config {c}: {t:.1f} us (vanilla, seed 0)")
        if best is None or t < best[0]:
            best = (t, c)
    if best is None:
        raise RuntimeError("no grouped-GEMM tile config ran")
    return best[1]


QWEN3_30B_A3B = dict(hidden=2048, inter=768, experts=128, top_k=8, rows=16)


def bench_moe(
    device: str, seeds: int, routing_us: Optional[float], dims: Dict[str, int] = QWEN3_30B_A3B
) -> Tuple[List[str], List[str]]:
    """Check 4. Returns (warnings, report lines). A broken grouped GEMM is a warning (the timing
    falls back to a torch.matmul loop), not a failure of the OEA kernel."""
    oea = kernels()
    H, I, E, K, B = (dims[k] for k in ("hidden", "inter", "experts", "top_k", "rows"))
    lines, warnings = [], []
    gen = torch.Generator(device=device).manual_seed(SEED)
    w_up = torch.randn(E, H, 2 * I, generator=gen, device=device, dtype=torch.bfloat16) * 0.02
    w_down = torch.randn(E, I, H, generator=gen, device=device, dtype=torch.bfloat16) * 0.02
    x = torch.randn(B, H, generator=gen, device=device, dtype=torch.bfloat16)

    def routings(seed: int):
        logits = torch.randn(B, E, generator=torch.Generator().manual_seed(seed)).to(device)
        vals, ids = torch.topk(torch.softmax(logits, dim=-1), K, dim=-1)
        w = vals / vals.sum(dim=-1, keepdim=True)
        ids = ids.to(torch.int32)
        yield "vanilla", ids, w
        for k0 in (3, 4, 5, 6):
            o_ids, o_w = oea.oea_route(logits, ids, w, k0=k0, num_valid_rows=B, min_batch=1)
            yield f"k0={k0}", o_ids.clone(), o_w.clone()

    # The tile configs whose shared memory fits this GPU; correctness of the GEMM on the real
    # shapes, then the fastest config.
    limit, source = device_smem_limit(device)
    configs, left_out = fitting_configs(GEMM_CONFIGS, limit, x.element_size())
    lines.append(f"- shared memory per block: {limit} B ({source}); tile configs that fit: {len(configs)}")
    lines += [f"- tile config {c}: left out, needs {need} B" for c, need in left_out]
    engine, cfg = "triton grouped GEMM", None
    _, ids0, w0 = next(routings(SEED))
    try:
        lay0 = moe_layout(ids0, w0, 16, device)
        got = moe_forward(x, w_up, w_down, lay0, configs[0])
        want = moe_reference(x, w_up, w_down, ids0, w0)
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)
        cfg = fastest_config(configs, x, w_up, w_down, lay0, lines)
    except Exception as e:
        engine = "torch.matmul loop over active experts (fallback: the Triton grouped GEMM failed)"
        warnings.append(f"grouped GEMM failed: {type(e).__name__}: {str(e).splitlines()[0]}")
        print(f"  {warnings[-1]}\n{traceback.format_exc()}")

    by_arm: Dict[str, List[Tuple[int, float]]] = {}
    for seed in range(seeds):
        for arm, ids, w in routings(SEED + seed):
            lay = moe_layout(ids, w, 16, device)
            if cfg is not None:
                bufs = (torch.zeros(lay.src_rows.numel(), 2 * I, dtype=x.dtype, device=device),
                        torch.zeros(lay.src_rows.numel(), H, dtype=x.dtype, device=device))
                t = graph_time_us(lambda: moe_forward(x, w_up, w_down, lay, cfg, bufs), inner=10, replays=30)[0]
            else:
                groups = loop_groups(ids, w, device)
                t = graph_time_us(lambda: moe_loop_forward(x, w_up, w_down, groups), inner=3, replays=10)[0]
            by_arm.setdefault(arm, []).append((len(lay.experts), t))
    vanilla = by_arm["vanilla"]
    t_van = statistics.fmean(t for _, t in vanilla)
    lines += [
        "",
        f"Engine: {engine}" + (f"; the tile config that ran: {cfg} ({tile_smem_bytes(cfg, x.element_size())} B "
                               f"shared)" if cfg else "") + f"; {seeds} random-logit batches (B = {B}).",
        "",
        "| arm | mean T | mean layer us | ratio vs vanilla (min-max) | + routing kernel | paper H100 |",
        "|---|---|---|---|---|---|",
    ]
    for arm, pts in by_arm.items():
        mean_t = statistics.fmean(t for _, t in pts)
        ratios = [t / tv for (_, t), (_, tv) in zip(pts, vanilla)]
        k0 = int(arm.split("=")[1]) if "=" in arm else None
        with_routing = "-" if k0 is None or routing_us is None else f"{(mean_t + routing_us) / t_van:.2f}x"
        paper = f"{PAPER_H100_RATIO[k0]:.2f}x" if k0 in PAPER_H100_RATIO else "-"
        lines.append(
            f"| {arm} | {statistics.fmean(T for T, _ in pts):.1f} | {mean_t:.1f} | {mean_t / t_van:.2f}x "
            f"({min(ratios):.2f}-{max(ratios):.2f}) | {with_routing} | {paper} |"
        )
    slope, intercept, r2 = _fit([p for pts in by_arm.values() for p in pts])
    lines += ["", f"Fit over all batches: time = {intercept:.1f} us + {slope:.2f} us x T, R^2 = {r2:.3f}."]
    lines += [f"- WARNING: {w}" for w in warnings]
    return warnings, lines

