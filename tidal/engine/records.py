"""Typed records passed between components. Streams move whole groups, never single samples.

    driver --PromptGroup--> rollout --RolloutGroup--> inference --ScoredGroup--> actor
                            (sample G responses,      (old log-probs under the     (GRPO: advantages from
                             reward each)              rollout's policy version,    rewards, ratio against
                                                       optional reference)          old log-probs)

Conventions for every record:
- token ids are tuples of Python ints; a prompt starts with `<bos>`, a response ends with `<eos>` unless
  it was cut at the length cap (finish reason "length");
- per-token log-probs are 1-D fp32 CPU tensors, one per sample, with one entry per RESPONSE token:
  `logprobs[i][k] = log p(response_ids[i][k] | prompt_ids + response_ids[i][:k])`;
- versions count optimizer weight updates pushed to a component: version v means "weights after v RL
  steps' updates", so `policy_version == step` in a fully on-policy run and lags it in an async one.

Records are frozen and validate their invariants when built (`__post_init__` calls `validate()`), so a
record that exists is well formed. They hold tensors, so equality is identity (`eq=False`): compare
fields explicitly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

FinishReason = Literal["eos", "length"]
FINISH_REASONS: frozenset[str] = frozenset({"eos", "length"})


class RecordError(ValueError):
    """A record whose fields contradict each other: a bug in the component that built it."""


def _check_ids(name: str, ids: tuple[int, ...], allow_empty: bool = False) -> None:
    if not isinstance(ids, tuple) or not all(isinstance(t, int) and t >= 0 for t in ids):
        raise RecordError(f"{name} must be a tuple of non-negative ints, got {type(ids).__name__}")
    if not ids and not allow_empty:
        raise RecordError(f"{name} is empty")


def _check_logprobs(name: str, lps: tuple[torch.Tensor, ...], lengths: list[int]) -> None:
    if not isinstance(lps, tuple) or len(lps) != len(lengths):
        raise RecordError(f"{name} must be a tuple of {len(lengths)} tensors (one per sample)")
    for i, (lp, n) in enumerate(zip(lps, lengths)):
        if not isinstance(lp, torch.Tensor) or lp.dim() != 1 or lp.dtype != torch.float32:
            raise RecordError(f"{name}[{i}] must be a 1-D float32 tensor, got "
                              f"{getattr(lp, 'dtype', type(lp).__name__)} of shape {tuple(getattr(lp, 'shape', ()))}")
        if lp.numel() != n:
            raise RecordError(f"{name}[{i}] has {lp.numel()} entries for {n} response tokens")
        if lp.device.type != "cpu":
            raise RecordError(f"{name}[{i}] is on {lp.device}; records carry CPU tensors")


@dataclass(frozen=True, eq=False)
class PromptGroup:
    """One prompt to sample `group_size` responses for. Built by the driver from the task's train stream."""

    group_id: int
    """Unique within the run: `step * rollout_batch_size + index in the step` (orders the step's groups)."""
    step: int
    """RL step that asked for this prompt."""
    prompt_ids: tuple[int, ...]
    """`<bos>` + prompt text, from `Task.prompt_ids`."""
    group_size: int
    """Responses to sample (GRPO's G, `algorithm.group_size`)."""
    answer_key: str
    """The task's expected answer text (`Task.answer`); the verifier is `verify(answer_key, response_text)`."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.group_id < 0 or self.step < 0:
            raise RecordError(f"group_id {self.group_id} and step {self.step} must be >= 0")
        _check_ids("prompt_ids", self.prompt_ids)
        if self.group_size < 1:
            raise RecordError(f"group_size must be >= 1, got {self.group_size}")


@dataclass(frozen=True, eq=False)
class RolloutGroup:
    """The `G` sampled responses of one prompt, rewarded. Built by a rollout instance."""

    group_id: int
    """The PromptGroup's id."""
    step: int
    """The PromptGroup's step."""
    prompt_ids: tuple[int, ...]
    """The PromptGroup's prompt ids."""
    response_ids: tuple[tuple[int, ...], ...]
    """G responses, each at least one token; ends with `<eos>` iff its finish reason is "eos"."""
    rollout_logprobs: tuple[torch.Tensor, ...]
    """G tensors `[len(response_ids[i])]`: log-probs the rollout engine sampled with (after temperature;
    diagnostics only, the loss uses ScoredGroup.old_logprobs)."""
    rewards: tuple[float, ...]
    """G verifier rewards (`verify(answer_key, decode(response_ids[i]))`), finite."""
    policy_version: int
    """Weights version the rollout engine generated with."""
    finish_reasons: tuple[FinishReason, ...]
    """G reasons: "eos" (wrote `<eos>`) or "length" (hit max_new_tokens)."""
    version_starts: tuple[tuple[tuple[int, int], ...], ...] = ()
    """Per response, (first token index, policy version) of each run of its tokens sampled under one version
    (`RequestResult.version_starts`); empty: every token under `policy_version`."""

    def token_versions(self, i: int) -> list[int]:
        """The policy version each token of response `i` was sampled under."""
        runs = self.version_starts[i] if self.version_starts and self.version_starts[i] else \
            ((0, self.policy_version),)
        n = len(self.response_ids[i])
        out: list[int] = []
        for (start, version), nxt in zip(runs, [*(s for s, _ in runs[1:]), n]):
            out.extend([version] * (min(nxt, n) - start))
        return out

    def __post_init__(self) -> None:
        self.validate()

    @property
    def group_size(self) -> int:
        return len(self.response_ids)

    def validate(self) -> None:
        if self.group_id < 0 or self.step < 0 or self.policy_version < 0:
            raise RecordError(f"group_id {self.group_id}, step {self.step}, policy_version "
                              f"{self.policy_version} must be >= 0")
        _check_ids("prompt_ids", self.prompt_ids)
        g = len(self.response_ids)
        if g < 1:
            raise RecordError("a group needs at least one response")
        if not isinstance(self.response_ids, tuple):
            raise RecordError("response_ids must be a tuple of tuples")
        for i, r in enumerate(self.response_ids):
            _check_ids(f"response_ids[{i}]", r)
        _check_logprobs("rollout_logprobs", self.rollout_logprobs, [len(r) for r in self.response_ids])
        if len(self.rewards) != g or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in self.rewards):
            raise RecordError(f"rewards must be {g} finite numbers, got {self.rewards!r}")
        if len(self.finish_reasons) != g or not set(self.finish_reasons) <= FINISH_REASONS:
            raise RecordError(f"finish_reasons must be {g} of {sorted(FINISH_REASONS)}, got {self.finish_reasons!r}")
        if self.version_starts and len(self.version_starts) != g:
            raise RecordError(f"version_starts must be empty or one run list per response ({g}), got "
                              f"{len(self.version_starts)}")

    def check_matches(self, prompt: PromptGroup) -> None:
        """Raise unless this group answers `prompt` (same id, step, prompt, group size)."""
        if (self.group_id, self.step, self.prompt_ids, self.group_size) != (
                prompt.group_id, prompt.step, prompt.prompt_ids, prompt.group_size):
            raise RecordError(f"rollout group {self.group_id} (step {self.step}, {self.group_size} samples) does "
                              f"not answer prompt group {prompt.group_id} (step {prompt.step}, "
                              f"{prompt.group_size} samples)")

    def scored(self, old_logprobs: tuple[torch.Tensor, ...], inference_version: int,
               ref_logprobs: tuple[torch.Tensor, ...] | None = None) -> ScoredGroup:
        """This group plus inference's log-probs."""
        return ScoredGroup(self.group_id, self.step, self.prompt_ids, self.response_ids, self.rollout_logprobs,
                           self.rewards, self.policy_version, self.finish_reasons, self.version_starts,
                           old_logprobs=old_logprobs, inference_version=inference_version,
                           ref_logprobs=ref_logprobs)


@dataclass(frozen=True, eq=False, kw_only=True)
class ScoredGroup(RolloutGroup):
    """A RolloutGroup plus the log-probs the actor's loss needs (its own fields are keyword-only).
    Built by an inference instance."""

    old_logprobs: tuple[torch.Tensor, ...]
    """G tensors `[len(response_ids[i])]`: log-probs under weights `inference_version` computed with the
    actor's own numerics (no temperature): the "old policy" of the PPO ratio."""
    inference_version: int
    """Weights version inference scored with; equals `policy_version` for exact PPO ratios at iter 0."""
    ref_logprobs: tuple[torch.Tensor, ...] | None = None
    """G tensors like old_logprobs under the frozen reference model, or None when kl_coef is 0."""

    def validate(self) -> None:
        super().validate()
        lengths = [len(r) for r in self.response_ids]
        _check_logprobs("old_logprobs", self.old_logprobs, lengths)
        if self.ref_logprobs is not None:
            _check_logprobs("ref_logprobs", self.ref_logprobs, lengths)
        if self.inference_version < 0:
            raise RecordError(f"inference_version must be >= 0, got {self.inference_version}")

    @property
    def num_response_tokens(self) -> int:
        return sum(len(r) for r in self.response_ids)
