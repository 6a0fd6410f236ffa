"""GRPO as pure torch functions: group advantages, packing, iter splitting, the clipped loss.

The objective (DeepSeekMath, Shao et al. 2024, eq. 3), for a group of G responses o_i to one prompt:

    ratio_it = pi(o_it | q, o_i<t) / pi_old(o_it | q, o_i<t)
    A_i      = (r_i - mean(r)) / (std(r) + eps)                           (same for every token of o_i)
    L        = 1/N * sum_i sum_t [ -min(ratio_it A_i, clip(ratio_it, 1 - eps_lo, 1 + eps_hi) A_i)
                                   + beta * k3_it ]
    k3_it    = pi_ref/pi - log(pi_ref/pi) - 1                             (per token, >= 0)

where N is the number of response tokens in the whole iter (one optimizer step's batch).

Where this deviates from the paper, and why:
- Token-level normalization (DAPO, Yu et al. 2025): the paper averages over each response's tokens,
  then over the group (`1/G sum_i 1/|o_i| sum_t`). We divide the sum over every response token of the
  iter by N. Long and short responses weigh per token, and above all the loss of a micro-batch is a plain
  SUM of per-token terms divided by a constant known in advance (`num_tokens_in_iter`): the gradients of
  any partition of the iter into micro-batches and data-parallel ranks add up to the one-batch gradient
  exactly (up to fp32 summation order). That is what lets DP be any size (DESIGN contract 3).
- Std: the population std (ddof=0) of the group's rewards, plus eps=1e-6 outside the sqrt. TRL uses the
  sample std (ddof=1): for a fixed group size the two differ by the constant sqrt((G-1)/G), which Adam
  absorbs; ddof=0 also keeps G=1 defined. `scale_by_std=False` gives Dr. GRPO's unscaled `r - mean`.
- All-equal group (every response right, or every one wrong): the advantages are exactly 0 (set
  explicitly, not left to `0 / (0 + eps)` round-off). Such a group adds no policy gradient, but its tokens
  still count in N and still feel the KL term; `grpo/zero_adv_group_frac` reports how much of a step is
  like that.
- Old policy: `pi_old` is the log-prob that inference computed with the weights the rollout sampled with
  (ScoredGroup.old_logprobs), not the sampler's own log-probs, so the ratio is 1 (up to layout round-off)
  in the step's first iter whatever the sampler's numerics and temperature (as in verl and RLinf).
- KL: Schulman's k3 estimator of KL(pi || pi_ref), in the loss (as the paper does), evaluated at the
  sampled tokens; `kl_coef=0` skips it and needs no reference log-probs.
- Clip: `clip_eps_high` (DAPO's "clip-higher") may widen the upper bound; by default it equals clip_eps.
- Off-policy correction (`correction`, tidal/engine/rollout_correction.py): each token's clipped term times a
  detached weight pi_old / pi_behaviour from the sampler's own log-probs (`behav_logprobs_BT`), truncated (TIS)
  or masked above a cap (decoupled PPO); off by default.

Layout of a packed batch (`pack_samples`), B sequences right-padded to T:

    input_ids_BT     <bos> 1 2 3 + 4 5 6 = | 9 7 5 <eos> | <pad> ...
    column j of every [B, T-1] tensor is the TARGET token input_ids[:, j+1], so they line up with
    `model.token_logprobs(input_ids_BT)` = log p(input_ids[:, j+1] | input_ids[:, :j+1]):
    response_mask_BT 0 ... 0 0 0 0 0 0 0 0 |  1 1 1  1    |  0 ...
    advantages_BT, old_logprobs_BT, ref_logprobs_BT: the sample's value where the mask is 1, 0 elsewhere.

Micro-batch loop of one iter (what the actor does):

    iters = split_iters(step_groups, n_minibatches)          # n lists of ScoredSample, equal sizes
    n_tok = count_response_tokens(iters[k])                  # known before any forward
    for mb in micro_batches(iters[k]):                       # any split, on any DP rank
        batch = pack_samples(mb, pad_id)
        loss, metrics = grpo_loss(model.token_logprobs(batch.input_ids_BT), batch, n_tok, clip_eps=0.2)
        loss.backward()                                       # gradients accumulate to the iter's
    all-reduce SUM the gradients over DP ranks; optimizer.step()

Metrics are floats with slash keys. The ones from `grpo_loss` are token sums divided by
`num_tokens_in_iter`, so summing them over micro-batches and ranks gives the iter's value.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from tidal.core.errors import TidalError
from tidal.engine.records import RolloutGroup, ScoredGroup
from tidal.engine.rollout_correction import Correction, importance_weights
from tidal.engine.shapes import micro_batches, padded_len

ADV_EPS = 1e-6


# ---- advantages -----------------------------------------------------------------------------------
def group_advantages(rewards_BG: torch.Tensor, eps: float = ADV_EPS, scale_by_std: bool = True) -> torch.Tensor:
    """Group-normalized advantages: one row per group (prompt), one column per response.

    `(r - mean(r)) / (std(r) + eps)` per row with the population std; rows whose rewards are all equal
    give exactly 0. Computed in float64, returned in the input's dtype. Example: rewards [1, 0, 0, 0]
    -> mean 0.25, std sqrt(0.1875) = 0.4330 -> [1.7320, -0.5773, -0.5773, -0.5773].
    """
    if rewards_BG.dim() != 2 or rewards_BG.shape[1] < 1:
        raise ValueError(f"rewards must be [groups, group_size], got shape {tuple(rewards_BG.shape)}")
    r = rewards_BG.to(torch.float64)
    centered = r - r.mean(dim=1, keepdim=True)
    adv = centered / (r.std(dim=1, correction=0, keepdim=True) + eps) if scale_by_std else centered
    all_equal = (r.max(dim=1, keepdim=True).values == r.min(dim=1, keepdim=True).values)
    adv = torch.where(all_equal, torch.zeros_like(adv), adv)
    return adv.to(rewards_BG.dtype if rewards_BG.is_floating_point() else torch.float32)


@dataclass(frozen=True, eq=False)
class ScoredSample:
    """One response of a ScoredGroup with its group-normalized advantage: the unit iters are cut into."""

    group_id: int
    sample_index: int
    """Position in its group (0..G-1)."""
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    advantage: float
    old_logprobs: torch.Tensor
    """[len(response_ids)] fp32."""
    ref_logprobs: torch.Tensor | None
    """[len(response_ids)] fp32, or None without a reference model."""
    behav_logprobs: torch.Tensor | None = None
    """[len(response_ids)]: the sampler's own log-probs (`RolloutGroup.rollout_logprobs`), the behaviour policy
    of an off-policy correction."""

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_ids)


def _ordered(groups: Iterable[ScoredGroup]) -> list[ScoredGroup]:
    """Groups in (step, group_id) order, whatever order the stream delivered them in."""
    groups = sorted(groups, key=lambda g: (g.step, g.group_id))
    for a, b in itertools.pairwise(groups):
        if (a.step, a.group_id) == (b.step, b.group_id):
            raise ValueError(f"group {a.group_id} of step {a.step} appears twice")
    return groups


def flatten_groups(groups: Iterable[ScoredGroup], eps: float = ADV_EPS,
                   scale_by_std: bool = True) -> list[ScoredSample]:
    """Samples with advantages, groups in (step, group_id) order, samples in group order.

    Advantages need whole groups, so they are computed here, before any split into iters."""
    out = []
    for g in _ordered(groups):
        adv = group_advantages(torch.tensor([g.rewards], dtype=torch.float64), eps, scale_by_std)[0]
        for i, resp in enumerate(g.response_ids):
            out.append(ScoredSample(g.group_id, i, g.prompt_ids, resp, float(adv[i]), g.old_logprobs[i],
                                    None if g.ref_logprobs is None else g.ref_logprobs[i], g.rollout_logprobs[i]))
    return out


def split_iters(groups: Iterable[ScoredGroup], n_minibatches: int, eps: float = ADV_EPS,
                scale_by_std: bool = True) -> list[list[ScoredSample]]:
    """The RL step's sequences cut into `n_minibatches` iters of equal size (one optimizer step each).

    Order is deterministic whatever the arrival order: groups by (step, group_id), samples in group order,
    then contiguous chunks. Iter k therefore needs only the groups covering sequences
    [k*S/n, (k+1)*S/n), so a streaming actor can start it as soon as those groups arrived. A group may
    straddle two iters: its advantages were already computed from the whole group.
    """
    samples = flatten_groups(groups, eps, scale_by_std)
    if n_minibatches < 1 or len(samples) % n_minibatches:
        raise TidalError("algorithm.n_minibatches", n_minibatches,
                         f"does not divide the step's {len(samples)} sequences into equal iters",
                         "use a divisor of rollout_batch_size x group_size")
    size = len(samples) // n_minibatches
    return [samples[k * size:(k + 1) * size] for k in range(n_minibatches)]


def count_response_tokens(samples: Iterable[ScoredSample]) -> int:
    """N of the loss: response tokens of an iter (compute it before splitting into micro-batches)."""
    return sum(s.num_response_tokens for s in samples)


# ---- packing --------------------------------------------------------------------------------------
def pack_sequences(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int,
                   seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids_BT long, response_mask_BT bool [B, T-1], target-aligned), right-padded to the longest
    sequence or to `seq_len`. Used by inference (old log-probs) and by `pack_samples` (the loss)."""
    if len(prompts) != len(responses) or not prompts:
        raise ValueError(f"need as many prompts as responses, at least one (got {len(prompts)}, {len(responses)})")
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    width = max(lengths) if seq_len is None else seq_len
    if width < max(lengths):
        raise ValueError(f"seq_len {seq_len} is shorter than the longest sequence ({max(lengths)} tokens)")
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width - 1), dtype=torch.bool)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        if not p:
            raise ValueError(f"sequence {b} has an empty prompt (it needs at least <bos>)")
        ids[b, :len(p) + len(r)] = torch.tensor(list(p) + list(r), dtype=torch.long)
        mask[b, len(p) - 1:len(p) + len(r) - 1] = True
    return ids, mask


def group_width(group: RolloutGroup, cap: int | None = None) -> int:
    """The padded width a group is scored at: its longest prompt + response, bucketed (`shapes.padded_len`)."""
    return padded_len(len(group.prompt_ids) + max(len(r) for r in group.response_ids), cap)


def iter_micro_batches(samples: Sequence[ScoredSample], *, max_tokens: int | None, max_rows: int,
                       cap: int | None = None) -> list[tuple[list[int], int]]:
    """An iter's micro-batches: (indices into `samples`, padded width), a function of the lengths alone
    (`shapes.micro_batches`)."""
    return micro_batches([len(s.prompt_ids) + len(s.response_ids) for s in samples], max_tokens=max_tokens,
                         max_rows=max_rows, cap=cap)


def unpack_response_logprobs(logprobs_BT: torch.Tensor, response_mask_BT: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-sequence 1-D response log-probs from target-aligned [B, T-1] log-probs (detached, fp32, CPU)."""
    if logprobs_BT.shape != response_mask_BT.shape:
        raise ValueError(f"log-probs {tuple(logprobs_BT.shape)} do not match the mask {tuple(response_mask_BT.shape)}")
    lp = logprobs_BT.detach().float().cpu()
    mask = response_mask_BT.cpu()
    return tuple(lp[b][mask[b]].clone() for b in range(lp.shape[0]))


@dataclass(frozen=True, eq=False)
class GRPOBatch:
    """Padded tensors of one micro-batch. [B, T-1] tensors are target-aligned (see module doc)."""

    input_ids_BT: torch.Tensor
    """[B, T] long: <bos> prompt response, right-padded with pad_id."""
    response_mask_BT: torch.Tensor
    """[B, T-1] bool: column j is a response token (input_ids[:, j+1])."""
    advantages_BT: torch.Tensor
    """[B, T-1] fp32: the sequence's advantage on its response columns, 0 elsewhere."""
    old_logprobs_BT: torch.Tensor
    """[B, T-1] fp32: inference's log-probs on response columns, 0 elsewhere."""
    ref_logprobs_BT: torch.Tensor | None
    """[B, T-1] fp32 like old_logprobs under the reference model, or None."""
    behav_logprobs_BT: torch.Tensor | None = None
    """[B, T-1] fp32 like old_logprobs, the sampler's own (packed for an off-policy correction), or None."""

    @property
    def num_tokens(self) -> int:
        """Response tokens in this micro-batch."""
        return int(self.response_mask_BT.sum())

    def to(self, device: torch.device | str) -> GRPOBatch:
        """This batch on `device` (the actor's), copied once per iter rather than per use."""
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)
        ref, behav = self.ref_logprobs_BT, self.behav_logprobs_BT
        return GRPOBatch(move(self.input_ids_BT), move(self.response_mask_BT), move(self.advantages_BT),
                         move(self.old_logprobs_BT), None if ref is None else move(ref),
                         None if behav is None else move(behav))


def _scatter(mask_BT: torch.Tensor, values: Sequence[torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(mask_BT.shape, dtype=torch.float32)
    out[mask_BT] = torch.cat([v.float().reshape(-1) for v in values])  # mask is row-major, like cat
    return out


def pack_samples(samples: Sequence[ScoredSample], pad_id: int, seq_len: int | None = None,
                 behaviour: bool = False) -> GRPOBatch:
    """A micro-batch from samples (any subset of an iter); `behaviour`: with the sampler's log-probs (an
    off-policy correction needs them)."""
    ids, mask = pack_sequences([s.prompt_ids for s in samples], [s.response_ids for s in samples], pad_id, seq_len)
    has_ref = {s.ref_logprobs is not None for s in samples}
    if len(has_ref) > 1:
        raise ValueError("some samples have reference log-probs and some do not; score them all alike")
    adv = _scatter(mask, [torch.full((s.num_response_tokens,), s.advantage) for s in samples])
    old = _scatter(mask, [s.old_logprobs for s in samples])
    ref = _scatter(mask, [cast(torch.Tensor, s.ref_logprobs) for s in samples]) if has_ref == {True} else None
    behav = None
    if behaviour:
        if any(s.behav_logprobs is None for s in samples):
            raise ValueError("an off-policy correction needs every sample's behaviour log-probs (ScoredSample."
                             "behav_logprobs, from the group's rollout_logprobs)")
        behav = _scatter(mask, [cast(torch.Tensor, s.behav_logprobs) for s in samples])
    return GRPOBatch(ids, mask, adv, old, ref, behav)


def build_batch(groups: Iterable[ScoredGroup], pad_id: int, eps: float = ADV_EPS,
                seq_len: int | None = None) -> GRPOBatch:
    """Whole ScoredGroups packed into one batch (advantages per group), in (step, group_id) order."""
    return pack_samples(flatten_groups(groups, eps), pad_id, seq_len)


# ---- loss -----------------------------------------------------------------------------------------
def ppo_clip_loss(logratio: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                  clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token `-min(ratio A, clip(ratio, 1-clip_low, 1+clip_high) A)` and where the clipped term is
    strictly smaller (the token's gradient is then 0: ratio > 1+clip_high with A > 0, or ratio <
    1-clip_low with A < 0)."""
    ratio = torch.exp(logratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 per token: `exp(ref - logp) - (ref - logp) - 1`, an unbiased, non-negative estimate of
    KL(pi || pi_ref) at tokens sampled from pi (the GRPO paper's eq. 4). Exactly 0 where ref == logp."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


def grpo_loss(logprobs_BT: torch.Tensor, batch: GRPOBatch, num_tokens_in_iter: int, *, clip_eps: float = 0.2,
              clip_eps_high: float | None = None, kl_coef: float = 0.0,
              correction: Correction | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The SUM-style loss of a micro-batch: per-token terms summed over its response tokens, divided by
    the response tokens of the whole iter. Summing this over the iter's micro-batches (and DP ranks) gives
    the iter's loss and gradients exactly.

    logprobs_BT: [B, T-1] log-probs of the current policy, target-aligned (`model.token_logprobs`); only
    response columns are read (others may hold anything finite or not).
    """
    if logprobs_BT.shape != batch.response_mask_BT.shape:
        raise ValueError(f"policy log-probs {tuple(logprobs_BT.shape)} are not target-aligned with the batch "
                         f"{tuple(batch.response_mask_BT.shape)} (use model.token_logprobs(input_ids_BT))")
    n_mb = batch.num_tokens
    if num_tokens_in_iter < max(n_mb, 1):
        raise ValueError(f"num_tokens_in_iter={num_tokens_in_iter} is less than this micro-batch's {n_mb} "
                         "response tokens; pass count_response_tokens(iter samples)")
    if kl_coef > 0 and batch.ref_logprobs_BT is None:
        raise ValueError("kl_coef > 0 needs reference log-probs in the batch (ScoredGroup.ref_logprobs)")
    if correction is not None and batch.behav_logprobs_BT is None:
        raise ValueError("an off-policy correction needs the sampler's log-probs in the batch "
                         "(pack_samples(..., behaviour=True))")
    mask = batch.response_mask_BT
    lp = logprobs_BT.float()
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    # torch.where, not multiplication: padding columns may hold -inf/nan and 0 * nan is nan.
    logratio = torch.where(mask, lp - batch.old_logprobs_BT.to(lp.device), zero)
    pg_tok, clipped = ppo_clip_loss(logratio, batch.advantages_BT.to(lp.device), clip_eps,
                                    clip_eps if clip_eps_high is None else clip_eps_high)
    weights = capped = None
    if correction is not None:
        weights, capped = importance_weights(batch.old_logprobs_BT.to(lp.device),
                                             cast(torch.Tensor, batch.behav_logprobs_BT).to(lp.device), mask,
                                             correction)
        pg_tok = pg_tok * weights
    per_tok = pg_tok
    inv_n = 1.0 / num_tokens_in_iter

    def tok_sum(x: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, x, zero).sum() * inv_n

    with torch.no_grad():
        metrics = {
            "grpo/pg_loss": float(tok_sum(pg_tok)),
            "grpo/clip_frac": float(tok_sum((clipped & mask).float())),
            "grpo/ratio_mean": float(tok_sum(torch.exp(logratio))),
            # k3 of KL(pi || pi_old): how far this iter's updates have moved the policy off the sampler.
            "grpo/kl_old": float(tok_sum(kl_k3(logratio, torch.zeros_like(logratio)))),
            "grpo/tokens": float(n_mb),
        }
        if weights is not None and capped is not None:   # sum-style shares of the iter's token means
            metrics["rollout_is/weight_mean"] = float(tok_sum(weights))
            metrics["rollout_is/capped_frac"] = float(tok_sum(capped.float()))
    if batch.ref_logprobs_BT is not None:
        ref = torch.where(mask, batch.ref_logprobs_BT.to(lp.device), zero)
        kl_tok = kl_k3(torch.where(mask, lp, zero), ref)
        metrics["grpo/kl"] = float(tok_sum(kl_tok.detach()))
        if kl_coef > 0:
            per_tok = per_tok + kl_coef * kl_tok
    loss = tok_sum(per_tok)
    metrics["grpo/loss"] = float(loss.detach())
    return loss, metrics


# ---- step-level metrics ---------------------------------------------------------------------------
def step_metrics(groups: Sequence[ScoredGroup], eps: float = ADV_EPS) -> dict[str, float]:
    """Means over the step's groups (not summable; compute once per step on the whole step)."""
    if not groups:
        return {}
    rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float64)
    advs = torch.tensor([s.advantage for s in flatten_groups(groups, eps)], dtype=torch.float64)
    lengths = torch.tensor([len(r) for g in groups for r in g.response_ids], dtype=torch.float64)
    reasons = [f for g in groups for f in g.finish_reasons]
    drift = torch.cat([(ro - old).abs() for g in groups for ro, old in zip(g.rollout_logprobs, g.old_logprobs)])
    # version lag: how many updates older than the step's own weights each token's (each sample's oldest) were
    token_lags = [g.step - v for g in groups for i in range(g.group_size) for v in g.token_versions(i)]
    sample_lags = [g.step - min(g.token_versions(i), default=g.policy_version) for g in groups
                   for i in range(g.group_size)]
    lag_hist = {f"grpo/samples_at_lag_{j}": float(sample_lags.count(j)) for j in sorted(set(sample_lags))}
    return {
        **lag_hist,
        "grpo/version_lag_tokens_mean": sum(token_lags) / max(1, len(token_lags)),
        "grpo/version_lag_max": float(max(sample_lags, default=0)),
        "grpo/reward_mean": float(rewards.mean()),
        "grpo/reward_std": float(rewards.std(correction=0)),
        "grpo/adv_std": float(advs.std(correction=0)),
        "grpo/zero_adv_group_frac": sum(len(set(g.rewards)) == 1 for g in groups) / len(groups),
        "grpo/response_tokens_mean": float(lengths.mean()),
        "grpo/truncated_frac": reasons.count("length") / len(reasons),
        # Sampler vs inference numerics (and temperature when != 1): large values mean a skewed ratio.
        "grpo/rollout_vs_old_logprob_absdiff": float(drift.mean()) if drift.numel() else 0.0,
        "grpo/policy_lag_steps_mean": sum(g.step - g.policy_version for g in groups) / len(groups),
    }
