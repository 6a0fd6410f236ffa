"""Small worker functions that exercise the runtime: collectives, per-worker state, CPU use.

Each takes the `WorkerContext` first, like every function run through `WorkerGroup.call*`. They are used by
the tests and by `tidal` commands that check a cluster, and double as examples of the calling convention.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist

from tidal.core.errors import ConfigError
from tidal.engine.model import ModelArgs, Transformer
from tidal.workers.device_worker import WorkerContext


def world_info(ctx: WorkerContext) -> dict[str, Any]:
    """Who and where this worker is."""
    return {"device_id": ctx.device_id, "rank": ctx.rank, "world_size": ctx.world_size,
            "device": str(ctx.device), "pid": os.getpid(), "backend": str(dist.get_backend(ctx.group))}


def allreduce_sum(ctx: WorkerContext, value: float) -> float:
    """Sum of `value` over the world (each rank passes its own or the same)."""
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=ctx.group)
    return float(t.item())


def allreduce_rank_weighted(ctx: WorkerContext, base: float) -> float:
    """Sum over ranks of `base * (rank + 1)`: each rank contributes a different value."""
    return allreduce_sum(ctx, base * (ctx.rank + 1))


def put_state(ctx: WorkerContext, key: str, value: Any) -> None:
    ctx.state[key] = value


def get_state(ctx: WorkerContext, key: str) -> Any:
    if key not in ctx.state:
        raise KeyError(f"device {ctx.device_id} has no state {key!r} (keys: {sorted(ctx.state)})")
    return ctx.state[key]


def add_to_state(ctx: WorkerContext, key: str, delta: float) -> float:
    """state[key] += delta, creating it at 0: shows state carried across calls."""
    ctx.state[key] = ctx.state.get(key, 0.0) + delta
    return ctx.state[key]


def sleep(ctx: WorkerContext, seconds: float) -> int:
    time.sleep(seconds)
    return ctx.device_id


def wait_for_interrupt(ctx: WorkerContext, name: str, seconds: float, seq: int) -> dict[str, Any]:
    """Poll `ctx.interrupted(name, seq)` every millisecond for up to `seconds`: how a time slice ends early."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if ctx.interrupted(name, seq):
            return {"interrupted": True, "after_s": time.monotonic() - t0}
        time.sleep(0.001)
    return {"interrupted": False, "after_s": time.monotonic() - t0}


def busy_cpu_rate(ctx: WorkerContext, seconds: float) -> float:
    """Spin for `seconds` of wall time; return the CPU seconds used per wall second (this process)."""
    c0, t0 = time.process_time(), time.monotonic()
    while time.monotonic() - t0 < seconds:
        pass
    return (time.process_time() - c0) / (time.monotonic() - t0)


def fail(ctx: WorkerContext, message: str) -> None:
    raise RuntimeError(f"device {ctx.device_id}: {message}")


def fail_with_config_error(ctx: WorkerContext, field: str) -> None:
    """Raise a user error (`ConfigError`) on the worker: the driver must receive it as itself."""
    raise ConfigError(field, "x", "is refused here", "give another value")


def allreduce_seeded(ctx: WorkerContext, seed: int, numel: int) -> list[float]:
    """All-reduce of an integer-valued float64 tensor drawn from `seed + device_id`.

    Integer values keep the sum exact in any reduction order, so the result can be compared for equality
    with a single-process reference (`seeded_tensor` summed over the device ids).
    """
    t = seeded_tensor(seed + ctx.device_id, numel).to(ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=ctx.group)
    return t.cpu().tolist()


def seeded_tensor(seed: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1000, 1000, (numel,), generator=g).to(torch.float64)


def probe_model() -> Transformer:
    """The e2e benchmark's decoder shape (hidden 128, 4 layers), seeded weights, eval mode."""

    torch.manual_seed(0)
    return Transformer(ModelArgs(vocab_size=32, max_seq_len=64)).eval()


def forwards_per_second(model: torch.nn.Module, seconds: float, batch: int = 16, seq: int = 24) -> float:
    """Forwards of `model` on a [batch, seq] input per wall second, over `seconds`, on one intra-op thread
    (set on the calling thread: under OpenMP the setting is per thread, as roles.setup does)."""
    torch.set_num_threads(1)
    ids = torch.randint(0, 32, (batch, seq))
    n, t0 = 0, time.monotonic()
    with torch.no_grad():
        while time.monotonic() - t0 < seconds:
            model(ids)
            n += 1
    return n / (time.monotonic() - t0)


def forward_rate(ctx: WorkerContext, seconds: float, batch: int = 16, seq: int = 24) -> float:
    """`forwards_per_second` of `probe_model` (built once per worker, kept in ``ctx.state``): the work a CPU
    virtual device does in rollout, scoring and training, many small ops with the interpreter in between.
    Used to check that a capped device's speed does not depend on how busy its neighbours are
    (`benchmarks/share.py`)."""
    if "_probe_model" not in ctx.state:
        ctx.state["_probe_model"] = probe_model()
    return forwards_per_second(ctx.state["_probe_model"], seconds, batch, seq)


def thread_affinities(ctx: WorkerContext) -> list[list[int]]:
    """The cores each thread of this worker may run on (one sorted list per thread, in /proc order)."""
    out = []
    for t in sorted(os.listdir(f"/proc/{os.getpid()}/task")):
        try:
            out.append(sorted(os.sched_getaffinity(int(t))))
        except ProcessLookupError:
            continue
    return out

