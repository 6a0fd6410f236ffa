"""Admission of a native engine: which waiting requests enter a slot, the KV blocks each request holds, and which
request is preempted when blocks run out (`RequestTable`).

    admit    waiting requests into free slots while KV blocks allow (FIFO, imported ones first in line; frozen
             ones are passed over and keep their place); each takes blocks for what its admission writes and its
             first decode position, and leaves one free block for each running request that may still grow
    grow     before a decode step, each active request gets a block where its next position starts one, oldest
             first; none free: the newest active request is preempted (blocks freed, back to the head of the
             queue, re-prefilled later)

A lone request is admitted whenever its blocks are free, so a budget that holds one request at `max_seq_len`
always makes progress. A preempted request re-prefills its prompt and replays its tokens through decode rows, so
its tokens do not change (bit for bit on CPU); a row it had in a step launched ahead (overlap) is skipped when
that step is read back, and the row's draw is rolled back here.

Example::

    table = RequestTable(cache, params, width=8, max_seq_len=64, reprefill="replay")
    table.enqueue(live)
    jobs = table.admit(version)   # [(live, token ids to prefill)], in admission order
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import cast

import torch

from tidal.engine.generation.kv_cache import PagedKVCache
from tidal.engine.generation.slots import Live, SlotParams

#: a request's generator state before the draws of a decode step launched ahead (restored if it is dropped)
Drawn = tuple[Live, torch.Tensor]


class RequestTable:
    """The requests of one engine: those in flight (`live`), their queue (`waiting`), the slots they run in, and
    why each that left did (`gone`: "finished", "aborted", "migrated away"; for error messages)."""

    def __init__(self, cache: PagedKVCache, params: SlotParams, width: int, max_seq_len: int, reprefill: str):
        self.cache, self.params = cache, params
        self.max_seq_len, self.reprefill = max_seq_len, reprefill
        self.live: dict[str, Live] = {}
        self.waiting: deque[str] = deque()
        self.slots: list[str | None] = [None] * width
        self.gone: dict[str, str] = {}
        self.admissions = 0
        self.preemptions = 0   # requests preempted for want of KV blocks (re-prefilled later)

    # ---- queries -------------------------------------------------------------------------------------------
    def running(self) -> list[Live]:
        """The requests holding a slot, in slot order."""
        return [self.live[rid] for rid in self.slots if rid is not None]

    def any_active(self) -> bool:
        """Some request holds a slot and is not frozen."""
        return any(rid is not None and not self.live[rid].frozen for rid in self.slots)

    def finishes_by_length(self, live: Live, more: int) -> bool:
        """The request reaches max_new_tokens or max_seq_len once `more` further tokens are recorded."""
        n = len(live.tokens) + more
        return n >= live.request.params.max_new_tokens or len(live.request.prompt_ids) + n >= self.max_seq_len

    # ---- in and out ----------------------------------------------------------------------------------------
    def enqueue(self, live: Live) -> None:
        """Last in line."""
        rid = live.request.request_id
        self.live[rid] = live
        self.gone.pop(rid, None)
        self.waiting.append(rid)

    def enqueue_first(self, lives: Sequence[Live]) -> None:
        """First in line, in this order (imported requests)."""
        for live in lives:
            self.live[live.request.request_id] = live
            self.gone.pop(live.request.request_id, None)
        self.waiting.extendleft(reversed([lv.request.request_id for lv in lives]))

    def remove(self, rid: str, why: str) -> None:
        live = self.live.pop(rid)
        if live.slot is not None:
            self.free_slot(live)
        else:
            self.waiting.remove(rid)
            if live.parked is not None:
                self.cache.give(live.parked)
                live.parked = None
        self.gone[rid] = why

    def free_slot(self, live: Live) -> None:
        slot = cast(int, live.slot)
        self.slots[slot], live.slot = None, None
        self.cache.release(slot)
        self.params.clear(slot)

    # ---- admission -----------------------------------------------------------------------------------------
    def admit(self, version: int) -> list[tuple[Live, list[int]]]:
        """Waiting requests into free slots (module doc), moved KV written into their blocks; the prefills this
        admission needs, in admission order: (request, the token ids to prefill). A request whose first token is
        scheduled under a version newer than `version` keeps its place, like a frozen one. Uploads the slots'
        sampling params and the block table."""
        skipped: list[str] = []
        jobs: list[tuple[Live, list[int]]] = []
        # running requests that may still need a block: admission leaves one free block for each
        growing = sum(1 for rid in self.slots if rid is not None and self._may_grow(self.live[rid]))
        while self.waiting and None in self.slots:
            live = self.live[self.waiting[0]]
            if live.frozen or (not live.tokens and live.held_at(0, version)):
                skipped.append(self.waiting.popleft())
                continue
            slot = self.slots.index(None)
            if not self._admit_blocks(slot, live, growing):
                break   # FIFO: nothing overtakes the head of the queue
            rid = self.waiting.popleft()
            self.slots[slot], live.slot = rid, slot
            growing += self._may_grow(live)
            live.admitted = self.admissions = self.admissions + 1
            self.params.set(slot, live.request.params)
            job = self._place(live, slot)
            if job is not None:
                jobs.append((live, job))
        self.waiting.extendleft(reversed(skipped))
        self.params.upload()
        self.cache.upload()
        return jobs

    def _place(self, live: Live, slot: int) -> list[int] | None:
        """Moved KV into the admitted request's blocks (None: nothing to prefill), else the ids to prefill: its
        prompt, or (imported without KV) the prompt, or prompt + generated in one pass (`single_pass`)."""
        if live.parked is not None:   # its KV is already in the blocks it holds since import
            live.parked = None
            live.replay = deque(live.all_tokens()[live.kv_len:-1])
            return None
        if live.pending_kv is not None:
            live.kv_len = self.cache.write(slot, [(k.to(self.cache.device, self.cache.dtype),
                                                   v.to(self.cache.device, self.cache.dtype))
                                                  for k, v in live.pending_kv])
            live.pending_kv = None
            live.replay = deque(live.all_tokens()[live.kv_len:-1])
            return None
        if live.tokens:  # imported without KV: re-prefill
            upto = len(live.request.prompt_ids) if self.reprefill == "replay" else -1
            return live.all_tokens()[:upto]
        return list(live.request.prompt_ids)

    def _admit_blocks(self, slot: int, live: Live, growing: int) -> bool:
        """Blocks for what the request's admission writes and its first decode position, if that leaves a free
        block for each of the `growing` running requests that may still grow (so admissions do not force
        preemptions at once); a lone request is admitted whenever its blocks are free."""
        if live.parked is not None:   # the slot takes its blocks as they are, and one more position
            more = self.cache.blocks_for(live.kv_len + 1) - len(live.parked)
            if self.cache.free_blocks - max(0, more) < growing:
                return False
            self.cache.bind(slot, live.parked)
            return self.cache.grow(slot, live.kv_len + 1)
        if live.pending_kv is not None:
            positions = live.pending_kv[0][0].shape[1] + 1
        elif live.tokens and self.reprefill == "single_pass":
            positions = len(live.all_tokens())
        else:   # a prompt, or a re-prefill that replays its tokens through decode rows (they grow as they go)
            positions = len(live.request.prompt_ids) + 1
        if self.cache.free_blocks - self.cache.blocks_for(positions) < growing:
            return False
        return self.cache.grow(slot, positions)

    def _may_grow(self, live: Live) -> bool:
        """An active request whose longest possible length needs more blocks than it holds."""
        longest = min(len(live.request.prompt_ids) + live.request.params.max_new_tokens, self.max_seq_len)
        return not live.frozen and self.cache.held(cast(int, live.slot)) < self.cache.blocks_for(longest)

    # ---- growth and preemption -----------------------------------------------------------------------------
    def grow(self, ahead: dict[int, bool], drew: Sequence[Drawn]) -> None:
        """Blocks for the position each active row writes in the step being launched (`ahead`: the in-flight
        step's rows, by `id` of their request: True if sampling there; `drew`: its draws), oldest request first.
        When none is free the newest active request is preempted (`preempt`); frozen requests keep theirs
        (their rows write where they hold no block: the null block). Per step only a comparison per row: a row
        crosses into a new block once every block_size steps."""
        capacity = self.cache.block_size
        need: list[tuple[Live, int]] = []
        for rid in self.slots:
            live = self.live[rid] if rid is not None else None
            if live is None or live.frozen:
                continue
            was = ahead.get(id(live))
            if was is True and self.finishes_by_length(live, 1):
                continue   # ends in the in-flight step
            positions = live.kv_len + (was is not None) + 1
            if positions > self.cache.held(cast(int, live.slot)) * capacity:
                need.append((live, positions))
        for live, positions in sorted(need, key=lambda lp: lp[0].admitted):
            while live.slot is not None and not self.cache.grow(live.slot, positions):
                self.preempt(max((self.live[rid] for rid in self.slots
                                  if rid is not None and not self.live[rid].frozen),
                                 key=lambda lv: lv.admitted), drew)
        self.cache.upload()

    def requeue_for_reprefill(self) -> None:
        """Every request's KV dropped (the weights that computed it changed): running ones leave their slots for
        the head of the queue in admission order, waiting ones give up imported KV; each re-prefills its prompt
        and replays its tokens at its next admission. Not counted as preemptions."""
        for live in sorted(self.running(), key=lambda lv: lv.admitted, reverse=True):
            self.free_slot(live)
            live.kv_len, live.replay = 0, deque()
            self.waiting.appendleft(live.request.request_id)
        for rid in self.waiting:
            live = self.live[rid]
            if live.parked is not None:
                self.cache.give(live.parked)
                live.parked = None
            live.pending_kv, live.kv_len = None, 0

    def preempt(self, live: Live, drew: Sequence[Drawn]) -> None:
        """Free a request's slot and blocks and put it first in line; re-admitted, it re-prefills its prompt
        and replays its tokens through decode rows (its KV rebuilt bit for bit on CPU). Its draw in the step
        launched ahead (`drew`) is rolled back."""
        for drawn, state in drew:
            if drawn is live:
                live.generator.set_state(state)
        self.free_slot(live)
        live.kv_len, live.replay = 0, deque()
        self.waiting.appendleft(live.request.request_id)
        self.preemptions += 1
