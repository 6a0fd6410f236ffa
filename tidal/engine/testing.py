"""Run a function on N real gloo ranks (spawned processes) and collect what each returns.

Used by tests and `tidal reshard-check` to exercise distributed code against single-process references:

    def body(rank, world, x):            # runs in each process, inside an initialized gloo world
        t = torch.tensor([float(rank + x)])
        torch.distributed.all_reduce(t)
        return t.item()
    run_ranks(4, body, 1.0)              # -> [10.0, 10.0, 10.0, 10.0]

`body` must be importable (module level). Results travel back through a multiprocessing queue on this host, by
value: tensors are sent as numpy copies and rebuilt (torch's shared-memory hand-off needs the sending process
alive, and a rank exits right after returning).
A rank that raises makes `run_ranks` raise `RankFailed` naming the rank and carrying its traceback text; a rank
that hangs past `timeout` is killed and reported the same way.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    pass


class _Tensor:
    """A tensor's bytes, pickled by value."""

    def __init__(self, t: torch.Tensor):
        self.dtype = t.dtype
        self.data = t.detach().cpu().contiguous().view(torch.uint8).numpy().copy() if t.numel() else None
        self.shape = tuple(t.shape)

    def tensor(self) -> torch.Tensor:
        if self.data is None:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.from_numpy(self.data).view(self.dtype).reshape(self.shape)


def _pack(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return _Tensor(obj)
    if isinstance(obj, dict):
        return {k: _pack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_pack(v) for v in obj)
    return obj


def _unpack(obj: Any) -> Any:
    if isinstance(obj, _Tensor):
        return obj.tensor()
    if isinstance(obj, dict):
        return {k: _unpack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unpack(v) for v in obj)
    return obj


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_loopback_world(backend: str, rank: int, world: int, port: int) -> None:
    """Join a process group whose every socket is on 127.0.0.1. `init_method="tcp://127.0.0.1:PORT"` is not
    enough: torch's TCPStore listens on every interface whatever the host says, so rank 0 binds the listening
    socket itself and hands its fd to the store; gloo's pair sockets follow GLOO_SOCKET_IFNAME."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if rank == 0:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False,
                              master_listen_fd=sock.detach())
    else:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, queue) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        init_loopback_world("gloo", rank, world, port)
        try:
            queue.put((rank, True, _pack(fn(rank, world, *args))))
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
            results[rank] = _unpack(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
