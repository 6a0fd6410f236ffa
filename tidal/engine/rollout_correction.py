"""Off-policy correction: the policy gradient reweighted by how the sampler's policy differs from the ratio's.

The rollout engine samples each token under the behaviour policy and records its log-prob
(`RolloutGroup.rollout_logprobs`); the PPO ratio of the loss is taken against the proximal policy, inference's
old log-probs (`ScoredGroup.old_logprobs`, the weights the step starts from). The two differ where the sampler's
numerics differ from the trainer's (paged decode kernels, bf16 on GPUs) and, in an asynchronous run, where the
sampler held weights one or more versions older. The correction multiplies each token's clipped surrogate by a
detached importance weight ``w`` of proximal over behaviour::

    loss_t = w_t * ppo_clip(pi_theta / pi_prox, A)_t

    algorithm.rollout_is: token       w_t = min(exp(prox_t - behav_t), C)                   truncated IS (TIS),
    algorithm.rollout_is: sequence    w_t = min(exp(sum_s prox_s - behav_s), C), all t       C = rollout_is_threshold
    algorithm.use_decoupled_loss      w_t = exp(prox_t - behav_t), 0 where above behav_imp_weight_cap
                                      (decoupled PPO; no cap: every weight kept)

The keys are verl's (`algorithm.rollout_correction.rollout_is`, `rollout_is_threshold`) and AReaL's
(`actor.use_decoupled_loss`, `actor.behav_imp_weight_cap`). Invariant: every weight is a function of the sample
alone, known before the iter (both log-probs arrive with it), and a sequence never spans two micro-batches, so the
loss stays a sum of per-token terms with fixed weights and the update does not depend on the DP size or the
micro-batch split. Log-weights are bounded to +-LOG_WEIGHT_BOUND before exp: a token the sampler drew at a
probability the trainer puts near 0 (or the reverse) gives a finite weight, which the cap then acts on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

#: |log w| bound before exp (e^20 ~ 5e8: finite in fp32, far beyond any useful cap)
LOG_WEIGHT_BOUND = 20.0


@dataclass(frozen=True)
class Correction:
    """How the loss weights a token: per token or per sequence, the cap, and what the cap does (`truncate`: the
    weight becomes the cap, TIS; `mask`: the token's term becomes 0, decoupled PPO)."""

    level: Literal["token", "sequence"]
    cap: float | None
    over_cap: Literal["truncate", "mask"]

    def __post_init__(self) -> None:
        assert self.cap is None or self.cap > 0, self.cap   # the config validates the keys this comes from


def correction_for(rollout_is: Literal["token", "sequence"] | None, rollout_is_threshold: float,
                   use_decoupled_loss: bool, behav_imp_weight_cap: float | None) -> Correction | None:
    """The run's correction from its `algorithm` keys (at most one of the two modes; the config checks that);
    None: the loss has no weights."""
    if rollout_is is not None:
        return Correction(rollout_is, rollout_is_threshold, "truncate")
    if use_decoupled_loss:
        return Correction("token", behav_imp_weight_cap, "mask")
    return None


def importance_weights(prox_BT: torch.Tensor, behav_BT: torch.Tensor, mask_BT: torch.Tensor,
                       c: Correction) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weights [B, T-1] (0 off the response columns) and where the cap acted (truncated or masked).
    Rows are whole sequences (`GRPOBatch`): a sequence-level weight is its row's."""
    zero = torch.zeros((), dtype=torch.float32, device=prox_BT.device)
    logw = torch.where(mask_BT, prox_BT.float() - behav_BT.float(), zero)
    if c.level == "sequence":
        logw = torch.where(mask_BT, logw.sum(dim=1, keepdim=True).expand_as(logw), zero)
    w = torch.exp(logw.clamp(-LOG_WEIGHT_BOUND, LOG_WEIGHT_BOUND))
    if c.cap is None:
        capped = torch.zeros_like(mask_BT)
    else:
        capped = mask_BT & (w > c.cap)
        w = torch.where(capped, torch.full_like(w, c.cap) if c.over_cap == "truncate" else torch.zeros_like(w), w)
    return torch.where(mask_BT, w, zero), capped
