"""Overlapped decode (`EngineConfig.overlap`): a step is launched before the previous one is read back, its rows
fed from the device. A request's tokens and log-probs equal those without overlap, bit for bit, through
admissions mid-flight, stop tokens, length limits, re-prefill replays, aborts, migrations (which discard the
step launched ahead and roll its draws back), weight updates and release/resume. CPU, batch-invariant mode."""

import random

import pytest
import torch

from tidal.engine.generation import EngineConfig, NativeEngine, Request, SamplingParams
from tidal.engine.generation.migration import migrate
from tidal.engine.model import ModelArgs, Transformer, init_global_weights

ARGS = ModelArgs(vocab_size=41, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
                 max_seq_len=24)
PARAMS = [SamplingParams(0.0, max_new_tokens=10), SamplingParams(1.0, max_new_tokens=30, stop_token_ids=(3, 5)),
          SamplingParams(0.9, top_p=0.85, top_k=8, max_new_tokens=12), SamplingParams(1.2, max_new_tokens=40)]


def model(seed=0):
    m = Transformer(ARGS)
    m.load_global(init_global_weights(ARGS, seed))
    return m


def requests(n, seed=0):
    """Mixed lengths and params: greedy, stop tokens, top-k/top-p, and requests ending at max_seq_len."""
    g = torch.Generator().manual_seed(seed)
    return [Request(f"r{i}", tuple(torch.randint(0, ARGS.vocab_size, (int(torch.randint(1, 12, (1,), generator=g)),),
                                                 generator=g).tolist()), PARAMS[i % len(PARAMS)], seed=50 + i)
            for i in range(n)]


def drive(engine, reqs, add_every=0, between=None):
    """Run to completion (one request added every `add_every` steps, else all at once); `between(step)` runs
    before each step. Returns {id: (tokens, log-probs, finish reason)}."""
    pending, out, steps = list(reqs), {}, 0
    if not add_every:
        for r in pending:
            engine.add(r)
        pending = []
    while pending or engine.has_work():
        if pending and steps % add_every == 0:
            engine.add(pending.pop(0))
        if between is not None:
            between(steps)
        for ev in engine.step():
            if ev.finished:
                assert ev.request_id not in out, f"{ev.request_id} finished twice"
                out[ev.request_id] = (ev.result.token_ids, ev.result.logprobs, ev.result.finish_reason)
        steps += 1
    return out


def engine(m, overlap, width=4):
    return NativeEngine(m, EngineConfig(max_running_requests=width, overlap=overlap))


def test_overlap_gives_the_same_tokens_as_launch_and_read():
    m, reqs = model(), requests(14)
    want = drive(engine(m, False), reqs)
    assert drive(engine(m, True), reqs) == want
    assert drive(engine(m, True), reqs, add_every=3) == want   # admissions while a step is launched ahead
    assert {r[2] for r in want.values()} == {"stop", "length"}


def test_a_step_launched_ahead_is_discarded_by_export_and_its_draws_rolled_back():
    """Migrations at random steps between overlapped engines (KV moved or re-prefilled and replayed)."""
    m, reqs = model(), requests(12, seed=1)
    want = drive(engine(m, False), reqs)
    rng = random.Random(0)
    es = [engine(m, True) for _ in range(3)]
    for r in reqs:
        rng.choice(es).add(r)
    out, moves = {}, 0
    while any(e.has_work() for e in es):
        if rng.random() < 0.5:
            src, dst = rng.sample(es, 2)
            ids = src.request_ids()
            if ids:
                migrate(src, dst, rng.sample(ids, rng.randint(1, len(ids))), reprefill=rng.random() < 0.5)
                moves += 1
        for e in es:
            for ev in e.step():
                if ev.finished:
                    assert ev.request_id not in out
                    out[ev.request_id] = (ev.result.token_ids, ev.result.logprobs, ev.result.finish_reason)
    assert moves > 5 and out == want


def test_abort_mid_flight_leaves_the_others_exact():
    m, reqs = model(), requests(10, seed=2)
    want = drive(engine(m, False), reqs)
    e = engine(m, True)

    def abort_some(step):
        if step == 4:
            e.abort([rid for rid in ("r1", "r6") if rid in e.request_ids()])
    got = drive(e, reqs, between=abort_some)
    assert "r1" not in got and got == {k: v for k, v in want.items() if k in got} and len(got) >= 8


@pytest.mark.parametrize("overlap", [False, True])
def test_weight_update_and_release_after_a_batch_with_a_step_left_ahead(overlap):
    m = model()
    e = engine(m, overlap)
    first = drive(e, requests(6, seed=3))
    new = init_global_weights(ARGS, 1)
    e.update_weights(new, 1)
    e.release_memory(offload=True)
    e.resume()
    got = drive(e, requests(6, seed=4))
    assert got == drive(engine(model(1), False), requests(6, seed=4)) and len(first) == 6
