"""Shapes follow the tokens: length buckets round up by less than 25%, micro-batches keep to their token budget
and depend on the lengths alone, and the generation engine's work (prefill tokens, decode keys read) does not
change when model.max_seq_len doubles with the same requests."""

import pytest
import torch
from training_equality import PARITY_REWARD, assert_same_training, start_weights, trained

from tidal.core.errors import TidalError
from tidal.engine.generation import EngineConfig, NativeEngine, Request, SamplingParams
from tidal.engine.model import ModelArgs, Transformer, init_global_weights
from tidal.engine.shapes import MIN_BUCKET, micro_batches, padded_len

pytestmark = pytest.mark.usefixtures("shared_ray")

ARGS = ModelArgs(vocab_size=37, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
                 max_seq_len=64)


def test_buckets_round_up_by_less_than_a_quarter_and_never_past_the_cap():
    widths = [padded_len(n) for n in range(1, 5000)]
    assert widths == sorted(widths)
    for n, w in enumerate(widths, start=1):
        assert w >= n and (n <= MIN_BUCKET or w < 1.25 * n), (n, w)
        assert padded_len(w) == w   # a bucket is its own width
    assert len(set(widths)) < 40    # O(log n) distinct shapes
    assert padded_len(97, cap=100) == 100 and padded_len(100, cap=100) == 100
    with pytest.raises(ValueError):
        padded_len(101, cap=100)


def test_micro_batches_by_token_budget_cover_every_sequence_once_within_budget():
    g = torch.Generator().manual_seed(0)
    lengths = [int(x) for x in torch.randint(5, 300, (97,), generator=g)]
    batches = micro_batches(lengths, max_tokens=1024, max_rows=8, cap=320)
    seen = sorted(i for idx, _ in batches for i in idx)
    assert seen == list(range(len(lengths)))
    for idx, width in batches:
        assert len(idx) * width <= 1024
        assert width == padded_len(max(lengths[i] for i in idx), 320)
    # longest first, so similar lengths share a batch: the padding is far below padding to the cap
    padded = sum(len(idx) * w for idx, w in batches)
    assert padded < 1.3 * sum(lengths) < len(lengths) * 320
    # a function of the lengths alone: the same lengths give the same batches
    assert micro_batches(list(lengths), max_tokens=1024, max_rows=8, cap=320) == batches


def test_micro_batches_without_a_budget_are_consecutive_runs_padded_to_their_longest():
    lengths = [3, 40, 17, 17, 90]
    assert micro_batches(lengths, max_tokens=None, max_rows=2) == [([0, 1], 40), ([2, 3], 20), ([4], 96)]


def test_a_budget_below_the_longest_sequence_is_a_clear_error():
    with pytest.raises(TidalError, match="actor.max_tokens_per_micro_batch"):
        micro_batches([100, 10], max_tokens=64, max_rows=8)


def _requests(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = tuple(torch.randint(0, ARGS.vocab_size, (int(torch.randint(2, 12, (1,), generator=g)),),
                                     generator=g).tolist())
        params = SamplingParams(0.0 if i % 2 else 1.0, max_new_tokens=int(torch.randint(3, 20, (1,), generator=g)))
        out.append(Request(f"r{i}", prompt, params, seed=100 + i))
    return out


def _generate(max_seq_len, batch_invariant=None):
    args = ModelArgs(**{**ARGS.__dict__, "max_seq_len": max_seq_len})
    m = Transformer(args)
    m.load_global(init_global_weights(args, 0))
    engine = NativeEngine(m, EngineConfig(max_running_requests=6, batch_invariant=batch_invariant))
    for r in _requests(14):
        engine.add(r)
    out = {}
    while engine.has_work():
        for ev in engine.step():
            if ev.finished:
                out[ev.request_id] = ev.result
    return engine, out


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_doubling_max_seq_len_leaves_the_engines_work_and_tokens_unchanged(batch_invariant):
    small, out_small = _generate(64, batch_invariant)
    big, out_big = _generate(128, batch_invariant)
    assert small.keys_read == big.keys_read > 0
    assert small.prefill_tokens == big.prefill_tokens > 0
    assert {k: (r.token_ids, r.logprobs) for k, r in out_small.items()} == \
           {k: (r.token_ids, r.logprobs) for k, r in out_big.items()}
    # decode rows read their bucketed lengths, far fewer keys than whole slots would be
    assert small.keys_read < 0.5 * small.rows * 64 * sum(len(r.token_ids) for r in out_small.values()) / 6


def test_step_wide_mode_agrees_with_the_batch_invariant_one_up_to_round_off():
    _, exact = _generate(64, batch_invariant=True)
    _, fast = _generate(64, batch_invariant=False)
    assert exact.keys() == fast.keys()
    for rid, r in exact.items():
        f = fast[rid]
        assert f.token_ids == r.token_ids, rid   # fp32, tiny model: no near-ties in these requests
        torch.testing.assert_close(torch.tensor(f.logprobs), torch.tensor(r.logprobs), atol=1e-5, rtol=0)


ONE_DEVICE = {
    "run": {"num_steps": 2, "seed": 5},
    "cluster": {"num_devices_per_node": 1, "component_placement": {"actor,rollout,inference": "0"}},
    "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 64},
    "actor": {"micro_batch_size": 4, "lr": 1e-3, "warmup_iters": 0, "max_tokens_per_micro_batch": 256},
    "rollout": {"max_new_tokens": 12, "max_running_requests": 16},
    "algorithm": {"group_size": 4, "n_minibatches": 2},
    "data": {"rollout_batch_size": 8, "eval_size": 8},
    "warm_start": {"iters": 0},
    "reward": {"function": PARITY_REWARD},   # the random model's groups are half rewarded: every iter trains
}


def _pipeline_run(tmp_path, max_seq_len):
    from tidal.core.config import build_config
    from tidal.pipeline.run import TrainingRun
    name = f"seq{max_seq_len}"
    cfg = build_config(ONE_DEVICE, [f"run.output_dir={tmp_path}", f"run.name={name}",
                                    f"model.max_seq_len={max_seq_len}"])
    run = TrainingRun(cfg, tmp_path / name)
    try:
        run.open()
        start = start_weights(run)
        work = []
        for _ in range(cfg.run.num_steps):
            run.step()
            work.append({k: v for k, v in run._res.metrics.items() if k.startswith("work/")})
        run.finish()
        return work, trained(run, start)
    finally:
        run.close()


@pytest.mark.slow
def test_doubling_max_seq_len_leaves_a_runs_work_and_result_unchanged(tmp_path):
    """The whole pipeline (real worker, generate -> score -> train): the same data at max_seq_len 64 and 128
    gives the same padded tokens in every phase, step by step, and the same final weights."""
    work64, end64 = _pipeline_run(tmp_path, 64)
    work128, end128 = _pipeline_run(tmp_path, 128)
    assert work64 == work128
    assert all(w["work/actor_tokens"] > 0 and w["work/inference_tokens"] > 0 and w["work/rollout_kv_read_tokens"] > 0
               for w in work64)
    assert_same_training(end64, end128)
