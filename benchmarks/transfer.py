"""Transfer benchmark: the transfer layer (`tidal.engine.transfer`) moving one request's paged KV and a model's
weights between two worker processes on one device, against re-prefilling the request and the device's own copy
bandwidth.

    python benchmarks/transfer.py --quick --device cpu --json out.json     # CPU, tiny model, seconds
    python benchmarks/transfer.py --device cuda --json out.json            # GPU: Qwen2.5-1.5B shape, bf16

Two processes (`tidal.engine.testing.run_ranks`: a real torch.distributed world, gloo) on one device: on CUDA both
ranks use `cuda:0`. Rank 0 is the source (a rollout worker exporting KV; the actor publishing weights), rank 1 the
target (the importing worker; the rollout engine). Control values cross the gloo group as data: block ids as
int64 tensors (`send_ints`), a `CudaIpcTensor` or a `BucketLayout` as JSON bytes (`send_blob`; bytes as hex).
`route` is `ipc` on CUDA (ranks that share a GPU form no NCCL communicator: the target maps the source's memory
with `open_shared` and copies on its own stream) and `p2p` on CPU (gloo `send_blocks` / `recv_blocks`,
`send_buckets` / `recv_buckets`). Every time is wall clock on rank 1 (after `torch.cuda.synchronize()` on CUDA),
the median of `--repeats` rounds after one warm-up round. `d2d_copy_gbps`: the device's copy bandwidth measured
in the same run on rank 1 (`benchmarks/rollout.py`'s `copy_bandwidth`: bytes read + bytes written; on CPU one
thread, as each rank runs).

KV (`kv`: one row per `--contexts` entry). The KV of one request of `context_tokens` tokens: `blocks` =
ceil(context / `block_size`) blocks of a paged pool [layers, 2, blocks + 1, kv_heads, block_size, head_dim]
(`PagedKVCache.pool`, block 0 being the null block) with the native engine's block size on that device
(`kv_layout`: the engine cache's layout string) and the model's dtype. The source fills its pool with seeded
random values and names its blocks in a shuffled order; the target's pool has the same geometry and its own
shuffled block ids. Per row:

- `kv_bytes`: the bytes moved, blocks x bytes per block over every layer, keys and values (whole blocks: the
  last one's tail positions move too);
- `kv_move_s`: ipc: `open_shared` of the source pool's handle + `copy_blocks` into the target's blocks + a device
  synchronize, split into `ipc_open_s` and `ipc_copy_s` (`ipc_open_first_s`: the warm-up round's open, the
  process's first CUDA IPC mapping of that pool; each round lets its mapping go after the copy); p2p: from a
  barrier to the last block received and written (`recv_blocks`), the ipc fields null;
- `exact`: every round's target blocks equal the source's bit for bit (the target regenerates the source's
  values from the same seed and compares the raw bytes; the run fails otherwise);
- `reprefill_s`: the fallback of moving no KV, as `benchmarks/rollout.py`'s migration measures it on rank 1: an
  engine generates 8 tokens for a prompt of context - 8 tokens; export_state -> `without_kv()` ->
  import_state(staged) into an engine with a one-pass re-prefill, commit, activate, `admit()` and a synchronize,
  timed from the export (eager engines: no CUDA graph capture inside the timed region);
- `ratio` = kv_move_s / reprefill_s (goal <= 0.1); `gbps` = kv_bytes / kv_move_s / 1e9;
- `copy_gbps` = 2 x kv_bytes / ipc_copy_s / 1e9 (p2p: over kv_move_s): bytes read + bytes written, the measure
  of `d2d_copy_gbps`; `bandwidth_ratio` = copy_gbps / d2d_copy_gbps (goal >= 0.5);
- `kv_move_s_all`, `reprefill_s_all`: every timed round; `meets`: the row's goals.

Weights (`weight_sync`): tensors of the model's parameter shapes (`param_specs`, in module order), seeded random
values in the model's dtype, on rank 0. Per round rank 0 packs them into flat buckets (`pack_buckets`,
`BUCKET_BYTES` each: `pack_s`, the actor's cost once per step), shares each bucket (ipc) and sends the layout and
the handles; rank 1 holds preallocated parameters of the same shapes and times `weight_sync_s`: ipc, opening
every bucket (`ipc_open_s`) and copying each entry's slice into its parameter; p2p, from a barrier through
`recv_buckets` and the same copies; both to a device synchronize. `weight_bytes`, `num_tensors`, `buckets`,
`weight_gbps` = weight_bytes / weight_sync_s / 1e9, `exact` (the received parameters equal the sent tensors bit
for bit, every round; the run fails otherwise), `weight_sync_s_all`.

`goals`: the bounds above (`kv_ratio_max`, `bandwidth_ratio_min`, `weight_sync_s_max`); `meets`: each computed
from the figures (`ratio` and `bandwidth_ratio` at every context). `model`: the shape (`--model`); `contexts`,
`repeats`, `dtype`, `device`, `command`, and `name`, `date`, `commit`, `machine` as every result file holds.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tidal.core.provenance import commit
from tidal.engine.generation import EngineConfig, NativeEngine
from tidal.engine.generation.migration import recv_blob, send_blob
from tidal.engine.model import ModelArgs, Transformer, param_specs
from tidal.engine.testing import run_ranks
from tidal.engine.transfer import (
    BucketEntry,
    BucketLayout,
    CudaIpcTensor,
    copy_blocks,
    open_shared,
    pack_buckets,
    recv_blocks,
    recv_buckets,
    recv_ints,
    send_blocks,
    send_buckets,
    send_ints,
    share,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))   # benchmarks/: the shared helpers
from rollout import CPU_MODEL, QWEN25_1_5B, build, copy_bandwidth, machine, prompts, sync, timed_move

MODELS = {"qwen2.5-1.5b": QWEN25_1_5B, "cpu": CPU_MODEL}
GOALS = {"kv_ratio_max": 0.1, "bandwidth_ratio_min": 0.5, "weight_sync_s_max": 0.1}
GENERATED = 8          # tokens the source engine generates before the re-prefill move (as rollout.py's migration)


# ---- control values as JSON -------------------------------------------------------------------------------------
def layout_to_json(layout: BucketLayout) -> dict[str, Any]:
    return {"dtype": layout.dtype, "sizes": list(layout.sizes),
            "entries": [[e.name, list(e.shape), e.bucket, e.offset] for e in layout.entries]}


def layout_from_json(d: dict[str, Any]) -> BucketLayout:
    return BucketLayout(d["dtype"], tuple(d["sizes"]),
                        tuple(BucketEntry(n, tuple(s), b, o) for n, s, b, o in d["entries"]))


def send_json(value: Any, dst: int) -> None:
    send_blob(json.dumps(value).encode(), dst)


def recv_json(src: int) -> Any:
    return json.loads(recv_blob(src))


# ---- values both ranks derive from a seed -------------------------------------------------------------------------
def seeded(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    """Random normal values, the same bits in every process that asks for them on this kind of device."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=dtype, device=device)


def shuffled_blocks(n: int, seed: int) -> list[int]:
    """Blocks 1 .. n (0 is the null block) in a seeded random order: not one contiguous run."""
    g = torch.Generator().manual_seed(seed)
    return [int(b) + 1 for b in torch.randperm(n, generator=g).tolist()]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                    b.contiguous().view(torch.uint8))


def index(blocks: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(blocks, dtype=torch.long, device=device)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


# ---- KV ---------------------------------------------------------------------------------------------------------
def kv_source(cfg: dict[str, Any], ctx: int, geometry: list[int], device: torch.device, dtype: torch.dtype) -> None:
    """Rank 0: a pool holding one request's KV in shuffled blocks, shared (ipc) or sent (p2p) each round."""
    layers, kv_heads, block, head_dim = geometry
    n = -(-ctx // block)
    pool = seeded((layers, 2, n + 1, kv_heads, block, head_dim), dtype, device, seed=ctx)
    blocks = shuffled_blocks(n, seed=ctx)
    send_ints(blocks, 1)
    if cfg["route"] == "ipc":
        sync(device)   # the pool is written before the target reads it
        send_json(share(pool).to_json(), 1)
    for _ in range(cfg["repeats"] + 1):
        dist.barrier()
        if cfg["route"] == "p2p":
            send_blocks(pool, blocks, 1)
        dist.barrier()   # the target's receipt: the pool may change or go from here
    del pool


def kv_target(cfg: dict[str, Any], ctx: int, geometry: list[int], device: torch.device,
              dtype: torch.dtype) -> dict[str, Any]:
    """Rank 1: receive the source's blocks into its own shuffled blocks each round, timed and checked."""
    layers, kv_heads, block, head_dim = geometry
    n = -(-ctx // block)
    shape = (layers, 2, n + 1, kv_heads, block, head_dim)
    src_blocks = recv_ints(n, 0)
    handle = CudaIpcTensor.from_json(recv_json(0)) if cfg["route"] == "ipc" else None
    dst_blocks = shuffled_blocks(n, seed=ctx + 1)
    expect = seeded(shape, dtype, device, seed=ctx).index_select(2, index(src_blocks, device))
    pool = torch.zeros(shape, dtype=dtype, device=device)
    rounds: list[dict[str, float]] = []
    moved, exact = 0, True
    for _ in range(cfg["repeats"] + 1):
        pool.zero_()
        sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        if handle is not None:
            src = open_shared(handle)
            t1 = time.perf_counter()
            moved = copy_blocks(src, src_blocks, pool, dst_blocks)
            sync(device)
            del src
        else:
            t1 = t0
            moved = recv_blocks(pool, dst_blocks, 0)
        t2 = time.perf_counter()
        exact &= same_bits(pool.index_select(2, index(dst_blocks, device)), expect)
        dist.barrier()
        rounds.append({"open": t1 - t0, "copy": t2 - t1, "move": t2 - t0})
    per_block = layers * 2 * kv_heads * block * head_dim * dtype.itemsize
    assert moved == n * per_block, (moved, n, per_block)
    assert exact, f"context {ctx}: the moved KV blocks differ from the source's"
    timed, ipc = rounds[1:], handle is not None
    return {"context_tokens": ctx, "blocks": n, "block_size": block, "kv_bytes": moved,
            "kv_move_s": median([r["move"] for r in timed]),
            "ipc_open_s": median([r["open"] for r in timed]) if ipc else None,
            "ipc_open_first_s": rounds[0]["open"] if ipc else None,
            "ipc_copy_s": median([r["copy"] for r in timed]) if ipc else None,
            "kv_move_s_all": [r["move"] for r in timed], "exact": exact}


def reprefill(model: Transformer, args: ModelArgs, ctx: int, repeats: int, device: torch.device) -> list[float]:
    """Rank 1: the no-KV move of one request of `ctx` tokens (export without KV, staged import, one-pass
    re-prefill at admission), as `benchmarks/rollout.py`'s migration times it; every timed round."""
    prompt = tuple(prompts(args, 1, ctx - GENERATED, seed=ctx)[0].tolist())
    times = [timed_move(model, prompt, "reprefill", device, GENERATED) for _ in range(repeats + 1)]
    return times[1:]   # the first round warms up


# ---- weights ----------------------------------------------------------------------------------------------------
def weight_tensors(args: ModelArgs, dtype: torch.dtype, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters by name and shape (module order), seeded random values."""
    return [(s.name, seeded(tuple(s.shape), dtype, device, seed=1000 + i)) for i, s in enumerate(param_specs(args))]


def weights_source(cfg: dict[str, Any], args: ModelArgs, device: torch.device, dtype: torch.dtype) -> list[float]:
    """Rank 0 (the actor): pack, share or send the buckets each round; returns the timed rounds' pack seconds."""
    tensors = weight_tensors(args, dtype, device)
    pack = []
    for _ in range(cfg["repeats"] + 1):
        sync(device)
        t0 = time.perf_counter()
        buckets, layout = pack_buckets(tensors, dtype, device)
        sync(device)
        pack.append(time.perf_counter() - t0)
        handles = [share(b).to_json() for b in buckets] if cfg["route"] == "ipc" else None
        send_json({"layout": layout_to_json(layout), "handles": handles}, 1)
        dist.barrier()
        if cfg["route"] == "p2p":
            send_buckets(buckets, 1)
        dist.barrier()   # the engine's receipt: the buckets may go from here
        del buckets
    return pack[1:]


def weights_target(cfg: dict[str, Any], args: ModelArgs, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Rank 1 (the engine): open or receive the buckets and copy each entry into its preallocated parameter."""
    specs = param_specs(args)
    params = {s.name: torch.empty(tuple(s.shape), dtype=dtype, device=device) for s in specs}
    expect = dict(weight_tensors(args, dtype, device))
    rounds, exact, buckets = [], True, 0
    for _ in range(cfg["repeats"] + 1):
        for p in params.values():
            p.zero_()
        msg = recv_json(0)
        layout = layout_from_json(msg["layout"])
        sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        if msg["handles"] is not None:
            flat = [open_shared(CudaIpcTensor.from_json(h)) for h in msg["handles"]]
        else:
            flat = recv_buckets(layout, 0, device)
        t1 = time.perf_counter()
        for e in layout.entries:
            n = int(torch.Size(e.shape).numel())
            params[e.name].copy_(flat[e.bucket][e.offset:e.offset + n].view(e.shape))
        sync(device)
        t2 = time.perf_counter()
        buckets = len(flat)
        del flat
        exact &= all(same_bits(params[k], v) for k, v in expect.items())
        dist.barrier()
        rounds.append((t1 - t0, t2 - t0))
    assert exact, "the received weights differ from the sent ones"
    weight_bytes = sum(p.numel() * p.element_size() for p in params.values())
    timed = rounds[1:]
    sync_s = median([t for _, t in timed])
    return {"num_tensors": len(specs), "buckets": buckets, "weight_bytes": weight_bytes, "weight_sync_s": sync_s,
            "ipc_open_s": median([o for o, _ in timed]) if cfg["route"] == "ipc" else None,
            "weight_gbps": weight_bytes / sync_s / 1e9, "weight_sync_s_all": [t for _, t in timed], "exact": exact}


# ---- the two ranks ----------------------------------------------------------------------------------------------
def rank_body(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Each rank's part (run by `run_ranks`); rank 1 builds the engine's model and measures, rank 0 serves."""
    assert world == 2
    device, dtype = torch.device(cfg["device"]), getattr(torch, cfg["dtype"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))   # weight init on the host: the ranks share it
    args = ModelArgs(max_seq_len=max(cfg["contexts"]) + 64, **cfg["model"])
    if rank == 0:
        geometry = recv_ints(4, 1)
        for ctx in cfg["contexts"]:
            kv_source(cfg, ctx, geometry, device, dtype)
        pack = weights_source(cfg, args, device, dtype)
        dist.barrier()   # rank 1's re-prefills done
        return {"pack_s": median(pack), "pack_s_all": pack}
    args, model, weights = build(cfg["model"], args.max_seq_len, device, dtype)
    del weights
    probe = NativeEngine(model, EngineConfig(2, cuda_graph=False))
    cache = probe.cache
    geometry = [cache.num_layers, cache.num_kv_heads, cache.block_size, cache.head_dim]
    layout = cache.layout
    assert cache.dtype == dtype, (cache.dtype, dtype)
    del probe, cache
    send_ints(geometry, 0)
    bandwidth = copy_bandwidth(device)
    rows = [kv_target(cfg, ctx, geometry, device, dtype) for ctx in cfg["contexts"]]
    weight_sync = weights_target(cfg, args, device, dtype)
    for row in rows:
        times = reprefill(model, args, row["context_tokens"], cfg["repeats"], device)
        row.update(reprefill_s=median(times), reprefill_s_all=times)
    dist.barrier()
    return {"d2d_copy_gbps": bandwidth, "kv_layout": layout, "kv": rows, "weight_sync": weight_sync}


def summarize(rows: list[dict[str, Any]], weight_sync: dict[str, Any], d2d: float) -> dict[str, Any]:
    """The derived figures of every row and the goals met (computed from the figures)."""
    for r in rows:
        copy_s = r["ipc_copy_s"] if r["ipc_copy_s"] is not None else r["kv_move_s"]
        r["ratio"] = r["kv_move_s"] / r["reprefill_s"]
        r["gbps"] = r["kv_bytes"] / r["kv_move_s"] / 1e9
        r["copy_gbps"] = 2 * r["kv_bytes"] / copy_s / 1e9
        r["bandwidth_ratio"] = r["copy_gbps"] / d2d
        r["meets"] = {"ratio": r["ratio"] <= GOALS["kv_ratio_max"],
                      "bandwidth_ratio": r["bandwidth_ratio"] >= GOALS["bandwidth_ratio_min"]}
    return {"ratio": all(r["meets"]["ratio"] for r in rows),
            "bandwidth_ratio": all(r["meets"]["bandwidth_ratio"] for r in rows),
            "weight_sync_s": weight_sync["weight_sync_s"] <= GOALS["weight_sync_s_max"]}


def print_table(report: dict[str, Any]) -> None:
    print(f"transfer: route {report['route']} on {report['device']} ({report['dtype']}), "
          f"d2d copy {report['d2d_copy_gbps']:.1f} GB/s, KV {report['kv_layout']}")
    print(f"{'context':>8} {'blocks':>6} {'KV MB':>9} {'move ms':>9} {'reprefill ms':>12} {'ratio':>7} "
          f"{'GB/s':>7} {'copy GB/s':>9} {'bw ratio':>8} {'exact':>5}")
    for r in report["kv"]:
        print(f"{r['context_tokens']:>8} {r['blocks']:>6} {r['kv_bytes'] / 1e6:>9.2f} {r['kv_move_s'] * 1e3:>9.3f} "
              f"{r['reprefill_s'] * 1e3:>12.3f} {r['ratio']:>7.3f} {r['gbps']:>7.2f} {r['copy_gbps']:>9.2f} "
              f"{r['bandwidth_ratio']:>8.2f} {r['exact']!s:>5}")
    w = report["weight_sync"]
    print(f"weights: {w['weight_bytes'] / 1e6:.1f} MB, {w['num_tensors']} tensors in {w['buckets']} buckets: "
          f"pack {w['pack_s'] * 1e3:.2f} ms, sync {w['weight_sync_s'] * 1e3:.2f} ms ({w['weight_gbps']:.2f} GB/s), "
          f"exact {w['exact']}")
    print("meets: " + ", ".join(f"{k} {v}" for k, v in report["meets"].items()), flush=True)


def contexts(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of context lengths") from None
    if not out or min(out) <= GENERATED:
        raise argparse.ArgumentTypeError(f"{text!r}: every context must exceed {GENERATED} tokens")
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda if available")
    p.add_argument("--contexts", type=contexts, default=None, metavar="T[,T...]",
                   help="request lengths in tokens (default 2048,8192,32768 on CUDA, 256,1024 on CPU)")
    p.add_argument("--model", choices=tuple(MODELS), default=None,
                   help="the model's shape (default qwen2.5-1.5b on CUDA, cpu on CPU or with --quick)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds after one warm-up (default 5)")
    p.add_argument("--quick", action="store_true", help="CPU sizes: the tiny model, 256,1024 tokens, 1 repeat")
    p.add_argument("--json", metavar="PATH", help="write the report here")
    a = p.parse_args(argv)
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    small = a.quick or a.device == "cpu"
    a.model = a.model or ("cpu" if small else "qwen2.5-1.5b")
    a.contexts = a.contexts or ([256, 1024] if small else [2048, 8192, 32768])
    a.repeats = a.repeats or (1 if a.quick else 5)
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    route = "ipc" if device.type == "cuda" else "p2p"
    cfg = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "route": route,
           "model": MODELS[a.model], "contexts": a.contexts, "repeats": a.repeats}
    source, target = run_ranks(2, rank_body, cfg, timeout=600.0 if a.quick else 1800.0)
    weight_sync = {**target["weight_sync"], "pack_s": source["pack_s"], "pack_s_all": source["pack_s_all"]}
    meets = summarize(target["kv"], weight_sync, target["d2d_copy_gbps"])
    report = {"name": "transfer", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "commit": commit(),
              "machine": machine(device),
              "command": shlex.join(["python", "benchmarks/transfer.py", *(sys.argv[1:] if argv is None else argv)]),
              "device": str(device), "dtype": cfg["dtype"], "route": route, "model": {"name": a.model, **cfg["model"]},
              "contexts": a.contexts, "repeats": a.repeats, "d2d_copy_gbps": target["d2d_copy_gbps"],
              "kv_layout": target["kv_layout"], "kv": target["kv"], "weight_sync": weight_sync, "goals": GOALS,
              "meets": meets}
    print_table(report)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
