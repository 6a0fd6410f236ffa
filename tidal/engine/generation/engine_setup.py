"""What a native engine is configured with (`EngineConfig`) and what it derives from that and its model once
(`EngineSetup`): the decode width, the kernels, the KV block geometry and the `numerics` that KV migration
compares.

    EngineConfig (user) + Transformer (device, dtype, TP, head dim) --EngineSetup.of--> EngineSetup (frozen)

Why the decode rows R are a multiple of 64 on CPU (measured, torch 2.13 CPU, AVX-512): elementwise kernels run a
flat loop over numel in vector chunks of 2 x Vec::size() and finish the last `numel % 32` elements with the
*scalar* function; for SiLU (Sleef exp vs std::exp) that gives other bits. With 5 rows of width 48 the last row's
last 16 values were computed by the scalar path, so the request in the last slot decoded 1 ulp apart from the same
request in slot 0 and once flipped a log-prob. With R a multiple of 64 no decode tensor has a tail. GEMMs: per-row
bits depend on M (classes M=1, 2..15, >=16 measured) but not on row position or other rows at fixed M, so R is
fixed per engine. Intra-op threads split large elementwise loops into chunks with their own tails: run CPU engines
with torch.set_num_threads(1) (our workers do) when bit-exactness matters.

The KV block size changes no bits (SDPA reads gathered contiguous copies, the Triton kernel the same sums), so it
is not part of `numerics`; everything that does change a request's bits is.

Example::

    setup = EngineSetup.of(EngineConfig(max_running_requests=8), model)   # CPU: rows=64, row spans, block 16
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from tidal.core.errors import TidalError
from tidal.engine.generation import decode_attention, decode_gemm, fused
from tidal.engine.generation.kv_cache import PagedKVCache
from tidal.engine.model import Transformer
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
    """How a KV-less imported request rebuilds its KV (see `tidal.engine.generation.engine`)."""
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
    A request's tokens are the same as without it (see `tidal.engine.generation.engine`). None: on for CUDA (12%
    fewer ms per decode step on an H200 at batch 64), off on CPU, where the host computes the step itself."""
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


@dataclass(frozen=True)
class _Kernels:
    """The kernels an engine runs: each resolved from its `EngineConfig` key, refused where it cannot run."""

    fused: bool
    attention: Literal["sdpa", "triton"]
    gemm: Literal["cublas", "triton"]


@dataclass(frozen=True)
class EngineSetup:
    """An engine's derived shape, kernels and KV geometry (module doc)."""

    device: torch.device
    dtype: torch.dtype
    tp: int
    """The model's TP size (its `tp_group`)."""
    vocab: int
    """Sampled ids are below this: `EngineConfig.vocab_limit`, else the model's vocab."""
    width: int
    """Slots: the most requests decoding at once (`max_running_requests`)."""
    rows: int
    """Rows of a decode forward: `width` on CUDA, `width` rounded up to CPU_ROW_MULTIPLE on CPU."""
    row_spans: bool
    """The batch-invariant mode: each decode row reads its own key span, prompts prefill one at a time."""
    fused: bool
    """Packed projections and compiled elementwise stages (`tidal.engine.generation.fused`)."""
    fused_attention: bool
    """Step-wide decode attention in Triton (each row reads its own keys, writes its K/V in the same launch)."""
    decode_gemm: bool
    """The decode step's projections on the Triton GEMMs (`tidal.engine.generation.decode_gemm`)."""
    compact: bool
    """Compact rows: a decode step computes the active rows only, in a bucket of rows."""
    block_size: int
    """Positions per KV block."""
    num_blocks: int
    """KV blocks requests may hold (the null block not counted)."""
    num_kv_heads: int
    """KV heads of this TP rank."""
    dummy: int | None
    """The slot padding rows read and write (its table row holds no block); None: no padding rows."""
    use_graph: bool
    """Replay captured CUDA graphs (CUDA, TP 1, `EngineConfig.cuda_graph`)."""
    overlap: bool
    """Launch decode step n+1 before reading step n back (`EngineConfig.overlap`)."""
    numerics: str
    """Everything a request's bits depend on besides its own inputs: KV moves only between equal values."""

    @property
    def per_slot(self) -> int:
        """Entries of the per-slot device tensors (sampling params, previous tokens): the rows, and the dummy
        slot with compact rows where it is not one of them."""
        return self.rows + (self.compact and self.rows == self.width)

    @staticmethod
    def of(config: EngineConfig, model: Transformer) -> EngineSetup:
        """Resolve `config` for `model`; packs the model's projections where the fused kernels run (the decode
        GEMMs read them packed). Raises TidalError naming the key for a setting this engine cannot run."""
        args = model.args
        if config.vocab_limit is not None and config.vocab_limit > args.vocab_size:
            raise TidalError("vocab_limit", config.vocab_limit, f"exceeds the model's {args.vocab_size} rows",
                             "use a tokenizer no larger than the model's embedding")
        p = next(model.parameters())
        device, dtype, tp = p.device, p.dtype, group_size(model.tp_group)
        width = config.max_running_requests
        # decode rows: on CPU a multiple of 64, so no elementwise kernel has a scalar tail (see module doc)
        rows = width if device.type != "cpu" else -(-width // CPU_ROW_MULTIPLE) * CPU_ROW_MULTIPLE
        row_spans = config.batch_invariant if config.batch_invariant is not None else device.type == "cpu"
        kernels = _resolve_kernels(config, model, device, dtype, tp, row_spans)
        fused_attention = kernels.attention == "triton"
        if config.compact_rows and row_spans:
            raise TidalError("compact_rows", True, "needs the step-wide mode (its rows are gathered from their "
                             "slots); the batch-invariant mode computes a row per slot",
                             "set batch_invariant False, or leave compact_rows None")
        compact = config.compact_rows if config.compact_rows is not None else fused_attention and not row_spans
        numerics = (f"rows={rows},dtype={dtype},"
                    f"device={device.type},tp={tp},seq={args.max_seq_len},"
                    f"span={'row' if row_spans else 'step'},fused={int(kernels.fused)},"
                    f"attention={kernels.attention},compact={int(compact)},gemm={kernels.gemm}")
        kv_heads = args.num_kv_heads // tp
        block = config.kv_block_size or (decode_attention.CHUNK if fused_attention else CPU_KV_BLOCK)
        num_blocks = _kv_blocks(config, model, block, kv_heads, dtype, fused_attention)
        return EngineSetup(
            device, dtype, tp, config.vocab_limit or args.vocab_size, width, rows, row_spans, kernels.fused,
            fused_attention, kernels.gemm == "triton", compact, block, num_blocks, kv_heads,
            dummy=width if rows > width or compact else None,
            use_graph=config.cuda_graph and device.type == "cuda" and tp == 1,
            overlap=config.overlap if config.overlap is not None else device.type == "cuda", numerics=numerics)


def _resolve_kernels(config: EngineConfig, model: Transformer, device: torch.device, dtype: torch.dtype, tp: int,
                     row_spans: bool) -> _Kernels:
    """The fused stages, the decode attention and the decode GEMMs, each refused where it cannot run; packs the
    model's projections where the fused stages run."""
    can_fuse = fused.available(device)
    if config.fused_kernels and not can_fuse:
        raise TidalError("fused_kernels", True, f"needs a CUDA device with Triton (this engine is on "
                         f"{device})", "leave it None (on where it can run) or set False")
    use_fused = config.fused_kernels if config.fused_kernels is not None else can_fuse and not row_spans
    head_dim = model.args.head_dim
    can_attend = use_fused and decode_attention.supported(head_dim, dtype)
    attention = config.decode_attention or ("triton" if can_attend else "sdpa")
    if attention == "triton" and not can_attend:
        raise TidalError("decode_attention", "triton", f"needs the fused kernels (step-wide mode on CUDA) and a "
                         f"power-of-two head dim in bf16/fp16 (this engine: fused={int(use_fused)}, head_dim="
                         f"{head_dim}, {dtype})", 'use "sdpa"')
    if use_fused:
        model.pack_projections()
    can_gemm = attention == "triton" and decode_gemm.usable(model)
    gemm = config.decode_gemm or ("triton" if can_gemm else "cublas")
    if gemm == "triton" and not can_gemm:
        raise TidalError("decode_gemm", "triton", f"needs the Triton decode attention, TP 1 and a bf16/fp16 "
                         f"model on CUDA (this engine: attention={attention}, tp={tp}, {dtype})",
                         'use "cublas"')
    return _Kernels(use_fused, attention, gemm)


def _kv_blocks(config: EngineConfig, model: Transformer, block: int, kv_heads: int, dtype: torch.dtype,
               fused_attention: bool) -> int:
    """KV blocks of `block` positions requests may hold: every slot's at max_seq_len, or what
    `kv_budget_bytes` holds (less the null block), refused when that is less than one request's."""
    args, s = model.args, model.args.max_seq_len
    if fused_attention and block % decode_attention.BLOCK_N:
        raise TidalError("kv_block_size", block, f"must be a multiple of the Triton decode attention's "
                         f"{decode_attention.BLOCK_N}-key loads", "e.g. 256, or None")
    per_request = -(-s // block)   # blocks of a request at max_seq_len
    block_bytes = PagedKVCache.block_bytes(args.num_layers, kv_heads, block, args.head_dim, dtype)
    blocks = config.max_running_requests * per_request
    if config.kv_budget_bytes is not None:
        fit = config.kv_budget_bytes // block_bytes - 1   # less the null block
        if fit < per_request:
            raise TidalError("kv_budget_bytes", config.kv_budget_bytes,
                             f"leaves no room for one request at max_seq_len={s} ({per_request} blocks of "
                             f"{block} positions, {block_bytes} bytes each, + the null block)",
                             f"give at least {(per_request + 1) * block_bytes} bytes, or lower model.max_seq_len")
        blocks = min(blocks, fit)
    return blocks
