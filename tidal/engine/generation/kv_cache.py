"""Paged KV cache: fixed-size blocks of positions, each request holding the blocks its tokens need.

Per layer two pools `k`, `v` of shape [N, H_kv_local, B, D]: N blocks of B positions, views of one tensor
`pool` [layers, 2, N, H_kv_local, B, D] (so a request's blocks of every layer move as one indexed copy, and one
CUDA IPC handle shares them all: `tidal.engine.transfer`). Each slot (a running
request's handle in the engine) has a row of the block table [slots, ceil(S / B)]: logical block j of the slot
(positions j*B .. j*B + B - 1) lives in physical block `table[slot, j]`. Block 0 is the null block: every
table entry that holds no block points at it, so a write that lands where a request holds no block (padding
rows, empty and frozen slots, a padded prefill's tail) goes there, and a read of keys past a row's position
(masked) reads finite garbage from it. Memory follows the tokens: a request holds ceil(positions / B) blocks,
not `max_seq_len` positions, and the engine adds a block as a request's next position crosses into it
(preempting the newest request when none is free: engine.py).

Why the shapes are what they are: on CPU a GEMM's per-row round-off depends on the number of rows M (measured
with torch 2.13/oneDNN: rows of `F.linear` fall into classes M=1, M=2..15, M>=16 with different bits), but at a
fixed M a row's result depends neither on its position nor on the other rows' contents (elementwise kernels
need the row count padded too: engine.py). So decode always runs all R rows through the projections and MLP.
Attention is where a row's cost follows its length: a row reads the first `span` keys of its slot, span = its
position + 1 rounded up to a length bucket (`tidal.engine.shapes.padded_len`), masked past its position (masked
scores are -inf and exp gives exact zeros). The SDPA paths gather a row's blocks into a contiguous
[H_kv, span, D] copy, so the kernel sees the same tensor whatever blocks hold the keys: a row's bits do not
depend on its block numbers. In the batch-invariant mode rows are grouped by their own span (`RowGroup`), so a
row's attention shape depends on its own position only and a request's tokens do not depend on which other
requests share the batch, which slot or blocks it holds, or which engine (of equal numerics) runs it; the
step-wide mode gives every row the longest active row's span (one CUDA graph per span). The Triton kernel reads
the blocks in place (a block is a multiple of its 64-key loads, so its sums are those of a contiguous slot).

Prefill writes a prompt's K/V into its blocks: one request at a time ([1, T], causal over its own tokens: the same
computation wherever and whenever it runs), or, step-wide, right-padded prompts [n, T] in one forward.

    B = 4; slot 3 holds blocks [5, 2]; prefill of 6 tokens      decode at position 6 writes block 2, offset 2
    table[3] = [5, 2, 0, 0]   block 5: [p p p p]  block 2: [p p . .]     and reads block 5 + block 2[:3]
"""

from __future__ import annotations

from typing import cast

import torch

from tidal.engine.generation.decode_attention import decode_attention_fused

NULL_BLOCK = 0


class PagedKVCache:
    """The KV pools and the block table; owns which blocks each slot holds (the engine decides when to grow,
    free or preempt: `grow`, `release`, `free_blocks`)."""

    def __init__(self, num_layers: int, num_slots: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 max_seq_len: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        if num_blocks < 2:
            raise ValueError("a paged KV cache needs the null block and at least one more")
        self.num_layers, self.num_slots, self.num_blocks = num_layers, num_slots, num_blocks
        self.block_size, self.num_kv_heads, self.max_seq_len = block_size, num_kv_heads, max_seq_len
        self.head_dim, self.dtype, self.device = head_dim, dtype, device
        self.max_blocks = -(-max_seq_len // block_size)   # table columns: blocks of the longest request
        self.pool = torch.empty(0, dtype=dtype, device=device)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        # the table on the host (the owner) and its device copy, uploaded before the next device work reads it
        self._table_h = torch.zeros((num_slots, self.max_blocks), dtype=torch.int32)
        self.table = torch.zeros((num_slots, self.max_blocks), dtype=torch.int32, device=device)
        self._held: list[list[int]] = [[] for _ in range(num_slots)]
        self._free: list[int] = []
        self._dirty = False
        self.allocate()

    @staticmethod
    def block_bytes(num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * block_size * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def layout(self) -> str:
        """The geometry a block copy between two pools needs equal on both sides."""
        return (f"layers={self.num_layers},kv_heads={self.num_kv_heads},block={self.block_size},"
                f"head_dim={self.head_dim},dtype={self.dtype}")

    @property
    def block_nbytes(self) -> int:
        """Bytes one block holds over every layer, keys and values."""
        return self.block_bytes(self.num_layers, self.num_kv_heads, self.block_size, self.head_dim, self.dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def allocate(self) -> None:
        """The pools (every block free) and an empty table."""
        shape = (self.num_layers, 2, self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim)
        # zeros, not empty: the null block and never-written positions are read (masked) and must be finite
        self.pool = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.k = [self.pool[layer, 0] for layer in range(self.num_layers)]
        self.v = [self.pool[layer, 1] for layer in range(self.num_layers)]
        self._held = [[] for _ in range(self.num_slots)]
        # lowest numbers first (pop from the end): a fresh cache hands out blocks 1, 2, 3, ...
        self._free = list(range(self.num_blocks - 1, NULL_BLOCK, -1))
        self._table_h.zero_()
        self._dirty = True
        self.upload()

    def free(self) -> None:
        self.pool = torch.empty(0, dtype=self.dtype, device=self.device)
        self.k, self.v = [], []

    # ---- blocks ---------------------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def held(self, slot: int) -> int:
        return len(self._held[slot])

    def grow(self, slot: int, positions: int) -> bool:
        """Give the slot blocks for positions 0..positions-1; False (and nothing taken) if too few are free."""
        more = self.blocks_for(positions) - len(self._held[slot])
        if more <= 0:
            return True
        if more > len(self._free):
            return False
        for _ in range(more):
            block = self._free.pop()
            self._table_h[slot, len(self._held[slot])] = block
            self._held[slot].append(block)
        self._dirty = True
        return True

    def take(self, n: int) -> list[int] | None:
        """`n` free blocks held by no slot (a moved request's KV lands in them before it has a slot: `bind`);
        None, and nothing taken, if too few are free."""
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def give(self, blocks: list[int]) -> None:
        """Blocks from `take` back to the pool (a moved request dropped before it had a slot)."""
        self._free.extend(reversed(blocks))

    def bind(self, slot: int, blocks: list[int]) -> None:
        """An empty slot takes `blocks` (from `take`) as its first blocks: no copy, only the table row."""
        assert not self._held[slot], f"slot {slot} already holds blocks"
        for j, block in enumerate(blocks):
            self._table_h[slot, j] = block
        self._held[slot] = list(blocks)
        self._dirty = True

    def blocks_of(self, slot: int, positions: int) -> list[int]:
        """The slot's blocks that hold positions 0..positions-1, in order."""
        return self._held[slot][:self.blocks_for(positions)]

    def release(self, slot: int) -> None:
        """The slot's blocks back to the pool; its table row points at the null block again."""
        if self._held[slot]:
            self._free.extend(reversed(self._held[slot]))
            self._held[slot] = []
            self._table_h[slot].zero_()
            self._dirty = True

    def upload(self) -> None:
        """The table to the device if it changed: one asynchronous copy, stream-ordered before the next prefill
        or decode step (from pinned memory on CUDA, so the host never waits for the queue)."""
        if not self._dirty:
            return
        self._dirty = False
        if self.table.device.type == "cuda":
            self.table.copy_(self._table_h.pin_memory(), non_blocking=True)
        else:
            self.table.copy_(self._table_h)

    def _rows(self, slots_N: torch.Tensor, positions_NT: torch.Tensor) -> torch.Tensor:
        """Rows of a layer's pool viewed as [N * H_kv * B, D] for (slot n, kv head h, position t): [N, H_kv, T]."""
        blocks = self.table[slots_N[:, None], torch.div(positions_NT, self.block_size, rounding_mode="floor")]
        heads = torch.arange(self.num_kv_heads, device=slots_N.device)
        return ((blocks[:, None, :].long() * self.num_kv_heads + heads[None, :, None]) * self.block_size
                + (positions_NT % self.block_size)[:, None, :])

    def gather(self, layer: int, slots_N: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `span` keys and values of each slot as contiguous [N, H_kv, span, D] copies."""
        nb = self.blocks_for(span)
        blocks = self.table[slots_N, :nb].long()
        n, h, d = slots_N.shape[0], self.num_kv_heads, self.head_dim

        def one(pool: torch.Tensor) -> torch.Tensor:
            x = pool[blocks].transpose(1, 2).reshape(n, h, nb * self.block_size, d)
            return x if nb * self.block_size == span else x[:, :, :span].contiguous()
        return one(self.k[layer]), one(self.v[layer])

    # ---- per-slot access (migration) --------------------------------------------------------------------
    def read(self, slot: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the first `length` positions of a slot: per layer (k, v) of shape [H_kv, length, D]."""
        self.upload()
        slots = torch.tensor([slot], device=self.device)
        out = []
        for layer in range(self.num_layers):
            k, v = self.gather(layer, slots, length)
            out.append((k[0], v[0]))
        return out

    def write(self, slot: int, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Load per-layer (k, v) [H_kv, L, D] into the first L positions of a slot (which holds blocks for
        them); returns L."""
        length = kv[0][0].shape[1]
        self.upload()
        rows = self._rows(torch.tensor([slot], device=self.device), torch.arange(length, device=self.device)[None])
        rows = rows.reshape(-1)
        d = self.head_dim
        for layer, (k, v) in enumerate(kv):
            self.k[layer].view(-1, d).index_copy_(0, rows, k.reshape(-1, d))
            self.v[layer].view(-1, d).index_copy_(0, rows, v.reshape(-1, d))
        return length

    def read_blocks(self, blocks: list[int], length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the first `length` positions held by `blocks` (in order): per layer (k, v) [H_kv, length, D]."""
        idx = torch.tensor(blocks[:self.blocks_for(length)], dtype=torch.long, device=self.device)
        h, d = self.num_kv_heads, self.head_dim

        def one(pool: torch.Tensor) -> torch.Tensor:
            return pool[idx].transpose(0, 1).reshape(h, -1, d)[:, :length].contiguous()
        return [(one(self.k[layer]), one(self.v[layer])) for layer in range(self.num_layers)]

    # ---- the model's `kv_cache` hooks -------------------------------------------------------------------
    def prefill_writer(self, slots: torch.Tensor) -> _PrefillWriter:
        return _PrefillWriter(self, slots)

    def decoder(self, positions_R: torch.Tensor, row_slot_R: torch.Tensor,
                span: int | None = None, groups: list[RowGroup] | None = None, fused: bool = False) -> _Decoder:
        """Hook for one decode step of R rows; `row_slot_R` maps rows to slots. Either every row attends over
        the first `span` keys of its slot, or each `RowGroup` over its own span. `fused` (with `span`, CUDA):
        the Triton kernel of `decode_attention`, each row reading its own keys 0..pos through the block table."""
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
    """Writes prompts' K/V into their slots' blocks; attention runs over each prompt only (causal, right-padded
    rows). `slots`: a device tensor of one slot per row (a batched prefill, or a CUDA graph whose slot changes
    between replays: the write rows are computed on the device from the table)."""

    def __init__(self, cache: PagedKVCache, slots: torch.Tensor):
        self.cache, self.slots = cache, slots
        self._rows: torch.Tensor | None = None

    def update(self, layer: int, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor):
        if self._rows is None:   # once per forward: every layer writes the same positions
            t = k_BHTD.shape[2]
            pos = torch.arange(t, device=self.slots.device).expand(self.slots.shape[0], t)
            self._rows = self.cache._rows(self.slots, pos).reshape(-1)
        d = self.cache.head_dim
        self.cache.k[layer].view(-1, d).index_copy_(0, self._rows, k_BHTD.reshape(-1, d))
        self.cache.v[layer].view(-1, d).index_copy_(0, self._rows, v_BHTD.reshape(-1, d))
        return k_BHTD, v_BHTD


class _Decoder:
    """One decode step: write each row's new K/V at its position, then attend over the keys the row needs.

    `span`: every row reads the first `span` keys of its own slot (CUDA graphs capture one step per span).
    `groups`: each row reads its own span's keys, gathered per group (the exact CPU path: a row's span depends
    on its own position only, never on which rows share the step)."""

    def __init__(self, cache: PagedKVCache, positions_R: torch.Tensor, row_slot_R: torch.Tensor,
                 span: int | None, groups: list[RowGroup] | None, fused: bool = False):
        if (span is None) == (groups is None):
            raise ValueError("a decode step takes either one span or row groups")
        if fused and span is None:
            raise ValueError("the fused decode attention takes one span, not row groups")
        self.cache, self.positions, self.span, self.groups, self.fused = cache, positions_R, span, groups, fused
        #: the fused kernel applies RoPE to q and the new K itself (the model passes them unrotated, with the
        #: rows' cos/sin): one launch a layer fewer
        self.rotates_qk = fused
        self.slots = row_slot_R
        device = positions_R.device
        if fused:
            return   # the kernel masks by position and writes the new K/V itself
        if span is not None:
            keys = torch.arange(span, device=device)
            visible = (keys[None, :] <= positions_R[:, None])[:, None, None, :]
            # additive, in the cache dtype, once per step: SDPA would convert a boolean mask the same way (zeros,
            # -inf where masked) in every layer's call
            self.mask = torch.zeros(visible.shape, dtype=cache.dtype, device=device).masked_fill_(~visible,
                                                                                                 float("-inf"))
        # where each row's new K/V goes in a layer's pool viewed as [blocks * H_kv * B, D]: one index_copy_ per
        # tensor and layer, these indices computed once per step
        self.write_rows = cache._rows(self.slots, positions_R[:, None]).reshape(-1)

    def attend(self, layer: int, q_RH1D: torch.Tensor, k_RK1D: torch.Tensor, v_RK1D: torch.Tensor,
               cos_R1D: torch.Tensor | None = None, sin_R1D: torch.Tensor | None = None) -> torch.Tensor:
        """The step's attention output [R, H, 1, D]; q and the new K come unrotated with the rows' cos/sin
        ([R, 1, D]) when `rotates_qk`, rotated otherwise."""
        cache = self.cache
        k, v = cache.k[layer], cache.v[layer]
        if self.fused:
            if cos_R1D is None or sin_R1D is None:
                raise ValueError("the fused decode step applies RoPE: pass the rows' cos and sin")
            out = decode_attention_fused(q_RH1D[:, :, 0], k_RK1D[:, :, 0], v_RK1D[:, :, 0], k, v, self.slots,
                                         self.positions, cast(int, self.span), cos_R1D[:, 0], sin_R1D[:, 0],
                                         block_table=cache.table)
            return out[:, :, None]
        d = cache.head_dim   # padding rows collide in the null block: garbage, never read unmasked
        k.view(-1, d).index_copy_(0, self.write_rows, k_RK1D.reshape(-1, d))
        v.view(-1, d).index_copy_(0, self.write_rows, v_RK1D.reshape(-1, d))
        if self.groups is None:
            return decode_attention(q_RH1D, *cache.gather(layer, self.slots, cast(int, self.span)), self.mask)
        out = torch.empty_like(q_RH1D)
        for g in self.groups:
            out[g.rows] = decode_attention(q_RH1D.index_select(0, g.rows), *cache.gather(layer, g.slots, g.span),
                                           g.mask)
        return out
