"""Export OEA's counters: Prometheus (with --enable-metrics) and a line beside SGLang's decode log.

Runs in scheduler processes only, once per decode-log interval; prometheus_client is imported
here, lazily, so it picks up the multiprocess directory SGLang set before spawning.

    sglang:oea_active_experts_before{model_name,tp_rank,layer}  distinct experts/step, router's own
    sglang:oea_active_experts_after{model_name,tp_rank,layer}   distinct experts/step, after OEA
    sglang:oea_active_experts_ratio{model_name,tp_rank}         after / before, all layers
    sglang:oea_decode_steps_applied_total{model_name,tp_rank,mode,k0}          mode: decode or verify
    sglang:oea_decode_steps_skipped_total{model_name,tp_rank,mode,reason,k0}   mode: decode, verify or other
    sglang:oea_k0{model_name,tp_rank}          the live settings in force (sglang_oea.live_settings)
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
Expert counts are averaged over the steps (decode or verify) where OEA applied between two counter
snapshots (sglang_oea.counters): each report covers the routed passes up to the second-newest one.
The step counters' k0 label is the k0 each step ran with (the settings can change while the server
runs). The counters reach /metrics only at decode-log steps, so steps that ran just before a change
can appear after it: they are told apart by that label, never by when they appear. The settings
gauges are set when a change is accepted (every pass from the next one on routes with it) and at
each report.
"""

import logging
from typing import Any, Dict, Optional

from sglang_oea.config import LiveSettings
from sglang_oea.counters import Snapshot, stats_between
from sglang_oea.runtime import DECODE, ROUTED_MODES, VERIFY, OEARuntime

logger = logging.getLogger("sglang_oea")

# The live settings in force: LiveSettings field -> the gauge's help (sglang:oea_<field>).
SETTING_GAUGES = (
    ("k0", "The k0 in force (0 = OEA off)"),
    ("min_batch", "The batch gate's floor in force, in requests"),
    ("max_batch", "The batch gate's cap in force, in routed token rows (0 = no cap)"),
)


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
        self.applied.labels(**labels, mode=VERIFY if speculative else DECODE, k0=str(settings.k0))
        self.settings = {field: Gauge(f"sglang:oea_{field}", doc, names, multiprocess_mode="mostrecent")
                         for field, doc in SETTING_GAUGES}
        self.publish_settings(settings)
        self.kernel = Gauge("sglang:oea_kernel_info", "MoE routing shapes per routing implementation and kernel "
                            "self-check result", names + ["kernel", "self_check"], multiprocess_mode="mostrecent")
        self.rank_checks = Counter("sglang:oea_rank_checks", "Passed --oea-check-ranks comparisons", names)
        self.exported_checks = 0
        self.exported: Dict[tuple, int] = {}  # (mode, k0) or (mode, k0, reason) -> count already exported

    def publish(self, runtime: OEARuntime, layers: Optional[Any]) -> None:
        if layers is not None:
            for layer, (steps, before, after) in enumerate_layers(layers):
                self.before.labels(**self.labels, layer=str(layer)).set(before / steps)
                self.after.labels(**self.labels, layer=str(layer)).set(after / steps)
            self.ratio.labels(**self.labels).set(float(layers[:, 2].sum() / layers[:, 1].sum()))
        for (mode, k0), count in runtime.applied_by_k0.items():
            self.applied.labels(**self.labels, mode=mode, k0=str(k0)).inc(self.new_counts((mode, k0), count))
        for (mode, k0, reason), count in runtime.skipped_by_k0.items():
            self.skipped.labels(**self.labels, mode=mode, reason=reason, k0=str(k0)).inc(
                self.new_counts((mode, k0, reason), count))
        self.publish_settings(runtime.settings)
        if runtime.rank_check is not None:
            self.rank_checks.labels(**self.labels).inc(runtime.rank_check.checks - self.exported_checks)
            self.exported_checks = runtime.rank_check.checks
        for (kernel, result), shapes in runtime.routers.status().items():
            self.kernel.labels(**self.labels, kernel=kernel, self_check=result).set(shapes)

    def publish_settings(self, settings: LiveSettings) -> None:
        for field, gauge in self.settings.items():
            gauge.labels(**self.labels).set(getattr(settings, field))

    def new_counts(self, key: tuple, count: int) -> int:
        """How much of a runtime counter is not exported yet (and mark it exported)."""
        new = count - self.exported.get(key, 0)
        self.exported[key] = count
        return new


def series_labels(model_name: str, rank: int, dp_rank: Optional[int] = None) -> Dict[str, str]:
    """The labels every OEA series of one rank carries: model_name, tp_rank, and dp_rank in a
    data-parallel replica (SGLang's convention: only where a DP controller runs, so that a
    one-replica server keeps its series as they were)."""
    labels = {"model_name": model_name, "tp_rank": str(rank)}
    if dp_rank is not None:
        labels["dp_rank"] = str(dp_rank)
    return labels


def enumerate_layers(layers: Any):
    """Yield (layer_id, (steps, before_sum, after_sum)) from drained [L, 4] rows."""
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
    _export = PrometheusExport(str(name), runtime.rank, runtime.settings, runtime.speculative, runtime.dp_rank)
    follow_settings(runtime, _export)


def follow_settings(runtime: OEARuntime, export: PrometheusExport) -> None:
    """The settings gauges move when a live change is accepted on this rank, not only at the next
    decode-log step: an operator who changes k0 sees it at once, on an idle server too."""
    runtime.settings_listeners.append(export.publish_settings)


def summary(runtime: OEARuntime, layers: Optional[Any]) -> str:
    """The short OEA summary appended to SGLang's 'Decode batch' line: the k0 in force, and per
    routed mode seen (decode; verify under speculative decoding) the steps that ran with it:
    applied / counted."""
    k0 = runtime.settings.k0
    counts = [f"{runtime.applied_by_k0[(mode, k0)]}/{steps} {mode} steps"
              for mode in ROUTED_MODES if (steps := steps_with(runtime, mode, k0))] or [f"0/0 {DECODE} steps"]
    text = f"OEA k0={k0}{' (off)' if k0 == 0 else ''}: applied {', '.join(counts)}"
    if layers is None:
        return text
    steps, before, after = (float(v) for v in layers[:, :3].sum(dim=0))
    return f"{text}, experts/layer/step {before / steps:.1f} -> {after / steps:.1f} ({after / before:.2f}x)"


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
    layers = None
    if runtime.cfg.stats and snapshot is not None:
        layers = stats_between(snapshot, _reported)
        _reported = snapshot
    if _export is not None:
        _export.publish(runtime, layers)
    _decode_line.pending = summary(runtime, layers)
