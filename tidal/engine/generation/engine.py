"""The native (torch) generation engine: continuous batching over a paged KV cache, exact per request.

    step():  admit   waiting requests into free slots while KV blocks allow (FIFO; imported ones first); for
                     each: load its moved KV, or prefill it and sample its first token
             grow    give each active request a block where its next position starts one; none free: preempt
                     the newest request (blocks freed, back to the head of the queue, re-prefilled later)
             decode  one batched forward over all R rows; each row attends over the first keys of its own slot
                     only, its length bucketed (`tidal.engine.shapes.padded_len`); rows that are replaying a
                     re-prefilled request feed their recorded token and sample nothing
             finish  stop token / max_new_tokens / max_seq_len -> RequestResult, slot and blocks free again

Capacity: W = max_running_requests slots (a slot is a running request's handle: its row of the block table,
its sampling params); KV memory is `kv_budget_bytes // block bytes` blocks of `kv_block_size` positions of
every layer (`kv_cache.PagedKVCache`), held by requests as their tokens need them, so a budget holds the tokens
requests have, not W x `max_seq_len` positions. Admission keeps one free block for each running request that
may still grow; a request preempted for want of blocks is re-prefilled in replay mode (below), so its tokens do
not change (bit for bit on CPU). Every decode forward has R rows: R = W on CUDA, W rounded up to a multiple of
64 on CPU (padding rows use one dummy slot whose table row holds no block). The work follows the tokens: a
decode step reads each row's keys up to its bucketed length, and a prefill runs the prompt's tokens, so
doubling `max_seq_len` with the same requests changes neither (`keys_read`, `prefill_tokens` count them).

Why R is a multiple of 64 on CPU (measured, torch 2.13 CPU, AVX-512): elementwise kernels run a flat loop
over numel in vector chunks of 2 x Vec::size() and finish the last `numel % 32` elements with the *scalar*
function; for SiLU (Sleef exp vs std::exp) that gives other bits. With 5 rows of width 48 the last row's
last 16 values were computed by the scalar path, so the request in the last slot decoded 1 ulp apart from
the same request in slot 0 and once flipped a log-prob. With R a multiple of 64 no decode tensor has a tail.
GEMMs: per-row bits depend on M (classes M=1, 2..15, >=16 measured) but not on row position or other rows at
fixed M, so R is fixed per engine. Intra-op threads split large elementwise loops into chunks with their own
tails: run CPU engines with torch.set_num_threads(1) (our workers do) when bit-exactness matters.

Two modes (`EngineConfig.batch_invariant`, default: on for CPU, off for CUDA):
- batch-invariant: decode rows are grouped by their own key span (a row's attention shape depends on its own
  position alone) and prompts prefill one at a time ([1, T]). Guarantee (measured, tests/test_generation.py): a
  request's tokens and log-probs are a function of (weights, prompt, sampling params, seed) only, not of which
  requests share its batch, its slot, or its arrival time, and not of migrations between engines with equal
  `numerics` (decode rows, dtype, device type, TP size, max_seq_len, mode; same torch build and thread count),
  nor of the KV blocks it holds or of preemptions.
- step-wide (CUDA): every row of a step reads the longest active row's bucketed span (one captured CUDA graph
  per span and sampler variant, all in one memory pool), and waiting prompts prefill together in right-padded
  batches of up to PREFILL_TOKENS tokens. Measured on an H200 in bf16 (tests/test_generation_cuda.py): a row's
  tokens and log-probs do not depend on the span of the steps it ran in (masked key blocks add exact zeros),
  and KV migration between engines of equal numerics continues a request bit for bit; a batched prefill's
  round-off depends on which prompts share it, so a request's tokens equal a one-at-a-time prefill's only up to
  round-off (a near-tie can flip).

Overlap (`EngineConfig.overlap`): each `step()` admits, launches the next decode step, then reads back the
step launched by the previous call (on CUDA through pinned buffers and an event, so the read waits for that
step only). The launched step's rows take their input token from the device (the token the in-flight step
samples) and their position one past it; a row that finishes in the in-flight step (a stop token) computes one
throw-away row, like an empty slot's. Anything that must see a settled engine (`export_state`, weight updates,
memory release) first discards the launched step: its generator draws are rolled back and its K/V write lands at
the position the next real step writes again with the same values. A request's tokens therefore equal those of
the same engine without overlap: the same inputs at the same positions, the same draws in the same order.

Migration: `export_state` freezes requests (they keep their slot but do not advance) and returns their state
with KV; `commit_export` forgets them, `cancel_export` unfreezes them. `import_state` queues them first in
line; a KV state continues at once, a KV-less one is re-prefilled: with `reprefill="replay"` (default) the
prompt is prefilled and the generated tokens are fed back through decode rows, reproducing the source's KV
bit for bit; `"single_pass"` prefills prompt + generated in one forward (faster; what a vLLM backend does;
equal up to round-off, so a rare near-tie can flip).

Example::

    engine = NativeEngine(model, EngineConfig(max_running_requests=8))
    engine.add(Request("a", (1, 5, 7), SamplingParams(temperature=1.0, max_new_tokens=8), seed=3))
    while engine.has_work():
        for ev in engine.step():
            if ev.finished: print(ev.result.token_ids)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch

from tidal.core.errors import TidalError
from tidal.engine.generation import decode_attention, decode_gemm, fused, sample_kernel, sampler
from tidal.engine.generation.kv_cache import PagedKVCache, RowGroup
from tidal.engine.generation.protocol import (
    TRANSITIONS,
    EngineStatus,
    GenerationEngine,
    GenerationError,
    IllegalTransition,
    check_importable,
    check_request_ids,
)
from tidal.engine.generation.requests import Request, RequestEvent, RequestResult, RequestState
from tidal.engine.model import EAGER, Transformer
from tidal.engine.shapes import padded_len
from tidal.engine.tp import group_size

CPU_ROW_MULTIPLE = 64
ROW_BUCKETS_MIN = 8   # compact rows (`EngineConfig.compact_rows`): powers of two from 8 up to the engine's width
PREFILL_GRAPHS = 32  # captured prefill graphs kept per engine (one per prompt length)
PREFILL_TOKENS = 16384  # CUDA: most tokens (rows x padded width) of one batched prefill
CPU_KV_BLOCK = 16   # positions per KV block where the Triton decode attention does not run (SDPA gathers them)


@dataclass(frozen=True)
class EngineConfig:
    max_running_requests: int = 64
    """Most requests decoding at once (RLinf key `rollout.max_running_requests`); the decode width."""
    kv_budget_bytes: int | None = None
    """KV memory this engine may use, in blocks held by requests as their tokens need them (must hold one
    request at `max_seq_len`). None: enough for every running request at `max_seq_len` (never preempts)."""
    kv_block_size: int | None = None
    """Positions per KV block. None: 256 (one chunk of the Triton decode attention) where that kernel runs, else
    16. With the Triton kernel a multiple of its 64-key loads."""
    reprefill: Literal["replay", "single_pass"] = "replay"
    """How a KV-less imported request rebuilds its KV (see module doc)."""
    cuda_graph: bool = True
    """On CUDA (TP 1), replay one captured CUDA graph per decode step instead of launching each kernel."""
    batch_invariant: bool | None = None
    """True: a request's tokens do not depend on what shares its batch (each decode row reads its own key span,
    prompts prefill one at a time). False: one key span per decode step (one CUDA graph per span) and batched
    prefill: faster, equal only up to round-off. None: True on CPU, False on CUDA."""
    fused_kernels: bool | None = None
    """Packed q/k/v and gate/up GEMMs and compiled elementwise stages (`tidal.engine.generation.fused`): fewer
    launches per step, other round-off than eager. None: on in the step-wide mode on CUDA where Triton is
    installed. True elsewhere is refused (it needs CUDA and Triton)."""
    decode_attention: Literal["sdpa", "triton"] | None = None
    """Step-wide decode attention on CUDA: `sdpa` (torch's kernels over the step's key span) or `triton`
    (`tidal.engine.generation.decode_attention`: split-K, each row reading its own keys, its K/V written in the
    same launch; needs the fused kernels). None: `triton` where the fused kernels run and the head dim and dtype
    suit it (`benchmarks/rollout.py --kernels fused,triton`: 7% fewer ms per decode step on an H200 at batch 64),
    else `sdpa`."""
    decode_gemm: Literal["cublas", "triton"] | None = None
    """The decode step's projections on CUDA: `cublas` (torch's GEMMs, with the compiled norms and SiLU product
    between them) or `triton` (`tidal.engine.generation.decode_gemm`: weight-streaming GEMMs with the SiLU
    product, the residual adds and the norms fused in; a row's sums independent of the batch; TP 1) for steps of
    up to `decode_gemm.MAX_ROWS` rows, cuBLAS above. None: `triton` where the Triton decode attention runs at
    TP 1, else `cublas`."""
    overlap: bool | None = None
    """Launch decode step n+1 before reading step n's tokens back, its inputs fed from the device (each row's
    token of step n, its position + 1), so the host's per-step work (recording tokens, drawing the next uniforms)
    runs while the GPU computes. `step()` then returns the events of the step launched by the call before.
    A request's tokens are the same as without it (see module doc). None: on for CUDA (12% fewer ms per decode
    step on an H200 at batch 64), off on CPU, where the host computes the step itself."""
    compact_rows: bool | None = None
    """Step-wide mode: a decode step computes only the active requests' rows, gathered from their slots, in
    `ROW_BUCKETS`-sized batches (one CUDA graph per bucket and span), instead of a row for every slot. A
    GRPO step's long tail (a few requests still generating, most slots free) then costs what its few rows cost.
    A row's round-off may then depend on the bucket (cuBLAS picks kernels by batch size), like a batched
    prefill's. None: on where the Triton decode attention runs (it reads each row's slot through an index);
    refused with `batch_invariant` (its rows are the slots)."""
    vocab_limit: int | None = None
    """Sample only ids below this (the tokenizer's size) when the embedding is padded past it (Qwen: 151,936
    rows for 151,665 tokens): the padding rows are never emitted. None: every row of the embedding."""

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise TidalError("rollout.max_running_requests", self.max_running_requests, "must be >= 1", "e.g. 64")
        if self.kv_budget_bytes is not None and self.kv_budget_bytes < 1:
            raise TidalError("kv_budget_bytes", self.kv_budget_bytes, "must be positive", "omit it for no cap")
        if self.kv_block_size is not None and self.kv_block_size < 1:
            raise TidalError("kv_block_size", self.kv_block_size, "must be >= 1", "e.g. 256, or None")
        if self.vocab_limit is not None and self.vocab_limit < 2:
            raise TidalError("vocab_limit", self.vocab_limit, "must be >= 2", "the tokenizer's size, or None")
        if self.reprefill not in ("replay", "single_pass"):
            raise TidalError("reprefill", self.reprefill, "unknown mode", 'use "replay" or "single_pass"')
        if self.decode_attention not in (None, "sdpa", "triton"):
            raise TidalError("decode_attention", self.decode_attention, "unknown kernel", 'use "sdpa" or "triton"')
        if self.decode_gemm not in (None, "cublas", "triton"):
            raise TidalError("decode_gemm", self.decode_gemm, "unknown kernel", 'use "cublas" or "triton"')

    @staticmethod
    def from_rollout(rollout_cfg, kv_budget_bytes: int | None = None) -> EngineConfig:
        return EngineConfig(rollout_cfg.max_running_requests, kv_budget_bytes)


@dataclass
class _Launched:
    """A decode step on its way: its rows (request, slot, samples: False for a replay row), the generator states
    before its draws (overlap: restored if the step is discarded), the keys it reads, and its tokens and
    log-probs (host copies once `ready` has passed; None: read them directly)."""

    rows: list[tuple[_Live, int, bool]]
    index: list[int]   # each row's index in `tok` / `lp` (its slot; its position with compact rows)
    drew: list[tuple[_Live, torch.Tensor]]
    keys: int
    tok: torch.Tensor
    lp: torch.Tensor
    ready: Any


@dataclass
class _Live:
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
    pending_kv: list | None = None  # imported KV waiting for a slot
    frozen: bool = False  # exported, waiting for commit/cancel
    migrations: int = 0

    def all_tokens(self) -> list[int]:
        return list(self.request.prompt_ids) + self.tokens


class NativeEngine(GenerationEngine):
    def __init__(self, model: Transformer, config: EngineConfig = EngineConfig(), policy_version: int = 0):
        self.model, self.config, self._version = model, config, int(policy_version)
        self.args = model.args
        if config.vocab_limit is not None and config.vocab_limit > self.args.vocab_size:
            raise TidalError("vocab_limit", config.vocab_limit, f"exceeds the model's {self.args.vocab_size} rows",
                             "use a tokenizer no larger than the model's embedding")
        self._vocab = config.vocab_limit or self.args.vocab_size
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.tp = group_size(model.tp_group)
        kv_heads = self.args.num_kv_heads // self.tp
        s = self.args.max_seq_len
        width = self.width = config.max_running_requests
        # decode rows: on CPU a multiple of 64, so no elementwise kernel has a scalar tail (see module doc)
        self.rows = width if self.device.type != "cpu" else -(-width // CPU_ROW_MULTIPLE) * CPU_ROW_MULTIPLE
        # decode key spans and prefill batching (see module doc and `EngineConfig.batch_invariant`)
        self._row_spans = config.batch_invariant if config.batch_invariant is not None else self.device.type == "cpu"
        can_fuse = fused.available(self.device)
        if config.fused_kernels and not can_fuse:
            raise TidalError("fused_kernels", True, f"needs a CUDA device with Triton (this engine is on "
                             f"{self.device})", "leave it None (on where it can run) or set False")
        self._fused = config.fused_kernels if config.fused_kernels is not None else can_fuse and not self._row_spans
        self._kernels = fused.compiled_kernels() if self._fused else EAGER
        # step-wide decode attention in Triton (each row reads its own keys, writes its K/V in the same launch)
        can_attend = self._fused and decode_attention.supported(self.args.head_dim, self.dtype)
        attention = config.decode_attention or ("triton" if can_attend else "sdpa")
        self._fused_attention = attention == "triton"
        if self._fused_attention and not can_attend:
            raise TidalError("decode_attention", "triton", f"needs the fused kernels (step-wide mode on CUDA) and a "
                             f"power-of-two head dim in bf16/fp16 (this engine: fused={int(self._fused)}, head_dim="
                             f"{self.args.head_dim}, {self.dtype})", 'use "sdpa"')
        if self._fused:
            model.pack_projections()
        can_gemm = self._fused_attention and decode_gemm.usable(model)
        gemm = config.decode_gemm or ("triton" if can_gemm else "cublas")
        self._decode_gemm = gemm == "triton"
        if self._decode_gemm and not can_gemm:
            raise TidalError("decode_gemm", "triton", f"needs the Triton decode attention, TP 1 and a bf16/fp16 "
                             f"model on CUDA (this engine: attention={attention}, tp={self.tp}, {self.dtype})",
                             'use "cublas"')
        if config.compact_rows and self._row_spans:
            raise TidalError("compact_rows", True, "needs the step-wide mode (its rows are gathered from their "
                             "slots); the batch-invariant mode computes a row per slot",
                             "set batch_invariant False, or leave compact_rows None")
        self._compact = config.compact_rows if config.compact_rows is not None else (
            self._fused_attention and not self._row_spans)
        # the block size changes no bits: SDPA reads gathered contiguous copies, the Triton kernel the same sums
        self.numerics = (f"rows={self.rows},dtype={self.dtype},"
                         f"device={self.device.type},tp={self.tp},seq={s},"
                         f"span={'row' if self._row_spans else 'step'},fused={int(self._fused)},"
                         f"attention={attention},compact={int(self._compact)},gemm={gemm}")
        block = config.kv_block_size or (decode_attention.CHUNK if self._fused_attention else CPU_KV_BLOCK)
        if self._fused_attention and block % decode_attention.BLOCK_N:
            raise TidalError("kv_block_size", block, f"must be a multiple of the Triton decode attention's "
                             f"{decode_attention.BLOCK_N}-key loads", "e.g. 256, or None")
        per_request = -(-s // block)   # blocks of a request at max_seq_len
        block_bytes = PagedKVCache.block_bytes(self.args.num_layers, kv_heads, block, self.args.head_dim, self.dtype)
        blocks = width * per_request
        if config.kv_budget_bytes is not None:
            fit = config.kv_budget_bytes // block_bytes - 1   # less the null block
            if fit < per_request:
                raise TidalError("kv_budget_bytes", config.kv_budget_bytes,
                                 f"leaves no room for one request at max_seq_len={s} ({per_request} blocks of "
                                 f"{block} positions, {block_bytes} bytes each, + the null block)",
                                 f"give at least {(per_request + 1) * block_bytes} bytes, or lower model.max_seq_len")
            blocks = min(blocks, fit)
        # padding rows use one dummy slot (its table row holds no block): `width` real slots + 1
        self._dummy = width if self.rows > width or self._compact else None
        self.cache = PagedKVCache(self.args.num_layers, width + (self._dummy is not None), blocks + 1, block,
                                  kv_heads, s, self.args.head_dim, self.dtype, self.device)
        self._row_slot_list = [min(r, width) for r in range(self.rows)]   # row -> slot (padding rows: the dummy)
        self._row_slot = torch.tensor(self._row_slot_list, device=self.device)
        self.status = EngineStatus.READY
        self._param_shapes = {n: tuple(q.shape) for n, q in model.named_parameters()}
        self._offload: dict[str, torch.Tensor] | None = None
        self._weights_kept = False   # released with keep_weights: only the KV cache was freed
        self._live: dict[str, _Live] = {}
        self._waiting: deque[str] = deque()
        self._slots: list[str | None] = [None] * width
        self._gone: dict[str, str] = {}  # id -> "finished" / "aborted" / "migrated away" (for error messages)
        self.tokens_generated = 0
        # work counters (a function of the tokens, not of max_seq_len): prompt tokens prefilled (padding included)
        # and key positions read by decode rows, summed over every row a step computes
        self.prefill_tokens = 0
        self.keys_read = 0
        self.preemptions = 0   # requests preempted for want of KV blocks (re-prefilled later)
        self._admissions = 0
        # per-slot sampling params, kept on the device (inactive slots are greedy and ignored); compact rows gather
        # theirs (the dummy slot's included)
        per_slot = self.rows + (self._compact and self.rows == width)
        self._temp = torch.zeros(per_slot, device=self.device)
        self._top_p = torch.ones(per_slot, device=self.device)
        self._top_k = torch.zeros(per_slot, dtype=torch.long, device=self.device)
        # their host copies, written as requests come and go and uploaded before the next device work reads them
        # (`_upload_params`): an element write to a device tensor is a blocking copy, behind every queued step
        self._params_h: tuple[list[float], list[float], list[int]] = ([0.0] * per_slot, [1.0] * per_slot,
                                                                      [0] * per_slot)
        self._params_dirty = False
        self._use_graph = config.cuda_graph and self.device.type == "cuda" and self.tp == 1
        self._overlap = config.overlap if config.overlap is not None else self.device.type == "cuda"
        self._launched: _Launched | None = None   # overlap: the decode step launched ahead, not read back yet
        # its tokens, per row (per slot with compact rows: a request's row changes between steps, its slot does not)
        self._prev_tok = torch.zeros(per_slot, dtype=torch.long, device=self.device)
        # (rows, decode span, filtered) -> (graph, its outputs); rows -> the graphs' static inputs
        self._graphs: dict[tuple[int, int, bool], tuple] = {}
        self._static: dict[int, list[torch.Tensor | None]] = {}
        self._prefill_graphs: dict[int, tuple] = {}
        self._graph_pool: Any = None   # one memory pool for every captured decode graph

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        return self._version

    def request_ids(self) -> list[str]:
        return [rid for rid, lv in self._live.items() if not lv.frozen]

    def num_running(self) -> int:
        return sum(1 for rid in self._slots if rid is not None and not self._live[rid].frozen)

    def num_waiting(self) -> int:
        return sum(1 for rid in self._waiting if not self._live[rid].frozen)

    def free_slots(self) -> int:
        return self._slots.count(None)

    # ---- requests in -------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self._need_ready("add")
        if request.request_id in self._live:
            raise GenerationError(f"add: request {request.request_id!r} is already in flight on this engine "
                                  "(ids must be unique per engine; derive them from step, group and sample)")
        self._check_prompt(request)
        gen = torch.Generator().manual_seed(request.seed)
        self._live[request.request_id] = _Live(request, gen)
        self._gone.pop(request.request_id, None)
        self._waiting.append(request.request_id)

    def _check_prompt(self, request: Request) -> None:
        n, s, v = len(request.prompt_ids), self.args.max_seq_len, self.args.vocab_size
        if n >= s:
            raise TidalError("prompt_ids", n, f"request {request.request_id!r}: a prompt of {n} tokens leaves no "
                             f"room to generate within max_seq_len={s}",
                             "shorten the prompt or raise model.max_seq_len")
        bad = [t for t in request.prompt_ids if not 0 <= t < v]
        if bad:
            raise TidalError("prompt_ids", bad[:5], f"request {request.request_id!r}: token ids outside the vocab "
                             f"[0, {v})", "tokenize with the model's tokenizer")

    # ---- the loop ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[RequestEvent]:
        self._need_ready("step")
        events: list[RequestEvent] = []
        self._admit(events)
        if self._overlap:   # launch the next step, then read back the one launched by the previous call
            inflight, self._launched = self._launched, None
            self._launched = self._launch(inflight)
            if inflight is not None:
                self._consume(inflight, events)
        elif any(rid is not None and not self._live[rid].frozen for rid in self._slots):
            self._decode(events)
        return events

    @torch.no_grad()
    def admit(self) -> list[RequestEvent]:
        """Admit waiting requests into free slots (prefill, or load moved KV) without a decode step. `step()`
        does this first anyway; calling it alone lets a driver prefill ahead or time a migration."""
        self._need_ready("admit")
        events: list[RequestEvent] = []
        self._admit(events)
        return events

    def _admit(self, events: list[RequestEvent]) -> None:
        skipped: list[str] = []
        jobs: list[tuple[_Live, list[int]]] = []   # prefills of this admission, in admission order
        # running requests that may still need a block: admission leaves one free block for each
        growing = sum(1 for rid in self._slots if rid is not None and self._may_grow(self._live[rid]))
        while self._waiting and None in self._slots:
            live = self._live[self._waiting[0]]
            if live.frozen:
                skipped.append(self._waiting.popleft())
                continue
            slot = self._slots.index(None)
            if not self._admit_blocks(slot, live, growing):
                break   # FIFO: nothing overtakes the head of the queue
            rid = self._waiting.popleft()
            self._slots[slot], live.slot = rid, slot
            growing += self._may_grow(live)
            live.admitted = self._admissions = self._admissions + 1
            p = live.request.params
            temp, top_p, top_k = self._params_h
            temp[slot], top_p[slot], top_k[slot] = p.temperature, p.top_p, p.top_k
            self._params_dirty = True
            if live.pending_kv is not None:
                live.kv_len = self.cache.write(slot, [(k.to(self.device, self.dtype), v.to(self.device, self.dtype))
                                                      for k, v in live.pending_kv])
                live.pending_kv = None
                live.replay = deque(live.all_tokens()[live.kv_len:-1])
            elif live.tokens:  # imported without KV: re-prefill
                upto = len(live.request.prompt_ids) if self.config.reprefill == "replay" else -1
                jobs.append((live, live.all_tokens()[:upto]))
            else:
                jobs.append((live, list(live.request.prompt_ids)))
        self._waiting.extendleft(reversed(skipped))
        self._upload_params()
        self.cache.upload()
        for (live, _), logits in zip(jobs, self._prefill_all(jobs)):
            if live.tokens:   # re-prefilled: the recorded tokens after the prefilled ones replay through decode rows
                live.replay = deque(live.all_tokens()[live.kv_len:-1])
                continue
            live.version = self._version
            slot = cast(int, live.slot)
            u = self._uniforms([live], [True])
            tok = sampler.sample(logits, self._temp[slot:slot + 1], self._top_p[slot:slot + 1],
                                 self._top_k[slot:slot + 1], u)
            lp = sampler.logprobs(logits, tok)
            self._record(live, int(tok.item()), float(lp.item()), events)

    def _admit_blocks(self, slot: int, live: _Live, growing: int) -> bool:
        """Blocks for what the request's admission writes and its first decode position, if that leaves a free
        block for each of the `growing` running requests that may still grow (so admissions do not force
        preemptions at once); a lone request is admitted whenever its blocks are free."""
        if live.pending_kv is not None:
            positions = live.pending_kv[0][0].shape[1] + 1
        elif live.tokens and self.config.reprefill == "single_pass":
            positions = len(live.all_tokens())
        else:   # a prompt, or a re-prefill that replays its tokens through decode rows (they grow as they go)
            positions = len(live.request.prompt_ids) + 1
        if self.cache.free_blocks - self.cache.blocks_for(positions) < growing:
            return False
        return self.cache.grow(slot, positions)

    def _may_grow(self, live: _Live) -> bool:
        """An active request whose longest possible length needs more blocks than it holds."""
        longest = min(len(live.request.prompt_ids) + live.request.params.max_new_tokens, self.args.max_seq_len)
        return not live.frozen and self.cache.held(cast(int, live.slot)) < self.cache.blocks_for(longest)

    def _grow(self, ahead: dict[int, bool], inflight: _Launched | None) -> None:
        """Blocks for the position each active row writes in the step being launched (`ahead`: the in-flight
        step's rows), oldest request first. When none is free the newest active request is preempted (its blocks
        freed, `_preempt`); frozen requests keep theirs (their rows write where they hold no block: the null
        block). Per step only a comparison per row: a row crosses into a new block once every block_size steps."""
        capacity = self.cache.block_size
        need: list[tuple[_Live, int]] = []
        for rid in self._slots:
            live = self._live[rid] if rid is not None else None
            if live is None or live.frozen:
                continue
            was = ahead.get(id(live))
            if was is True and self._finishes_by_length(live, 1):
                continue   # ends in the in-flight step
            positions = live.kv_len + (was is not None) + 1
            if positions > self.cache.held(cast(int, live.slot)) * capacity:
                need.append((live, positions))
        for live, positions in sorted(need, key=lambda lp: lp[0].admitted):
            while live.slot is not None and not self.cache.grow(live.slot, positions):
                self._preempt(max((self._live[rid] for rid in self._slots
                                   if rid is not None and not self._live[rid].frozen),
                                  key=lambda lv: lv.admitted), inflight)
        self.cache.upload()

    def _preempt(self, live: _Live, inflight: _Launched | None) -> None:
        """Free a request's slot and blocks and put it first in line; re-admitted, it re-prefills its prompt
        and replays its tokens through decode rows (its KV rebuilt bit for bit on CPU). A row it has in the
        in-flight step is skipped when read back, and that row's draw rolled back."""
        for drawn, state in inflight.drew if inflight is not None else ():
            if drawn is live:
                live.generator.set_state(state)
        self._free_slot(live)
        live.kv_len, live.replay = 0, deque()
        self._waiting.appendleft(live.request.request_id)
        self.preemptions += 1

    def _prefill_all(self, jobs: list[tuple[_Live, list[int]]]) -> list[torch.Tensor]:
        """Write each job's K/V into its slot; the last position's full logits [1, V] of each. CPU: one request
        at a time (a prompt's prefill is the same computation wherever it runs). CUDA: right-padded batches of
        up to PREFILL_TOKENS tokens (a lone prompt through its captured graph)."""
        if self._row_spans:
            return [self._prefill(live, ids) for live, ids in jobs]
        out: list[torch.Tensor] = []
        lo = 0
        while lo < len(jobs):
            hi, width = lo + 1, padded_len(len(jobs[lo][1]), self.args.max_seq_len)
            while hi < len(jobs):
                w = max(width, padded_len(len(jobs[hi][1]), self.args.max_seq_len))
                if (hi - lo + 1) * w > PREFILL_TOKENS:
                    break
                hi, width = hi + 1, w
            chunk = jobs[lo:hi]
            out += [self._prefill(*chunk[0])] if len(chunk) == 1 else self._prefill_batch(chunk, width)
            lo = hi
        return out

    def _prefill_batch(self, jobs: list[tuple[_Live, list[int]]], width: int) -> list[torch.Tensor]:
        """Right-padded prompts [n, width] in one causal forward (padding sits after every real token, so it
        changes no real position's output; its K/V lands past each slot's kv_len, where decode masks it)."""
        lengths = [len(ids) for _, ids in jobs]
        ids_BT = torch.zeros((len(jobs), width), dtype=torch.long)
        for b, (live, ids) in enumerate(jobs):
            ids_BT[b, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            live.kv_len = len(ids)
        self.prefill_tokens += len(jobs) * width
        slots = torch.tensor([cast(int, live.slot) for live, _ in jobs], device=self.device)
        pos_BT = torch.arange(width, device=self.device).expand(len(jobs), width)
        h = self.model.hidden(ids_BT.to(self.device), pos_BT, None, self.cache.prefill_writer(slots), self._kernels)
        last = h[torch.arange(len(jobs), device=self.device), torch.tensor(lengths, device=self.device) - 1]
        logits = self.model.full_logits(self.model.logits_local(last[:, None]))[:, -1, :self._vocab].float()
        return list(logits.split(1))

    def _prefill(self, live: _Live, ids: list[int]) -> torch.Tensor:
        """Write the K/V of `ids` into the request's slot; return the last position's full logits [1, V]."""
        t = len(ids)
        live.kv_len = t
        self.prefill_tokens += t
        ids_1T = torch.tensor([ids], dtype=torch.long)
        slot = cast(int, live.slot)  # prefill runs on admitted requests, which hold a slot
        if self._use_graph:
            return self._graph_prefill(ids_1T, slot)
        return self._prefill_forward(ids_1T.to(self.device), torch.tensor([slot], device=self.device))

    def _prefill_forward(self, ids_1T: torch.Tensor, slot_1: torch.Tensor) -> torch.Tensor:
        pos_1T = torch.arange(ids_1T.shape[1], device=self.device)[None]
        h = self.model.hidden(ids_1T, pos_1T, None, self.cache.prefill_writer(slot_1), self._kernels)
        return self.model.full_logits(self.model.logits_local(h[:, -1:]))[:, -1, :self._vocab].float()

    def _graph_prefill(self, ids_1T: torch.Tensor, slot: int) -> torch.Tensor:
        """CUDA: one captured graph per prompt length (LRU, at most PREFILL_GRAPHS), slot as a device index."""
        t = ids_1T.shape[1]
        entry = self._prefill_graphs.pop(t, None)
        if entry is None:
            static_ids = ids_1T.to(self.device)
            static_slot = torch.tensor([slot], device=self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # warm-up writes this request's own K/V into its own blocks
                self._prefill_forward(static_ids, static_slot)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self._prefill_forward(static_ids, static_slot)
            entry = (graph, static_ids, static_slot, out)
            while len(self._prefill_graphs) >= PREFILL_GRAPHS:
                self._prefill_graphs.pop(next(iter(self._prefill_graphs)))
        self._prefill_graphs[t] = entry  # most recent last
        graph, static_ids, static_slot, out = entry
        static_ids.copy_(ids_1T, non_blocking=True)
        static_slot.fill_(slot)
        graph.replay()
        return out

    def _decode(self, events: list[RequestEvent]) -> None:
        """One decode step, launched and read back (without overlap)."""
        launched = self._launch(None)
        if launched is not None:
            self._consume(launched, events)

    def _launch(self, inflight: _Launched | None) -> _Launched | None:
        """Start a decode step over the active rows; `inflight`: the step launched before and not read back
        yet, whose rows this one continues (input token from the device, position + 1). None: no active row."""
        ahead = {id(lv): samples for lv, _, samples in inflight.rows} if inflight is not None else {}
        self._grow(ahead, inflight)
        ids, pos, prev = [0] * self.rows, [0] * self.rows, [False] * self.rows
        rows: list[tuple[_Live, int, bool]] = []
        for slot, rid in enumerate(self._slots):
            if rid is None:
                continue
            live = self._live[rid]
            was = ahead.get(id(live))   # None: not in the in-flight step; True: sampling there; False: replaying
            pos[slot] = live.kv_len + (was is not None)  # frozen rows write past their valid length: harmless
            if live.frozen:
                continue
            replay = len(live.replay) - (was is False)   # recorded tokens still to feed after the in-flight step
            if was is True and self._finishes_by_length(live, 1):
                continue   # ends in the in-flight step: no row here (its throw-away write lands past its tokens)
            if was is True:
                prev[slot] = True
            elif replay > 0:
                ids[slot] = live.replay[len(live.replay) - replay]
            else:
                ids[slot] = live.tokens[-1]
            rows.append((live, slot, replay <= 0))
        if not rows:
            return None
        self._upload_params()
        drew = [(lv, lv.generator.get_state()) for lv, _, samples in rows if samples and not lv.request.params.greedy
                ] if self._overlap else []
        u_list = [0.0] * self.rows   # built on the host, one tensor a step: no per-row tensor writes or syncs
        for (_, slot, _), x in zip(rows, self._draws([lv for lv, _, _ in rows], [sm for _, _, sm in rows])):
            u_list[slot] = x
        u, ids_R, pos_R = self._host(u_list, torch.float32), self._host(ids, torch.long), self._host(pos, torch.long)
        index = [slot for _, slot, _ in rows]
        slots_R = None
        if self._compact:   # the active rows only, in a bucket of rows; padding rows read and write the dummy slot
            n = len(rows)
            bucket = min(self.width, max(ROW_BUCKETS_MIN, 1 << (n - 1).bit_length()))
            pad = bucket - n
            dummy = cast(int, self._dummy)
            ids, pos = [ids[i] for i in index] + [0] * pad, [pos[i] for i in index] + [0] * pad
            prev, u_list = [prev[i] for i in index] + [False] * pad, [u_list[i] for i in index] + [0.0] * pad
            slots_R = self._host(index + [dummy] * pad, torch.long)
            index = list(range(n))
        u, ids_R, pos_R = self._host(u_list, torch.float32), self._host(ids, torch.long), self._host(pos, torch.long)
        prev_R = self._host(prev, torch.bool) if self._overlap else None
        # the vocab sort of top-k / top-p runs only in steps where some row asks for it (a row's token never
        # depends on this: `sampler.sample`)
        filtered = any(lv.request.params.top_p < 1 or lv.request.params.top_k > 0 for lv, _, _ in rows)
        if self._row_spans:
            groups = self._row_groups(pos)
            keys = sum(len(g.rows) * g.span for g in groups)
            tok, lp = self._decode_forward(*self._to_device(ids_R, pos_R, u, prev_R), filtered, groups=groups)
        else:
            # one span for the step: the longest active row's keys, bucketed (frozen and empty rows are discarded)
            longest = max(pos[i] for i in index) + 1
            span = self._grid_span(longest) if self._fused_attention else padded_len(longest, self.args.max_seq_len)
            # the fused kernel reads each row's keys 0..pos (empty rows: one key); SDPA the step's span
            keys = sum(p + 1 for p in pos) if self._fused_attention else len(pos) * span
            if self._use_graph and (self._compact or self.rows == self.width):
                tok, lp = self._graph_decode(ids_R, pos_R, u, prev_R, filtered, span, slots_R)
            else:
                slots = slots_R.to(self.device, non_blocking=True) if slots_R is not None else None
                tok, lp = self._decode_forward(*self._to_device(ids_R, pos_R, u, prev_R), filtered, span=span,
                                               slots_R=slots)
        return _Launched(rows, index, drew, keys, *self._read_back(tok, lp))

    def _upload_params(self) -> None:
        """The slots' sampling params to the device, one asynchronous copy per tensor, stream-ordered before the
        next prefill or decode step that reads them."""
        if not self._params_dirty:
            return
        self._params_dirty = False
        temp, top_p, top_k = self._params_h
        self._temp.copy_(self._host(temp, self._temp.dtype), non_blocking=True)
        self._top_p.copy_(self._host(top_p, self._top_p.dtype), non_blocking=True)
        self._top_k.copy_(self._host(top_k, self._top_k.dtype), non_blocking=True)

    def _grid_span(self, keys: int) -> int:
        """The Triton decode attention's `span` for a step whose longest row reads `keys` keys: it only sizes the
        kernel's grid (a chunk past a row's position exits at once; the sums do not depend on it), so steps share
        a few CUDA graphs: chunk counts in powers of two, at most the chunks of max_seq_len."""
        chunks = -(-keys // decode_attention.CHUNK)
        most = -(-self.args.max_seq_len // decode_attention.CHUNK)
        return decode_attention.CHUNK * min(most, 1 << (chunks - 1).bit_length())

    def _host(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A step input on the host; pinned where overlap copies it to a GPU (an async copy from pageable memory
        would wait for the device to finish its queue)."""
        return torch.tensor(values, dtype=dtype, pin_memory=self._overlap and self.device.type == "cuda")

    def _to_device(self, ids: torch.Tensor, pos: torch.Tensor, u: torch.Tensor, prev: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        ids, pos, u = (x.to(self.device, non_blocking=True) for x in (ids, pos, u))
        return ids, pos, u, prev.to(self.device, non_blocking=True) if prev is not None else None

    def _read_back(self, tok: torch.Tensor, lp: torch.Tensor):
        """Host copies of a step's tokens and log-probs: on CUDA with overlap, pinned buffers filled after the
        step on its stream and an event marking them (so reading them waits for this step only)."""
        if not (self._overlap and tok.is_cuda):
            return tok, lp, None
        tok_h = torch.empty(tok.shape, dtype=tok.dtype, pin_memory=True).copy_(tok, non_blocking=True)
        lp_h = torch.empty(lp.shape, dtype=lp.dtype, pin_memory=True).copy_(lp, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return tok_h, lp_h, ready

    def _consume(self, launched: _Launched, events: list[RequestEvent]) -> None:
        """Read a launched step's tokens back and record them. Rows whose request finished, left or was aborted
        since the launch are skipped (their row was a throw-away)."""
        if launched.ready is not None:
            launched.ready.synchronize()
        tok_l, lp_l = launched.tok.tolist(), launched.lp.tolist()
        self.keys_read += launched.keys
        for (live, slot, samples), row in zip(launched.rows, launched.index):
            if self._live.get(live.request.request_id) is not live or live.slot != slot:
                continue
            live.kv_len += 1
            if not samples:
                live.replay.popleft()
                continue
            self._record(live, tok_l[row], lp_l[row], events)

    def _discard_launched(self) -> None:
        """Drop the step launched ahead (overlap) unread: roll its rows' generators back to before its draws.
        Its K/V writes sit at the positions the next real step writes again, with the same values."""
        launched, self._launched = self._launched, None
        if launched is not None:
            for live, state in launched.drew:
                live.generator.set_state(state)

    def _finishes_by_length(self, live: _Live, more: int) -> bool:
        """The request reaches max_new_tokens or max_seq_len once `more` further tokens are recorded."""
        n = len(live.tokens) + more
        return n >= live.request.params.max_new_tokens or len(live.request.prompt_ids) + n >= self.args.max_seq_len

    def _row_groups(self, pos: list[int]) -> list[RowGroup]:
        """Rows by their own key span (position + 1, bucketed): the exact path, whatever shares the step."""
        by_span: dict[int, list[int]] = {}
        for r in range(self.rows):
            by_span.setdefault(padded_len(pos[r] + 1, self.args.max_seq_len), []).append(r)
        return [RowGroup(rows, [self._row_slot_list[r] for r in rows], [pos[r] for r in rows], span, self.device)
                for span, rows in sorted(by_span.items())]

    def _decode_forward(self, ids_R: torch.Tensor, pos_R: torch.Tensor, u_R: torch.Tensor,
                        prev_R: torch.Tensor | None, filtered: bool, *, span: int | None = None,
                        groups: list[RowGroup] | None = None, slots_R: torch.Tensor | None = None):
        """The decode math: R rows in, (token, rollout log-prob) per row out. No host syncs. With overlap, rows
        marked in `prev_R` take the token the previous decode step sampled (kept on the device). `slots_R`
        (compact rows): each row's slot, whose KV, sampling params and previous token it reads."""
        if slots_R is not None:
            temp, top_p, top_k = self._temp[slots_R], self._top_p[slots_R], self._top_k[slots_R]
            if prev_R is not None:
                ids_R = torch.where(prev_R, self._prev_tok[slots_R], ids_R)
            row_slot = slots_R
        else:
            temp, top_p, top_k = self._temp, self._top_p, self._top_k
            if prev_R is not None:
                ids_R = torch.where(prev_R, self._prev_tok, ids_R)
            row_slot = self._row_slot
        decoder = self.cache.decoder(pos_R, row_slot, span, groups, fused=self._fused_attention and span is not None)
        if self._decode_gemm and ids_R.shape[0] <= decode_gemm.MAX_ROWS:
            logits_local = self.model.logits_local(decode_gemm.decode_hidden(self.model, ids_R, pos_R, decoder,
                                                                             self._kernels))
        else:
            logits_local = self.model(ids_R[:, None], pos_R[:, None], None, decoder, self._kernels)
        logits = self.model.full_logits(logits_local)[:, -1, :self._vocab]
        if self._fused and not filtered:   # the token and its log-prob in Triton (`sample_kernel`)
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

    def _graph_decode(self, ids_R: torch.Tensor, pos_R: torch.Tensor, u_R: torch.Tensor,
                      prev_R: torch.Tensor | None, filtered: bool, span: int, slots_R: torch.Tensor | None = None):
        """CUDA: replay the captured graph of `_decode_forward` at this row count, key span and sampler (one
        capture per triple, all in one memory pool; the kernels are the eager ones, so the results are too).
        Captured lazily, dropped on release."""
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
                    self._decode_forward(ids_s, pos_s, u_s, prev_s, filtered, span=span, slots_R=slots_s)
                self._prev_tok.copy_(kept)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._graph_pool):
                out = self._decode_forward(ids_s, pos_s, u_s, prev_s, filtered, span=span, slots_R=slots_s)
            self._graphs[(rows, span, filtered)] = entry = (graph, out)
        entry[0].replay()
        return entry[1]

    def _uniforms(self, lives: list[_Live], sampling: list[bool]) -> torch.Tensor:
        """`_draws` as an fp32 tensor on the device."""
        return torch.tensor(self._draws(lives, sampling), dtype=torch.float32, device=self.device)

    @staticmethod
    def _draws(lives: list[_Live], sampling: list[bool]) -> list[float]:
        """One uniform per sampling, non-greedy request, drawn from its own generator (0 for the others)."""
        return [torch.rand((), generator=lv.generator).item() if s and not lv.request.params.greedy else 0.0
                for lv, s in zip(lives, sampling)]

    def _record(self, live: _Live, token: int, logprob: float, events: list[RequestEvent]) -> None:
        live.tokens.append(token)
        live.logprobs.append(logprob)
        self.tokens_generated += 1
        p = live.request.params
        reason = None
        if token in p.stop_token_ids:
            reason = "stop"
        elif self._finishes_by_length(live, 0):
            reason = "length"
        new: tuple[tuple[int, ...], tuple[float, ...]] = ((token,), (logprob,)) if live.request.stream else ((), ())
        if reason is None:
            if live.request.stream:
                events.append(RequestEvent(live.request.request_id, *new))
            return
        rid = live.request.request_id
        result = RequestResult(rid, live.request.prompt_ids, tuple(live.tokens), tuple(live.logprobs), reason,
                               cast(int, live.version), live.migrations)  # set when it sampled a token
        self._remove(rid, "finished")
        events.append(RequestEvent(rid, *new, result=result))

    def _remove(self, rid: str, why: str) -> None:
        live = self._live.pop(rid)
        if live.slot is not None:
            self._free_slot(live)
        else:
            self._waiting.remove(rid)
        self._gone[rid] = why

    def _free_slot(self, live: _Live) -> None:
        slot = cast(int, live.slot)
        self._slots[slot], live.slot = None, None
        self.cache.release(slot)
        self._params_h[0][slot] = 0.0   # inactive slots are greedy (their rows are ignored)
        self._params_dirty = True

    # ---- abort and migration -----------------------------------------------------------------------------
    def _check_ids(self, op: str, ids: Sequence[str], frozen: bool | None) -> list[str]:
        return check_request_ids(op, ids, self._live, self._gone, frozen)

    def abort(self, ids: Sequence[str]) -> None:
        for rid in self._check_ids("abort", ids, None):
            self._remove(rid, "aborted")

    def export_state(self, ids: Sequence[str]) -> list[RequestState]:
        self._need_ready("export_state")
        self._discard_launched()   # the state as of the last step() returned: generators before unread draws
        out = []
        for rid in self._check_ids("export_state", ids, False):
            live = self._live[rid]
            live.frozen = True
            if live.slot is not None:
                kv, kv_len = self.cache.read(live.slot, live.kv_len), live.kv_len
            elif live.pending_kv is not None:
                kv, kv_len = live.pending_kv, live.pending_kv[0][0].shape[1]
            else:
                kv, kv_len = None, 0
            out.append(RequestState(live.request, list(live.tokens), list(live.logprobs),
                                    live.generator.get_state(), live.version, kv, kv_len,
                                    self.numerics if kv is not None else "", live.migrations))
        return out

    def commit_export(self, ids: Sequence[str]) -> None:
        for rid in self._check_ids("commit_export", ids, True):
            self._remove(rid, "migrated away")

    def cancel_export(self, ids: Sequence[str]) -> None:
        for rid in self._check_ids("cancel_export", ids, True):
            self._live[rid].frozen = False

    def activate(self, ids: Sequence[str]) -> None:
        for rid in self._check_ids("activate", ids, True):
            self._live[rid].frozen = False

    def import_state(self, states: Sequence[RequestState], staged: bool = False) -> None:
        """All or nothing: every state is checked before any is installed. `staged`: hold them frozen until
        `activate(ids)` (the target side of a two-phase migration), or drop them with `abort(ids)`."""
        self._need_ready("import_state")
        lives = [self._validate_state(st, [s.request_id for s in states]) for st in states]
        for live in lives:
            live.frozen = staged
            self._live[live.request.request_id] = live
            self._gone.pop(live.request.request_id, None)
        self._waiting.extendleft(reversed([lv.request.request_id for lv in lives]))

    def _validate_state(self, st: RequestState, batch_ids: list[str]) -> _Live:
        where = check_importable(st, batch_ids, self._live, self._version)
        self._check_prompt(st.request)
        if len(st.token_ids) != len(st.logprobs) or len(st.token_ids) > st.request.params.max_new_tokens:
            raise GenerationError(f"{where}: {len(st.token_ids)} tokens, {len(st.logprobs)} log-probs, "
                                  f"max_new_tokens={st.request.params.max_new_tokens}: the state is corrupt")
        gen = torch.Generator()
        gen.set_state(st.generator_state.to("cpu", torch.uint8))
        live = _Live(st.request, gen, list(st.token_ids), list(st.logprobs), st.policy_version,
                     migrations=st.num_migrations + 1)
        if st.kv is not None:
            if st.numerics != self.numerics:
                raise GenerationError(f"{where}: its KV was computed with numerics [{st.numerics}], this engine "
                                      f"has [{self.numerics}]; continuing would not be bit-exact. Give instances "
                                      "equal max_running_requests/kv budget/dtype/TP, or send state.without_kv()")
            n_total = len(st.request.prompt_ids) + len(st.token_ids)
            want = (self.cache.num_kv_heads, st.kv_len, self.args.head_dim)
            ok = len(st.kv) == self.args.num_layers and st.kv_len <= n_total - 1 and all(
                tuple(k.shape) == want and tuple(v.shape) == want for k, v in st.kv)
            if not ok or not st.token_ids:
                raise GenerationError(f"{where}: KV of {len(st.kv)} layers, kv_len {st.kv_len}, shapes "
                                      f"{[tuple(k.shape) for k, _ in st.kv[:1]]}; expected {self.args.num_layers} "
                                      f"layers of {want} with kv_len < prompt + generated ({n_total})")
            live.pending_kv = st.kv
        return live

    # ---- weights and memory ------------------------------------------------------------------------------

    @torch.no_grad()
    def _load(self, weights: Mapping[str, torch.Tensor]) -> None:
        own = dict(self.model.named_parameters())
        missing, extra = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
        if missing or extra:
            raise TidalError("weights", f"missing {missing[:4]}, unexpected {extra[:4]}",
                             "names must be exactly the model's parameter names (param_specs)",
                             "build the shard with tidal.engine.generation.weights.rollout_shard")
        for name in own:
            if tuple(weights[name].shape) != self._param_shapes[name]:
                raise TidalError(f"weights[{name!r}]", tuple(weights[name].shape),
                                 f"is not this rank's TP shard shape {self._param_shapes[name]} (tp={self.tp})",
                                 "build the shard for this rollout TP size with rollout_shard")
        for name, p in own.items():
            p.copy_(weights[name])

    def _check_version(self, version: int) -> None:
        if not isinstance(version, int) or version <= self._version:
            raise TidalError("policy_version", version, f"must be an int above the current {self._version}",
                             "stamp each update with the actor's next version")

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        self._need_ready("update_weights")
        self._need_idle("update_weights")
        self._discard_launched()
        self._check_version(version)
        self._load(weights)
        self._version = version

    def _move(self, dst: EngineStatus, op: str) -> None:
        if (self.status, dst) not in TRANSITIONS:
            raise IllegalTransition(self.status, dst, op)
        self.status = dst

    def release_memory(self, offload: bool = False, keep_weights: bool = False) -> None:
        """Free KV and weights (parameters become empty). `offload`: keep a host copy for `resume()`.
        `keep_weights`: free the KV cache only (a scorer on this device reads the same model next); a later
        `release_memory()` then frees the weights it kept."""
        self._need_idle("release_memory")
        self._discard_launched()
        if not (self.status is EngineStatus.RELEASED and self._weights_kept and not keep_weights):
            self._move(EngineStatus.RELEASED, "release_memory")
        self._weights_kept = keep_weights
        params = {} if keep_weights else dict(self.model.named_parameters())
        self._offload = {n: p.detach().to("cpu", copy=True) for n, p in params.items()} if offload else None
        if params and self._fused:
            self.model.pack_projections(False)   # the packed weights go with the parameters
        for p in params.values():
            p.data = torch.empty(0, dtype=self.dtype, device=self.device)
        self.cache.free()
        self._graphs, self._prefill_graphs = {}, {}  # they point into the freed slab and parameters
        self._static, self._graph_pool = {}, None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume(self, weights: Mapping[str, torch.Tensor] | None = None, version: int | None = None) -> None:
        if self.status is not EngineStatus.RELEASED:
            raise IllegalTransition(self.status, EngineStatus.READY, "resume")
        if weights is not None and version is None:
            raise GenerationError("resume: new weights need the policy version they belong to (version=...)")
        if weights is None and self._offload is None and not self._weights_kept:
            raise GenerationError("resume: no weights given and none were offloaded; pass weights=... "
                                  "(and version=...), or release with release_memory(offload=True)")
        if weights is not None and version is not None:
            self._check_version(version)
        if weights is not None or not self._weights_kept:
            for name, p in self.model.named_parameters():
                p.data = torch.empty(self._param_shapes[name], dtype=self.dtype, device=self.device)
            self._load(weights if weights is not None else cast(Mapping[str, torch.Tensor], self._offload))  # checked
            if self._fused:
                self.model.pack_projections()
        self._offload, self._weights_kept = None, False
        if version is not None:
            self._version = version
        self.cache.allocate()
        self._move(EngineStatus.READY, "resume")
