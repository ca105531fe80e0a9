"""The trial's preflight (trial.py): what the server says about itself, read before any load, and
whether a trial on it can mean anything.

Reads GET /server_info once: each scheduler's OEA state (internal_states[i]["oea"]: the settings
in force, the startup envelope, --oea-verify, the routing kernel and its self-check), SGLang's own
fields (speculative_algorithm, speculative_num_draft_tokens, enable_metrics, tp_size, dp_size,
decode_log_interval) and the model's top-k (its config.json). Then, for every concurrency C, whether
OEA's batch gate can open there: a decode or verify pass of R = min(C, max running requests)
requests routes R x D token rows (D = draft tokens under speculative decoding, else 1); the gate is
open when R >= min_batch and, with a cap, R x D <= max_batch.

What cannot give a meaningful trial raises TrialRefused, naming the flag or field and what to do.
Nothing is sent but that one GET.
"""

import json
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from serving.live_settings import LiveSettingsError, current_settings, oea_states, read_server_info

# config.json keys that hold a MoE model's top-k, by model family.
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token")
FAILED_CHECKS = ("failed", "failed_other_rank")


class TrialRefused(RuntimeError):
    """The trial cannot mean anything on this server with these flags; nothing was sent but a GET."""


@dataclass
class Gate:
    """Whether OEA's batch gate can open at one concurrency."""

    concurrency: int
    requests: int  # requests in a pass: min(C, the server's max running requests)
    rows: int  # routed token rows: requests x rows per request
    open: bool
    why: str  # one line: the arithmetic that decides it


@dataclass
class Preflight:
    """What the server said, and what the trial will do with it."""

    url: str
    info: Dict  # /server_info, whole
    states: List[Dict]  # internal_states[i]["oea"]
    original: Dict[str, int]  # the settings in force (or pending) now: put back at the end
    top_k: Optional[int]
    speculative: Optional[str]  # SGLang's speculative_algorithm, None without
    rows_per_request: int  # draft tokens under speculative decoding, else 1
    max_running: Optional[int]
    gates: List[Gate]
    lines: List[str] = field(default_factory=list)  # what the preflight prints and the report shows
    warnings: List[str] = field(default_factory=list)

    @property
    def open_concurrencies(self) -> List[int]:
        return [g.concurrency for g in self.gates if g.open]

    @property
    def decode_log_interval(self) -> int:
        value = self.info.get("decode_log_interval")
        return int(value) if isinstance(value, int) and value > 0 else 40


def read_states(url: str) -> Tuple[Dict, List[Dict]]:
    """(/server_info, its OEA states); TrialRefused when the server has no OEA state."""
    try:
        info = read_server_info(url)
    except LiveSettingsError as e:
        raise TrialRefused(f"{e}: no server answers at --url {url}") from None
    try:
        return info, oea_states(info, url)
    except LiveSettingsError as e:
        raise TrialRefused(f"{e}. Start the server with --oea-k0 0 (the plugin armed, OEA off) and "
                           "--enable-metrics, plus your usual flags") from None


def model_top_k(info: Dict, tokenizer: Optional[str]) -> Optional[int]:
    """The model's top-k: from the OEA state when the plugin reports it (internal_states[0]["oea"]
    ["model"]["top_k"]), else from config.json in the --tokenizer or the server's model_path
    directory (when either is a directory on this machine), else None."""
    reported = ((info.get("internal_states") or [{}])[0].get("oea") or {}).get("model") or {}
    if isinstance(reported.get("top_k"), int) and reported["top_k"] > 0:
        return reported["top_k"]
    for directory in (tokenizer, info.get("model_path")):
        path = os.path.join(directory or "", "config.json")
        if directory and os.path.isfile(path):
            with open(path) as f:
                config = json.load(f)
            for source in (config, config.get("text_config") or {}):
                for key in TOP_K_KEYS:
                    if isinstance(source.get(key), int) and source[key] > 0:
                        return source[key]
    return None


def gate_at(conc: int, settings: Dict[str, int], rows_per_request: int, max_running: Optional[int]) -> Gate:
    """Whether the gate in `settings` (oea_min_batch requests, oea_max_batch token rows, 0 = no cap)
    can open for a pass at concurrency conc."""
    requests = min(conc, max_running) if max_running else conc
    rows = requests * rows_per_request
    floor, cap = settings.get("oea_min_batch", 1), settings.get("oea_max_batch", 0)
    reqs = f"{requests} request{'s' if requests != 1 else ''}"
    per = f"{reqs} x {rows_per_request} rows = {rows} rows" if rows_per_request > 1 else reqs
    capped = f"; the server runs at most {max_running} requests at once" if requests < conc else ""
    if requests < floor:
        return Gate(conc, requests, rows, False, f"{per} < min_batch {floor}{capped}")
    if cap and rows > cap:
        return Gate(conc, requests, rows, False, f"{per} > max_batch {cap} token rows{capped}")
    bound = f"<= max_batch {cap} rows" if cap else "no max_batch cap"
    return Gate(conc, requests, rows, True, f"{per}: >= min_batch {floor}, {bound}{capped}")


def kernel_lines(states: List[Dict]) -> Tuple[List[str], bool]:
    """One line per scheduler on its routing kernel and self-check, and whether OEA turned itself
    off on every routing path of some scheduler (a failed self-check under --oea-kernel auto)."""
    lines, all_off = [], False
    for i, state in enumerate(states):
        kernel = state.get("kernel")
        if not isinstance(kernel, dict):
            lines.append(f"scheduler {i}: kernel not reported by this plugin version")
            continue
        paths = kernel.get("paths") or []
        shown = ", ".join(f"{p.get('router')} (self-check {p.get('self_check')}, {p.get('shapes')} shapes)"
                          for p in paths) or "no routing path yet"
        lines.append(f"scheduler {i}: --oea-kernel {kernel.get('flag')}, tp_size {kernel.get('tp_size')}: {shown}")
        all_off = all_off or (bool(paths) and all(p.get("router") == "off" for p in paths))
    return lines, all_off


def check_k0s(k0s: Sequence[int], top_k: Optional[int]) -> Optional[str]:
    """Why --k0 values cannot be trialled (None when they can): each must be 1..top-k - 1."""
    high = (top_k - 1) if top_k else 64
    bad = [k for k in k0s if not 1 <= k <= high]
    if not bad:
        return None
    allowed = f"1 to {high} (the model's top-k is {top_k}: k0 >= top-k changes nothing)" if top_k else "1 to 64"
    return f"--k0 {' '.join(map(str, bad))}: each k0 must be an integer from {allowed}; 0 is the baseline arm itself"


def preflight(url: str, tokenizer: Optional[str], k0s: Sequence[int], concurrencies: Sequence[int]) -> Preflight:
    """Read the server once and decide; TrialRefused with the reason when the trial cannot mean anything."""
    info, states = read_states(url)
    try:
        original = current_settings(states, base_url=url)
    except LiveSettingsError as e:
        raise TrialRefused(str(e)) from None
    speculative = info.get("speculative_algorithm") or None
    rows = int(info.get("speculative_num_draft_tokens") or 1) if speculative else 1
    first = info.get("internal_states", [{}])[0]
    max_running = first.get("effective_max_running_requests_per_dp") or info.get("max_running_requests") or None
    gates = [gate_at(c, original, rows, max_running) for c in concurrencies]
    pre = Preflight(url, info, states, original, model_top_k(info, tokenizer), speculative, rows, max_running, gates)
    describe(pre)
    refuse_if_meaningless(pre, k0s)
    return pre


def describe(pre: Preflight) -> None:
    """pre.lines: the preflight's findings, one line each; pre.warnings: what the operator should know."""
    s = pre.original
    envelope = pre.states[0].get("envelope") or {}
    k0_now = s.get("oea_k0", 0)
    pre.lines.append(f"OEA armed on {len(pre.states)} scheduler(s); in force: k0 {k0_now}"
                     f"{' (off)' if k0_now == 0 else ''}, min_batch {s.get('oea_min_batch')} requests, max_batch "
                     f"{s.get('oea_max_batch') or 'no cap'}{' token rows' if s.get('oea_max_batch') else ''}")
    pre.lines.append(f"startup envelope (the widest gate live settings may set): min_batch >= "
                     f"{envelope.get('min_batch', '?')}, max_batch <= {envelope.get('max_batch') or 'no cap'}")
    kernels, _ = kernel_lines(pre.states)
    pre.lines += [f"kernel: {line}" for line in kernels]
    verify = pre.states[0].get("verify")
    spec = (f"{pre.speculative}, {pre.rows_per_request} draft tokens per request (a verify pass routes requests x "
            f"{pre.rows_per_request} rows); --oea-verify {'on' if verify in (True, None) else 'off'}"
            if pre.speculative else "none (decode passes route one row per request)")
    pre.lines.append(f"speculative decoding: {spec}")
    metrics = "on" if pre.info.get("enable_metrics") else "OFF"
    pre.lines.append(f"metrics: {metrics}; step counters reach /metrics every "
                     f"{pre.decode_log_interval} decode steps (--decode-log-interval); tp_size "
                     f"{pre.info.get('tp_size', '?')}, dp_size {pre.info.get('dp_size', '?')}")
    pre.lines.append(f"model top-k: {pre.top_k or 'unknown (no config.json in --tokenizer or the model path)'}")
    if k0_now:
        pre.warnings.append(f"OEA is on now (k0 {k0_now}): the trial measures OEA off against each --k0 and puts "
                            f"k0 {k0_now} back at the end")


def refuse_if_meaningless(pre: Preflight, k0s: Sequence[int]) -> None:
    """TrialRefused for what makes every measurement of this trial meaningless."""
    if not pre.info.get("enable_metrics"):
        raise TrialRefused("the server runs without --enable-metrics: the trial reads T, the share of steps OEA "
                           "applied and accept length from /metrics. Restart it with --enable-metrics")
    problem = check_k0s(k0s, pre.top_k)
    if problem:
        raise TrialRefused(problem)
    if pre.speculative and pre.states[0].get("verify") is False:
        raise TrialRefused(f"--oea-verify off with --speculative-algorithm {pre.speculative}: the target model decodes "
                           "only in verify passes, so OEA applies nowhere. Restart with --oea-verify on (the default)")
    _, all_off = kernel_lines(pre.states)
    if all_off:
        raise TrialRefused("OEA turned itself off on this server (the routing kernel failed its startup self-check "
                           "under --oea-kernel auto; the server log says why): see docs/gpu.md, 'The startup "
                           "self-check'")
    if not pre.open_concurrencies:
        closed = "; ".join(f"C={g.concurrency}: {g.why}" for g in pre.gates)
        raise TrialRefused(f"OEA's batch gate cannot open at any --concurrency ({closed}). Choose concurrencies "
                           "inside the gate, or widen it: oea_max_batch counts token rows (requests x draft tokens "
                           "under speculative decoding), so C=64 with 4 draft tokens needs --oea-max-batch 256")
