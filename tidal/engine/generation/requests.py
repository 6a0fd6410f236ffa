"""Request records of the generation engines: what goes in, what comes out, what migrates.

    Request ──add()──> engine ──step()──> RequestEvent(s) ... RequestEvent(finished=RequestResult)
                          │
                          └─export_state()──> RequestState ──import_state()──> another engine

* `SamplingParams` and `Request` are frozen and validated when built (bad input names the field and the fix).
* `RequestResult` is the finished sample: response tokens, the rollout log-prob of each token (fp32, model
  softmax at temperature 1, see `sampler.py`), why it stopped and the single policy version it sampled with.
* `RequestState` is everything a request needs to continue elsewhere and produce exactly the tokens it would
  have produced in place: tokens so far, log-probs so far, the state of its own `torch.Generator`, and
  (native engines) the KV cache of the positions already computed. Plain tensors + plain metadata, so
  `migration.py` can serialize it without pickle.

Seeds: every sample of a GRPO group is its own request whose seed is `derive_seed(run_seed, step, group_id,
sample_index)`, a hash (not a sum), so neighbouring groups or steps never share a stream::

    derive_seed(0, 3, 17, 2)  # -> a fixed 63-bit int, the same in every process and on every machine
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field

import torch

from tidal.core.errors import TidalError


def derive_seed(run_seed: int, step: int, group_id: int, sample_index: int) -> int:
    """A 63-bit seed from (run seed, RL step, prompt group, sample index): stable across processes."""
    text = f"tidal-sample/{run_seed}/{step}/{group_id}/{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Validated at construction."""

    temperature: float = 1.0
    """Softmax temperature of the sampling distribution; 0 means greedy (argmax, no randomness used)."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]: sample among the most likely tokens whose cumulative probability reaches it."""
    top_k: int = 0
    """Sample among the k most likely tokens; 0 disables."""
    max_new_tokens: int = 16
    """Response length cap (the stop token, when sampled, counts and is kept in the response)."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end the response (eos among them); the stop token is part of the response."""

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise TidalError("temperature", self.temperature, "must be >= 0", "use 0 for greedy or e.g. 1.0")
        if not 0 < self.top_p <= 1:
            raise TidalError("top_p", self.top_p, "must be in (0, 1]", "use 1.0 to disable nucleus sampling")
        if self.top_k < 0:
            raise TidalError("top_k", self.top_k, "must be >= 0", "use 0 to disable top-k")
        if self.max_new_tokens < 1:
            raise TidalError("max_new_tokens", self.max_new_tokens, "must be >= 1", "e.g. 16")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @staticmethod
    def from_config(rollout_cfg, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
        """From `tidal.core.config.RolloutConfig` plus the tokenizer's stop ids (eos)."""
        return SamplingParams(rollout_cfg.temperature, rollout_cfg.top_p, rollout_cfg.top_k,
                              rollout_cfg.max_new_tokens, tuple(stop_token_ids))

    def to_meta(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "max_new_tokens": self.max_new_tokens, "stop_token_ids": list(self.stop_token_ids)}

    @staticmethod
    def from_meta(meta: dict) -> SamplingParams:
        return SamplingParams(float(meta["temperature"]), float(meta["top_p"]), int(meta["top_k"]),
                              int(meta["max_new_tokens"]), tuple(meta["stop_token_ids"]))


@dataclass(frozen=True)
class Request:
    """One sequence to generate. `seed` seeds the request's own `torch.Generator`."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    stream: bool = False
    """Emit a `RequestEvent` for every token (else only when finished)."""
    version_schedule: tuple[tuple[int, int], ...] = ()
    """The versions its tokens must be sampled under, as (first token index, policy version) runs (a replay of a
    partial rollout's `RequestResult.version_starts`): it waits at a run's first token until its engine holds
    that run's version, and its engine takes no newer weights before it reaches that token. Empty: whatever
    version the engine holds."""

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise TidalError("request_id", self.request_id, "must be a non-empty string", "e.g. 's0-g3-i1'")
        if len(self.prompt_ids) == 0:
            raise TidalError("prompt_ids", self.request_id, "prompt is empty", "give at least one token (e.g. bos)")
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        sched = tuple((int(i), int(v)) for i, v in self.version_schedule)
        if sched and (sched[0][0] != 0 or any(a[0] >= b[0] or a[1] >= b[1] for a, b in itertools.pairwise(sched))):
            raise TidalError("version_schedule", sched, f"request {self.request_id!r}: runs must start at token 0 "
                             "with token indices and versions both increasing", "replay a result's version_starts")
        object.__setattr__(self, "version_schedule", sched)

    def version_due(self, index: int) -> int | None:
        """The version token `index` must be sampled under (`version_schedule`); None: any."""
        due = None
        for start, version in self.version_schedule:
            if start > index:
                break
            due = version
        return due

    def to_meta(self) -> dict:
        return {"request_id": self.request_id, "prompt_ids": list(self.prompt_ids), "seed": self.seed,
                "stream": self.stream, "params": self.params.to_meta(),
                "version_schedule": [list(run) for run in self.version_schedule]}

    @staticmethod
    def from_meta(meta: dict) -> Request:
        return Request(str(meta["request_id"]), tuple(meta["prompt_ids"]), SamplingParams.from_meta(meta["params"]),
                       int(meta["seed"]), bool(meta["stream"]),
                       tuple((int(i), int(v)) for i, v in meta.get("version_schedule", ())))


@dataclass(frozen=True)
class RequestResult:
    """A finished request. `logprobs[i]` is log p(token_ids[i]) under the model at temperature 1, fp32."""

    request_id: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    """"stop" (a stop token), "length" (max_new_tokens or the model's max_seq_len)."""
    policy_version: int
    """The version of the weights its first token was sampled with (the oldest of its tokens')."""
    num_migrations: int = 0
    version_starts: tuple[tuple[int, int], ...] = ()
    """(first token index, policy version) of each run of tokens sampled under one version, in order: more than
    one where the weights were updated with the request in flight (a partial rollout); empty: every token under
    `policy_version`."""


@dataclass(frozen=True)
class RequestEvent:
    """What `step()` reports for one request: new tokens (streaming requests) and/or its final result."""

    request_id: str
    new_token_ids: tuple[int, ...] = ()
    new_logprobs: tuple[float, ...] = ()
    result: RequestResult | None = None

    @property
    def finished(self) -> bool:
        return self.result is not None


@dataclass
class RequestState:
    """A request in flight, exported to continue elsewhere.

    `kv` (native engines only): per layer `(k, v)` of shape [H_kv_local, kv_len, D] for the first `kv_len`
    tokens of prompt + generated; None means the target re-prefills (the vLLM-style fallback). The last
    generated token is never in the KV: it is the next decode input. `numerics` names what must be equal on
    both sides for the KV to continue bit-exactly (decode width, dtype, device type, TP); see `engine.py`.
    """

    request: Request
    token_ids: list[int]
    logprobs: list[float]
    generator_state: torch.Tensor
    """`torch.Generator.get_state()` of the request's CPU generator (uint8)."""
    policy_version: int | None
    """Version of the weights it sampled with; None if nothing was sampled yet."""
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    kv_len: int = 0
    numerics: str = ""
    num_migrations: int = 0
    kv_blocks: tuple[int, ...] | None = None
    """The KV left in place on the source (`kv` None): the source's blocks holding positions 0..kv_len-1, which
    the transfer layer copies block for block into the blocks the target takes at import (`kv_destination`)."""
    kv_layout: str = ""
    """With `kv_blocks`: the source pool's block geometry (`PagedKVCache.layout`); the target's must be equal."""
    kv_nbytes: int = 0
    """With `kv_blocks`: the bytes those blocks hold over every layer (what the transfer moves)."""
    version_starts: tuple[tuple[int, int], ...] = ()
    """As `RequestResult.version_starts`: the runs of its tokens sampled under one version."""

    @property
    def current_version(self) -> int | None:
        """The version its next token must be sampled with: its last run's (None: nothing sampled yet)."""
        return self.version_starts[-1][1] if self.version_starts else self.policy_version

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def without_kv(self) -> RequestState:
        """The same request for the re-prefill path (tokens + generator state only)."""
        return RequestState(self.request, list(self.token_ids), list(self.logprobs), self.generator_state.clone(),
                            self.policy_version, None, 0, "", self.num_migrations,
                            version_starts=self.version_starts)
