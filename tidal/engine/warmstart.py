"""Supervised warm start: teach the model the task's format from a deliberately small labelled set.

RL with a 0/1 verifier needs a policy that sometimes succeeds. The warm start trains next-token NLL on the
response tokens of `task.sft_examples(num_examples, seed)`: a fixed, small set, optionally with a fraction of
wrong labels (`label_noise`, like demonstrations written with mistakes), for `iters` steps or until held-out
accuracy first reaches `stop_at_accuracy`. RL then learns from fresh prompts with only the verifier.

Measured (3-digit addition, 0.8M parameters): held-out accuracy is all-or-nothing in the step count (with
2,000 noisy examples: 0.02 at step 600, 0.9 at step 900) and the step where it jumps moves with the machine's
floating-point path, so a warm start meant to half solve the task stops by accuracy, not by step.
`plateaued(history)`: held-out accuracy rose by less than `tol` over the last quarter of training (final value
against the best one reached by three quarters).

    examples = [(tok.prompt_ids(e.prompt), tok.encode(e.response) + [eos]) for e in task_examples(task, spec)]
    history = warm_start(model, examples, lambda m: greedy_accuracy(m, heldout, tok, verifier, 8), spec, pad_id)
    history[-1].heldout_accuracy   # e.g. 0.3
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tidal.engine.grpo import pack_sequences
from tidal.engine.model import Transformer
from tidal.engine.rl_tasks import SFTExample, Task


@dataclass(frozen=True)
class WarmStartSpec:
    num_examples: int = 1000
    """Size of the labelled set (small on purpose: the warm start should plateau below perfect)."""
    iters: int = 1200
    """Optimizer steps."""
    batch_size: int = 64
    """Sequences per step, drawn with replacement from the labelled set."""
    lr: float = 1e-3
    """AdamW learning rate (constant)."""
    eval_every: int = 150
    """Evaluate held-out accuracy every N steps."""
    eval_size: int = 256
    """Held-out prompts per evaluation."""
    seed: int = 0
    """Seed of the labelled set, the held-out split and batch sampling."""
    label_noise: float = 0.0
    """Fraction of labelled examples with one answer digit wrong (seeded): demonstrations with mistakes."""
    stop_at_accuracy: float | None = None
    """Stop at the first evaluation whose held-out accuracy reaches this (None: run all `iters`): a model that
    solves the task this well, whatever the machine's floating-point path took to get there."""

    @staticmethod
    def from_config(ws, eval_size: int, seed: int) -> WarmStartSpec:
        """From `tidal.core.config.WarmStartConfig` (duck-typed), the held-out size and the data seed."""
        return WarmStartSpec(num_examples=ws.num_examples, iters=ws.iters, batch_size=ws.batch_size, lr=ws.lr,
                             eval_every=ws.eval_every or max(1, ws.iters // 8), eval_size=eval_size, seed=seed,
                             label_noise=ws.label_noise, stop_at_accuracy=ws.stop_at_accuracy)


@dataclass(frozen=True)
class EvalPoint:
    iter: int
    loss: float
    heldout_accuracy: float
    seconds: float


def noisy(examples: list[SFTExample], fraction: float, seed: int) -> list[SFTExample]:
    """`fraction` of the examples with one character of the response replaced by another digit (seeded)."""
    if fraction <= 0:
        return examples
    rng = random.Random(seed)
    out = []
    for e in examples:
        r = e.response
        if rng.random() < fraction:
            digits = [i for i, c in enumerate(r) if c.isdigit()]
            if digits:
                i = rng.choice(digits)
                r = r[:i] + str((int(r[i]) + rng.randrange(1, 10)) % 10) + r[i + 1:]
        out.append(SFTExample(e.prompt, r))
    return out


def warm_start(model: Transformer, examples: list[tuple[list[int], list[int]]],
               evaluate: Callable[[Transformer], float], spec: WarmStartSpec, pad_id: int,
               log=None) -> list[EvalPoint]:
    """Train `model` in place on (prompt ids, response ids) pairs (responses end with the stop token); return the
    evaluation history (`evaluate(model)`: held-out accuracy, e.g. `evaluation.greedy_accuracy`)."""
    ids_BT, mask_BT = pack_sequences([p for p, _ in examples], [r for _, r in examples], pad_id)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(spec.seed)
    t0 = time.perf_counter()
    history = [EvalPoint(0, float("nan"), evaluate(model), 0.0)]
    model.train()
    for it in range(1, spec.iters + 1):
        idx = torch.randint(0, len(examples), (spec.batch_size,), generator=g)
        mask = mask_BT[idx]
        loss = -(model.token_logprobs(ids_BT[idx]) * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if it % spec.eval_every == 0 or it == spec.iters:
            point = EvalPoint(it, float(loss.detach()), evaluate(model), time.perf_counter() - t0)
            history.append(point)
            if log:
                log(point)
            if spec.stop_at_accuracy is not None and point.heldout_accuracy >= spec.stop_at_accuracy:
                break
    return history


def task_examples(task: Task, spec: WarmStartSpec) -> list[SFTExample]:
    """The labelled set of `task`: `spec.num_examples` train prompts, `spec.label_noise` of them mislabelled."""
    return noisy(task.sft_examples(spec.num_examples, spec.seed), spec.label_noise, spec.seed)


def plateaued(history: list[EvalPoint], tol: float = 0.02) -> bool:
    """Stopped improving: the final held-out accuracy is less than `tol` above the best one reached by three
    quarters of training (the best, not the last: held-out accuracy of a model fitting noisy labels wobbles)."""
    last = history[-1]
    earlier = [p.heldout_accuracy for p in history if p.iter <= last.iter * 3 / 4]
    return bool(earlier) and last.heldout_accuracy - max(earlier) < tol
