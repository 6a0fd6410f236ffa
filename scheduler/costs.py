"""Cost models: how long each kind of work takes, as small dataclasses with documented parameters.

The simulator uses them to advance time; the `tidal` policy uses the same models to predict whether a move
pays for itself. Three presets:

- `gpu_h200_1p5b()`: an H200-class GPU (HBM 4.8 TB/s, 989 TFLOP/s dense bf16, NVLink 450 GB/s per direction,
  pinned host copies 55 GB/s measured, see DESIGN.md) running a 1.5B Qwen2.5-style model (28 layers,
  2 KV heads x 128, bf16). Every number is derived below from those figures; none is fitted to a workload.
- `gpu_h200()`: the same pair fitted to this system's own measurements on one H200 (decode vs batch and
  context, prefill, actor, scoring, weight sync, hand-over; resharding on 2 x H200); the derived figures stay
  where one GPU measures nothing.
- `cpu_tiny()`: CPU virtual devices running the default tiny config (hidden 128, 4 layers). Orders of
  magnitude from the DESIGN.md facts (gloo 3 GB/s); calibrate with `fit_decode` / `fit_actor` from
  measured runs before trusting absolute times.

Model forms (t: seconds)::

    decode step, b sequences running:     t = step_s + per_seq_s * b
    prefill (and migration re-prefill):    t = prefill_per_token_s * tokens          (one instance)
    inference (log-prob forward):          t = per_token_s * tokens / (devices * tp_eff)
    actor iter on tp x dp:                 t = iter_fixed_s + train_per_token_s * tokens * share / (tp * tp_eff)
                                              + 2 (dp-1)/dp * grad_bytes/tp / link_bw        (ring all-reduce)
        share: the busiest DP rank's part of the iter, 1/dp; with m micro-batches per iter (known from the
        config) ceil(m / dp) / m, since a rank trains whole micro-batches (8 micro-batches: dp 3 trains 3/8
        on its busiest rank, not 1/3; dp 5, 6, 7 gain nothing over dp 4)
    reshard a -> b:                        t = fixed_s + max bytes received by one device / bandwidth
    weight sync at step end:               t = sync_fixed_s + param_bytes / sync_bw

`fit_linear` is least squares on measured (x, seconds) samples: (batch, decode-step seconds) gives
`DecodeCost`, (1/dp, iter seconds) gives the actor's fixed and per-token terms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from tidal.core.errors import TidalError


@dataclass(frozen=True)
class DecodeCost:
    """A rollout instance's generation speed (one instance = one TP group)."""

    step_s: float              #: fixed time of one decode step (weights read + launch/sampling overhead)
    per_seq_s: float           #: extra time per running sequence per step (KV read + per-token compute)
    prefill_per_token_s: float #: prompt (or migrated prompt+generated) tokens, compute bound

    def step_time(self, batch: float) -> float:
        return self.step_s + self.per_seq_s * batch

    def rate(self, batch: float) -> float:
        """Tokens per second with `batch` sequences running."""
        return batch / self.step_time(batch) if batch > 0 else 0.0


@dataclass(frozen=True)
class InferenceCost:
    per_token_s: float         #: one forward over one token on one device
    tp_eff: float = 1.0        #: parallel efficiency of an instance's TP group
    per_group_s: float = 0.0   #: fixed cost per scored group (batching, transfer)

    def group_time(self, tokens: float, tp: int) -> float:
        return self.per_group_s + self.per_token_s * tokens / (tp * (self.tp_eff if tp > 1 else 1.0))


@dataclass(frozen=True)
class ActorCost:
    train_per_token_s: float   #: forward + backward of one token on one device (6 x params flops / achieved)
    iter_fixed_s: float        #: optimizer step, micro-batch pipeline bubbles, logging
    grad_bytes: float          #: gradient bytes of the whole model (all-reduced across DP)
    link_bw: float             #: bytes/s of the all-reduce links
    tp_eff: float = 1.0        #: efficiency of TP > 1

    def iter_time(self, tokens: float, tp: int, dp: int, micro_batches: int = 0) -> float:
        """Seconds of one iter of `tokens` on tp x dp; `micro_batches` per iter (0: unknown, work splits evenly)."""
        eff = self.tp_eff if tp > 1 else 1.0
        compute = self.train_per_token_s * tokens * rank_share(dp, micro_batches) / (tp * eff)
        allreduce = 2 * (dp - 1) / dp * (self.grad_bytes / tp) / self.link_bw
        return self.iter_fixed_s + compute + allreduce


def rank_share(dp: int, micro_batches: int = 0) -> float:
    """Fraction of an iter's work on its busiest DP rank: whole micro-batches per rank (0 micro-batches: unknown,
    the work splits evenly)."""
    return math.ceil(micro_batches / dp) / micro_batches if micro_batches > 0 else 1.0 / dp


@dataclass(frozen=True)
class ReshardCost:
    """Actor reshard: parameters to every new DP replica, optimizer state (ZeRO-1 over DP) re-partitioned."""

    param_bytes: float         #: model parameters in the compute dtype
    optim_bytes: float         #: fp32 master weights + Adam moments
    bw: float                  #: bytes/s into one device within a node
    inter_node_bw: float       #: bytes/s into one device from another node
    devices_per_node: int
    fixed_s: float             #: plan + barrier + commit (process groups are cached)

    def time(self, from_devices: Sequence[int], from_dp: int, to_devices: Sequence[int], to_dp: int,
             tp: int) -> float:
        if tuple(from_devices) == tuple(to_devices) and from_dp == to_dp:
            return 0.0
        old = set(from_devices)
        joining = [d for d in to_devices if d not in old]
        nodes_old = {d // self.devices_per_node for d in old}
        far = any(d // self.devices_per_node not in nodes_old for d in joining)
        return self.time_counts(len(joining), len(to_devices) - len(joining), from_dp, to_dp, tp, far)

    def time_counts(self, joining: int, kept: int, from_dp: int, to_dp: int, tp: int, far: bool) -> float:
        """O(1) form: `joining` new devices receive params + their optimizer shard; `kept` devices receive
        the optimizer shards of leaving ranks; the slowest receiver sets the time."""
        if joining == 0 and from_dp == to_dp:
            return 0.0
        worst = self.param_bytes / tp + self.optim_bytes / (tp * to_dp) if joining else 0.0
        if kept:
            worst = max(worst, self.optim_bytes / tp * max(0.0, 1 / to_dp - 1 / from_dp))
        return self.fixed_s + worst / (self.inter_node_bw if far else self.bw)

    def grow_time(self, from_size: int, to_size: int, tp: int) -> float:
        """Contiguous layouts [0, from_size) -> [0, to_size) (growing or shrinking)."""
        if from_size == to_size:
            return 0.0
        far = ((max(from_size, to_size) - 1) // self.devices_per_node
               != (min(from_size, to_size) - 1) // self.devices_per_node)
        return self.time_counts(max(0, to_size - from_size), min(from_size, to_size), from_size // tp,
                                to_size // tp, tp, far)


@dataclass(frozen=True)
class CostModel:
    """All costs of one hardware + model pair."""

    name: str
    decode: DecodeCost
    inference: InferenceCost
    actor: ActorCost
    reshard: ReshardCost
    migration_fixed_s: float   #: abort + resubmit round trip per migration action (re-prefill is extra)
    rollout_release_s: float   #: free KV cache and weights of a rollout instance
    inference_release_s: float
    lend_s: float              #: actor offloads state and a rollout instance loads weights on its devices
    return_s: float            #: rollout instance offloads and the actor reloads its state
    sync_fixed_s: float        #: weight sync actor -> rollout/inference at step end
    sync_bw: float
    kv_bytes_per_token: float = 0.0  #: KV cache bytes of one token (all layers, K and V)
    kv_bw: float = 1.0         #: bytes/s of a KV-cache copy between instances
    kv_fixed_s: float = 0.0    #: pause + page-table handoff per KV migration action
    offload_bw: float = 55e9   #: bytes/s of the actor's state from a device to pinned host memory (hand-over)
    onload_bw: float = 55e9    #: bytes/s of the actor's state back onto a device

    def sync_time(self) -> float:
        return self.sync_fixed_s + self.reshard.param_bytes / self.sync_bw

    def offload_s(self, state_bytes: float) -> float:
        """Move `state_bytes` of the actor's state (one device's) off the device, as a shared placement does."""
        return state_bytes / self.offload_bw

    def onload_s(self, state_bytes: float) -> float:
        return state_bytes / self.onload_bw

    def migration_time(self, tokens: float) -> float:
        """Abort + resubmit + re-prefill of `tokens` (prompt + generated) on the target."""
        return self.migration_fixed_s + self.decode.prefill_per_token_s * tokens

    def kv_move_time(self, tokens: float) -> float:
        """Copy the KV cache of `tokens` (prompt + generated) to the target instance (no re-prefill)."""
        return self.kv_fixed_s + self.kv_bytes_per_token * tokens / self.kv_bw

    def with_decode(self, decode: DecodeCost) -> CostModel:
        return replace(self, decode=decode)


def gpu_h200_1p5b() -> CostModel:
    """H200 + 1.5B model. Derivations (P = 1.54e9 params; 989e12 flop/s; HBM 4.8e12 B/s):

    - decode step_s 4 ms: weights 3.1 GB / (4.8 TB/s x 0.65) = 1.0 ms + ~3 ms launch, sampling and
      scheduling overhead per step (typical for small models in vLLM/SGLang without CUDA-graph gains);
    - per_seq_s 30 us: KV read at a 2k-token mean context, 28 layers x 2 x 2 heads x 128 x 2 B = 28.7 KB/token
      -> 59 MB / (4.8 TB/s x 0.6) = 20 us, plus 2P flops at 30% of peak = 10 us;
    - prefill 6.2 us/token: 2P flops at 50% of peak; inference (log-probs) the same per token;
    - train 23 us/token: 6P flops at 40% MFU; TP 2 efficiency 0.9; 0.3 s fixed per iter (Adam step etc.);
    - grads 3.1 GB bf16; NVLink 450 GB/s per direction; 50 GB/s (400 Gb/s InfiniBand) across nodes;
    - reshard: params 3.1 GB + fp32 master 6.2 GB + Adam 12.3 GB, 0.5 s fixed (RLinf's "within 1 s");
    - lend/return: actor state per device (21.6 GB / 2) over pinned host copies at 55 GB/s (measured),
      ~0.2 s each way, plus 1 s instance start / stop;
    - KV migration (native engine): 28.7 KB/token (above) at 50 GB/s (the slower, inter-node link, so the
      same figure holds in and across nodes), 50 ms fixed (pause, page-table handoff): 2k tokens ~1.2 ms vs
      12 ms of re-prefill.
    """
    p = 1.54e9
    return CostModel(
        name="gpu-h200-1.5b",
        decode=DecodeCost(step_s=4e-3, per_seq_s=30e-6, prefill_per_token_s=6.2e-6),
        inference=InferenceCost(per_token_s=6.2e-6, tp_eff=0.9, per_group_s=0.01),
        actor=ActorCost(train_per_token_s=23.4e-6, iter_fixed_s=0.3, grad_bytes=2 * p, link_bw=450e9,
                        tp_eff=0.9),
        reshard=ReshardCost(param_bytes=2 * p, optim_bytes=12 * p, bw=450e9, inter_node_bw=50e9,
                            devices_per_node=8, fixed_s=0.5),
        migration_fixed_s=0.05, rollout_release_s=0.5, inference_release_s=0.3,
        lend_s=1.2, return_s=1.2, sync_fixed_s=0.3, sync_bw=450e9,
        kv_bytes_per_token=28 * 2 * 2 * 128 * 2, kv_bw=50e9, kv_fixed_s=0.05,
    )


def gpu_h200() -> CostModel:
    """One H200 + a Qwen2.5-1.5B-shaped model (bf16), fitted to measurements of this system on that machine
    (`scheduler/costs_h200.py` names the result files and refits every figure; tests hold the two equal):

    - decode with the engine's default CUDA kernels: 2.09 ms + 6.11 us per sequence + 7.29 ns per sequence-token
      of context (least squares over 14 windows of batch 64 and 256 as the context grows 320 -> 1,088; largest
      residual 1.4%), the context term folded in at a 1,024-token mean context: 13.6 us per sequence. The fixed
      term is 2.8x the weights' read at the measured copy bandwidth (0.74 ms at 4.15 TB/s): kernels that wait on
      latency, not bytes;
    - prefill 13.6 us/token (the same run's batched prefills, 81,920 prompt tokens);
    - actor 31.0 us/token (32,288 tokens/s, MFU 42.2%: 8 x 2,048-token sequences per micro-batch, 2 micro-batches
      an iter, the optimizer step included);
    - scoring 10.6 us/token (the scoring phase of one collocated GRPO step of 64 x 8 responses); that step's weight
      sync 0.56 s and hand-over (0.48 s offload, 0.43 s onload of the actor's state: 14 B a parameter at 44.6 and
      50.7 GB/s, `offload_bw` / `onload_bw`, what a shared placement pays per device), plus the derived preset's 1 s
      instance start or stop;
    - reshard: 28 ms + the busiest device's bytes at 355 GB/s (12 cases of 1B- and 7B-shaped states on 2 x H200;
      the form is within 60%: a whole state onto one new device runs at the link's 343 GB/s, a split at ~0.6 of
      it).
    Gradient all-reduce, inter-node links and KV moves across instances keep `gpu_h200_1p5b`'s derivations (one
    GPU measures none of them).
    """
    p = 1.54e9
    derived = gpu_h200_1p5b()
    return replace(
        derived, name="gpu-h200",
        decode=DecodeCost(step_s=2.09e-3, per_seq_s=6.11e-6 + 7.29e-9 * 1024, prefill_per_token_s=13.6e-6),
        inference=InferenceCost(per_token_s=10.6e-6, tp_eff=0.9, per_group_s=0.01),
        actor=replace(derived.actor, train_per_token_s=31.0e-6, iter_fixed_s=0.0),
        reshard=ReshardCost(param_bytes=2 * p, optim_bytes=12 * p, bw=355e9, inter_node_bw=50e9,
                            devices_per_node=8, fixed_s=0.028),
        lend_s=1.48, return_s=1.43, sync_fixed_s=0.56 - 2 * p / 450e9,
        offload_bw=14 * p / 0.483, onload_bw=14 * p / 0.425,
    )


def cpu_tiny() -> CostModel:
    """CPU virtual devices, the default tiny model (~1M params). Estimates to calibrate with the fits:
    gloo send/recv 3 GB/s and memcpy 20 GB/s are measured (DESIGN.md); compute terms are Python-overhead
    dominated (a decode step of a 4-layer model is ~1 ms of interpreter and kernel launches)."""
    p = 1.0e6
    return CostModel(
        name="cpu-tiny",
        decode=DecodeCost(step_s=1.5e-3, per_seq_s=40e-6, prefill_per_token_s=5e-6),
        inference=InferenceCost(per_token_s=8e-6, tp_eff=0.7, per_group_s=2e-3),
        actor=ActorCost(train_per_token_s=30e-6, iter_fixed_s=0.02, grad_bytes=4 * p, link_bw=3e9, tp_eff=0.7),
        reshard=ReshardCost(param_bytes=4 * p, optim_bytes=12 * p, bw=3e9, inter_node_bw=3e9,
                            devices_per_node=8, fixed_s=0.2),
        migration_fixed_s=0.01, rollout_release_s=0.05, inference_release_s=0.05,
        lend_s=0.1, return_s=0.1, sync_fixed_s=0.05, sync_bw=3e9,
        kv_bytes_per_token=4 * 2 * 128 * 4, kv_bw=3e9, kv_fixed_s=0.01,
    )


PRESETS = {"gpu": gpu_h200_1p5b, "gpu_h200": gpu_h200, "cpu": cpu_tiny}


def preset(name: str) -> CostModel:
    if name not in PRESETS:
        raise TidalError("costs", name, "unknown cost preset", f"use one of {sorted(PRESETS)}")
    return PRESETS[name]()


def fit_linear(samples: Sequence[tuple[float, float]], field: str = "samples") -> tuple[float, float]:
    """Least-squares (intercept, slope) of seconds = intercept + slope * x over (x, seconds) samples."""
    xs = np.asarray([float(s[0]) for s in samples])
    ys = np.asarray([float(s[1]) for s in samples])
    if len(xs) < 2 or np.unique(xs).size < 2:
        raise TidalError(field, list(samples)[:4], "needs samples at two or more distinct x values",
                         "measure at least two batch sizes (or DP sizes)")
    if not np.all(np.isfinite(ys)) or np.any(ys < 0):
        raise TidalError(field, list(samples)[:4], "seconds must be finite and non-negative", "drop bad samples")
    a = np.stack([np.ones_like(xs), xs], axis=1)
    (intercept, slope), *_ = np.linalg.lstsq(a, ys, rcond=None)
    return float(intercept), float(slope)


def fit_decode(samples: Sequence[tuple[int, float]], prefill_per_token_s: float) -> DecodeCost:
    """`DecodeCost` from measured (batch size, seconds per decode step)."""
    step_s, per_seq_s = fit_linear(samples, "decode samples")
    return DecodeCost(step_s=max(step_s, 0.0), per_seq_s=max(per_seq_s, 0.0),
                      prefill_per_token_s=prefill_per_token_s)


def learn_decode(samples: Sequence[tuple[float, float]], prior: DecodeCost, min_samples: int = 8) -> DecodeCost | None:
    """The decode cost a running service measured last step: `samples` are (mean running batch, wall seconds per
    decode step) of rollout calls as the driver saw them (call seconds x batch / tokens generated: admissions,
    prefills, call overhead and the machine's contention included, so this is the step time the rollout
    really pays, which a decode-only microbenchmark underestimates 2-3x on the capped CPU devices). The batch
    barely varies within a run (and CPU rows are padded to a fixed width), so the slope stays the prior's and
    the intercept is the median residual: robust to load spikes. None when there are too few samples."""
    if len(samples) < min_samples:
        return None
    b = np.asarray([x[0] for x in samples], dtype=float)
    t = np.asarray([x[1] for x in samples], dtype=float)
    ok = np.isfinite(t) & (t > 0)
    if ok.sum() < min_samples:
        return None
    step_s = float(np.median(t[ok] - prior.per_seq_s * b[ok]))
    return replace(prior, step_s=max(step_s, 1e-6))


def learn_scoring(samples: Sequence[tuple[int, float, float]], prior: InferenceCost, tp: int = 1,
                  min_samples: int = 4) -> InferenceCost | None:
    """The scoring cost a running service measured last step: `samples` are (groups, tokens, wall seconds) of
    inference calls as the driver saw them (call overhead and contention included). The per-token slope stays the
    prior's; the fixed cost per group is the median residual. None when there are too few samples."""
    if len(samples) < min_samples:
        return None
    g = np.asarray([x[0] for x in samples], dtype=float)
    tok = np.asarray([x[1] for x in samples], dtype=float)
    t = np.asarray([x[2] for x in samples], dtype=float)
    ok = np.isfinite(t) & (t > 0) & (g > 0)
    if ok.sum() < min_samples:
        return None
    per_tok = prior.per_token_s / (tp * (prior.tp_eff if tp > 1 else 1.0))
    per_group = float(np.median((t[ok] - per_tok * tok[ok]) / g[ok]))
    return replace(prior, per_group_s=max(per_group, 0.0))


def learn_actor_factor(samples: Sequence[tuple[int, int, float, float]], prior: ActorCost, lo: float = 1 / 16,
                       hi: float = 16.0, min_samples: int = 3, micro_batches: int = 0) -> float | None:
    """Measured over modelled actor iter time: `samples` are (tp, dp, tokens, wall seconds) of last step's iters.
    One factor, not a refit of fixed and per-token cost: iters measured while rollout runs are slowed by the
    machine, and a refit from them (tried) read the slowdown as fixed cost and ruled out growing. The median
    ratio, clipped to [lo, hi]; None with too few samples.

    The range is wide because the factor carries a preset to another machine: the CPU preset was measured on
    0.125-core devices, and with a whole host core per device (`--intermediate 1536`) the iters take 0.23x of
    it: a floor of 0.5 would price every iter there at twice its time."""
    return _median_ratio([t / m for tp, dp, tok, t in samples
                          if t > 0 and (m := prior.iter_time(tok, tp, dp, micro_batches)) > 0], lo, hi, min_samples)


def learn_rollout_factor(predictions: Sequence[tuple[float, float]], rollout_end: float,
                         lo: float = 0.5, hi: float = 4.0, min_samples: int = 3) -> float | None:
    """Measured over modelled remaining rollout time: `predictions` are (when, modelled seconds left) taken during
    last step's rollout, `rollout_end` when its last group came back (same clock). The median ratio, clipped to
    [lo, hi] (a stalled step must not teach the policy that rollout never ends). None with too few samples."""
    return _median_ratio([(rollout_end - t) / p for t, p in predictions if p > 0 and t < rollout_end],
                         lo, hi, min_samples)


def _median_ratio(ratios: Sequence[float], lo: float, hi: float, min_samples: int) -> float | None:
    """Median of measured / modelled ratios clipped to [lo, hi]; None with fewer than `min_samples`."""
    if len(ratios) < min_samples:
        return None
    return float(min(hi, max(lo, np.median(ratios))))


def learn_reshard(events: Sequence[dict], prior: ReshardCost) -> ReshardCost | None:
    """The fixed cost of a reshard as last step's `reshard` events measured it (seconds minus the modelled
    transfer of the bytes each receiving device got): drain, calls, plans, votes and, for a layout met the first
    time, its process groups. None without events."""
    xs = [max(0.0, e["seconds"] - e.get("bytes_moved", 0) / max(1, len(e.get("devices", ()) or (1,))) / prior.bw)
          for e in events if e.get("kind") == "reshard" and e.get("seconds") is not None]
    if not xs:
        return None
    return replace(prior, fixed_s=float(np.median(xs)))


#: action names whose measured seconds price a move of the cost model (`learn_moves` online, `costs_cpu.event_costs`
#: for the offline fit): a StartRollout is priced as a lend, as the simulator charges it
MIGRATION_ACTIONS = ("MigrateBatch", "MigrateRequests")
LEND_ACTIONS = ("LendToRollout", "StartRollout", "LendInference")
RETURN_ACTIONS = ("ReturnFromRollout", "ReturnToInference")


def learn_moves(events: Sequence[dict], prior: CostModel, kv: bool) -> CostModel | None:
    """The fixed costs of the policy's moves as last step's `action` events measured them, all in (the drain of
    the time slices in flight, the calls, and on a shared or capped machine the wait for the workers):

    - a migration batch (median of its actions, less the modelled KV bytes) -> `kv_fixed_s` when the engine moves
      KV caches (`kv`), else `migration_fixed_s` (re-prefill happens later, on the target, and is modelled apart);
    - a lend -> `lend_s`; a return -> `return_s`.

    The presets are orders of magnitude for one machine; a move's real price depends on the machine and its load
    (0.04-0.07 s per migration batch with a whole host core per device, 0.1-0.3 s at 0.125 core per device).
    Terms with no successful action last step keep their value; None when none was measured."""
    acts = [e for e in events if e.get("kind") == "action" and e.get("ok", True) and e.get("seconds") is not None]

    def med(names: tuple[str, ...], bytes_key: str | None = None) -> float | None:
        xs = [max(0.0, e["seconds"] - (e.get(bytes_key, 0) / prior.kv_bw if bytes_key else 0.0))
              for e in acts if e.get("action") in names]
        return float(np.median(xs)) if xs else None

    mig, lend, ret = med(MIGRATION_ACTIONS, "kv_bytes" if kv else None), med(LEND_ACTIONS), med(RETURN_ACTIONS)
    if mig is None and lend is None and ret is None:
        return None
    out = prior
    if mig is not None:
        out = replace(out, kv_fixed_s=mig) if kv else replace(out, migration_fixed_s=mig)
    if lend is not None:
        out = replace(out, lend_s=lend)
    if ret is not None:
        out = replace(out, return_s=ret)
    return out


def fit_actor(samples: Sequence[tuple[int, float]], tokens: float, tp: int, base: ActorCost,
              micro_batches: int = 0) -> ActorCost:
    """`ActorCost` from measured (dp, iter seconds) at a fixed `tokens` per iter (`micro_batches` of them, 0:
    unknown); the all-reduce term of `base` is subtracted first, so only the fixed and per-token terms are fitted."""
    xs = []
    for dp, secs in samples:
        ar = 2 * (dp - 1) / dp * (base.grad_bytes / tp) / base.link_bw
        xs.append((rank_share(dp, micro_batches), secs - ar))
    fixed, slope = fit_linear(xs, "actor samples")
    eff = base.tp_eff if tp > 1 else 1.0
    return replace(base, iter_fixed_s=max(fixed, 0.0), train_per_token_s=max(slope, 0.0) * tp * eff / tokens)
