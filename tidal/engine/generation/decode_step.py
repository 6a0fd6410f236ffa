"""The decode step of a native engine: one batched forward over the active rows, and the sampled tokens handed
back to the host (`DecodeStep.launch` -> `Launched`, read back by the engine).

    plan_rows   each active slot's row: its input token (its last token, a replayed token, or with overlap the
                token the in-flight step samples, kept on the device), its position, whether it samples
    launch      one uniform per sampling row from the request's own generator; host inputs (pinned where
                overlap copies them to a GPU); the forward: rows grouped by their own key span (batch-invariant)
                or one span for the step, bucketed (step-wide; a CUDA graph per row count, span and sampler);
                sampling on the device; host copies of tokens and log-probs behind an event (overlap)

Every forward has R rows (`EngineSetup.rows`; padding rows use the dummy slot, whose table row holds no block).
With compact rows (step-wide) a step computes only the active rows, gathered from their slots into a
power-of-two bucket of at least ROW_BUCKETS_MIN rows. The work follows the tokens: a row reads its keys up to its
bucketed length, so `Launched.keys` (summed into the engine's `keys_read`) does not grow with `max_seq_len`.

A launched step holds its rows' generator states before its draws (`Launched.drew`): a step launched ahead and
then discarded rolls them back, and its K/V writes sit at the positions the next real step writes again with the
same values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch

from tidal.engine.generation import decode_attention, decode_gemm, sample_kernel, sampler
from tidal.engine.generation.admission import Drawn, RequestTable
from tidal.engine.generation.engine_setup import ROW_BUCKETS_MIN, EngineSetup
from tidal.engine.generation.kv_cache import PagedKVCache, RowGroup
from tidal.engine.generation.slots import Live, SlotParams
from tidal.engine.model import Kernels, Transformer
from tidal.engine.shapes import padded_len

#: a row of a decode step: (request, slot, samples: False for a row replaying a recorded token)
Row = tuple[Live, int, bool]


@dataclass
class Launched:
    """A decode step on its way: its rows, the generator states before its draws (overlap: restored if the step
    is discarded), the keys it reads, and its tokens and log-probs (host copies once `ready` has passed; None:
    read them directly)."""

    rows: list[Row]
    index: list[int]   # each row's index in `tok` / `lp` (its slot; its position with compact rows)
    drew: list[Drawn]
    keys: int
    tok: torch.Tensor
    lp: torch.Tensor
    ready: Any


def draws(lives: list[Live], sampling: list[bool]) -> list[float]:
    """One uniform per sampling, non-greedy request, drawn from its own generator (0 for the others)."""
    return [torch.rand((), generator=lv.generator).item() if s and not lv.request.params.greedy else 0.0
            for lv, s in zip(lives, sampling)]


def plan_rows(table: RequestTable, ahead: dict[int, bool], num_rows: int, version: int
              ) -> tuple[list[Row], list[int], list[int], list[bool]]:
    """The rows of the step being launched and each slot's input token, position and whether it takes the
    in-flight step's token (`ahead`: that step's rows, by `id` of their request: True if sampling there). A
    request whose next token is scheduled under a version newer than `version` gets no sampling row."""
    ids, pos, prev = [0] * num_rows, [0] * num_rows, [False] * num_rows
    rows: list[Row] = []
    for slot, rid in enumerate(table.slots):
        if rid is None:
            continue
        live = table.live[rid]
        was = ahead.get(id(live))   # None: not in the in-flight step; True: sampling there; False: replaying
        pos[slot] = live.kv_len + (was is not None)  # frozen rows write past their valid length: harmless
        if live.frozen:
            continue
        replay = len(live.replay) - (was is False)   # recorded tokens still to feed after the in-flight step
        if was is True and table.finishes_by_length(live, 1):
            continue   # ends in the in-flight step: no row here (its throw-away write lands past its tokens)
        if replay <= 0 and live.held_at(len(live.tokens) + (was is True), version):
            continue   # waits for its scheduled version (its K/V write, if any, lands again when it resumes)
        if was is True:
            prev[slot] = True
        elif replay > 0:
            ids[slot] = live.replay[len(live.replay) - replay]
        else:
            ids[slot] = live.tokens[-1]
        rows.append((live, slot, replay <= 0))
    return rows, ids, pos, prev


class DecodeStep:
    """Launches decode steps (module doc); holds the captured decode graphs and, with overlap, each row's token
    of the step launched last, on the device."""

    def __init__(self, model: Transformer, cache: PagedKVCache, params: SlotParams, setup: EngineSetup,
                 kernels: Kernels):
        self.model, self.cache, self.params, self.setup, self.kernels = model, cache, params, setup, kernels
        self.device, self.max_seq_len = setup.device, model.args.max_seq_len
        self._row_slot_list = [min(r, setup.width) for r in range(setup.rows)]   # row -> slot (padding: dummy)
        self._row_slot = torch.tensor(self._row_slot_list, device=self.device)
        # the launched step's tokens, per row (per slot with compact rows: a request's row changes between steps,
        # its slot does not)
        self._prev_tok = torch.zeros(setup.per_slot, dtype=torch.long, device=self.device)
        # (rows, decode span, filtered) -> (graph, its outputs); rows -> the graphs' static inputs
        self._graphs: dict[tuple[int, int, bool], tuple] = {}
        self._static: dict[int, list[torch.Tensor | None]] = {}
        self._graph_pool: Any = None   # one memory pool for every captured decode graph

    def drop_graphs(self) -> None:
        """Forget the captured graphs (they point into freed KV and parameters)."""
        self._graphs, self._static, self._graph_pool = {}, {}, None

    def launch(self, rows: list[Row], ids: list[int], pos: list[int], prev: list[bool]) -> Launched:
        """Start the decode step of `plan_rows`'s rows; its tokens are read back from the returned record."""
        s = self.setup
        self.params.upload()
        drew = [(lv, lv.generator.get_state()) for lv, _, samples in rows if samples and not lv.request.params.greedy
                ] if s.overlap else []
        u_list = [0.0] * s.rows   # built on the host, one tensor a step: no per-row tensor writes or syncs
        for (_, slot, _), x in zip(rows, draws([lv for lv, _, _ in rows], [sm for _, _, sm in rows])):
            u_list[slot] = x
        index = [slot for _, slot, _ in rows]
        slots_R = None
        if s.compact:   # the active rows only, in a bucket of rows; padding rows read and write the dummy slot
            n = len(rows)
            pad = min(s.width, max(ROW_BUCKETS_MIN, 1 << (n - 1).bit_length())) - n
            ids, pos = [ids[i] for i in index] + [0] * pad, [pos[i] for i in index] + [0] * pad
            prev, u_list = [prev[i] for i in index] + [False] * pad, [u_list[i] for i in index] + [0.0] * pad
            slots_R = self._host(index + [cast(int, s.dummy)] * pad, torch.long)
            index = list(range(n))
        u, ids_R, pos_R = self._host(u_list, torch.float32), self._host(ids, torch.long), self._host(pos, torch.long)
        prev_R = self._host(prev, torch.bool) if s.overlap else None
        # the vocab sort of top-k / top-p runs only in steps where some row asks for it (a row's token never
        # depends on this: `sampler.sample`)
        filtered = any(lv.request.params.top_p < 1 or lv.request.params.top_k > 0 for lv, _, _ in rows)
        keys, tok, lp = self._run(ids_R, pos_R, u, prev_R, filtered, pos, index, slots_R)
        return Launched(rows, index, drew, keys, *self._read_back(tok, lp))

    def _run(self, ids_R: torch.Tensor, pos_R: torch.Tensor, u: torch.Tensor, prev_R: torch.Tensor | None,
             filtered: bool, pos: list[int], index: list[int], slots_R: torch.Tensor | None
             ) -> tuple[int, torch.Tensor, torch.Tensor]:
        """The step's forward: (keys read, tokens, log-probs)."""
        s = self.setup
        if s.row_spans:
            groups = self._row_groups(pos)
            keys = sum(len(g.rows) * g.span for g in groups)
            tok, lp = self._forward(*self._to_device(ids_R, pos_R, u, prev_R), filtered, groups=groups)
            return keys, tok, lp
        # one span for the step: the longest active row's keys, bucketed (frozen and empty rows are discarded)
        longest = max(pos[i] for i in index) + 1
        span = self._grid_span(longest) if s.fused_attention else padded_len(longest, self.max_seq_len)
        # the fused kernel reads each row's keys 0..pos (empty rows: one key); SDPA the step's span
        keys = sum(p + 1 for p in pos) if s.fused_attention else len(pos) * span
        if s.use_graph and (s.compact or s.rows == s.width):
            tok, lp = self._graph(ids_R, pos_R, u, prev_R, filtered, span, slots_R)
        else:
            slots = slots_R.to(self.device, non_blocking=True) if slots_R is not None else None
            tok, lp = self._forward(*self._to_device(ids_R, pos_R, u, prev_R), filtered, span=span, slots_R=slots)
        return keys, tok, lp

    def _grid_span(self, keys: int) -> int:
        """The Triton decode attention's `span` for a step whose longest row reads `keys` keys: it only sizes the
        kernel's grid (a chunk past a row's position exits at once; the sums do not depend on it), so steps share
        a few CUDA graphs: chunk counts in powers of two, at most the chunks of max_seq_len."""
        chunks = -(-keys // decode_attention.CHUNK)
        most = -(-self.max_seq_len // decode_attention.CHUNK)
        return decode_attention.CHUNK * min(most, 1 << (chunks - 1).bit_length())

    def _host(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A step input on the host; pinned where overlap copies it to a GPU (an async copy from pageable memory
        would wait for the device to finish its queue)."""
        return torch.tensor(values, dtype=dtype, pin_memory=self.setup.overlap and self.device.type == "cuda")

    def _to_device(self, ids: torch.Tensor, pos: torch.Tensor, u: torch.Tensor, prev: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        ids, pos, u = (x.to(self.device, non_blocking=True) for x in (ids, pos, u))
        return ids, pos, u, prev.to(self.device, non_blocking=True) if prev is not None else None

    def _read_back(self, tok: torch.Tensor, lp: torch.Tensor):
        """Host copies of a step's tokens and log-probs: on CUDA with overlap, pinned buffers filled after the
        step on its stream and an event marking them (so reading them waits for this step only)."""
        if not (self.setup.overlap and tok.is_cuda):
            return tok, lp, None
        tok_h = torch.empty(tok.shape, dtype=tok.dtype, pin_memory=True).copy_(tok, non_blocking=True)
        lp_h = torch.empty(lp.shape, dtype=lp.dtype, pin_memory=True).copy_(lp, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return tok_h, lp_h, ready

    def _row_groups(self, pos: list[int]) -> list[RowGroup]:
        """Rows by their own key span (position + 1, bucketed): the exact path, whatever shares the step."""
        by_span: dict[int, list[int]] = {}
        for r in range(self.setup.rows):
            by_span.setdefault(padded_len(pos[r] + 1, self.max_seq_len), []).append(r)
        return [RowGroup(rows, [self._row_slot_list[r] for r in rows], [pos[r] for r in rows], span, self.device)
                for span, rows in sorted(by_span.items())]

    def _forward(self, ids_R: torch.Tensor, pos_R: torch.Tensor, u_R: torch.Tensor, prev_R: torch.Tensor | None,
                 filtered: bool, *, span: int | None = None, groups: list[RowGroup] | None = None,
                 slots_R: torch.Tensor | None = None):
        """The decode math: R rows in, (token, rollout log-prob) per row out. No host syncs. With overlap, rows
        marked in `prev_R` take the token the previous decode step sampled (kept on the device). `slots_R`
        (compact rows): each row's slot, whose KV, sampling params and previous token it reads."""
        s, p = self.setup, self.params
        if slots_R is not None:
            temp, top_p, top_k = p.temp[slots_R], p.top_p[slots_R], p.top_k[slots_R]
            if prev_R is not None:
                ids_R = torch.where(prev_R, self._prev_tok[slots_R], ids_R)
            row_slot = slots_R
        else:
            temp, top_p, top_k = p.temp, p.top_p, p.top_k
            if prev_R is not None:
                ids_R = torch.where(prev_R, self._prev_tok, ids_R)
            row_slot = self._row_slot
        decoder = self.cache.decoder(pos_R, row_slot, span, groups, fused=s.fused_attention and span is not None)
        if s.decode_gemm and ids_R.shape[0] <= decode_gemm.MAX_ROWS:
            logits_local = self.model.logits_local(decode_gemm.decode_hidden(self.model, ids_R, pos_R, decoder,
                                                                             self.kernels))
        else:
            logits_local = self.model(ids_R[:, None], pos_R[:, None], None, decoder, self.kernels)
        logits = self.model.full_logits(logits_local)[:, -1, :s.vocab]
        if s.fused and not filtered:   # the token and its log-prob in Triton (`sample_kernel`)
            tok, lp = sample_kernel.sample_logprobs(logits, temp, u_R)
        else:
            logits = logits.float()
            tok = sampler.sample(logits, temp, top_p, top_k, u_R, filtered)
            lp = sampler.logprobs(logits, tok)
        if prev_R is not None:
            if slots_R is not None:   # padding rows all write the dummy slot: never read for a real row
                self._prev_tok.index_copy_(0, slots_R, tok)
            else:
                self._prev_tok.copy_(tok)
        return tok, lp

    def _graph(self, ids_R: torch.Tensor, pos_R: torch.Tensor, u_R: torch.Tensor, prev_R: torch.Tensor | None,
               filtered: bool, span: int, slots_R: torch.Tensor | None = None):
        """CUDA: replay the captured graph of `_forward` at this row count, key span and sampler (one capture per
        triple, all in one memory pool; the kernels are the eager ones, so the results are too). Captured lazily,
        dropped with `drop_graphs`."""
        rows = ids_R.shape[0]
        inputs = (ids_R, pos_R, u_R, prev_R, slots_R)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        if rows not in self._static:
            self._static[rows] = [x.to(self.device) if x is not None else None for x in inputs]
        static = self._static[rows]
        for buf, src in zip(static, inputs):
            if buf is not None and src is not None:
                buf.copy_(src, non_blocking=True)
        entry = self._graphs.get((rows, span, filtered))
        if entry is None:
            ids_s, pos_s, u_s = (cast(torch.Tensor, x) for x in static[:3])
            prev_s, slots_s = static[3:]
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up: rewrites each row's current K/V position with the same values
                kept = self._prev_tok.clone()   # the in-flight step's tokens, which the warm-up overwrites
                for _ in range(2):
                    self._prev_tok.copy_(kept)
                    self._forward(ids_s, pos_s, u_s, prev_s, filtered, span=span, slots_R=slots_s)
                self._prev_tok.copy_(kept)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._graph_pool):
                out = self._forward(ids_s, pos_s, u_s, prev_s, filtered, span=span, slots_R=slots_s)
            self._graphs[(rows, span, filtered)] = entry = (graph, out)
        entry[0].replay()
        return entry[1]
