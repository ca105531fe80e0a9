"""The quality A/B's client: every prompt of an arm through one OpenAI-compatible server, greedy,
a fixed number of requests in flight, in order. Standard library only.

Every request carries the key its endpoint needs (common/http.py, from the keys registered for the
server). Tokens are compared by id: SGLang's /v1/completions returns the generated ids in
choices[0].token_ids when asked with "return_token_ids": true (logprobs tokens are display
strings, and two ids can render the same).
"""

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Optional, Sequence

from common.oea_metrics import applied_share
from serving.quality_inputs import Item, Prompt, prompts_digest
from common import http
from common.http import http_json


def fetch_text(url: str, timeout: float = 30.0) -> Optional[str]:
    """Body of a GET, or None when the server does not serve it (404, 401, connection refused...)."""
    return http.http_get(url, timeout)


def served_model(base_url: str) -> str:
    """The first id of /v1/models, or 'default' when the server lists none."""
    body = fetch_text(base_url + "/v1/models")
    try:
        models = json.loads(body)["data"] if body else []
    except (ValueError, KeyError, TypeError):
        models = []
    return models[0]["id"] if models and isinstance(models[0], dict) and "id" in models[0] else "default"


def flush_cache(base_url: str) -> bool:
    """Ask SGLang to drop its prefix cache (so both arms prefill alike); False if it did not."""
    return http.flush_cache(base_url) is None


def complete(base_url: str, model: str, prompt: Prompt, opts: argparse.Namespace) -> Dict:
    """One greedy completion: {"text", "token_ids", "finish_reason"}, and "spec" when
    opts.spec_details is set (a speculative-decoding server's own figures for this request)."""
    spec = getattr(opts, "spec_details", False)  # only the speculative study's namespaces carry it
    payload = {"model": model, "prompt": prompt if isinstance(prompt, str) else list(prompt),
               "max_tokens": opts.max_tokens, "temperature": 0, "return_token_ids": True}
    if opts.ignore_eos:
        payload["ignore_eos"] = True
    if spec:
        payload["return_spec_tokens_details"] = True
    answer = http_json(base_url + "/v1/completions", payload, opts.timeout)
    choice = answer["choices"][0]
    if choice.get("token_ids") is None:
        raise RuntimeError(f"{base_url}: no choices[0].token_ids in the answer; the server must support "
                           "SGLang's return_token_ids")
    out = {"text": choice["text"], "token_ids": choice["token_ids"], "finish_reason": choice.get("finish_reason")}
    if spec:
        out["spec"] = spec_figures(answer, base_url)
    return out


def spec_figures(answer: Dict, base_url: str) -> Dict:
    """SGLang's speculative figures of one request ("sglext": {"spec_tokens_details": ...}, asked
    with return_spec_tokens_details): {"accept_length": completion tokens / verify steps,
    "verify_steps"}. RuntimeError when the server did not send them (not speculative)."""
    details = (answer.get("sglext") or {}).get("spec_tokens_details")
    if not details or not details.get("spec_verify_ct"):
        raise RuntimeError(f"{base_url}: no sglext.spec_tokens_details in the answer; is the server running "
                           "with --speculative-algorithm?")
    return {"accept_length": details["spec_accept_length"], "verify_steps": details["spec_verify_ct"]}


def k0_in_force(base_url: str) -> Optional[int]:
    """The k0 the server routes its next passes with (a pending change, else the one in force), from
    /server_info's first scheduler; None for a server without OEA's live state (no plugin, or a
    plain baseline server): its steps then carry no k0 label to tell apart."""
    body = fetch_text(base_url + "/server_info")
    try:
        states = json.loads(body)["internal_states"] if body else None
        state = states[0]["oea"]
        return int((state.get("pending") or state)["k0"])
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def run_arm(name: str, base_url: str, items: Sequence[Item], opts: argparse.Namespace) -> Dict:
    """All prompts through one server, `opts.concurrency` in flight, in order; the arm record.

    Its "oea_steps" counts only the decode steps labelled with the k0 in force when the arm starts
    (oea_metrics: an earlier arm's late steps are not this arm's)."""
    base_url = base_url.rstrip("/")
    model = opts.model or served_model(base_url)
    flushed = flush_cache(base_url)
    k0 = k0_in_force(base_url)
    metrics_before = fetch_text(base_url + "/metrics")
    start = time.time()
    print(f"[quality] arm {name}: {len(items)} prompts at concurrency {opts.concurrency} -> {base_url}", flush=True)
    with ThreadPoolExecutor(opts.concurrency) as pool:
        outputs = list(pool.map(lambda it: complete(base_url, model, it.prompt, opts), items))
    elapsed = time.time() - start
    return {"name": name, "url": base_url, "model": model, "concurrency": opts.concurrency,
            "max_tokens": opts.max_tokens, "ignore_eos": opts.ignore_eos, "prompts_sha256": prompts_digest(items),
            "cache_flushed": flushed, "elapsed_s": elapsed, "outputs": outputs,
            "oea_steps": applied_share(metrics_before, fetch_text(base_url + "/metrics"), k0)}
