"""The native (torch) generation engine: continuous batching over a paged KV cache, exact per request.

    step():  admit   waiting requests into free slots while KV blocks allow (FIFO; imported ones first); for
                     each: load its moved KV, or prefill it and sample its first token (`admission`, `prefill`)
             grow    give each active request a block where its next position starts one; none free: preempt
                     the newest request (blocks freed, back to the head of the queue, re-prefilled later)
             decode  one batched forward over all R rows (`decode_step`); each row attends over the first keys of
                     its own slot only, its length bucketed (`tidal.engine.shapes.padded_len`); rows that are
                     replaying a re-prefilled request feed their recorded token and sample nothing
             finish  stop token / max_new_tokens / max_seq_len -> RequestResult, slot and blocks free again

Capacity: W = max_running_requests slots (a slot is a running request's handle: its row of the block table,
its sampling params); KV memory is `kv_budget_bytes // block bytes` blocks of `kv_block_size` positions of
every layer (`kv_cache.PagedKVCache`), held by requests as their tokens need them, so a budget holds the tokens
requests have, not W x `max_seq_len` positions. Admission keeps one free block for each running request that
may still grow; a request preempted for want of blocks is re-prefilled in replay mode (below), so its tokens do
not change (bit for bit on CPU). Every decode forward has R rows: R = W on CUDA, W rounded up to a multiple of
64 on CPU (`engine_setup` says why; padding rows use one dummy slot whose table row holds no block). The work
follows the tokens: a decode step reads each row's keys up to its bucketed length, and a prefill runs the
prompt's tokens, so doubling `max_seq_len` with the same requests changes neither (`keys_read`,
`prefill_tokens` count them).

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

    step n:   admit ──> launch step n ──> read back step n-1 (waits for it only) ──> events of step n-1
    step n+1: admit ──> launch step n+1 (its rows' inputs: step n's tokens, on the device) ──> read back step n

Migration (`engine_states`): `export_state` freezes requests (they keep their slot but do not advance) and
returns their state with KV; `commit_export` forgets them, `cancel_export` unfreezes them. `import_state` queues
them first in line; a KV state continues at once, a KV-less one is re-prefilled: with `reprefill="replay"`
(default) the prompt is prefilled and the generated tokens are fed back through decode rows, reproducing the
source's KV bit for bit; `"single_pass"` prefills prompt + generated in one forward (faster; what a vLLM backend
does; equal up to round-off, so a rare near-tie can flip).

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
from typing import Literal, cast

import torch

from tidal.core.errors import TidalError
from tidal.engine.generation import engine_states, fused, sampler
from tidal.engine.generation.admission import RequestTable
from tidal.engine.generation.decode_step import DecodeStep, Launched, draws, plan_rows
from tidal.engine.generation.engine_setup import CPU_KV_BLOCK, CPU_ROW_MULTIPLE, EngineConfig, EngineSetup
from tidal.engine.generation.kv_cache import PagedKVCache
from tidal.engine.generation.prefill import Prefill
from tidal.engine.generation.protocol import EngineBusyError, EngineStatus, GenerationEngine, check_prompt
from tidal.engine.generation.requests import Request, RequestEvent, RequestResult, RequestState
from tidal.engine.generation.slots import Live, SlotParams
from tidal.engine.model import EAGER, Transformer

__all__ = ["NativeEngine", "EngineConfig", "CPU_KV_BLOCK", "CPU_ROW_MULTIPLE"]

_DEFAULT_CONFIG = EngineConfig()   # frozen: one value serves every engine built without a config


class NativeEngine(GenerationEngine):
    def __init__(self, model: Transformer, config: EngineConfig = _DEFAULT_CONFIG, policy_version: int = 0):
        self.model, self.config, self._version = model, config, int(policy_version)
        self.args = model.args
        self.setup = setup = EngineSetup.of(config, model)
        self.device, self.dtype, self.tp = setup.device, setup.dtype, setup.tp
        self.width, self.rows, self.numerics = setup.width, setup.rows, setup.numerics
        kernels = fused.compiled_kernels() if setup.fused else EAGER
        # `width` real slots, + 1 for the dummy slot of padding rows (its table row holds no block)
        self.cache = PagedKVCache(self.args.num_layers, setup.width + (setup.dummy is not None), setup.num_blocks + 1,
                                  setup.block_size, setup.num_kv_heads, self.args.max_seq_len, self.args.head_dim,
                                  self.dtype, self.device)
        self._params = SlotParams(setup.per_slot, self.device, pinned=setup.overlap and self.device.type == "cuda")
        self._table = RequestTable(self.cache, self._params, setup.width, self.args.max_seq_len, config.reprefill)
        self._live, self._gone = self._table.live, self._table.gone   # the table's own dicts, never rebound
        self._prefill = Prefill(model, self.cache, setup, kernels)
        self._decode_step = DecodeStep(model, self.cache, self._params, setup, kernels)
        self._launched: Launched | None = None   # overlap: the decode step launched ahead, not read back yet
        self.status = EngineStatus.READY
        self._param_shapes = {n: tuple(q.shape) for n, q in model.named_parameters()}
        self._offload: dict[str, torch.Tensor] | None = None
        self._weights_kept = False   # released with keep_weights: only the KV cache was freed
        self.tokens_generated = 0
        # key positions read by decode rows, summed over every row a step computes (a function of the tokens,
        # not of max_seq_len)
        self.keys_read = 0

    # ---- queries -------------------------------------------------------------------------------------------
    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens prefilled, padding included (a function of the tokens, not of max_seq_len)."""
        return self._prefill.tokens

    @property
    def preemptions(self) -> int:
        """Requests preempted for want of KV blocks (re-prefilled later)."""
        return self._table.preemptions

    def num_running(self) -> int:
        return sum(1 for live in self._table.running() if not live.frozen)

    def num_waiting(self) -> int:
        return sum(1 for rid in self._table.waiting if not self._live[rid].frozen)

    def free_slots(self) -> int:
        return self._table.slots.count(None)

    def num_held(self) -> int:
        """Requests waiting for a newer version at their next token (`Request.version_schedule`)."""
        return sum(1 for live in self._live.values() if live.held_at(len(live.tokens), self._version))

    # ---- requests in -------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self._check_new(request)
        check_prompt(request, self.args)
        self._table.enqueue(Live(request, torch.Generator().manual_seed(request.seed)))

    # ---- the loop ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[RequestEvent]:
        self._need_ready("step")
        events: list[RequestEvent] = []
        self._admit(events)
        if self.setup.overlap:   # launch the next step, then read back the one launched by the previous call
            inflight, self._launched = self._launched, None
            self._launched = self._launch(inflight)
            if inflight is not None:
                self._consume(inflight, events)
        elif self._table.any_active():
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
        """Admission (`RequestTable.admit`), then its prefills; a prompt's first token is sampled from its
        prefill's logits, a re-prefilled request replays its recorded tokens through decode rows."""
        jobs = self._table.admit(self._version)
        p = self._params
        for (live, _), logits in zip(jobs, self._prefill.run(jobs)):
            if live.tokens:
                live.replay = deque(live.all_tokens()[live.kv_len:-1])
                continue
            live.version = self._version
            slot = cast(int, live.slot)
            u = torch.tensor(draws([live], [True]), dtype=torch.float32, device=self.device)
            tok = sampler.sample(logits, p.temp[slot:slot + 1], p.top_p[slot:slot + 1], p.top_k[slot:slot + 1], u)
            lp = sampler.logprobs(logits, tok)
            self._record(live, int(tok.item()), float(lp.item()), events)

    def _decode(self, events: list[RequestEvent]) -> None:
        """One decode step, launched and read back (without overlap)."""
        launched = self._launch(None)
        if launched is not None:
            self._consume(launched, events)

    def _launch(self, inflight: Launched | None) -> Launched | None:
        """Start a decode step over the active rows; `inflight`: the step launched before and not read back
        yet, whose rows this one continues (input token from the device, position + 1). None: no active row."""
        ahead = {id(lv): samples for lv, _, samples in inflight.rows} if inflight is not None else {}
        self._table.grow(ahead, inflight.drew if inflight is not None else ())
        rows, ids, pos, prev = plan_rows(self._table, ahead, self.rows, self._version)
        if not rows:
            return None
        return self._decode_step.launch(rows, ids, pos, prev)

    def _consume(self, launched: Launched, events: list[RequestEvent]) -> None:
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

    def _record(self, live: Live, token: int, logprob: float, events: list[RequestEvent]) -> None:
        if not live.version_starts or live.version_starts[-1][1] != self._version:
            live.version_starts.append((len(live.tokens), self._version))
        live.tokens.append(token)
        live.logprobs.append(logprob)
        self.tokens_generated += 1
        p = live.request.params
        reason = None
        if token in p.stop_token_ids:
            reason = "stop"
        elif self._table.finishes_by_length(live, 0):
            reason = "length"
        new: tuple[tuple[int, ...], tuple[float, ...]] = ((token,), (logprob,)) if live.request.stream else ((), ())
        if reason is None:
            if live.request.stream:
                events.append(RequestEvent(live.request.request_id, *new))
            return
        rid = live.request.request_id
        result = RequestResult(rid, live.request.prompt_ids, tuple(live.tokens), tuple(live.logprobs), reason,
                               cast(int, live.version), live.migrations,   # set when it sampled a token
                               tuple(live.version_starts))
        self._table.remove(rid, "finished")
        events.append(RequestEvent(rid, *new, result=result))

    # ---- abort and migration -----------------------------------------------------------------------------
    def abort(self, ids: Sequence[str]) -> None:
        for rid in self._check_ids("abort", ids, None):
            self._table.remove(rid, "aborted")

    def export_state(self, ids: Sequence[str], in_place: bool = False) -> list[RequestState]:
        """Freeze `ids` and return their states; `in_place`: their KV stays in this engine's blocks (frozen, read
        by the transfer layer until `commit_export` frees them or `cancel_export` resumes them) and the states
        name the blocks (`RequestState.kv_blocks`)."""
        self._need_ready("export_state")
        self._discard_launched()   # the state as of the last step() returned: generators before unread draws
        out = []
        for rid in self._check_ids("export_state", ids, False):
            live = self._live[rid]
            live.frozen = True
            out.append(engine_states.export_state(live, self.cache, self.numerics, in_place))
        if in_place and self.cache.device.type == "cuda":
            torch.cuda.synchronize(self.cache.device)   # the blocks' last writes land before another process reads
        return out

    def commit_export(self, ids: Sequence[str]) -> None:
        for rid in self._check_ids("commit_export", ids, True):
            self._table.remove(rid, "migrated away")

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
        batch_ids = [s.request_id for s in states]
        lives = [engine_states.live_from_state(st, batch_ids, self._live, self._version, self.args,
                                               self.cache.num_kv_heads, self.numerics, self.cache.layout)
                 for st in states]
        self._park(lives, [st.kv_blocks for st in states])
        for live in lives:
            live.frozen = staged
        self._table.enqueue_first(lives)

    def _park(self, lives: list[Live], sources: list[tuple[int, ...] | None]) -> None:
        """Blocks for each state whose KV arrives as blocks (`kv_blocks`), in order: its KV lands there before
        the request has a slot, and they become its slot's at admission. A state that finds too few free blocks
        imports without its KV and rebuilds it from its tokens at admission (the replay re-prefill: exact)."""
        for live, blocks in zip(lives, sources):
            if blocks is None:
                continue
            live.parked = self.cache.take(len(blocks))
            if live.parked is None:
                live.kv_len = 0

    @property
    def kv_pool(self) -> torch.Tensor:
        """The paged KV pool [layers, 2, blocks, kv heads, block size, head dim] (`PagedKVCache.pool`)."""
        return self.cache.pool

    def kv_destination(self, rid: str) -> list[int] | None:
        """The blocks a staged request's KV lands in (`import_state` of a state with `kv_blocks`), in the order
        of the source's; None where it found none free (it re-prefills: its source sends no KV)."""
        live = self._live[rid]
        return None if live.parked is None else list(live.parked)

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

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int,
                       in_flight: Literal["keep", "recompute"] | None = None) -> None:
        """Load `weights` as policy `version`. Without `in_flight` the engine must be idle. With it, requests in
        flight continue under the new weights (a partial rollout), each token recording the version it was
        sampled with (`RequestResult.version_starts`): `keep` continues on the KV the old weights computed;
        `recompute` frees their KV, and each re-prefills its prompt and replays its tokens under the new weights
        at its next admission (the KV the new weights give, no token drawn again). Requests frozen by a
        migration in progress are refused: commit or cancel it first."""
        self._need_ready("update_weights")
        if in_flight is None:
            self._need_idle("update_weights")
        frozen = [rid for rid, live in self._live.items() if live.frozen]
        if frozen:
            raise EngineBusyError(f"update_weights: {len(frozen)} requests are exported ({frozen[:4]}); commit or "
                                  "cancel their migration before the weights change")
        early = [rid for rid, live in self._live.items()
                 if live.request.version_schedule and not live.held_at(len(live.tokens), self._version)]
        if early:
            raise EngineBusyError(f"update_weights: {len(early)} requests ({early[:4]}) have tokens scheduled under "
                                  f"version {self._version} still to sample; step until num_held() counts every "
                                  "scheduled request")
        self._discard_launched()
        self._check_version(version)
        self._load(weights)
        self._version = version
        if in_flight == "recompute":
            self._table.requeue_for_reprefill()

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
        if params and self.setup.fused:
            self.model.pack_projections(False)   # the packed weights go with the parameters
        for p in params.values():
            p.data = torch.empty(0, dtype=self.dtype, device=self.device)
        self.cache.free()
        self._decode_step.drop_graphs()   # they point into the freed slab and parameters
        self._prefill.drop_graphs()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume(self, weights: Mapping[str, torch.Tensor] | None = None, version: int | None = None) -> None:
        self._check_resume(weights, version, kept=self._offload is not None or self._weights_kept)
        if weights is not None or not self._weights_kept:
            for name, p in self.model.named_parameters():
                p.data = torch.empty(self._param_shapes[name], dtype=self.dtype, device=self.device)
            self._load(weights if weights is not None else cast(Mapping[str, torch.Tensor], self._offload))  # checked
            if self.setup.fused:
                self.model.pack_projections()
        self._offload, self._weights_kept = None, False
        if version is not None:
            self._version = version
        self.cache.allocate()
        self._move(EngineStatus.READY, "resume")
