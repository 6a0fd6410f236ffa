"""Off-policy correction (tidal/engine/rollout_correction.py): the weights and the loss against plain hand-written
formulas on fixed tensors (fp32), the loss's independence of the micro-batch split, and the keys' refusals."""

import math

import pytest
import torch

from tidal.core.config import build_config
from tidal.core.errors import ConfigError
from tidal.engine.grpo import ScoredSample, count_response_tokens, grpo_loss, pack_samples
from tidal.engine.rollout_correction import LOG_WEIGHT_BOUND, Correction, correction_for, importance_weights

TIS_TOKEN = Correction("token", 2.0, "truncate")
TIS_SEQ = Correction("sequence", 2.0, "truncate")
DECOUPLED = Correction("token", 1.5, "mask")


def _samples() -> list[ScoredSample]:
    """Four responses of two prompts with fixed old (proximal) and behaviour log-probs: weights below 1, near 1,
    above each cap, and one log-weight beyond the bound."""
    g = torch.Generator().manual_seed(0)
    out = []
    lengths = (3, 5, 2, 4)
    for i, n in enumerate(lengths):
        old = -torch.rand(n, generator=g) * 2 - 0.1
        behav = old - (torch.rand(n, generator=g) - 0.5) * 2.0   # |old - behav| < 1
        if i == 2:
            behav = behav.clone()
            behav[0] = old[0] - 30.0                              # exp(30): beyond LOG_WEIGHT_BOUND
        out.append(ScoredSample(i // 2, i % 2, (1, 2, 3 + i), tuple(range(4, 4 + n)), [0.7, -0.4, 1.1, -0.9][i],
                                old, None, behav))
    return out


def _hand_weights(s: ScoredSample, c: Correction) -> list[float]:
    """The paper formula for one sequence, element by element in Python floats."""
    old, behav = s.old_logprobs.tolist(), s.behav_logprobs.tolist()
    if c.level == "sequence":
        logs = [sum(o - b for o, b in zip(old, behav))] * len(old)
    else:
        logs = [o - b for o, b in zip(old, behav)]
    ws = [math.exp(min(max(x, -LOG_WEIGHT_BOUND), LOG_WEIGHT_BOUND)) for x in logs]
    if c.cap is None:
        return ws
    return [w if w <= c.cap else (c.cap if c.over_cap == "truncate" else 0.0) for w in ws]


@pytest.mark.parametrize("c", [TIS_TOKEN, TIS_SEQ, DECOUPLED, Correction("token", None, "mask")],
                         ids=["tis-token", "tis-sequence", "decoupled", "decoupled-uncapped"])
def test_weights_are_the_formula(c):
    samples = _samples()
    batch = pack_samples(samples, pad_id=0, behaviour=True)
    w, capped = importance_weights(batch.old_logprobs_BT, batch.behav_logprobs_BT, batch.response_mask_BT, c)
    assert float(w[~batch.response_mask_BT].abs().sum()) == 0.0 and not capped[~batch.response_mask_BT].any()
    for row, s in enumerate(samples):
        got = w[row][batch.response_mask_BT[row]]
        torch.testing.assert_close(got, torch.tensor(_hand_weights(s, c)), rtol=1e-6, atol=0)
    assert torch.isfinite(w).all()
    assert bool(capped.any()) == (c.cap is not None)


def _hand_loss(samples, logp, c, clip=0.2):
    """sum over tokens of -w * min(r A, clip(r) A), / N; r = exp(logp - old); the iter's N tokens."""
    n = count_response_tokens(samples)
    total = 0.0
    for s, lp in zip(samples, logp):
        ws = _hand_weights(s, c) if c is not None else [1.0] * s.num_response_tokens
        for t, (x, o) in enumerate(zip(lp.tolist(), s.old_logprobs.tolist())):
            r = math.exp(x - o)
            total += -ws[t] * min(r * s.advantage, min(max(r, 1 - clip), 1 + clip) * s.advantage)
    return total / n


@pytest.mark.parametrize("c", [None, TIS_TOKEN, TIS_SEQ, DECOUPLED], ids=["none", "tis-token", "tis-seq", "decoupled"])
def test_loss_is_the_formula_and_independent_of_the_micro_batch_split(c):
    samples = _samples()
    g = torch.Generator().manual_seed(1)
    # the current policy: the old log-probs moved by up to +-0.5 (some ratios clip)
    logp = [s.old_logprobs + (torch.rand(s.num_response_tokens, generator=g) - 0.5) for s in samples]
    n = count_response_tokens(samples)

    def loss_of(part):
        batch = pack_samples([samples[i] for i in part], pad_id=0, behaviour=c is not None)
        lp = torch.zeros(batch.response_mask_BT.shape)
        for row, i in enumerate(part):
            lp[row][batch.response_mask_BT[row]] = logp[i]
        lp.requires_grad_(True)
        loss, metrics = grpo_loss(lp, batch, n, correction=c)
        loss.backward()
        grads = [lp.grad[row][batch.response_mask_BT[row]] for row in range(len(part))]
        return loss, metrics, grads

    whole, metrics, grads = loss_of([0, 1, 2, 3])
    assert float(whole.detach()) == pytest.approx(_hand_loss(samples, logp, c), rel=1e-6, abs=1e-7)
    halves = [loss_of([0, 2]), loss_of([3, 1])]   # any split, any order: the same sum and the same gradients
    assert float((halves[0][0] + halves[1][0]).detach()) == pytest.approx(float(whole), rel=1e-6, abs=1e-7)
    split_grads = {0: halves[0][2][0], 2: halves[0][2][1], 3: halves[1][2][0], 1: halves[1][2][1]}
    for i in range(4):
        torch.testing.assert_close(split_grads[i], grads[i], rtol=0, atol=0)
    if c is None:
        assert not any(k.startswith("rollout_is/") for k in metrics)
    else:
        parts = [h[1] for h in halves]
        for k in ("rollout_is/weight_mean", "rollout_is/capped_frac"):   # sum-style: shares add up
            assert parts[0][k] + parts[1][k] == pytest.approx(metrics[k], rel=1e-6)
        assert metrics["rollout_is/capped_frac"] > 0


def test_a_correction_without_behaviour_log_probs_is_refused():
    samples = _samples()
    batch = pack_samples(samples, pad_id=0)
    with pytest.raises(ValueError, match="behaviour=True"):
        grpo_loss(torch.zeros(batch.response_mask_BT.shape), batch, 14, correction=TIS_TOKEN)
    bare = [ScoredSample(s.group_id, s.sample_index, s.prompt_ids, s.response_ids, s.advantage, s.old_logprobs, None)
            for s in samples]
    with pytest.raises(ValueError, match="behav_logprobs"):
        pack_samples(bare, pad_id=0, behaviour=True)


def test_the_keys_give_the_peers_corrections():
    assert correction_for(None, 2.0, False, None) is None
    assert correction_for("token", 3.0, False, None) == Correction("token", 3.0, "truncate")
    assert correction_for("sequence", 2.0, False, None) == Correction("sequence", 2.0, "truncate")
    assert correction_for(None, 2.0, True, 5.0) == Correction("token", 5.0, "mask")
    assert correction_for(None, 2.0, True, None) == Correction("token", None, "mask")
    cfg = build_config({}, ["algorithm.rollout_is=sequence", "algorithm.rollout_is_threshold=4"])
    assert (cfg.algorithm.rollout_is, cfg.algorithm.rollout_is_threshold) == ("sequence", 4.0)


@pytest.mark.parametrize("overrides, field, fix", [
    (["algorithm.rollout_is=token", "algorithm.use_decoupled_loss=true"], "algorithm.use_decoupled_loss",
     "choose one"),
    (["algorithm.behav_imp_weight_cap=5"], "algorithm.behav_imp_weight_cap", "use_decoupled_loss: true"),
    (["algorithm.rollout_is=token", "rollout.temperature=0.7"], "algorithm.rollout_is", "temperature: 1"),
    (["algorithm.use_decoupled_loss=true", "rollout.temperature=0.7"], "algorithm.use_decoupled_loss",
     "temperature: 1"),
])
def test_bad_keys_are_refused_naming_the_field_and_the_fix(overrides, field, fix):
    with pytest.raises(ConfigError) as e:
        build_config({}, overrides)
    assert field in str(e.value) and fix in str(e.value)
