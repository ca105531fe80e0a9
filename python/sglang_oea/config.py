"""OEA configuration: one frozen object, validated once at startup. No SGLang import.

Built from the server flags (or `sglang.Engine(oea_k0=...)` keywords), with the deprecated
environment variable SGLANG_OEA_K0 as a fallback for --oea-k0. Everything a user can get wrong
raises ValueError naming the flag and the allowed values, before any weights load.
"""

import logging
import os
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional

logger = logging.getLogger(__name__)

# B = 1 is pure top-k0 pruning, which the paper shows collapses accuracy (AIME 80.4 -> 51.2 at
# k0=3). A row can only be refilled to k experts once the batch's union can hold k experts, i.e.
# B * k0 >= k; B = 4 guarantees that for every k0 >= 2 at k = 8 (Qwen3, DeepSeek-V3, GLM-5).
DEFAULT_MIN_BATCH = 4
DEPRECATED_ENV_K0 = "SGLANG_OEA_K0"
KERNEL_CHOICES = ("auto", "triton", "torch")
# Upper bounds, the same for the flags and for live changes. The settings live in an int32 device
# control block, and the device gate compares rows >= min_batch x rows-per-request in int32: with
# min_batch <= MAX_BATCH (2^16) and at most MAX_ROWS_PER_REQUEST (2^14) token rows per request
# (speculative draft tokens, refused above that at startup) the product stays <= 2^30, so the
# device gate never wraps and always agrees with the host gate. 65,536 rows is far above any
# decode batch SGLang runs; a cap that high is no cap in practice (0 says so directly).
MAX_K0 = 64  # the largest top-k the fused kernel and the torch path support (kernels.checks.MAX_TOP_K)
MAX_BATCH = 1 << 16
MAX_ROWS_PER_REQUEST = 1 << 14
SWITCH_CHOICES = {"on": True, "off": False}
# The keywords of sglang.Engine(...), named like the flags' argparse destinations.
ENGINE_KEYWORDS = (
    "oea_k0", "oea_min_batch", "oea_max_batch", "oea_disable_stats", "oea_kernel",
    "oea_dump_router_logits", "oea_dump_steps", "oea_check_ranks", "oea_verify",
)


@dataclass(frozen=True)
class LiveSettings:
    """The settings routing reads on every pass; on a server started with --oea-k0 they can change
    while it runs (POST /set_internal_state). Validated where they come in (the flags, a live
    update); this record only carries them.

    k0: base size; 0 = OEA off (the router's own experts); >= the layer's top-k = a no-op.
    min_batch: the gate's floor, in requests.
    max_batch: the gate's cap, in routed token rows; 0 = no cap.
    """

    k0: int
    min_batch: int
    max_batch: int


@dataclass(frozen=True)
class OEAConfig:
    """The OEA settings of one server.

    k0: experts each token keeps as its base; None = OEA not installed; 0 = installed ("armed")
        but off until a live change (POST /set_internal_state, sglang_oea.live_settings).
    min_batch: OEA applies only to decode batches with at least this many real requests (in
        speculative verify passes too: requests, not their draft tokens).
    max_batch: OEA is skipped above this many routed token rows (requests x draft tokens in a
        speculative verify pass); 0 = no cap.
    stats: count distinct experts before/after OEA on the device (for /metrics).
    kernel: "auto" (on CUDA the fused Triton kernel after a startup self-check that passed on
        every TP rank, else OEA off for that routing shape; on the CPU the torch path), "triton"
        (the kernel, or refuse to start), "torch" (always torch).
    dump_router_logits: directory to record decode router logits into (None = off).
    dump_steps: how many decode steps to record (bounded).
    check_ranks: every this many decode steps, tensor-parallel ranks compare checksums of the
        experts OEA chose and stop the server if they differ; 0 = off.
    verify: route the target model's speculative-decoding verify passes (--oea-verify on/off).
    """

    k0: Optional[int] = None
    min_batch: int = DEFAULT_MIN_BATCH
    max_batch: int = 0
    stats: bool = True
    kernel: str = "auto"
    dump_router_logits: Optional[str] = None
    dump_steps: int = 32
    check_ranks: int = 0
    verify: bool = True

    def __post_init__(self):
        require_int("--oea-k0", self.k0, minimum=0, maximum=MAX_K0, allow_none=True)
        require_int("--oea-min-batch", self.min_batch, minimum=1, maximum=MAX_BATCH)
        require_int("--oea-max-batch", self.max_batch, minimum=0, maximum=MAX_BATCH)
        require_int("--oea-dump-steps", self.dump_steps, minimum=1)
        require_int("--oea-check-ranks", self.check_ranks, minimum=0)
        if self.kernel not in KERNEL_CHOICES:
            raise ValueError(f"--oea-kernel must be one of {', '.join(KERNEL_CHOICES)}, got {self.kernel!r}")
        if not isinstance(self.stats, bool):
            raise ValueError(f"stats must be True or False (--oea-disable-stats turns it off), got {self.stats!r}")
        if not isinstance(self.verify, bool):
            raise ValueError(f"--oea-verify must be on or off (oea_verify: True or False), got {self.verify!r}")
        if self.dump_router_logits and not self.enabled:
            raise ValueError("--oea-dump-router-logits records only with --oea-k0 set; to record without changing "
                             "any expert, give --oea-k0 the model's top-k")
        if self.check_ranks and not self.enabled:
            raise ValueError("--oea-check-ranks compares the experts OEA chose, so it needs --oea-k0")
        check_batch_window("--oea-min-batch", self.min_batch, "--oea-max-batch", self.max_batch)

    @property
    def enabled(self) -> bool:
        """OEA installed (--oea-k0 given, 0 included): its hooks are in place, and live settings apply."""
        return self.k0 is not None

    def live(self) -> LiveSettings:
        """The settings in force at startup (k0 None reads as 0: off)."""
        return LiveSettings(self.k0 or 0, self.min_batch, self.max_batch)

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        cap = self.max_batch or "none"
        return (
            f"k0={self.k0} min_batch={self.min_batch} max_batch={cap} stats={'on' if self.stats else 'off'} "
            f"kernel={self.kernel} check_ranks={self.check_ranks or 'off'} verify={'on' if self.verify else 'off'}"
        )


def require_int(flag: str, value: Any, minimum: int, maximum: Optional[int] = None, allow_none: bool = False) -> None:
    """Raise ValueError naming `flag` unless value is an int in minimum..maximum (or None when
    allowed; maximum None = no upper bound). A bool or a float (3.0 included) is not an int here."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (maximum is not None and value > maximum):
        allowed = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise ValueError(f"{flag} must be an integer {allowed}, got {value!r}")


def check_batch_window(min_name: str, min_batch: int, max_name: str, max_batch: int) -> None:
    """Raise ValueError unless max_batch is 0 (no cap) or >= min_batch (both already integers)."""
    if max_batch and max_batch < min_batch:
        raise ValueError(f"{max_name} must be 0 (no cap) or >= {min_name} ({min_batch}), got {max_batch}")


def parse_switch(flag: str, value: Any) -> bool:
    """An on/off setting given as "on"/"off" (the flag) or True/False (the Engine keyword)."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, str) or value not in SWITCH_CHOICES:
        raise ValueError(f"{flag} must be one of {', '.join(SWITCH_CHOICES)} (or True / False), got {value!r}")
    return SWITCH_CHOICES[value]


def parse_int_flag(flag: str, text: str, minimum: int, maximum: Optional[int] = None) -> int:
    """Parse a flag's text as an int in minimum..maximum, or raise ValueError naming the flag."""
    try:
        value = int(text, 10)
    except (TypeError, ValueError):
        value = text  # not an integer: require_int refuses it, naming the allowed range
    require_int(flag, value, minimum, maximum)
    return value


def k0_from_environment(environ: Mapping[str, str]) -> Optional[int]:
    """The deprecated SGLANG_OEA_K0 switch, parsed and warned about; None when unset or empty."""
    text = environ.get(DEPRECATED_ENV_K0, "").strip()
    if not text:
        return None
    logger.warning("%s is deprecated; use the server flag --oea-k0 %s instead.", DEPRECATED_ENV_K0, text)
    return parse_int_flag(DEPRECATED_ENV_K0, text, minimum=1, maximum=MAX_K0)


def build_config(values: Mapping[str, Any], environ: Optional[Mapping[str, str]] = None) -> OEAConfig:
    """OEAConfig from flag values keyed like ENGINE_KEYWORDS (missing/None = default).

    --oea-k0 wins over SGLANG_OEA_K0; the variable is used only when the flag is absent.
    Raises ValueError for a key that is not one of ENGINE_KEYWORDS.
    """
    unknown = sorted(set(values) - set(ENGINE_KEYWORDS))
    if unknown:
        raise ValueError(f"unknown OEA setting(s) {', '.join(unknown)}; allowed: {', '.join(ENGINE_KEYWORDS)}")
    environ = os.environ if environ is None else environ
    k0 = values.get("oea_k0")
    env_k0 = k0_from_environment(environ)
    if k0 is None:
        k0 = env_k0
    elif env_k0 is not None and env_k0 != k0:
        logger.warning("--oea-k0 %s overrides %s=%s.", k0, DEPRECATED_ENV_K0, env_k0)
    given = {key[len("oea_"):]: values[key] for key in ENGINE_KEYWORDS[1:] if values.get(key) is not None}
    if "disable_stats" in given:
        disable = given.pop("disable_stats")
        if not isinstance(disable, bool):
            raise ValueError(f"--oea-disable-stats (oea_disable_stats) must be True or False, got {disable!r}")
        given["stats"] = not disable
    if "verify" in given:
        given["verify"] = parse_switch("--oea-verify (oea_verify)", given["verify"])
    return OEAConfig(k0=k0, **given)
