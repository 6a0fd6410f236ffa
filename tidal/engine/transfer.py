"""Tensors between worker processes without the object store: the one transfer layer.

Two routes, chosen from where the two ends are (`route`):

    p2p   torch.distributed point-to-point in the workers' world: gloo between CPU virtual devices, NCCL between
          distinct GPUs (over NVLink/PCIe on one node, the network between nodes). Two-sided: the source's call
          sends while the target's call receives. Every worker runs the transfers of one exchange in one agreed
          order (the caller's: a wave's move order), so the earliest unfinished transfer always has both ends at
          it: no cycle of waits.
    ipc   CUDA IPC between processes on one GPU: the source hands out a handle of the memory (`share`, a small
          record), the target maps it (`open_shared`) and copies what it needs on its own stream. One-sided: the
          source takes no part after the handle, and must leave the shared tensor unchanged until the target's
          receipt. Ranks that share a GPU cannot form an NCCL communicator; this is what they use.

Ray (or whatever runs the calls) carries only small typed records: a `CudaIpcTensor`, block ids, receipts.

Paged KV moves as blocks: `send_blocks` / `recv_blocks` / `copy_blocks` take a pool [layers, 2, N, H, B, D]
(`PagedKVCache.pool`) and lists of block ids on each side; a chunk of at most `chunk_bytes` of whole blocks is
gathered by one indexed copy on the source (the unit a send needs), and scattered by one indexed copy into the
target's own blocks. Nothing is re-laid out per position, and no buffer holds more than one chunk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

#: the most bytes one staged chunk of a stream holds (a wave of long requests streams in pieces of this size)
CHUNK_BYTES = 64 << 20

Route = Literal["p2p", "ipc"]


def route(src_node: str, src_gpu: str | None, dst_node: str, dst_gpu: str | None) -> Route:
    """`ipc` between two processes on one GPU (the same node and the same physical GPU id), `p2p` otherwise."""
    same_gpu = src_gpu is not None and src_gpu == dst_gpu and src_node == dst_node
    return "ipc" if same_gpu else "p2p"


# ---- small control values over the group (int64 on the host: gloo in every world) ----------------------------
def send_ints(values: Sequence[int], dst: int, group: Any = None) -> None:
    dist.send(torch.tensor(list(values), dtype=torch.int64), dst, group=group)


def recv_ints(n: int, src: int, group: Any = None) -> list[int]:
    t = torch.zeros(n, dtype=torch.int64)
    dist.recv(t, src, group=group)
    return [int(x) for x in t.tolist()]


# ---- blocks -----------------------------------------------------------------------------------------------------
def blocks_per_chunk(pool: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Whole blocks (every layer, keys and values) in one chunk of at most `chunk_bytes` (at least one)."""
    per_block = pool[:, :, 0].numel() * pool.element_size()
    return max(1, chunk_bytes // per_block)


def _index(blocks: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(blocks), dtype=torch.long, device=device)


def send_blocks(pool: torch.Tensor, blocks: Sequence[int], dst: int, group: Any = None,
                chunk_bytes: int = CHUNK_BYTES) -> int:
    """Stream `blocks` of `pool` to rank `dst` (which runs `recv_blocks` with as many blocks); returns bytes sent."""
    step, sent = blocks_per_chunk(pool, chunk_bytes), 0
    for i in range(0, len(blocks), step):
        chunk = pool.index_select(2, _index(blocks[i:i + step], pool.device))
        dist.send(chunk, dst, group=group)
        sent += chunk.numel() * chunk.element_size()
    return sent


def recv_blocks(pool: torch.Tensor, blocks: Sequence[int], src: int, group: Any = None,
                chunk_bytes: int = CHUNK_BYTES) -> int:
    """Receive `send_blocks`' stream from rank `src` into `blocks` of `pool` (in order); returns bytes received.
    One chunk buffer serves the whole stream."""
    step, got = blocks_per_chunk(pool, chunk_bytes), 0
    per_block = pool[:, :, 0].numel()
    flat = torch.empty(min(step, len(blocks)) * per_block, dtype=pool.dtype, device=pool.device)
    for i in range(0, len(blocks), step):
        part = blocks[i:i + step]
        shape = (*pool.shape[:2], len(part), *pool.shape[3:])
        chunk = flat[:len(part) * per_block].view(shape)   # contiguous: a prefix of the flat buffer
        dist.recv(chunk, src, group=group)
        pool.index_copy_(2, _index(part, pool.device), chunk)
        got += chunk.numel() * chunk.element_size()
    return got


def runs(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """(source start, target start, length) of the maximal runs where both block lists count up by one."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src_blocks, dst_blocks):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def copy_blocks(src_pool: torch.Tensor, src_blocks: Sequence[int], dst_pool: torch.Tensor,
                dst_blocks: Sequence[int]) -> int:
    """`src_blocks` of `src_pool` into `dst_blocks` of `dst_pool` on the target's device: a pool mapped from
    another process (`open_shared`) or one of this process. One strided copy per run of consecutive blocks
    (`runs`): every byte read once and written once, no staging buffer. Returns bytes copied."""
    assert len(src_blocks) == len(dst_blocks), (len(src_blocks), len(dst_blocks))
    assert src_pool.shape[:2] == dst_pool.shape[:2] and src_pool.shape[3:] == dst_pool.shape[3:], \
        (tuple(src_pool.shape), tuple(dst_pool.shape))
    for s, d, n in runs(src_blocks, dst_blocks):
        dst_pool[:, :, d:d + n].copy_(src_pool[:, :, s:s + n])
    return len(src_blocks) * src_pool[:, :, 0].numel() * src_pool.element_size()


# ---- weights in buckets -----------------------------------------------------------------------------------------
#: the most bytes one weight bucket holds (a 1.5B-parameter model in bf16: about 12 buckets)
BUCKET_BYTES = 256 << 20


@dataclass(frozen=True)
class BucketEntry:
    """Where one tensor lies in a bucket list: bucket `bucket`, elements `offset` .. `offset + numel`."""

    name: str
    shape: tuple[int, ...]
    bucket: int
    offset: int


@dataclass(frozen=True)
class BucketLayout:
    """How `pack_buckets` laid tensors of one dtype out in flat buckets (plain fields: it crosses as data)."""

    dtype: str
    sizes: tuple[int, ...]           #: elements per bucket
    entries: tuple[BucketEntry, ...]


def bucket_layout(shapes: Sequence[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                  bucket_bytes: int = BUCKET_BYTES) -> BucketLayout:
    """Tensors of `shapes`, in order, into flat buckets of at most `bucket_bytes` (a larger tensor alone)."""
    per = max(1, bucket_bytes // torch.empty((), dtype=dtype).element_size())
    sizes: list[int] = []
    entries = []
    for name, shape in shapes:
        n = int(torch.Size(shape).numel())
        if not sizes or (sizes[-1] and sizes[-1] + n > per):
            sizes.append(0)
        entries.append(BucketEntry(name, tuple(shape), len(sizes) - 1, sizes[-1]))
        sizes[-1] += n
    return BucketLayout(str(dtype).removeprefix("torch."), tuple(sizes), tuple(entries))


def pack_buckets(tensors: Sequence[tuple[str, torch.Tensor]], dtype: torch.dtype, device: torch.device,
                 bucket_bytes: int = BUCKET_BYTES) -> tuple[list[torch.Tensor], BucketLayout]:
    """The tensors cast to `dtype` and copied, in order, into flat buckets on `device` (what a sender shares or
    sends), and their layout."""
    layout = bucket_layout([(n, tuple(t.shape)) for n, t in tensors], dtype, bucket_bytes)
    buckets = [torch.empty(n, dtype=dtype, device=device) for n in layout.sizes]
    for (_, t), e in zip(tensors, layout.entries):
        buckets[e.bucket][e.offset:e.offset + t.numel()].view(t.shape).copy_(t)
    return buckets, layout


def views(buckets: Sequence[torch.Tensor], layout: BucketLayout) -> dict[str, torch.Tensor]:
    """Each tensor of the layout as a view into its bucket (no copy)."""
    return {e.name: buckets[e.bucket][e.offset:e.offset + int(torch.Size(e.shape).numel())].view(e.shape)
            for e in layout.entries}


def unpack(buckets: Sequence[torch.Tensor], layout: BucketLayout, device: torch.device) -> dict[str, torch.Tensor]:
    """Each tensor of the layout copied out of the buckets into its own tensor on `device`."""
    out = {}
    for e in layout.entries:
        n = int(torch.Size(e.shape).numel())
        out[e.name] = buckets[e.bucket][e.offset:e.offset + n].view(e.shape).to(device, copy=True)
    return out


def send_buckets(buckets: Sequence[torch.Tensor], dst: int, group: Any = None) -> int:
    """Each bucket to rank `dst` (which runs `recv_buckets` with the same layout); returns bytes sent."""
    for b in buckets:
        dist.send(b, dst, group=group)
    return sum(b.numel() * b.element_size() for b in buckets)


def recv_buckets(layout: BucketLayout, src: int, device: torch.device, group: Any = None) -> list[torch.Tensor]:
    """`send_buckets`' buckets from rank `src`, received on `device`."""
    out = []
    for n in layout.sizes:
        b = torch.empty(n, dtype=getattr(torch, layout.dtype), device=device)
        dist.recv(b, src, group=group)
        out.append(b)
    return out


# ---- CUDA IPC ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CudaIpcTensor:
    """A CUDA tensor of another process on this GPU, as `torch.multiprocessing` shares one: its storage's IPC
    handle with the producer's reference counter and event (the memory stays allocated until every consumer let
    go of it), and the view on that storage. Plain fields only: it crosses as data, never as code."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: str
    device: int
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * getattr(torch, self.dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        """Plain JSON values (bytes as hex): what a control message carries."""
        return {k: (v.hex() if isinstance(v, bytes) else list(v) if isinstance(v, tuple) else v)
                for k, v in dataclasses.asdict(self).items()}

    @staticmethod
    def from_json(d: dict[str, Any]) -> CudaIpcTensor:
        hexes = ("handle", "ref_counter_handle", "event_handle")
        fields: dict[str, Any] = {k: (bytes.fromhex(v) if k in hexes and v is not None else
                                      tuple(v) if isinstance(v, list) else v) for k, v in d.items()}
        return CudaIpcTensor(**fields)


def share(t: torch.Tensor) -> CudaIpcTensor:
    """A handle of CUDA tensor `t` another process on this GPU maps with `open_shared`. The caller keeps `t`
    (and its contents) until the consumers' receipts."""
    if t.device.type != "cuda":
        raise ValueError(f"share needs a CUDA tensor (got one on {t.device}); CPU tensors move by p2p")
    _, args = reduce_tensor(t)
    (_cls, size, stride, offset, _storage_cls, dtype, device, handle, storage_bytes, storage_offset, _grad,
     ref_handle, ref_offset, event_handle, event_sync) = args
    return CudaIpcTensor(tuple(size), tuple(stride), int(offset), str(dtype).removeprefix("torch."), int(device),
                         bytes(handle), int(storage_bytes), int(storage_offset), bytes(ref_handle), int(ref_offset),
                         None if event_handle is None else bytes(event_handle), bool(event_sync))


def open_shared(h: CudaIpcTensor) -> torch.Tensor:
    """The tensor `share` handed out, mapped into this process. Both processes see the one GPU they share as
    their current device (each worker's only visible GPU), whatever index the producer's process gave it."""
    device = torch.cuda.current_device()
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(h.shape), h.stride, h.offset, torch.storage.TypedStorage,
                               getattr(torch, h.dtype), device, h.handle, h.storage_bytes, h.storage_offset,
                               False, h.ref_counter_handle, h.ref_counter_offset, h.event_handle,
                               h.event_sync_required)
