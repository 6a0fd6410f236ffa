"""Slot KV cache: one fixed-capacity slot per running request, laid out so decode is row-exact.

Per layer two slabs `k`, `v` of shape [W, H_kv_local, S, D]: W slots (+1 dummy slot for padding rows when
the engine pads the decode batch, see engine.py), S = the model's `max_seq_len`. A request owns one slot
from admission to finish; its first `kv_len` positions are valid.

Why the shapes are what they are: on CPU a GEMM's per-row round-off depends on the number of rows M (measured
with torch 2.13/oneDNN: rows of `F.linear` fall into classes M=1, M=2..15, M>=16 with different bits), but at a
fixed M a row's result depends neither on its position nor on the other rows' contents (elementwise kernels
need the row count padded too: engine.py). So decode always runs all R rows through the projections and MLP.
Attention is where a row's cost follows its length: a row reads the first `span` keys of its slot, span = its
position + 1 rounded up to a length bucket (`tidal.engine.shapes.padded_len`), masked past its position (masked
scores are -inf and exp gives exact zeros). In the batch-invariant mode rows are grouped by their own span
(`RowGroup`), so a row's attention shape depends on its own position only and a request's tokens do not depend
on which other requests share the batch, which slot it sits in, or which engine (of equal numerics) runs it; the
step-wide mode gives every row the longest active row's span (one CUDA graph per span). Empty and frozen slots
compute throw-away rows; garbage beyond a row's valid length is masked and always finite (earlier model output,
padding's K/V, or zeros).

Prefill writes a prompt's K/V into its slot: one request at a time ([1, T], causal over its own tokens: the same
computation wherever and whenever it runs), or, step-wide, right-padded prompts [n, T] in one forward.

    prefill(slot 3, prompt of 5)         decode step, write position = kv_len of each row, span 16 (a bucket)
    slot 3: [p p p p p . . .]            slot 0: [x x x w . . . .]   mask row 0: [1 1 1 1 0 0 ... 0] (16 keys)
                                         slot 1: (empty: write at 0, attend to 0, row discarded)
"""

from __future__ import annotations

from typing import cast

import torch

from tidal.engine.generation.decode_attention import decode_attention_fused


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
    def prefill_writer(self, slots: int | torch.Tensor) -> _PrefillWriter:
        return _PrefillWriter(self, slots)

    def decoder(self, positions_R: torch.Tensor, row_slot_R: torch.Tensor | None,
                span: int | None = None, groups: list[RowGroup] | None = None, fused: bool = False) -> _Decoder:
        """Hook for one decode step of R rows; `row_slot_R` maps rows to slots (None: row r is slot r). Either
        every row attends over the first `span` keys of its slot, or each `RowGroup` over its own span. `fused`
        (with `span`, CUDA): the Triton kernel of `decode_attention`, each row reading its own keys 0..pos."""
        return _Decoder(self, positions_R, row_slot_R, span, groups, fused)


class RowGroup:
    """Decode rows that attend over the same key span: their row and slot indices and their [n, 1, 1, span]
    mask (key j visible to a row at position p iff j <= p), built once per step, used by every layer."""

    def __init__(self, rows: list[int], slots: list[int], positions: list[int], span: int, device):
        self.rows = torch.tensor(rows, device=device)
        self.slots = torch.tensor(slots, device=device)
        self.span = span
        keys = torch.arange(span, device=device)
        self.mask = (keys[None, :] <= torch.tensor(positions, device=device)[:, None])[:, None, None, :]


def decode_attention(q_RH1D: torch.Tensor, k_RKSD: torch.Tensor, v_RKSD: torch.Tensor,
                     mask_R11S: torch.Tensor) -> torch.Tensor:
    """One query token per row over S keys, grouped-query without copying K/V: the H query heads of a row
    become `H / K` queries of each of its K kv heads (head h reads kv head h // (H / K), as repeat_interleave
    would), so every backend that takes a broadcast boolean mask serves it (on CUDA the memory-efficient
    kernel, which the fused `enable_gqa` + mask call does not reach)."""
    r, h, _, d = q_RH1D.shape
    kv = k_RKSD.shape[1]
    q = q_RH1D.reshape(r, kv, h // kv, d)
    out = torch.nn.functional.scaled_dot_product_attention(q, k_RKSD, v_RKSD, attn_mask=mask_R11S)
    return out.reshape(r, h, 1, d)


class _PrefillWriter:
    """Writes prompts' K/V into their slots; attention runs over each prompt only (causal, right-padded rows).

    `slots` is an int (one request), or a device tensor of one slot per row (a batched prefill, or a CUDA graph
    whose slot changes between replays)."""

    def __init__(self, cache: SlotKVCache, slots: int | torch.Tensor):
        self.cache, self.slots = cache, slots

    def update(self, layer: int, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor):
        t = k_BHTD.shape[2]
        if isinstance(self.slots, torch.Tensor):
            self.cache.k[layer][self.slots, :, :t] = k_BHTD
            self.cache.v[layer][self.slots, :, :t] = v_BHTD
        else:
            self.cache.k[layer][self.slots, :, :t].copy_(k_BHTD[0])
            self.cache.v[layer][self.slots, :, :t].copy_(v_BHTD[0])
        return k_BHTD, v_BHTD


class _Decoder:
    """One decode step: write each row's new K/V at its position, then attend over the keys the row needs.

    `span`: every row reads the first `span` keys of its own slot (rows are slots; CUDA graphs capture one
    step per span). `groups`: each row reads its own span's keys, gathered per group (the exact CPU path:
    a row's span depends on its own position only, never on which rows share the step)."""

    def __init__(self, cache: SlotKVCache, positions_R: torch.Tensor, row_slot_R: torch.Tensor | None,
                 span: int | None, groups: list[RowGroup] | None, fused: bool = False):
        if (span is None) == (groups is None):
            raise ValueError("a decode step takes either one span or row groups")
        if fused and span is None:
            raise ValueError("the fused decode attention takes one span, not row groups")
        self.cache, self.positions, self.span, self.groups, self.fused = cache, positions_R, span, groups, fused
        #: the fused kernel applies RoPE to q and the new K itself (the model passes them unrotated, with the
        #: rows' cos/sin): one launch a layer fewer
        self.rotates_qk = fused
        self.gather = row_slot_R is not None
        device = positions_R.device
        self.slots = row_slot_R if row_slot_R is not None else torch.arange(cache.num_slots, device=device)
        if fused:
            return   # the kernel masks by position and writes the new K/V itself
        if span is not None:
            keys = torch.arange(span, device=device)
            visible = (keys[None, :] <= positions_R[:, None])[:, None, None, :]
            # additive, in the cache dtype, once per step: SDPA would convert a boolean mask the same way (zeros,
            # -inf where masked) in every layer's call
            self.mask = torch.zeros(visible.shape, dtype=cache.dtype, device=device).masked_fill_(~visible,
                                                                                                 float("-inf"))
        # where each row's new K/V goes in a layer's slab viewed as [slots * H_kv * S, D]: one index_copy_ per
        # tensor and layer, these indices computed once per step
        heads = torch.arange(cache.num_kv_heads, device=device)
        self.write_rows = ((self.slots[:, None] * cache.num_kv_heads + heads[None, :]) * cache.max_seq_len
                           + positions_R[:, None]).reshape(-1)

    def attend(self, layer: int, q_RH1D: torch.Tensor, k_RK1D: torch.Tensor, v_RK1D: torch.Tensor,
               cos_R1D: torch.Tensor | None = None, sin_R1D: torch.Tensor | None = None) -> torch.Tensor:
        """The step's attention output [R, H, 1, D]; q and the new K come unrotated with the rows' cos/sin
        ([R, 1, D]) when `rotates_qk`, rotated otherwise."""
        k, v = self.cache.k[layer], self.cache.v[layer]
        if self.fused:
            if cos_R1D is None or sin_R1D is None:
                raise ValueError("the fused decode step applies RoPE: pass the rows' cos and sin")
            out = decode_attention_fused(q_RH1D[:, :, 0], k_RK1D[:, :, 0], v_RK1D[:, :, 0], k, v, self.slots,
                                         self.positions, cast(int, self.span), cos_R1D[:, 0], sin_R1D[:, 0])
            return out[:, :, None]
        d = self.cache.head_dim   # padding rows collide in the dummy slot: garbage, never read unmasked
        k.view(-1, d).index_copy_(0, self.write_rows, k_RK1D.reshape(-1, d))
        v.view(-1, d).index_copy_(0, self.write_rows, v_RK1D.reshape(-1, d))
        if self.groups is None:
            span = cast(int, self.span)
            if self.gather:
                return decode_attention(q_RH1D, k[self.slots, :, :span], v[self.slots, :, :span], self.mask)
            return decode_attention(q_RH1D, k[:, :, :span], v[:, :, :span], self.mask)
        out = torch.empty_like(q_RH1D)
        for g in self.groups:
            out[g.rows] = decode_attention(q_RH1D.index_select(0, g.rows), k[g.slots, :, :g.span],
                                           v[g.slots, :, :g.span], g.mask)
        return out
