"""Held-out accuracy: greedy responses from the native engine, scored by the run's verifier.

    greedy_accuracy(model, items, tok, verifier, max_new_tokens) -> mean reward in [0, 1]

Every item is one request (greedy, so no randomness; the engine is batch-invariant, so the result does not
depend on how many run at once); responses stop at the tokenizer's stop ids or `max_new_tokens`. The engine
samples only ids the tokenizer has (`EngineConfig.vocab_limit`), as rollout does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from tidal.engine.generation import EngineConfig, NativeEngine, Request, RequestResult, SamplingParams


@dataclass(frozen=True)
class EvalItem:
    """One held-out prompt: its token ids and its label (a `PromptLabel`: answer, uid, data source)."""

    prompt_ids: tuple[int, ...]
    label: object


@torch.no_grad()
def greedy_responses(model, prompts: list[tuple[int, ...]], stop_ids: tuple[int, ...], max_new_tokens: int,
                     width: int = 64, vocab_limit: int | None = None) -> list[tuple[int, ...]]:
    """Greedy token ids of each prompt's response (stop token kept), in order."""
    was_training = model.training
    model.eval()
    # a fresh engine per evaluation: capturing its CUDA graphs would cost more than the few decode steps it runs
    engine = NativeEngine(model, EngineConfig(max_running_requests=max(1, min(width, len(prompts))),
                                              vocab_limit=vocab_limit, cuda_graph=False))
    params = SamplingParams(0.0, max_new_tokens=max_new_tokens, stop_token_ids=stop_ids)
    for i, p in enumerate(prompts):
        engine.add(Request(f"eval/{i}", tuple(p), params, seed=0))
    out: dict[int, tuple[int, ...]] = {}
    while engine.has_work():
        for ev in engine.step():
            if ev.finished:
                out[int(ev.request_id.split("/")[1])] = tuple(cast(RequestResult, ev.result).token_ids)
    model.train(was_training)
    return [out[i] for i in range(len(prompts))]


def greedy_accuracy(model, items: list[EvalItem], tok, verifier, max_new_tokens: int, width: int = 64) -> float:
    """Mean verifier reward of greedy responses to `items` (single process, no TP)."""
    if not items:
        return 0.0
    responses = greedy_responses(model, [it.prompt_ids for it in items], tok.stop_ids, max_new_tokens, width,
                                 min(tok.vocab_size, model.args.vocab_size))
    return sum(verifier.score(it.label, tok.response_text(r)) for it, r in zip(items, responses)) / len(items)
