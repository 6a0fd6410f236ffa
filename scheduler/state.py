"""The scheduler's state: what a policy knows besides the signals, derived once from the run config.

`PolicyParams.from_config(cfg)` is the only place the scheduler reads the config, so a flag the user omits
means the same here as for the workers: both read `cfg.cluster.use_pre_process_policy` (and its one default
in `tidal/core/config.py`). RLinf defaults the flag to True in its scheduler and False in its workers; there is no
second default here to drift.

Valid actor sizes::

    rlinf: dp <= devices / tp  and  (rollout_batch_size * group_size / n_minibatches) % (dp * group_size) == 0
    tidal: dp <= devices / tp  and  dp <= sequences per iter   (DP ranks pull micro-batches from one queue)

Example, RLinf's 8-device example (TP 2, 512 prompts x 16, 4 iters): rlinf sizes (2, 4, 8); tidal (2, 4, 6, 8).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from scheduler.costs import CostModel, gpu_h200_1p5b
from scheduler.signals import ActorLayout
from tidal.core.config import TidalConfig


@dataclass(frozen=True)
class PolicyParams:
    num_devices: int
    actor_devices: tuple[int, ...]       #: initial (and end-of-step) actor devices
    rollout_devices: tuple[int, ...]     #: initial rollout devices
    inference_devices: tuple[int, ...]
    actor_tp: int
    rollout_tp: int
    inference_tp: int
    rollout_batch_size: int              #: prompts (groups) per step
    group_size: int
    n_minibatches: int                   #: actor iters per step
    max_running_requests: int            #: sequences one rollout instance runs at once
    use_pre_process_policy: bool
    use_wait_before_last_iter_policy: bool
    pre_process_threshold: float
    pre_process_check_s: float = 1.0     #: RLinf polls the pre-process condition every second
    kv_migration: bool = True            #: rollout engine can move a sequence's KV cache (native engine; vLLM
                                         #: cannot: tidal then migrates by re-prefill, like RLinf)
    micro_batch_size: int = 0            #: sequences per actor micro-batch (0: unknown, an iter splits evenly)
    margin_s: float = 0.0                #: tidal: a move must beat doing nothing by this much on top of its cost
    margin_frac: float = 0.01            #: tidal: ... plus this fraction of the predicted time it improves on
    grow_on_return: bool = True          #: tidal: may release instances when lent devices return (step start)
    lend_actor: bool = True              #: tidal: the waiting actor's devices may host rollout instances
    return_on_generated: bool = True     #: tidal: lent devices return when the mini-batch is generated
    min_actor_devices: int = 0           #: fewest devices that hold the actor's state (0: its TP); lending them
                                         #: all (state to host) stays allowed, keeping fewer than this does not

    @classmethod
    def from_config(cls, cfg: TidalConfig) -> PolicyParams:
        p = cfg.placement
        return cls(
            num_devices=cfg.cluster.num_devices, actor_devices=p.actor, rollout_devices=p.rollout,
            inference_devices=p.inference, actor_tp=cfg.actor.tensor_parallel_size,
            rollout_tp=cfg.rollout.tensor_parallel_size, inference_tp=cfg.inference.tensor_parallel_size,
            rollout_batch_size=cfg.data.rollout_batch_size, group_size=cfg.algorithm.group_size,
            n_minibatches=cfg.algorithm.n_minibatches, max_running_requests=cfg.rollout.max_running_requests,
            use_pre_process_policy=cfg.cluster.use_pre_process_policy,
            use_wait_before_last_iter_policy=cfg.cluster.use_wait_before_last_iter_policy,
            pre_process_threshold=cfg.scheduler.pre_process_threshold,
            kv_migration=cfg.rollout.backend == "native", micro_batch_size=cfg.actor.micro_batch_size,
            margin_s=cfg.scheduler.margin_s, margin_frac=cfg.scheduler.margin_frac,
            grow_on_return=cfg.scheduler.grow_on_return, lend_actor=cfg.scheduler.lend_actor,
            return_on_generated=cfg.scheduler.return_on_generated)

    @property
    def groups_per_iter(self) -> int:
        return self.rollout_batch_size // self.n_minibatches

    @property
    def sequences_per_iter(self) -> int:
        return self.rollout_batch_size * self.group_size // self.n_minibatches

    @property
    def micro_batches(self) -> int:
        """Micro-batches per actor iter (0: unknown). A DP rank trains whole ones, so dp past this gains nothing."""
        return -(-self.sequences_per_iter // self.micro_batch_size) if self.micro_batch_size > 0 else 0

    @property
    def initial_layout(self) -> ActorLayout:
        return ActorLayout(self.actor_tp, len(self.actor_devices) // self.actor_tp, self.actor_devices)

    def rlinf_sizes(self) -> tuple[int, ...]:
        """Actor device counts RLinf accepts (whole groups per DP rank, fixed global batch)."""
        per_iter = self.sequences_per_iter
        return tuple(dp * self.actor_tp for dp in range(1, self.num_devices // self.actor_tp + 1)
                     if per_iter % (dp * self.group_size) == 0)

    def tidal_sizes(self) -> tuple[int, ...]:
        """Actor device counts Tidal accepts: any dp that fits and gets at least one sequence."""
        top = min(self.num_devices // self.actor_tp, self.sequences_per_iter)
        return tuple(dp * self.actor_tp for dp in range(1, top + 1) if dp * self.actor_tp >= self.min_actor_devices)


@dataclass(frozen=True)
class SchedState:
    """A policy's whole non-signal input: the run's parameters and the cost model it predicts with."""

    params: PolicyParams
    costs: CostModel = field(default_factory=gpu_h200_1p5b)
    mean_response_tokens: float = 0.0    #: from the length model; 0 = unknown
    prompt_tokens: float = 0.0           #: mean prompt length
    #: learned from the previous step by the producer (empty = unknown: equal shares, linear readiness):
    iter_shares: tuple[float, ...] = ()  #: fraction of the step's tokens each actor iter trained (later
                                         #: mini-batches hold the longer responses)
    ready_curve: tuple[float, ...] = ()  #: fraction of rollout time by which k/16 of the groups were generated,
                                         #: k = 0..16 (groups finish front-loaded; the tail sets the end)
    actor_time_factor: float = 1.0       #: measured / modelled actor iter time, learned by the producer (the
                                         #: layout scaling stays the model's; a busy machine slows every iter)
    rollout_time_factor: float = 1.0     #: measured / modelled remaining rollout time, learned by the producer
                                         #: (sequences start in waves, the slowest stragglers: the model's
                                         #: max(tail, tokens / slots) undercounts both; 1 = trust the model)

    def decode_seconds(self, tokens, tail):
        """Seconds one instance needs for `tokens` left whose longest sequence has `tail` left (scalars or arrays):
        every decode step costs `step_s + per_seq_s * b` and yields b tokens, so `steps * step_s + tokens *
        per_seq_s`, times the learned `rollout_time_factor`, with

            steps = max(tail, tokens / slots + min(tail, tokens / slots))

        Full slots turn out tokens / slots steps, then the last wave drains: sequences admitted as the queue
        empties still need most of their length, up to the longest one (`tail`). Without the drain term (plain
        max(tail, tokens / slots)) giving up an instance looked free whenever the tail dominated, and the policy
        released instances it needed: in the simulator on the CPU e2e workload 19.7 s/step vs 17.6 s with it.
        """
        d = self.costs.decode
        thr = tokens / self.params.max_running_requests
        steps = np.maximum(tail, thr + np.minimum(tail, thr))
        return (d.step_s * steps + d.per_seq_s * tokens) * self.rollout_time_factor

    def iter_share(self, j: int) -> float:
        n = self.params.n_minibatches
        return self.iter_shares[j] if len(self.iter_shares) == n else 1.0 / n

    def time_fraction(self, q: float) -> float:
        """Fraction of the rollout's time by which a fraction q of its groups is generated."""
        c = self.ready_curve
        if len(c) < 2:
            return min(max(q, 0.0), 1.0)
        x = min(max(q, 0.0), 1.0) * (len(c) - 1)
        k = min(int(x), len(c) - 2)
        return c[k] + (x - k) * (c[k + 1] - c[k])
