"""The rank-divergence guard (--oea-check-ranks N): do all tensor-parallel ranks route alike?

OEA couples the rows of a batch through the union, so one logit that differs by one ulp on one
rank can move other rows to other experts there. The TP all-reduce would then sum partial outputs
of different experts, silently. Each rank therefore folds the ids OEA hands to the MoE layer into a
per-layer checksum on the device (sglang_oea.reference.ids_checksum; the fused kernel adds it
itself, the torch path with a few ops; graph-safe: captured with the routing, so replayed steps are
covered too), and every N decode steps the ranks compare their checksums over the CPU group, as
a counters snapshot holds them (sglang_oea.counters).

No SGLang import: the caller passes the process group.
"""

import logging
from typing import List, Optional

import torch

logger = logging.getLogger("sglang_oea")


class RankDivergenceError(RuntimeError):
    """Tensor-parallel ranks routed a decode step to different experts."""


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

    The checksums come from a counters Snapshot (sglang_oea.counters): cumulative, never reset,
    so a divergence stays visible at every later check, and taken at the end of the same routed
    pass on every rank, so a check never compares a step that is still running on the device.
    """

    def __init__(self, every: int, group: Optional[object], world_size: int):
        self.every, self.group, self.world_size = every, group, world_size
        self.checks = 0

    def due(self, decode_step: int) -> bool:
        return decode_step % self.every == 0

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """[W, 1 + L] int64 on the host: every rank's [routed step, checksums...] (one collective)."""
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, local, group=self.group)
        return torch.stack(parts)

    def check(self, snapshot, decode_step: int) -> None:
        """Raise RankDivergenceError unless every rank holds the same checksums at the same
        routed step. snapshot: a counters.Snapshot (host memory: no device sync here)."""
        local = torch.cat([torch.tensor([snapshot.step], dtype=torch.int64), snapshot.checksums()])
        gathered = self.gather(local)
        steps, sums = gathered[:, 0], gathered[:, 1:]
        if bool((steps != steps[0]).any()):
            message = (f"sglang-oea: tensor-parallel ranks compared checksums of different routed steps "
                       f"(decode step {decode_step}; {', '.join(f'rank {r}={int(s)}' for r, s in enumerate(steps))}): "
                       "the ranks have not run the same decode passes. Stopping; restart without --oea-k0 and "
                       "report this with the model, --tp and the --oea-* flags.")
            logger.error(message)
            raise RankDivergenceError(message)
        layers = mismatched_layers(sums)
        if layers:
            message = describe_mismatch(sums, layers, decode_step)
            logger.error(message)  # one log line per rank, besides the traceback SGLang prints
            raise RankDivergenceError(message)
        self.checks += 1
