"""The score-bits check of gpu_check.py: the kernel's selection scores against the torch path's
(sglang_oea.routing.score_experts), bit for bit, and near-ties at the base boundary; plus the
probability-tie inputs test/srt/test_lean_routing.py routes.
"""

import contextlib
from typing import List, Optional, Tuple

import torch

from gpu.gpu_cases import SEED, Case, kernels, run_kernel
from gpu.gpu_compare import compare
from sglang_oea.routing import RouterSpec, score_experts

SCORE_BLOCK = 1024
_SCORE_BLOCKS_KERNEL = None


def score_blocks_kernel():
    """A one-launch Triton kernel, built on first use: program p writes the routing kernels' own
    `_scores` jit helper of x[p * BLOCK : (p + 1) * BLOCK] (bias alike) into sel and w.

    Triton resolves a kernel's names in its module's globals (the interpreter even re-executes the
    source there, so closures are not seen): the imports below bind module globals on purpose.
    """
    global _SCORE_BLOCKS_KERNEL, triton, tl, _scores
    if _SCORE_BLOCKS_KERNEL is None:
        import triton
        import triton.language as tl

        _scores = kernels()._scores

        @triton.jit
        def _score_blocks(x_ptr, bias_ptr, sel_ptr, w_ptr, numel, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK: tl.constexpr):
            start = tl.program_id(0) * BLOCK
            cols = tl.arange(0, BLOCK)
            sel, w = _scores(x_ptr + start, bias_ptr + start, cols, numel - start, SIGMOID, HAS_BIAS)
            tl.store(sel_ptr + start + cols, sel, mask=cols < numel - start)
            tl.store(w_ptr + start + cols, w, mask=cols < numel - start)

        _SCORE_BLOCKS_KERNEL = _score_blocks
    return _SCORE_BLOCKS_KERNEL


def kernel_scores(x: torch.Tensor, bias: Optional[torch.Tensor], sigmoid: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sel, w) of the flat float32 x [M], M a multiple of SCORE_BLOCK (softmax: one row per block),
    as the routing kernels score a row, compiled with their options."""
    sel, w = torch.empty_like(x), torch.empty_like(x)
    with contextlib.ExitStack() as quiet:
        if not x.is_cuda:  # the interpreter's numpy warns on the deliberate overflows (exp(inf), inf - inf)
            import numpy as np

            quiet.enter_context(np.errstate(over="ignore", invalid="ignore"))
        score_blocks_kernel()[(x.numel() // SCORE_BLOCK,)](
            x, x if bias is None else bias, sel, w, x.numel(), SIGMOID=sigmoid, HAS_BIAS=bias is not None,
            BLOCK=SCORE_BLOCK, **dict(kernels().COMPILE_OPTIONS))
    return sel, w


def score_inputs(size: int, gen: torch.Generator, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [M] float32 and a bias [M] on `device`, M = size rounded up to SCORE_BLOCK: mostly uniform
    over [-30, 30]; sweeps where exp over- or underflows (|x| in 80..110) and where sigmoid
    saturates (|x| near 16.6); tiny |x|; the special values (+-0, subnormal, FLT_MIN, huge,
    FLT_MAX, +-inf). The bias is normal * 0.5, with +0.0 and -0.0 in every tenth element."""
    f32 = torch.finfo(torch.float32)
    special = [0.0, -0.0, 1e-45, -1e-45, f32.tiny, -f32.tiny, 1e-30, -1e-30, 1e30, -1e30, f32.max, -f32.max,
               float("inf"), float("-inf"), 88.72283, -88.72283, 87.33654, -87.33654, 103.97208, -103.97208]
    sweep = max(size // 50, 64)
    parts = [
        torch.tensor(special),
        torch.linspace(-110.0, -80.0, sweep), torch.linspace(80.0, 110.0, sweep),
        torch.linspace(-17.5, -15.5, sweep), torch.linspace(15.5, 17.5, sweep),
        (torch.rand(sweep, generator=gen) * 2 - 1) * 1e-6,
    ]
    used = sum(p.numel() for p in parts)
    total = -(-max(size, used) // SCORE_BLOCK) * SCORE_BLOCK
    x = torch.cat(parts + [torch.rand(total - used, generator=gen) * 60 - 30])
    bias = torch.randn(total, generator=gen) * 0.5
    bias[::20] = 0.0
    bias[1::20] = -0.0
    return x.to(device), bias.to(device)


def reference_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """What the kernel's sigmoid must equal bit for bit on x's device: torch.sigmoid on CUDA (the
    torch path); on the CPU, where the kernel runs in Triton's interpreter, numpy's float32
    1 / (1 + exp(-x)) (torch's CPU sigmoid is another implementation, off in the last bit)."""
    if x.is_cuda:
        return torch.sigmoid(x)
    import numpy as np

    one = np.float32(1.0)
    with np.errstate(over="ignore"):
        return torch.from_numpy(one / (one + np.exp(-x.numpy())))


def bit_mismatches(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """[M] bool: float32 elements whose bits differ (-0.0 is not +0.0)."""
    return got.view(torch.int32) != want.view(torch.int32)


def score_bits(x: torch.Tensor, bias: torch.Tensor) -> Tuple[List[str], List[str]]:
    """The kernel's scores against the torch path's, bit for bit, on x's device (see check_score_bits)."""
    from sglang_oea.routing import softmax_rows

    w_ref = reference_sigmoid(x)
    _, w = kernel_scores(x, None, sigmoid=True)
    sel, w_of_biased = kernel_scores(x, bias, sigmoid=True)
    soft_sel, soft_w = kernel_scores(x, None, sigmoid=False)
    checks = {  # name: (kernel, torch path)
        "sigmoid w": (w, w_ref),
        "sigmoid w, biased call": (w_of_biased, w_ref),
        "sigmoid + bias sel": (sel, w_ref + bias),  # routing.score_experts: one float32 add
        "softmax sel (the logit)": (soft_sel, x),
    }
    errors, counts = [], []
    for name, (got, want) in checks.items():
        bad = bit_mismatches(got, want)
        counts.append(f"{name}: {int(bad.sum())}")
        if bad.any():
            first = int(bad.nonzero()[0])
            errors.append(f"score bits: {name}: {int(bad.sum())} of {x.numel()} values differ from the torch path "
                          f"(first x = {float(x[first])!r}: kernel {float(got[first])!r}, "
                          f"torch {float(want[first])!r})")
    # Softmax weights only need the weight tolerance: the sum's order differs between the paths.
    rows = x.view(-1, SCORE_BLOCK)
    finite = rows.isfinite().all(dim=1)
    want_w, got_w = softmax_rows(rows[finite]), soft_w.view(-1, SCORE_BLOCK)[finite]
    worst = float(((got_w - want_w).abs() / want_w.clamp_min(1e-30)).max())
    if not torch.allclose(got_w, want_w, rtol=1e-5, atol=1e-12):
        errors.append(f"score bits: softmax weights off from the torch path by up to {worst:.2e} (relative)")
    against = "torch on CUDA" if x.is_cuda else (
        "numpy's formula (torch's CPU sigmoid differs in "
        f"{int(bit_mismatches(w_ref, torch.sigmoid(x)).sum())} of them)")
    line = (f"| score bits vs {against} | {x.numel()} values | differing: " + ", ".join(counts)
            + f"; softmax weights max rel. diff {worst:.1e} |")
    return errors, [line]


def _ulp_neighbours(x: torch.Tensor, span: int) -> torch.Tensor:
    """[R, 2 * span + 1] float32: the floats within `span` ulps of each positive finite x [R]."""
    steps = torch.arange(-span, span + 1, dtype=torch.int32, device=x.device)
    return (x.view(torch.int32)[:, None] + steps).view(torch.float32)


def _sigmoid_score_pairs(device, gen: torch.Generator, beta: torch.Tensor):
    """Candidates x_a, x_b [R] float32, x_a in [1, 2], with sigmoid(x_b) + beta 1 ulp below
    sigmoid(x_a) + beta as reference_sigmoid computes them elementwise, and found [R] bool (False
    where no x_b lies within 64 ulps of the closed-form guess)."""
    x_a = (torch.rand(beta.numel(), generator=gen) + 1).to(device)
    sel_a = reference_sigmoid(x_a) + beta
    target = torch.nextafter(sel_a, torch.full_like(sel_a, float("-inf")))
    goal = (target.double() - beta.double()).clamp(1e-6, 1 - 1e-6)
    cand = _ulp_neighbours((goal / (1 - goal)).log().float(), 64)  # [R, C]
    match = reference_sigmoid(cand.flatten()).view_as(cand) + beta[:, None] == target[:, None]
    x_b = cand.gather(1, match.int().argmax(dim=1, keepdim=True))[:, 0]
    return x_a, x_b, match.any(dim=1)


def _one_ulp_apart(logits: torch.Tensor, spec: RouterSpec, a: torch.Tensor, b: torch.Tensor):
    """(selection, weight, ok [R] bool): the torch path's scores of logits, and whether
    selection[r, a_r] lies 1 ulp above selection[r, b_r] (both positive). On the CPU (interpreted
    kernel), with sigmoid, ok also needs the torch path's weights there to be numpy's bits."""
    selection, weight = score_experts(logits, spec)
    both = torch.stack([a, b], dim=1)
    sel = selection.gather(1, both)
    ok = (sel[:, 1] > 0) & (sel[:, 0].view(torch.int32) - sel[:, 1].view(torch.int32) == 1)
    if spec.scoring_func == "sigmoid" and not logits.is_cuda:
        ok &= (weight.gather(1, both) == reference_sigmoid(logits.gather(1, both).contiguous())).all(dim=1)
    return selection, weight, ok


def near_tie_inputs(scoring: str, device, gen: torch.Generator, rows: int = 16, k: int = 8, k0: int = 3):
    """Router inputs [rows, 64] where, in every row r, the k0-th and (k0+1)-th routed experts a_r and
    b_r (one of experts 2r, 2r + 1 each, drawn at random) have selection scores exactly 1 ulp apart
    as the torch path (routing.score_experts) computes them on `device`: sigmoid + correction bias
    (the bias of a_r and b_r is the row's beta) or softmax (logits 1 ulp apart). Every row also
    routes experts 32 and 33 (the best: bias +1) and four of 34..47 (below b_r, bias 0); experts
    48..63 have bias -1; unrouted logits are -6. Returns logits, topk_ids (int32, columns
    shuffled), topk_weights, spec, a [rows], b [rows]."""
    num_experts = 64
    assert 2 * rows <= 32 and (k, k0) == (8, 3)
    sigmoid = scoring == "sigmoid"
    beta = ((torch.rand(rows, generator=gen) - 0.5) * 0.4).to(device)
    swap = torch.rand(rows, generator=gen) < 0.5
    a = (2 * torch.arange(rows) + swap.long()).to(device)
    b = (2 * torch.arange(rows) + 1 - swap.long()).to(device)
    bias = torch.zeros(num_experts, device=device)
    bias[a], bias[b] = beta, beta
    bias[32:34], bias[48:] = 1.0, -1.0
    spec = RouterSpec(scoring, bias if sigmoid else None)
    logits = torch.full((rows, num_experts), -6.0, device=device)
    logits[:, 32:34] = (torch.rand(rows, 2, generator=gen) * 2 + 2).to(device)
    lower = (torch.rand(rows, 14, generator=gen).argsort(dim=1)[:, : k - k0 - 1] + 34).to(device)
    logits.scatter_(1, lower, (-torch.rand(rows, k - k0 - 1, generator=gen)).to(device))
    r = torch.arange(rows, device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    for _ in range(40):  # redraw the rows that are not 1 ulp apart yet
        if sigmoid:
            x_a, x_b, found = _sigmoid_score_pairs(device, gen, beta)
        else:
            x_a = (torch.rand(rows, generator=gen) + 0.5).to(device)
            x_b, found = torch.nextafter(x_a, torch.full_like(x_a, float("-inf"))), torch.ones_like(done)
        take = found & ~done
        logits[r, a] = torch.where(take, x_a, logits[r, a])
        logits[r, b] = torch.where(take, x_b, logits[r, b])
        # Checked on the whole batch: torch's CPU sigmoid differs in the last bit between its
        # vectorised body and its scalar tail, so the element's position matters there.
        selection, weight, done = _one_ulp_apart(logits, spec, a, b)
        if bool(done.all()):
            break
    assert bool(done.all()), f"{scoring}: rows {(~done).nonzero().flatten().tolist()} found no 1-ulp pair"
    ids = selection.topk(k, dim=1).indices
    assert torch.equal(ids[:, k0 - 1], a) and torch.equal(ids[:, k0], b), "the near tie is not at the boundary"
    ids = ids.gather(1, torch.rand(rows, k, generator=gen).argsort(dim=1).to(device))
    w = weight.gather(1, ids)
    w = w / w.sum(dim=1, keepdim=True) * 2.5
    return logits, ids.int(), w, spec, a, b


def near_ties(device) -> Tuple[List[str], List[str]]:
    """Kernel ids == torch path ids (and a_r, not b_r, in every base) on near_tie_inputs."""
    errors, lines = [], []
    gen = torch.Generator().manual_seed(SEED + 11)
    for scoring in ("sigmoid", "softmax"):
        logits, ids, w, spec, a, b = near_tie_inputs(scoring, device, gen)
        case = Case(B=logits.shape[0], N=logits.shape[1], K=8, k0=3, scoring=scoring, bias=scoring == "sigmoid")
        out_ids, out_w = run_kernel(case, logits, ids, w, spec)
        err = compare(case, out_ids, out_w, logits, ids, w, spec)
        base = out_ids[:, : case.k0].long()
        if err is None and not bool(((base == a[:, None]).any(dim=1) & ~(base == b[:, None]).any(dim=1)).all()):
            err = f"{case}: some base holds b_r (1 ulp below a_r) instead of a_r: {base.tolist()}"
        if err:
            errors.append(f"near tie ({scoring}): {err}")
        lines.append(f"| near tie at the base boundary, {scoring}{' + bias' * (scoring == 'sigmoid')} | "
                     f"{case.B} rows, selection 1 ulp apart | {'ok' if err is None else 'FAIL'} |")
    return errors, lines


def check_score_bits(device, size: Optional[int] = None) -> Tuple[List[str], List[str]]:
    """The kernel's selection scores are the torch path's, bit for bit: `_scores` (the routing
    kernels' own helper, compiled with their options) over ~1e6 float32 values (uniform over
    [-30, 30], over/underflow sweeps, special values) against torch.sigmoid(x) (+ bias) on the same
    device, and softmax's selection against the logit itself; expected 0 differing values. Then two
    near-tie batches whose a_r / b_r selection scores are 1 ulp apart at the base boundary (sigmoid +
    bias and softmax): kernel ids == route_from_logits ids.

    On the CPU (TRITON_INTERPRET=1; size defaults to 16 blocks) the kernel's exp is numpy's, so the
    bits are checked against numpy's float32 formula instead, and the near-ties use values where
    numpy and torch agree.

    Returns (failures, report lines).
    """
    device = torch.device(device)
    size = size or (1 << 20 if device.type == "cuda" else 16 * SCORE_BLOCK)
    x, bias = score_inputs(size, torch.Generator().manual_seed(SEED + 10), device)
    errors, lines = score_bits(x, bias)
    tie_errors, tie_lines = near_ties(device)
    return errors + tie_errors, lines + tie_lines


def probability_tie_inputs(device="cpu"):
    """Softmax router inputs [5, 64] whose probabilities tie where the logits do not, so that ranking
    by probability (the old selection score) and by logit (the current one) choose different ids:
      rows 0-1: the routed experts after the best one have logits around -100 (ascending with the
          id), so their probabilities underflow to 0;
      rows 2-3: routed logits 1.0 and the next float up, 1 ulp apart, at a max of 20: x - max rounds
          to the same float, so their probabilities are equal;
      row 4: expert 16 (in row 0's base) has logit -inf: never a piggyback candidate there.
    Returns logits, topk_ids (int32, the top 8 by logit, columns shuffled), topk_weights (float32,
    renormalised) and the RouterSpec."""
    num_rows, num_experts, k = 5, 64, 8
    gen = torch.Generator().manual_seed(SEED + 12)
    logits = torch.rand(num_rows, num_experts, generator=gen) * 4 - 150  # unrouted: far below
    logits[:, 5] = 20.0
    for r in (0, 1):
        ids = torch.arange(10, 17) + 20 * r
        logits[r, ids] = -100.0 + torch.arange(7.0)  # higher id, higher logit; exp(x - 20) == 0
    for r in (2, 3):
        logits[r, 40 + r] = 1.0
        logits[r, 41 + r] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
        logits[r, torch.arange(50, 55) + r] = -1.0 - torch.arange(5.0)
    logits[4, 10:17] = torch.arange(7.0)
    logits[4, 16] = float("-inf")
    logits[4, 30] = 10.0
    ids = logits.topk(k, dim=1).indices
    ids = ids.gather(1, torch.rand(num_rows, k, generator=gen).argsort(dim=1))
    weights = logits.softmax(dim=1).gather(1, ids)
    weights = weights / weights.sum(dim=1, keepdim=True).clamp_min(1e-30)
    return logits.to(device), ids.int().to(device), weights.to(device), RouterSpec("softmax")
