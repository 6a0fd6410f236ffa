"""What a native engine keeps per request and per slot: a request's engine-side state (`Live`) and the slots'
sampling params on the device (`SlotParams`).

A slot is a running request's handle: its row of the KV block table and its sampling params. The params live on
the device (a decode step reads them there) and are written on the host as requests come and go, then uploaded
in one asynchronous copy per tensor before the next device work reads them: an element write to a device tensor
is a blocking copy, behind every queued step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from tidal.engine.generation.requests import Request, SamplingParams


@dataclass
class Live:
    """Engine-side state of one request in flight."""

    request: Request
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)  # generated so far
    logprobs: list[float] = field(default_factory=list)
    version: int | None = None
    slot: int | None = None
    kv_len: int = 0  # positions of prompt + tokens whose K/V are in the slot's blocks
    admitted: int = 0  # admission order (preemption takes the newest)
    replay: deque = field(default_factory=deque)  # recorded tokens to feed before sampling resumes
    pending_kv: list | None = None  # imported KV (tensors) waiting for a slot
    parked: list[int] | None = None  # blocks holding imported KV (kv_len positions), taken before it has a slot
    frozen: bool = False  # exported, waiting for commit/cancel
    migrations: int = 0
    #: (first token index, policy version) of each run of tokens sampled under one version: weights updated
    #: with the request in flight start a new run (`NativeEngine.update_weights(in_flight=...)`)
    version_starts: list[tuple[int, int]] = field(default_factory=list)

    def all_tokens(self) -> list[int]:
        return list(self.request.prompt_ids) + self.tokens

    def held_at(self, index: int, version: int) -> bool:
        """Its token `index` is scheduled under a version newer than `version` (`Request.version_schedule`)."""
        due = self.request.version_due(index)
        return due is not None and due > version


class SlotParams:
    """Per-slot temperature, top-p and top-k on the device (`temp`, `top_p`, `top_k`; inactive slots are greedy
    and ignored) and their host copies, uploaded by `upload` when they changed."""

    def __init__(self, num_slots: int, device: torch.device, pinned: bool):
        self.temp = torch.zeros(num_slots, device=device)
        self.top_p = torch.ones(num_slots, device=device)
        self.top_k = torch.zeros(num_slots, dtype=torch.long, device=device)
        self._host: tuple[list[float], list[float], list[int]] = ([0.0] * num_slots, [1.0] * num_slots,
                                                                   [0] * num_slots)
        self._pinned = pinned
        self._dirty = False

    def set(self, slot: int, p: SamplingParams) -> None:
        temp, top_p, top_k = self._host
        temp[slot], top_p[slot], top_k[slot] = p.temperature, p.top_p, p.top_k
        self._dirty = True

    def clear(self, slot: int) -> None:
        """The slot is greedy again (its rows are ignored)."""
        self._host[0][slot] = 0.0
        self._dirty = True

    def upload(self) -> None:
        """The host copies to the device, one asynchronous copy per tensor, stream-ordered before the next
        prefill or decode step that reads them."""
        if not self._dirty:
            return
        self._dirty = False
        for dev, host in zip((self.temp, self.top_p, self.top_k), self._host):
            dev.copy_(torch.tensor(host, dtype=dev.dtype, pin_memory=self._pinned), non_blocking=True)
