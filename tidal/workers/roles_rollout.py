"""The rollout role on a worker: an instance's engine started or updated (`rollout_start`), its time slices of
generation (`rollout_run`), what it holds (`rollout_holding`), its memory given back (`rollout_release`,
`rollout_free_kv`). Moving its requests to another instance: `tidal.workers.roles_migration`. The slot itself
(`RolloutSlot`) and the other roles: `tidal.workers.roles`."""

from __future__ import annotations

import time
from typing import cast

import torch

from tidal.core.errors import TidalError
from tidal.engine.generation.engine import EngineConfig, NativeEngine
from tidal.engine.hf_tokenizer import Tokenizer
from tidal.engine.model import Transformer
from tidal.engine.records import RolloutGroup
from tidal.engine.verifier import Verifier
from tidal.workers.device_worker import WorkerContext
from tidal.workers.gc_pauses import GcPauses
from tidal.workers.messages import RolloutReport
from tidal.workers.roles import EngineWeights, RolloutSlot, RunSpec, engine_model, load_weights, roles_of, rollout_slot
from tidal.workers.rollout_instance import GroupQueue, PromptGroup, RolloutInstance
from tidal.workers.rollout_instance import RolloutGroup as FinishedGroup


def _kv_budget(spec: RunSpec, model: Transformer, device: torch.device) -> int | None:
    """KV bytes a rollout engine on `device` may hold: `rollout.gpu_memory_utilization` of the GPU less the
    engine's weights, and no more than is free now. None on CPU (one slot per running request)."""
    if torch.device(device).type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = min(int(spec.gpu_memory_utilization * total) - weights, int(free * 0.95))
    if budget <= 0:
        raise TidalError("rollout.gpu_memory_utilization", spec.gpu_memory_utilization,
                         f"leaves no KV memory on {device}: the engine's weights take {weights / 2**30:.2f} GiB of "
                         f"{total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free)",
                         "raise it, or offload the actor's state on shared devices (actor.offload_*)")
    return budget


def rollout_start(ctx: WorkerContext, instance_id: str, weights: EngineWeights | None, version: int,
                  step: int) -> str:
    """Become (or stay) a rollout instance for `step` with weights `version` (`weights` None: keep the engine of
    that version this worker already has)."""
    roles = roles_of(ctx)
    spec = roles.run
    loaded = None if weights is None else load_weights(ctx, weights)
    old = roles.rollout
    if old is not None and loaded is not None and old.version != version and _holds_work(old):
        # an asynchronous run: groups of later steps are in flight here; they go on under the new weights
        # (a partial rollout: `RunSpec.partial`), the instance's queue and finished groups kept
        old.engine.update_weights(loaded, version, in_flight=spec.partial)   # TP 1: global names
        old.version, old.step, old.inst.step = version, step, step
        return instance_id
    if old is not None and old.version == version and loaded is None:
        engine = old.engine
    else:
        # `weights` None without an engine of `version` here: the caller's error (fails in engine_model)
        roles.rollout = old = None   # the old engine's memory goes before the new one takes any
        model = engine_model(spec, cast(dict[str, torch.Tensor], loaded), ctx.device)
        engine = NativeEngine(model, EngineConfig(max_running_requests=spec.max_running_requests,
                                                  kv_budget_bytes=_kv_budget(spec, model, ctx.device),
                                                  vocab_limit=spec.vocab_limit), policy_version=version)
    queue = GroupQueue([])
    out: list[FinishedGroup] = []
    inst = RolloutInstance(instance_id, engine, queue, out.append, spec.sampling, spec.group_size, spec.seed, step)
    roles.rollout = RolloutSlot(engine, queue, inst, out, version, step)
    return instance_id


def _holds_work(r: RolloutSlot) -> bool:
    """Groups queued, in the engine, or finished and not returned yet."""
    return bool(r.queue.remaining() or r.inst.group_keys() or r.out)


def _to_record(g: FinishedGroup, verifier: Verifier, tok: Tokenizer) -> RolloutGroup:
    rewards = tuple(verifier.score(g.label, tok.response_text(s.token_ids)) for s in g.samples)
    return RolloutGroup(g.group_id, g.step, tuple(g.prompt_ids), tuple(tuple(s.token_ids) for s in g.samples),
                        tuple(torch.tensor(s.logprobs, dtype=torch.float32) for s in g.samples), rewards,
                        g.policy_version, tuple("eos" if s.finish_reason == "stop" else "length" for s in g.samples),
                        tuple(s.version_starts for s in g.samples))


#: `WorkerGroup.interrupt` name that ends a `rollout_run` time slice after the engine pump in progress
ROLLOUT_INTERRUPT = "rollout_slice"


def rollout_run(ctx: WorkerContext, groups: list[PromptGroup], budget_s: float, seq: int) -> tuple[list[RolloutGroup],
                                                                                     RolloutReport]:
    """Take `groups` into the local queue, generate for about `budget_s` (returning early once a group is
    done, or at an interrupt `ROLLOUT_INTERRUPT` from the driver naming this call's number `seq` or a later one,
    so one interrupt ends every slice queued before it), and return the finished groups with rewards plus this
    instance's report."""
    r, roles = rollout_slot(ctx), roles_of(ctx)
    r.queue.extend(groups)
    inst = r.inst
    inst.reopen()  # new work may have arrived in the local queue
    t0 = time.perf_counter()
    tokens0 = inst.signals().tokens_generated
    keys0, prefill0 = getattr(r.engine, "keys_read", 0), getattr(r.engine, "prefill_tokens", 0)
    preempted0 = getattr(r.engine, "preemptions", 0)
    pumps = 0
    batch = 0     # sequences running summed over the pumps (their mean: the batch the step time was paid at)
    while not inst.done() and time.perf_counter() - t0 < budget_s:
        if ctx.interrupted(ROLLOUT_INTERRUPT, seq):   # the driver is about to move work off or onto this instance
            break
        inst.pump()
        pumps += 1
        batch += r.engine.num_running()
        if r.out and time.perf_counter() - t0 > budget_s / 4:
            break
    finished, r.out[:] = list(r.out), []
    verifier, tok = roles.verifier, roles.tok
    timeouts0 = verifier.num_timeouts
    records = [_to_record(g, verifier, tok) for g in finished]
    s = inst.signals()
    eng = r.engine  # tokens generated so far by unfinished requests (what the scheduler's length model needs)
    progress = sum(len(eng._live[rid].tokens) for rid in eng.request_ids()) if hasattr(eng, "_live") else 0
    return records, RolloutReport(
        groups_in_progress=s.groups_in_progress, running=s.running_requests, waiting=s.waiting_requests,
        progress=progress, tokens=s.tokens_generated, token_rate=s.token_rate, emitted=s.groups_emitted,
        queued=r.queue.remaining(), busy_s=time.perf_counter() - t0, pumps=pumps, mean_batch=batch / max(1, pumps),
        gc_s=GcPauses.install().take()[0], call_tokens=s.tokens_generated - tokens0,
        reward_timeouts=verifier.num_timeouts - timeouts0, call_keys_read=getattr(eng, "keys_read", 0) - keys0,
        call_prefill_tokens=getattr(eng, "prefill_tokens", 0) - prefill0,
        call_preemptions=getattr(eng, "preemptions", 0) - preempted0)


def rollout_holding(ctx: WorkerContext) -> list[tuple[int, int]]:
    """(step, group id) of the groups this instance holds and has not returned: waiting in its queue, open in its
    engine, finished but not yet returned (later steps' too, in an asynchronous run). The driver asks the
    survivors of a lost instance (their slices drained), so what no one holds is what the lost one took with it."""
    r = rollout_slot(ctx)
    inst = r.inst
    return sorted({*((inst.step_of(g), g.group_id) for g in r.queue.groups()), *inst.group_keys(),
                   *((g.step, g.group_id) for g in r.out)})


def rollout_release(ctx: WorkerContext) -> int:
    """Stop being a rollout instance; free the engine (weights and KV). Returns bytes freed (approx)."""
    roles = roles_of(ctx)
    r, roles.rollout = roles.rollout, None
    if r is None:
        return 0
    if r.engine.request_ids():
        roles.rollout = r   # refused: it stays an instance
        raise RuntimeError(f"device {ctx.device_id}: rollout released with requests in flight "
                           f"{r.engine.request_ids()[:4]} (migrate them first)")
    r.engine.release_memory()   # after `rollout_free_kv` too: the weights it kept go now
    return 0


def rollout_free_kv(ctx: WorkerContext) -> None:
    """Generation is done here and this device scores next: free the engine's KV cache, keep its weights (the
    scorer reads the same model). The instance stays, idle, until `rollout_release` or the next weight sync."""
    r = rollout_slot(ctx)
    if r.engine.request_ids():   # the driver's invariant: every group of the step came back generated
        raise RuntimeError(f"device {ctx.device_id}: KV freed with requests in flight {r.engine.request_ids()[:4]}")
    r.engine.release_memory(keep_weights=True)
