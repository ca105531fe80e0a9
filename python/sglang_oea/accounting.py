"""Accounting of forward passes: applied or skipped, per pass mode. No SGLang import.

Accounting is done when the outermost forward pass ends, from what actually happened in it: a
routed pass counts as applied only if OEA rewrote its ids (eagerly, or by replaying a CUDA graph
whose capture rewrote them); otherwise it is skipped with the reason. Warm-up and capture passes
are not serving steps and are not counted (a capture pass records its bucket's outcome, which its
replays inherit); neither are the draft model's passes (under speculative decoding, every DECODE
pass belongs to the draft model).

Every pass is attributed to the LiveSettings it ran with (StepInfo.settings): the host gate, the
skip reason and the per-k0 counts (`applied_by_k0`, `skipped_by_k0`) use them. A replayed graph
holds routing iff its capture pass routed; whether that routing rewrote the ids is decided at
replay by the pass's own settings (k0 = 0: oea_off; k0 >= the layers' top-k: k0_covers_top_k).
"""

import logging
from collections import Counter
from typing import Dict, Optional, Tuple

from sglang_oea.config import OEAConfig
from sglang_oea.passes import DRAFT, ROUTED_MODES, SKIP_NO_IDS, SKIP_NOOP, StepInfo, skip_reason

logger = logging.getLogger(__name__)


class PassAccounts:
    """The serving passes of one process by mode and outcome, and each graph bucket's capture."""

    def __init__(self, cfg: OEAConfig):
        self.cfg = cfg
        self.routed_steps = 0  # decode and verify steps counted (applied or skipped)
        # (mode, bucket in requests, token rows per request) -> outcome of its capture, and the top-k
        # of the layers it routed. Rows per request are part of the key: under adaptive speculative
        # decoding one verify runner per draft width captures the same buckets, and a wider runner
        # may leave a bucket unrouted (the cap counts rows) that a narrower one routed.
        self.captured: Dict[Tuple[str, int, int], Optional[str]] = {}
        self.captured_top_k: Dict[Tuple[str, int, int], int] = {}
        self.applied_by_k0: Counter = Counter()  # (pass mode, k0) -> steps whose ids OEA rewrote
        self.skipped_by_k0: Counter = Counter()  # (pass mode, k0, reason) -> steps without OEA
        # k0 -> real token rows of the decode and verify steps counted with it (applied or
        # skipped): the tokens the lost router mass is averaged over (sglang_oea.metrics).
        self.tokens_by_k0: Counter = Counter()
        self.warned_no_ids = False

    @property
    def applied(self) -> Counter:
        """pass mode -> steps whose ids OEA rewrote, over every k0."""
        by_mode: Counter = Counter()
        for (mode, _), count in self.applied_by_k0.items():
            by_mode[mode] += count
        return by_mode

    @property
    def skipped(self) -> Counter:
        """(pass mode, reason) -> steps without OEA, over every k0."""
        by_reason: Counter = Counter()
        for (mode, _, reason), count in self.skipped_by_k0.items():
            by_reason[(mode, reason)] += count
        return by_reason

    @property
    def applied_steps(self) -> int:
        return sum(self.applied.values())

    @property
    def skipped_steps(self) -> Counter:
        """reason -> skipped steps, over all pass modes."""
        by_reason: Counter = Counter()
        for (_, reason), count in self.skipped.items():
            by_reason[reason] += count
        return by_reason

    def steps_of(self, mode: str) -> int:
        """Counted steps (applied or skipped) of one pass mode."""
        return self.applied[mode] + sum(count for (m, _), count in self.skipped.items() if m == mode)

    def end_pass(self, step: StepInfo) -> bool:
        """Account for the outermost pass that is ending (see the module docstring). True when it
        was a serving pass, now counted."""
        if step.graph:
            if step.routed:  # replays of this bucket hold routing iff this capture pass routed
                key = (step.mode, step.bucket, step.rows_per_request)
                self.captured[key] = step.tally.outcome()
                self.captured_top_k[key] = step.tally.top_k
            return False
        if step.mode == DRAFT:
            return False
        reason = skip_reason(step.settings, self.cfg.verify, step.mode, step.requests, step.num_rows)
        if reason is None:
            reason = self.replay_outcome(step) if step.tally.replayed_bucket is not None else step.tally.outcome()
        self.count(step.mode, reason, step.settings.k0, step.num_rows)
        return True

    def count(self, mode: str, reason: Optional[str], k0: int, rows: int = 0) -> None:
        """One serving pass of `mode` with `rows` real token rows, routed with `k0`: applied (reason
        None) or skipped with `reason`."""
        if mode in ROUTED_MODES:
            self.routed_steps += 1
            self.tokens_by_k0[k0] += rows
        if reason is None:
            self.applied_by_k0[(mode, k0)] += 1
            return
        self.skipped_by_k0[(mode, k0, reason)] += 1
        if reason == SKIP_NO_IDS and not self.warned_no_ids:
            self.warned_no_ids = True
            logger.warning("sglang-oea: a %s step ended without the routing hook seeing any top-k ids; the MoE "
                           "backend may route inside its kernel. OEA is not applied (metric reason no_topk_ids).",
                           mode)

    def replay_outcome(self, step: StepInfo) -> Optional[str]:
        """A replayed graph rewrote ids iff its capture pass routed and the pass's k0 is below the
        top-k of the layers it routed (the device gate agrees with the host gate, which already
        passed: k0 >= 1 and the batch inside min_batch..max_batch)."""
        key = (step.mode, step.tally.replayed_bucket, step.rows_per_request)
        outcome = self.captured.get(key, SKIP_NO_IDS)
        if outcome is None and key in self.captured_top_k and step.settings.k0 >= self.captured_top_k[key]:
            return SKIP_NOOP
        return outcome
