"""GRPO math and the group records: hand-computed advantages, clipping, KL, micro-batch additivity."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.core.errors import TidalError
from tidal.engine.grpo import (
    build_batch,
    count_response_tokens,
    flatten_groups,
    group_advantages,
    grpo_loss,
    kl_k3,
    pack_samples,
    pack_sequences,
    ppo_clip_loss,
    split_iters,
    step_metrics,
    unpack_response_logprobs,
)
from tidal.engine.records import PromptGroup, RecordError, RolloutGroup, ScoredGroup

V, PAD, BOS, EOS = 19, 0, 1, 2


class PrefixPolicy(torch.nn.Module):
    """A tiny causal policy (bigram table + running sum of embeddings): log-probs depend on the whole
    prefix, never on what follows, like any decoder. Model-agnostic stand-in for tidal/engine/model.py."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(V, V, generator=g) * 0.5)
        self.emb = torch.nn.Parameter(torch.randn(V, V, generator=g) * 0.2)

    def token_logprobs(self, ids_BT: torch.Tensor) -> torch.Tensor:
        ctx = ids_BT[:, :-1]
        logits = self.table[ctx] + torch.cumsum(self.emb[ctx], dim=1)
        return torch.log_softmax(logits, -1).gather(-1, ids_BT[:, 1:, None]).squeeze(-1)


def _lp(n: int, g: torch.Generator) -> torch.Tensor:
    return (-torch.rand(n, generator=g) * 3).float()


def make_groups(num_groups=4, group_size=4, seed=0, ref=True, step=0) -> list[ScoredGroup]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for gid in range(num_groups):
        prompt = (BOS,) + tuple(int(x) for x in torch.randint(3, V, (int(torch.randint(3, 8, (1,), generator=g)),),
                                                             generator=g))
        resps, rewards = [], []
        for _ in range(group_size):
            n = int(torch.randint(1, 6, (1,), generator=g))
            resps.append(tuple(int(x) for x in torch.randint(3, V, (n,), generator=g)) + (EOS,))
            rewards.append(float(torch.randint(0, 2, (1,), generator=g)))
        lens = [len(r) for r in resps]
        rg = RolloutGroup(gid, step, prompt, tuple(resps), tuple(_lp(n, g) for n in lens), tuple(rewards),
                          step, ("eos",) * group_size)
        out.append(rg.scored(tuple(_lp(n, g) for n in lens), step,
                             tuple(_lp(n, g) for n in lens) if ref else None))
    return out


def realistic_old_logprobs(groups, policy, noise=0.3, seed=1):
    """Old (and ref) log-probs near the policy's, so ratios straddle the clip range."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for grp in groups:
        ids, mask = pack_sequences([grp.prompt_ids] * grp.group_size, grp.response_ids, PAD)
        with torch.no_grad():
            cur = unpack_response_logprobs(policy.token_logprobs(ids), mask)
        old = tuple(c + noise * torch.randn(c.shape, generator=g) for c in cur)
        ref = tuple(c + noise * torch.randn(c.shape, generator=g) for c in cur)
        out.append(ScoredGroup(grp.group_id, grp.step, grp.prompt_ids, grp.response_ids, grp.rollout_logprobs,
                               grp.rewards, grp.policy_version, grp.finish_reasons, old_logprobs=old,
                               inference_version=grp.inference_version, ref_logprobs=ref))
    return out


# ---- advantages -----------------------------------------------------------------------------------
def test_group_advantages_by_hand():
    adv = group_advantages(torch.tensor([[1.0, 0, 0, 0], [1, 1, 0, 0], [0.5, 1.5, 0.5, 1.5]]))
    s3 = math.sqrt(3)
    # mean 0.25, population std sqrt(3)/4: (0.75) / (sqrt(3)/4) = sqrt(3); (-0.25) / (sqrt(3)/4) = -1/sqrt(3)
    torch.testing.assert_close(adv[0], torch.tensor([s3, -1 / s3, -1 / s3, -1 / s3]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(adv[1], torch.tensor([1.0, 1, -1, -1]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(adv[2], torch.tensor([-1.0, 1, -1, 1]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(group_advantages(torch.tensor([[1.0, 0, 0, 0]]), scale_by_std=False),
                               torch.tensor([[0.75, -0.25, -0.25, -0.25]]))


def test_all_equal_groups_and_singletons_are_exactly_zero():
    adv = group_advantages(torch.tensor([[1.0] * 8, [0.0] * 8, [0.1] * 8, [0.3] * 8]))
    assert torch.equal(adv, torch.zeros(4, 8))
    assert torch.equal(group_advantages(torch.tensor([[0.7]])), torch.zeros(1, 1))


def test_flatten_is_independent_of_arrival_order_and_split_is_equal():
    groups = make_groups(num_groups=6, group_size=4)
    a = flatten_groups(groups)
    b = flatten_groups(list(reversed(groups)))
    assert [(s.group_id, s.sample_index) for s in a] == [(s.group_id, s.sample_index) for s in b]
    assert [s.advantage for s in a] == [s.advantage for s in b]
    iters = split_iters(reversed(groups), 3)
    assert [len(it) for it in iters] == [8, 8, 8]
    assert [(s.group_id, s.sample_index) for it in iters for s in it] == [(s.group_id, s.sample_index) for s in a]
    with pytest.raises(TidalError, match="n_minibatches"):
        split_iters(groups, 5)
    with pytest.raises(ValueError, match="appears twice"):
        flatten_groups(groups + groups[:1])


# ---- packing --------------------------------------------------------------------------------------
def test_pack_is_target_aligned_and_unpack_round_trips():
    groups = make_groups(num_groups=3, group_size=2)
    samples = flatten_groups(groups)
    batch = pack_samples(samples, PAD, seq_len=20)
    assert batch.input_ids_BT.shape == (6, 20) and batch.response_mask_BT.shape == (6, 19)
    targets = batch.input_ids_BT[:, 1:]
    for b, s in enumerate(samples):
        assert targets[b][batch.response_mask_BT[b]].tolist() == list(s.response_ids)
        assert batch.input_ids_BT[b, :len(s.prompt_ids)].tolist() == list(s.prompt_ids)
        assert (batch.input_ids_BT[b, len(s.prompt_ids) + len(s.response_ids):] == PAD).all()
        assert torch.equal(batch.old_logprobs_BT[b][batch.response_mask_BT[b]], s.old_logprobs)
        assert (batch.advantages_BT[b][batch.response_mask_BT[b]] == torch.tensor(s.advantage).float()).all()
        assert (batch.advantages_BT[b][~batch.response_mask_BT[b]] == 0).all()
    back = unpack_response_logprobs(batch.old_logprobs_BT, batch.response_mask_BT)
    assert all(torch.equal(x, s.old_logprobs) for x, s in zip(back, samples))
    assert batch.num_tokens == count_response_tokens(samples)
    assert build_batch(groups, PAD).num_tokens == batch.num_tokens
    no_ref = flatten_groups(make_groups(num_groups=1, group_size=2, ref=False))
    with pytest.raises(ValueError, match="reference log-probs"):
        pack_samples(samples[:1] + no_ref, PAD)


# ---- clip and KL ----------------------------------------------------------------------------------
@pytest.mark.parametrize("adv, ratio, clipped", [
    (1.0, 1.5, True),     # A > 0 and ratio above 1 + eps: no push further up
    (1.0, 0.5, False),    # A > 0 below the range: still pulled up (min takes the unclipped term)
    (-1.0, 0.5, True),    # A < 0 below 1 - eps: no push further down
    (-1.0, 1.5, False),   # A < 0 above the range: still pulled down
    (1.0, 1.1, False),    # inside the range
    (-2.0, 0.9, False),
])
def test_clip_zeroes_the_gradient_exactly_where_expected(adv, ratio, clipped):
    logratio = torch.tensor([math.log(ratio)], requires_grad=True)
    loss, is_clipped = ppo_clip_loss(logratio, torch.tensor([adv]), 0.2, 0.2)
    loss.sum().backward()
    assert bool(is_clipped) == clipped
    expected_grad = 0.0 if clipped else -adv * ratio  # d(-ratio A)/d logratio
    assert logratio.grad.item() == pytest.approx(expected_grad, rel=1e-6, abs=0)
    assert loss.item() == pytest.approx(-min(ratio * adv, min(max(ratio, 0.8), 1.2) * adv), rel=1e-6)


def test_clip_higher_widens_only_the_upper_bound():
    logratio = torch.log(torch.tensor([1.25, 0.75]))
    _, sym = ppo_clip_loss(logratio, torch.tensor([1.0, -1.0]), 0.2, 0.2)
    _, high = ppo_clip_loss(logratio, torch.tensor([1.0, -1.0]), 0.2, 0.28)
    assert sym.tolist() == [True, True] and high.tolist() == [False, True]


def test_kl_is_zero_when_reference_equals_policy():
    policy = PrefixPolicy()
    groups = make_groups(num_groups=3, group_size=3, ref=False)
    batch = build_batch(groups, PAD)
    lp = policy.token_logprobs(batch.input_ids_BT)
    same_ref = flatten_groups(groups)
    refd = [s.__class__(s.group_id, s.sample_index, s.prompt_ids, s.response_ids, s.advantage, s.old_logprobs, r)
            for s, r in zip(same_ref, unpack_response_logprobs(lp, batch.response_mask_BT))]
    with_ref = pack_samples(refd, PAD)
    n = batch.num_tokens
    loss_kl, m_kl = grpo_loss(lp, with_ref, n, kl_coef=0.5)
    loss_plain, m_plain = grpo_loss(lp, batch, n)
    assert m_kl["grpo/kl"] == 0.0 and "grpo/kl" not in m_plain
    assert loss_kl.item() == loss_plain.item()
    g_kl = torch.autograd.grad(loss_kl, policy.table, retain_graph=True)[0]
    g_plain = torch.autograd.grad(loss_plain, policy.table)[0]
    torch.testing.assert_close(g_kl, g_plain, rtol=0, atol=1e-7)
    d = torch.arange(-20, 21) / 10.0
    k3 = kl_k3(torch.zeros(41), d)
    assert (k3 >= 0).all() and k3[20] == 0 and (k3[d != 0] > 0).all()


def test_loss_errors_name_the_fix():
    batch = build_batch(make_groups(num_groups=1, group_size=2, ref=False), PAD)
    lp = torch.zeros(batch.response_mask_BT.shape)
    with pytest.raises(ValueError, match="target-aligned"):
        grpo_loss(torch.zeros(batch.input_ids_BT.shape), batch, batch.num_tokens)
    with pytest.raises(ValueError, match="count_response_tokens"):
        grpo_loss(lp, batch, batch.num_tokens - 1)
    with pytest.raises(ValueError, match="reference log-probs"):
        grpo_loss(lp, batch, batch.num_tokens, kl_coef=0.1)


def test_padding_columns_may_hold_nan():
    batch = build_batch(make_groups(num_groups=2, group_size=3), PAD)
    lp = torch.full(batch.response_mask_BT.shape, float("nan"))
    lp[batch.response_mask_BT] = -1.0
    loss, metrics = grpo_loss(lp, batch, batch.num_tokens, kl_coef=0.1)
    assert math.isfinite(loss.item()) and all(math.isfinite(v) for v in metrics.values())


# ---- micro-batch additivity -----------------------------------------------------------------------
def _grads_and_metrics(policy, samples_mbs, n_tok, **kw):
    policy.zero_grad()
    total, metrics = torch.zeros(()), {}
    for mb in samples_mbs:
        batch = pack_samples(mb, PAD)
        loss, m = grpo_loss(policy.token_logprobs(batch.input_ids_BT), batch, n_tok, **kw)
        loss.backward()
        total = total + loss.detach()
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + v
    return total, [p.grad.clone() for p in policy.parameters()], metrics


POLICY = PrefixPolicy(seed=3)
ITER = flatten_groups(realistic_old_logprobs(make_groups(num_groups=5, group_size=4, seed=5), POLICY))
N_TOK = count_response_tokens(ITER)
KW = dict(clip_eps=0.2, kl_coef=0.3)
REF_LOSS, REF_GRADS, REF_METRICS = _grads_and_metrics(POLICY, [ITER], N_TOK, **KW)


def test_reference_iter_exercises_clipping():
    assert 0.05 < REF_METRICS["grpo/clip_frac"] < 0.95 and REF_METRICS["grpo/kl"] > 0
    assert REF_METRICS["grpo/tokens"] == N_TOK


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.data())
def test_micro_batch_losses_and_grads_sum_to_the_one_batch_values(data):
    order = data.draw(st.permutations(range(len(ITER))))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(ITER) - 1), max_size=len(ITER) - 1)))
    bounds = [0] + cuts + [len(ITER)]
    mbs = [[ITER[i] for i in order[a:b]] for a, b in itertools.pairwise(bounds)]
    loss, grads, metrics = _grads_and_metrics(POLICY, mbs, N_TOK, **KW)
    torch.testing.assert_close(loss, REF_LOSS, rtol=1e-6, atol=1e-6)
    for g, ref in zip(grads, REF_GRADS):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6)
    for k, v in REF_METRICS.items():
        assert metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


def test_data_parallel_ranks_sum_to_the_one_batch_gradient():
    """Uneven 'DP ranks' (3 of them) each accumulate micro-batches of 2; the SUM of their gradients is the
    iter's gradient: what an all-reduce SUM over any DP size computes."""
    rank_grads = []
    for r in range(3):
        mine = ITER[r::3]
        _, grads, _ = _grads_and_metrics(POLICY, [mine[i:i + 2] for i in range(0, len(mine), 2)], N_TOK, **KW)
        rank_grads.append(grads)
    for i, ref in enumerate(REF_GRADS):
        torch.testing.assert_close(sum(g[i] for g in rank_grads), ref, rtol=1e-5, atol=1e-6)


# ---- records and step metrics ---------------------------------------------------------------------
def test_records_validate_their_invariants():
    PromptGroup(0, 0, (BOS, 4), 4, "975")
    with pytest.raises(RecordError, match="group_size"):
        PromptGroup(0, 0, (BOS, 4), 0, "975")
    with pytest.raises(RecordError, match="prompt_ids"):
        PromptGroup(0, 0, [BOS, 4], 2, "975")
    good = dict(group_id=1, step=0, prompt_ids=(BOS, 5), response_ids=((4, EOS), (EOS,)),
                rollout_logprobs=(torch.zeros(2), torch.zeros(1)), rewards=(1.0, 0.0), policy_version=0,
                finish_reasons=("eos", "eos"))
    RolloutGroup(**good)
    for field, value, msg in [
        ("rollout_logprobs", (torch.zeros(2), torch.zeros(2)), "has 2 entries for 1"),
        ("rollout_logprobs", (torch.zeros(2, dtype=torch.float64), torch.zeros(1)), "float32"),
        ("rewards", (1.0,), "rewards"),
        ("rewards", (1.0, float("nan")), "finite"),
        ("finish_reasons", ("eos", "stop"), "finish_reasons"),
        ("response_ids", ((4, EOS), ()), "empty"),
    ]:
        with pytest.raises(RecordError, match=msg):
            RolloutGroup(**{**good, field: value})
    rg = RolloutGroup(**good)
    with pytest.raises(RecordError, match="old_logprobs"):
        rg.scored((torch.zeros(2),), inference_version=0)
    with pytest.raises(RecordError, match="ref_logprobs"):
        rg.scored((torch.zeros(2), torch.zeros(1)), 0, ref_logprobs=(torch.zeros(1), torch.zeros(1)))
    sg = rg.scored((torch.zeros(2), torch.zeros(1)), inference_version=0)
    assert isinstance(sg, ScoredGroup) and sg.num_response_tokens == 3 and sg.group_size == 2
    rg.check_matches(PromptGroup(1, 0, (BOS, 5), 2, "x"))
    with pytest.raises(RecordError, match="does not answer"):
        rg.check_matches(PromptGroup(1, 0, (BOS, 5), 3, "x"))


def test_step_metrics_by_hand():
    lp = lambda *v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    a = RolloutGroup(0, 2, (BOS,), ((4, EOS), (5, 6)), (lp(-1, -1), lp(-2, -2)), (1.0, 0.0), 1,
                     ("eos", "length")).scored((lp(-1, -1.5), lp(-2, -2)), 1)
    b = RolloutGroup(1, 2, (BOS,), ((EOS,), (EOS,)), (lp(-1), lp(-1)), (1.0, 1.0), 2,
                     ("eos", "eos")).scored((lp(-1), lp(-1)), 2)
    m = step_metrics([a, b])
    assert m["grpo/reward_mean"] == 0.75
    assert m["grpo/zero_adv_group_frac"] == 0.5
    assert m["grpo/truncated_frac"] == 0.25
    assert m["grpo/response_tokens_mean"] == 1.5
    assert m["grpo/rollout_vs_old_logprob_absdiff"] == pytest.approx(0.5 / 6)
    assert m["grpo/policy_lag_steps_mean"] == 0.5
    assert m["grpo/adv_std"] == pytest.approx(math.sqrt(0.5), rel=1e-5)  # advantages (1, -1, 0, 0)


def test_engine_modules_import_no_orchestration():
    code = ("import sys, tidal.engine.grpo, tidal.engine.rl_tasks, tidal.engine.records, tidal.engine.tokenizer;"
            "bad = [m for m in ('prefect', 'mlflow', 'ray', 'sqlalchemy', 'optuna') if m in sys.modules];"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
