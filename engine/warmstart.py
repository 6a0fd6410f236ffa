"""Supervised warm start: teach the model the task's format from a deliberately small labelled set.

RL with a 0/1 verifier needs a policy that sometimes succeeds. The warm start trains next-token NLL on the
response tokens of `task.sft_examples(num_examples, seed)`: a fixed, small set, optionally with a fraction of
wrong labels (`label_noise`, like demonstrations written with mistakes), until held-out accuracy stops
improving. RL then learns from fresh prompts with only the exact verifier: what the supervision could not teach.

Measured here (3-digit addition, 0.8M parameters): clean sets are all-or-nothing (500 examples memorize at
~5% held-out, 700+ generalize to >90%), so the default warm start uses noisy labels, which plateau in between.

`plateaued(history)` is the rule the learning test checks: held-out accuracy rose by less than `tol` over the
last quarter of training (final value against the best one reached by three quarters).

    history = warm_start(model, task, tok, WarmStartSpec(num_examples=1000, iters=1200))
    history[-1].heldout_accuracy   # e.g. 0.3
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import torch

from tidal.engine.grpo import pack_sequences
from tidal.engine.model import Transformer
from tidal.engine.rl_tasks import SFTExample, Task
from tidal.engine.tokenizer import CharTokenizer


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


@dataclass(frozen=True)
class EvalPoint:
    iter: int
    loss: float
    heldout_accuracy: float
    seconds: float


@torch.no_grad()
def greedy_accuracy(model: Transformer, task: Task, tok: CharTokenizer, prompts: list[str],
                    max_new_tokens: int | None = None, batch_size: int = 256) -> float:
    """Fraction of `prompts` the model answers exactly under greedy decoding (single process, no TP)."""
    was_training = model.training
    model.eval()
    steps = max_new_tokens or task.max_response_tokens
    correct = 0.0
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        enc = [task.prompt_ids(p, tok) for p in chunk]
        by_len: dict[int, list[int]] = {}
        for j, e in enumerate(enc):  # equal-length prompts decode as one dense batch
            by_len.setdefault(len(e), []).append(j)
        for _, idx in sorted(by_len.items()):
            x = torch.tensor([enc[j] for j in idx])
            out = []
            for _ in range(steps):
                nxt = model.full_logits(model(x)[:, -1]).argmax(-1)
                out.append(nxt)
                x = torch.cat([x, nxt[:, None]], dim=1)
            toks = torch.stack(out, 1).tolist()
            correct += sum(task.reward(chunk[j], tok.decode(t)) for j, t in zip(idx, toks))
    model.train(was_training)
    return correct / max(len(prompts), 1)


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


def warm_start(model: Transformer, task: Task, tok: CharTokenizer, spec: WarmStartSpec,
               log=None) -> list[EvalPoint]:
    """Train `model` in place on the labelled set; return the evaluation history."""
    examples = noisy(task.sft_examples(spec.num_examples, spec.seed), spec.label_noise, spec.seed)
    prompts = [task.prompt_ids(e.prompt, tok) for e in examples]
    responses = [tok.encode(e.response, add_eos=True) for e in examples]
    ids_BT, mask_BT = pack_sequences(prompts, responses, tok.pad_id)
    heldout = task.heldout_prompts(spec.eval_size, spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(spec.seed)
    t0 = time.perf_counter()
    history = [EvalPoint(0, float("nan"), greedy_accuracy(model, task, tok, heldout), 0.0)]
    model.train()
    for it in range(1, spec.iters + 1):
        idx = torch.randint(0, len(prompts), (spec.batch_size,), generator=g)
        mask = mask_BT[idx]
        loss = -(model.token_logprobs(ids_BT[idx]) * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if it % spec.eval_every == 0 or it == spec.iters:
            point = EvalPoint(it, float(loss.detach()), greedy_accuracy(model, task, tok, heldout), time.perf_counter() - t0)
            history.append(point)
            if log:
                log(point)
    return history


def plateaued(history: list[EvalPoint], tol: float = 0.02) -> bool:
    """Stopped improving: the final held-out accuracy is less than `tol` above the best one reached by three
    quarters of training (the best, not the last: held-out accuracy of a model fitting noisy labels wobbles)."""
    last = history[-1]
    earlier = [p.heldout_accuracy for p in history if p.iter <= last.iter * 3 / 4]
    return bool(earlier) and last.heldout_accuracy - max(earlier) < tol
