"""OEA under DP attention: SGLang's view of the gathered batch, read for the runtime (thin layer).

Under DP attention (`--attn-dp-size G > 1`) every rank of the tensor-parallel group runs every
forward pass, and before each MoE layer SGLang gathers every attention-DP group's tokens, so that
each rank's router sees the same gathered batch: the batch OEA routes. What a rank's own
ForwardBatch says is local (its forward mode is IDLE on a rank without requests of its own, its
batch size its own), so the pass is described from what SGLang's MLP-sync all-gather gave every
rank alike (sglang 0.5.23, model_executor/forward_batch_info.py and
managers/scheduler_components/dp_attn.py):
    original_global_num_tokens_cpu  every group's requests in a decode-family pass (before
                                    padding; None in graph capture passes);
    is_extend_in_batch              whether any group prefills in this pass;
    spec_info.num_tokens_per_req    the draft tokens per request of a verify pass (the same on
                                    every rank: SGLang sizes the gather with it on each rank).
The pass mode is then the same on every rank: not routed when any group prefills, else the local
mode of a rank with requests, and for an idle rank the mode this server routes (decode; verify
under speculative decoding). Eager passes lay the groups' slots out as SGLang padded them for the
gather (`gathered_slots`); graph passes in equal slots (sglang_oea.gathered).

Two checks that run from a rank's own decode steps elsewhere run here from the gathered passes,
which every rank runs alike: the rank check (--oea-check-ranks), every N routed passes, and the
metrics export of a rank whose own batch was idle (SGLang never calls its decode-stats report there).
"""

import logging
from typing import Any, List, Optional

from sglang_oea.passes import DECODE, DRAFT, OTHER, VERIFY, StepInfo

logger = logging.getLogger("sglang_oea")

_report_every = 0  # SGLang's --decode-log-interval, set at scheduler start (0: not yet)


def attention_dp_groups() -> int:
    """The attention-DP groups whose tokens each MoE layer gathers (0 without DP attention)."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    groups = int(getattr(parallel, "attn_dp_size", 1) or 1)
    return groups if getattr(parallel, "attn_dp_enabled", False) and groups > 1 else 0


def gathered_slots() -> Optional[List[int]]:
    """Each group's slot in the current eager pass's gathered buffer, in token rows, as SGLang
    padded them for its gather (layers/dp_attention.py), or None when it published none."""
    from sglang.srt.layers.dp_attention import get_dp_global_num_tokens

    padded = get_dp_global_num_tokens()
    return None if padded is None else [int(n) for n in padded]


def verify_width(forward_batch: Any) -> int:
    """Draft tokens per request of a verify pass (1 without a speculative input)."""
    return int(getattr(forward_batch.spec_info, "num_tokens_per_req", None) or 1)


def gathered_step(forward_batch: Any, mode: str, routed_mode: str, groups: int, local_rows: int) -> dict:
    """begin_step's description of a pass under DP attention (mode, num_rows, requests, groups,
    group_rows), the same on every rank; the draft model's passes are DRAFT (never routed).
    mode: the local mode (hooks.forward_mode_of); routed_mode: the mode this server routes.
    local_rows: this rank's token rows (a graph capture pass's bucket)."""
    spec = forward_batch.spec_info
    if mode == DRAFT or (forward_batch.forward_mode.is_idle() and spec is not None and spec.is_draft_input()):
        # Also an idle rank's draft-model pass whose forward context SGLang opens before the draft
        # runner's forward (speculative/eagle_worker_v2.py, the idle draft steps): the others' is a
        # draft pass too.
        return dict(mode=DRAFT, num_rows=local_rows, requests=int(forward_batch.batch_size))
    counts = forward_batch.original_global_num_tokens_cpu
    if counts is None:  # a graph warm-up or capture pass: every group at the bucket
        return dict(mode=mode, num_rows=local_rows * groups, requests=int(forward_batch.batch_size) * groups,
                    groups=groups, group_rows=())
    counts = [int(c) for c in counts]
    if forward_batch.is_extend_in_batch or not any(counts) or len(counts) != groups:
        mode = OTHER
    elif mode not in (DECODE, VERIFY):
        mode = routed_mode if forward_batch.forward_mode.is_idle() else OTHER
    width = verify_width(forward_batch) if mode == VERIFY else 1
    rows = tuple(c * width for c in counts)
    return dict(mode=mode, num_rows=sum(rows), requests=sum(counts), groups=groups, group_rows=rows)


def describe(runtime: Any, forward_batch: Any, local: dict, outermost: bool, graph: bool) -> dict:
    """begin_step's arguments for a pass under DP attention, from its local description (mode,
    num_rows, requests). A nested forward context describes its outer one's pass: SGLang opens it
    after padding the batch, which changes the local view, not the gathered one; inside a graph
    (a capture, or a --debug-cuda-graph re-run of a replay) that pass is the graph's own batch,
    every group at the bucket its local view holds."""
    outer, groups = runtime.step, runtime.groups
    if not outermost and outer.groups:
        if graph:
            return dict(mode=outer.mode, num_rows=local["num_rows"] * groups, requests=local["requests"] * groups,
                        groups=groups, group_rows=())
        return dict(mode=outer.mode, num_rows=outer.num_rows, requests=outer.requests, groups=outer.groups,
                    group_rows=outer.group_rows)
    return gathered_step(forward_batch, local["mode"], runtime.routed_mode, groups, local["num_rows"])


def configure(scheduler: Any, runtime: Any) -> None:
    """At scheduler start: SGLang's decode-log interval (the idle ranks' export period), and under
    DP attention one line on what OEA routes."""
    global _report_every
    _report_every = int(getattr(scheduler.server_args, "decode_log_interval", 40) or 40)
    if runtime.groups:
        logger.info("sglang-oea rank %d: DP attention over %d attention-DP groups: every rank routes the batch gathered "
                    "from all of them (their real rows; an idle group's rank too), and --oea-min-batch / "
                    "--oea-max-batch count that whole batch", runtime.rank, runtime.groups)


def after_pass(runtime: Any, step: StepInfo, idle_here: bool) -> None:
    """After a gathered serving pass that counted as routed: the rank check when due, and the
    metrics export of a rank with no requests of its own, every decode-log interval. Every rank
    counts the same routed passes, so every rank runs the check's collective at the same pass."""
    from sglang_oea import metrics

    if step.graph or not step.routed:
        return
    done = runtime.routed_steps
    check, snapshot = runtime.rank_check, None
    if check is not None and check.due(done):
        snapshot = runtime.read_snapshot()
        if snapshot is not None:
            check.check(snapshot, done)  # not contained: a divergence must stop the server
    if idle_here and _report_every and done % _report_every == 0:
        with metrics.contained("the OEA metrics report"):
            metrics.report(runtime, snapshot if snapshot is not None else runtime.read_snapshot())
