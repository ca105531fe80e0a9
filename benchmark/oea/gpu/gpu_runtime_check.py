"""Check 5 of benchmark/oea/gpu/gpu_check.py: the real runtime path, driven as SGLang drives it (check 6,
its timing, is in gpu_timing.py and uses the layers made here; check 11, the same under DP attention,
is in gpu_dp_check.py).

Check 5 (correctness). Per scenario: an OEARuntime(OEAConfig(k0, min_batch=4, max_batch=M)) and
MoE layers of two model shapes, each layer with its own SimpleNamespace TopKConfig (as
test/srt/test_graph_path.py) and static input buffers: bf16 router logits, int32 ids, fp32 weights.
  GLM-5:          256 experts, top-8, sigmoid + correction bias, 8 groups / topk_group 4, one fused
                  shared-expert column (top_k 9, num_shared_topk_slots 1); layers 3, 4, 5
  Qwen3-30B-A3B:  128 experts, top-8, softmax; layers 10, 11, 12
(counter rows are padded to 32 bytes, so every layer's row is 16-byte aligned: one kernel variant).
  1. As DecodeCudaGraphRunner.capture_one_shape: a capture-mode step begin_step(DECODE, bucket,
     graph=True), two eager warm-up forwards over all layers, then ONE torch.cuda.CUDAGraph captured
     at the bucket over every layer's `runtime.route`, end_step(). The first warm-up runs the
     startup self-check (its wall time and compiles are reported).
  2. Nothing may be compiled during capture: Triton compiles counted with
     triton.knobs.runtime.jit_post_compile_hook (when this triton has it) and by the growth of the
     two kernels' per-device JIT caches; every kernel variant launched in capture must have been
     launched by a warm-up; no GraphCaptureError.
  3. Replays with several real row counts (full, bucket - 3, mid, the gate bounds, and rows that
     close the gate below min_batch / above max_batch): fresh router inputs copied into the static
     buffers, begin_step(DECODE, n), set_replay_rows(n), replay, note_replay(bucket), end_step().
     Each layer's output == route_from_logits with num_valid_rows = n (ids exactly, weights to
     tolerance, the shared column passed through); a closed gate returns the router's inputs bit
     for bit. Then the device counters == reference.distinct_experts summed over the open replays,
     the step accounting (applied / skipped), and runtime.routers.status() (the triton kernel with
     a passing self-check; the torch scenario: torch, not run).
Scenarios: the kernel with max_batch below the bucket (run first, in a process that has launched no
kernel of these shapes yet: the warm-ups run with the gate closed and must still compile everything
the capture launches), the kernel with no cap, the torch path (OEAConfig(kernel="torch")), the
breakable backend's capture (one graph per layer in a shared pool, eager breaks between them,
GraphCapture.capture_segments), and a
speculative verify graph: begin_step(VERIFY, requests x drafts rows, requests=...), the bucket and
the replays counted in requests, every draft token a row, the gate's floor on requests and its cap
on token rows.

On the CPU (the dry run, TRITON_INTERPRET=1) check 5 runs the same sequence on small shapes without
a graph: the "captured" forward and every "replay" re-run the layers with
sglang_oea.runtime.is_capturing forced on, as test/srt/test_graph_path.py does.
"""

import contextlib
import time
import traceback
import zlib
from collections import Counter
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from gpu.gpu_cases import SEED, kernels
from sglang_oea import runtime as runtime_module
from sglang_oea.config import OEAConfig
from sglang_oea.counters import stats_between
from sglang_oea.reference import distinct_experts
from sglang_oea.routing import RouterSpec, route_from_logits, score_experts
from sglang_oea.runtime import DECODE, SKIP_ABOVE_MAX, SKIP_BELOW_MIN, VERIFY, OEARuntime

ROUTED_SCALING = 2.5  # the router's weights are renormalised, then scaled (GLM / DeepSeek style)


@dataclass(frozen=True)
class MoEShape:
    name: str
    experts: int
    top_k: int
    layers: Tuple[int, ...]
    shared: int = 0  # fused shared-expert columns after the routed ones
    grouped: bool = False  # sigmoid + correction bias, grouped top-k (DeepSeek-V3 / GLM style)
    groups: int = 1
    topk_group: int = 1


GLM5 = MoEShape("GLM-5", 256, 8, layers=(3, 4, 5), shared=1, grouped=True, groups=8, topk_group=4)
QWEN3_30B = MoEShape("Qwen3-30B-A3B", 128, 8, layers=(10, 11, 12))
GPU_SHAPES = (GLM5, QWEN3_30B)
CPU_SHAPES = (replace(GLM5, experts=64, layers=(3, 4)), replace(QWEN3_30B, experts=32, top_k=4, layers=(10,)))


@dataclass(frozen=True)
class Scenario:
    name: str
    kernel: str  # OEAConfig.kernel
    k0: int
    max_batch: int
    bucket: int
    rows: Tuple[int, ...]  # real rows of the replays (requests, for a verify scenario)
    min_batch: int = 4
    drafts: int = 1  # token rows per request: > 1 is a speculative verify graph
    segments: bool = False  # capture as --cuda-graph-backend-decode breakable does (GraphCapture)

    @property
    def mode(self) -> str:
        return VERIFY if self.drafts > 1 else DECODE


def scenarios(use_graph: bool) -> Tuple[Scenario, ...]:
    if use_graph:
        capped = Scenario("kernel, max_batch 48 < bucket", "auto", 3, 48, 64, (64, 61, 48, 23, 4, 2))
        return (capped, Scenario("kernel, no cap", "auto", 4, 0, 64, (64, 61, 23, 5, 3)),
                replace(capped, name="torch path, max_batch 48", kernel="torch"),
                replace(capped, name="kernel, breakable: a graph per layer, eager breaks between", segments=True),
                Scenario("kernel, verify 4 drafts, max_batch 48 rows < bucket", "auto", 3, 48, 16,
                         (16, 13, 12, 5, 4, 3, 1), drafts=4))
    # The interpreter is slow (~30 ms per row and launch): one kernel scenario, small shapes.
    capped = Scenario("kernel, max_batch 8 < bucket", "auto", 3, 8, 12, (12, 9, 8, 4, 2))
    return (capped, replace(capped, name="torch path, max_batch 8", kernel="torch"),
            Scenario("kernel, verify 3 drafts, max_batch 6 rows < bucket", "auto", 3, 6, 3, (3, 2, 1), min_batch=2,
                     drafts=3))


@dataclass
class Layer:
    """One MoE layer: its TopKConfig, the reference's RouterSpec and the static input buffers."""

    shape: MoEShape
    layer_id: int
    config: SimpleNamespace
    spec: RouterSpec  # on the device, written out independently of runtime.router_spec_of
    host_spec: RouterSpec  # the same on the CPU, to draw inputs
    logits: torch.Tensor  # [B, N] bf16
    ids: torch.Tensor  # [B, K + shared] int32
    weights: torch.Tensor  # [B, K + shared] fp32

    def route(self, rt: OEARuntime):
        return rt.route(self.ids, self.weights, self.config, self.logits, self.layer_id)


def top_groups_only(selection: torch.Tensor, shape: MoEShape) -> torch.Tensor:
    """SGLang's grouped top-k: -inf outside the topk_group groups with the best sum of two scores."""
    rows, group_size = selection.shape[0], shape.experts // shape.groups
    group_scores = selection.view(rows, shape.groups, group_size).topk(2, dim=-1).values.sum(dim=-1)
    keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(shape.topk_group, dim=-1).indices, 1.0)
    return selection.masked_fill(keep.repeat_interleave(group_size, dim=1) == 0, float("-inf"))


def plain_routing(logits: torch.Tensor, shape: MoEShape, bias: Optional[torch.Tensor]):
    """What the router itself does (torch ops): scores, top-k, renormalised weights."""
    scores = logits.float()
    if shape.grouped:
        weight = scores.sigmoid()
        ids = top_groups_only(weight + bias, shape).topk(shape.top_k, dim=-1).indices
    else:
        weight = scores.softmax(dim=-1)
        ids = weight.topk(shape.top_k, dim=-1).indices
    picked = weight.gather(1, ids)
    return ids, picked / picked.sum(dim=-1, keepdim=True)


def draw_inputs(shape: MoEShape, host_spec: RouterSpec, rows: int, gen: torch.Generator):
    """Router logits and the router's output for them, columns shuffled per row, plus the fused
    shared-expert columns (id N, random weight): what SGLang hands the routing hook (CPU)."""
    logits = (torch.randn(rows, shape.experts, generator=gen) * 2).to(torch.bfloat16)
    selection, weight = score_experts(logits, host_spec)
    if shape.grouped:
        selection = top_groups_only(selection, shape)
    ids = selection.topk(shape.top_k, dim=-1).indices
    ids = ids.gather(1, torch.rand(rows, shape.top_k, generator=gen).argsort(dim=1))
    picked = weight.gather(1, ids)
    picked = picked / picked.sum(dim=1, keepdim=True) * ROUTED_SCALING
    ids = torch.cat([ids, torch.full((rows, shape.shared), shape.experts, dtype=ids.dtype)], dim=1)
    picked = torch.cat([picked, torch.rand(rows, shape.shared, generator=gen)], dim=1)
    return logits, ids.to(torch.int32).contiguous(), picked.float().contiguous()


def topk_config(shape: MoEShape, bias: Optional[torch.Tensor]) -> SimpleNamespace:
    """The attributes of SGLang's TopKConfig that the runtime reads."""
    return SimpleNamespace(
        top_k=shape.top_k + shape.shared, num_shared_topk_slots=shape.shared, allow_routed_experts_capture=True,
        scoring_func="sigmoid" if shape.grouped else "softmax", correction_bias=bias,
        num_expert_group=shape.groups if shape.grouped else None,
        topk_group=shape.topk_group if shape.grouped else None, use_grouped_topk=shape.grouped,
        custom_routing_function=None, renormalize=True,
    )


def make_layers(shapes: Sequence[MoEShape], rows: int, gen: torch.Generator, device) -> List[Layer]:
    layers = []
    for shape in shapes:
        for layer_id in shape.layers:
            bias = torch.randn(shape.experts, generator=gen) * 0.1 if shape.grouped else None
            host_spec = RouterSpec("sigmoid", bias, shape.groups, True) if shape.grouped else RouterSpec("softmax")
            on_device = None if bias is None else bias.to(device)
            spec = replace(host_spec, correction_bias=on_device)
            logits, ids, weights = (t.to(device) for t in draw_inputs(shape, host_spec, rows, gen))
            layers.append(Layer(shape, layer_id, topk_config(shape, on_device), spec, host_spec, logits, ids, weights))
    return layers


def refill(layers: Sequence[Layer], gen: torch.Generator) -> None:
    """Fresh router inputs, copied into the static buffers a captured graph reads."""
    for layer in layers:
        fresh = draw_inputs(layer.shape, layer.host_spec, layer.logits.shape[0], gen)
        for static, value in zip((layer.logits, layer.ids, layer.weights), fresh):
            static.copy_(value)


def forward(rt: OEARuntime, layers: Sequence[Layer]) -> Dict[int, Optional[tuple]]:
    """One forward pass over the MoE layers: {layer id: the route's (ids, weights), or None}."""
    return {layer.layer_id: layer.route(rt) for layer in layers}


@contextlib.contextmanager
def forward_step(rt: OEARuntime, rows: int, graph: bool = False, drafts: int = 1):
    """An outermost forward context, as the forward-context hook opens and closes it: a decode step of
    `rows` requests, or with drafts > 1 a verify step of `rows` requests x `drafts` token rows."""
    mode = VERIFY if drafts > 1 else DECODE
    previous = rt.begin_step(mode, rows * drafts, graph=graph, requests=rows)
    try:
        yield
        rt.end_step()
    finally:
        rt.step = previous


# ------------------------------------------------------------------------------------------------
# Watching compiles and launches
# ------------------------------------------------------------------------------------------------


class CompileWatch:
    """Counts Triton JIT compiles (in-memory kernel-cache misses: a compile, or a load from the disk
    cache) of any kernel with triton.knobs.runtime.jit_post_compile_hook (chained to a hook already
    set), and the growth of the OEA kernels' per-device JIT caches. Neither exists in the
    interpreter, which compiles nothing."""

    def __init__(self):
        import triton

        from sglang_oea.kernels import interpret_mode

        self.interpreted = interpret_mode()
        self.knobs = None if self.interpreted else getattr(getattr(triton, "knobs", None), "runtime", None)
        self.hooked = False
        self.events: List[str] = []
        module = kernels()
        self.functions = (module._oea_union_kernel, module._oea_route_kernel)

    def __enter__(self):
        if self.knobs is not None and hasattr(self.knobs, "jit_post_compile_hook"):
            self.previous = self.knobs.jit_post_compile_hook

            def hook(*args, **kwargs):
                self.events.append(str(getattr(kwargs.get("fn"), "name", None) or kwargs.get("repr", "?"))[:60])
                return self.previous(*args, **kwargs) if self.previous is not None else None

            self.knobs.jit_post_compile_hook = hook
            self.hooked = True
        return self

    def __exit__(self, *exc):
        if self.hooked:
            self.knobs.jit_post_compile_hook = self.previous
            self.hooked = False

    def cache_size(self) -> Optional[int]:
        """Compiled variants in the OEA kernels' per-device caches (None: no such cache here)."""
        try:
            return sum(len(entry[0]) for fn in self.functions for entry in list(fn.device_caches.values()))
        except Exception:
            return None

    def mark(self) -> Tuple[int, Optional[int]]:
        return len(self.events), self.cache_size()

    def since(self, mark: Tuple[int, Optional[int]]) -> Tuple[Optional[int], Optional[int]]:
        """(compiles seen by the hook, cache growth) since `mark`; None where not measurable."""
        size = self.cache_size()
        growth = None if size is None or mark[1] is None else size - mark[1]
        return (len(self.events) - mark[0] if self.hooked else None), growth

    def method(self) -> str:
        methods = ["triton.knobs.runtime.jit_post_compile_hook"] * self.hooked
        methods += ["growth of the kernels' per-device JIT caches (device_caches)"] * (self.cache_size() is not None)
        if self.interpreted:
            return "none: the interpreter compiles nothing (the launched-variant check stands in)"
        return " and ".join(methods) or "none available in this triton (the launched-variant check only)"


class LaunchRecorder:
    """Records the variant of every KernelLaunch.run(), apart for warm-up and capture, and keeps the
    compiled kernel of each warm-up variant (its registers and spills once loaded)."""

    def __init__(self):
        self.module = kernels()
        self.capturing = False
        self.launched: Dict[bool, set] = {False: set(), True: set()}
        self.compiled: Dict[tuple, object] = {}

    def __enter__(self):
        self.original = original = self.module.KernelLaunch.run

        def run(launch):
            compiled = original(launch)
            key = launch.variant()
            self.launched[self.capturing].add(key)
            if not self.capturing:
                self.compiled.setdefault(key, compiled)
            return compiled

        self.module.KernelLaunch.run = run
        return self

    def __exit__(self, *exc):
        self.module.KernelLaunch.run = self.original


def regs_spills(compiled) -> str:
    """'regs/spills' of a Triton CompiledKernel that has been launched (loaded on the device)."""
    return f"{getattr(compiled, 'n_regs', '?')}/{getattr(compiled, 'n_spills', '?')}"


class GraphCapture:
    """The captured forward: a real CUDA graph (use_graph), or on the CPU the forward re-run on each
    "replay" with sglang_oea.runtime.is_capturing forced on (test/srt/test_graph_path.py).

    segments: capture as SGLang's breakable backend (`--cuda-graph-backend-decode breakable`) does
    where a model's forward has graph breaks: the forward split into several graphs captured one
    after another into one memory pool, with eager work between them, replayed in order with that
    work re-run eagerly. Here each MoE layer's routing is its own segment, and the eager "break"
    between segments writes the next layer's logits buffer again (as a break's output feeds the
    next segment), so every segment must read the device row count and control block itself."""

    def __init__(self, use_graph: bool, segments: bool = False):
        self.use_graph, self.segments = use_graph, segments
        self.stream = torch.cuda.Stream() if use_graph else None
        self.graph = torch.cuda.CUDAGraph() if use_graph else None
        self.parts: List[Tuple["torch.cuda.CUDAGraph", Callable]] = []  # (segment, eager break after it)
        self.fn: Optional[Callable] = None
        self.outputs = None

    @contextlib.contextmanager
    def warm_up_stream(self):
        """Where the eager warm-ups run: the capture stream (SGLang's graph_capture() stream)."""
        if not self.use_graph:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            yield
        torch.cuda.current_stream().wait_stream(self.stream)
        torch.cuda.synchronize()

    @contextlib.contextmanager
    def capturing(self):
        if self.use_graph:
            with torch.cuda.graph(self.graph, stream=self.stream):
                yield
            torch.cuda.synchronize()
            return
        original = runtime_module.is_capturing
        runtime_module.is_capturing = lambda tensor: True
        try:
            yield
        finally:
            runtime_module.is_capturing = original

    def capture(self, fn: Callable):
        self.fn = fn
        with self.capturing():
            self.outputs = fn()
        return self.outputs

    def capture_segments(self, rt: OEARuntime, layers: Sequence["Layer"]):
        """Breakable capture: one graph per layer's routing in a shared pool, an eager break after each."""
        if not self.use_graph:
            return self.capture(lambda: forward(rt, layers))
        pool, self.outputs = torch.cuda.graph_pool_handle(), {}
        for layer in layers:
            segment = torch.cuda.CUDAGraph()
            with torch.cuda.graph(segment, pool=pool, stream=self.stream):
                self.outputs[layer.layer_id] = layer.route(rt)
            self.parts.append((segment, lambda layer=layer: layer.logits.mul_(1)))
            self.parts[-1][1]()  # the break also runs once at capture, eagerly
        torch.cuda.synchronize()
        return self.outputs

    def replay(self, rt: OEARuntime, bucket: int, drafts: int = 1):
        """Inside the replay's forward context: on the CPU the captured Python path runs again in the
        bucket's graph context, as the graph would replay it."""
        if self.use_graph and self.parts:
            for segment, eager_break in self.parts:
                segment.replay()
                eager_break()
            torch.cuda.synchronize()
            return self.outputs
        if self.use_graph:
            self.graph.replay()
            torch.cuda.synchronize()
            return self.outputs
        outer = rt.begin_step(rt.step.mode, bucket * drafts, graph=True, outermost=False, requests=bucket)
        try:
            with self.capturing():
                return self.fn()
        finally:
            rt.step = outer


# ------------------------------------------------------------------------------------------------
# Check 5
# ------------------------------------------------------------------------------------------------


def gate_open(sc: Scenario, requests: int) -> bool:
    """The gate's floor counts requests, its cap token rows (requests x drafts)."""
    return requests >= sc.min_batch and (sc.max_batch == 0 or requests * sc.drafts <= sc.max_batch)


def verify_layer(layer: Layer, out, requests: int, sc: Scenario) -> Tuple[Optional[str], List[int]]:
    """(None or what is wrong, what the layer's counters should add: (1, T before, T after) if open).
    The gate's floor counts requests, its cap rows; the union and the counters are over the requests x
    drafts rows."""
    rows = requests * sc.drafts
    where = f"layer {layer.layer_id} ({layer.shape.name}) rows={rows}"
    if out is None:
        return f"{where}: route returned None under capture (not routed)", [0, 0, 0]
    got_ids, got_w = out[0].cpu(), out[1].cpu()
    ids, w = layer.ids.cpu(), layer.weights.cpu()
    if got_ids.dtype != ids.dtype or got_w.dtype != w.dtype or got_ids.shape != ids.shape:
        return f"{where}: output {got_ids.dtype}/{got_w.dtype} {tuple(got_ids.shape)}", [0, 0, 0]
    if not gate_open(sc, requests):
        same = torch.equal(got_ids, ids) and torch.equal(got_w.view(torch.int32), w.view(torch.int32))
        return (None if same else f"{where}: gate closed, yet the output is not the router's bit for bit"), [0, 0, 0]
    K, N = layer.shape.top_k, layer.shape.experts
    ref_ids, ref_w = route_from_logits(layer.logits, layer.ids[:, :K], layer.weights[:, :K], layer.spec, sc.k0, rows)
    ref_ids, ref_w = ref_ids.cpu(), ref_w.cpu()
    added = [1, int(distinct_experts(ids[:, :K], N, rows)), int(distinct_experts(ref_ids, N, rows))]
    bad = (got_ids[:, :K].long() != ref_ids).any(dim=1).nonzero().flatten()
    if bad.numel():
        r = int(bad[0])
        return (f"{where}: ids differ in {bad.numel()} rows; row {r}: runtime {got_ids[r].tolist()} reference "
                f"{ref_ids[r].tolist()} router {ids[r].tolist()}"), added
    if not torch.allclose(got_w[:, :K], ref_w, rtol=1e-5, atol=1e-6):
        return f"{where}: weights differ by up to {(got_w[:, :K] - ref_w).abs().max().item():.3g}", added
    if not (torch.equal(got_ids[:, K:], ids[:, K:]) and torch.equal(got_w[:, K:], w[:, K:])):
        return f"{where}: the shared-expert column was not passed through", added
    return None, added


def time_self_checks(rt: OEARuntime, watch: CompileWatch) -> List[str]:
    """Wrap the runtime's per-shape self-check: its wall time and the compiles it caused."""
    records = []
    check_here = rt.routers.check_here

    def timed(shape, spec, device):
        mark, start = watch.mark(), time.perf_counter()
        try:
            return check_here(shape, spec, device)
        finally:
            compiles = watch.since(mark)[0]
            records.append(f"{shape.describe()}: {time.perf_counter() - start:.2f} s"
                           + ("" if compiles is None else f", {compiles} compiles"))

    rt.routers.check_here = timed
    return records


def capture_and_replay(sc: Scenario, shapes: Sequence[MoEShape], device, use_graph: bool,
                       watch: CompileWatch) -> Tuple[List[str], str, Dict[tuple, object]]:
    """One scenario: (failures, its report row, {kernel variant: compiled kernel} of its warm-ups)."""
    failures = []
    gen = torch.Generator().manual_seed(SEED + zlib.crc32(sc.name.encode()))
    layers = make_layers(shapes, sc.bucket * sc.drafts, gen, device)
    rt = OEARuntime(OEAConfig(k0=sc.k0, min_batch=sc.min_batch, max_batch=sc.max_batch, kernel=sc.kernel),
                    speculative=sc.drafts > 1)
    self_checks = time_self_checks(rt, watch)
    graph = GraphCapture(use_graph, sc.segments)
    with LaunchRecorder() as recorder, forward_step(rt, sc.bucket, graph=True, drafts=sc.drafts):
        with graph.warm_up_stream():
            for _ in range(2):
                forward(rt, layers)
        mark = watch.mark()
        recorder.capturing = True
        if sc.segments:
            graph.capture_segments(rt, layers)
        else:
            graph.capture(lambda: forward(rt, layers))
        recorder.capturing = False
        compiles, growth = watch.since(mark)
    fresh = recorder.launched[True] - recorder.launched[False]
    if compiles or growth:
        failures.append(f"{sc.name}: Triton compiled during capture (hook: {compiles}, cache growth: {growth}): "
                        f"{watch.events[-3:]}")
    if fresh:
        failures.append(f"{sc.name}: {len(fresh)} kernel variants first launched inside capture")
    if sc.kernel != "torch" and not recorder.launched[True]:
        failures.append(f"{sc.name}: no kernel was launched inside capture")
    want_status = {("torch", "not_run") if sc.kernel == "torch" else ("triton", "passed"): len(shapes)}
    if rt.routers.status() != want_status:
        failures.append(f"{sc.name}: routers.status() = {rt.routers.status()}, expected {want_status}")
    mark = rt.counters.snapshot_now()  # the warm-ups and the capture counted with whatever rows the device held

    want_sums = {layer.layer_id: [0, 0, 0] for layer in layers}
    results = []
    for rows in sc.rows:
        refill(layers, gen)
        with forward_step(rt, rows, drafts=sc.drafts):
            rt.set_replay_rows(rows * sc.drafts)
            outputs = graph.replay(rt, sc.bucket, sc.drafts)
            rt.note_replay(sc.bucket)
        errors = []
        for layer in layers:
            err, added = verify_layer(layer, outputs.get(layer.layer_id), rows, sc)
            want_sums[layer.layer_id] = [a + b for a, b in zip(want_sums[layer.layer_id], added)]
            errors += [err] * (err is not None)
        failures += [f"{sc.name}: {e}" for e in errors]
        results.append(f"{rows}:{'ok' if not errors else 'FAIL'}{'' if gate_open(sc, rows) else '(closed)'}")

    stats_ok = counters_match(rt, mark, want_sums, sc.name, failures)
    opened = sum(gate_open(sc, rows) for rows in sc.rows)
    want_skips = Counter(SKIP_BELOW_MIN if rows < sc.min_batch else SKIP_ABOVE_MAX
                         for rows in sc.rows if not gate_open(sc, rows))
    counted = (rt.steps_of(sc.mode), rt.applied_steps, dict(rt.skipped_steps))
    accounting_ok = counted == (len(sc.rows), opened, dict(want_skips))
    if not accounting_ok:
        failures.append(f"{sc.name}: ({sc.mode} steps, applied, skipped) = {counted}, expected "
                        f"{(len(sc.rows), opened, dict(want_skips))}")
    hook = "-" if compiles is None else str(compiles)
    cache = "-" if growth is None else f"+{growth}"
    row = (f"| {sc.name} | {sc.kernel}, k0={sc.k0}, gate {sc.min_batch}..{sc.max_batch or 'no cap'}, bucket "
           f"{sc.bucket}{f' x {sc.drafts} drafts' if sc.drafts > 1 else ''} | {'; '.join(self_checks) or '-'} | {hook} / {cache} | "
           f"{len(recorder.launched[False])} / {len(recorder.launched[True])} ({len(fresh)} new) | "
           f"{' '.join(results)} | {'ok' if stats_ok else 'FAIL'}, {'ok' if accounting_ok else 'FAIL'} |")
    return failures, row, recorder.compiled



def counters_match(rt: OEARuntime, mark, want_sums: Dict[int, List[int]], name: str, failures: List[str]) -> bool:
    """Whether the device expert counters since the snapshot `mark` equal want_sums (layer id ->
    [steps, T before, T after], layers that never applied left out); a failure line when not."""
    drained = stats_between(rt.counters.snapshot_now(), mark)
    got_sums = {} if drained is None else {int(r[3]): [int(v) for v in r[:3].tolist()] for r in drained}
    want_sums = {k: v for k, v in want_sums.items() if v[0]}
    if got_sums != want_sums:
        failures.append(f"{name}: expert counters {got_sums}, expected {want_sums}")
    return got_sums == want_sums

def report_raised(name: str, exc: Exception, failures: list, lines: list, extra: list) -> None:
    """A scenario that raised: its traceback printed and kept below the table, one failure line and
    one table row (7 columns) naming it; the next scenario still runs."""
    tb = traceback.format_exc()
    print(tb)
    failures.append(f"{name}: raised {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}")
    lines.append(f"| {name} | raised {type(exc).__name__} (traceback below) | | | | | |")
    extra += [f"'{name}' raised:", "", "```", tb.strip(), "```", ""]

def check_runtime_path(device, use_graph: bool) -> Tuple[List[str], List[str]]:
    """Check 5 (use_graph=False: the CPU stand-in). Returns (failures, report lines); a scenario that
    raises (a GraphCaptureError included) is a failure, reported with its traceback."""
    shapes = GPU_SHAPES if use_graph else CPU_SHAPES
    failures, lines, extra, compiled = [], [], [], {}
    lines += [
        "Layers: " + "; ".join(
            f"{s.name} {s.experts} experts top-{s.top_k}" + (f" +{s.shared} shared" if s.shared else "")
            + (f" sigmoid+bias groups {s.groups}/{s.topk_group}" if s.grouped else " softmax")
            + f" (layers {', '.join(map(str, s.layers))})" for s in shapes
        ) + ". Logits bf16, ids int32, weights fp32.",
        "",
        "| scenario | config | self-check wall time (per routing shape) | compiles in capture (hook / cache) "
        "| variants launched: warm-up / capture | replays (rows: result) | counters, accounting |",
        "|---|---|---|---|---|---|---|",
    ]
    with CompileWatch() as watch:
        for sc in scenarios(use_graph):
            try:
                errors, row, launched = capture_and_replay(sc, shapes, device, use_graph, watch)
            except Exception as e:
                report_raised(sc.name, e, failures, lines, extra)
                continue
            failures += errors
            lines.append(row)
            for key, kernel in launched.items():
                compiled.setdefault(key, kernel)
        method = watch.method()
    lines += ["", f"Compile detection: {method}. Nothing may compile while a graph is captured.", ""]
    if use_graph and compiled:
        lines.append("Kernel variants the warm-ups launched (registers / spilled registers, from the device):")
        for key, kernel in sorted(compiled.items(), key=lambda kv: str(kv[0])):
            c = dict(key[2])
            lines.append(f"- {key[0]} N_PAD={c.get('N_PAD')} K={c.get('K')} EXTRA={c.get('EXTRA', '-')} "
                         f"SIGMOID={c.get('SIGMOID')} STATS={c.get('STATS')} warps={key[3]}: {regs_spills(kernel)}")
        lines.append("")
    lines += extra
    lines += [f"- FAIL: {f}" for f in failures]
    return failures, lines
