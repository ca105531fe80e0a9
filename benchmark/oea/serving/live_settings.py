"""OEA's live settings on a running server: set them, read them back, refuse what does not match.

Standard library only. A server started with `--oea-k0 K` (K may be 0: the plugin installed, OEA
off) takes, through SGLang's own endpoint,

    POST /set_internal_state  {"server_args": {"oea_k0": 4, "oea_min_batch": 2, "oea_max_batch": 0}}
        -> [true, ...]    one boolean per data-parallel rank; false = refused (the reason is in the
                          server log); one request is applied whole or not at all
    GET  /server_info     -> {"internal_states": [{"oea": {"k0": 4, "min_batch": 2, "max_batch": 0,
                             "pending": {...}, ...}, ...}, ...], "decode_log_interval": 40, ...}

`oea_k0` 0 turns OEA off (SGLang's own routing). A change takes effect at the next forward pass:
until one runs, a scheduler reports the settings in force and the requested ones under "pending".
So a change is confirmed twice: accepted (every scheduler reports it, pending or in force) right
after the POST, and in force (no other change pending) once the server has run a pass since. With
`--admin-api-key KEY` the POST needs `Authorization: Bearer KEY` (with `--api-key` alone, the API
key), and with `--api-key` the GET needs the API key: common/http puts the registered key on each.
/server_info also holds the server's keys in plain text: read_server_info returns it redacted.

put_back sets settings, runs one pass and confirms them in force, retrying with backoff: what the
trial and its guard use to restore a server.

A settings dict maps the POST's keys (oea_k0, oea_min_batch, oea_max_batch) to integers; each
scheduler reports the same value under the key without its `oea_` prefix.
"""

import json
import time
import urllib.error
from typing import Callable, Dict, List, Optional, Sequence

from common.http import auth_for, http_json, redact

Settings = Dict[str, int]  # {"oea_k0": 4, ...}
SETTING_KEYS = ("oea_k0", "oea_min_batch", "oea_max_batch")
DEFAULT_DECODE_LOG_INTERVAL = 40  # SGLang's --decode-log-interval default


RESTORE_DELAYS = (1.0, 2.0, 4.0, 8.0)  # put_back: seconds before each retry (5 attempts, about 15 s of waits)


class LiveSettingsError(RuntimeError):
    """The server refused a setting, did not confirm it, or does not support live OEA settings."""


# Called as fn(base_url, settings) right before each POST (the trial's guard learns the trial's last
# settings this way; see trial/guard.py).
_watchers: List[Callable[[str, Settings], None]] = []


def watch_settings(fn: Callable[[str, Settings], None]) -> Callable[[], None]:
    """Call fn(base_url, settings) before every POST of post_settings; returns the function that stops it."""
    _watchers.append(fn)
    return lambda: _watchers.remove(fn) if fn in _watchers else None


def arm_settings(k0: int, min_batch: Optional[int] = None, max_batch: Optional[int] = None) -> Settings:
    """The POST body's server_args for one arm: k0 (0 = OEA off), and the batch gate when given."""
    settings = {"oea_k0": k0}
    if min_batch is not None:
        settings["oea_min_batch"] = min_batch
    if max_batch is not None:
        settings["oea_max_batch"] = max_batch
    return settings


def read_server_info(base_url: str, timeout: float = 30.0) -> Dict:
    """GET /server_info, decoded, its keys redacted (common/http.redact: SGLang shows api_key,
    admin_api_key and the launch command line in plain text). LiveSettingsError when the server
    does not answer it."""
    try:
        info = http_json(base_url + "/server_info", timeout=timeout)
    except (RuntimeError, urllib.error.URLError, OSError) as e:
        raise LiveSettingsError(f"{base_url}/server_info: {e}") from None
    if not isinstance(info, dict):
        raise LiveSettingsError(f"{base_url}/server_info: expected a JSON object, got {type(info).__name__}")
    return redact(info)


def oea_states(info: Dict, base_url: str = "the server") -> List[Dict]:
    """internal_states[i]["oea"] of a /server_info answer: [one dict per scheduler]. LiveSettingsError
    when a scheduler reports none (a server without the live-settings plugin, or started without
    --oea-k0)."""
    states = info.get("internal_states")
    if not isinstance(states, list) or not states:
        raise LiveSettingsError(f"{base_url}/server_info has no internal_states")
    found = [s.get("oea") if isinstance(s, dict) else None for s in states]
    missing = [i for i, s in enumerate(found) if not isinstance(s, dict)]
    if missing:
        raise LiveSettingsError(
            f"{base_url}/server_info: scheduler(s) {missing} report no OEA state (internal_states[i]['oea']); "
            "the server needs the sglang_oea plugin with live settings, started with --oea-k0 (0 = armed, off)")
    return found


def check_states(states: List[Dict], settings: Settings, base_url: str = "the server",
                 in_force: bool = True) -> None:
    """LiveSettingsError unless every scheduler reports every value of `settings`, naming each
    scheduler's values. in_force: the values in force, and no other change pending; else the
    values a scheduler will route with from its next pass (its pending change, if any, else those
    in force)."""
    want = {key[len("oea_"):]: value for key, value in settings.items()}

    def matches(state: Dict) -> bool:
        pending = state.get("pending")
        views = ([state] + ([pending] if pending else [])) if in_force else [pending or state]
        return all(view.get(k) == v for view in views for k, v in want.items())

    wrong = [i for i, state in enumerate(states) if not matches(state)]
    if wrong:
        seen = "; ".join(f"scheduler {i}: " + ", ".join(f"{k}={states[i].get(k)!r}" for k in want)
                         + (f", pending {states[i]['pending']}" if states[i].get("pending") else "") for i in wrong)
        what = "have in force" if in_force else "accept"
        raise LiveSettingsError(f"{base_url} did not {what} {json.dumps(settings)}: {seen}")


def post_settings(base_url: str, settings: Settings, admin_api_key: Optional[str] = None,
                  timeout: float = 60.0) -> List[bool]:
    """POST /set_internal_state {"server_args": settings} with the key it needs (the registered one,
    or admin_api_key when none is); the reply, one boolean per DP rank. LiveSettingsError when a
    rank refused, or the reply is not a list of booleans."""
    url = base_url + "/set_internal_state"
    headers = auth_for(url, admin_api_key).headers_for("/set_internal_state")
    for fn in list(_watchers):
        fn(base_url, settings)
    try:
        reply = http_json(url, {"server_args": settings}, timeout, headers)
    except (RuntimeError, urllib.error.URLError, OSError) as e:
        raise LiveSettingsError(f"setting {json.dumps(settings)} failed: {e}") from None
    if not isinstance(reply, list) or not reply or not all(isinstance(x, bool) for x in reply):
        raise LiveSettingsError(f"{base_url}/set_internal_state: expected a list of booleans, got {reply!r}")
    if not all(reply):
        raise LiveSettingsError(f"{base_url} refused {json.dumps(settings)} (reply {reply}); the reason is in "
                                "the server log")
    return reply


def apply_settings(base_url: str, settings: Settings, admin_api_key: Optional[str] = None) -> Dict:
    """Set `settings`, then check through /server_info that every scheduler accepted them (pending
    until its next forward pass, or in force). Returns that /server_info answer (oea_states gives
    the states); LiveSettingsError otherwise."""
    post_settings(base_url, settings, admin_api_key)
    info = read_server_info(base_url)
    check_states(oea_states(info, base_url), settings, base_url, in_force=False)
    return info


def confirm_settings(base_url: str, settings: Settings, in_force: bool = True) -> List[Dict]:
    """Read /server_info and check `settings` on every scheduler (see check_states); the states
    [one dict per scheduler], or LiveSettingsError."""
    states = oea_states(read_server_info(base_url), base_url)
    check_states(states, settings, base_url, in_force)
    return states


def current_settings(states: List[Dict], keys=SETTING_KEYS, base_url: str = "the server") -> Settings:
    """The settings every scheduler routes with from its next pass (a pending change, else those in
    force), as a POST body (to restore them later). LiveSettingsError when the schedulers disagree."""
    first = states[0].get("pending") or states[0]
    now = {key: first.get(key[len("oea_"):]) for key in keys}
    try:
        check_states(states, now, base_url, in_force=False)
    except LiveSettingsError as e:
        raise LiveSettingsError(f"the schedulers of {base_url} disagree on their OEA settings ({e})") from None
    return {key: value for key, value in now.items() if value is not None}


def decode_log_interval(info: Dict) -> int:
    """The server's --decode-log-interval (how often OEA's counters reach /metrics), from /server_info."""
    value = info.get("decode_log_interval")
    return int(value) if isinstance(value, int) and value > 0 else DEFAULT_DECODE_LOG_INTERVAL


def run_one_pass(base_url: str, timeout: float = 120.0) -> None:
    """One 1-token request: a forward pass, at which a pending change takes effect."""
    http_json(base_url + "/generate", {"text": "0", "sampling_params": {"max_new_tokens": 1}}, timeout)


def put_back(base_url: str, settings: Settings, admin_api_key: Optional[str] = None,
             delays: Optional[Sequence[float]] = None, log: Callable[[str], None] = print) -> Dict:
    """Set `settings`, run one pass and confirm them in force on every scheduler; on any error, try
    again after each of `delays` seconds. Never raises an Exception (a KeyboardInterrupt still
    passes). Returns {"settings", "ok", "attempts", "errors": [one line per failed attempt],
    "left_at": the settings in force at the end (None when unreadable)}. delays: default RESTORE_DELAYS."""
    delays = RESTORE_DELAYS if delays is None else delays
    errors: List[str] = []
    for attempt, delay in enumerate([0.0, *delays], start=1):
        time.sleep(delay)
        try:
            apply_settings(base_url, settings, admin_api_key)
            run_one_pass(base_url)
            confirm_settings(base_url, settings)
            return {"settings": settings, "ok": True, "attempts": attempt, "errors": errors, "left_at": settings}
        except Exception as e:  # any failure is retried: the server must not be left at a trial's setting
            errors.append(f"attempt {attempt}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            log(f"putting back {json.dumps(settings)} failed ({errors[-1]})"
                + (f"; again in {delays[attempt - 1]:.0f}s" if attempt <= len(delays) else ""))
    return {"settings": settings, "ok": False, "attempts": len(delays) + 1, "errors": errors,
            "left_at": settings_now(base_url, list(settings))}


def settings_now(base_url: str, keys: Sequence[str] = SETTING_KEYS) -> Optional[Settings]:
    """The settings every scheduler routes with from its next pass (current_settings), or None when
    the server does not say (no answer, no OEA state, schedulers that disagree)."""
    try:
        return current_settings(oea_states(read_server_info(base_url, 10.0), base_url), keys, base_url)
    except Exception:  # only a description for a report: any failure means "unknown"
        return None
