"""OEA's per-layer device counters, and the snapshots through which the host reads them. No SGLang import.

The routing adds into one persistent [MAX_LAYERS, 4] int64 table on the device, inside the
forward pass (and so inside captured CUDA graphs):
    column 0, 1, 2: routed steps, distinct experts before OEA, after OEA (the expert metrics);
    column 3:       the rank-check checksum of the ids OEA handed to the layer (--oea-check-ranks).
Nothing ever resets it: the host works with differences between snapshots.

Why snapshots. Under SGLang's overlap scheduler the forward pass of batch N is launched on the
forward stream before batch N-1's results are processed, and `report_decode_stats` runs on the
schedule stream, which waits for batch N only up to its attention metadata, before any MoE layer.
A device-to-host copy of the live table there would read a step that is half done (a different
number of layers on each rank), and zeroing it there would lose adds in flight. So:
  - writer: when a routed pass ends on the host, `take(step)` enqueues on the stream that ran the
    pass (the forward stream) one copy of the table into a pinned host slot and records an event;
    the slot is tagged with the routed steps completed so far. Stream order puts the copy after
    every MoE layer of that pass, and before any layer of the next one.
  - reader: `read()` returns the second-newest snapshot, waiting on its event. The newest one may
    belong to a pass still running; the second-newest belongs to a pass that has ended (its
    results are being processed, or were). Which snapshot that is depends only on how many routed
    passes the host has run, so every tensor-parallel rank reads the same step.
On the CPU the copy is synchronous and there is no event; the protocol is the same.
"""

from dataclasses import dataclass
from typing import Optional

import torch

MAX_LAYERS = 1024
STEPS, BEFORE, AFTER, CHECKSUM = range(4)


class LayerCounters:
    """The device table [MAX_LAYERS, 4] int64 (see the module docstring).

    Rows are 32 bytes, so every layer's stats row starts 16-byte aligned: one compiled kernel
    variant serves all layers (Triton specialises pointers on their alignment).
    """

    def __init__(self, device: torch.device):
        self.table = torch.zeros(MAX_LAYERS, 4, dtype=torch.int64, device=device)
        self.layers_seen = 0  # 1 + the highest layer id routed so far (host int)

    def note_layer(self, layer_id: int) -> None:
        self.layers_seen = max(self.layers_seen, layer_id + 1)

    def stats_row(self, layer_id: int) -> torch.Tensor:
        """[3] int64 view (steps, T before, T after): the kernel's stats= argument."""
        return self.table[layer_id, STEPS:CHECKSUM]

    def checksum_slot(self, layer_id: int) -> torch.Tensor:
        """[1] int64 view: the kernel's checksum= argument."""
        return self.table[layer_id, CHECKSUM:]

    def snapshot_now(self) -> "Snapshot":
        """A synchronous copy of the live table (tests and offline tools only: under the overlap
        scheduler the server must read SnapshotRing instead). Its step is -1."""
        return Snapshot(-1, self.table[: self.layers_seen].to("cpu", copy=True))

    def add_stats(self, layer_id: int, before: torch.Tensor, after: torch.Tensor, gate=1) -> None:
        """The torch path's counts. gate: 1, or a 0-d device bool/int (a closed gate adds 0)."""
        row = torch.stack([torch.ones_like(before), before, after]).long()
        self.stats_row(layer_id).add_(row * gate)


@dataclass
class Snapshot:
    """The table as it stood when a routed pass ended.

    step: routed passes (decode or verify) completed when it was taken.
    table: [layers, 4] int64 on the host (layers = LayerCounters.layers_seen at that time).
    """

    step: int
    table: torch.Tensor

    def checksums(self) -> torch.Tensor:
        """[MAX_LAYERS] int64: column 3, zero past the layers seen (the same size on every rank)."""
        out = torch.zeros(MAX_LAYERS, dtype=torch.int64)
        out[: self.table.shape[0]] = self.table[:, CHECKSUM]
        return out


class SnapshotRing:
    """Two pinned host slots that the forward stream copies the counter table into.

    Two are enough: the reader only ever wants the second-newest snapshot, and it copies that
    slot out before the host enqueues the next write into it (reader and writer share the
    scheduler's thread; the GPU's writes into a slot are ordered on one stream).
    """

    SLOTS = 2

    def __init__(self, counters: LayerCounters):
        self.counters = counters
        device = counters.table.device
        self.on_cuda = device.type == "cuda"
        pinned = self.on_cuda and torch.cuda.is_available()
        self.slots = [torch.zeros(MAX_LAYERS, 4, dtype=torch.int64, pin_memory=pinned) for _ in range(self.SLOTS)]
        self.events = [torch.cuda.Event() if self.on_cuda else None for _ in range(self.SLOTS)]
        self.steps = [-1] * self.SLOTS  # the step tag of each slot's copy
        self.rows = [0] * self.SLOTS  # the layers each slot's copy holds
        self.taken = 0  # snapshots taken so far

    def take(self, step: int) -> None:
        """At the end of a routed pass, on the stream that ran it (never inside graph capture)."""
        slot = self.taken % self.SLOTS
        rows = self.counters.layers_seen
        if rows:
            self.slots[slot][:rows].copy_(self.counters.table[:rows], non_blocking=self.on_cuda)
        if self.events[slot] is not None:
            self.events[slot].record()
        self.steps[slot], self.rows[slot] = step, rows
        self.taken += 1

    def read(self) -> Optional[Snapshot]:
        """The second-newest snapshot (waiting for its copy), or None before two were taken."""
        if self.taken < 2:
            return None
        slot = (self.taken - 2) % self.SLOTS
        if self.events[slot] is not None:
            self.events[slot].synchronize()
        rows = self.rows[slot]
        return Snapshot(self.steps[slot], self.slots[slot][:rows].clone())


def stats_between(newer: Optional[Snapshot], older: Optional[Snapshot]) -> Optional[torch.Tensor]:
    """[L, 4] float64 rows (steps, T before sum, T after sum, layer id) of the layers that routed
    between two snapshots (older None = since the start), or None when none did."""
    if newer is None:
        return None
    counts = newer.table[:, :CHECKSUM].clone()
    if older is not None:
        rows = older.table.shape[0]
        counts[:rows] -= older.table[:, :CHECKSUM]
    layer_ids = torch.arange(counts.shape[0], dtype=torch.float64)[:, None]
    rows = torch.cat([counts.double(), layer_ids], dim=1)[counts[:, STEPS] > 0]
    return rows if rows.shape[0] else None
