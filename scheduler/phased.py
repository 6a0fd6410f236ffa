"""Placements whose components take turns on shared devices: collocated and hybrid, simulated per step.

- **collocated** (every component on every device, verl's default): the step's groups are generated on all
  devices (the same continuous-batching model as the simulator's instances, `rollout_model.lay_out`), then the
  actor's state comes back to the devices (`onload`), every device scores, the actor trains the step's
  `n_minibatches` iters on all devices, syncs the new weights in place and offloads its state for the next
  rollout. Nothing overlaps: step = rollout + onload + scoring + training + sync + offload.
- **hybrid** (actor and inference share the devices A, rollout runs apart on B): B generates; A scores groups as
  they arrive and trains iter j as soon as its mini-batch (a prefix of ids, as in the simulator) is scored and no
  group waits for scoring; every switch between scoring and training on A moves the actor's optimizer state on
  or off the devices (the measured hand-over). The step ends with the weight sync to B.

The hand-over is priced from the measured offload and onload of the actor's state on one GPU
(`CostModel.offload_s` / `onload_s`: bytes per device over the measured host-copy rate), scaled by the state
each device holds (parameters and gradients over TP, optimizer state over TP x DP).

Deterministic for a (spec, seed): the lengths are drawn from the same stream as `simulator.simulate`, so the
phased placements, static splits and dynamic policies see the same responses step for step.
"""

from __future__ import annotations

import heapq
import time as _time
from dataclasses import dataclass

import numpy as np

from scheduler.rollout_model import Work, lay_out
from scheduler.sim_records import SimResult, StepStats
from scheduler.workload import SimSpec
from tidal.core.errors import TidalError

MODES = ("collocated", "hybrid")


@dataclass(frozen=True)
class PhaseSeconds:
    """One step of a phased placement: where its wall time went (seconds)."""

    rollout: float
    scoring: float
    training: float
    handover: float
    sync: float
    total: float
    idle_fraction: float


def step_lengths(spec: SimSpec, seed: int, step: int) -> np.ndarray:
    """The response lengths of `step`: the stream `simulator._Sim.run_step` draws from."""
    p = spec.params
    rng = np.random.default_rng([seed, step])
    return spec.lengths.sample(rng, p.rollout_batch_size, p.group_size, spec.max_new_tokens, step=step)


def _rollout(spec: SimSpec, lengths: np.ndarray, devices: int) -> np.ndarray:
    """Wall time (from the step's start) at which each group is generated, on `devices` devices."""
    p, c = spec.params, spec.costs
    n_inst = devices // p.rollout_tp
    works, t0s = [], []
    lf = lengths.astype(np.float64)
    for k in range(n_inst):
        mine = np.arange(k, p.rollout_batch_size, n_inst, dtype=np.int64)
        gid = np.repeat(mine, p.group_size)
        works.append(Work(gid, lf[mine].reshape(-1), np.zeros(gid.size)))
        t0s.append(c.decode.prefill_per_token_s * spec.prompt_tokens * min(gid.size, p.max_running_requests))
    done = np.zeros(p.rollout_batch_size)
    for e in lay_out(works, t0s, p.max_running_requests, c.decode):
        done[np.asarray(e.gids, dtype=np.int64)] = e.gwall
    return done


def minibatch_ready(spec: SimSpec, lengths: np.ndarray, devices: int) -> list[float]:
    """When each of the step's mini-batches (id-order slices of the groups) is generated, as a fraction of the
    rollout's end, with the rollout on `devices` devices: how much of the rollout a streaming actor could hide."""
    gen = _rollout(spec, lengths, devices)
    gpi = spec.params.groups_per_iter
    end = float(gen.max())
    return [float(gen[:(j + 1) * gpi].max()) / end for j in range(spec.params.n_minibatches)]


def _group_tokens(spec: SimSpec, lengths: np.ndarray) -> np.ndarray:
    return lengths.sum(axis=1).astype(np.float64) + spec.params.group_size * spec.prompt_tokens


def _iter_tokens(spec: SimSpec, tokens: np.ndarray) -> list[float]:
    gpi = spec.params.groups_per_iter
    return [float(tokens[j * gpi:(j + 1) * gpi].sum()) for j in range(spec.params.n_minibatches)]


def state_bytes_per_device(spec: SimSpec, devices: int) -> float:
    """The actor's state on one of `devices` devices: parameters over TP, optimizer state over TP x DP."""
    r, tp = spec.costs.reshard, spec.params.actor_tp
    return r.param_bytes / tp + r.optim_bytes / devices


def collocated_step(spec: SimSpec, lengths: np.ndarray) -> PhaseSeconds:
    p, c = spec.params, spec.costs
    n = p.num_devices
    gen = _rollout(spec, lengths, n)
    rollout = float(gen.max())
    tokens = _group_tokens(spec, lengths)
    servers = n // p.inference_tp
    # all groups are there at once: a list schedule over the servers, lowest ids first
    free = [0.0] * servers
    for tok in tokens.tolist():
        t = heapq.heappop(free)
        heapq.heappush(free, t + c.inference.group_time(tok, p.inference_tp))
    scoring = max(free)
    dp = n // p.actor_tp
    training = sum(c.actor.iter_time(t, p.actor_tp, dp, p.micro_batches) for t in _iter_tokens(spec, tokens))
    state = state_bytes_per_device(spec, n)
    handover = c.onload_s(state) + c.offload_s(state)
    sync = c.sync_time()
    total = rollout + scoring + training + handover + sync
    useful = _rollout_busy(spec, gen, n) + scoring * n + training * n
    return PhaseSeconds(rollout, scoring, training, handover, sync, total, 1.0 - useful / (n * total))


def _rollout_busy(spec: SimSpec, done: np.ndarray, devices: int) -> float:
    """Device-seconds the rollout instances hold unfinished sequences (each instance until its last group), from
    `done`, when each group was generated (`_rollout`)."""
    p = spec.params
    n_inst = devices // p.rollout_tp
    return float(sum(done[k::n_inst].max() for k in range(n_inst) if done[k::n_inst].size)) * p.rollout_tp


def hybrid_step(spec: SimSpec, lengths: np.ndarray, rollout_devices: int) -> PhaseSeconds:
    """Rollout on `rollout_devices` devices, actor and inference sharing the rest (module doc)."""
    p, c = spec.params, spec.costs
    shared = p.num_devices - rollout_devices
    if shared < max(p.actor_tp, p.inference_tp) or rollout_devices < p.rollout_tp:
        raise TidalError("hybrid split", rollout_devices, f"leaves no room on {p.num_devices} devices",
                         "give the rollout fewer devices")
    gen = _rollout(spec, lengths, rollout_devices)
    tokens = _group_tokens(spec, lengths)
    servers = shared // p.inference_tp
    dp = shared // p.actor_tp
    gpi = p.groups_per_iter
    iters = _iter_tokens(spec, tokens)
    state = state_bytes_per_device(spec, shared)
    order = np.argsort(gen, kind="stable")
    arrivals = gen[order].tolist()
    scored = np.zeros(p.rollout_batch_size, dtype=bool)
    prefix, nxt, done_iters, t = 0, 0, 0, 0.0
    scoring = training = handover = 0.0
    mode = "score"
    while done_iters < p.n_minibatches:
        k = nxt
        while k < len(arrivals) and arrivals[k] <= t + 1e-12:
            k += 1
        if k > nxt:   # score what has arrived (the servers share the batch)
            if mode == "train":
                t += c.offload_s(state)
                handover += c.offload_s(state)
                mode = "score"
            ids = order[nxt:k]
            dt = (float(sum(c.inference.group_time(tokens[g], p.inference_tp) for g in ids.tolist()))
                  / servers)
            t += dt
            scoring += dt
            scored[ids] = True
            nxt = k
            while prefix < p.rollout_batch_size and scored[prefix]:
                prefix += 1
        elif prefix >= (done_iters + 1) * gpi:
            if mode == "score":
                t += c.onload_s(state)
                handover += c.onload_s(state)
                mode = "train"
            dt = c.actor.iter_time(iters[done_iters], p.actor_tp, dp, p.micro_batches)
            t += dt
            training += dt
            done_iters += 1
        else:
            t = arrivals[nxt]
    sync = c.sync_time()
    total = t + sync
    rollout = float(gen.max())
    useful = _rollout_busy(spec, gen, rollout_devices) + (scoring + training) * shared
    return PhaseSeconds(rollout, scoring, training, handover, sync, total,
                        1.0 - useful / (p.num_devices * total))


def simulate_phased(spec: SimSpec, mode: str, steps: int, seed: int = 0,
                    rollout_devices: int | None = None) -> SimResult:
    """`steps` steps of a phased placement, as a `SimResult` (no events: nothing moves)."""
    if mode not in MODES:
        raise TidalError("mode", mode, "is not a phased placement", f"use one of {MODES}")
    t0 = _time.perf_counter()
    stats, parts = [], []
    for s in range(steps):
        lengths = step_lengths(spec, seed, s)
        ph = (collocated_step(spec, lengths) if mode == "collocated"
              else hybrid_step(spec, lengths, rollout_devices or spec.num_devices // 2))
        parts.append(ph)
        g = spec.params.rollout_batch_size
        stats.append(StepStats(s, ph.total, ph.idle_fraction, g, g, g, 0, 0, 0, 0))
    total = sum(s.time_s for s in stats)
    idle = sum(s.idle_fraction * s.time_s for s in stats) / total
    busy = {"rollout": sum(ph.rollout for ph in parts), "inference": sum(ph.scoring for ph in parts),
            "actor": sum(ph.training for ph in parts)}
    name = mode if mode == "collocated" else f"hybrid-r{rollout_devices or spec.num_devices // 2}"
    return SimResult(spec.name, name, spec.num_devices, tuple(stats), total, idle, busy, (),
                     _time.perf_counter() - t0, seed)
