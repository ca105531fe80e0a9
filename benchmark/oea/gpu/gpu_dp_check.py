"""Check 11 of benchmark/oea/gpu/gpu_check.py: the runtime path under DP attention, driven as SGLang
drives it (its warm-ups, graphs and layers as check 5, gpu_runtime_check.py).

Under DP attention (`--attn-dp-size 2`) every rank's router sees the gathered batch of both
attention-DP groups: group g owns slot g of the buffer, its real token rows first, then padding
that holds whatever memory held (NaN was seen in an idle group's rows). OEA must route the real
rows of every group as ONE batch and let the padding join nothing. Per scenario: an
OEARuntime(OEAConfig(k0, min_batch, max_batch), groups=2, slots=...) and the MoE layers of check 5
(GLM-5: 256 experts, top-8, sigmoid + correction bias, 8 groups / topk_group 4, a fused
shared-expert column; Qwen3-30B-A3B: 128 experts, softmax), static buffers of bucket x 2 groups
(x draft tokens in verify) rows.
  1. As DecodeCudaGraphRunner.capture_one_shape under DP attention, described as
     sglang_oea.dp_attention.gathered_step describes a capture pass: begin_step(mode, num_rows =
     bucket x 2 (x drafts), requests = bucket x 2, graph=True, groups=2, group_rows=()), two eager
     warm-ups, ONE torch.cuda.CUDAGraph over every layer's `runtime.route`, end_step(); nothing
     compiled in capture, no kernel variant first launched there (check 5's watches).
  2. Replays with per-group requests such as (bucket, bucket), (bucket, 0) (an idle group),
     (1, bucket - 2), (0, 3), and rows that close the gate (below min_batch, above max_batch),
     each as the hooks drive one: begin_step(mode, num_rows = sum of the groups' rows, requests =
     their sum, groups=2, group_rows=rows), set_replay_rows(this rank's rows) (the runtime writes
     every group's rows), fresh inputs copied into the static buffers with NaN logits and weights
     in every padded row of every slot, replay, note_replay(bucket), end_step(). Each layer's
     output on the real rows == route_from_logits over the real rows alone (one batch, in buffer
     order): ids exactly, weights to tolerance, the shared column passed through; the padded rows
     hold valid, distinct expert ids; a closed gate returns the router's inputs bit for bit. The
     padding is then rewritten with huge finite logits (experts that would take over the union if
     it counted) and the graph replayed again: the real rows must be the same bits.
  3. Eager gathered passes (graph=False), their slots as SGLang pads them (every slot the busiest
     group's count, or each its own), read through `slots`: the same comparison (a closed gate
     returns None: the router's own), then one more replay (an eager pass between replays must
     not disturb the graph's device state).
  4. The device counters == reference.distinct_experts over the real rows, summed over the open
     passes; the step accounting (applied / skipped by reason); runtime.routers.status().
Scenarios: the kernel with max_batch below 2 x bucket, the kernel with no cap, the torch path, the
kernel captured as the breakable backend does (a graph per layer, eager breaks between them: the
gathered order made in the first segment is read by the later ones), and a verify graph (rows per
request = draft tokens; the gate's floor counts requests, its cap rows).

Before the replays: the capture must not reuse a gathered order its warm-ups made eagerly (SGLang
runs the warm-ups and the capture in one outer forward context, so they share one pass): a graph
would read that tensor, frozen at the warm-up's group rows and freed when the pass ends.

On the CPU (the dry run, TRITON_INTERPRET=1) the same sequence runs on small GLM-5-shaped layers
without a graph: every "replay" re-runs the layers in the capture pass's description with
sglang_oea.runtime.is_capturing forced on (gpu_runtime_check.GraphCapture), starting from the pass
state as capture found it, so that what a real graph would reuse from the warm-ups is reused here too
(DPGraphCapture).
"""

import contextlib
import copy
import warnings
import zlib
from collections import Counter
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from gpu.gpu_cases import SEED
from gpu.gpu_runtime_check import (CPU_SHAPES, GPU_SHAPES, CompileWatch, GraphCapture, Layer, LaunchRecorder,
                                   MoEShape, counters_match, draw_inputs, forward, gate_open, make_layers,
                                   report_raised)
from sglang_oea.config import OEAConfig
from sglang_oea.reference import distinct_experts
from sglang_oea.routing import route_from_logits
from sglang_oea.runtime import DECODE, SKIP_ABOVE_MAX, SKIP_BELOW_MIN, VERIFY, OEARuntime

GROUPS = 2
HUGE_LOGIT = 1e30  # finite in bf16: padding whose experts would win every slot of the union if it counted

Rows = Tuple[int, ...]  # requests of each attention-DP group


@dataclass(frozen=True)
class DPScenario:
    name: str
    kernel: str  # OEAConfig.kernel
    k0: int
    max_batch: int  # token rows of the whole gathered batch (0: no cap)
    bucket: int  # requests of ONE group (SGLang picks the bucket of the busiest group)
    replays: Tuple[Rows, ...]  # each replay's requests per group, each <= bucket
    eager: Tuple[Tuple[Rows, Rows], ...]  # each eager pass's (requests per group, slot of each group)
    min_batch: int = 4  # requests of the whole gathered batch
    drafts: int = 1  # token rows per request: > 1 is a speculative verify graph
    segments: bool = False  # capture as --cuda-graph-backend-decode breakable does

    @property
    def mode(self) -> str:
        return VERIFY if self.drafts > 1 else DECODE


def dp_scenarios(use_graph: bool) -> Tuple[DPScenario, ...]:
    if use_graph:
        b = 32
        capped = DPScenario("DP kernel, max_batch 48 < 2 x bucket", "auto", 3, 48, b,
                            ((b, 16), (b, 0), (1, b - 2), (0, 3), (0, 4), (b, b), (2, 1), (17, 9)),
                            (((20, 7), (20, 20)), ((0, 6), (6, 6)), ((4, 9), (6, 10)), ((5, 9), (5, 9)),
                             ((2, 1), (2, 2))))
        return (capped,
                replace(capped, name="DP kernel, no cap", k0=4, max_batch=0,
                        replays=((b, b), (b, 0), (1, b - 2), (0, 3), (0, 4), (b - 1, b))),
                replace(capped, name="DP torch path, max_batch 48", kernel="torch"),
                replace(capped, name="DP kernel, breakable: a graph per layer", segments=True,
                        replays=((b, 16), (0, 3), (1, b - 2), (b, b)), eager=()),
                DPScenario("DP kernel, verify 4 drafts, max_batch 48 rows", "auto", 3, 48, 8,
                           ((8, 4), (8, 0), (1, 6), (0, 3), (0, 4), (8, 8), (2, 1)),
                           (((5, 3), (5, 5)), ((0, 4), (4, 4)), ((1, 1), (1, 1)))))
    # The interpreter is slow (~30 ms per row and launch): small shapes, a few passes. Eager slots as
    # SGLang pads them: every slot the busiest group's count (MAX_LEN), or each its own plus alignment.
    b = 4
    capped = DPScenario("DP kernel, max_batch 6 < 2 x bucket", "auto", 3, 6, b,
                        ((b, 2), (b, 0), (1, b - 2), (0, 3), (b, b), (1, 0)),
                        (((3, 1), (3, 3)), ((2, 1), (3, 2)), ((1, 0), (1, 1))), min_batch=2)
    return (capped, replace(capped, name="DP torch path, max_batch 6", kernel="torch"),
            DPScenario("DP kernel, verify 3 drafts, max_batch 9 rows", "auto", 3, 9, 2,
                       ((2, 1), (0, 2), (2, 2), (1, 0)), (((0, 2), (2, 2)),), min_batch=2, drafts=3))


def dp_shapes(use_graph: bool) -> Tuple[MoEShape, ...]:
    """Check 5's layers on a GPU; on the CPU its small GLM-5 shape alone (grouped, biased, shared column)."""
    return GPU_SHAPES if use_graph else CPU_SHAPES[:1]


def real_mask(rows: Sequence[int], slots: Sequence[int]) -> torch.Tensor:
    """[sum(slots)] bool (host): the real token rows of each group's slot, its first rows[g]."""
    mask = torch.zeros(sum(slots), dtype=torch.bool)
    start = 0
    for real, slot in zip(rows, slots):
        mask[start:start + real] = True
        start += slot
    return mask


def fill_gathered(layers: Sequence[Layer], mask: torch.Tensor, gen: torch.Generator) -> None:
    """Fresh router inputs into the layers' buffers: real rows drawn as the router gives them, every
    padded row's logits and weights NaN (an idle group's unwritten memory)."""
    pad = (~mask).nonzero().flatten()
    for layer in layers:
        logits, ids, weights = draw_inputs(layer.shape, layer.host_spec, layer.logits.shape[0], gen)
        logits[pad], weights[pad] = float("nan"), float("nan")
        for static, value in zip((layer.logits, layer.ids, layer.weights), (logits, ids, weights)):
            static.copy_(value)


def poison_padding(layers: Sequence[Layer], mask: torch.Tensor, gen: torch.Generator) -> None:
    """Rewrite every padded row's logits with huge finite values of random sign: experts that would
    outscore every real row's, and take over the union, if the padding counted."""
    pad = (~mask).nonzero().flatten()
    for layer in layers:
        huge = torch.randn(pad.numel(), layer.shape.experts, generator=gen) * HUGE_LOGIT
        layer.logits[pad.to(layer.logits.device)] = huge.to(layer.logits.dtype).to(layer.logits.device)


def with_rows(layers: Sequence[Layer], rows: int, gen: torch.Generator, device) -> List[Layer]:
    """The same layers (their TopKConfig, so the same routing slots) with input buffers of `rows`."""
    return [replace(layer, **dict(zip(("logits", "ids", "weights"), (
        t.to(device) for t in draw_inputs(layer.shape, layer.host_spec, rows, gen))))) for layer in layers]


class DPGraphCapture(GraphCapture):
    """GraphCapture whose CPU "replay" re-runs the layers in the capture pass's description under DP
    attention (the gathered bucket of every group, real rows known only on the device).

    A real graph replays only the device work recorded in capture: whatever the pass computed before
    capture (its warm-ups share the capture pass's PassTally) and the capture then reused is a
    static tensor, frozen at warm-up time. So each CPU replay starts from a copy of the tally as
    capture found it (`at_capture`), and reuses what the real graph would reuse. On a GPU the copy
    also keeps such tensors alive: a runtime that reused them then fails the comparison, rather than
    reading memory freed when the capture pass ended."""

    at_capture = None  # copy of the capture pass's PassTally when capture began

    def capture_pass(self, rt: OEARuntime, layers: Sequence[Layer], segments: bool):
        self.at_capture = copy.copy(rt.step.tally)
        return self.capture_segments(rt, layers) if segments else self.capture(lambda: forward(rt, layers))

    def replay(self, rt: OEARuntime, bucket: int, drafts: int = 1):
        if self.use_graph:
            return super().replay(rt, bucket, drafts)
        requests = bucket * GROUPS
        outer = rt.begin_step(rt.step.mode, requests * drafts, graph=True, outermost=False, requests=requests,
                              groups=GROUPS)
        rt.step.tally = copy.copy(self.at_capture)
        try:
            with self.capturing():
                return self.fn()
        finally:
            rt.step = outer


@contextlib.contextmanager
def gathered_pass(rt: OEARuntime, sc: DPScenario, requests: Optional[Rows], graph: bool = False):
    """An outermost forward context as sglang_oea.dp_attention.gathered_step describes it: a capture
    pass (requests None: every group at the bucket, group rows unknown) or a serving pass."""
    if requests is None:
        total = sc.bucket * GROUPS
        previous = rt.begin_step(sc.mode, total * sc.drafts, graph=graph, requests=total, groups=GROUPS)
    else:
        rows = tuple(r * sc.drafts for r in requests)
        previous = rt.begin_step(sc.mode, sum(rows), graph=graph, requests=sum(requests), groups=GROUPS,
                                 group_rows=rows)
    try:
        yield
        rt.end_step()
    finally:
        rt.step = previous


def check_dp_layer(layer: Layer, out, mask: torch.Tensor, sc: DPScenario, requests: int, eager: bool
                   ) -> Tuple[Optional[str], List[int]]:
    """(None or what is wrong, what the layer's counters should add: (1, T before, T after) if open).
    mask: [B] the buffer's real rows; the gate counts `requests` (floor) and the real rows (cap)."""
    where = f"layer {layer.layer_id} ({layer.shape.name})"
    ids, w = layer.ids.cpu(), layer.weights.cpu()
    if not gate_open(sc, requests):
        if out is None:
            return (None if eager else f"{where}: route returned None under capture (not routed)"), [0, 0, 0]
        same = torch.equal(out[0].cpu(), ids) and torch.equal(out[1].cpu().view(torch.int32), w.view(torch.int32))
        return (None if same else f"{where}: gate closed, yet the output is not the router's bit for bit"), [0, 0, 0]
    if out is None:
        return f"{where}: gate open, yet route returned None", [0, 0, 0]
    got_ids, got_w = out[0].cpu(), out[1].cpu()
    if got_ids.dtype != ids.dtype or got_w.dtype != w.dtype or got_ids.shape != ids.shape:
        return f"{where}: output {got_ids.dtype}/{got_w.dtype} {tuple(got_ids.shape)}", [0, 0, 0]
    K, N = layer.shape.top_k, layer.shape.experts
    real = mask.to(layer.logits.device)
    ref_ids, ref_w = route_from_logits(layer.logits[real], layer.ids[real, :K], layer.weights[real, :K], layer.spec,
                                       sc.k0)
    ref_ids, ref_w = ref_ids.cpu(), ref_w.cpu()
    added = [1, int(distinct_experts(ids[mask, :K], N)), int(distinct_experts(ref_ids, N))]
    mine_ids, mine_w = got_ids[mask, :K].long(), got_w[mask, :K]
    bad = (mine_ids != ref_ids).any(dim=1).nonzero().flatten()
    if bad.numel():
        r = int(bad[0])
        return (f"{where}: ids differ in {bad.numel()} real rows; real row {r}: runtime {mine_ids[r].tolist()} "
                f"reference {ref_ids[r].tolist()} router {ids[mask][r].tolist()}"), added
    if not torch.allclose(mine_w, ref_w, rtol=1e-5, atol=1e-6):
        return f"{where}: weights differ by up to {(mine_w - ref_w).abs().max().item():.3g}", added
    if not (torch.equal(got_ids[:, K:], ids[:, K:]) and torch.equal(got_w[:, K:].view(torch.int32),
                                                                    w[:, K:].view(torch.int32))):
        return f"{where}: the shared-expert column was not passed through", added
    padded = got_ids[~mask, :K].long()
    if padded.numel() and (padded.min() < 0 or padded.max() >= N
                           or (padded.sort(dim=1).values.diff(dim=1) == 0).any()):
        return f"{where}: a padded row holds invalid or repeated expert ids: {padded[0].tolist()}", added
    return None, added


def real_outputs(outputs: dict, mask: torch.Tensor) -> Dict[int, tuple]:
    return {k: (v[0][mask.to(v[0].device)].cpu(), v[1][mask.to(v[1].device)].cpu()) for k, v in outputs.items()
            if v is not None}


def same_bits(a: Dict[int, tuple], b: Dict[int, tuple]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k][0], b[k][0]) and torch.equal(a[k][1].view(torch.int32), b[k][1].view(torch.int32)) for k in a)


def capture_and_replay_dp(sc: DPScenario, shapes: Sequence[MoEShape], device, use_graph: bool,
                          watch: CompileWatch) -> Tuple[List[str], str]:
    """One scenario: (failures, its report row)."""
    failures: List[str] = []
    gen = torch.Generator().manual_seed(SEED + zlib.crc32(sc.name.encode()))
    slot = sc.bucket * sc.drafts
    layers = make_layers(shapes, slot * GROUPS, gen, device)
    eager_slots: List[Optional[List[int]]] = [None]  # what SGLang's get_dp_global_num_tokens() gives now
    rt = OEARuntime(OEAConfig(k0=sc.k0, min_batch=sc.min_batch, max_batch=sc.max_batch, kernel=sc.kernel),
                    speculative=sc.drafts > 1, groups=GROUPS, slots=lambda: eager_slots[0])
    graph = DPGraphCapture(use_graph, sc.segments)
    with LaunchRecorder() as recorder, gathered_pass(rt, sc, None, graph=True):
        with graph.warm_up_stream():
            for _ in range(2):
                forward(rt, layers)
        warm_order = getattr(rt.step.tally, "order", None)  # the gathered order, if the warm-ups left one
        mark = watch.mark()
        recorder.capturing = True
        graph.capture_pass(rt, layers, sc.segments)
        recorder.capturing = False
        compiles, growth = watch.since(mark)
        if warm_order is not None and getattr(rt.step.tally, "order", None) is warm_order:
            failures.append(f"{sc.name}: the capture reused the gathered order its warm-up made eagerly: the graph "
                            "reads a tensor made outside it (frozen at the warm-up's group rows, and freed when the "
                            "capture pass ends) instead of computing the order from each replay's group rows")
    fresh = recorder.launched[True] - recorder.launched[False]
    if compiles or growth:
        failures.append(f"{sc.name}: Triton compiled during capture (hook: {compiles}, cache growth: {growth})")
    if fresh:
        failures.append(f"{sc.name}: {len(fresh)} kernel variants first launched inside capture")
    if sc.kernel != "torch" and not recorder.launched[True]:
        failures.append(f"{sc.name}: no kernel was launched inside capture")
    if rt.captured != {(sc.mode, sc.bucket, sc.drafts): None}:
        failures.append(f"{sc.name}: the capture pass recorded {rt.captured}, expected a routed bucket {sc.bucket}")
    counters_mark = rt.counters.snapshot_now()  # warm-ups and capture counted with whatever rows the device held

    want_sums = {layer.layer_id: [0, 0, 0] for layer in layers}
    passes: List[int] = []  # requests of every serving pass, in order

    def record(name: str, requests: int, routed: Sequence[Layer], outputs: dict, mask: torch.Tensor, eager: bool,
               ) -> Tuple[bool, Dict[int, List[int]]]:
        """Check one pass's layers; count the pass and what each layer's counters should add."""
        errors, added = [], {}
        for layer in routed:
            err, added[layer.layer_id] = check_dp_layer(layer, outputs.get(layer.layer_id), mask, sc, requests, eager)
            errors += [err] * (err is not None)
        failures.extend(f"{sc.name}, {name}: {e}" for e in errors)
        count(requests, added)
        return not errors, added

    def count(requests: int, added: Dict[int, List[int]]) -> None:
        passes.append(requests)
        for lid, values in added.items():
            want_sums[lid] = [a + b for a, b in zip(want_sums[lid], values)]

    def replay_pass(requests: Rows) -> dict:
        """One replay as the hooks drive it; the inputs already in the static buffers."""
        with gathered_pass(rt, sc, requests):
            rt.set_replay_rows(requests[0] * sc.drafts)  # the hook passes this rank's own rows
            outputs = graph.replay(rt, sc.bucket, sc.drafts)
            rt.note_replay(sc.bucket)
        return outputs

    def replay(requests: Rows) -> str:
        mask = real_mask([r * sc.drafts for r in requests], [slot] * GROUPS)
        fill_gathered(layers, mask, gen)
        name = f"replay {requests}"
        outputs = replay_pass(requests)
        device_rows = (int(rt.device.rows), rt.device.group_rows.tolist())
        ok, added = record(name, sum(requests), layers, outputs, mask, eager=False)
        if device_rows != (sum(requests) * sc.drafts, [r * sc.drafts for r in requests]):
            failures.append(f"{sc.name}, {name}: the device holds (rows, group rows) {device_rows}")
            ok = False
        if gate_open(sc, sum(requests)) and ok and mask.sum() < mask.numel():
            # The same real rows, the padding now huge finite logits: not a bit of a real row may move.
            first = real_outputs(outputs, mask)
            poison_padding(layers, mask, gen)
            again = real_outputs(replay_pass(requests), mask)
            count(sum(requests), added)  # the same real rows: the same counts again
            if not same_bits(first, again):
                failures.append(f"{sc.name}, {name}: the real rows changed with the padding's contents")
                ok = False
        closed = "" if gate_open(sc, sum(requests)) else "(closed)"
        return f"{'+'.join(map(str, requests))}:{'ok' if ok else 'FAIL'}{closed}"

    results = [replay(requests) for requests in sc.replays]
    eager_results = []
    for requests, slots in sc.eager:
        rows, slot_rows = [r * sc.drafts for r in requests], [s * sc.drafts for s in slots]
        mask = real_mask(rows, slot_rows)
        eager_layers = with_rows(layers, sum(slot_rows), gen, device)
        fill_gathered(eager_layers, mask, gen)
        eager_slots[0] = slot_rows
        with gathered_pass(rt, sc, requests):
            outputs = forward(rt, eager_layers)
        eager_slots[0] = None
        ok, _ = record(f"eager {requests} in slots {slots}", sum(requests), eager_layers, outputs, mask, eager=True)
        closed = "" if gate_open(sc, sum(requests)) else "(closed)"
        eager_results.append(f"{'+'.join(map(str, requests))}/{'+'.join(map(str, slots))}:{'ok' if ok else 'FAIL'}"
                             f"{closed}")
    if sc.eager:  # an eager pass between replays must not disturb the graph's device state
        results.append("then " + replay(sc.replays[0]))

    stats_ok = counters_match(rt, counters_mark, want_sums, sc.name, failures)
    want_skips = Counter(SKIP_BELOW_MIN if req < sc.min_batch else SKIP_ABOVE_MAX
                         for req in passes if not gate_open(sc, req))
    opened = sum(gate_open(sc, req) for req in passes)
    counted = (rt.steps_of(sc.mode), rt.applied_steps, dict(rt.skipped_steps))
    accounting_ok = counted == (len(passes), opened, dict(want_skips))
    if not accounting_ok:
        failures.append(f"{sc.name}: ({sc.mode} steps, applied, skipped) = {counted}, expected "
                        f"{(len(passes), opened, dict(want_skips))}")
    want_status = {("torch", "not_run") if sc.kernel == "torch" else ("triton", "passed"): len(shapes)}
    if rt.routers.status() != want_status:
        failures.append(f"{sc.name}: routers.status() = {rt.routers.status()}, expected {want_status}")
    hook = "-" if compiles is None else str(compiles)
    cache = "-" if growth is None else f"+{growth}"
    row = (f"| {sc.name} | {sc.kernel}, k0={sc.k0}, gate {sc.min_batch}..{sc.max_batch or 'no cap'}, bucket "
           f"{sc.bucket} x {GROUPS} groups{f' x {sc.drafts} drafts' if sc.drafts > 1 else ''} | {hook} / {cache} | "
           f"{len(recorder.launched[False])} / {len(recorder.launched[True])} ({len(fresh)} new) | "
           f"{' '.join(results)} | {' '.join(eager_results) or '-'} | "
           f"{'ok' if stats_ok else 'FAIL'}, {'ok' if accounting_ok else 'FAIL'} |")
    return failures, row


def check_dp_attention(device, use_graph: bool) -> Tuple[List[str], List[str]]:
    """Check 11 (use_graph=False: the CPU stand-in). Returns (failures, report lines); a scenario that
    raises (a GraphCaptureError included) is a failure, reported with its traceback."""
    shapes = dp_shapes(use_graph)
    failures, extra = [], []
    lines = [
        f"{GROUPS} attention-DP groups; layers: " + ", ".join(f"{s.name} {s.experts} experts top-{s.top_k} (layers "
                                                               f"{', '.join(map(str, s.layers))})" for s in shapes)
        + ". Padded rows: NaN logits and weights, then huge finite logits (the real rows must keep their bits).",
        "",
        "| scenario | config | compiles in capture (hook / cache) | variants launched: warm-up / capture "
        "| replays (requests per group: result) | eager passes (requests / slots: result) | counters, accounting |",
        "|---|---|---|---|---|---|---|",
    ]
    with CompileWatch() as watch, warnings.catch_warnings():
        # The interpreter's numpy warns where a huge padded logit overflows exp() to inf, which a
        # GPU's expf does silently (the sigmoid is then 0 or 1, as it should be).
        warnings.filterwarnings("ignore", message="overflow encountered", category=RuntimeWarning)
        for sc in dp_scenarios(use_graph):
            try:
                errors, row = capture_and_replay_dp(sc, shapes, device, use_graph, watch)
            except Exception as e:
                report_raised(sc.name, e, failures, lines, extra)
                continue
            failures += errors
            lines.append(row)
    lines += [""] + extra + [f"- FAIL: {f}" for f in failures]
    return failures, lines
