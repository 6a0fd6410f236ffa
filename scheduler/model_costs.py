"""Cost models of other model shapes, scaled from the figures measured on one H200 with the 1.5B shape.

What is measured (`gpu_h200()`, refitted from result files by `scheduler/costs_h200.py`) is one model shape on
one GPU. Each figure is scaled by the quantity that sets it, so a 7B or 32B model costs what the same kernels
would cost at its size:

    decode step (fixed)      weights read once per step: measured read time x params / (rollout TP), plus the
                             measured launch and sampling overhead x layers
    decode per sequence      measured per-sequence compute x params / TP, plus the measured per-sequence-token
                             KV read x (KV bytes per token ratio) x the workload's mean context / TP
    prefill, scoring, train  per token: measured x params (compute-bound, the same achieved rate)
    reshard, sync, hand-over bytes: parameters 2 B, optimizer state 12 B per parameter, over the same links
    KV migration             the shape's KV bytes per token

TP groups pay no extra overhead in this model; the simulator already charges TP efficiency (`tp_eff`) on the
actor and on scoring. `ModelShape.min_actor_devices` is the memory floor of the actor's state (16 B per parameter
with ZeRO-1 over data parallel ranks, 75% of an 80 GB device for it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from scheduler.costs import ActorCost, CostModel, DecodeCost, InferenceCost, ReshardCost, gpu_h200
from tidal.core.errors import TidalError

#: the measured shape (Qwen2.5-1.5B) and the decomposition of its decode fit (`scheduler/costs_h200.py`)
BASE_PARAMS = 1.54e9
BASE_LAYERS = 28
BASE_KV_BYTES_PER_TOKEN = 28 * 2 * 2 * 128 * 2
DECODE_WEIGHT_READ_S = 0.74e-3      #: 3.1 GB of weights at the measured 4.15 TB/s copy rate
DECODE_OVERHEAD_S = 2.09e-3 - DECODE_WEIGHT_READ_S   #: launch, sampling, scheduling per step (28 layers)
DECODE_PER_SEQ_S = 6.11e-6          #: per sequence per step at context 0
DECODE_PER_SEQ_TOKEN_S = 7.29e-9    #: per sequence per step per token of context (KV read)
DEVICE_BYTES = 80e9
STATE_FRACTION = 0.75               #: of a device's memory the actor's state may take (activations: the rest)


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    actor_tp: int
    rollout_tp: int
    inference_tp: int
    slots: int            #: sequences one rollout instance runs at once (KV memory at long contexts)

    @property
    def kv_bytes_per_token(self) -> float:
        return self.layers * 2 * self.kv_heads * self.head_dim * 2

    @property
    def min_actor_devices(self) -> int:
        """Fewest devices that hold the actor's state (params + grads over TP, optimizer over TP x DP)."""
        budget = DEVICE_BYTES * STATE_FRACTION
        per_tp = 4 * self.params / self.actor_tp           # bf16 params + grads on each TP rank
        if per_tp >= budget:
            raise TidalError("model", self.name, "does not fit its actor TP", "raise actor_tp")
        dp = math.ceil(12 * self.params / self.actor_tp / (budget - per_tp))
        return self.actor_tp * max(1, dp)


#: Qwen2.5 shapes (params, layers, KV heads x 128); TP per role as their recipes run them on 80 GB devices
SHAPES = {
    "1.5b": ModelShape("1.5b", 1.54e9, 28, 2, 128, actor_tp=1, rollout_tp=1, inference_tp=1, slots=512),
    "7b": ModelShape("7b", 7.6e9, 28, 4, 128, actor_tp=2, rollout_tp=1, inference_tp=1, slots=256),
    "32b": ModelShape("32b", 32.8e9, 64, 8, 128, actor_tp=4, rollout_tp=2, inference_tp=2, slots=128),
}


def shape(name: str) -> ModelShape:
    if name not in SHAPES:
        raise TidalError("model", name, "unknown model shape", f"use one of {sorted(SHAPES)}")
    return SHAPES[name]


def costs_for(m: ModelShape, mean_context: float, base: CostModel | None = None) -> CostModel:
    """`base` (default `gpu_h200()`, the 1.5B shape measured) scaled to shape `m` (module doc)."""
    b = base or gpu_h200()
    r = m.params / BASE_PARAMS
    kv = m.kv_bytes_per_token / BASE_KV_BYTES_PER_TOKEN
    rt = m.rollout_tp
    decode = DecodeCost(
        step_s=(DECODE_WEIGHT_READ_S * r / rt + DECODE_OVERHEAD_S * m.layers / BASE_LAYERS),
        per_seq_s=(DECODE_PER_SEQ_S * r + DECODE_PER_SEQ_TOKEN_S * kv * mean_context) / rt,
        prefill_per_token_s=b.decode.prefill_per_token_s * r / rt)
    state = 14 * m.params
    lend_extra = b.lend_s - 14 * BASE_PARAMS / b.offload_bw     # instance start / stop beyond the state's copy
    return_extra = b.return_s - 14 * BASE_PARAMS / b.onload_bw
    return replace(
        b, name=f"{b.name}-{m.name}", decode=decode,
        inference=InferenceCost(b.inference.per_token_s * r, b.inference.tp_eff, b.inference.per_group_s),
        actor=ActorCost(b.actor.train_per_token_s * r, b.actor.iter_fixed_s, 2 * m.params, b.actor.link_bw,
                        b.actor.tp_eff),
        reshard=ReshardCost(2 * m.params, 12 * m.params, b.reshard.bw, b.reshard.inter_node_bw,
                            b.reshard.devices_per_node, b.reshard.fixed_s),
        lend_s=lend_extra + state / m.actor_tp / b.offload_bw,
        return_s=return_extra + state / m.actor_tp / b.onload_bw,
        sync_fixed_s=b.sync_fixed_s, kv_bytes_per_token=m.kv_bytes_per_token)
