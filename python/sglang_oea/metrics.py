"""Export OEA's counters: Prometheus (with --enable-metrics) and a line beside SGLang's decode log.

Runs in scheduler processes only, once per decode-log interval; prometheus_client is imported
here, lazily, so it picks up the multiprocess directory SGLang set before spawning.

    sglang:oea_active_experts_before{model_name,tp_rank,layer}  distinct experts/step, router's own
    sglang:oea_active_experts_after{model_name,tp_rank,layer}   distinct experts/step, after OEA
    sglang:oea_active_experts_ratio{model_name,tp_rank}         after / before, all layers
    sglang:oea_decode_steps_applied_total{model_name,tp_rank,mode}          mode: decode or verify
    sglang:oea_decode_steps_skipped_total{model_name,tp_rank,mode,reason}   mode: decode, verify or other
    sglang:oea_k0{model_name,tp_rank}
    sglang:oea_kernel_info{model_name,tp_rank,kernel,self_check}   routing shapes per (router, result)
    sglang:oea_rank_checks_total{model_name,tp_rank}   passed --oea-check-ranks comparisons
Expert counts are averaged over the steps (decode or verify) where OEA applied between two counter
snapshots (sglang_oea.counters): each report covers the routed passes up to the second-newest one.
"""

import logging
from typing import Any, Dict, Optional

from sglang_oea.counters import Snapshot, stats_between
from sglang_oea.runtime import DECODE, ROUTED_MODES, VERIFY, OEARuntime

logger = logging.getLogger("sglang_oea")


class PrometheusExport:
    """The OEA metrics of one rank, and the counter values already exported."""

    def __init__(self, model_name: str, rank: int, k0: int, speculative: bool = False):
        from prometheus_client import Counter, Gauge

        labels = {"model_name": model_name, "tp_rank": str(rank)}
        self.labels = labels
        names = list(labels)
        self.before = Gauge("sglang:oea_active_experts_before", "Distinct experts per MoE layer per decode or verify step, router's own choice", names + ["layer"], multiprocess_mode="mostrecent")
        self.after = Gauge("sglang:oea_active_experts_after", "Distinct experts per MoE layer per decode or verify step, after OEA", names + ["layer"], multiprocess_mode="mostrecent")
        self.ratio = Gauge("sglang:oea_active_experts_ratio", "Distinct experts after OEA / before, all MoE layers", names, multiprocess_mode="mostrecent")
        self.applied = Counter("sglang:oea_decode_steps_applied", "Decode and verify steps routed with OEA",
                               names + ["mode"])
        self.skipped = Counter("sglang:oea_decode_steps_skipped", "Forward steps where OEA did not apply",
                               names + ["mode", "reason"])
        # The routed mode this server runs is exported from the start, at 0 (the target model
        # decodes in verify passes under speculative decoding).
        self.applied.labels(**labels, mode=VERIFY if speculative else DECODE)
        k0_gauge = Gauge("sglang:oea_k0", "The k0 in force", names, multiprocess_mode="mostrecent")
        k0_gauge.labels(**labels).set(k0)
        self.kernel = Gauge("sglang:oea_kernel_info", "MoE routing shapes per routing implementation and kernel "
                            "self-check result", names + ["kernel", "self_check"], multiprocess_mode="mostrecent")
        self.rank_checks = Counter("sglang:oea_rank_checks", "Passed --oea-check-ranks comparisons", names)
        self.exported_checks = 0
        self.exported: Dict[tuple, int] = {}  # (mode,) or (mode, reason) -> count already exported

    def publish(self, runtime: OEARuntime, layers: Optional[Any]) -> None:
        if layers is not None:
            for layer, (steps, before, after) in enumerate_layers(layers):
                self.before.labels(**self.labels, layer=str(layer)).set(before / steps)
                self.after.labels(**self.labels, layer=str(layer)).set(after / steps)
            self.ratio.labels(**self.labels).set(float(layers[:, 2].sum() / layers[:, 1].sum()))
        for mode, count in runtime.applied.items():
            self.applied.labels(**self.labels, mode=mode).inc(self.new_counts((mode,), count))
        for (mode, reason), count in runtime.skipped.items():
            self.skipped.labels(**self.labels, mode=mode, reason=reason).inc(self.new_counts((mode, reason), count))
        if runtime.rank_check is not None:
            self.rank_checks.labels(**self.labels).inc(runtime.rank_check.checks - self.exported_checks)
            self.exported_checks = runtime.rank_check.checks
        for (kernel, result), shapes in runtime.routers.status().items():
            self.kernel.labels(**self.labels, kernel=kernel, self_check=result).set(shapes)

    def new_counts(self, key: tuple, count: int) -> int:
        """How much of a runtime counter is not exported yet (and mark it exported)."""
        new = count - self.exported.get(key, 0)
        self.exported[key] = count
        return new


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
    _export = PrometheusExport(str(name), runtime.rank, runtime.cfg.k0, runtime.speculative)


def summary(runtime: OEARuntime, layers: Optional[Any]) -> str:
    """The short OEA summary appended to SGLang's 'Decode batch' line: applied/counted steps per
    routed mode seen (decode; verify under speculative decoding)."""
    counts = [f"{runtime.applied[mode]}/{runtime.steps_of(mode)} {mode} steps"
              for mode in ROUTED_MODES if runtime.steps_of(mode)] or [f"0/0 {DECODE} steps"]
    text = f"OEA k0={runtime.cfg.k0}: applied {', '.join(counts)}"
    if layers is None:
        return text
    steps, before, after = (float(v) for v in layers[:, :3].sum(dim=0))
    return f"{text}, experts/layer/step {before / steps:.1f} -> {after / steps:.1f} ({after / before:.2f}x)"


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
