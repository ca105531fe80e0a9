"""The trial's preflight (trial.py): what the server says about itself, read before any load, and
whether a trial on it can mean anything.

Reads GET /server_info once: each scheduler's OEA state (internal_states[i]["oea"]: the settings
in force, the startup envelope, --oea-verify, the routing kernel and its self-check), SGLang's own
fields (speculative_algorithm, speculative_num_draft_tokens, enable_metrics, tp_size, dp_size,
attn_dp_size, decode_log_interval) and the model's top-k (its config.json). SGLang's limits
(Limits): the requests one scheduler runs at once (internal_states[i]
["effective_max_running_requests_per_dp"], else max_running_requests / attention-DP groups; under
speculative decoding SGLang sets 48 in all when --max-running-requests is not given), the
data-parallel replicas (dp_size: each forms its own batches from about C / N of the requests), the
attention-DP groups (attn_dp_size: one scheduler each, but one batch for OEA, see below) and the
decode CUDA graphs' largest batch (cuda_graph_config.decode.max_bs).

Then, for every concurrency C, whether OEA's batch gate can open there, on the batch OEA routes:
- --dp-size N: each replica forms its own batches, R = min(C / N, max running requests);
- DP attention (--attn-dp-size G): the G groups schedule their requests apart (round robin spreads
  them), but before every MoE layer SGLang gathers them, and OEA's gate counts that gathered batch:
  R = min(C, G x a group's max running requests). The decode CUDA graphs' largest batch applies per
  group: a pass runs eagerly when its busiest group holds more (ceil(C / G) > max_bs).
R requests route R x D token rows (D = draft tokens under speculative decoding, else 1); the gate
is open when R >= min_batch on every replica (floor(C / N)) and, with a cap, R x D <= max_batch on
every replica (ceil(C / N)). A concurrency above what the server runs at once is marked (the rest
of its requests wait in the queue).

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


EAGLE_DEFAULT_MAX_RUNNING = 48  # SGLang 0.5.23 under EAGLE-family decoding without --max-running-requests


@dataclass
class Limits:
    """SGLang's own limits on the batch OEA routes, from /server_info."""

    max_running: Optional[int] = None  # requests one scheduler (a replica, or an attention-DP group) runs at once
    default_cap: bool = False  # max_running is SGLang's speculative default, not a flag
    replicas: int = 1  # data-parallel replicas (dp_size), each with its own scheduler and batches
    graph_max_bs: Optional[int] = None  # decode CUDA graphs' largest batch (None: no graphs, or not reported)
    groups: int = 1  # attention-DP groups (attn_dp_size; 1 without DP attention): one gathered batch for OEA

    @property
    def batch_max(self) -> Optional[int]:
        """The most requests in one batch OEA routes: a replica's, or every group's gathered together."""
        return self.max_running * self.groups if self.max_running else None


@dataclass
class Gate:
    """Whether OEA's batch gate can open at one concurrency, on the batch OEA routes there (one
    replica's, or under DP attention every group's requests gathered)."""

    concurrency: int
    requests: int  # requests in the pass OEA routes: min(ceil(C / replicas), max running x groups)
    rows: int  # routed token rows of that pass: requests x rows per request
    open: bool
    why: str  # one line: the arithmetic that decides it
    replicas: int = 1
    above_limit: bool = False  # C is above what the server runs at once: the rest wait
    eager: bool = False  # a scheduler's requests above the decode CUDA graphs' largest batch: eager passes
    groups: int = 1  # attention-DP groups gathered into that pass (1 without DP attention)
    group_requests: int = 0  # the busiest group's requests (= requests without DP attention): its graph bucket


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
    limits: Limits = field(default_factory=Limits)

    def gate(self, conc: int) -> Gate:
        """The gate at any concurrency (swept or not), with the server's settings and limits."""
        return gate_at(conc, self.original, self.rows_per_request, self.limits.max_running, self.limits.replicas,
                       self.limits.graph_max_bs, self.limits.groups)

    def smallest_open_concurrency(self) -> Optional[int]:
        """The smallest concurrency at which the gate opens on every replica: --oea-min-batch requests
        per replica, counted over every attention-DP group together under DP attention (under
        speculative decoding as many requests, each of D rows); None when it opens at no
        concurrency up to the largest swept one."""
        return next((c for c in range(1, max(self.open_concurrencies, default=0) + 1) if self.gate(c).open), None)

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


def gate_at(conc: int, settings: Dict[str, int], rows_per_request: int, max_running: Optional[int],
            replicas: int = 1, graph_max_bs: Optional[int] = None, groups: int = 1) -> Gate:
    """Whether the gate in `settings` (oea_min_batch requests, oea_max_batch token rows, 0 = no cap)
    can open at concurrency conc on every one of `replicas` data-parallel replicas, each forming
    passes of about conc / replicas requests; under DP attention (groups > 1) a replica's requests
    are spread over `groups` schedulers (max_running each) and OEA routes them gathered, one batch
    (see the module doc)."""
    groups = max(groups, 1)
    share = -(-conc // replicas)  # a replica's requests: the most any replica gets
    per_group = -(-share // groups)  # the busiest attention-DP group's (round robin): the graph bucket's

    def batch(n: int) -> int:  # requests in the pass OEA routes when a replica holds n: all groups' together
        return min(n, max_running * groups) if max_running else n

    fewest, most = batch(conc // replicas), batch(share)
    busiest = min(per_group, max_running) if max_running else per_group
    rows = most * rows_per_request
    floor, cap = settings.get("oea_min_batch", 1), settings.get("oea_max_batch", 0)
    above = bool(max_running) and per_group > max_running
    eager = bool(graph_max_bs) and busiest > graph_max_bs
    span = f"{fewest}" if fewest == most else f"{fewest}-{most}"
    reqs = f"{span} request{'s' if most != 1 else ''}" + (f" per replica ({replicas} replicas)" if replicas > 1 else "")
    if groups > 1:
        least = min(share // groups, max_running) if max_running else share // groups
        each = f"{busiest}" if least == busiest else f"{least}-{busiest}"
        reqs += f" gathered from {groups} attention-DP groups ({each} each)"
    per = f"{reqs} x {rows_per_request} rows = {rows} rows" if rows_per_request > 1 else reqs
    if groups > 1:
        notes = (f"; the server runs at most {max_running * groups} requests at once ({max_running} per "
                 "attention-DP group): the rest wait" if above else "")
        notes += (f"; the busiest group's {busiest} requests are above cuda_graph_max_bs {graph_max_bs} (a "
                  "per-group limit): these passes run without CUDA graphs" if eager else "")
    else:
        notes = (f"; the server runs at most {max_running} requests at once{' per replica' if replicas > 1 else ''}: "
                 "the rest wait" if above else "")
        notes += f"; above cuda_graph_max_bs {graph_max_bs}: these passes run without CUDA graphs" if eager else ""
    gate = Gate(conc, most, rows, True, "", replicas, above, eager, groups, busiest)
    if fewest < floor:
        gate.open, gate.why = False, f"{per} < min_batch {floor}{notes}"
    elif cap and rows > cap:
        gate.open, gate.why = False, f"{per} > max_batch {cap} token rows{notes}"
    else:
        bound = f"<= max_batch {cap} rows" if cap else "no max_batch cap"
        gate.why = f"{per}: >= min_batch {floor}, {bound}{notes}"
    return gate


def positive_int(value) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def decode_graph_max_bs(info: Dict) -> Optional[int]:
    """The decode CUDA graphs' largest batch: cuda_graph_config.decode.max_bs (SGLang 0.5.23), else
    the older cuda_graph_max_bs flags; None with decode graphs disabled or when not reported."""
    if info.get("disable_cuda_graph"):
        return None
    decode = (info.get("cuda_graph_config") or {}).get("decode") or {}
    if decode.get("backend") == "disabled":
        return None
    return (positive_int(decode.get("max_bs")) or positive_int(info.get("cuda_graph_max_bs_decode"))
            or positive_int(info.get("cuda_graph_max_bs")))


def data_parallel(info: Dict) -> Tuple[int, int]:
    """(data-parallel replicas, attention-DP groups) of a /server_info answer.

    SGLang 0.5.23 reports DP attention as attn_dp_size G (with enable_dp_attention true when G > 1)
    and dp_size as the replicas; it refuses --dp-size > 1 together with --attn-dp-size > 1 at startup
    (arg_groups/parallel_hook.py), so one of the two is 1, and it resolves the deprecated
    `--dp-size G --enable-dp-attention` to attn_dp_size G, dp_size 1. A server that reports
    enable_dp_attention without an attn_dp_size above 1 counts its groups the deprecated way, in
    dp_size. Were both above 1, each replica's groups would gather their own batch (SGLang counts
    dp_size x attn_dp_size DP ranks); gate_at computes that too."""
    dp_size = positive_int(info.get("dp_size")) or 1
    groups = positive_int(info.get("attn_dp_size")) or 1
    if groups > 1:
        return dp_size, groups
    if info.get("enable_dp_attention") and dp_size > 1:
        return 1, dp_size
    return dp_size, 1


def read_limits(info: Dict, speculative: Optional[str]) -> Limits:
    """SGLang's limits on the batch OEA routes (Limits), from a /server_info answer."""
    replicas, groups = data_parallel(info)
    first = (info.get("internal_states") or [{}])[0] or {}
    total = positive_int(info.get("max_running_requests"))
    # each scheduler's own figure; without it, SGLang's split of the server's over the attention-DP groups
    max_running = (positive_int(first.get("effective_max_running_requests_per_dp"))
                   or (max(1, total // groups) if total else None))
    launch = info.get("launch_command")
    launch = " ".join(launch) if isinstance(launch, list) else str(launch or "")
    # SGLang's speculative default is the server's 48, which DP attention splits over its groups
    default_cap = bool(speculative) and bool(max_running) and max_running * groups == EAGLE_DEFAULT_MAX_RUNNING \
        and "--max-running-requests" not in launch
    return Limits(max_running, default_cap, replicas, decode_graph_max_bs(info), groups)


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
    limits = read_limits(info, speculative)
    gates = [gate_at(c, original, rows, limits.max_running, limits.replicas, limits.graph_max_bs, limits.groups)
             for c in concurrencies]
    pre = Preflight(url, info, states, original, model_top_k(info, tokenizer), speculative, rows, limits.max_running,
                    gates, limits=limits)
    describe(pre)
    refuse_if_meaningless(pre, k0s)
    return pre


def describe(pre: Preflight) -> None:
    """pre.lines: the preflight's findings, one line each; pre.warnings: what the operator should know."""
    s = pre.original
    envelope = pre.states[0].get("envelope") or {}
    k0_now = s.get("oea_k0", 0)
    groups = pre.limits.groups
    each = " (one per attention-DP group)" if groups > 1 and len(pre.states) == groups else ""
    pre.lines.append(f"OEA armed on {len(pre.states)} scheduler(s){each}; in force: k0 {k0_now}"
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
                     f"{pre.info.get('tp_size', '?')}, dp_size {pre.info.get('dp_size', '?')}"
                     + (f", attn_dp_size {groups}" if groups > 1 else ""))
    pre.lines.append(f"model top-k: {pre.top_k or 'unknown (no config.json in --tokenizer or the model path)'}")
    pre.lines.append(limits_line(pre.limits))
    if k0_now:
        pre.warnings.append(f"OEA is on now (k0 {k0_now}): the trial measures OEA off against each --k0 and puts "
                            f"k0 {k0_now} back at the end")
    above = [g.concurrency for g in pre.gates if g.above_limit]
    if above and groups > 1:
        pre.warnings.append(f"C={', '.join(map(str, above))}: above the {pre.limits.batch_max} requests the {groups} "
                            f"attention-DP groups run at once together ({pre.limits.max_running} each); the rest "
                            "wait in the queue, so these cells measure gathered batches of "
                            f"{pre.limits.batch_max} (raise --max-running-requests to measure more)")
    elif above:
        pre.warnings.append(f"C={', '.join(map(str, above))}: above the {pre.limits.max_running} requests a replica "
                            "runs at once; the rest wait in the queue, so these cells measure batches of "
                            f"{pre.limits.max_running} (raise --max-running-requests to measure more)")


def limits_line(limits: Limits) -> str:
    """The preflight's line on SGLang's limits."""
    default = "SGLang's default under speculative decoding: --max-running-requests is not set"
    why = f" ({default})" if limits.default_cap else ""
    if limits.groups > 1:
        # the groups are not replicas for OEA: its gate counts the gathered batch, every group's requests
        per = f"{limits.max_running} per group" + (f", {default}" if limits.default_cap else "")
        most = (f"up to {limits.batch_max} requests ({per})" if limits.max_running
                else "the running-request limit is not reported")
        graphs = (f"decode CUDA graphs up to {limits.graph_max_bs} requests per group (a pass whose busiest group "
                  "holds more runs eagerly)" if limits.graph_max_bs else "no decode CUDA graphs reported")
        replicas = (f"; {limits.replicas} data-parallel replicas, each gathering its own groups (about C / "
                    f"{limits.replicas} requests each)" if limits.replicas > 1 else "")
        return (f"limits: DP attention: {limits.groups} attention-DP groups; OEA's gate counts their requests "
                f"together (one gathered batch), {most}; {graphs}{replicas}")
    if limits.max_running:
        running = f"each replica runs at most {limits.max_running} requests at once{why}"
    else:
        running = "the running-request limit is not reported"
    graphs = (f"decode CUDA graphs up to {limits.graph_max_bs} requests per pass" if limits.graph_max_bs
              else "no decode CUDA graphs reported")
    return (f"limits: {running}; {graphs}; {limits.replicas} data-parallel replica(s), each forming its own batches "
            f"(about C / {limits.replicas} requests each)")


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
