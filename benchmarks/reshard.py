"""Reshard benchmark: our executor vs a raw batched send/recv of the same bytes and vs torch.distributed.checkpoint.

    python benchmarks/reshard.py --quick --json out.json          # CPU, gloo, < 2 min
    python benchmarks/reshard.py --backend nccl --json out.json   # one process per GPU

Per case (world, from, to) in one spawned world:
- the actor state (params, fp32 master, both Adam moments) is filled with a hash of each element's global index,
  so after a reshard every rank checks its new shards against the formula (`exact`);
- warm-up A -> B -> A (the pool then holds B-sized buffers, as in a run that reshards repeatedly), then `--reps`
  timed A -> B (+ untimed B -> A); median seconds;
- raw: one batch_isend_irecv with one message per (src, dst) pair carrying the plan's bytes for that pair, into
  receive buffers preallocated and reused (as our pooled ones are); `transport_ratio` = raw s / our s;
- dcp: every old rank `dcp.save`s its boxes to /dev/shm, every new rank `dcp.load`s the boxes that overlap its new
  holdings and copies the overlaps into place; `dcp_speedup` = dcp s / our s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from tidal.engine.actor import ActorShard
from tidal.engine.groups import GroupCache
from tidal.engine.layout import Layout
from tidal.engine.model import ModelArgs
from tidal.engine.optim import OPT_KINDS, OptimConfig
from tidal.engine.reshard import plan_reshard
from tidal.engine.reshard._plan import flat_boxes, shard_box

QUICK = ModelArgs(vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=8,
                  intermediate_size=768, max_seq_len=64)
FULL = ModelArgs(vocab_size=8192, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=8,
                 intermediate_size=1536, max_seq_len=64)
CASES = {2: [("tp=1,dp=1", "tp=1,dp=1,devices=1"), ("tp=1,dp=2", "tp=2,dp=1")],
         4: [("tp=1,dp=2", "tp=1,dp=3,devices=1-3"), ("tp=2,dp=2", "tp=4,dp=1"),
             ("tp=2,dp=1,devices=0-1", "tp=2,dp=1,devices=2-3")],
         8: [("tp=2,dp=2", "tp=1,dp=7,devices=1-7"), ("tp=4,dp=2", "tp=2,dp=3,devices=2-7")]}
SALT = {"param": 11, "master": 11, "exp_avg": 23, "exp_avg_sq": 37}


def _expected(spec, box, kind, device) -> torch.Tensor:
    """k/256 values (exact in fp32 and bf16) from a hash of the global flat index of each element of `box`."""
    idx = torch.zeros((), dtype=torch.int64)
    strides = [1] * len(spec.shape)
    for k in range(len(spec.shape) - 2, -1, -1):
        strides[k] = strides[k + 1] * spec.shape[k + 1]
    for k, (lo, hi) in enumerate(box):
        shape = [1] * len(box)
        shape[k] = hi - lo
        idx = idx + (torch.arange(lo, hi, dtype=torch.int64) * strides[k]).view(shape)
    h = ((idx * 2654435761 + SALT[kind] * 97) >> 11) % 256
    return (h.float() / 256.0).to(device)


def _holding_views(shard: ActorShard):
    """(kind, spec, global box, local view) of everything this rank holds."""
    st, lay = shard.state, shard.layout
    if st is None:
        return
    t, d = shard.coord
    for i, spec in enumerate(shard.specs):
        yield "param", spec, shard_box(spec, lay.tp, t), st.param(i)
        lo, hi = st.shape.owned[i]
        cols = spec.tp_shape(lay.tp, t)[1] if len(spec.shape) == 2 else 1
        for box in flat_boxes(spec, lay.tp, t, lo, hi):
            first = (box[0][0] - shard_box(spec, lay.tp, t)[0][0]) * cols + \
                (box[1][0] - shard_box(spec, lay.tp, t)[1][0] if len(box) == 2 else 0)
            size = tuple(b - a for a, b in box)
            stride = (cols, 1) if len(box) == 2 else (1,)
            for kind in OPT_KINDS:
                buf = st.buffer(kind)
                yield kind, spec, box, buf.as_strided(size, stride, buf.storage_offset() + st.shape.opt_offsets[i]
                                                      + first - lo)


def _fill(shard):
    for kind, spec, box, view in _holding_views(shard):
        view.copy_(_expected(spec, box, kind, view.device))


def _exact(shard) -> bool:
    ok = all(torch.equal(view.float(), _expected(spec, box, kind, view.device))
             for kind, spec, box, view in _holding_views(shard))
    flag = torch.tensor([int(ok)], device=shard.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _raw(plan, rank, device, dtype, reps) -> float:
    """One batched send/recv per pair of the plan's bytes, into reused preallocated buffers; median seconds."""
    esize = torch.empty((), dtype=dtype).element_size()
    pair_bytes: dict[tuple[int, int], int] = {}
    for m in plan.moves:
        if m.src != m.dst:
            pair_bytes[(m.src, m.dst)] = pair_bytes.get((m.src, m.dst), 0) + \
                m.numel * (esize if m.what == "param" else 12)
    bufs = {pair: torch.empty(n, dtype=torch.uint8, device=device) for pair, n in pair_bytes.items()
            if rank in pair}
    times = []
    for _ in range(reps + 1):
        _sync(device)
        t0 = time.perf_counter()
        ops = [dist.P2POp(dist.isend if s == rank else dist.irecv, buf, d if s == rank else s)
               for (s, d), buf in bufs.items()]
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _dcp(shard: ActorShard, old: Layout, new: Layout, path: str) -> float:
    """Save the old layout's boxes with DCP, load on the new layout what overlaps its holdings, copy the overlaps
    into new-layout tensors. Target tensors are allocated before the clock starts; seconds of save+load+copy."""
    import torch.distributed.checkpoint as dcp

    from tidal.engine.reshard._plan import _holdings, intersect
    rank = dist.get_rank()
    saved = {}
    if shard.state is not None:
        d = shard.coord[1]
        for kind, spec, box, view in _holding_views(shard):
            if kind == "param" and d != 0:
                continue  # one copy of each TP shard is enough
            saved[f"{kind}|{spec.name}|{box}"] = view.contiguous()
    coord = new.coord(rank)
    want, copies = {}, []
    if coord is not None:
        tn, dn = coord
        for spec in shard.specs:
            for what in ("param", "optim"):
                for dst_box in _holdings(spec, new, tn, dn, what):
                    for kind in (("param",) if what == "param" else OPT_KINDS):
                        dt = shard.dtype if kind == "param" else torch.float32
                        dst = torch.empty([hi - lo for lo, hi in dst_box], dtype=dt, device=shard.device)
                        for t in range(old.tp):
                            for d in (range(old.dp) if what == "optim" else (0,)):
                                for src_box in _holdings(spec, old, t, d, what):
                                    inter = intersect(src_box, dst_box)
                                    if inter is None:
                                        continue
                                    key = f"{kind}|{spec.name}|{src_box}"
                                    src = want.setdefault(key, torch.empty([hi - lo for lo, hi in src_box],
                                                                           dtype=dt, device=shard.device))
                                    sl_src = tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inter, src_box))
                                    sl_dst = tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inter, dst_box))
                                    copies.append((dst, sl_dst, src, sl_src))
    _sync(shard.device)
    t0 = time.perf_counter()
    dcp.save(saved, checkpoint_id=path)
    dcp.load(want, checkpoint_id=path)
    for dst, sl_dst, src, sl_src in copies:
        dst[sl_dst].copy_(src[sl_src])
    _sync(shard.device)
    return time.perf_counter() - t0


def _case_body(rank, world, args_dict, cases, backend, reps, shm):
    torch.set_num_threads(1)
    args = ModelArgs(**args_dict)
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    groups = GroupCache()
    out = []
    for a_text, b_text in cases:
        a, b = Layout.parse(a_text), Layout.parse(b_text)
        shard = ActorShard(args, OptimConfig(), a, rank, device=device, dtype=dtype, groups=groups,
                           weights="empty", bucket_bytes=32 << 20, keep_pool_on_leave=True)
        _fill(shard)
        shard.reshard(b)
        shard.reshard(a)
        times, exact = [], True
        for _ in range(reps):
            _sync(device)
            t0 = time.perf_counter()
            rep = shard.reshard(b)
            _sync(device)
            times.append(time.perf_counter() - t0)
            exact = exact and _exact(shard)
            shard.reshard(a)
        exact = exact and _exact(shard)
        ours = statistics.median(times)
        plan = plan_reshard(a, b, shard.specs)
        raw = _raw(plan, rank, device, dtype, reps)
        path = tempfile.mkdtemp(prefix="tidal_dcp_", dir=shm) if rank == 0 else ""
        holder = [path]
        if world > 1:
            obj = torch.zeros(256, dtype=torch.uint8, device=device)
            if rank == 0:
                obj[:len(path)] = torch.tensor(list(path.encode()), dtype=torch.uint8)
            dist.broadcast(obj, 0)
            holder = [bytes(obj.cpu().tolist()).rstrip(b"\0").decode()]
        dcp_s = _dcp(shard, a, b, holder[0])
        if rank == 0:
            shutil.rmtree(holder[0], ignore_errors=True)
        esize = torch.empty((), dtype=dtype).element_size()
        out.append({"world": world, "from": str(a), "to": str(b),
                    "state_bytes": plan.state_bytes(esize), "bytes_moved": plan.bytes_moved(esize),
                    "seconds": ours, "gbps": plan.bytes_moved(esize) / ours / 1e9,
                    "raw_seconds": raw, "transport_ratio": raw / ours, "dcp_seconds": dcp_s,
                    "dcp_speedup": dcp_s / ours, "exact": exact,
                    "phase_seconds": {k: round(v, 6) for k, v in rep.phase_seconds.items()}})
        shard.free()
        dist.barrier()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller model, world 4 only (CPU: < 2 min)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", dest="json_path", help="write {'cases': [...]} here")
    ns = p.parse_args(argv)
    from tidal.reshard_check import run_world
    args = QUICK if ns.quick else FULL
    worlds = [4] if ns.quick else [4, 8]
    if ns.backend == "nccl":
        worlds = [w for w in (2, 4, 8) if w <= torch.cuda.device_count()]
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    cases = []
    for w in worlds:
        cases += run_world(w, ns.backend, _case_body, args.__dict__, CASES[w], ns.backend, ns.reps, shm)[0]
    print(f"{'world':>5} {'from':>28} {'to':>28} {'state MB':>9} {'moved MB':>9} {'s':>7} {'GB/s':>6} "
          f"{'vs raw':>6} {'vs dcp':>7} exact")
    for c in cases:
        print(f"{c['world']:>5} {c['from']:>28} {c['to']:>28} {c['state_bytes'] / 1e6:>9.1f} "
              f"{c['bytes_moved'] / 1e6:>9.1f} {c['seconds']:>7.3f} {c['gbps']:>6.2f} {c['transport_ratio']:>6.2f} "
              f"{c['dcp_speedup']:>7.1f} {c['exact']}")
    result = {"name": "reshard", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpu, backend {ns.backend}"
                         + (f", {torch.cuda.get_device_name(0)}" if ns.backend == "nccl" else ""),
              "model": args.__dict__, "cases": cases}
    if ns.json_path:
        with open(ns.json_path, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if all(c["exact"] for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
