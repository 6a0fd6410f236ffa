"""The protocol every generation backend implements (`NativeEngine`, torch; `VLLMEngine`, a vLLM server).

    add(request)            queue a request; it is admitted when a slot and KV budget are free
    step() -> events        one scheduling iteration: admit + prefill new requests, one batched decode step;
                            returns a `RequestEvent` per streaming token and one per finished request
    abort(ids)              drop requests (no result is produced)
    export_state(ids)       freeze requests and return their `RequestState`s (phase 1 of a migration)
    commit_export(ids)      the target holds them: forget them here (phase 2, success)
    cancel_export(ids)      the target failed: unfreeze them here, they continue as if nothing happened
    import_state(states, staged)  take over requests exported elsewhere (all or nothing); `staged=True` holds
                            them frozen until `activate(ids)` (or `abort(ids)`): the target's half of phase 2
    update_weights(w, v)    load TP-local weights stamped with policy version v (only when idle)
    release_memory()        free weights and KV so the device can serve another role
    resume(weights, v)      reallocate; weights again (or the host copy kept by release_memory(offload=True))

A backend without movable KV (vLLM) exports states with `kv=None` and imports by re-prefilling the prompt plus
the generated tokens, then continues with the exported generator state: the same protocol, the fallback path.

Rule for weight updates (both backends): updates apply between RL steps, when no request is in flight. An
engine refuses `update_weights` while any request is queued, running or frozen for export, and every request
records the single version it sampled with (`RequestResult.policy_version`); a state exported under version v
can only be imported by an engine at version v. So a response never mixes two policies.

Lifecycle (`EngineStatus`)::

    READY --release_memory--> RELEASED --resume--> READY
    (update_weights / add / step / migrate only in READY; release_memory refuses while requests are in flight)
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

import torch

from tidal.core.errors import TidalError
from tidal.engine.generation.requests import Request, RequestEvent, RequestState
from tidal.engine.model import ModelArgs


class EngineStatus(enum.Enum):
    READY = "ready"
    RELEASED = "released"


# Allowed lifecycle edges, one reason each.
TRANSITIONS: dict[tuple[EngineStatus, EngineStatus], str] = {
    (EngineStatus.READY, EngineStatus.RELEASED): "release_memory: the device goes to another role",
    (EngineStatus.RELEASED, EngineStatus.READY): "resume: weights and KV are allocated again",
}


class GenerationError(RuntimeError):
    """Misuse of an engine by the caller (our code): the message names the ids/state and what to do."""


class UnknownRequestError(GenerationError, KeyError):
    """abort/export/commit of ids the engine does not hold (never added, finished, aborted, or moved away)."""

    def __init__(self, op: str, problems: Mapping[str, str]):
        self.op, self.problems = op, dict(problems)
        listed = ", ".join(f"{rid!r} ({why})" for rid, why in list(self.problems.items())[:8])
        more = f" and {len(self.problems) - 8} more" if len(self.problems) > 8 else ""
        super().__init__(f"{op}: cannot act on {listed}{more}; only requests queued or running on this engine "
                         "can be aborted or exported (check the ids, or the events that finished them)")

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0]


class _Held(Protocol):
    @property
    def frozen(self) -> bool: ...


def check_request_ids(op: str, ids: Sequence[str], live: Mapping[str, _Held], gone: Mapping[str, str],
                      frozen: bool | None) -> list[str]:
    """The ids an engine may act on for `op`, or UnknownRequestError naming each bad one and why.

    live: requests held (each with a `frozen` flag); gone: why a request left (finished, aborted, moved);
    frozen: True = must be exported (commit/cancel), False = must not be, None = either."""
    ids = list(ids)
    problems: dict[str, str] = {}
    for rid in ids:
        if ids.count(rid) > 1:
            problems[rid] = "listed twice"
        elif rid not in live:
            problems[rid] = gone.get(rid, "never added here")
        elif frozen is True and not live[rid].frozen:
            problems[rid] = "not exported"
        elif frozen is False and live[rid].frozen:
            problems[rid] = "already exported, awaiting commit_export/cancel_export"
    if problems:
        raise UnknownRequestError(op, problems)
    return ids


def check_importable(st, batch_ids: Sequence[str], live: Mapping[str, object], version: int) -> str:
    """Rules every backend applies to an imported request state (the `where` prefix of its errors is returned):
    it runs in exactly one place, and it sampled with this engine's policy version (a response never mixes
    policies)."""
    rid = st.request_id
    where = f"import_state: request {rid!r}"
    if rid in live or list(batch_ids).count(rid) > 1:
        raise GenerationError(f"{where} is already here (a request runs in exactly one place; "
                              "commit or cancel the earlier migration first)")
    current = st.current_version
    if current is not None and current != version:
        raise GenerationError(f"{where} sampled with policy version {current} but this engine holds "
                              f"version {version}; a response changes policy only where its engine's weights are "
                              "updated: migrate between engines of one version")
    return where


def check_prompt(request: Request, args: ModelArgs) -> None:
    """A prompt every backend can run: shorter than the model's max_seq_len, its ids inside the vocab."""
    n, s, v = len(request.prompt_ids), args.max_seq_len, args.vocab_size
    rid = request.request_id
    if n >= s:
        raise TidalError("prompt_ids", n, f"request {rid!r}: a prompt of {n} tokens leaves no room to generate "
                         f"within max_seq_len={s}", "shorten the prompt or raise model.max_seq_len")
    bad = [t for t in request.prompt_ids if not 0 <= t < v]
    if bad:
        raise TidalError("prompt_ids", bad[:5], f"request {rid!r}: token ids outside the vocab [0, {v})",
                         "tokenize with the model's tokenizer")


class EngineBusyError(GenerationError):
    """An operation that needs an idle engine (weight update, release) while requests are in flight."""


class IllegalTransition(GenerationError):
    def __init__(self, src: EngineStatus, dst: EngineStatus, op: str):
        super().__init__(f"{op}: engine is {src.value}, cannot go to {dst.value} "
                         f"(allowed: {[f'{a.value}->{b.value}' for a, b in TRANSITIONS]})")


class GenerationEngine(ABC):
    """What rollout instances and migration code rely on. Implementations: `NativeEngine`, `VLLMEngine`."""

    # Rules shared by the backends. Each keeps `status`, its policy version, a `_live` dict of the requests in
    # flight (each with a `frozen` flag, set while exported) and `_gone`: why a request left (error messages).
    status: EngineStatus
    _version: int
    _live: Mapping[str, Any]
    _gone: Mapping[str, str]

    def _need_ready(self, op: str) -> None:
        if self.status is not EngineStatus.READY:
            raise GenerationError(f"{op}: engine memory is released; call resume() first")

    def _need_idle(self, op: str) -> None:
        if self._live:
            ids = list(self._live)
            raise EngineBusyError(f"{op}: {len(ids)} requests in flight ({ids[:4]}...); weights change only "
                                  "between RL steps: let them finish, or export/abort them first")

    def _check_new(self, request: Request) -> None:
        """`add`'s rules: a ready engine, and an id not in flight here."""
        self._need_ready("add")
        if request.request_id in self._live:
            raise GenerationError(f"add: request {request.request_id!r} is already in flight on this engine "
                                  "(ids must be unique per engine; derive them from step, group and sample)")

    def _check_ids(self, op: str, ids: Sequence[str], frozen: bool | None) -> list[str]:
        return check_request_ids(op, ids, self._live, self._gone, frozen)

    def _check_version(self, version: int) -> None:
        if not isinstance(version, int) or version <= self._version:
            raise TidalError("policy_version", version, f"must be an int above the current {self._version}",
                             "stamp each update with the actor's next version")

    def _move(self, dst: EngineStatus, op: str) -> None:
        if (self.status, dst) not in TRANSITIONS:
            raise IllegalTransition(self.status, dst, op)
        self.status = dst

    def _check_resume(self, weights: Mapping[str, torch.Tensor] | None, version: int | None, kept: bool) -> None:
        """`resume`'s rules: a released engine; new weights come with their (newer) version; without new weights
        the engine must have `kept` its own (offloaded, or released with the weights kept)."""
        if self.status is not EngineStatus.RELEASED:
            raise IllegalTransition(self.status, EngineStatus.READY, "resume")
        if weights is not None and version is None:
            raise GenerationError("resume: new weights need the policy version they belong to (version=...)")
        if weights is None and not kept:
            raise GenerationError("resume: no weights given and none were offloaded; pass weights=... "
                                  "(and version=...), or release with release_memory(offload=True)")
        if weights is not None and version is not None:
            self._check_version(version)

    @property
    def policy_version(self) -> int:
        return self._version

    @abstractmethod
    def add(self, request: Request) -> None: ...

    @abstractmethod
    def step(self) -> list[RequestEvent]: ...

    @abstractmethod
    def abort(self, ids: Sequence[str]) -> None: ...

    @abstractmethod
    def export_state(self, ids: Sequence[str], in_place: bool = False) -> list[RequestState]:
        """Freeze `ids` and return their states; `in_place` asks the KV to stay in this engine's blocks, named by
        the states (`RequestState.kv_blocks`), where the engine has a paged pool (`kv_pool`)."""

    @property
    def kv_pool(self) -> torch.Tensor | None:
        """The paged KV pool the transfer layer reads and writes block by block; None: this engine has none (its
        states carry KV as tensors, or none)."""
        return None

    def kv_destination(self, rid: str) -> list[int] | None:
        """The blocks of `kv_pool` a staged request's KV lands in, in the source's order; None: the engine
        re-prefills it (no pool, or no free blocks), so its source sends no KV."""
        return None

    @abstractmethod
    def commit_export(self, ids: Sequence[str]) -> None: ...

    @abstractmethod
    def cancel_export(self, ids: Sequence[str]) -> None: ...

    @abstractmethod
    def import_state(self, states: Sequence[RequestState], staged: bool = False) -> None: ...

    @abstractmethod
    def activate(self, ids: Sequence[str]) -> None: ...

    @abstractmethod
    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int,
                       in_flight: Literal["keep", "recompute"] | None = None) -> None:
        """Load `weights` as policy `version`; idle engines only, unless `in_flight` says what requests in flight
        do under the new weights (a partial rollout: `keep` their KV, `recompute` it)."""

    @abstractmethod
    def release_memory(self, offload: bool = False) -> None: ...

    @abstractmethod
    def resume(self, weights: Mapping[str, torch.Tensor] | None = None, version: int | None = None) -> None: ...

    def request_ids(self) -> list[str]:
        """Ids queued or running here, in arrival order (not those frozen in a migration)."""
        return [rid for rid, r in self._live.items() if not r.frozen]

    @abstractmethod
    def num_running(self) -> int: ...

    @abstractmethod
    def num_waiting(self) -> int: ...

    def has_work(self) -> bool:
        return self.num_running() + self.num_waiting() > 0
