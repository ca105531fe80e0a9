"""The thin layer that hooks OEA into SGLang 0.5.23, only through SGLang's own plugin interfaces.

Always installed (the flags must parse even when OEA is off); they add nothing else:
  ServerArgs.add_cli_args    AROUND  adds the --oea-* argument group.
  ServerArgs.from_cli_args   AROUND  builds and validates OEAConfig before any weights load, and
                                     publishes it to the processes SGLang spawns next.
  ServerArgs.resolve_once    AROUND  then, when OEA is installed, refuses the parallel layouts in the
                                     resolved arguments (resolution can turn on all-to-all dispatch
                                     and expert parallel: sglang_oea.startup_checks); on the command
                                     line an OEA refusal here is one `sglang-oea: error:` line.
  Engine.__init__            AROUND  the same for sglang.Engine(server_args=record).
  Engine.server_args_class   (SGLang's class attribute for the Engine's record type, set, not
                             wrapped) the same for sglang.Engine(oea_k0=...): Engine.__init__ builds
                             its record right after load_plugins(), so it works for the first Engine
                             of a process, which an __init__ hook would miss.
  resolution step handle_moe_kernel_config (SGLang's register_resolution_hook)
                                     when OEA is installed and `auto` resolved to a MoE backend that hides
                                     topk_ids: a backend that keeps them for this quantization.
Installed only in scheduler / TP-worker processes started while OEA is installed (--oea-k0 given,
0 included: the published config is present; the other processes that load plugins, such as the
detokenizer, get none of them: sglang_oea.routing_scope):
  topk._post_process_topk_ids          BEFORE  rewrites logical topk ids and weights (decode and the
                                               target's verify passes only); never traced by
                                               torch.compile, and routes with SGLang's symmetric-
                                               memory context suspended (sglang_oea.routing_scope).
  ModelRunner.initialize               AFTER   once the target model is built, before any memory
                                               pool or CUDA graph: refuses routed layers whose top-k
                                               output hides topk_ids (sglang_oea.startup_checks).
  forward_context.forward_context      AROUND  tells the runtime what each forward pass is (under DP
                                               attention the gathered batch: sglang_oea.dp_attention);
                                               accounts for it when the outermost pass ends.
  Scheduler.__init__                   AFTER   logs the settings and the kernel choice; metrics.
  SchedulerMetricsReporter.report_decode_stats  BEFORE  exports metrics once per log interval and
                                                 hands SGLang's 'Decode batch' line an OEA summary
                                                 (a metrics failure is logged once, never raised);
                                                 runs the rank check when due.
  DecodeCudaGraphRunner.execute        AROUND  sets the device scalar of real token rows before a
                                               decode- or verify-graph replay.
  DecodeCudaGraphRunner.capture        AROUND  mark the draft model's graph captures and forward
  ModelRunner.forward                  AROUND  passes (its runner's is_draft_worker): OEA neither
                                               routes nor counts them. Around a capture, the
                                               runtime also knows the runner's buckets.
  SchedulerInternalStateController (live settings: sglang_oea.live_settings)
    ._update_handlers                  AFTER   POST /set_internal_state takes oea_k0, oea_min_batch and
                                               oea_max_batch: validated, then requested from the runtime
    .set_internal_state                AROUND  the handlers see the whole request (checks across keys)
    .get_internal_state                AFTER   /server_info's internal_states[i]["oea"]
Installed only in scheduler processes started while OEA is not installed (no --oea-k0):
  SchedulerInternalStateController._update_handlers  AFTER  refuses the oea_* keys with a message
                                               that says how to arm OEA; nothing else is hooked.
The per-process runtime is created at the first forward pass (CUDA-graph warm-ups run inside
Scheduler.__init__, before its AFTER hook). Every hook is verified after it is applied; one that
did not land stops startup with the name of the SGLang function.
"""

import inspect
import json
import logging
import os
import pkgutil
from contextlib import contextmanager
from typing import Any, Callable, List, Optional, Tuple

from sglang_oea import dp_attention, flags, live_settings, routing_scope, startup_checks
from sglang_oea.config import ENGINE_KEYWORDS, OEAConfig, build_config
from sglang_oea.rank_check import RankCheck
from sglang_oea.runtime import DECODE, DRAFT, OTHER, VERIFY, OEARuntime, graph_capture_active
from sglang_oea.startup_checks import speculative_note, startup_state  # the startup line's words

logger = logging.getLogger("sglang_oea")

CONFIG_ENV = "_SGLANG_OEA_CONFIG"  # internal: the validated config, for spawned processes
SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
TOPK_POST = "sglang.srt.layers.moe.topk._post_process_topk_ids"
FORWARD_CONTEXT = "sglang.srt.model_executor.forward_context.forward_context"
SCHEDULER_INIT = "sglang.srt.managers.scheduler.Scheduler.__init__"
GRAPH_RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
GRAPH_EXECUTE = f"{GRAPH_RUNNER}.execute"
GRAPH_CAPTURE = f"{GRAPH_RUNNER}.capture"
MODEL_FORWARD = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
MODEL_INITIALIZE = "sglang.srt.model_executor.model_runner.ModelRunner.initialize"
DECODE_STATS = "sglang.srt.managers.scheduler_components.metrics_reporter.SchedulerMetricsReporter.report_decode_stats"
ENGINE_INIT = "sglang.srt.entrypoints.engine.Engine.__init__"
RESOLVE = f"{SERVER_ARGS}.resolve_once"
MOE_RESOLUTION_STEP = "handle_moe_kernel_config"
CLI_TARGETS = (f"{SERVER_ARGS}.add_cli_args", f"{SERVER_ARGS}.from_cli_args", RESOLVE, ENGINE_INIT)
ROUTING_TARGETS = (TOPK_POST, FORWARD_CONTEXT, SCHEDULER_INIT, DECODE_STATS, GRAPH_EXECUTE, GRAPH_CAPTURE,
                   MODEL_FORWARD, MODEL_INITIALIZE)
INTERNAL_STATE = "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController"
UPDATE_HANDLERS = f"{INTERNAL_STATE}._update_handlers"
SET_STATE = f"{INTERNAL_STATE}.set_internal_state"
GET_STATE = f"{INTERNAL_STATE}.get_internal_state"
CONTROL_TARGETS = (UPDATE_HANDLERS, SET_STATE, GET_STATE)  # OEA installed: the live settings
REFUSAL_TARGETS = (UPDATE_HANDLERS,)  # OEA not installed: their refusal

_runtime: Optional[OEARuntime] = None
_topk_signature: Optional[inspect.Signature] = None
_draft_runner = False  # inside a forward pass or graph capture of the draft model's runner
_replaying = False  # inside DecodeCudaGraphRunner.execute (a graph replay)


class OEAStartupError(ValueError):
    """A configuration OEA refuses, found while SGLang resolves the server arguments."""


# ----------------------------------------------------------------------------- config plumbing


def publish_config(cfg: OEAConfig) -> None:
    """Hand the config to processes spawned from now on (schedulers, TP workers)."""
    if cfg.enabled:
        os.environ[CONFIG_ENV] = json.dumps(cfg.as_dict())
    else:
        os.environ.pop(CONFIG_ENV, None)


def published_config() -> Optional[OEAConfig]:
    text = os.environ.get(CONFIG_ENV)
    return OEAConfig(**json.loads(text)) if text else None


def hf_config_loader(get: Callable[[str, Any], Any]) -> Callable[[], Any]:
    """The model's Hugging Face config, loaded lazily as SGLang loads it: the same path, revision
    (--revision: a branch, tag or commit of a hub model) and remote-code setting."""
    def load():
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(get("model_path", None), trust_remote_code=bool(get("trust_remote_code", False)),
                                          revision=get("revision", None))

    return load


def validate_for_server(cfg: OEAConfig, get: Callable[[str, Any], Any]) -> None:
    """Run every startup check that needs only the raw settings. Raises ValueError."""
    flags.validate_server(cfg, get, hf_config_loader(get))


def backend_fallback_pass(view: Any) -> dict:
    """SGLang post-process pass: replace a resolved MoE backend that hides topk_ids (only `auto` can
    resolve to one: an explicit choice was refused before resolution). Raises OEAStartupError when
    no backend known to keep topk_ids runs the checkpoint's quantization."""
    backend = getattr(view.moe_runner_backend, "value", view.moe_runner_backend)
    try:
        fallback = flags.fallback_backend(backend, view.quantization)
    except ValueError as exc:
        raise OEAStartupError(str(exc)) from None
    if fallback is None:
        return {}
    logger.warning(
        "sglang-oea: --moe-runner-backend auto chose %s, which %s; using %s (quantization %s) so that OEA can run.",
        backend, flags.HIDDEN_TOPK_BACKENDS[backend], fallback, view.quantization,
    )
    return {"moe_runner_backend": fallback}


def moe_kernel_config_step(server_args: Any, previous: Callable[[Any], None]) -> None:
    """SGLang's MoE kernel resolution step, then OEA's backend fallback when OEA is installed."""
    previous(server_args)
    cfg = published_config()
    if cfg is not None and cfg.enabled:
        from sglang.srt.arg_groups.overrides import run_post_process_pass

        run_post_process_pass(server_args, backend_fallback_pass)


def check_resolved_arguments(server_args: Any) -> None:
    """With OEA on: refuse what SGLang's resolution made of the arguments. Raises OEAStartupError."""
    cfg = published_config()
    if cfg is None or not cfg.enabled:
        return
    try:
        startup_checks.check_resolved_arguments(server_args, cfg)
    except ValueError as exc:
        raise OEAStartupError(str(exc)) from None


def resolve_once_hook(original: Callable, server_args: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang's resolution, then OEA's checks on its result. On the command line, an OEA refusal
    here is one error line, not a traceback."""
    try:
        result = original(server_args, *args, **kwargs)
        check_resolved_arguments(server_args)
        return result
    except OEAStartupError as exc:
        if getattr(server_args, "_oea_cli", False):
            raise SystemExit(f"sglang-oea: error: {exc}") from None
        raise


# ----------------------------------------------------------------------------- CLI and Engine hooks


def add_cli_args_hook(original: Callable, parser: Any) -> Any:
    result = original(parser)
    flags.add_oea_arguments(parser)
    return result


def from_cli_args_hook(original: Callable, cls: type, args: Any) -> Any:
    server_args = original(cls, args)
    try:
        cfg = flags.config_from_namespace(args)
        validate_for_server(cfg, lambda name, default: getattr(server_args, name, default))
    except ValueError as exc:
        raise SystemExit(f"sglang-oea: error: {exc}") from None
    server_args._oea = cfg.as_dict()
    server_args._oea_cli = True
    publish_config(cfg)
    return server_args


def engine_config(kwargs: dict, read: Callable[[str, Any], Any]) -> OEAConfig:
    """The OEA config of sglang.Engine(**kwargs), its oea_* keywords taken out of kwargs and checked
    (`read(name, default)` reads the other settings). Raises ValueError."""
    unknown = sorted(key for key in kwargs if key.startswith("oea_") and key not in ENGINE_KEYWORDS)
    if unknown:
        raise ValueError(f"sglang.Engine: unknown OEA keyword(s) {', '.join(unknown)}; allowed: {', '.join(ENGINE_KEYWORDS)}")
    cfg = build_config({key: kwargs.pop(key) for key in ENGINE_KEYWORDS if key in kwargs})
    validate_for_server(cfg, read)
    return cfg


def engine_server_args(**kwargs: Any) -> Any:
    """Engine.server_args_class, through which sglang.Engine(**kwargs) builds its ServerArgs right
    after its own load_plugins() (an Engine.__init__ hook lands too late for a process's first
    Engine): the oea_* keywords checked and published, the others to ServerArgs."""
    from sglang.srt.server_args import ServerArgs

    publish_config(engine_config(kwargs, kwargs.get))
    return ServerArgs(**kwargs)


ENGINE_RECORD = staticmethod(engine_server_args)


def engine_init_hook(original: Callable, self: Any, **kwargs: Any) -> Any:
    """sglang.Engine(server_args=record): publish the record's OEA config (keywords alone go
    through engine_server_args)."""
    record = kwargs.get("server_args")
    if record is not None:
        read = lambda name, default: getattr(record, name, default)  # noqa: E731
        publish_config(OEAConfig(**record._oea) if getattr(record, "_oea", None) else engine_config(kwargs, read))
    return original(self, **kwargs)


def install_engine_record() -> None:
    """Point sglang.Engine's record class (its server_args_class, meant to be swapped) at
    engine_server_args; idempotent, verified."""
    from sglang.srt.entrypoints import engine

    if engine.Engine.__dict__.get("server_args_class") is not ENGINE_RECORD:
        engine.Engine.server_args_class = ENGINE_RECORD
    if engine.Engine.__dict__.get("server_args_class") is not ENGINE_RECORD:
        logger.error("sglang-oea: could not set sglang.Engine.server_args_class; the oea_* Engine keywords are unavailable.")


# ----------------------------------------------------------------------------- routing hooks


def ensure_runtime() -> Optional[OEARuntime]:
    """This process's runtime, created on first use from the published config (None when OEA is off)."""
    global _runtime
    if _runtime is None:
        cfg = published_config()
        if cfg is None or not cfg.enabled:
            return None
        from sglang.srt.runtime_context import get_parallel, get_server_args

        parallel = get_parallel()
        _runtime = OEARuntime(cfg, rank=int(parallel.tp_rank or 0),
                              speculative=bool(get_server_args().speculative_algorithm),
                              world_size=int(parallel.tp_size or 1), agree=tp_agreement, dp_rank=parallel.dp_rank,
                              groups=dp_attention.attention_dp_groups(), slots=dp_attention.gathered_slots)
    return _runtime


def tp_agreement(passed_here: bool) -> bool:
    """Whether the kernel self-check passed on every rank of this tensor-parallel group (the ranks
    that route the same batch): one MIN all-reduce over its CPU group. Called by every rank at the
    same routing call, during the first (warm-up) forward pass, before any routed output exists."""
    from sglang.srt.distributed import get_tp_group

    from sglang_oea.routers import min_agreement

    group = get_tp_group()
    return passed_here if group.world_size == 1 else min_agreement(group.cpu_group)(passed_here)


def scheduler_init_hook(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """Log this rank's settings with the model's routing shape and the kernel choice; metrics."""
    from sglang_oea import metrics
    from sglang_oea.model_info import read_moe_shape

    runtime = ensure_runtime()
    if runtime is None:
        return
    cfg = runtime.cfg
    shape = read_moe_shape(scheduler.model_config.hf_config)
    model = shape.describe() if shape else "no routed experts"
    runtime.verify_widths = startup_checks.resolved_verify_widths(scheduler.server_args) if cfg.verify else ()
    runtime.moe_shape = shape
    logger.info("sglang-oea rank %d: OEA %s, %s; model %s; %s%s", runtime.rank, startup_state(cfg.k0, shape), cfg.describe(), model,
                runtime.routers.describe(), speculative_note(cfg, scheduler.server_args.speculative_algorithm,
                                                             runtime.verify_widths))
    attach_rank_check(runtime)
    metrics.attach(runtime, scheduler)
    dp_attention.configure(scheduler, runtime)


def attach_rank_check(runtime: OEARuntime) -> None:
    """The --oea-check-ranks guard over this rank's tensor-parallel group (the ranks that route
    the same batch), once the groups exist."""
    if runtime.checksums and runtime.rank_check is None:
        from sglang.srt.distributed import get_tp_group

        group = get_tp_group()
        runtime.rank_check = RankCheck(runtime.cfg.check_ranks, group.cpu_group, group.world_size)


def forward_mode_of(forward_batch: Any) -> str:
    """What OEA makes of a forward pass; the draft model's passes (its runner's, draft-extend) are DRAFT."""
    mode = forward_batch.forward_mode
    if _draft_runner or mode.is_draft_extend_v2():
        return DRAFT
    if mode.is_decode():
        return DECODE
    return VERIFY if mode.is_target_verify() else OTHER


def token_rows(forward_batch: Any) -> int:
    """The pass's token rows, which reach the MoE router: requests in decode, requests x draft
    tokens in a verify pass (eager: all real; graph replay: the real rows before padding)."""
    input_ids = forward_batch.input_ids
    return int(forward_batch.batch_size) if input_ids is None else int(input_ids.shape[0])


def capture_mode_active() -> bool:
    """A CUDA-graph warm-up or capture pass (SGLang's capture mode, or a stream being captured)."""
    from sglang.srt.model_executor.runner_utils.capture_mode import get_is_capture_mode

    return get_is_capture_mode() or graph_capture_active()


@contextmanager
def _oea_step(inner: Any, forward_batch: Any):
    """Enter SGLang's forward context with the runtime told what this forward pass is."""
    runtime = ensure_runtime() if forward_batch is not None else None
    if runtime is None:
        with inner:
            yield
        return
    # SGLang nests forward contexts within one forward pass; the outermost one is the step.
    outermost = runtime.depth == 0
    # A context opened inside a graph replay describes the graph's padded capture-time batch: with
    # --debug-cuda-graph the breakable backend re-runs the whole forward eagerly at every replay,
    # on that batch. It must route as the graph does (real rows from the device scalar, gate on
    # the device), never take its padded rows for real ones: it is a graph pass whatever SGLang's
    # capture-mode flag says.
    graph = capture_mode_active() or (_replaying and not outermost)
    described = dict(mode=forward_mode_of(forward_batch), num_rows=token_rows(forward_batch),
                     requests=int(forward_batch.batch_size))
    if runtime.groups:  # DP attention: the gathered batch
        described = dp_attention.describe(runtime, forward_batch, described, outermost, graph)
    previous = runtime.begin_step(graph=graph, outermost=outermost, **described)
    ended = runtime.step
    runtime.depth += 1
    try:
        with inner:
            yield
    finally:
        runtime.depth -= 1
        if outermost:
            runtime.end_step()
        runtime.step = previous
    if outermost and runtime.groups:
        dp_attention.after_pass(runtime, ended, forward_batch.forward_mode.is_idle())


def forward_context_hook(original: Callable, ctx: Any, *args: Any, forward_batch: Any = None, **kwargs: Any):
    return _oea_step(original(ctx, *args, forward_batch=forward_batch, **kwargs), forward_batch)


def model_built_hook(result: Any, model_runner: Any, *args: Any, **kwargs: Any) -> None:
    """Once the target model is built (its TopK output formats bound), before its memory pools and
    CUDA graphs: refuse routed layers whose top-k output hides topk_ids. The ValueError ends
    Scheduler.__init__; SGLang's scheduler process logs it and stops the server (SIGQUIT)."""
    if not model_runner.is_draft_worker:
        startup_checks.check_built_model(model_runner)


@routing_scope.never_traced
def topk_post_hook(*args: Any, **kwargs: Any) -> Optional[Tuple[tuple, dict]]:
    """Rewrite the routed columns before EPLB mapping and padded-row masking."""
    if _runtime is None or not _runtime.step.routed:
        return None
    bound = _topk_signature.bind(*args, **kwargs)
    params = bound.arguments
    routed = routing_scope.outside_symmetric_memory(
        _runtime.route, params["topk_ids"], params["topk_weights"], params["topk_config"],
        params["router_logits"], params.get("layer_id"),
    )
    if routed is None:
        return None
    params["topk_ids"], params["topk_weights"] = routed
    return bound.args, bound.kwargs


def graph_execute_hook(original: Callable, runner: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
    """Before each decode- or verify-graph replay, tell the captured routing how many token rows
    are real (padded requests' rows come after them); after it, note which bucket (in requests) was
    replayed: its capture decides whether this step applied OEA."""
    global _replaying
    if _runtime is not None:
        _runtime.set_replay_rows(token_rows(forward_batch))
    previous, _replaying = _replaying, True
    try:
        output = original(runner, forward_batch, *args, **kwargs)
    finally:
        _replaying = previous
    if _runtime is not None:
        _runtime.note_replay(int(runner.bs))
    return output


@contextmanager
def _runner_scope(model_runner: Any):
    """While a model runner works: whether it is the draft model's (SGLang's is_draft_worker)."""
    global _draft_runner
    previous, _draft_runner = _draft_runner, bool(model_runner.is_draft_worker)
    try:
        yield
    finally:
        _draft_runner = previous


def model_forward_hook(original: Callable, model_runner: Any, *args: Any, **kwargs: Any) -> Any:
    """Eager passes and graph replays: a draft runner's passes (MTP/EAGLE drafts decode, DFlash
    drafts verify) are neither routed nor counted."""
    with _runner_scope(model_runner):
        return original(model_runner, *args, **kwargs)


def graph_capture_hook(original: Callable, runner: Any, *args: Any, **kwargs: Any) -> Any:
    """Graph captures: a draft runner's captures must not stand for the target's graphs of the
    same bucket in the accounting; the runtime learns the runner's buckets (a bucket serves the
    batches above the next smaller one), so that it leaves routing out of buckets whose every
    batch is outside the gate."""
    runtime = ensure_runtime()
    previous = None if runtime is None else runtime.graph_buckets
    if runtime is not None:
        runtime.graph_buckets = tuple(sorted(int(bs) for bs in runner.capture_bs))
    try:
        with _runner_scope(runner.model_runner):
            return original(runner, *args, **kwargs)
    finally:
        if runtime is not None:
            runtime.graph_buckets = previous


def decode_stats_hook(reporter: Any, *args: Any, **kwargs: Any) -> None:
    """After every decode step, on every rank in step: the rank check when due; on SGLang's
    decode-log steps, publish OEA's counters just before it logs 'Decode batch'. Both read the
    counters through a snapshot that every rank took at the end of the same routed pass (under the
    overlap scheduler the next pass is already running here: see sglang_oea.counters).

    The metrics are contained (a bug there is logged once and costs a metric, never the scheduler
    loop this runs in). The rank check is not: a divergence means wrong outputs and stops the
    server by design, and a rank that skipped the check's collective would leave the others
    waiting in it."""
    if _runtime is None:
        return
    from sglang_oea import metrics

    step = reporter.forward_ct_decode
    check = None if _runtime.groups else _runtime.rank_check  # under DP attention: at the gathered passes
    snapshot = None
    if check is not None and check.due(step):
        snapshot = _runtime.read_snapshot()
        if snapshot is not None:
            check.check(snapshot, step)
    with metrics.contained("the OEA metrics report"):
        if step % reporter.decode_log_interval == 0:
            metrics.report(_runtime, snapshot if snapshot is not None else _runtime.read_snapshot())


# ----------------------------------------------------------------------------- live settings


def update_handlers_hook(handlers: dict, controller: Any, *args: Any, **kwargs: Any) -> None:
    """SGLang's /set_internal_state handlers, plus the OEA keys' (refusing ones without OEA)."""
    handlers.update(live_settings.handlers(ensure_runtime()))


def set_internal_state_hook(original: Callable, controller: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
    with live_settings.whole_request(request.server_args):
        return original(controller, request, *args, **kwargs)


def get_internal_state_hook(result: Any, controller: Any, *args: Any, **kwargs: Any) -> None:
    runtime = ensure_runtime()
    if runtime is not None:
        result.internal_state["oea"] = live_settings.state_of(runtime)


# ----------------------------------------------------------------------------- install / verify


def _register(hooks: List[Tuple[str, Callable, Any]]) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    for target, fn, kind in hooks:
        if not any(h is fn for _, h, _ in HookRegistry._hooks.get(target, [])):
            HookRegistry.register(target, fn, kind)
    HookRegistry.apply_hooks()


def missing_hooks(targets: Tuple[str, ...]) -> List[str]:
    """The targets whose patch did not land (not applied, or no wrapper in place)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    missing = []
    for target in targets:
        owner, _, attr = target.rpartition(".")
        try:
            landed = target in HookRegistry._patched and hasattr(getattr(pkgutil.resolve_name(owner), attr), "__wrapped__")
        except (ImportError, AttributeError):  # the module, class or function is gone in this SGLang
            landed = False
        if not landed:
            missing.append(target)
    return missing


def require_hooks(targets: Tuple[str, ...]) -> None:
    """Stop the process when a patch did not land. SystemExit, not an Exception: SGLang's plugin
    loader logs and swallows exceptions."""
    missing = missing_hooks(targets)
    if missing:
        raise SystemExit(f"sglang-oea: error: could not hook SGLang's {missing[0]}; OEA needs an sglang 0.5.23 build")


def install() -> None:
    """Plugin entry: CLI hooks always; in a scheduler process, the routing and live-settings hooks
    when the published config installs OEA, else only the live settings' refusal."""
    from sglang.srt.arg_groups.resolution_hooks import _HOOKS, register_resolution_hook
    from sglang.srt.plugins.hook_registry import HookType

    _register([
        (f"{SERVER_ARGS}.add_cli_args", add_cli_args_hook, HookType.AROUND),
        (f"{SERVER_ARGS}.from_cli_args", from_cli_args_hook, HookType.AROUND),
        (RESOLVE, resolve_once_hook, HookType.AROUND),
        (ENGINE_INIT, engine_init_hook, HookType.AROUND),
    ])
    if moe_kernel_config_step not in _HOOKS.get(MOE_RESOLUTION_STEP, []):
        register_resolution_hook(MOE_RESOLUTION_STEP)(moe_kernel_config_step)
    install_engine_record()
    for target in missing_hooks(CLI_TARGETS):
        logger.error("sglang-oea: could not hook SGLang's %s; the --oea-* flags are unavailable.", target)
    if not routing_scope.loading_in_scheduler_process():
        return
    cfg = published_config()
    if cfg is not None and cfg.enabled:
        install_routing()
    else:
        install_refusal()


def install_refusal() -> None:
    """A scheduler without OEA: only the refusal of the live settings' keys."""
    from sglang.srt.plugins.hook_registry import HookType

    _register([(UPDATE_HANDLERS, update_handlers_hook, HookType.AFTER)])
    require_hooks(REFUSAL_TARGETS)


def install_routing() -> None:
    global _topk_signature
    from sglang.srt.plugins.hook_registry import HookType

    _register([
        (TOPK_POST, topk_post_hook, HookType.BEFORE),
        (FORWARD_CONTEXT, forward_context_hook, HookType.AROUND),
        (SCHEDULER_INIT, scheduler_init_hook, HookType.AFTER),
        (DECODE_STATS, decode_stats_hook, HookType.BEFORE),
        (GRAPH_EXECUTE, graph_execute_hook, HookType.AROUND),
        (GRAPH_CAPTURE, graph_capture_hook, HookType.AROUND),
        (MODEL_FORWARD, model_forward_hook, HookType.AROUND),
        (MODEL_INITIALIZE, model_built_hook, HookType.AFTER),
        (UPDATE_HANDLERS, update_handlers_hook, HookType.AFTER),
        (SET_STATE, set_internal_state_hook, HookType.AROUND),
        (GET_STATE, get_internal_state_hook, HookType.AFTER),
    ])
    require_hooks(ROUTING_TARGETS + CONTROL_TARGETS)
    from sglang.srt.layers.moe import topk

    _topk_signature = inspect.signature(topk._post_process_topk_ids.__wrapped__)
