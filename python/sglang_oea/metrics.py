"""Export OEA's counters: Prometheus (with --enable-metrics) and a line beside SGLang's decode log.

Runs in scheduler processes only, once per decode-log interval; prometheus_client is imported
here, lazily, so it picks up the multiprocess directory SGLang set before spawning.

    sglang:oea_active_experts_before{model_name,tp_rank,layer}  distinct experts/step, router's own
    sglang:oea_active_experts_after{model_name,tp_rank,layer}   distinct experts/step, after OEA
    sglang:oea_active_experts_ratio{model_name,tp_rank}         after / before, all layers
    sglang:oea_kept_router_mass{model_name,tp_rank,mode,k0}      kept router mass per routed token, all layers
    sglang:oea_layer_kept_router_mass{model_name,tp_rank,layer,mode,k0}   the same, per MoE layer
    sglang:oea_router_mass_lost_total{model_name,tp_rank,mode,k0}        lost router mass, token-layers summed
    sglang:oea_routed_token_layers_total{model_name,tp_rank,mode,k0}     routed tokens x MoE layers counted
    sglang:oea_decode_steps_applied_total{model_name,tp_rank,mode,k0}          mode: decode or verify
    sglang:oea_decode_steps_skipped_total{model_name,tp_rank,mode,reason,k0}   mode: decode, verify or other
    sglang:oea_k0{model_name,tp_rank}          the live settings last accepted (sglang_oea.live_settings)
    sglang:oea_min_batch{model_name,tp_rank}
    sglang:oea_max_batch{model_name,tp_rank}   0 = no cap
    sglang:oea_kernel_info{model_name,tp_rank,kernel,self_check}   routing shapes per (router, result)
    sglang:oea_rank_checks_total{model_name,tp_rank}   passed --oea-check-ranks comparisons
With data-parallel replicas (--dp-size > 1) every series also carries dp_rank, as SGLang's own
scheduler series do (it adds the label only where a DP controller runs): each replica is its own
scheduler group, whose TP ranks count from 0, and in Prometheus' multiprocess mode two replicas'
series with the same labels would merge (the "mostrecent" gauges would keep one replica's value,
the counters would add up). Apart, each replica's series reads as on a one-replica server; the
server's total is the sum over dp_rank of one TP rank's counters (every TP rank counts the same).
Under DP attention SGLang's dp_rank is the rank's attention-DP group, and every rank routes and
counts each gathered pass once (sglang_oea.dp_attention): one TP rank's counters are the server's
total (each TP rank is in one group, so the sum over dp_rank of tp_rank="0" is that rank alone).
Expert counts are averaged over the steps (decode or verify) where OEA applied between two counter
snapshots (sglang_oea.counters): each report covers the routed passes up to the second-newest one.
The step counters' k0 label is the k0 each step ran with (the settings can change while the server
runs). The counters reach /metrics only at decode-log steps, so steps that ran just before a change
can appear after it: they are told apart by that label, never by when they appear.

The settings gauges follow one rule, whoever writes them (the settings listener when a change is
accepted, every report, the export at startup): they show the settings last accepted, pending or
in force (requested_settings), which every pass from the next one on runs with. They never show
the settings of passes that already ran: the counters' k0 label does. So a report that runs while
a change is pending (accepted during the pass that finishes the last batch) leaves them alone.

Nothing here may stop the scheduler: the report and the settings listener run inside SGLang's
scheduler loop. Each piece runs `contained` (an exception is logged once, with its traceback, and
costs that piece); an increment that is not finite or is negative never reaches a Prometheus
counter (prometheus_client raises on it), and an interval whose lost router mass cannot be right
is skipped; each with one warning line. (The rank check is not a metric: sglang_oea.hooks.)

Kept router mass (reference.lost_router_mass): per routed token and MoE layer, the share of the
token's own routed weight whose experts OEA kept, 1.0 where OEA changed nothing. Every real token
of every decode or verify step counts, applied or skipped; the device sums the lost share per
layer in the column of the k0 the step ran with (sglang_oea.counters), and the host counts the
tokens per k0 in the same snapshots, so both labels are exact across live changes. The gauges
give the last report interval's mean; 1 - rate(lost) / rate(token_layers) gives any window's.
"""

import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from sglang_oea.config import MAX_K0, LiveSettings
from sglang_oea.counters import Snapshot, lost_between, stats_between
from sglang_oea.reference import MASS_ONE
from sglang_oea.runtime import DECODE, ROUTED_MODES, VERIFY, OEARuntime

logger = logging.getLogger("sglang_oea")

# The live settings last accepted: LiveSettings field -> the gauge's help (sglang:oea_<field>).
SETTING_GAUGES = (
    ("k0", "The k0 last accepted, which every pass from the next one on runs with (0 = OEA off)"),
    ("min_batch", "The batch gate's floor last accepted, in requests"),
    ("max_batch", "The batch gate's cap last accepted, in routed token rows (0 = no cap)"),
)

_logged: set = set()  # what the metrics path has already logged a failure or a warning for


def warn_once(key: str, message: str, *args: Any) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.warning(message, *args)


@contextmanager
def contained(piece: str):
    """Run one piece of OEA's metrics path so that a bug in it costs that piece, never the
    scheduler: an exception is logged once per piece, with its traceback, and goes no further."""
    try:
        yield
    except Exception:  # the scheduler loop must survive a metrics bug: logged, not raised
        if piece not in _logged:
            _logged.add(piece)
            logger.exception("sglang-oea: %s failed; OEA's metrics miss what it would have published, and "
                             "serving goes on (logged once)", piece)


def requested_settings(runtime: OEARuntime) -> LiveSettings:
    """What the settings gauges show: the settings last accepted (the pending change, else those
    in force)."""
    pending = runtime.pending
    return runtime.settings if pending is None else pending


@dataclass
class KeptMass:
    """One report interval's kept router mass at one k0.

    tokens: real token rows of the decode or verify steps that ran with k0 (applied or skipped).
    lost: MoE layer id -> the lost router mass of those tokens, in units (MASS_ONE = one token).
    """

    k0: int
    tokens: int
    lost: Dict[int, int]

    @property
    def token_layers(self) -> int:
        return self.tokens * len(self.lost)

    @property
    def lost_mass(self) -> float:
        """Lost router mass summed over the tokens and layers (in tokens)."""
        return sum(self.lost.values()) / MASS_ONE

    @property
    def kept(self) -> float:
        """Mean kept router mass per routed token and layer (exactly 1.0 when nothing was lost)."""
        return 1.0 - self.lost_mass / self.token_layers

    def layer_kept(self, layer: int) -> float:
        return 1.0 - self.lost[layer] / (MASS_ONE * self.tokens)


def kept_mass_between(newer: Optional[Snapshot], older: Optional[Snapshot], layers: Sequence[int]) -> List[KeptMass]:
    """The kept router mass of the steps between two snapshots (older None = since the start), per
    k0 that counted tokens there. layers: the MoE layers OEA routes (runtime.moe_layers). A k0
    whose counts cannot be right (plausible_loss) is left out, with one warning line."""
    if newer is None or newer.host is None or not layers:
        return []
    counted_before = older.host if older is not None and older.host is not None else {}
    lost = lost_between(newer, older)
    parts = []
    for k0, count in sorted(newer.host.items()):
        tokens = count - counted_before.get(k0, 0)
        if tokens <= 0:
            continue
        # k0 = MAX_K0 has no column: it covers every top-k, so the gate never opened with it.
        per_layer = {layer: int(lost[layer, k0]) if k0 < MAX_K0 and layer < lost.shape[0] else 0 for layer in layers}
        if plausible_loss(k0, tokens, per_layer):
            parts.append(KeptMass(k0, tokens, per_layer))
    return parts


def plausible_loss(k0: int, tokens: int, lost: Dict[int, int]) -> bool:
    """Whether every layer lost between none and all of its `tokens` tokens' router mass (units).
    Anything else means a count went wrong (a router weight that is not finite, say): that k0's
    kept mass of the interval is skipped, with one warning line."""
    bad = {layer: units for layer, units in lost.items() if not 0 <= units <= tokens * MASS_ONE}
    if bad:
        layer, units = next(iter(bad.items()))
        warn_once("lost_router_mass", "sglang-oea: skipped the kept router mass at k0=%d for one report interval: "
                  "layer %d lost %d units over %d tokens (allowed 0 to %d); a lost-mass counter went wrong. "
                  "Logged once.", k0, layer, units, tokens, tokens * MASS_ONE)
    return not bad


class PrometheusExport:
    """The OEA metrics of one rank, and the counter values already exported."""

    def __init__(self, model_name: str, rank: int, settings: LiveSettings, speculative: bool = False,
                 dp_rank: Optional[int] = None):
        from prometheus_client import Counter, Gauge

        labels = series_labels(model_name, rank, dp_rank)
        self.labels = labels
        names = list(labels)
        self.before = Gauge("sglang:oea_active_experts_before", "Distinct experts per MoE layer per decode or verify step, router's own choice", names + ["layer"], multiprocess_mode="mostrecent")
        self.after = Gauge("sglang:oea_active_experts_after", "Distinct experts per MoE layer per decode or verify step, after OEA", names + ["layer"], multiprocess_mode="mostrecent")
        self.ratio = Gauge("sglang:oea_active_experts_ratio", "Distinct experts after OEA / before, all MoE layers", names, multiprocess_mode="mostrecent")
        self.applied = Counter("sglang:oea_decode_steps_applied", "Decode and verify steps routed with OEA, by the "
                               "k0 they ran with", names + ["mode", "k0"])
        self.skipped = Counter("sglang:oea_decode_steps_skipped", "Forward steps where OEA did not apply, by the k0 "
                               "in force", names + ["mode", "reason", "k0"])
        # The routed mode this server runs is exported from the start, at 0 (the target model
        # decodes in verify passes under speculative decoding).
        mode = VERIFY if speculative else DECODE
        self.applied.labels(**labels, mode=mode, k0=str(settings.k0))
        self.kept = Gauge("sglang:oea_kept_router_mass", "Kept router mass per routed token, all MoE layers, last "
                          "report interval (1 = OEA kept the router's own experts)", names + ["mode", "k0"],
                          multiprocess_mode="mostrecent")
        self.layer_kept = Gauge("sglang:oea_layer_kept_router_mass", "Kept router mass per routed token in one MoE "
                                "layer, last report interval", names + ["layer", "mode", "k0"],
                                multiprocess_mode="mostrecent")
        self.lost = Counter("sglang:oea_router_mass_lost", "Router mass OEA dropped, summed over routed tokens and "
                            "MoE layers, by the k0 the steps ran with", names + ["mode", "k0"])
        self.token_layers = Counter("sglang:oea_routed_token_layers", "Routed tokens x MoE layers counted for the "
                                    "kept router mass, by the k0 the steps ran with", names + ["mode", "k0"])
        for counter in (self.lost, self.token_layers):
            counter.labels(**labels, mode=mode, k0=str(settings.k0))
        self.settings = {field: Gauge(f"sglang:oea_{field}", doc, names, multiprocess_mode="mostrecent")
                         for field, doc in SETTING_GAUGES}
        self.publish_settings(settings)
        self.kernel = Gauge("sglang:oea_kernel_info", "MoE routing shapes per routing implementation and kernel "
                            "self-check result", names + ["kernel", "self_check"], multiprocess_mode="mostrecent")
        self.rank_checks = Counter("sglang:oea_rank_checks", "Passed --oea-check-ranks comparisons", names)
        self.exported_checks = 0
        self.exported: Dict[tuple, int] = {}  # (mode, k0) or (mode, k0, reason) -> count already exported

    def publish(self, runtime: OEARuntime, layers: Optional[Any], kept: Sequence[KeptMass] = ()) -> None:
        self.publish_kept(runtime.routed_mode, kept)
        if layers is not None:
            for layer, (steps, before, after) in enumerate_layers(layers):
                self.before.labels(**self.labels, layer=str(layer)).set(before / steps)
                self.after.labels(**self.labels, layer=str(layer)).set(after / steps)
            self.ratio.labels(**self.labels).set(float(layers[:, 2].sum() / layers[:, 1].sum()))
        for (mode, k0), count in runtime.applied_by_k0.items():
            self.add(self.applied.labels(**self.labels, mode=mode, k0=str(k0)), self.new_counts((mode, k0), count),
                     "sglang:oea_decode_steps_applied_total")
        for (mode, k0, reason), count in runtime.skipped_by_k0.items():
            self.add(self.skipped.labels(**self.labels, mode=mode, reason=reason, k0=str(k0)),
                     self.new_counts((mode, k0, reason), count), "sglang:oea_decode_steps_skipped_total")
        self.publish_settings(requested_settings(runtime))
        if runtime.rank_check is not None:
            self.add(self.rank_checks.labels(**self.labels), runtime.rank_check.checks - self.exported_checks,
                     "sglang:oea_rank_checks_total")
            self.exported_checks = runtime.rank_check.checks
        for (kernel, result), shapes in runtime.routers.status().items():
            self.kernel.labels(**self.labels, kernel=kernel, self_check=result).set(shapes)

    def publish_kept(self, mode: str, kept: Sequence[KeptMass]) -> None:
        for part in kept:
            labels = dict(self.labels, mode=mode, k0=str(part.k0))
            self.add(self.lost.labels(**labels), part.lost_mass, "sglang:oea_router_mass_lost_total")
            self.add(self.token_layers.labels(**labels), part.token_layers, "sglang:oea_routed_token_layers_total")
            self.kept.labels(**labels).set(part.kept)
            for layer in part.lost:
                self.layer_kept.labels(**labels, layer=str(layer)).set(part.layer_kept(layer))

    def publish_settings(self, settings: LiveSettings) -> None:
        """The settings gauges' one writer; callers pass requested_settings (see the module docstring)."""
        for field, gauge in self.settings.items():
            gauge.labels(**self.labels).set(getattr(settings, field))

    @staticmethod
    def add(series: Any, amount: float, name: str) -> None:
        """series.inc(amount) when amount is finite and >= 0. A counter never goes down, and
        prometheus_client raises on a negative increment inside the scheduler loop: such an amount
        means a count went wrong, and is skipped with one warning line per metric."""
        if math.isfinite(amount) and amount >= 0:
            series.inc(amount)
            return
        warn_once(name, "sglang-oea: skipped an increment of %s by %r (not finite, or negative); "
                  "that interval is missing from it. Logged once.", name, amount)

    def new_counts(self, key: tuple, count: int) -> int:
        """How much of a runtime counter is not exported yet (and mark it exported)."""
        new = count - self.exported.get(key, 0)
        self.exported[key] = count
        return new


def series_labels(model_name: str, rank: int, dp_rank: Optional[int] = None) -> Dict[str, str]:
    """The labels every OEA series of one rank carries: model_name, tp_rank, and dp_rank in a
    data-parallel replica or, under DP attention, its attention-DP group (SGLang's convention: only
    where a DP controller runs, so that a one-replica server keeps its series as they were)."""
    labels = {"model_name": model_name, "tp_rank": str(rank)}
    if dp_rank is not None:
        labels["dp_rank"] = str(dp_rank)
    return labels


def enumerate_layers(layers: Any):
    """Yield (layer_id, (steps, before_sum, after_sum)) from stats_between's [L, 4] rows."""
    for row in layers.tolist():
        yield int(row[3]), row[:3]


_export: Optional[PrometheusExport] = None
_reported: Optional[Snapshot] = None  # the snapshot the last report counted up to


def attach(runtime: OEARuntime, scheduler: Any) -> None:
    """Hook the decode log line; create this rank's Prometheus metrics when SGLang's are on."""
    global _export
    decode_logger = logging.getLogger(SGLANG_DECODE_LOGGER)
    if _decode_line not in decode_logger.filters:
        decode_logger.addFilter(_decode_line)
    server_args = scheduler.server_args
    if not getattr(server_args, "enable_metrics", False):
        return
    name = getattr(server_args, "served_model_name", None) or server_args.model_path
    _export = PrometheusExport(str(name), runtime.rank, requested_settings(runtime), runtime.speculative,
                               runtime.dp_rank)
    follow_settings(runtime, _export)


def follow_settings(runtime: OEARuntime, export: PrometheusExport) -> None:
    """The settings gauges move when a live change is accepted on this rank, not only at the next
    decode-log step: an operator who changes k0 sees it at once, on an idle server too. The
    listener runs inside the live-settings handler: a failure here must not fail the change."""
    def publish(_new: LiveSettings) -> None:
        with contained("the settings gauges"):
            export.publish_settings(requested_settings(runtime))

    runtime.settings_listeners.append(publish)


def summary(runtime: OEARuntime, layers: Optional[Any], kept: Sequence[KeptMass] = ()) -> str:
    """The short OEA summary appended to SGLang's 'Decode batch' line: the k0 in force, and per
    routed mode seen (decode; verify under speculative decoding) the steps that ran with it:
    applied / counted; the expert counts; the kept router mass of the interval's steps at the k0
    in force (all layers, and the lowest layer)."""
    k0 = runtime.settings.k0
    counts = [f"{runtime.applied_by_k0[(mode, k0)]}/{steps} {mode} steps"
              for mode in ROUTED_MODES if (steps := steps_with(runtime, mode, k0))] or [f"0/0 {DECODE} steps"]
    text = f"OEA k0={k0}{' (off)' if k0 == 0 else ''}: applied {', '.join(counts)}"
    if layers is not None:
        steps, before, after = (float(v) for v in layers[:, :3].sum(dim=0))
        text = f"{text}, experts/layer/step {before / steps:.1f} -> {after / steps:.1f} ({after / before:.2f}x)"
    for part in kept:
        if part.k0 == k0:
            lowest = min(part.layer_kept(layer) for layer in part.lost)
            text = f"{text}, kept router mass {part.kept:.3f} (lowest layer {lowest:.3f})"
    return text


def steps_with(runtime: OEARuntime, mode: str, k0: int) -> int:
    """Counted steps (applied or skipped) of one pass mode that ran with `k0`."""
    skipped = sum(count for (m, k, _), count in runtime.skipped_by_k0.items() if (m, k) == (mode, k0))
    return runtime.applied_by_k0[(mode, k0)] + skipped


class DecodeLineSummary(logging.Filter):
    """Appends the latest OEA summary to SGLang's next 'Decode batch' log line, once."""

    def __init__(self):
        super().__init__()
        self.pending: Optional[str] = None

    def filter(self, record: logging.LogRecord) -> bool:
        if self.pending and isinstance(record.msg, str) and record.msg.startswith("Decode batch"):
            record.msg = f"{record.msg}, {self.pending}"
            self.pending = None
        return True


_decode_line = DecodeLineSummary()
SGLANG_DECODE_LOGGER = "sglang.srt.managers.scheduler_components.metrics_reporter"


def report(runtime: OEARuntime, snapshot: Optional[Snapshot]) -> None:
    """Publish the expert counts that routed between the last reported snapshot and this one (a
    snapshot, not the live counters: no device sync, nothing lost; see sglang_oea.counters);
    SGLang's 'Decode batch' line, logged right after this, carries the summary."""
    global _reported
    layers, kept = None, []
    if runtime.cfg.stats and snapshot is not None:
        older, _reported = _reported, snapshot  # a failure below costs this interval, never counts it twice
        with contained("reading OEA's device counters"):
            layers = stats_between(snapshot, older)
            kept = kept_mass_between(snapshot, older, runtime.moe_layers())
    if _export is not None:
        with contained("the OEA Prometheus export"):
            _export.publish(runtime, layers, kept)
    with contained("the OEA summary of the 'Decode batch' line"):
        _decode_line.pending = summary(runtime, layers, kept)
