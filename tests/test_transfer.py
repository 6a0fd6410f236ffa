"""The transfer layer (tidal/engine/transfer.py) between real processes over gloo: paged KV blocks and weight
buckets arrive bit for bit, in bounded chunks, into the blocks the target names; the store audit counts every
tensor a value carries. CUDA IPC (one GPU, two processes) runs where a GPU is."""

import json
import random

import pytest
import torch
import torch.distributed as dist

from tidal.engine.testing import run_ranks
from tidal.engine.transfer import (
    CudaIpcTensor,
    blocks_per_chunk,
    bucket_layout,
    copy_blocks,
    pack_buckets,
    recv_blocks,
    recv_buckets,
    route,
    runs,
    send_blocks,
    send_buckets,
    unpack,
)
from tidal.workers.messages import ExportReceipt, MigrationPackage
from tidal.workers.store_audit import StoreAudit, tensor_bytes

SHAPE = (3, 2, 40, 2, 4, 8)   # [layers, k/v, blocks, kv heads, block size, head dim]


def _pool(seed):
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def _blocks(seed, n=23):
    return random.Random(seed).sample(range(1, SHAPE[2]), n)


def _kv_body(rank, world, chunk_bytes):
    src_blocks, dst_blocks = _blocks(1), _blocks(2)
    if rank == 0:
        return send_blocks(_pool(0), src_blocks, 1, chunk_bytes=chunk_bytes)
    pool = _pool(5)
    before = pool.clone()
    got = recv_blocks(pool, dst_blocks, 0, chunk_bytes=chunk_bytes)
    untouched = [b for b in range(SHAPE[2]) if b not in dst_blocks]
    landed = torch.equal(pool[:, :, dst_blocks], _pool(0)[:, :, src_blocks])
    kept = torch.equal(pool[:, :, untouched], before[:, :, untouched])
    return got, landed, kept


@pytest.mark.parametrize("chunk_bytes", [1 << 30, 3000])
def test_kv_blocks_stream_into_the_named_blocks_bit_for_bit(chunk_bytes):
    block_bytes = _pool(0)[:, :, 0].numel() * 4
    assert blocks_per_chunk(_pool(0), chunk_bytes) == max(1, chunk_bytes // block_bytes)
    sent, (got, landed, kept) = run_ranks(2, _kv_body, chunk_bytes)
    assert sent == got == 23 * block_bytes
    assert landed and kept   # every block where the target named it, no other block touched


@pytest.mark.parametrize("order", ["shuffled", "runs"])
def test_copy_blocks_in_one_process_equals_indexing(order):
    src_blocks, dst_blocks = (_blocks(1), _blocks(2)) if order == "shuffled" else \
        ([3, 4, 5, 9, 10, 20], [7, 8, 9, 1, 2, 30])
    src, dst = _pool(0), _pool(1)
    want = dst.clone()
    want[:, :, dst_blocks] = src[:, :, src_blocks]
    copy_blocks(src, src_blocks, dst, dst_blocks)
    assert torch.equal(dst, want)


def test_runs_merge_blocks_consecutive_on_both_sides():
    assert runs([3, 4, 5, 9, 10, 20], [7, 8, 9, 1, 2, 30]) == [(3, 7, 3), (9, 1, 2), (20, 30, 1)]
    assert runs([1, 2], [5, 4]) == [(1, 5, 1), (2, 4, 1)]


def _weights():
    g = torch.Generator().manual_seed(3)
    return [(f"w{i}", torch.randn(shape, generator=g)) for i, shape in enumerate([(7, 5), (300,), (2, 3, 4), (1,)])]


def _bucket_body(rank, world):
    buckets, layout = pack_buckets(_weights(), torch.float32, torch.device("cpu"), bucket_bytes=1024)
    if rank == 0:
        return send_buckets(buckets, 1), len(buckets)
    got = unpack(recv_buckets(layout, 0, torch.device("cpu")), layout, torch.device("cpu"))
    return all(torch.equal(got[n], t) for n, t in _weights()), None


def test_weight_buckets_cross_processes_bit_for_bit():
    (sent, n_buckets), (equal, _) = run_ranks(2, _bucket_body)
    assert equal and n_buckets == 3 and sent == sum(t.numel() * 4 for _, t in _weights())


def test_bucket_layout_keeps_order_and_bound():
    layout = bucket_layout([("a", (10,)), ("b", (300,)), ("c", (5,)), ("d", (5,))], torch.float32, 100 * 4)
    assert layout.sizes == (10, 300, 10)   # a tensor larger than a bucket goes alone
    assert [(e.name, e.bucket, e.offset) for e in layout.entries] == [("a", 0, 0), ("b", 1, 0), ("c", 2, 0),
                                                                     ("d", 2, 5)]


def test_routes():
    assert route("n1", "0", "n1", "0") == "ipc"          # two processes on one GPU
    assert route("n1", "0", "n1", "1") == "p2p"          # distinct GPUs: NCCL
    assert route("n1", "0", "n2", "0") == "p2p"          # another node
    assert route("n1", None, "n1", None) == "p2p"        # CPU virtual devices: gloo


def test_an_ipc_handle_round_trips_through_json():
    h = CudaIpcTensor((2, 3), (3, 1), 0, "bfloat16", 0, b"\x01\x02", 64, 0, b"\x03", 8, None, True)
    assert CudaIpcTensor.from_json(json.loads(json.dumps(h.to_json()))) == h and h.nbytes == 12


def test_the_store_audit_counts_every_tensor_a_value_carries():
    import dataclasses

    @dataclasses.dataclass
    class Rec:
        t: torch.Tensor
        more: list

    v = {"a": [Rec(torch.zeros(10), [torch.zeros(3, dtype=torch.int64)])], "b": (torch.zeros(2, 2),), "c": "x"}
    assert tensor_bytes(v) == 40 + 24 + 16
    audit = StoreAudit()
    audit.note("f", v)
    audit.note("f", [])
    audit.note("put", torch.zeros(1 << 20, dtype=torch.uint8))
    assert audit.take() == {"f": 80, "put": 1 << 20} and audit.take() == {}


def test_a_package_names_blocks_and_carries_no_kv():
    from tidal.engine.generation.requests import Request, RequestState
    st = RequestState(Request("m/g1/i0", (1, 2, 3)), [4, 5], [0.0, 0.0], torch.zeros(8, dtype=torch.uint8), 0,
                      None, 4, "n", 0, (7, 9), "layout", 2 * 4096)
    pkg = MigrationPackage((), {1: ((1, 2, 3), [])}, (st,))
    assert pkg.summary().kv_bytes == 8192 and tensor_bytes(pkg) == 8
    assert pkg.receipt() == ExportReceipt(("m/g1/i0",), (1,), ())


def _ipc_body(rank, world):
    import json

    from tidal.engine.generation.migration import recv_blob, send_blob
    from tidal.engine.transfer import open_shared, share
    pool = _pool(0).cuda() if rank == 0 else _pool(5).cuda()
    if rank == 0:
        send_blob(json.dumps(share(pool).to_json()).encode(), 1)
        dist.barrier()   # the target copied: the source may let go
        return True
    h = CudaIpcTensor.from_json(json.loads(recv_blob(0).decode()))
    copy_blocks(open_shared(h), _blocks(1), pool, _blocks(2))
    torch.cuda.synchronize()
    dist.barrier()
    return torch.equal(pool.cpu()[:, :, _blocks(2)], _pool(0)[:, :, _blocks(1)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU (two processes share it)")
def test_cuda_ipc_maps_the_source_pool_and_copies_blocks():
    assert run_ranks(2, _ipc_body) == [True, True]
