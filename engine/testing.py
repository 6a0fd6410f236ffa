"""Run a function on N real gloo ranks (spawned processes) and collect what each returns.

Used by tests and `tidal reshard-check` to exercise distributed code against single-process references:

    def body(rank, world, x):            # runs in each process, inside an initialized gloo world
        t = torch.tensor([float(rank + x)])
        torch.distributed.all_reduce(t)
        return t.item()
    run_ranks(4, body, 1.0)              # -> [10.0, 10.0, 10.0, 10.0]

`body` must be importable (module level). Results travel back through a multiprocessing queue on this host.
A rank that raises makes `run_ranks` raise `RankFailed` naming the rank and carrying its traceback text; a rank
that hangs past `timeout` is killed and reported the same way.
"""

from __future__ import annotations

import os
import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, queue) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            queue.put((rank, True, fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report to the parent, which raises; the process exits either way
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(world: int, fn: Callable, *args: Any, timeout: float = 300.0, daemon: bool = True) -> list[Any]:
    """`daemon=False` lets a rank start processes of its own (megatron-core's checkpoint writer forks writers)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue), daemon=daemon) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world):
            try:
                rank, ok, value = queue.get(timeout=timeout)
            except Exception:
                missing = sorted(set(range(world)) - set(results))
                raise RankFailed(f"ranks {missing} gave no result within {timeout:.0f} s") from None
            if not ok:
                raise RankFailed(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
