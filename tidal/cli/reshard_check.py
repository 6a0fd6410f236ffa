"""`tidal reshard-check`: a user-facing self-test of online actor resharding.

    tidal reshard-check --world 4 --from tp=2,dp=2 --to tp=1,dp=3,devices=1-3 [--json out.json]

Starts `--world` ranks (CPU processes over gloo, or one per GPU over NCCL with `--backend nccl`), builds a small
model at the `--from` layout, trains one step (so Adam moments, step and LR state are non-trivial), reshards to
`--to`, and checks every tensor against the source: both layouts are gathered into global tensors on every rank
*for the check only* and compared bit for bit (parameters, fp32 master weights, both Adam moments, step, data
cursor, the RNG rule), then reshards back and checks that the round trip is the identity on every rank's own
buffers. Exit 0 with a one-line summary; 1 with the first mismatching tensor; 2 for an impossible layout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tidal.core.errors import LayoutError, TidalError
from tidal.engine.actor import ActorShard, SharedQueue, nll_loss
from tidal.engine.layout import Layout
from tidal.engine.model import ModelArgs, check_tp
from tidal.engine.optim import OptimConfig, rng_seed
from tidal.engine.testing import RankFailed, free_port, init_loopback_world, run_ranks

# 8 heads and 8 kv heads: any TP in 1, 2, 4, 8; vocab 37 and SwiGLU width 52 split unevenly.
CHECK_MODEL: dict[str, Any] = dict(vocab_size=37, hidden_size=32, num_layers=2, num_heads=8, num_kv_heads=8,
                   intermediate_size=52, max_seq_len=16)


def _entry(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple, queue) -> None:
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        init_loopback_world(backend, rank, world, port)
        try:
            queue.put((rank, True, fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))


def run_world(world: int, backend: str, fn: Callable, *args: Any, timeout: float = 600.0) -> list[Any]:
    """`engine.testing.run_ranks` for gloo, or one process per GPU (cuda:rank) for NCCL. `fn(rank, world, *args)`
    gets an initialized world; results must pickle without shared tensors (return numbers, bools, strings)."""
    if backend == "gloo":
        return run_ranks(world, fn, *args, timeout=timeout)

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, backend, fn, args, queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                raise RankFailed(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def _check_body(rank: int, world: int, a_text: str, b_text: str, backend: str, seed: int) -> dict:


    args = ModelArgs(**CHECK_MODEL)
    a, b = Layout.parse(a_text), Layout.parse(b_text)
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    shard = ActorShard(args, OptimConfig(lr=1e-3, warmup_iters=1), a, rank, seed=seed, device=device,
                       dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    mbs = [torch.randint(0, args.vocab_size, (2, 12), generator=g).to(device) for _ in range(3)]
    shard.train_iter(SharedQueue(mbs), nll_loss, sum(m.numel() - m.shape[0] for m in mbs))
    ga = shard.state_dict_global()
    before = shard.local_tensors()
    t0 = time.perf_counter()
    report = shard.reshard(b)
    seconds = time.perf_counter() - t0
    gb = shard.state_dict_global()
    first = None
    for key in ga:
        if key != "rng" and not torch.equal(ga[key], gb[key]):
            diff = (ga[key].double() - gb[key].double()).abs()
            first = f"{key}: {int((diff > 0).sum())} elements differ (max {diff.max().item():.3g})"
            break
    if first is None:
        step = int(gb["step"])
        for idx in range(b.size):
            t, d = idx % b.tp, idx // b.tp
            want = ga["rng"][d * a.tp + t] if (t < a.tp and d < a.dp) else \
                torch.Generator(device).manual_seed(rng_seed(seed, step, t, d)).get_state()
            if not torch.equal(gb["rng"][idx].cpu(), want.cpu()):
                first = f"rng of rank (t={t}, d={d}) does not follow the RNG rule"
                break
    shard.reshard(a)
    after = shard.local_tensors()
    if first is None:
        for key in before:
            if not torch.equal(before[key], after[key]):
                first = f"round trip on rank {rank}: {key} differs"
                break
    return {"mismatch": first, "bytes_moved": report.bytes_moved, "seconds": seconds,
            "num_tensors": sum(1 for k in ga if "/" in k)}


def _validate(text: str, flag: str, world: int):
    lay = Layout.parse(text, flag)
    if max(lay.devices) >= world:
        raise LayoutError(f"{flag}.devices", text, f"uses device {max(lay.devices)} but --world is {world}",
                          f"use device ids 0-{world - 1} or raise --world")
    try:
        check_tp(ModelArgs(**CHECK_MODEL), lay.tp)
    except LayoutError as e:
        raise LayoutError(f"{flag}.tp", lay.tp, e.problem, "use tp in 1, 2, 4, 8 (the check model has 8 heads)") from e
    for d in range(lay.dp):
        grp = lay.tp_group(d)
        if list(grp) != sorted(grp):
            raise LayoutError(f"{flag}.devices", text, f"TP group {grp} is not increasing",
                              "list each TP group's devices in increasing order")
    return lay


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tidal reshard-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, required=True, help="ranks to start (CPU processes or GPUs)")
    p.add_argument("--from", dest="src", required=True, help='layout like "tp=2,dp=2[,devices=0-3]"')
    p.add_argument("--to", dest="dst", required=True, help="target layout, same syntax")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: nccl when the machine has --world GPUs, else gloo on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", help="write the result as JSON here")
    ns = p.parse_args(argv)
    try:
        if ns.world < 1:
            raise LayoutError("--world", ns.world, "must be >= 1", "e.g. --world 4")
        a, b = _validate(ns.src, "--from", ns.world), _validate(ns.dst, "--to", ns.world)
        backend = ns.backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= ns.world else "gloo"
        if backend == "nccl" and torch.cuda.device_count() < ns.world:
            raise LayoutError("--world", ns.world, f"needs {ns.world} GPUs, this machine has "
                              f"{torch.cuda.device_count()}", "lower --world or use --backend gloo")
    except TidalError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = run_world(ns.world, backend, _check_body, str(a), str(b), backend, ns.seed)
    mismatch = next((r["mismatch"] for r in results if r["mismatch"]), None)
    r0 = results[0]
    out = {"ok": mismatch is None, "world": ns.world, "backend": backend, "from": str(a), "to": str(b),
           "num_tensors": r0["num_tensors"], "bytes_moved": r0["bytes_moved"],
           "seconds": max(r["seconds"] for r in results), "mismatch": mismatch}
    if ns.json_path:
        with open(ns.json_path, "w") as f:
            json.dump(out, f, indent=2)
    if mismatch:
        print(f"reshard-check FAILED {a} -> {b}: {mismatch}", file=sys.stderr)
        return 1
    print(f"reshard-check ok: {a} -> {b} on {ns.world} {backend} ranks: {out['num_tensors']} tensors bit-identical "
          f"(params, master, Adam moments, step, data cursor, RNG), {out['bytes_moved'] / 1e3:.1f} kB moved in "
          f"{out['seconds'] * 1e3:.1f} ms, round trip identical")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
