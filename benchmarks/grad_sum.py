"""The actor's ordered gradient sum on gloo: the exchange overlapped with the iter's compute vs after the last backward.

    python benchmarks/grad_sum.py --json out.json                       # dp 2 on this machine's cores, e2e's model
    python benchmarks/grad_sum.py --dp 2,4 --cores 8-15 --json out.json # 8 host cores, one core per rank

The actor sums micro-batch gradients in index order so that an update does not depend on the data-parallel size
(a dynamic run ends bit-equal to a static one). Each rank owns a ZeRO-1 range and needs every micro-batch's slice
of it. The baseline mode sends every rank's slices after its last backward (`ActorShard._ordered_sum`); with the
claim order known in advance (`SharedQueue` without a store) the receives are posted before the first
forward and each micro-batch's slices leave as soon as its backward is done (`tidal/engine/actor.py` `_OverlappedSum`).

Per dp, both modes run in one process group, alternating iter by iter (the machine's drift falls on both), on the
same data; the final weights of both are compared bit for bit. Reported per mode: median iter seconds and phases
(slowest rank). Ratios: baseline (after the last backward) over overlapped, and overlapped over the hardware
limit here, the iter without its sync phase (compute + update + publish: what a free exchange would give).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile

import torch

from tidal.engine.model import ModelArgs

#: the e2e benchmark's actor (`benchmarks/e2e.py --intermediate 1536`): ~2.6M parameters
E2E = dict(vocab_size=64, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=1536,
           max_seq_len=64)


def _rank(rank: int, world: int, init: str, args_dict: dict, iters: int, micro_batch: int, num_mb: int,
          seq: int, cores: list[int] | None, out_path: str) -> None:
    import torch.distributed as dist

    from tidal.engine.actor import ActorShard, SharedQueue, nll_loss
    from tidal.engine.layout import Layout
    from tidal.engine.optim import OptimConfig
    torch.set_num_threads(1)
    if cores:
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    args = ModelArgs(**args_dict)
    layout = Layout(1, world, tuple(range(world)))
    hp = OptimConfig(lr=1e-3, warmup_iters=1, total_iters=iters + 2)
    shards = {mode: ActorShard(args, hp, layout, rank, seed=0, overlap_grad_sum=(mode == "overlapped"))
              for mode in ("after_backward", "overlapped")}
    g = torch.Generator().manual_seed(0)
    rows: dict[str, list[dict]] = {m: [] for m in shards}
    for it in range(iters + 1):   # iter 0: warm-up
        mbs = [torch.randint(0, args.vocab_size, (micro_batch, seq), generator=g) for _ in range(num_mb)]
        order = list(shards) if it % 2 == 0 else list(reversed(shards))
        for mode in order:
            dist.barrier()
            rep = shards[mode].train_iter(SharedQueue(mbs), nll_loss, num_mb * micro_batch * (seq - 1))
            if it:
                rows[mode].append({"seconds": rep.seconds, **rep.phases})
    same = all(torch.equal(a, b) for a, b in zip(shards["after_backward"].local_tensors().values(),
                                                  shards["overlapped"].local_tensors().values()))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"rows": rows, "same": same})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


def measure(dp: int, iters: int, micro_batch: int, num_mb: int, seq: int, cores: list[int] | None,
            model: dict) -> dict:
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rendezvous"
        out = f"{tmp}/out.json"
        mp.spawn(_rank, args=(dp, init, model, iters, micro_batch, num_mb, seq, cores, out), nprocs=dp, join=True)
        with open(out) as f:
            ranks = json.load(f)
    res: dict = {"dp": dp, "bit_identical": all(r["same"] for r in ranks)}
    for mode in ("after_backward", "overlapped"):
        per_iter = [{k: max(r["rows"][mode][i][k] for r in ranks) for k in ranks[0]["rows"][mode][i]}
                    for i in range(iters)]   # slowest rank per iter and phase
        res[mode] = {k: statistics.median(x[k] for x in per_iter) for k in per_iter[0]}
    b, o = res["after_backward"], res["overlapped"]
    limit = o["seconds"] - o.get("sync", 0.0)
    res["speedup_vs_after_backward"] = b["seconds"] / o["seconds"]
    res["overlapped_over_limit"] = o["seconds"] / limit if limit > 0 else None
    return res


def parse_cores(text: str | None) -> list[int] | None:
    if not text:
        return None
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        try:
            out += list(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise SystemExit(f"error: --cores {text!r}: expected a list like 8-15 or 0,1") from None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="write results here")
    ap.add_argument("--dp", default="2", help="comma-separated data-parallel sizes, e.g. 2,4")
    ap.add_argument("--iters", type=int, default=8, help="timed iters per mode (after one warm-up)")
    ap.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch")
    ap.add_argument("--num-mb", type=int, default=8, help="micro-batches per iter")
    ap.add_argument("--seq", type=int, default=28, help="tokens per sequence (e2e: ~9 prompt + ~19 response)")
    ap.add_argument("--intermediate", type=int, default=E2E["intermediate_size"])
    ap.add_argument("--cores", default=None, help="pin rank k to the k-th of these cores (e.g. 8-15)")
    a = ap.parse_args(argv)
    try:
        dps = [int(x) for x in a.dp.split(",")]
    except ValueError:
        raise SystemExit(f"error: --dp {a.dp!r}: expected sizes like 2,4") from None
    if any(d < 2 for d in dps):
        raise SystemExit("error: --dp: every size must be >= 2 (dp 1 has no exchange)")
    model = {**E2E, "intermediate_size": a.intermediate, "max_seq_len": max(E2E["max_seq_len"], a.seq)}
    cores = parse_cores(a.cores)
    res = {"name": "grad_sum", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "machine": {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
                       "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
           "config": {"model": model, "micro_batch": a.micro_batch, "num_mb": a.num_mb, "seq": a.seq,
                      "iters": a.iters, "cores": cores, "backend": "gloo"},
           "runs": []}
    for dp in dps:
        r = measure(dp, a.iters, a.micro_batch, a.num_mb, a.seq, cores, model)
        res["runs"].append(r)
        b, o = r["after_backward"], r["overlapped"]
        lim = r["overlapped_over_limit"]
        print(f"dp {dp}: after the last backward {b['seconds']:.3f} s/iter (sync {b.get('sync', 0):.3f}), "
              f"overlapped {o['seconds']:.3f} (sync {o.get('sync', 0):.3f}): {r['speedup_vs_after_backward']:.2f}x; "
              f"overlapped / limit (no sync) {'-' if lim is None else f'{lim:.2f}'}; "
              f"bit-identical {r['bit_identical']}",
              flush=True)
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
