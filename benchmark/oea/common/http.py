"""HTTP helpers for talking to a running SGLang server (standard library only), and the one place
where the server's keys are kept and put on requests.

SGLang 0.5.23's rules (utils/auth.py, `decide_request_auth`; the level of each endpoint in
entrypoints/http_server.py):

    /health*, /ready*, /metrics             always open
    /set_internal_state, /flush_cache, ...   ADMIN_OPTIONAL: the admin key when the server has
                                            --admin-api-key, else the API key when it has --api-key
    everything else (/server_info,           NORMAL: the API key when the server has --api-key
      /generate, /v1/*)                     (the admin key does not do there), else open

A key goes as `Authorization: Bearer KEY`; a refusal is HTTP 401 {"error": "Unauthorized"}.
`use_auth(url, Auth(...))` registers a server's keys once; every request made through this module
to that server (host and port) then carries the right one. Children that send their own requests
(bench_serving, lm-eval) get the API key in their environment instead (serving/servers.client_env).

SGLang's /server_info shows `api_key`, `admin_api_key` and the launch command line in plain text:
`redact` blanks them (and every known key wherever it appears) before anything is saved.
"""

import json
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

OPEN_PREFIXES = ("/health", "/ready", "/metrics")
ADMIN_PATHS = ("/set_internal_state", "/flush_cache")  # the ADMIN_OPTIONAL endpoints this project calls
REDACTED = "<redacted>"
# Field and flag names that hold a secret (SGLang's api_key, admin_api_key, ssl_keyfile_password,
# watermark_key, ...), in snake case.
KEY_LIKE = re.compile(r"(?:^|_)(?:key|password|passwd|secret|token)$")


@dataclass(frozen=True)
class Auth:
    """One server's keys: api_key (its --api-key), admin_api_key (its --admin-api-key); None = not given."""

    api_key: Optional[str] = None
    admin_api_key: Optional[str] = None

    def __repr__(self) -> str:  # a key never reaches a log through repr()
        return (f"Auth(api_key={'set' if self.api_key else None}, "
                f"admin_api_key={'set' if self.admin_api_key else None})")

    def key_for(self, path: str) -> Optional[str]:
        """The key a request to `path` needs (None: send none)."""
        if path.startswith(OPEN_PREFIXES):
            return None
        if path.startswith(ADMIN_PATHS):
            return self.admin_api_key or self.api_key
        return self.api_key

    def headers_for(self, path: str) -> Dict[str, str]:
        key = self.key_for(path)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def secrets(self) -> List[str]:
        return [k for k in (self.api_key, self.admin_api_key) if k]

    def bench_flushes(self) -> bool:
        """Whether bench_serving's own --flush-cache works: it sends only OPENAI_API_KEY (the API key),
        so not when /flush_cache needs an admin key that differs from it."""
        return self.key_for("/flush_cache") == self.api_key


_AUTH: Dict[str, Auth] = {}  # by "host:port"


def _server(url: str) -> str:
    return urllib.parse.urlparse(url).netloc


def use_auth(url: str, auth: Auth) -> None:
    """Register the keys of the server at `url` (any URL on it) for every later request to it."""
    _AUTH[_server(url)] = auth


def auth_for(url: str, admin_api_key: Optional[str] = None) -> Auth:
    """The keys registered for the server at `url`; `admin_api_key` (a caller's own --admin-api-key)
    fills in the admin key when none is registered."""
    auth = _AUTH.get(_server(url), Auth())
    if admin_api_key and not auth.admin_api_key:
        auth = Auth(auth.api_key, admin_api_key)
    return auth


def request_headers(url: str, admin_api_key: Optional[str] = None) -> Dict[str, str]:
    """The Authorization header a request to `url` carries ({} when it needs none)."""
    return auth_for(url, admin_api_key).headers_for(urllib.parse.urlparse(url).path or "/")


class HTTPStatusError(RuntimeError):
    """The server answered with an HTTP error; `code` is its status (401: a key missing or wrong)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def http_get(url: str, timeout: float = 5.0) -> Optional[str]:
    """Body of a 200 answer, or None on any error."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=request_headers(url)),
                                    timeout=timeout) as resp:
            if resp.status == 200:
                return resp.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError, ValueError):
        pass
    return None


def http_status(url: str, timeout: float = 5.0) -> Optional[int]:
    """The HTTP status of a GET (401 included), or None when nothing answers."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=request_headers(url)),
                                    timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError, ValueError):
        return None


def http_json(url: str, payload: Optional[Dict] = None, timeout: float = 600.0,
              headers: Optional[Dict[str, str]] = None):
    """GET (payload None) or POST JSON; the decoded answer. HTTPStatusError (a RuntimeError) with the
    body on HTTP errors; URLError / OSError when nothing answers. The registered key for the path
    goes with it; headers: extra request headers, which win."""
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json", **request_headers(url),
                                                 **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        raise HTTPStatusError(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')[:500]}", e.code) from None
    try:
        return json.loads(body)
    except json.JSONDecodeError:
        raise RuntimeError(f"{url}: the answer is not JSON: {body[:200]!r}") from None


def flush_cache(base_url: str, admin_api_key: Optional[str] = None, timeout: float = 60.0) -> Optional[str]:
    """POST /flush_cache (SGLang drops its prefix cache) with the key it needs (admin_api_key: see
    auth_for); None when flushed, else why not (HTTP status and body, or the connection error)."""
    url = base_url.rstrip("/") + "/flush_cache"
    request = urllib.request.Request(url, b"", request_headers(url, admin_api_key), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return None if response.status == 200 else f"HTTP {response.status}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}: {e.read().decode(errors='replace')[:200]}"
    except (urllib.error.URLError, OSError) as e:
        return str(e)


def redact(value: Any, secrets: Sequence[str] = ()) -> Any:
    """A copy of a decoded JSON value with every key-like field (KEY_LIKE, e.g. api_key,
    admin_api_key) that holds a string set to REDACTED, every value after a key-like flag in a
    command line (a list, or a string such as /server_info's launch_command) too, and every
    occurrence of `secrets` and of the registered keys replaced by REDACTED."""
    known = sorted({*secrets, *(k for a in _AUTH.values() for k in a.secrets())}, key=len, reverse=True)
    return _redact(value, known)


def _redact(value: Any, known: List[str]) -> Any:
    if isinstance(value, dict):
        return {k: (REDACTED if isinstance(v, str) and v and _key_like(k) else _redact(v, known))
                for k, v in value.items()}
    if isinstance(value, list):
        if all(isinstance(v, str) for v in value):
            return redact_argv(value, known)
        return [_redact(v, known) for v in value]
    if isinstance(value, str):
        return _redact_text(value, known)
    return value


def _key_like(name: str) -> bool:
    return bool(KEY_LIKE.search(str(name).lstrip("-").replace("-", "_").lower()))


def redact_argv(argv: Sequence[str], secrets: Sequence[str] = ()) -> List[str]:
    """A command line with the value of every key-like flag (--api-key KEY, --admin-api-key=KEY, ...)
    and every occurrence of `secrets` replaced by REDACTED."""
    known = sorted({*secrets, *(k for a in _AUTH.values() for k in a.secrets())}, key=len, reverse=True)
    out: List[str] = []
    for i, arg in enumerate(argv):
        if arg.startswith("--") and "=" in arg and _key_like(arg.split("=", 1)[0]):
            out.append(arg.split("=", 1)[0] + "=" + REDACTED)
        elif i > 0 and argv[i - 1].startswith("--") and "=" not in argv[i - 1] and _key_like(argv[i - 1]):
            out.append(REDACTED)
        else:
            out.append(_redact_text(arg, known))
    return out


_FLAG_VALUE = re.compile(r"(--[A-Za-z0-9_-]+)([= ]+)(\"[^\"]*\"|'[^']*'|\S+)")


def _redact_text(text: str, known: Sequence[str]) -> str:
    for secret in known:
        text = text.replace(secret, REDACTED)
    if "--" in text:
        text = _FLAG_VALUE.sub(lambda m: m.group(1) + m.group(2) + REDACTED if _key_like(m.group(1)) else m.group(0),
                               text)
    return text
