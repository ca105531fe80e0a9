"""OEAWorkspace: the preallocated buffers of `oea_route` (sglang_oea.kernels.oea_route), so that a
call allocates nothing and can run under CUDA-graph capture. No SGLang import.

Shape legend: N = routed experts, C = the router's output columns (routed + fused shared experts).
"""

from dataclasses import dataclass
from typing import Optional, Union

import torch


@dataclass
class OEAWorkspace:
    """Preallocated buffers, so that `oea_route` allocates nothing (CUDA-graph capture).

    union: [N] int32, all zero between calls (launch 2 clears it).
    routed: [N] int32, the routed-experts bitmap of the statistics (`stats=`); all zero between
        calls (launch 2 clears it); untouched by calls without stats.
    counter: [1] int32, zero between calls (launch 2 resets it).
    rows: [1] int32, where a call given num_valid_rows as an int (or None) writes it.
    control: [3] int32, where a call given its settings as ints writes (k0, min_batch, max_batch).
    out_ids: [max_rows, C] in the router's ids dtype; out_weights: [max_rows, C] in its weights
        dtype, C = routed + shared-expert columns. A call with B rows writes and returns views
        out_ids[:B], out_weights[:B].

    Contract: build once per MoE layer (or share between layers of equal shape, if each
    layer's outputs are consumed before the next call), outside graph capture, and never free
    or replace one that a captured graph uses. Calls that use one workspace must be serialised
    on one stream. The returned tensors are overwritten by the next call with the same
    workspace. Call `reset()` if a call was ever interrupted.
    """

    union: torch.Tensor
    routed: torch.Tensor
    counter: torch.Tensor
    rows: torch.Tensor
    control: torch.Tensor
    out_ids: torch.Tensor
    out_weights: torch.Tensor

    @classmethod
    def allocate(
        cls,
        num_experts: int,
        num_columns: int,
        max_rows: int,
        ids_dtype: torch.dtype = torch.int32,
        weights_dtype: torch.dtype = torch.float32,
        device: Union[str, torch.device] = "cuda",
    ) -> "OEAWorkspace":
        """num_columns: the router's output width, routed plus fused shared-expert columns."""
        return cls(
            union=torch.zeros(num_experts, dtype=torch.int32, device=device),
            routed=torch.zeros(num_experts, dtype=torch.int32, device=device),
            counter=torch.zeros(1, dtype=torch.int32, device=device),
            rows=torch.zeros(1, dtype=torch.int32, device=device),
            control=torch.zeros(3, dtype=torch.int32, device=device),
            out_ids=torch.empty(max_rows, num_columns, dtype=ids_dtype, device=device),
            out_weights=torch.empty(max_rows, num_columns, dtype=weights_dtype, device=device),
        )

    @property
    def max_rows(self) -> int:
        return self.out_ids.shape[0]

    def reset(self) -> None:
        """Zero U, R and the counter (only needed if a call was interrupted half-way)."""
        self.union.zero_()
        self.routed.zero_()
        self.counter.zero_()

    def check(self, num_rows: int, num_experts: int, ids: torch.Tensor, weights: torch.Tensor):
        """Assert that this workspace fits a call (shapes and dtypes only: no device sync)."""
        for name in ("union", "routed"):
            t = getattr(self, name)
            assert t.shape == (num_experts,) and t.dtype == torch.int32, f"{name}: {t.shape=} {t.dtype=}"
        for name, size in (("counter", 1), ("rows", 1), ("control", 3)):
            t = getattr(self, name)
            assert t.shape == (size,) and t.dtype == torch.int32, f"{name}: {t.shape=} {t.dtype=}"
        assert self.out_ids.shape[0] >= num_rows and self.out_ids.shape[1] == ids.shape[1], f"{self.out_ids.shape=}"
        assert self.out_weights.shape == self.out_ids.shape, f"{self.out_weights.shape=}"
        assert self.out_ids.dtype == ids.dtype, f"{self.out_ids.dtype=} {ids.dtype=}"
        assert self.out_weights.dtype == weights.dtype, f"{self.out_weights.dtype=} {weights.dtype=}"
        for t in (self.routed, self.counter, self.rows, self.control, self.out_ids):
            assert t.device == self.union.device == ids.device, f"{t.device=} {ids.device=}"

    def row_count(self, num_valid_rows: Optional[Union[int, torch.Tensor]], num_rows: int) -> torch.Tensor:
        """The 1-element int32 device tensor the kernels read the real row count from: the caller's,
        or the `rows` slot with the int written into it (one fill; None: all num_rows rows)."""
        if isinstance(num_valid_rows, torch.Tensor):
            assert num_valid_rows.numel() == 1 and num_valid_rows.dtype == torch.int32, f"{num_valid_rows=}"
            assert num_valid_rows.device == self.union.device, f"{num_valid_rows.device=}"
            return num_valid_rows
        self.rows.fill_(num_rows if num_valid_rows is None else int(num_valid_rows))
        return self.rows

    def control_block(self, control: Optional[torch.Tensor], k0: int, min_batch: int, max_batch: int) -> torch.Tensor:
        """The int32 [3] device tensor the kernels read (k0, min_batch, max_batch) from: the caller's
        control block, or the `control` slot with the int settings written into it (three fills)."""
        if control is not None:
            return control
        for i, value in enumerate((k0, min_batch, max_batch)):
            self.control[i].fill_(value)
        return self.control
