"""The worker runtime: one long-lived Ray actor per device, all in one torch.distributed world.

::

    driver (flow / CLI / test)                     one Ray actor per device id
    ───────────────────────────                    ─────────────────────────────────────────
    WorkerGroup.start(devices=[0,1,2,3])  ──────►  DeviceWorker(device 0, rank 0)  ┐ rank 0 hosts a TCPStore
      ComputeShare.apply(pid, cores) per worker    DeviceWorker(device 1, rank 1)  │ on 127.0.0.1:PORT; all
      rank 0 reports PORT; all init_world  ──────► DeviceWorker(device 2, rank 2)  │ init_process_group(store)
                                                   DeviceWorker(device 3, rank 3)  ┘ gloo (CPU) / NCCL (GPU)
    submit_all("mod:fn", x=1) ─ Ray task per worker ─► fn(ctx, x=1)  (ctx.state persists between calls)
    gather(handles, timeout)  ◄── results ──────────   (one call at a time per worker, in order)
       │ every poll_s: ray.wait + is each pending worker's pid alive? (+ Ray's actor-death errors)
       └─► WorkerDied(device_id) | WorkerCallError(device_id) | WorkerTimeout(device_ids) | results

Guarantees:

* Workers are addressed by **device id**. Rank = position in the `devices` list given to `start`.
* A worker whose process dies is reported as `WorkerDied(device_id, reason)` by the next `gather`/`call`/
  `check` within about `poll_s` (local workers: its pid leaves /proc; any worker: Ray's actor-death error),
  never a hang. Survivors may sit in a collective with the dead rank (gloo fails it when the rank's sockets
  close). A caller that `retire`s the device goes on without it: only calls to it fail, `quiesce` waits out the
  survivors' abandoned calls, and the live ranks (`world_ids`) still make process groups among themselves
  (torch names a group by the order of `new_group` calls, with no barrier over the world), never one with the
  dead rank; the world itself keeps its size, the dead rank a hole in it.
* Waits log progress every `log_every_s` seconds naming the devices still running.
* CPU virtual devices can get a fixed compute share (`compute_share`, fraction of this machine's cores per
  device, like `cluster.cpu_compute_share`): see `tidal.workers.compute_share`.
* Calls are typed: `submit(d, fn, **kwargs)` checks the keywords against `fn(ctx: WorkerContext, ...)` and
  returns a `CallHandle[R]` of its result type; `gather` returns a `list[R]` (a function named by its path is
  unchecked: `CallHandle[Any]`). Ray stays in this package: `put` (the object store), `get`, `wait_ready`.

Example::

    group = WorkerGroup.start(devices=[0, 1, 2, 3], device_kind="cpu")
    try:
        sums = group.call_all("tidal.workers.probes:allreduce_sum", value=1.0, timeout=30)  # {0: 4.0, ...}
    finally:
        group.shutdown()
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Concatenate, Generic, Literal, ParamSpec, TypeVar, overload

import torch
import torch.distributed as dist

from tidal.core.errors import PeerFailed, TidalError
from tidal.engine.transfer import route as transfer_route
from tidal.workers.compute_share import DEFAULT_PERIOD_S, ComputeShare, cores_for_share, pin_process, process_alive
from tidal.workers.device_worker import (
    CONTROL_GROUP,
    DeviceWorker,
    HealthReport,
    WorkerContext,
    WorkerFn,
    WorkerInfo,
    fn_path,
)
from tidal.workers.errors import WorkerCallError, WorkerDied, WorkerTimeout
from tidal.workers.messages import KVRoute
from tidal.workers.ray_env import RaySession, connect, disconnect
from tidal.workers.store_audit import StoreAudit, merged

if TYPE_CHECKING:
    # Ray's object reference: a value in the object store (`WorkerGroup.put`) or a call's result (`CallHandle.ref`).
    # Named here so that callers outside tidal.workers import no Ray.
    from ray import ObjectRef
    from torch.distributed import TCPStore

log = logging.getLogger("tidal.workers")

DeviceKind = Literal["cpu", "cuda"]
_DEATH_GRACE_S = 0.3
CPU_WORKER_NUM_CPUS = 0.01


P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
R_co = TypeVar("R_co", covariant=True)


@dataclass(frozen=True)
class CallHandle(Generic[R_co]):
    """A call in flight on one device, whose function returns `R_co`; pass a list of them to `WorkerGroup.gather`.
    Covariant: handles of calls of different kinds gather together (their results as the join of their types)."""

    device_id: int
    fn: str
    """The function's path ("package.module:function"), or the runtime's own step ("start", "init_world")."""
    ref: ObjectRef[R_co]
    """The result in Ray's object store: `WorkerGroup.gather` reads it; a role function may take it as an argument
    (the worker resolves it)."""


@dataclass(frozen=True)
class WorkerStatus:
    """One line of `WorkerGroup.health()`: `state` is alive, dead or unresponsive."""

    device_id: int
    state: Literal["alive", "dead", "unresponsive"]
    reason: str
    report: HealthReport | None


class WorkerGroup:
    """A started set of device workers sharing one world. Make it with `WorkerGroup.start`."""

    def __init__(self, session: RaySession, device_kind: DeviceKind, actors: dict[int, Any],
                 infos: dict[int, WorkerInfo], local: bool, poll_s: float, log_every_s: float):
        self._store: TCPStore | None = None  # rendezvous store, when the driver hosts it
        self._session, self.device_kind = session, device_kind
        self._actors, self.infos, self._local = actors, infos, local
        self._audit = StoreAudit()
        self._poll_s, self._log_every_s = poll_s, log_every_s
        self._caps: dict[int, ComputeShare] = {}
        self._dead: dict[int, str] = {}
        self._retired: set[int] = set()   # dead devices the caller has taken out of its work (`retire`)
        self._alone: set[int] = set()     # devices served by a replacement worker, in no world (`replace`)
        self._starting: dict[int, tuple[Any, Any]] = {}   # device -> (replacement actor, its info() ref)
        self._last: dict[int, Any] = {}   # device -> its last call's ref (calls run in order: `quiesce`)
        self._spawn: tuple[Any, dict[str, Any], str] | None = None   # (actor class, options, name tag): `replace`
        self._share: tuple[float, float] | None = None   # (cores, period_s) each CPU worker is capped at
        self._cpu_cores: tuple[int, ...] | None = None   # cores every CPU worker is pinned to
        self._closed = False

    # ------------------------------------------------------------------------------------------ start
    @classmethod
    def start(cls, devices: Sequence[int], device_kind: DeviceKind = "cpu", compute_share: float | None = None,
              ray_address: str | None = None, *, cpu_cores: Sequence[int] | None = None,
              share_period_s: float = DEFAULT_PERIOD_S, world_timeout_s: float = 120.0, start_timeout_s: float = 120.0,
              poll_s: float = 0.5, log_every_s: float = 10.0) -> WorkerGroup:
        """Start one worker per device id and join them in one world. Connects to (or starts) Ray.

        CPU virtual devices: `cpu_cores` pins every worker to those cores, and `compute_share` is then a
        fraction of them (else of the whole machine), enforced per `share_period_s` (the CFS period: a call
        that needs a little more CPU than one period's quota waits for the next period).
        """
        devices = _check_devices(devices)
        cpu_cores, cores = _check_cpu_caps(device_kind, cpu_cores, compute_share)
        session = connect(ray_address)
        import ray

        # Ray's typed overloads of remote() omit the actor option concurrency_groups (accepted at runtime)
        actor_cls = ray.remote(concurrency_groups={CONTROL_GROUP: 1})(DeviceWorker)  # type: ignore[call-overload]
        env, opts = _worker_options(device_kind, session.embedded)
        tag = uuid.uuid4().hex[:6]
        # TIDAL_DEVICE_ID in each worker's environment: which process serves which device (`ps e`, fault tests)
        actors = {d: actor_cls.options(name=f"tidal-{tag}-dev{d}", **{
                      **opts, "runtime_env": {"env_vars": {**env, "TIDAL_DEVICE_ID": str(d)}}})
                  .remote(d, device_kind, r, devices) for r, d in enumerate(devices)}
        group = cls(session, device_kind, actors, {}, local=session.embedded, poll_s=poll_s,
                    log_every_s=log_every_s)
        group._spawn = (actor_cls, {**opts, "runtime_env": {"env_vars": env}}, tag)
        group._cpu_cores = cpu_cores
        try:
            group._bring_up(devices, cores, share_period_s, world_timeout_s, start_timeout_s)
        except BaseException:
            group.shutdown()
            raise
        return group

    def _bring_up(self, devices: tuple[int, ...], cores: float | None, share_period_s: float,
                  world_timeout_s: float, start_timeout_s: float) -> None:
        """The started workers answer, take their compute caps and pins (CPU), and join one world."""
        import ray
        handles = [CallHandle(d, "start", a.info.remote()) for d, a in self._actors.items()]
        try:
            self.infos = dict(zip(devices, self.gather(handles, timeout=start_timeout_s)))
        except WorkerTimeout as e:
            raise WorkerTimeout(e.device_ids, f"start (Ray could not place or start these workers; free "
                                f"resources now: {ray.available_resources()})", start_timeout_s) from None
        if cores is not None:
            if not self._local:
                raise ValueError("compute_share needs workers on this machine (embedded Ray); "
                                 "drop it when joining a cluster with ray_address")
            self._share = (cores, share_period_s)
            self._caps = {d: ComputeShare.apply(i.pid, cores, period_s=share_period_s) for d, i in self.infos.items()}
        if self._cpu_cores is not None:
            if not self._local:
                raise ValueError("cpu_cores needs workers on this machine (embedded Ray); "
                                 "drop it when joining a cluster with ray_address")
            for i in self.infos.values():
                pin_process(i.pid, self._cpu_cores)
        addr, port = self._rendezvous(devices[0])
        handles = [CallHandle(d, "init_world", a.init_world.remote(addr, port, world_timeout_s))
                   for d, a in self._actors.items()]
        self.gather(handles, timeout=world_timeout_s + 10)
        log.info("world of %d %s workers up: devices %s (rendezvous %s:%d)", len(devices), self.device_kind,
                 list(devices), addr, port)

    def _rendezvous(self, rank0_device: int) -> tuple[str, int]:
        """Open the rendezvous store; returns (host, port).

        Embedded Ray: the driver hosts it on loopback. Its server thread then never shares a (capped,
        duty-cycled) worker's CPU: with the store inside worker 0, every `new_group` stalled while that worker
        was throttled (measured: 5-8 s per new layout at 0.25 core per device). A cluster: rank 0 hosts it on
        its node's address, reachable by every node.
        """

        import ray

        if self._local:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))  # bound here: torch's own listener would take every interface
            sock.listen(128)
            port = sock.getsockname()[1]
            self._store = dist.TCPStore("127.0.0.1", port, len(self._actors), is_master=True,
                                        timeout=timedelta(seconds=300), wait_for_workers=False,
                                        master_listen_fd=sock.detach())
            return "127.0.0.1", port
        host = self.infos[rank0_device].node_ip
        port = ray.get(self._actors[rank0_device].open_store.remote(host), timeout=60)
        return host, port

    # ------------------------------------------------------------------------------------------ calls
    @property
    def device_ids(self) -> tuple[int, ...]:
        return tuple(self._actors)

    @property
    def live_ids(self) -> tuple[int, ...]:
        """Devices whose worker is not known dead, in rank order."""
        return tuple(d for d in self._actors if d not in self._dead)

    @property
    def world_ids(self) -> tuple[int, ...]:
        """Live devices that are ranks of the world (not served by a replacement, which is in no world): the
        devices a call that takes part in a collective, or builds an actor shard, may go to."""
        return tuple(d for d in self.live_ids if d not in self._alone)

    def transfer_route(self, source: int, target: int) -> KVRoute:
        """How tensors go from `source`'s worker to `target`'s (`tidal.engine.transfer.route`): CUDA IPC on one
        GPU, point to point in the world otherwise; "reprefill" where an end is in no world (a replacement
        worker): a request's KV is rebuilt there, weights take the object store."""
        world = self.world_ids
        if source not in world or target not in world:
            return "reprefill"
        a, b = self.infos[source], self.infos[target]
        return transfer_route(a.node_ip, a.gpu_ids[0] if a.gpu_ids else None,
                              b.node_ip, b.gpu_ids[0] if b.gpu_ids else None)

    def replace(self, device_id: int) -> None:
        """Start a new worker process for dead, retired `device_id`; returns at once (`replacement_ready` says
        when it is up). The replacement joins no world (`DeviceWorker.init_alone`): it runs calls that need no
        collective (rollout, inference), never the actor's. Where the device cannot host it yet (a GPU gone)
        Ray keeps it pending until one can. Starting one already starting does nothing."""
        if device_id not in self._retired:
            raise RuntimeError(f"device {device_id} is not a retired dead worker (dead: {sorted(self._dead)}, "
                               f"retired: {sorted(self._retired)}); `retire` it before `replace`")
        if device_id in self._starting:
            return
        assert self._spawn is not None, "a group made by `start` knows how to spawn workers"
        actor_cls, opts, tag = self._spawn
        env = {**opts["runtime_env"]["env_vars"], "TIDAL_DEVICE_ID": str(device_id)}
        actor = actor_cls.options(name=f"tidal-{tag}-dev{device_id}-{uuid.uuid4().hex[:4]}",
                                  **{**opts, "runtime_env": {"env_vars": env}}) \
            .remote(device_id, self.device_kind, 0, (device_id,))
        self._starting[device_id] = (actor, actor.info.remote())
        log.info("replacement worker for device %d starting", device_id)

    def replacement_ready(self, device_id: int, health_timeout_s: float = 10.0) -> WorkerInfo | None:
        """None while `device_id`'s replacement (`replace`) is still starting. Once its process is up, with the
        group's compute share and pinning applied and a context of its own, and it answered a health check: it
        serves `device_id` from now on (calls reach it; the device is no longer dead) and its `WorkerInfo` is
        returned. A replacement that died or did not answer is killed and raises `WorkerDied`."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        if device_id not in self._starting:
            raise KeyError(f"device {device_id} has no replacement starting; call replace({device_id}) first")
        actor, ref = self._starting[device_id]
        if not ray.wait([ref], timeout=0)[0]:
            return None
        del self._starting[device_id]
        cap = None
        try:
            info: WorkerInfo = ray.get(ref)
            if self._share is not None:
                cap = ComputeShare.apply(info.pid, self._share[0], period_s=self._share[1])
            if self._cpu_cores is not None:
                pin_process(info.pid, self._cpu_cores)
            ray.get(actor.init_alone.remote(), timeout=health_timeout_s)
            ray.get(actor.health.options(concurrency_group=CONTROL_GROUP).remote(), timeout=health_timeout_s)
        except (RayActorError, GetTimeoutError) as e:
            if cap is not None:
                cap.release()
            ray.kill(actor, no_restart=True)
            raise WorkerDied(device_id, f"its replacement did not come up: {_first_line(e)}") from None
        self._actors[device_id], self.infos[device_id] = actor, info
        if cap is not None:
            self._caps[device_id] = cap
        self._dead.pop(device_id, None)
        self._retired.discard(device_id)
        self._alone.add(device_id)
        log.info("replacement worker for device %d up (pid %d)", device_id, info.pid)
        return info

    def retire(self, device_id: int) -> None:
        """The caller has taken dead `device_id` out of its work (nothing it runs waits on that rank): from now
        on its death fails only calls to it, not every `gather`. A collective over the default (whole-world) group
        cannot complete any more; process groups of live ranks can still be made by every live rank (module
        doc)."""
        if device_id not in self._dead:
            raise RuntimeError(f"device {device_id} is not dead; only a dead worker is retired")
        self._retired.add(device_id)

    def fail(self, device_id: int, reason: str) -> None:
        """Declare `device_id`'s worker failed (it stopped answering): kill it, so no late result of it
        arrives, and treat it as dead from now on."""
        import ray

        self._mark_dead(device_id, reason)
        try:
            ray.kill(self._actors[device_id], no_restart=True)
        except ValueError:   # not an actor handle any more (Ray already shut down)
            pass

    # A call names a module-level function `fn(ctx: WorkerContext, ...)`: the overloads check each call's
    # arguments against it and type its result. A function named by its path ("package.module:function") is
    # checked by nobody before the worker runs it. `device_ids` and `timeout` precede the function's arguments
    # (a ParamSpec takes no keyword-only parameter after it): pass the function's arguments by keyword.
    @overload
    def submit(self, device_id: int, fn: Callable[Concatenate[WorkerContext, P], R], /, *args: P.args,
               **kwargs: P.kwargs) -> CallHandle[R]: ...
    @overload
    def submit(self, device_id: int, fn: str, /, *args: Any, **kwargs: Any) -> CallHandle[Any]: ...

    def submit(self, device_id: int, fn: WorkerFn, /, *args: Any, **kwargs: Any) -> CallHandle[Any]:
        """Start `fn(ctx, *args, **kwargs)` on `device_id`'s worker; returns at once. `fn` is a module-level
        function (or its "package.module:function" path): the worker imports it by name."""
        self._usable(device_id)
        path = fn_path(fn)
        self._audit.note(path, (args, kwargs))   # the arguments go through Ray's object store
        handle: CallHandle[Any] = CallHandle(device_id, path, self._actors[device_id].call.remote(path, args, kwargs))
        self._last[device_id] = handle.ref
        return handle

    @overload
    def submit_all(self, fn: Callable[Concatenate[WorkerContext, P], R], /,
                   device_ids: Iterable[int] | None = None, *args: P.args,
                   **kwargs: P.kwargs) -> list[CallHandle[R]]: ...
    @overload
    def submit_all(self, fn: str, /, device_ids: Iterable[int] | None = None, *args: Any,
                   **kwargs: Any) -> list[CallHandle[Any]]: ...

    def submit_all(self, fn: WorkerFn, /, device_ids: Iterable[int] | None = None, *args: Any,
                   **kwargs: Any) -> list[CallHandle[Any]]:
        """`submit` on every device (or on `device_ids`), same arguments; handles in the given order."""
        ids = self.device_ids if device_ids is None else tuple(device_ids)
        for d in ids:
            self._usable(d)
        return [self.submit(d, fn, *args, **kwargs) for d in ids]

    def gather(self, handles: Sequence[CallHandle[R]], timeout: float | None = None) -> list[R]:
        """Results of `handles`, in order. Raises on the first death, failure, or at the deadline."""
        import ray

        pending: dict[ObjectRef[R], CallHandle[R]] = {h.ref: h for h in handles}
        results: dict[ObjectRef[R], R] = {}
        t0 = time.monotonic()
        next_log = t0 + self._log_every_s
        while pending:
            now = time.monotonic()
            wait_s = self._poll_s if timeout is None else max(0.0, min(self._poll_s, t0 + timeout - now))
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=wait_s)
            for ref in ready:
                try:
                    results[ref] = self._result(pending.pop(ref))
                except PeerFailed as follower:   # report the rank that caused it, if it says so soon
                    raise self._cause(follower, pending) from None
            if not pending:
                break
            # Any dead rank breaks the world (peers block in collectives with it), pending or not.
            self._check_processes(self._actors)
            now = time.monotonic()
            waiting = sorted({h.device_id for h in pending.values()})
            fns = sorted({h.fn for h in pending.values()})
            if timeout is not None and now - t0 >= timeout:
                raise WorkerTimeout(tuple(waiting), ",".join(fns), timeout)
            if now >= next_log:
                log.info("waiting %.0fs for %s on devices %s", now - t0, ",".join(fns), waiting)
                next_log = now + self._log_every_s
        return [results[h.ref] for h in handles]

    def _cause(self, follower: PeerFailed, pending: dict[ObjectRef[R], CallHandle[R]],
               grace_s: float = 10.0) -> BaseException:
        """The first error among `pending` that is not itself a PeerFailed, waited for up to `grace_s` (the
        failing rank raises right after the collective its peers left); else `follower`."""
        import ray

        deadline = time.monotonic() + grace_s
        while pending and time.monotonic() < deadline:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            for ref in ready:
                try:
                    self._result(pending.pop(ref))
                except PeerFailed:
                    continue
                except BaseException as cause:  # noqa: BLE001 - the cause is reported, whatever it is
                    return cause
        return follower

    @overload
    def call(self, device_id: int, fn: Callable[Concatenate[WorkerContext, P], R], /,
             timeout: float | None = None, *args: P.args, **kwargs: P.kwargs) -> R: ...
    @overload
    def call(self, device_id: int, fn: str, /, timeout: float | None = None, *args: Any, **kwargs: Any) -> Any: ...

    def call(self, device_id: int, fn: WorkerFn, /, timeout: float | None = None, *args: Any, **kwargs: Any) -> Any:
        """`fn(ctx, *args, **kwargs)` on one device, waited for."""
        return self.gather([self.submit(device_id, fn, *args, **kwargs)], timeout)[0]

    @overload
    def call_all(self, fn: Callable[Concatenate[WorkerContext, P], R], /, timeout: float | None = None,
                 device_ids: Iterable[int] | None = None, *args: P.args, **kwargs: P.kwargs) -> dict[int, R]: ...
    @overload
    def call_all(self, fn: str, /, timeout: float | None = None, device_ids: Iterable[int] | None = None,
                 *args: Any, **kwargs: Any) -> dict[int, Any]: ...

    def call_all(self, fn: WorkerFn, /, timeout: float | None = None, device_ids: Iterable[int] | None = None,
                 *args: Any, **kwargs: Any) -> dict[int, Any]:
        """`fn(ctx, *args, **kwargs)` on every device (or `device_ids`) at once -> {device_id: result}."""
        handles = self.submit_all(fn, device_ids, *args, **kwargs)
        return {h.device_id: r for h, r in zip(handles, self.gather(handles, timeout))}

    def quiesce(self, device_ids: Iterable[int], timeout_s: float) -> list[int]:
        """Wait until every call submitted to `device_ids` has ended, whatever its outcome (results and errors are
        dropped: for a caller abandoning the work, e.g. the survivors of a lost rank, whose collectives with it
        fail). Calls on a worker run in submission order, so its last call ending means all have. A device still
        busy after `timeout_s` (say, blocked in a collective that never times out) is declared failed (`fail`)
        and returned."""
        import ray

        refs = {self._last[d]: d for d in device_ids if d in self._last and d not in self._dead}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
            except Exception:  # noqa: BLE001 - abandoned work: its outcome is not wanted, only its end
                pass
        stuck = sorted(d for ref, d in refs.items() if ref not in set(ready))
        for d in stuck:
            self.fail(d, f"still busy {timeout_s:g}s after its work was abandoned")
        return stuck

    def interrupt(self, upto: dict[int, int], name: str) -> None:
        """End early, on each device of `upto` {device: seq}, every call numbered up to seq that polls `name`
        (`ctx.interrupted(name, seq)`): the one running and those queued behind it, none submitted later. Returns
        at once (the control thread answers while the call runs); a call that does not poll it is not affected."""
        for d, seq in upto.items():
            self._usable(d)
            self._actors[d].interrupt.options(concurrency_group=CONTROL_GROUP).remote(name, seq)

    # ---------------------------------------------------------------------------------------- liveness
    def health(self, timeout: float = 5.0) -> dict[int, WorkerStatus]:
        """Ask every worker (on its control thread, so a busy one still answers)."""
        import ray
        from ray.exceptions import RayActorError

        refs = {}
        out: dict[int, WorkerStatus] = {}
        for d, a in self._actors.items():
            if d in self._dead:
                out[d] = WorkerStatus(d, "dead", self._dead[d], None)
            else:
                refs[d] = a.health.options(concurrency_group=CONTROL_GROUP).remote()
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
        ready_set = set(ready)
        for d, ref in refs.items():
            reason = self._process_gone(d)
            if reason:
                out[d] = WorkerStatus(d, "dead", reason, None)
            elif ref not in ready_set:
                out[d] = WorkerStatus(d, "unresponsive", f"no health answer within {timeout:.1f}s", None)
            else:
                try:
                    out[d] = WorkerStatus(d, "alive", "", ray.get(ref))
                except RayActorError as e:
                    out[d] = WorkerStatus(d, "dead", self._mark_dead(d, _first_line(e)), None)
        return dict(sorted(out.items()))

    def check(self) -> None:
        """Raise `WorkerDied` for the first dead worker; cheap (no round trip for local workers)."""
        for d in self._actors:
            if d not in self._retired:
                self._usable(d)
        if not self._local:
            for st in self.health().values():
                if st.state == "dead" and st.device_id not in self._retired:
                    raise WorkerDied(st.device_id, st.reason)

    def done(self, handle: CallHandle[Any]) -> bool:
        """Whether `handle`'s call has ended (its result, or its error, is there for `gather`); never waits."""
        import ray

        return bool(ray.wait([handle.ref], timeout=0)[0])

    def wait_ready(self, handles: Sequence[CallHandle[R]], timeout: float | None,
                   num_returns: int = 1) -> list[CallHandle[R]]:
        """Wait until `num_returns` of `handles` (all of them, if fewer) have ended, or `timeout` seconds (None: no
        limit); returns the ended ones, up to `num_returns`, in the order given (a handle given twice, once). A call
        that failed or whose worker died has ended too: `gather` raises its error; this never raises for it."""
        import ray

        by_ref = {h.ref: h for h in handles}
        if not by_ref:
            return []
        ready, _ = ray.wait(list(by_ref), num_returns=min(num_returns, len(by_ref)), timeout=timeout)
        ended = set(ready)
        return [h for ref, h in by_ref.items() if ref in ended]

    def put(self, value: T) -> ObjectRef[T]:
        """`value` into the object store, once, for calls on many devices to take (the workers fetch it
        themselves): pass the reference as a role function's argument."""
        import ray

        self._audit.note("put", value)
        return ray.put(value)

    def store_audit(self, reset: bool = True) -> dict[str, int]:
        """The largest tensor bytes any value carried through Ray's object store since the last reset, per name:
        each call's arguments and `put` here, each call's result on every live worker (`StoreAudit`). The
        transfer layer moves tensors; this says what did not."""
        import ray

        refs = [a.store_audit.options(concurrency_group=CONTROL_GROUP).remote(reset)
                for d, a in self._actors.items() if d in self.live_ids]
        return merged([self._audit.take(reset), *ray.get(refs, timeout=30)])

    def get(self, ref: ObjectRef[T], timeout: float | None = None) -> T:
        """The value `put` stored, or the result of a call by its `CallHandle.ref` (a failed call raises Ray's
        error here: `gather` names the device instead)."""
        import ray

        return ray.get(ref, timeout=timeout)

    def pid(self, device_id: int) -> int:
        return self.infos[device_id].pid

    # ---------------------------------------------------------------------------------------- shutdown
    def shutdown(self, wait_s: float = 10.0) -> None:
        """Kill every worker, lift compute shares, and stop Ray if this group started it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for cap in self._caps.values():
            cap.release()  # resumes a SIGSTOPped worker so it can die cleanly
        import ray

        for a in [*self._actors.values(), *(a for a, _ in self._starting.values())]:
            try:
                ray.kill(a, no_restart=True)
            except ValueError:  # not an actor handle any more (Ray already shut down)
                pass
        if self._local:
            # ray.kill is asynchronous; wait so the next group's workers do not compete with dying ones.
            deadline = time.monotonic() + wait_s
            pids = [i.pid for i in self.infos.values()]
            while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
                time.sleep(0.05)
        self._store = None  # the driver-hosted rendezvous store (embedded Ray) stops with its last reference
        disconnect(self._session)

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------------------------------ private
    def _usable(self, device_id: int) -> None:
        if device_id not in self._actors:
            raise KeyError(f"device {device_id} has no worker in this group (devices {list(self._actors)})")
        if self._closed:
            raise RuntimeError("the worker group is shut down; start a new one")
        if device_id in self._dead:
            raise WorkerDied(device_id, self._dead[device_id])
        reason = self._process_gone(device_id)
        if reason:
            raise WorkerDied(device_id, reason)

    def _result(self, h: CallHandle[R]) -> R:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return ray.get(h.ref, timeout=0)
        except RayActorError as e:
            raise WorkerDied(h.device_id, self._mark_dead(h.device_id, _first_line(e))) from None
        except RayTaskError as e:
            # A collective fails on the survivors when a peer dies; name the dead peer, not the survivor.
            # The peer's sockets close a moment before its pid turns zombie, hence the short grace.
            deadline = time.monotonic() + _DEATH_GRACE_S
            while True:
                self._check_processes(self._actors)
                if time.monotonic() >= deadline or not self._local:
                    break
                time.sleep(0.05)
            if isinstance(e.cause, TidalError):   # bad input found on a worker: the user's error, as itself
                rank = list(self._actors).index(h.device_id)
                raise e.cause.on_device(h.device_id, rank) from None
            raise WorkerCallError(h.device_id, h.fn, str(e)) from None

    def _check_processes(self, device_ids: Iterable[int]) -> None:
        for d in sorted(set(device_ids) - self._retired):
            reason = self._process_gone(d)
            if reason:
                raise WorkerDied(d, reason)

    def _process_gone(self, device_id: int) -> str | None:
        """Local workers only: a pid that left /proc is dead now, before Ray has noticed."""
        if device_id in self._dead:
            return self._dead[device_id]
        info = self.infos.get(device_id)
        if self._local and info is not None and not process_alive(info.pid):
            return self._mark_dead(device_id, f"worker process {info.pid} exited")
        return None

    def _mark_dead(self, device_id: int, reason: str) -> str:
        self._dead.setdefault(device_id, reason)
        if device_id in self._caps:
            self._caps.pop(device_id).release()
        log.error("worker of device %d died: %s", device_id, self._dead[device_id])
        return self._dead[device_id]


def _check_cpu_caps(device_kind: DeviceKind, cpu_cores: Sequence[int] | None,
                    compute_share: float | None) -> tuple[tuple[int, ...] | None, float | None]:
    """`WorkerGroup.start`'s device kind and CPU caps checked: (the pinned cores, sorted; the cores' worth of
    compute each worker gets), each None when not asked for."""
    if device_kind not in ("cpu", "cuda"):
        raise ValueError(f"device_kind={device_kind!r}: use 'cpu' (virtual devices) or 'cuda'")
    pinned = None
    if cpu_cores is not None:
        pinned = tuple(sorted(set(cpu_cores)))
        if device_kind != "cpu":
            raise ValueError(f"cpu_cores={list(pinned)} applies to CPU virtual devices only; "
                             "drop it for device_kind='cuda'")
        have = os.cpu_count() or 1
        if not pinned or pinned[0] < 0 or pinned[-1] >= have:
            raise ValueError(f"cpu_cores={list(pinned)}: this machine has cores 0-{have - 1}; "
                             "pick cores among them")
    if compute_share is None:
        return pinned, None
    if device_kind != "cpu":
        raise ValueError(f"compute_share={compute_share!r} applies to CPU virtual devices only; "
                         "drop it for device_kind='cuda'")
    return pinned, cores_for_share(compute_share, len(pinned) if pinned else None)


def _worker_options(device_kind: DeviceKind, embedded: bool) -> tuple[dict[str, str], dict[str, Any]]:
    """The workers' environment and Ray actor options."""
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if embedded:
        env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's pair sockets on loopback, like the rest
    opts: dict[str, Any] = dict(max_restarts=0, max_task_retries=0, runtime_env={"env_vars": env})
    if device_kind == "cuda":
        opts.update(num_gpus=1, num_cpus=0.01)
    else:
        # A token CPU reservation so many virtual devices (and several groups) fit on a small machine:
        # Ray's CPU accounting does not model them; the real cap is compute_share.
        opts.update(num_gpus=0, num_cpus=CPU_WORKER_NUM_CPUS)
    return env, opts


def start_from_config(cluster: Any, devices: Sequence[int] | None = None) -> WorkerGroup:
    """Start the workers a `tidal.core.config.ClusterConfig` describes (all its devices unless `devices`)."""
    devices = list(range(cluster.num_devices)) if devices is None else list(devices)
    kind = cluster.device
    if kind == "auto":

        kind = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= len(devices) else "cpu"
    share = cluster.cpu_compute_share if kind == "cpu" else None
    cores = cluster.cpu_device_core_ids if kind == "cpu" else None
    return WorkerGroup.start(devices, kind, compute_share=share, ray_address=cluster.ray_address, cpu_cores=cores)


def _check_devices(devices: Sequence[int]) -> tuple[int, ...]:
    devs = tuple(devices)
    if not devs:
        raise ValueError("devices is empty: give the device ids to start workers on, e.g. [0, 1, 2, 3]")
    bad = [d for d in devs if not isinstance(d, int) or isinstance(d, bool) or d < 0]
    if bad:
        raise ValueError(f"devices {list(devs)}: {bad} are not device ids (ints >= 0)")
    if len(set(devs)) != len(devs):
        raise ValueError(f"devices {list(devs)} repeat an id; each device gets exactly one worker")
    return devs


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
