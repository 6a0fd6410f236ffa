"""Slot KV cache: one fixed-capacity slot per running request, laid out so decode is row-exact.

Per layer two slabs `k`, `v` of shape [W, H_kv_local, S, D]: W slots (+1 dummy slot for padding rows when
the engine pads the decode batch, see engine.py), S = the model's `max_seq_len`. A request owns one slot
from admission to finish; its first `kv_len` positions are valid.

Why fixed shapes: on CPU a GEMM's per-row round-off depends on the number of rows M (measured with torch
2.13/oneDNN: rows of `F.linear` fall into classes M=1, M=2..15, M>=16 with different bits), but at a fixed M
a row's result depends neither on its position nor on the other rows' contents (elementwise kernels need the
row count padded too: engine.py). Attention over a fixed key
span S with a boolean mask is exact per row too (masked scores are -inf, exp gives exact zeros, and the
reduction shapes never change). So decode always runs all W rows over all S keys: a request's tokens do not
depend on which other requests share the batch, which slot it sits in, or which engine (of equal W, dtype,
device type and TP) runs it. Empty and frozen slots compute throw-away rows; garbage beyond a row's valid
length is masked and always finite (it is earlier model output or zeros).

Prefill runs one request at a time ([1, T] rows, causal attention over its own tokens) and writes the slot;
the prompt's prefill is therefore the same computation wherever and whenever it runs.

    prefill(slot 3, prompt of 5)         decode step (W=4, S=8), write position = kv_len of each row
    slot 3: [p p p p p . . .]            slot 0: [x x x w . . . .]   mask row 0: [1 1 1 1 0 0 0 0]
                                         slot 1: (empty: write at 0, attend to 0, row discarded)
"""

from __future__ import annotations

import torch


class SlotKVCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_layers, self.num_slots, self.num_kv_heads = num_layers, num_slots, num_kv_heads
        self.max_seq_len, self.head_dim, self.dtype, self.device = max_seq_len, head_dim, dtype, device
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.allocate()

    @staticmethod
    def slot_bytes(num_layers: int, num_kv_heads: int, max_seq_len: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * max_seq_len * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def allocate(self) -> None:
        shape = (self.num_slots, self.num_kv_heads, self.max_seq_len, self.head_dim)
        # zeros, not empty: never-written positions are read (masked) by decode and must be finite
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]

    def free(self) -> None:
        self.k, self.v = [], []

    # ---- per-slot access (migration) --------------------------------------------------------------------
    def read(self, slot: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the first `length` positions of a slot: per layer (k, v) of shape [H_kv, length, D]."""
        return [(k[slot, :, :length].clone(), v[slot, :, :length].clone()) for k, v in zip(self.k, self.v)]

    def write(self, slot: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Load per-layer (k, v) [H_kv, L, D] into the first L positions of a slot; returns L."""
        length = kv[0][0].shape[1]
        for layer, (k, v) in enumerate(kv):
            self.k[layer][slot, :, :length].copy_(k)
            self.v[layer][slot, :, :length].copy_(v)
        return length

    # ---- the model's `kv_cache` hooks -------------------------------------------------------------------
    def prefill_writer(self, slot: int | torch.Tensor) -> _PrefillWriter:
        return _PrefillWriter(self, slot)

    def decoder(self, positions_R: torch.Tensor, row_slot_R: torch.Tensor | None = None) -> _Decoder:
        """Hook for one decode step of R rows; `row_slot_R` maps rows to slots (None: row r is slot r)."""
        return _Decoder(self, positions_R, row_slot_R)

    def decode_mask(self, positions_W: torch.Tensor) -> torch.Tensor:
        """[W, 1, S] bool: row b attends to keys 0..positions[b] (its own new token included)."""
        keys = torch.arange(self.max_seq_len, device=positions_W.device)
        return (keys[None, :] <= positions_W[:, None]).unsqueeze(1)


class _PrefillWriter:
    """Writes one request's prompt K/V into its slot; attention runs over the prompt only (causal).

    `slot` is an int, or a one-element device tensor (CUDA graphs: the slot changes between replays)."""

    def __init__(self, cache: SlotKVCache, slot: int | torch.Tensor):
        self.cache, self.slot = cache, slot

    def update(self, layer: int, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor):
        t = k_BHTD.shape[2]
        if isinstance(self.slot, torch.Tensor):
            self.cache.k[layer][self.slot, :, :t] = k_BHTD
            self.cache.v[layer][self.slot, :, :t] = v_BHTD
        else:
            self.cache.k[layer][self.slot, :, :t].copy_(k_BHTD[0])
            self.cache.v[layer][self.slot, :, :t].copy_(v_BHTD[0])
        return k_BHTD, v_BHTD


class _Decoder:
    """One decode step: write each row's new K/V at its position, attend over the row's whole slot.

    Padding rows (CPU, see engine.py) all map to one dummy slot; then the slab rows are gathered per row."""

    def __init__(self, cache: SlotKVCache, positions_R: torch.Tensor, row_slot_R: torch.Tensor | None):
        self.cache, self.positions, self.gather = cache, positions_R, row_slot_R is not None
        self.slots = row_slot_R if row_slot_R is not None else torch.arange(cache.num_slots, device=positions_R.device)

    def update(self, layer: int, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor):
        k, v = self.cache.k[layer], self.cache.v[layer]
        k[self.slots, :, self.positions] = k_BHTD[:, :, 0]  # padding rows collide in the dummy slot: garbage
        v[self.slots, :, self.positions] = v_BHTD[:, :, 0]
        if self.gather:
            return k.index_select(0, self.slots), v.index_select(0, self.slots)
        return k, v
