"""Prefill of a native engine: admitted requests' prompt K/V written into their KV blocks, and each prompt's
last-position logits for its first token (`Prefill`).

    batch-invariant mode   one request at a time, [1, T] causal over its own tokens: the same computation
                           wherever and whenever it runs
    step-wide mode (CUDA)  right-padded batches of up to PREFILL_TOKENS tokens in one causal forward (padding
                           sits after every real token, so it changes no real position's output; its K/V lands
                           past each slot's kv_len, where decode masks it); a lone prompt through its captured
                           graph (one per prompt length, LRU, at most PREFILL_GRAPHS)

`tokens` counts the prompt tokens prefilled, padding included: a function of the prompts, not of max_seq_len.
"""

from __future__ import annotations

from typing import cast

import torch

from tidal.engine.generation.engine_setup import PREFILL_GRAPHS, PREFILL_TOKENS, EngineSetup
from tidal.engine.generation.kv_cache import PagedKVCache
from tidal.engine.generation.slots import Live
from tidal.engine.model import Kernels, Transformer
from tidal.engine.shapes import padded_len


class Prefill:
    """Runs the prefills of an admission (module doc); holds the captured prefill graphs."""

    def __init__(self, model: Transformer, cache: PagedKVCache, setup: EngineSetup, kernels: Kernels):
        self.model, self.cache, self.kernels = model, cache, kernels
        self.device, self.vocab, self.max_seq_len = setup.device, setup.vocab, model.args.max_seq_len
        self.row_spans, self.use_graph = setup.row_spans, setup.use_graph
        self.tokens = 0
        self._graphs: dict[int, tuple] = {}

    def drop_graphs(self) -> None:
        """Forget the captured graphs (they point into freed KV and parameters)."""
        self._graphs = {}

    def run(self, jobs: list[tuple[Live, list[int]]]) -> list[torch.Tensor]:
        """Write each job's K/V into its slot (setting its kv_len); the last position's full logits [1, V] of
        each."""
        if self.row_spans:
            return [self._one(live, ids) for live, ids in jobs]
        out: list[torch.Tensor] = []
        lo = 0
        while lo < len(jobs):
            hi, width = lo + 1, padded_len(len(jobs[lo][1]), self.max_seq_len)
            while hi < len(jobs):
                w = max(width, padded_len(len(jobs[hi][1]), self.max_seq_len))
                if (hi - lo + 1) * w > PREFILL_TOKENS:
                    break
                hi, width = hi + 1, w
            chunk = jobs[lo:hi]
            out += [self._one(*chunk[0])] if len(chunk) == 1 else self._batch(chunk, width)
            lo = hi
        return out

    def _batch(self, jobs: list[tuple[Live, list[int]]], width: int) -> list[torch.Tensor]:
        """Right-padded prompts [n, width] in one causal forward (module doc)."""
        lengths = [len(ids) for _, ids in jobs]
        ids_BT = torch.zeros((len(jobs), width), dtype=torch.long)
        for b, (live, ids) in enumerate(jobs):
            ids_BT[b, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            live.kv_len = len(ids)
        self.tokens += len(jobs) * width
        slots = torch.tensor([cast(int, live.slot) for live, _ in jobs], device=self.device)
        pos_BT = torch.arange(width, device=self.device).expand(len(jobs), width)
        h = self.model.hidden(ids_BT.to(self.device), pos_BT, None, self.cache.prefill_writer(slots), self.kernels)
        last = h[torch.arange(len(jobs), device=self.device), torch.tensor(lengths, device=self.device) - 1]
        logits = self.model.full_logits(self.model.logits_local(last[:, None]))[:, -1, :self.vocab].float()
        return list(logits.split(1))

    def _one(self, live: Live, ids: list[int]) -> torch.Tensor:
        """Write the K/V of `ids` into the request's slot; return the last position's full logits [1, V]."""
        t = len(ids)
        live.kv_len = t
        self.tokens += t
        ids_1T = torch.tensor([ids], dtype=torch.long)
        slot = cast(int, live.slot)  # prefill runs on admitted requests, which hold a slot
        if self.use_graph:
            return self._graph(ids_1T, slot)
        return self._forward(ids_1T.to(self.device), torch.tensor([slot], device=self.device))

    def _forward(self, ids_1T: torch.Tensor, slot_1: torch.Tensor) -> torch.Tensor:
        pos_1T = torch.arange(ids_1T.shape[1], device=self.device)[None]
        h = self.model.hidden(ids_1T, pos_1T, None, self.cache.prefill_writer(slot_1), self.kernels)
        return self.model.full_logits(self.model.logits_local(h[:, -1:]))[:, -1, :self.vocab].float()

    def _graph(self, ids_1T: torch.Tensor, slot: int) -> torch.Tensor:
        """CUDA: one captured graph per prompt length (LRU, at most PREFILL_GRAPHS), slot as a device index."""
        t = ids_1T.shape[1]
        entry = self._graphs.pop(t, None)
        if entry is None:
            static_ids = ids_1T.to(self.device)
            static_slot = torch.tensor([slot], device=self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up writes this request's own K/V into its own blocks
                self._forward(static_ids, static_slot)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self._forward(static_ids, static_slot)
            entry = (graph, static_ids, static_slot, out)
            while len(self._graphs) >= PREFILL_GRAPHS:
                self._graphs.pop(next(iter(self._graphs)))
        self._graphs[t] = entry  # most recent last
        graph, static_ids, static_slot, out = entry
        static_ids.copy_(ids_1T, non_blocking=True)
        static_slot.fill_(slot)
        graph.replay()
        return out
