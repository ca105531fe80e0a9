"""OEA's per-layer device counters, and the snapshots through which the host reads them. No SGLang import.

The routing adds into one persistent [MAX_LAYERS, WIDTH] int64 table on the device, inside the
forward pass (and so inside captured CUDA graphs):
    column 0, 1, 2: routed steps, distinct experts before OEA, after OEA (the expert metrics);
    column 3:       the rank-check checksum of the ids OEA handed to the layer (--oea-check-ranks);
    columns LOST + k0, k0 in [0, MAX_K0): the router mass OEA dropped from the tokens it routed
                    with k0 (reference.lost_router_mass_units: 2^-20 of a token per unit). The
                    column is chosen on the device from the control block's k0, so a captured
                    graph files every step under the k0 it ran with, across live changes.
Nothing ever resets it: the host works with differences between snapshots. Each snapshot also
carries a host payload taken with it (the runtime's routed tokens by k0), so that the
host's counts and the device's cover the same passes.

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
from typing import Any, Optional

import torch

from sglang_oea.config import MAX_K0

MAX_LAYERS = 1024
STEPS, BEFORE, AFTER, CHECKSUM = range(4)
LOST = 8  # columns 4..7 are unused: the lost columns start 64-byte aligned in every row
WIDTH = LOST + MAX_K0


class LayerCounters:
    """The device table [MAX_LAYERS, WIDTH] int64 (see the module docstring).

    Rows are 576 bytes, so every layer's stats row and lost row start 16-byte aligned: one compiled
    kernel variant serves all layers (Triton specialises pointers on their alignment).
    """

    def __init__(self, device: torch.device):
        self.table = torch.zeros(MAX_LAYERS, WIDTH, dtype=torch.int64, device=device)
        self.layers_seen = 0  # 1 + the highest layer id routed so far (host int)

    def note_layer(self, layer_id: int) -> None:
        self.layers_seen = max(self.layers_seen, layer_id + 1)

    def stats_row(self, layer_id: int) -> torch.Tensor:
        """[3] int64 view (steps, T before, T after): the kernel's stats= argument."""
        return self.table[layer_id, STEPS:CHECKSUM]

    def checksum_slot(self, layer_id: int) -> torch.Tensor:
        """[1] int64 view: the kernel's checksum= argument."""
        return self.table[layer_id, CHECKSUM:CHECKSUM + 1]

    def lost_row(self, layer_id: int) -> torch.Tensor:
        """[MAX_K0] int64 view: the kernel's lost= argument (lost router mass by k0)."""
        return self.table[layer_id, LOST:]

    def snapshot_now(self) -> "Snapshot":
        """A synchronous copy of the live table (tests and offline tools only: under the overlap
        scheduler the server must read SnapshotRing instead). Its step is -1."""
        return Snapshot(-1, self.table[: self.layers_seen].to("cpu", copy=True))

    def add_lost(self, layer_id: int, k0, units: torch.Tensor) -> None:
        """The torch path's lost router mass (0-d int64) into the column of k0: a host int, or a
        0-d device tensor (the control block's; clamped, as the kernel clamps it: a k0 outside
        [1, K) closes the gate, and the caller then adds 0)."""
        row = self.lost_row(layer_id)
        if isinstance(k0, torch.Tensor):
            row.index_add_(0, k0.clamp(0, MAX_K0 - 1).long().view(1), units.view(1))
        else:
            row[min(max(k0, 0), MAX_K0 - 1)].add_(units)

    def add_stats(self, layer_id: int, before: torch.Tensor, after: torch.Tensor, gate=1) -> None:
        """The torch path's counts. gate: 1, or a 0-d device bool/int (a closed gate adds 0)."""
        row = torch.stack([torch.ones_like(before), before, after]).long()
        self.stats_row(layer_id).add_(row * gate)


@dataclass
class Snapshot:
    """The table as it stood when a routed pass ended.

    step: routed passes (decode or verify) completed when it was taken.
    table: [layers, WIDTH] int64 on the host (layers = LayerCounters.layers_seen at that time).
    host: what the host counted up to the same pass (the runtime's routed tokens), or None.
    """

    step: int
    table: torch.Tensor
    host: Any = None

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
        self.slots = [torch.zeros(MAX_LAYERS, WIDTH, dtype=torch.int64, pin_memory=pinned) for _ in range(self.SLOTS)]
        self.events = [torch.cuda.Event() if self.on_cuda else None for _ in range(self.SLOTS)]
        self.steps = [-1] * self.SLOTS  # the step tag of each slot's copy
        self.rows = [0] * self.SLOTS  # the layers each slot's copy holds
        self.host: list = [None] * self.SLOTS  # each slot's host payload
        self.taken = 0  # snapshots taken so far

    def take(self, step: int, host: Any = None) -> None:
        """At the end of a routed pass, on the stream that ran it (never inside graph capture).
        host: the host's counts up to the same pass, kept with the copy (the caller's own object:
        it must not change it afterwards)."""
        slot = self.taken % self.SLOTS
        rows = self.counters.layers_seen
        if rows:
            self.slots[slot][:rows].copy_(self.counters.table[:rows], non_blocking=self.on_cuda)
        if self.events[slot] is not None:
            self.events[slot].record()
        self.steps[slot], self.rows[slot], self.host[slot] = step, rows, host
        self.taken += 1

    def read(self) -> Optional[Snapshot]:
        """The second-newest snapshot (waiting for its copy), or None before two were taken."""
        if self.taken < 2:
            return None
        slot = (self.taken - 2) % self.SLOTS
        if self.events[slot] is not None:
            self.events[slot].synchronize()
        rows = self.rows[slot]
        return Snapshot(self.steps[slot], self.slots[slot][:rows].clone(), self.host[slot])


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


def lost_between(newer: Snapshot, older: Optional[Snapshot]) -> torch.Tensor:
    """[layers, MAX_K0] int64: the lost router mass units added between two snapshots (older None
    = since the start), by layer id (rows of newer) and k0 (columns)."""
    lost = newer.table[:, LOST:].clone()
    if older is not None:
        rows = older.table.shape[0]
        lost[:rows] -= older.table[:, LOST:]
    return lost
