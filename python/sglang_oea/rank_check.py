"""The rank-divergence guard (--oea-check-ranks N): do all tensor-parallel ranks route alike?

OEA couples the rows of a batch through the union, so one logit that differs by one ulp on one
rank can move other rows to other experts there. The TP all-reduce would then sum partial outputs
of different experts, silently. Each rank therefore folds the ids OEA hands to the MoE layer into a
per-layer checksum on the device (graph-safe: captured with the routing, so replayed steps are
covered too), and every N decode steps the ranks compare their checksums over the CPU group.

No SGLang import: the caller passes the process group.
"""

import logging
from typing import List, Optional

import torch

logger = logging.getLogger("sglang_oea")

# Odd 64-bit mixing constants (splitmix64's), as signed int64; products wrap.
MIX1 = 0x9E3779B97F4A7C15 - (1 << 64)
MIX2 = 0xBF58476D1CE4E5B9 - (1 << 64)
ROW_SHIFT = 20  # expert ids < 2**20


class RankDivergenceError(RuntimeError):
    """Tensor-parallel ranks routed a decode step to different experts."""


def ids_checksum(ids: torch.Tensor) -> torch.Tensor:
    """A 0-d int64 digest of a batch's expert choice.

    ids: [B, K] integer expert ids (any column order). The digest is a wrapping sum over rows r and
    columns of mix(r, id): column order does not matter, while a changed id, or two rows trading
    experts, changes it except with probability about 2**-64.
    """
    rows = torch.arange(1, ids.shape[0] << ROW_SHIFT, 1 << ROW_SHIFT, device=ids.device, dtype=torch.int64)
    h = (ids.long() + rows[:, None]) * MIX1
    h = (h ^ (h >> 31)) * MIX2
    return h.sum()


def mismatched_layers(gathered: torch.Tensor) -> List[int]:
    """Layers whose checksums differ between ranks. gathered: [W, L] int64, one row per rank."""
    differs = (gathered != gathered[:1]).any(dim=0)
    return differs.nonzero().flatten().tolist()


def describe_mismatch(gathered: torch.Tensor, layers: List[int], step: int) -> str:
    """The error text: which layers, each rank's checksum for the first few."""
    def hex64(value) -> str:  # the checksum's 64 bits, unsigned
        return f"{int(value) & (1 << 64) - 1:#018x}"

    shown = "; ".join(f"layer {layer}: " + ", ".join(f"rank {r}={hex64(v)}" for r, v in enumerate(gathered[:, layer]))
                      for layer in layers[:3])
    more = f" (and {len(layers) - 3} more layers)" if len(layers) > 3 else ""
    return (f"sglang-oea: tensor-parallel ranks routed different experts (decode step {step}; {shown}{more}). "
            "Outputs of this server are wrong from the first such step on. Stopping; restart without --oea-k0 "
            "and report this with the model, --tp and the --oea-* flags.")


class RankCheck:
    """Every `every` decode steps, compare this rank's checksums with the other ranks'.

    checksums: [L] int64 device tensor that routing adds into (cumulative, never reset, so a
    divergence stays visible at every later check).
    """

    def __init__(self, every: int, group: Optional[object], world_size: int):
        self.every, self.group, self.world_size = every, group, world_size
        self.checks = 0

    def due(self, decode_step: int) -> bool:
        return self.world_size > 1 and decode_step % self.every == 0

    def gather(self, checksums: torch.Tensor) -> torch.Tensor:
        """[W, L] int64 on the host: every rank's checksums (one device sync, one collective)."""
        local = checksums.to("cpu", copy=True)
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, local, group=self.group)
        return torch.stack(parts)

    def check(self, checksums: torch.Tensor, decode_step: int) -> None:
        """Raise RankDivergenceError unless every rank holds the same checksums."""
        gathered = self.gather(checksums)
        layers = mismatched_layers(gathered)
        if layers:
            message = describe_mismatch(gathered, layers, decode_step)
            logger.error(message)  # one log line per rank, besides the traceback SGLang prints
            raise RankDivergenceError(message)
        self.checks += 1
