"""Token-proportional shapes: every padded dimension follows the tokens it holds, never `model.max_seq_len`.

    padded_len(n, cap)                 n rounded up to a length bucket: at most 25% more, never above `cap`
    micro_batches(lengths, ...)        an iter's sequences cut into micro-batches by a token budget

Buckets are 16, then four per octave (m * 2^k for m in 4..7): 16 20 24 28 32 40 48 56 64 80 96 112 128 160 ...
A length just above a bucket is rounded up to the next one, so a shape grows by less than 25% (n = 4 * 2^k + 1
goes to 5 * 2^k), and a run sees O(log max_seq_len) distinct widths: few GEMM shapes and few captured CUDA graphs.

The invariant that keeps a dynamic run equal to the static one: every shape here is a function of the data it
pads (the lengths, in their order), never of the layout, the DP size, the device or which requests happen to
arrive together. Doubling `max_seq_len` with the same data changes no shape unless `cap` bound it.
"""

from __future__ import annotations

from collections.abc import Sequence

from tidal.core.errors import TidalError

MIN_BUCKET = 16


def padded_len(n: int, cap: int | None = None) -> int:
    """`n` rounded up to its length bucket (see module doc), at most `cap` (n itself must fit: n <= cap)."""
    if n < 1:
        raise ValueError(f"a length must be >= 1, got {n}")
    if cap is not None and n > cap:
        raise ValueError(f"length {n} exceeds its cap {cap}")
    if n <= MIN_BUCKET:
        width = MIN_BUCKET
    else:
        step = 1 << max(0, (n - 1).bit_length() - 3)   # a quarter of the octave that holds n
        width = -(-n // step) * step
    return width if cap is None else min(width, cap)


def micro_batches(lengths: Sequence[int], *, max_tokens: int | None, max_rows: int,
                  cap: int | None = None) -> list[tuple[list[int], int]]:
    """An iter's sequences (by index into `lengths`) cut into micro-batches: [(indices, padded width)].

    `max_tokens` None: consecutive runs of `max_rows` sequences (RLinf's micro_batch_size), each padded to
    its longest sequence's bucket. `max_tokens` set (RLinf's max_tokens_per_mbs): sequences longest first
    (ties in index order), a micro-batch takes the next one while rows x its width stays within the budget;
    widths are set by the first (longest) row, so similar lengths share a micro-batch and little is padded.
    Either way the result depends on the lengths alone, so any DP size trains on the same micro-batches."""
    if not lengths:
        return []
    if max_tokens is None:
        out = []
        for lo in range(0, len(lengths), max_rows):
            idx = list(range(lo, min(lo + max_rows, len(lengths))))
            out.append((idx, padded_len(max(lengths[i] for i in idx), cap)))
        return out
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    longest = padded_len(lengths[order[0]], cap)
    if longest > max_tokens:
        raise TidalError("actor.max_tokens_per_micro_batch", max_tokens,
                         f"is below the longest sequence's padded width ({longest} tokens)",
                         "give at least model.max_seq_len tokens per micro-batch")
    batches: list[tuple[list[int], int]] = []
    cur: list[int] = []
    width = 0
    for i in order:
        if cur and (len(cur) + 1) * width > max_tokens:
            batches.append((cur, width))
            cur = []
        if not cur:
            width = padded_len(lengths[i], cap)
        cur.append(i)
    batches.append((cur, width))
    return batches
