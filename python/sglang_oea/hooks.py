"""The thin layer that hooks OEA into SGLang 0.5.23, only through SGLang's HookRegistry.

Always installed (the flags must parse even when OEA is off); they add nothing else:
  ServerArgs.add_cli_args    AROUND  adds the --oea-* argument group.
  ServerArgs.from_cli_args   AROUND  builds and validates OEAConfig before any weights load, and
                                     publishes it to the processes SGLang spawns next.
  Engine.__init__            AROUND  the same for sglang.Engine(oea_k0=...).
Installed only in processes started while OEA is enabled (the published config is present):
  topk._post_process_topk_ids          BEFORE  rewrites logical topk ids and weights (decode only).
  forward_context.forward_context      AROUND  tells the runtime whether a step is decode, and its rows.
  Scheduler.__init__                   AFTER   creates the per-rank runtime; logs the settings.
  SchedulerMetricsReporter.report_decode_stats  BEFORE  exports metrics once per log interval and
                                                 hands SGLang's 'Decode batch' line an OEA summary.
  DecodeCudaGraphRunner.execute        AROUND  sets the device scalar of real rows before a replay.
Every hook is verified after it is applied; one that did not land stops startup with the name
of the SGLang function.
"""

import inspect
import json
import logging
import os
import pkgutil
from contextlib import contextmanager
from typing import Any, Callable, Dict, List, Optional, Tuple

from sglang_oea import flags
from sglang_oea.config import ENGINE_KEYWORDS, OEAConfig, build_config
from sglang_oea.runtime import OEARuntime, graph_capture_active

logger = logging.getLogger("sglang_oea")

CONFIG_ENV = "_SGLANG_OEA_CONFIG"  # internal: the validated config, for spawned processes
SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
TOPK_POST = "sglang.srt.layers.moe.topk._post_process_topk_ids"
FORWARD_CONTEXT = "sglang.srt.model_executor.forward_context.forward_context"
SCHEDULER_INIT = "sglang.srt.managers.scheduler.Scheduler.__init__"
GRAPH_EXECUTE = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.execute"
DECODE_STATS = "sglang.srt.managers.scheduler_components.metrics_reporter.SchedulerMetricsReporter.report_decode_stats"
ENGINE_INIT = "sglang.srt.entrypoints.engine.Engine.__init__"
CLI_TARGETS = (f"{SERVER_ARGS}.add_cli_args", f"{SERVER_ARGS}.from_cli_args", ENGINE_INIT)
ROUTING_TARGETS = (TOPK_POST, FORWARD_CONTEXT, SCHEDULER_INIT, DECODE_STATS, GRAPH_EXECUTE)

_runtime: Optional[OEARuntime] = None
_topk_signature: Optional[inspect.Signature] = None


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


def _load_hf_config(model_path: str, trust_remote_code: bool) -> Callable[[], Any]:
    def load():
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)

    return load


def validate_for_server(cfg: OEAConfig, get: Callable[[str, Any], Any]) -> None:
    """Run every startup check; register the resolved-backend check. Raises ValueError."""
    loader = _load_hf_config(get("model_path", None), bool(get("trust_remote_code", False)))
    flags.validate_server(cfg, get, loader)
    if cfg.enabled:
        register_backend_resolution_check()


def backend_resolution_pass(view: Any) -> Dict[str, str]:
    """SGLang post-process pass: if `auto` resolved to a backend that hides topk_ids, use triton.

    An explicit choice of such a backend was already refused before resolution.
    """
    backend = getattr(view, "moe_runner_backend", None)
    backend = getattr(backend, "value", backend)
    if backend not in flags.HIDDEN_TOPK_BACKENDS:
        return {}
    logger.warning(
        "sglang-oea: --moe-runner-backend auto chose %s, which %s; using %s so that OEA can run.",
        backend, flags.HIDDEN_TOPK_BACKENDS[backend], flags.FALLBACK_BACKEND,
    )
    return {"moe_runner_backend": flags.FALLBACK_BACKEND}


def register_backend_resolution_check() -> None:
    from sglang.srt.arg_groups.overrides import POST_PROCESS_PASSES, register_post_process

    if backend_resolution_pass not in POST_PROCESS_PASSES:
        register_post_process(backend_resolution_pass)


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
    publish_config(cfg)
    return server_args


def engine_init_hook(original: Callable, self: Any, **kwargs: Any) -> Any:
    values = {key: kwargs.pop(key) for key in ENGINE_KEYWORDS if key in kwargs}
    record = kwargs.get("server_args")
    if record is not None and getattr(record, "_oea", None):
        cfg = OEAConfig(**record._oea)
    else:
        cfg = build_config(values)
        read = kwargs.get if record is None else (lambda name, default: getattr(record, name, default))
        validate_for_server(cfg, read)
    publish_config(cfg)
    return original(self, **kwargs)


# ----------------------------------------------------------------------------- routing hooks


def scheduler_init_hook(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """Create this rank's runtime and log the settings with the model's routing shape."""
    global _runtime
    from sglang_oea.model_info import read_moe_shape

    cfg = published_config()
    rank = int(getattr(scheduler, "tp_rank", 0) or 0)
    _runtime = OEARuntime(cfg, rank=rank, device=routing_device())
    shape = read_moe_shape(scheduler.model_config.hf_config)
    model = shape.describe() if shape else "no routed experts"
    state = "no-op (k0 >= top-k)" if shape and cfg.k0 >= shape.top_k else "on"
    logger.info("sglang-oea rank %d: OEA %s, %s; model %s", rank, state, cfg.describe(), model)
    from sglang_oea import metrics

    metrics.attach(_runtime, scheduler)


def routing_device():
    """Where this process routes: its current CUDA device, else the CPU."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@contextmanager
def _oea_step(inner: Any, forward_batch: Any):
    """Enter SGLang's forward context with the runtime told what this forward pass is."""
    if forward_batch is None or _runtime is None:
        with inner:
            yield
        return
    # SGLang nests forward contexts for one forward pass; only the outermost counts as a step.
    outermost = _runtime.depth == 0 and not graph_capture_active()
    previous = _runtime.begin_step(forward_batch.forward_mode.is_decode(), int(forward_batch.batch_size), count=outermost)
    _runtime.depth += 1
    try:
        with inner:
            yield
    finally:
        _runtime.depth -= 1
        _runtime.step = previous


def forward_context_hook(original: Callable, ctx: Any, *args: Any, forward_batch: Any = None, **kwargs: Any):
    return _oea_step(original(ctx, *args, forward_batch=forward_batch, **kwargs), forward_batch)


def topk_post_hook(*args: Any, **kwargs: Any) -> Optional[Tuple[tuple, dict]]:
    """Rewrite the routed columns before EPLB mapping and padded-row masking."""
    if _runtime is None or not _runtime.step.decode:
        return None
    bound = _topk_signature.bind(*args, **kwargs)
    params = bound.arguments
    routed = _runtime.route(
        params["topk_ids"], params["topk_weights"], params["topk_config"],
        params["router_logits"], params.get("layer_id"),
    )
    if routed is None:
        return None
    params["topk_ids"], params["topk_weights"] = routed
    return bound.args, bound.kwargs


def graph_execute_hook(original: Callable, runner: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
    """Before each decode-graph replay, tell the captured routing how many rows are real."""
    if _runtime is not None:
        _runtime.graph_rows.fill_(int(forward_batch.batch_size))
    return original(runner, forward_batch, *args, **kwargs)


def decode_stats_hook(reporter: Any, *args: Any, **kwargs: Any) -> None:
    """On SGLang's decode-log steps, publish OEA's counters just before it logs 'Decode batch'."""
    if _runtime is not None and reporter.forward_ct_decode % reporter.decode_log_interval == 0:
        from sglang_oea import metrics

        metrics.report(_runtime)


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
        landed = target in HookRegistry._patched and hasattr(getattr(pkgutil.resolve_name(owner), attr), "__wrapped__")
        if not landed:
            missing.append(target)
    return missing


def install() -> None:
    """Plugin entry: CLI hooks always; routing hooks when a published config enables OEA."""
    from sglang.srt.plugins.hook_registry import HookType

    _register([
        (f"{SERVER_ARGS}.add_cli_args", add_cli_args_hook, HookType.AROUND),
        (f"{SERVER_ARGS}.from_cli_args", from_cli_args_hook, HookType.AROUND),
        (ENGINE_INIT, engine_init_hook, HookType.AROUND),
    ])
    for target in missing_hooks(CLI_TARGETS):
        logger.error("sglang-oea: could not hook SGLang's %s; the --oea-* flags are unavailable.", target)
    cfg = published_config()
    if cfg is not None and cfg.enabled:
        install_routing()


def install_routing() -> None:
    global _topk_signature
    from sglang.srt.plugins.hook_registry import HookType

    _register([
        (TOPK_POST, topk_post_hook, HookType.BEFORE),
        (FORWARD_CONTEXT, forward_context_hook, HookType.AROUND),
        (SCHEDULER_INIT, scheduler_init_hook, HookType.AFTER),
        (DECODE_STATS, decode_stats_hook, HookType.BEFORE),
        (GRAPH_EXECUTE, graph_execute_hook, HookType.AROUND),
    ])
    missing = missing_hooks(ROUTING_TARGETS)
    if missing:
        # SystemExit, not an Exception: SGLang's plugin loader logs and swallows exceptions.
        raise SystemExit(f"sglang-oea: error: could not hook SGLang's {missing[0]}; OEA needs sglang==0.5.23")
    from sglang.srt.layers.moe import topk

    _topk_signature = inspect.signature(topk._post_process_topk_ids.__wrapped__)
