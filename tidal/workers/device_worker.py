"""The per-device worker: one long-lived process that owns one device and a rank in the world.

`DeviceWorker` is a plain class; `tidal.workers.runtime` turns it into a Ray actor (``ray.remote``) at
start, so importing this module costs torch and nothing else. It runs functions named by a path
(``"tidal.workers.probes:allreduce_sum"``) with a `WorkerContext` first argument::

    def my_fn(ctx: WorkerContext, value: float) -> float:
        t = torch.tensor([value], device=ctx.device)
        dist.all_reduce(t, group=ctx.group)
        ctx.state["last"] = t.item()      # survives until the next call, and the one after
        return t.item()

Calls run one at a time, in arrival order, on the actor's default thread (Ray's max_concurrency=1 for the
default group). `health` and `interrupt` run in a separate "control" group so they answer while a long call is
running: the driver tells a busy worker from a dead or wedged one, and can ask a time slice to end early.
"""

from __future__ import annotations

import importlib
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tidal.workers.store_audit import StoreAudit, tensor_bytes

CONTROL_GROUP = "control"


@dataclass
class WorkerContext:
    """What a function running on a worker knows about where it runs."""

    device_id: int
    """The device this worker owns (an id of the cluster's placement, not a count)."""
    rank: int
    """Rank in the world: the device's position in the group's device list."""
    world_size: int
    device_ids: tuple[int, ...]
    """All devices of the world, in rank order (`device_ids[rank] == device_id`)."""
    device: torch.device
    """cpu for a CPU virtual device; cuda:0 for a GPU (Ray hides the other GPUs)."""
    group: Any
    """The world's process group (gloo on CPU; gloo for CPU tensors + NCCL for CUDA tensors on GPU); None in a
    replacement worker, which is in no world (`DeviceWorker.init_alone`)."""
    state: dict[str, Any] = field(default_factory=dict)
    """Per-worker objects kept between calls: a model shard, an optimizer, a generation engine."""
    interrupt_upto: dict[str, int] = field(default_factory=dict)
    """Per name, the highest call number the driver asked to end early (`WorkerGroup.interrupt`, on the control
    thread): a long call numbered by its caller polls `interrupted(name, seq)` between units of work; every call
    numbered up to it ends, however many are queued, and later ones are not touched."""

    def interrupted(self, name: str, seq: int) -> bool:
        """True if the call numbered `seq` (by the driver, per device and name) was asked to end early."""
        return seq <= self.interrupt_upto.get(name, -1)

    def rank_of(self, device_id: int) -> int:
        try:
            return self.device_ids.index(device_id)
        except ValueError:
            raise KeyError(f"device {device_id} is not in this world {list(self.device_ids)}") from None


@dataclass(frozen=True)
class WorkerInfo:
    """Where a worker landed; reported once at start."""

    device_id: int
    pid: int
    hostname: str
    node_ip: str
    gpu_ids: tuple[str, ...]


@dataclass(frozen=True)
class HealthReport:
    """A worker's answer to `health()`; `busy_fn` is the call running now, if any."""

    device_id: int
    pid: int
    calls_done: int
    busy_fn: str | None
    busy_for_s: float


#: what a call names: a module-level function of an importable module, or its path "package.module:function"
WorkerFn = Callable[..., Any] | str


def fn_path(fn: WorkerFn) -> str:
    """The path a worker resolves `fn` by: only the name crosses the process boundary, never code."""
    if isinstance(fn, str):
        return fn
    mod, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not mod or "<" in name:
        raise ValueError(f"{fn!r} is not a module-level function: a worker can only run those (by name)")
    return f"{mod}:{name}"


def resolve(fn_path: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> the function. Errors name the path and the fix."""
    mod_name, sep, attr = fn_path.partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"function path {fn_path!r} must look like 'package.module:function'")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"function path {fn_path!r}: cannot import module {mod_name!r} on the worker ({e}); "
                         "the module must be importable from the worker's Python environment") from e
    obj: Any = mod
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"function path {fn_path!r}: module {mod_name!r} has no attribute {attr!r}")
    if not callable(obj):
        raise ValueError(f"function path {fn_path!r} names a {type(obj).__name__}, not a function")
    return obj


class DeviceWorker:
    """One device, one process, one rank. Driven by `tidal.workers.runtime.WorkerGroup`."""

    def __init__(self, device_id: int, device_kind: str, rank: int, device_ids: tuple[int, ...]):
        # One intra-op thread: N virtual devices on a small machine must not each spawn a thread per core.
        torch.set_num_threads(1)
        self._device_id, self._kind, self._rank = device_id, device_kind, rank
        self._device_ids = tuple(device_ids)
        if device_kind == "cuda":
            # Ray sets CUDA_VISIBLE_DEVICES to the one GPU it granted this actor.
            torch.cuda.set_device(0)
            self._device = torch.device("cuda", 0)
        else:
            self._device = torch.device("cpu")
        self._ctx: WorkerContext | None = None
        self._store: dist.TCPStore | None = None
        self._lock = threading.Lock()
        self._busy: tuple[str, float] | None = None
        self._calls_done = 0
        self._audit = StoreAudit()

    # ----------------------------------------------------------------------------------- start-up
    def info(self) -> WorkerInfo:
        import ray  # only called inside a Ray worker, where ray is already loaded

        gpu_ids = tuple(str(g) for g in ray.get_gpu_ids()) if self._kind == "cuda" else ()
        return WorkerInfo(self._device_id, os.getpid(), socket.gethostname(), ray.util.get_node_ip_address(),
                          gpu_ids)

    def open_store(self, host: str) -> int:
        """Rank 0 only: host the rendezvous store on `host` (loopback locally); returns its port.

        ``init_method="tcp://host:port"`` makes torch's TCPStore listen on every interface whatever `host`
        says (seen with ``ss -ltnp``), so rank 0 binds the listening socket itself and hands the fd to the
        store. Binding port 0 here also means no port picked elsewhere can be taken in between.
        """
        assert self._rank == 0, "only rank 0 hosts the store"
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        self._store = dist.TCPStore(host, port, len(self._device_ids), is_master=True,
                                    timeout=timedelta(seconds=300), wait_for_workers=False,
                                    master_listen_fd=sock.detach())
        return port

    def init_world(self, master_addr: str, master_port: int, timeout_s: float) -> int:
        """Join the world. Every rank must call this concurrently; returns the rank."""
        backend = "cpu:gloo,cuda:nccl" if self._kind == "cuda" else "gloo"
        if self._store is None:
            self._store = dist.TCPStore(master_addr, master_port, len(self._device_ids), is_master=False,
                                        timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=self._store, rank=self._rank, world_size=len(self._device_ids),
                                timeout=timedelta(seconds=timeout_s))
        self._ctx = WorkerContext(self._device_id, self._rank, len(self._device_ids), self._device_ids,
                                  self._device, dist.group.WORLD)
        return self._rank

    def init_alone(self) -> int:
        """A replacement for a failed rank: a context with no world. torch's world has a fixed size and the
        survivors' ranks in it stay as they are, so a new process cannot take the lost rank; it runs what needs no
        collective (rollout, inference). Its `group` is None, its world itself alone (rank 0 of 1)."""
        self._ctx = WorkerContext(self._device_id, 0, 1, (self._device_id,), self._device, None)
        return self._device_id

    # --------------------------------------------------------------------------------------- calls
    def call(self, fn_path: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        assert self._ctx is not None, "init_world must run before call"
        fn = resolve(fn_path)
        with self._lock:
            self._busy = (fn_path, time.monotonic())
        try:
            result = fn(self._ctx, *args, **kwargs)
            nbytes = tensor_bytes(result)   # the result goes back through Ray's object store
            with self._lock:   # `store_audit` reads and resets it from the control thread
                self._audit.record(fn_path, nbytes)
            return result
        finally:
            with self._lock:
                self._busy = None
                self._calls_done += 1

    def health(self) -> HealthReport:
        """Answered from the control thread, so it works while `call` is busy."""
        with self._lock:
            busy = self._busy
            done = self._calls_done
        return HealthReport(self._device_id, os.getpid(), done, busy[0] if busy else None,
                            time.monotonic() - busy[1] if busy else 0.0)

    def store_audit(self, reset: bool) -> dict[str, int]:
        """Control thread: the largest result's tensor bytes per function since the last reset (`StoreAudit`)."""
        with self._lock:
            return self._audit.take(reset)

    def interrupt(self, name: str, upto: int) -> None:
        """Control thread: end every call numbered up to `upto` that polls `name` (`WorkerContext.interrupted`).
        A plain dict store: atomic under the GIL."""
        if self._ctx is not None:
            self._ctx.interrupt_upto[name] = max(upto, self._ctx.interrupt_upto.get(name, -1))

    def leave_world(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self._ctx = None
        self._store = None

