"""OEA's live settings: k0 and the batch gate changed on a running server, through SGLang's own
`/set_internal_state`, and read back in `/server_info`. No SGLang import at module level.

    POST /set_internal_state {"server_args": {"oea_k0": 4, "oea_min_batch": 8, "oea_max_batch": 64}}
      -> [true]   accepted: every TP rank (each handles the request in the same scheduler
                  iteration) requested the change; it takes effect at the next forward pass
      -> [false]  refused; nothing changed; each rank logged one line with the key, the value and
                  what is allowed
      One bool per data-parallel replica (--dp-size N: [true, true]). SGLang's DP controller sends
      the request to every replica, and each checks it on its own: against the same startup
      flags and the same settings, since every earlier request reached every replica in the same
      order. So all replicas accept it or all refuse it ([true, true] or [false, false]); a request
      that also carries SGLang's own keys is refused by every replica (see below).
    GET /server_info -> internal_states[i]["oea"] = {"k0", "min_batch", "max_batch" (in force),
                        "pending" (requested, not yet reached a pass), "envelope" (the startup gate),
                        "verify" (--oea-verify), "kernel" (the routing path and its self-check),
                        "model" (routed experts, top-k), "dp_rank" (with --dp-size > 1)}

The rules are the flags' own (sglang_oea.config), checked on the settings the whole request
would leave in force (the settings requested last, with the request's keys merged in):
    oea_k0         an integer from 0 to 64 (0 = off: the router's own experts; >= top-k = a no-op)
    oea_min_batch  an integer from 1 to 65536, and >= the startup --oea-min-batch
    oea_max_batch  an integer from 0 to 65536, 0 (no cap) or >= oea_min_batch; when the startup
                   --oea-max-batch is > 0, at most that (0 is then outside the envelope too)
The upper bounds keep every value, and min_batch x draft tokens, inside the int32 device control
block and gate (sglang_oea.config.MAX_BATCH). Under speculative decoding, a cap below min_batch x
the draft tokens of every verify width the server runs (no verify pass could open the gate) is
refused, as at startup; one that closes only some adaptive widths is accepted with a warning on
every rank (passes.verify_cap_problem).
Why the envelope: CUDA graphs of the batch sizes outside the startup gate were captured without
OEA routing, so the gate cannot open there without a restart (with wider flags).
Not a bool, not a float (3.0 included). SGLang's HTTP parsing (pydantic, lax) turns JSON true/false
and numeric strings into integers before any handler sees them; other strings and null are
refused there (HTTP 400). One request is applied whole or not at all: SGLang validates every key
before it applies any, and the OEA keys are checked together. These keys are not ServerArgs
fields: they never enter SGLang's config override.
A request that mixes oea_* keys with SGLang's own keys is refused whole (check_not_mixed), on
every rank and replica alike: some of SGLang's keys are checked against each replica's own state
(pp_max_micro_batch_size against its max_running_requests, the DFlash accept threshold against
its active requests), so such a request could pass on some replicas and not others, with no
rollback. Sent apart, each request is all or none on its own.

SGLang side (`SchedulerInternalStateController`, hooked by sglang_oea.hooks in scheduler processes):
    _update_handlers     adds one handler per key: validate (rules above), apply (request the
                         change from the runtime, once per request); on a server started without
                         --oea-k0, a handler that refuses with NOT_INSTALLED
    set_internal_state   the request being handled, for the checks across keys
    get_internal_state   internal_states[i]["oea"] (state_of)
"""

import json
import logging
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from sglang_oea.config import MAX_BATCH, MAX_K0, LiveSettings, OEAConfig, check_batch_window, require_int
from sglang_oea.passes import verify_cap_problem

logger = logging.getLogger("sglang_oea")

# POST key -> LiveSettings field (and /server_info key); the range of values each takes (the
# flags' own: sglang_oea.config).
LIVE_KEYS = {"oea_k0": "k0", "oea_min_batch": "min_batch", "oea_max_batch": "max_batch"}
MINIMUM = {"oea_k0": 0, "oea_min_batch": 1, "oea_max_batch": 0}
MAXIMUM = {"oea_k0": MAX_K0, "oea_min_batch": MAX_BATCH, "oea_max_batch": MAX_BATCH}
MEANING = {"oea_k0": " (0 = OEA off)", "oea_min_batch": "", "oea_max_batch": " (0 = no cap)"}
LIVE_NAMES = ("oea_min_batch", "oea_max_batch")
NOT_INSTALLED = ("OEA is not installed on this server (it was started without --oea-k0); start the server "
                 "with --oea-k0 0 to arm OEA without turning it on")
SEND_APART = ("the oea_* keys cannot share a request with other keys: data-parallel replicas check some of "
              "SGLang's keys against their own state, so one request could change some replicas and not others; "
              "send the oea_* keys and the others in separate requests")
WHY_ENVELOPE = ("CUDA graphs were captured without OEA routing for batch sizes outside the startup window; "
                "restart with a wider --oea-min-batch / --oea-max-batch to widen it")


class SettingRefused(ValueError):
    """A live change OEA refuses; its message names the key, the value and what is allowed."""


def check_values(requested: Mapping[str, Any]) -> None:
    """Each OEA key's value alone: an integer in its range. Raises SettingRefused."""
    for key, value in requested.items():
        try:
            require_int(key, value, MINIMUM[key], MAXIMUM[key])
        except ValueError as exc:
            raise SettingRefused(f"{exc}{MEANING[key]}") from None


def check_envelope(new: LiveSettings, startup: OEAConfig) -> None:
    """The gate may only narrow the startup window. Raises SettingRefused."""
    if new.min_batch < startup.min_batch:
        raise SettingRefused(f"oea_min_batch must be >= {startup.min_batch}, the server's --oea-min-batch, "
                             f"got {new.min_batch} ({WHY_ENVELOPE})")
    if startup.max_batch and not 0 < new.max_batch <= startup.max_batch:
        raise SettingRefused(f"oea_max_batch must be between oea_min_batch and {startup.max_batch}, the server's "
                             f"--oea-max-batch (0, no cap, is outside it), got {new.max_batch} ({WHY_ENVELOPE})")


def check_request(current: LiveSettings, requested: Mapping[str, Any], startup: OEAConfig,
                  widths: Sequence[int] = ()) -> LiveSettings:
    """The settings a request's OEA keys leave in force, merged into `current`.

    Args:
        current: the settings requested last (pending, else in force).
        requested: {POST key: value}, OEA keys only.
        startup: the server's startup config (its gate is the envelope).
        widths: draft tokens per request of the verify passes the server runs (() without them):
            a gate no verify pass can open is refused, as at startup (passes.verify_cap_problem).
    Raises SettingRefused: the message starts with the request and names what is allowed.
    """
    try:
        check_values(requested)
        new = replace(current, **{LIVE_KEYS[key]: value for key, value in requested.items()})
        try:
            check_batch_window("oea_min_batch", new.min_batch, "oea_max_batch", new.max_batch)
        except ValueError as exc:
            raise SettingRefused(f"{exc} (in force after this request: oea_min_batch {new.min_batch}, "
                                 f"oea_max_batch {new.max_batch})") from None
        check_envelope(new, startup)
        refusal, _ = verify_cap_problem(new.min_batch, new.max_batch, widths, LIVE_NAMES)
        if refusal:
            raise SettingRefused(refusal)
    except SettingRefused as exc:
        raise SettingRefused(f"sglang-oea: refused {json.dumps(dict(requested))}: {exc}; nothing changed") from None
    return new


def cap_warning(new: LiveSettings, widths: Sequence[int]) -> Optional[str]:
    """The warning an accepted request gets when its cap closes the gate for some verify widths."""
    warning = verify_cap_problem(new.min_batch, new.max_batch, widths, LIVE_NAMES)[1]
    return None if warning is None else f"sglang-oea: accepted, but {warning}"


def oea_part(request: Mapping[str, Any]) -> Dict[str, Any]:
    """The OEA keys of a /set_internal_state request."""
    return {key: value for key, value in request.items() if key in LIVE_KEYS}


def check_not_mixed(keys: Mapping[str, Any], others: Sequence[str]) -> None:
    """A request's OEA keys may not come with other keys (see SEND_APART). Raises SettingRefused.

    Args:
        keys: {POST key: value}, the request's OEA keys.
        others: the request's other keys, in request order.
    """
    if others:
        raise SettingRefused(f"sglang-oea: refused {json.dumps(dict(keys))} sent with {', '.join(others)}: "
                             f"{SEND_APART}; nothing changed")


def state_of(runtime: Any) -> Dict[str, Any]:
    """internal_states[i]["oea"] of /server_info: the settings in force, the pending change if
    any, the startup envelope, --oea-verify, and the routing kernel (kernel_state)."""
    state: Dict[str, Any] = asdict(runtime.settings)
    if runtime.pending is not None:
        state["pending"] = asdict(runtime.pending)
    state["envelope"] = {"min_batch": runtime.cfg.min_batch, "max_batch": runtime.cfg.max_batch}
    state["verify"] = runtime.cfg.verify
    state["kernel"] = kernel_state(runtime)
    if getattr(runtime, "dp_rank", None) is not None:  # replicas answer in any order: say which
        state["dp_rank"] = runtime.dp_rank
    shape = getattr(runtime, "moe_shape", None)
    if shape is not None:  # what a client needs to choose k0 without the model's files
        state["model"] = {"num_experts": shape.num_experts, "top_k": shape.top_k}
    return state


def kernel_state(runtime: Any) -> Dict[str, Any]:
    """How this server routes: --oea-kernel, and per (router, self-check result) the routing shapes
    that use it. Every tensor-parallel rank makes the same choice (a MIN over the ranks' self-check
    verdicts), so rank 0's answer stands for all of them: "passed" means passed on every rank,
    "failed_other_rank" that another rank failed (its log has the reason). Before the first
    decode pass: one path, router = the flag, self_check "pending"."""
    paths = [{"router": router, "self_check": result, "shapes": shapes}
             for (router, result), shapes in runtime.routers.status().items()]
    return {"flag": runtime.cfg.kernel, "paths": paths, "tp_size": runtime.world_size}


# ----------------------------------------------------------------------------- SGLang's handlers


@dataclass
class _Request:
    """One /set_internal_state request in a scheduler: its OEA keys, its other keys (refused with
    them: check_not_mixed) and what the OEA keys leave in force."""

    keys: Dict[str, Any]
    others: Tuple[str, ...] = ()
    new: Optional[LiveSettings] = None
    applied: bool = False


_request: Optional[_Request] = None


@contextmanager
def whole_request(server_args: Mapping[str, Any]) -> Iterator[None]:
    """While SGLang handles one request: the handlers see all of its keys."""
    global _request
    others = tuple(key for key in server_args if key not in LIVE_KEYS)
    previous, _request = _request, _Request(oea_part(server_args), others)
    try:
        yield
    finally:
        _request = previous


class Handler(NamedTuple):
    """What SGLang's controller calls for a key: validate(key, value), then apply(key, value)."""

    validate: Callable[[str, Any], None]
    apply: Callable[[str, Any], Optional[dict]]


def handlers(runtime: Any) -> Dict[str, Handler]:
    """A handler per OEA key: with the runtime, validate and request; without (OEA not
    installed), refuse."""
    if runtime is None:
        handler = Handler(refuse_not_installed, lambda key, value: None)
    else:
        handler = Handler(lambda key, value: validate(runtime, key, value),
                          lambda key, value: apply(runtime, key, value))
    return dict.fromkeys(LIVE_KEYS, handler)


def rejected(message: str) -> Exception:
    """SGLang's refusal: the controller logs its message once and replies {"updated": false}."""
    from sglang.srt.managers.scheduler_components.internal_state import UpdateRejected

    return UpdateRejected(message)


def refuse_not_installed(key: str, value: Any) -> None:
    raise rejected(f"sglang-oea: refused {json.dumps({key: value})}: {NOT_INSTALLED}")


def request_of(runtime: Any, key: str, value: Any) -> _Request:
    """The request being handled, its OEA keys checked together once (and refused with any other
    key); outside set_internal_state (a caller of the controller's handlers other than SGLang's),
    this key alone. Raises SGLang's UpdateRejected."""
    request = _request if _request is not None and key in _request.keys else _Request({key: value})
    if request.new is None:
        try:
            check_not_mixed(request.keys, request.others)
            request.new = check_request(runtime.pending or runtime.settings, request.keys, runtime.cfg,
                                        runtime.verify_widths)
        except SettingRefused as exc:
            raise rejected(str(exc)) from None
    return request


def validate(runtime: Any, key: str, value: Any) -> None:
    request_of(runtime, key, value)


def apply(runtime: Any, key: str, value: Any) -> None:
    """Every key of the request validated: request the settings it leaves in force, once per
    request (no SGLang config override)."""
    request = request_of(runtime, key, value)
    if not request.applied:
        runtime.request_settings(request.new)
        request.applied = True
        warning = cap_warning(request.new, runtime.verify_widths)
        if warning:
            logger.warning(warning)  # on every rank: each handles the request


# ----------------------------------------------------------------------------- sglang.Engine


def set_engine_settings(engine: Any, oea_k0: Optional[int] = None, oea_min_batch: Optional[int] = None,
                        oea_max_batch: Optional[int] = None) -> List[bool]:
    """What POST /set_internal_state does, for an in-process `sglang.Engine` (SGLang 0.5.23's
    Engine has no such method). Returns SGLang's reply, one bool per data-parallel rank; False =
    refused (the reason is in the log). Raises ValueError before sending a value that is not an
    integer in its key's range (a bool would not survive SGLang's IPC decoding).
    Read back with engine.get_server_info()["internal_states"][0]["oea"].
    """
    from sglang.srt.managers.io_struct import SetInternalStateReq

    given = {"oea_k0": oea_k0, "oea_min_batch": oea_min_batch, "oea_max_batch": oea_max_batch}
    settings = {key: value for key, value in given.items() if value is not None}
    if not settings:
        raise ValueError(f"set_engine_settings: give at least one of {', '.join(LIVE_KEYS)}")
    check_values(settings)
    request = SetInternalStateReq(server_args=settings)
    return engine.loop.run_until_complete(engine.tokenizer_manager.set_internal_state(request))
