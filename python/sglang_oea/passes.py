"""What forward pass is running, and the batch gate over it. No SGLang import.

The forward-context hook describes each pass to the runtime as a StepInfo: its mode (decode,
target verify, draft or other), its token rows and requests, and whether it is a CUDA-graph
warm-up or capture pass. What happens to the routing during the pass is kept in its PassTally,
which the accounting (sglang_oea.accounting) reads when the pass ends.

Each pass routes with the LiveSettings (k0, min_batch, max_batch) in force when it began
(OEARuntime.request_settings changes them between passes). k0 = 0 turns OEA off; k0 >= the
layer's top-k makes it a no-op.

The batch gate: its floor (min_batch) counts requests; its cap (max_batch) counts routed token
rows (requests x draft tokens in verify), since the union's coverage of the experts grows with
rows. Eager passes are gated on the host (`skip_reason`); graph passes on the device at replay,
from the settings' device control block (`row_bounds` gives the same bounds in rows), and a graph
bucket whose every batch is outside the startup envelope is captured without routing
(`bucket_may_open`). Which pass modes are routed at all (`mode_skip_reason`: decode, and the
target's verify passes unless --oea-verify is off) is decided in one place for both.
"""

from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple

from sglang_oea.config import MAX_ROWS_PER_REQUEST, LiveSettings, OEAConfig

DECODE, VERIFY, DRAFT, OTHER = "decode", "verify", "draft", "other"
ROUTED_MODES = (DECODE, VERIFY)
SKIP_BELOW_MIN = "below_min_batch"
SKIP_ABOVE_MAX = "above_max_batch"
SKIP_NOT_DECODE = "not_decode"
SKIP_VERIFY = "target_verify"
SKIP_NO_IDS = "no_topk_ids"
SKIP_UNSUPPORTED = "router_unsupported"
SKIP_NOOP = "k0_covers_top_k"
SKIP_KERNEL_OFF = "kernel_off"
SKIP_OFF = "oea_off"  # k0 = 0: armed, but off (the router's own experts)
SKIP_LAYOUT = "gathered_layout"  # DP attention: the gathered batch is not laid out as expected
# The settings of the placeholder step that describes no pass.
NO_SETTINGS = LiveSettings(k0=0, min_batch=1, max_batch=0)


@dataclass
class PassTally:
    """What happened to the routing during one outermost forward pass (nested contexts share it)."""

    rewrote: bool = False  # OEA rewrote the ids of some MoE layer
    unsupported: bool = False  # a target MoE layer has a router OEA does not handle
    noop: bool = False  # k0 >= the layer's top-k
    kernel_off: bool = False  # OEA is off for a layer's routing shape (kernel failed or unavailable on CUDA)
    layout: bool = False  # DP attention: the gathered batch's layout was not the one expected
    replayed_bucket: Optional[int] = None  # the graph (bucket in requests) replayed for this pass
    rows_written: bool = False  # the device row count holds this pass's real rows
    top_k: int = 0  # the largest top-k of the layers OEA routed in this pass
    # Under DP attention: (gathered rows, capturing, order, inverse) of this pass (sglang_oea.gathered),
    # made at its first routed layer and shared by the others (in a graph, captured once with them).
    order: Optional[tuple] = None

    def outcome(self) -> Optional[str]:
        """None when OEA rewrote ids, else the skip reason."""
        if self.rewrote:
            return None
        if self.kernel_off:
            return SKIP_KERNEL_OFF
        if self.layout:
            return SKIP_LAYOUT
        return SKIP_UNSUPPORTED if self.unsupported else SKIP_NOOP if self.noop else SKIP_NO_IDS


@dataclass
class StepInfo:
    """What the current forward pass is: set by the forward-context hook.

    num_rows: the pass's token rows: requests in decode, requests x draft tokens in verify (graph
        warm-up and capture passes: the bucket's rows, padding included).
    requests: the pass's requests (the bucket size in graph passes); the batch gate counts these.
    settings: the live settings the pass routes with (those in force when its outermost context
        began; nested contexts share them).
    groups: under DP attention, the attention-DP groups whose tokens every MoE layer sees gathered
        (0 otherwise). Then num_rows and requests count the whole gathered batch (graph passes: the
        bucket of every group), and group_rows gives each group's real token rows (empty in graph
        warm-up and capture passes, whose real rows are known only at replay).
    """

    mode: str = OTHER
    num_rows: int = 0
    requests: int = 0
    apply: bool = False  # the host batch gate (real requests; eager passes)
    graph: bool = False  # a CUDA-graph warm-up or capture pass
    index: int = -1  # routed steps counted before this one (router dumps)
    tally: PassTally = field(default_factory=PassTally)
    settings: LiveSettings = NO_SETTINGS
    groups: int = 0
    group_rows: Tuple[int, ...] = ()

    @property
    def bucket(self) -> int:
        """A graph pass's bucket in requests: that of one attention-DP group under DP attention."""
        return self.requests // self.groups if self.groups else self.requests

    @property
    def routed(self) -> bool:
        """A pass whose MoE layers OEA may route (decode, or the target's verify)."""
        return self.mode in ROUTED_MODES

    @property
    def rows_per_request(self) -> int:
        """Token rows per request: 1 in decode, the draft tokens per request in verify."""
        return max(1, self.num_rows // self.requests) if self.requests else 1


def mode_skip_reason(verify: bool, mode: str) -> Optional[str]:
    """Why no pass of `mode` is ever routed on this server, or None when its passes may be.
    verify: --oea-verify. Fixed at startup: the one place that decides which modes OEA routes, read
    by the host gate of eager passes and by the capture of graph passes alike."""
    if mode == VERIFY and not verify:
        return SKIP_VERIFY
    return None if mode in ROUTED_MODES else SKIP_NOT_DECODE


def skip_reason(settings: LiveSettings, verify: bool, mode: str, requests: int, rows: int) -> Optional[str]:
    """Why the host gate keeps OEA off this pass, or None when it may apply. verify: --oea-verify.
    The floor counts requests (a verify pass of one request routes one sequence's draft tokens);
    the cap counts token rows (requests x draft tokens in verify), where the union's coverage is
    decided. k0 >= the layer's top-k is found per layer (PassTally.noop), not here."""
    reason = mode_skip_reason(verify, mode)
    if reason is not None:
        return reason
    if settings.k0 == 0:
        return SKIP_OFF
    if requests < settings.min_batch:
        return SKIP_BELOW_MIN
    if settings.max_batch and rows > settings.max_batch:
        return SKIP_ABOVE_MAX
    return None


def bucket_may_open(cfg: OEAConfig, step: StepInfo, graph_buckets: Sequence[int]) -> bool:
    """Whether some real batch served by this graph bucket passes the gate, under the STARTUP
    min_batch and max_batch (cfg), whatever k0 is (k0 = 0 or >= top-k closes the device gate at
    replay instead, so that a later k0 routes without recapture).

    The startup envelope rule: live settings may only narrow the gate that the graphs were
    captured for, never widen it. A live min_batch must be >= the startup --oea-min-batch, and,
    when the startup --oea-max-batch is > 0, a live max_batch must be > 0 and <= it (a startup cap
    of 0, no cap, admits any live cap). Under that rule a bucket captured without routing serves
    only batches that every admissible live gate keeps closed. The /set_internal_state handler
    refuses values outside it.

    A bucket serves batches of (the previous bucket, this bucket] requests (SGLang pads a batch up
    to the smallest bucket that holds it); with the runner's bucket list unknown, of [1, bucket].
    Under DP attention the bucket is one group's (SGLang picks it for the busiest group) and the
    gate counts every group's requests: its batches hold from (the previous bucket + 1) requests
    (the other groups idle) to step.requests (every group full).
    A pass of a mode this server never routes (verify passes under --oea-verify off) may never open.
    """
    if mode_skip_reason(cfg.verify, step.mode) is not None or step.requests < cfg.min_batch:
        return False
    smaller = [b for b in graph_buckets if b < step.bucket]
    fewest = max(max(smaller) + 1 if smaller else 1, cfg.min_batch)  # the fewest it may route
    return not cfg.max_batch or fewest * step.rows_per_request <= cfg.max_batch


def row_bounds(settings: LiveSettings, step: StepInfo) -> Tuple[int, int]:
    """(min_rows, max_rows) of the device gate, which compares token rows. The request floor is
    scaled by the rows per request: a verify pass has requests x draft tokens rows, the same for
    every request (SGLang replays a verify graph only for batches of its captured width), so the
    scaled floor opens exactly when the request floor does. The cap already counts rows. The fused
    kernel computes the same bounds on the device from the control block and rows_per_request."""
    return settings.min_batch * step.rows_per_request, settings.max_batch


def verify_cap_problem(min_batch: int, max_batch: int, widths: Sequence[int], names=("--oea-min-batch", "--oea-max-batch")
                       ) -> Tuple[Optional[str], Optional[str]]:
    """(refusal, warning) for a batch gate under speculative decoding; (None, None) when every
    verify pass the server can run may open it.

    widths: the draft tokens per request of every verify pass the server can run (one width, or
        every candidate of --speculative-adaptive); empty without speculative decoding or with
        --oea-verify off.
    A verify pass of w draft tokens opens the gate only if min_batch x w <= max_batch (the floor
    counts requests, the cap rows). A cap that closes it for every width leaves OEA on in no pass at
    all, which is never what a cap is for (k0 0 or --oea-verify off say "off" plainly): refused, at
    startup and live alike. A cap that closes it only for the wider of several adaptive widths
    still routes the narrower ones: a warning.
    """
    min_name, max_name = names
    too_wide = [w for w in widths if w > MAX_ROWS_PER_REQUEST]
    if too_wide:
        return (f"OEA supports at most {MAX_ROWS_PER_REQUEST} draft tokens per request in a verify pass, "
                f"this server runs {max(too_wide)}"), None
    if not max_batch or not widths:
        return None, None
    closed = sorted(w for w in set(widths) if max_batch < min_batch * w)
    if not closed:
        return None, None
    narrowest = min(widths)
    if len(closed) == len(set(widths)):
        return (f"{max_name} {max_batch} rows is below {min_name} {min_batch} requests x {narrowest} draft tokens, "
                f"so OEA would apply in no verify pass; give {max_name} at least {min_batch * narrowest} (or 0, no "
                f"cap), or turn OEA off with k0 0"), None
    return None, (f"{max_name} {max_batch} rows is below {min_name} {min_batch} requests x "
                  f"{', '.join(map(str, closed))} draft tokens: verify passes of that width never route with OEA "
                  f"(narrower ones still do)")
