"""Reshard benchmark: our executor vs a raw batched send/recv of the same bytes and vs torch.distributed.checkpoint.

    python benchmarks/reshard.py --quick --json out.json          # CPU, gloo, < 2 min
    python benchmarks/reshard.py --smoke --json out.json          # the test suite's smoke run: one case, toy model
    python benchmarks/reshard.py --backend nccl --json out.json   # one process per GPU
    python benchmarks/reshard.py --backend nccl --shape 1b --worlds 2 --json out.json   # ~1.1B Llama-shaped

Per case (world, from, to) in one spawned world:
- the actor state (params, fp32 master, both Adam moments) is filled with a hash of each element's global index,
  so after a reshard every rank checks its new shards against the formula (`exact`);
- warm-up A -> B -> A (the pool then holds B-sized buffers, as in a run that reshards repeatedly), then `--reps`
  timed A -> B (+ untimed B -> A); median seconds;
- raw: one batch_isend_irecv with one message per (src, dst) pair carrying the plan's bytes for that pair, into
  receive buffers preallocated and reused (as our pooled ones are); `transport_ratio` = raw s / our s;
- dcp: every old rank `dcp.save`s its boxes to /dev/shm, every new rank `dcp.load`s the boxes that overlap its new
  holdings and copies the overlaps into place; `dcp_speedup` = dcp s / our s (skipped with `--dcp off`, and by
  default for states over 32 GB: it stages the whole state in host memory);
- link: per GPU, the larger of bytes sent and bytes received over our seconds (`link_gbps`, the busiest GPU) and
  that over `--link-gbps` (NVLink, ~450 GB/s per direction per H200), `link_fraction`.

Shapes (`--shape`): small (22M, the default), 1b (~1.1B: hidden 2048, 16 layers, 32/8 heads, SwiGLU 8192, vocab
32000), 7b (~5.9B: hidden 4096, 32 layers, 32/8 heads, SwiGLU 11008, vocab 32000; the actor state, bf16 params +
fp32 master + 2 fp32 moments, is ~83 GB). On CUDA, each case's per-GPU peak is estimated first (live A state +
pooled B state + raw receive chunks + DCP staging) and a case that would not fit `--mem-fraction` of the GPU is
skipped and reported with the estimate (`skipped`); the measured peak is `max_mem_gb` (torch.cuda.max_memory_allocated,
the largest over ranks).
"""

from __future__ import annotations

import argparse
import dataclasses
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

from tidal.core.provenance import commit
from tidal.engine.actor import ActorShard
from tidal.engine.groups import GroupCache
from tidal.engine.layout import Layout
from tidal.engine.model import ModelArgs
from tidal.engine.optim import OPT_KINDS, OptimConfig
from tidal.engine.reshard import plan_reshard
from tidal.engine.reshard.plan import flat_boxes, shard_box

QUICK = ModelArgs(vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=8,
                  intermediate_size=768, max_seq_len=64)
#: `--smoke`: the same cases' code path on a toy model (4 heads and 4 KV heads: TP up to 4)
SMOKE = ModelArgs(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=128,
                  max_seq_len=64)
FULL = ModelArgs(vocab_size=8192, hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=8,
                 intermediate_size=1536, max_seq_len=64)
SHAPES = {
    "small": FULL,
    "1b": ModelArgs(vocab_size=32000, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                    intermediate_size=8192, max_seq_len=64),
    "7b": ModelArgs(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                    intermediate_size=11008, max_seq_len=64),
}
# world 2 (a 2-GPU host): grow DP onto the second GPU and shrink back, TP 2 <-> 1, a full move, DP 2 -> TP 2
CASES = {2: [("tp=1,dp=1", "tp=1,dp=2"), ("tp=1,dp=2", "tp=1,dp=1"), ("tp=2,dp=1", "tp=1,dp=1"),
             ("tp=1,dp=1", "tp=2,dp=1"), ("tp=1,dp=1", "tp=1,dp=1,devices=1"), ("tp=1,dp=2", "tp=2,dp=1")],
         4: [("tp=1,dp=2", "tp=1,dp=3,devices=1-3"), ("tp=2,dp=2", "tp=4,dp=1"),
             ("tp=2,dp=1,devices=0-1", "tp=2,dp=1,devices=2-3")],
         8: [("tp=2,dp=2", "tp=1,dp=7,devices=1-7"), ("tp=4,dp=2", "tp=2,dp=3,devices=2-7")]}
SALT = {"param": 11, "master": 11, "exp_avg": 23, "exp_avg_sq": 37}


def _expected(spec, box, kind, device) -> torch.Tensor:
    """k/256 values (exact in fp32 and bf16) from a hash of the global flat index of each element of `box`,
    computed on `device` (on one CPU thread a 1B-parameter state took minutes per fill or check)."""
    idx = torch.zeros((), dtype=torch.int64, device=device)
    strides = [1] * len(spec.shape)
    for k in range(len(spec.shape) - 2, -1, -1):
        strides[k] = strides[k + 1] * spec.shape[k + 1]
    for k, (lo, hi) in enumerate(box):
        shape = [1] * len(box)
        shape[k] = hi - lo
        idx = idx + (torch.arange(lo, hi, dtype=torch.int64, device=device) * strides[k]).view(shape)
    h = ((idx * 2654435761 + SALT[kind] * 97) >> 11) % 256
    return h.float() / 256.0


def _holding_views(shard: ActorShard):
    """(kind, spec, global box, local view) of everything this rank holds."""
    st, lay = shard.state, shard.layout
    if st is None:
        return
    t, _d = shard.coord
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


def _pair_bytes(plan, esize) -> dict[tuple[int, int], int]:
    out: dict[tuple[int, int], int] = {}
    for m in plan.moves:
        if m.src != m.dst:
            out[(m.src, m.dst)] = out.get((m.src, m.dst), 0) + m.numel * (esize if m.what == "param" else 12)
    return out


def _raw(plan, rank, device, dtype, reps, chunk) -> float:
    """The plan's bytes per (src, dst) pair in one batch_isend_irecv, into reused preallocated buffers; median
    seconds. A pair's bytes go as messages of at most `chunk` bytes that share one buffer (contents are not
    checked; this keeps the raw baseline's memory small next to a 7B state)."""
    esize = torch.empty((), dtype=dtype).element_size()
    pair_bytes = _pair_bytes(plan, esize)
    bufs = {pair: torch.empty(min(n, chunk), dtype=torch.uint8, device=device) for pair, n in pair_bytes.items()
            if rank in pair}
    sizes = {pair: [min(chunk, n - o) for o in range(0, n, chunk)] for pair, n in pair_bytes.items()}
    times = []
    for _ in range(reps + 1):
        _sync(device)
        t0 = time.perf_counter()
        ops = [dist.P2POp(dist.isend if s == rank else dist.irecv, buf[:n], d if s == rank else s)
               for (s, d), buf in bufs.items() for n in sizes[(s, d)]]
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _dcp(shard: ActorShard, old: Layout, new: Layout, path: str) -> float:
    """Save the old layout's boxes with DCP, load on the new layout what overlaps its holdings, copy the overlaps
    into new-layout tensors. Target tensors are allocated before the clock starts; seconds of save+load+copy."""
    import torch.distributed.checkpoint as dcp

    from tidal.engine.reshard.plan import holdings, intersect
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
                for dst_box in holdings(spec, new, tn, dn, what):
                    for kind in (("param",) if what == "param" else OPT_KINDS):
                        dt = shard.dtype if kind == "param" else torch.float32
                        dst = torch.empty([hi - lo for lo, hi in dst_box], dtype=dt, device=shard.device)
                        for t in range(old.tp):
                            for d in (range(old.dp) if what == "optim" else (0,)):
                                for src_box in holdings(spec, old, t, d, what):
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


def _rank_bytes(specs, layout: Layout, rank: int, esize: int) -> int:
    """Bytes of actor state rank `rank` holds at `layout` (params at `esize`, fp32 master + 2 moments)."""
    from tidal.engine.optim import ZeroShape
    coord = layout.coord(rank)
    if coord is None:
        return 0
    zs = ZeroShape.of(tuple(specs), layout.tp, layout.dp, coord[0], coord[1])
    return zs.param_total * esize + zs.opt_total * 12


def _estimate(specs, a: Layout, b: Layout, rank: int, esize: int, chunk: int, dcp: bool) -> int:
    """Per-rank peak estimate of one case: live A + pooled B + raw chunks + DCP staging (~2x B) + 2 GiB slack for
    the check's index tensors and the transfer's staging slots."""
    plan = plan_reshard(a, b, tuple(specs))
    raw = sum(min(n, chunk) for pair, n in _pair_bytes(plan, esize).items() if rank in pair)
    nb = _rank_bytes(specs, b, rank, esize)
    return _rank_bytes(specs, a, rank, esize) + nb + raw + (2 * nb if dcp else 0) + (2 << 30)


def _case_body(rank, world, args_dict, cases, backend, reps, shm, opts):
    torch.set_num_threads(1)
    args = ModelArgs(**args_dict)
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    esize = torch.empty((), dtype=dtype).element_size()
    from tidal.engine.model import param_specs
    specs = tuple(param_specs(args))
    groups = GroupCache()
    out = []
    for a_text, b_text in cases:
        a, b = Layout.parse(a_text), Layout.parse(b_text)
        full = _rank_bytes(specs, Layout(1, 1, (0,)), 0, esize)  # the whole state on one rank
        use_dcp = opts["dcp"] == "on" or (opts["dcp"] == "auto" and full <= 32e9)
        if device.type == "cuda":
            need = torch.tensor([_estimate(specs, a, b, rank, esize, opts["chunk"], use_dcp)], device=device)
            dist.all_reduce(need, op=dist.ReduceOp.MAX)
            cap = torch.cuda.get_device_properties(device).total_memory * opts["mem_fraction"]
            if need.item() > cap:
                out.append({"world": world, "from": str(a), "to": str(b), "skipped":
                            f"estimated peak {need.item() / 2**30:.1f} GiB per GPU > {cap / 2**30:.1f} GiB "
                            f"({opts['mem_fraction']:.0%} of the GPU)", "est_peak_gb": need.item() / 2**30})
                continue
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
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
        raw = _raw(plan, rank, device, dtype, reps, opts["chunk"])
        dcp_s = None
        if use_dcp:
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
        sent, recv = {}, {}
        for (src, dst), n in _pair_bytes(plan, esize).items():
            sent[src], recv[dst] = sent.get(src, 0) + n, recv.get(dst, 0) + n
        busiest = max([*sent.values(), *recv.values(), 0])
        mem = torch.tensor([torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0],
                           device=device)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        out.append({"world": world, "from": str(a), "to": str(b),
                    "state_bytes": plan.state_bytes(esize), "bytes_moved": plan.bytes_moved(esize),
                    "seconds": ours, "seconds_all": times, "gbps": plan.bytes_moved(esize) / ours / 1e9,
                    "busiest_gpu_bytes": busiest, "link_gbps": busiest / ours / 1e9,
                    "link_fraction": busiest / ours / 1e9 / opts["link_gbps"],
                    "raw_seconds": raw, "raw_link_gbps": busiest / raw / 1e9 if raw else None,
                    "transport_ratio": raw / ours, "dcp_seconds": dcp_s,
                    "dcp_speedup": dcp_s / ours if dcp_s is not None else None, "exact": exact,
                    "max_mem_gb": mem.item() / 2**30,
                    "phase_seconds": {k: round(v, 6) for k, v in rep.phase_seconds.items()}})
        shard.free()
        dist.barrier()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller model, world 4 only (CPU: < 2 min)")
    p.add_argument("--smoke", action="store_true",
                   help="a smoke run of --quick's code path, its figures meaningless: a toy model, world 4's first "
                        "case (--cases picks others), 1 rep")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="model shape (default: small)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--worlds", default=None, help="comma-separated world sizes (of 2, 4, 8); default: gloo 4,8 "
                                                  "(--quick: 4), nccl every size the GPUs allow")
    p.add_argument("--reps", type=int, default=None, help="timed reshards per case (default 3, --smoke 1)")
    p.add_argument("--dcp", choices=("auto", "on", "off"), default="auto",
                   help="DCP baseline: auto = only for states up to 32 GB")
    p.add_argument("--raw-chunk-mb", type=int, default=1024, help="largest raw send/recv message (MiB)")
    p.add_argument("--link-gbps", type=float, default=450.0, help="per-direction link limit per GPU (GB/s)")
    p.add_argument("--mem-fraction", type=float, default=0.92, help="skip cases whose estimated peak exceeds "
                                                                    "this fraction of GPU memory")
    p.add_argument("--json", dest="json_path", help="write {'cases': [...]} here")
    p.add_argument("--cases", default=None, help="comma-separated indices into each world's case list "
                                                 "(default: all); big shapes take minutes per case")
    ns = p.parse_args(argv)
    from tidal.cli.reshard_check import run_world
    if (ns.quick or ns.smoke) and ns.shape:
        p.error("--quick and --smoke pick their own model; drop --shape or them")
    if ns.reps is None:
        ns.reps = 1 if ns.smoke else 3
    if ns.smoke and not ns.cases:
        ns.cases = "0"
    args = SMOKE if ns.smoke else QUICK if ns.quick else SHAPES[ns.shape or "small"]
    model = dataclasses.asdict(args)   # plain values, nested ones too (rope_scaling): the JSON's and the ranks'
    if ns.worlds:
        try:
            worlds = [int(w) for w in ns.worlds.split(",")]
        except ValueError:
            p.error(f"--worlds {ns.worlds!r}: give comma-separated integers, e.g. 2 or 2,4")
        bad = [w for w in worlds if w not in CASES]
        if bad:
            p.error(f"--worlds {bad}: cases exist for world sizes {sorted(CASES)}")
    else:
        worlds = [4] if ns.quick or ns.smoke else [4, 8]
        if ns.backend == "nccl":
            worlds = [w for w in sorted(CASES) if w <= torch.cuda.device_count()]
    if ns.backend == "nccl" and any(w > torch.cuda.device_count() for w in worlds):
        p.error(f"--worlds {worlds}: this machine has {torch.cuda.device_count()} GPUs")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    opts = {"dcp": ns.dcp, "chunk": ns.raw_chunk_mb << 20, "link_gbps": ns.link_gbps,
            "mem_fraction": ns.mem_fraction}
    cases = []
    head = {"name": "reshard", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "commit": commit(),
            "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpu, backend {ns.backend}"
                       + (f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
                          if ns.backend == "nccl" else ""),
            "shape": "smoke" if ns.smoke else "quick" if ns.quick else (ns.shape or "small"),
            "num_params": args.num_params(), "model": model, "reps": ns.reps, "link_gbps_limit": ns.link_gbps}
    for w in worlds:
        pick = CASES[w]
        if ns.cases:
            try:
                pick = [CASES[w][int(i)] for i in ns.cases.split(",")]
            except (ValueError, IndexError):
                p.error(f"--cases {ns.cases!r}: give indices below {len(CASES[w])}, e.g. 0,2")
        for case in pick:   # one world per case, the JSON rewritten after each: a cut-off run keeps what it did
            cases += run_world(w, ns.backend, _case_body, model, [case], ns.backend, ns.reps, shm, opts,
                               timeout=1800.0)[0]
            print(f"  world {w} {case[0]} -> {case[1]}: {cases[-1].get('seconds', cases[-1].get('skipped'))}",
                  flush=True)
            if ns.json_path:
                with open(ns.json_path, "w") as f:
                    json.dump({**head, "cases": cases}, f, indent=2)
    print(f"{'world':>5} {'from':>22} {'to':>22} {'state GB':>8} {'moved GB':>8} {'ms':>8} {'GB/s':>6} "
          f"{'link':>6} {'%NVL':>5} {'vs raw':>6} {'vs dcp':>7} {'peak GiB':>8} exact")
    for c in cases:
        if "skipped" in c:
            print(f"{c['world']:>5} {c['from']:>22} {c['to']:>22} skipped: {c['skipped']}")
            continue
        dcp_txt = f"{c['dcp_speedup']:>7.1f}" if c["dcp_speedup"] is not None else f"{'-':>7}"
        print(f"{c['world']:>5} {c['from']:>22} {c['to']:>22} {c['state_bytes'] / 1e9:>8.2f} "
              f"{c['bytes_moved'] / 1e9:>8.2f} {c['seconds'] * 1e3:>8.1f} {c['gbps']:>6.1f} {c['link_gbps']:>6.1f} "
              f"{c['link_fraction']:>5.0%} {c['transport_ratio']:>6.2f} {dcp_txt} {c['max_mem_gb']:>8.1f} "
              f"{c['exact']}")
    result = {**head, "cases": cases}
    if ns.json_path:
        with open(ns.json_path, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if all(c.get("exact", True) for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
