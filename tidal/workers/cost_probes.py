"""Worker functions that measure the cost model's inputs on a device (`WorkerGroup.call(d,
"tidal.workers.cost_probes:measure_decode", ...)`): the decode step against the batch and the prefill per token,
with the run's model shape (random weights) on that device's worker, under its caps. `scheduler.costs_cpu`
fits the cost model from what they return."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from tidal.engine.generation.engine import EngineConfig, NativeEngine
from tidal.engine.generation.requests import Request, SamplingParams
from tidal.engine.model import Transformer, init_global_weights
from tidal.workers.device_worker import WorkerContext
from tidal.workers.roles import roles_of


def measure_decode(ctx: WorkerContext, batches: Sequence[int], steps: int = 12,
                   warmup: int = 3) -> list[tuple[int, float]]:
    """(batch, seconds per decode step) on this device's worker: a fresh NativeEngine with the run's model
    (random weights of the same shape), `batch` requests that cannot finish early (no stop token, a cap
    past the steps measured), median of `steps` timed `engine.step()` calls after `warmup`."""

    spec = roles_of(ctx).run
    torch.set_num_threads(1)
    model = Transformer(spec.args, device=ctx.device)
    model.load_global(init_global_weights(spec.args, 0))
    model.eval()
    prompt = (1,) * 9
    cap = min(spec.args.max_seq_len - len(prompt) - 1, warmup + steps + 2)
    out = []
    for b in batches:
        eng = NativeEngine(model, EngineConfig(max_running_requests=max(batches)))
        params = SamplingParams(temperature=1.0, max_new_tokens=cap)
        for i in range(b):
            eng.add(Request(f"m/g{i}/i0", prompt, params, seed=i))
        ts = []
        for k in range(warmup + steps):
            t0 = time.perf_counter()
            eng.step()
            if k >= warmup:
                ts.append(time.perf_counter() - t0)
        out.append((b, float(np.median(ts))))
        eng.abort(eng.request_ids())
    return out


def measure_prefill(ctx: WorkerContext, tokens: int = 32, reps: int = 5) -> float:
    """Seconds per prompt token of a prefill on this worker (one request of `tokens` prompt tokens)."""

    spec = roles_of(ctx).run
    torch.set_num_threads(1)
    model = Transformer(spec.args, device=ctx.device)
    model.load_global(init_global_weights(spec.args, 0))
    model.eval()
    tokens = min(tokens, spec.args.max_seq_len - 2)
    ts = []
    for k in range(reps):
        eng = NativeEngine(model, EngineConfig(max_running_requests=1))
        eng.add(Request(f"p/g{k}/i0", (1,) * tokens, SamplingParams(max_new_tokens=1), seed=k))
        t0 = time.perf_counter()
        eng.admit()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) / tokens
