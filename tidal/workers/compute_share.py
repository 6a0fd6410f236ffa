"""Fixed compute shares for CPU virtual devices: idle capacity is lost, as on a GPU.

A GPU's throughput does not grow when its neighbour idles. CPU processes on a shared machine do the
opposite: when 7 of 8 "devices" wait, the 8th gets the whole machine and every timing the scheduler sees is
wrong. A `ComputeShare` caps one process (and the threads and children it has or makes) at a fixed number of
core-seconds per second of wall time, whether or not the others are busy.

Mechanisms, first that works wins (``backend="auto"``):

* ``cgroup2``: a cgroup ``tidal-dev-<id>`` under the v2 root with ``cpu.max = "<quota> <period>"``.
* ``cgroup1``: a cgroup ``tidal-dev-<id>`` under the v1 ``cpu`` root with ``cpu.cfs_quota_us`` /
  ``cpu.cfs_period_us`` (the kernel's CFS bandwidth control, same semantics as cgroup2's ``cpu.max``).
  Each device's cgroup is a direct child of the root so that, below its cap, it competes for CPU like
  one ordinary process (CFS weighs sibling groups equally).
* ``duty``: no writable cgroup (containers, non-root). A companion process (``python -m
  tidal.workers.compute_share``) reads the target's CPU time every few ms and ``SIGSTOP``s it once it
  used its quota of the current period, ``SIGCONT`` at the next period. Overshoot within a period (the poll
  interval's worth) is charged to the next period, so the long-run rate is the share; unused quota is not
  carried over (that is the point).

Who waits on whom (duty backend)::

    caller ──apply(pid, cores)──► companion process ──SIGSTOP/SIGCONT──► target pid
                                   │ polls /proc/PID/task/*/schedstat every period/10
    caller ──release()──────────► SIGTERM companion ──► SIGCONT target, exit

The companion exits by itself when the target exits, and always leaves the target running (``SIGCONT``)
when it stops on a signal. If it is SIGKILLed while the target is stopped, the target stays stopped: the
caller's `release()` sends ``SIGCONT`` too.

Units: ``cores`` is core-seconds per wall second (0.25 = a quarter of one core). A machine-relative share
(``cluster.cpu_compute_share``: fraction of all cores) converts with `cores_for_share`.

    >>> cap = ComputeShare.apply(pid, cores=0.25)   # doctest: +SKIP
    >>> cap.backend                                 # doctest: +SKIP
    'cgroup1'
    >>> cap.release()                               # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

log = logging.getLogger("tidal.workers.compute_share")

Backend = Literal["auto", "cgroup2", "cgroup1", "duty"]

DEFAULT_PERIOD_S = 0.05
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_PROC = Path("/proc")
_CGROUP_PREFIX = "tidal-dev-"


def cores_for_share(share: float, num_cores: int | None = None) -> float:
    """Machine-relative share (0.125 of a 2-core machine) -> cores (0.25)."""
    if not 0 < share <= 1:
        raise ValueError(f"compute share {share!r} must be in (0, 1]: a fraction of the machine's cores")
    return share * (num_cores or os.cpu_count() or 1)


# ----------------------------------------------------------------------------------------------- CPU time
def cpu_time_s(pid: int) -> float:
    """Total CPU time (user + system, all threads) of a live process, in seconds.

    Uses per-thread ``schedstat`` (nanoseconds) when the kernel has it and it counts; else `stat_cpu_time_s`,
    which counts in clock ticks (10 ms), as coarse as a quota of 0.25 core in a 50 ms period. Exited threads are
    folded into the process's ``stat`` counters only, so the two are not mixed: schedstat of live threads +
    nothing.
    Raises ProcessLookupError when the process is gone.
    """
    task_dir = _PROC / str(pid) / "task"
    try:
        threads = list(task_dir.iterdir())
    except FileNotFoundError as e:
        raise ProcessLookupError(pid) from e
    total_ns, seen = 0, 0
    for t in threads:
        try:
            total_ns += int((t / "schedstat").read_text().split()[0])
            seen += 1
        except (FileNotFoundError, ProcessLookupError):
            continue  # thread exited between listing and reading, or no schedstat in this kernel
    if not seen or not total_ns:
        # No schedstat, or one that reads 0 for live threads (gVisor and similar sandboxes): the
        # kernel does not account there, and a duty cycle reading 0 would never stop its target.
        return stat_cpu_time_s(pid)
    return total_ns / 1e9


def stat_cpu_time_s(pid: int) -> float:
    """CPU time (user + system) of a live process from ``/proc/PID/stat``, in clock ticks' resolution: kept by
    every kernel and by gVisor. Raises ProcessLookupError when the process is gone."""
    try:
        fields = (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError as e:
        raise ProcessLookupError(pid) from e
    # fields[0] is state (stat field 3): utime/stime are stat fields 14/15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


# ----------------------------------------------------------------------------------------------- pinning
def pin_process(pid: int, cpus: set[int] | frozenset[int] | tuple[int, ...]) -> None:
    """Run every thread of `pid` (and the threads and children they make later) on `cpus` only.

    `os.sched_setaffinity(pid)` moves one thread (the one whose id is `pid`); a Ray worker already has a dozen,
    so each thread of ``/proc/PID/task`` is moved. New threads inherit their creator's mask.
    Why pin at all: a share caps CPU *time*, and CPU time is only work when every device runs on cores of one
    speed. On a VM whose vCPUs are hyperthreads of one host core, two busy vCPUs do about the work of one
    (measured, docs/e2e.md): devices spread over both slow each other down exactly when all are busy.
    """
    cpus = set(cpus)
    if not cpus:
        raise ValueError("pin_process: cpus is empty; give at least one core id")
    bad = sorted(c for c in cpus if c >= (os.cpu_count() or 1) or c < 0)
    if bad:
        n = os.cpu_count() or 1
        raise ValueError(f"cores {bad} do not exist on this machine (cores 0-{n - 1}); pick cores among them")
    try:
        tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    except FileNotFoundError as e:
        raise ProcessLookupError(f"cannot pin pid {pid}: no such live process") from e
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            continue  # the thread exited between listing and pinning


# ------------------------------------------------------------------------------------------------ cgroups
def _cgroup_parent(backend: str) -> Path | None:
    """Writable parent for our cgroups under this backend, or None if it cannot be used here."""
    if backend == "cgroup2":
        root = _CGROUP_ROOT
        ctrl = root / "cgroup.controllers"
        if not ctrl.exists() or "cpu" not in ctrl.read_text().split():
            return None
    else:
        root = _CGROUP_ROOT / "cpu"
        if not (root / "cpu.cfs_quota_us").exists():
            return None
    # Each device's cgroup sits directly under the root, not under a common "tidal" parent: CFS group
    # scheduling weighs sibling groups equally, so under a shared parent all capped devices together would
    # compete for the CPU like ONE process (seen: 2 capped workers got half what an uncapped one did).
    try:
        if backend == "cgroup2":
            (root / "cgroup.subtree_control").write_text("+cpu")  # children need the cpu controller
    except OSError:
        return None
    return root if os.access(root, os.W_OK) else None


def _own_cgroup_path(pid: int, backend: str) -> Path:
    """Where `pid` lives now, to move it back on release."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        hier, ctrls, rel = line.split(":", 2)
        if backend == "cgroup2" and hier == "0":
            return _CGROUP_ROOT / rel.lstrip("/")
        if backend == "cgroup1" and "cpu" in ctrls.split(","):
            return _CGROUP_ROOT / "cpu" / rel.lstrip("/")
    raise FileNotFoundError(f"no {backend} entry in /proc/{pid}/cgroup")


def _make_cgroup(parent: Path, backend: str, cores: float, period_s: float) -> Path:
    cg = parent / f"{_CGROUP_PREFIX}{uuid.uuid4().hex[:12]}"
    cg.mkdir()
    period_us = int(period_s * 1e6)
    quota_us = max(1000, int(cores * period_us))  # the kernel's floor is 1 ms
    if backend == "cgroup2":
        (cg / "cpu.max").write_text(f"{quota_us} {period_us}")
    else:
        (cg / "cpu.cfs_period_us").write_text(str(period_us))
        (cg / "cpu.cfs_quota_us").write_text(str(quota_us))
    return cg


# ------------------------------------------------------------------------------------------------- handle
@dataclass
class ComputeShare:
    """A live cap on one process. Make it with `ComputeShare.apply`; undo it with `release`."""

    pid: int
    cores: float
    period_s: float
    backend: str
    _cgroup: Path | None = None
    _home: Path | None = None
    _companion: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    released: bool = False

    @classmethod
    def apply(cls, pid: int, cores: float, *, period_s: float = DEFAULT_PERIOD_S,
              backend: Backend = "auto") -> ComputeShare:
        """Cap `pid` (its threads and future children) at `cores` core-seconds per second."""
        if not cores > 0:
            raise ValueError(f"cores={cores!r}: a compute share must be > 0 core (e.g. 0.25)")
        if not 0.005 <= period_s <= 1.0:
            raise ValueError(f"period_s={period_s!r}: use a period between 5 ms and 1 s (default 0.05)")
        if not process_alive(pid):
            raise ProcessLookupError(f"cannot cap pid {pid}: no such live process")
        order = ["cgroup2", "cgroup1", "duty"] if backend == "auto" else [backend]
        for b in order:
            if b == "duty":
                return cls._apply_duty(pid, cores, period_s)
            parent = _cgroup_parent(b)
            if parent is None:
                if backend != "auto":
                    raise RuntimeError(f"backend={b!r} is not usable here (no writable {b} cpu controller); "
                                       "use backend='auto' or 'duty'")
                continue
            home = _own_cgroup_path(pid, b)
            cg = _make_cgroup(parent, b, cores, period_s)
            try:
                (cg / "cgroup.procs").write_text(str(pid))
            except OSError:
                cg.rmdir()
                if backend != "auto":
                    raise
                continue
            log.debug("pid %d capped at %.3f cores via %s (%s)", pid, cores, b, cg)
            return cls(pid, cores, period_s, b, _cgroup=cg, _home=home)
        raise AssertionError("unreachable: 'duty' always applies")

    @classmethod
    def _apply_duty(cls, pid: int, cores: float, period_s: float) -> ComputeShare:
        cmd = [sys.executable, "-m", "tidal.workers.compute_share", "--pid", str(pid),
               "--cores", repr(cores), "--period", repr(period_s)]
        # Own session: a Ctrl-C aimed at the caller must not kill the companion before it resumes the target.
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
        log.debug("pid %d capped at %.3f cores via duty cycle (companion pid %d)", pid, cores, proc.pid)
        return cls(pid, cores, period_s, "duty", _companion=proc)

    def usage_s(self) -> float:
        """CPU seconds the capped process has used so far (for tests and metrics)."""
        return cpu_time_s(self.pid)

    def release(self) -> None:
        """Lift the cap. Idempotent; safe after the target exited."""
        if self.released:
            return
        self.released = True
        if self._companion is not None:
            if self._companion.poll() is None:
                self._companion.terminate()
                try:
                    self._companion.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._companion.kill()
                    self._companion.wait()
            try:
                os.kill(self.pid, signal.SIGCONT)  # in case the companion died holding it stopped
            except ProcessLookupError:
                pass
        if self._cgroup is not None:
            if process_alive(self.pid) and self._home is not None:
                try:
                    (self._home / "cgroup.procs").write_text(str(self.pid))
                except OSError as e:
                    log.warning("could not move pid %d back to %s: %s", self.pid, self._home, e)
            # The kernel refuses rmdir while a task (even one exiting) is still charged to the group.
            for _ in range(50):
                try:
                    self._cgroup.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)
            else:
                log.warning("cgroup %s still busy; left in place", self._cgroup)

    def __enter__(self) -> ComputeShare:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# ------------------------------------------------------------------------------------- duty-cycle loop
def run_duty_cycle(pid: int, cores: float, period_s: float) -> None:
    """Hold `pid` to `cores` until it exits or we get SIGTERM/SIGINT; always leave it running."""
    quota = cores * period_s
    poll = max(0.001, period_s / 10)
    stopping = False

    def _stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    debt = 0.0
    try:
        while not stopping:
            t0 = time.monotonic()
            try:
                os.kill(pid, signal.SIGCONT)
                used0 = cpu_time_s(pid)
            except ProcessLookupError:
                return
            allowance = quota - debt
            end = t0 + period_s
            stopped = allowance <= 0
            if stopped:
                os.kill(pid, signal.SIGSTOP)
            while not stopping:
                now = time.monotonic()
                if now >= end:
                    break
                if not stopped:
                    try:
                        used = cpu_time_s(pid) - used0
                    except ProcessLookupError:
                        return
                    if used >= allowance:
                        os.kill(pid, signal.SIGSTOP)
                        stopped = True
                time.sleep(min(poll, end - now))
            try:
                used = cpu_time_s(pid) - used0
            except ProcessLookupError:
                return
            # Overshoot is charged to the next period (so the average holds); unused quota is forfeited.
            debt = max(0.0, used - allowance) if allowance > 0 else max(0.0, debt - quota + used)
            if not process_alive(pid):
                return
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Duty-cycle companion: cap a process at a fixed CPU share.")
    p.add_argument("--pid", type=int, required=True, help="process to cap")
    p.add_argument("--cores", type=float, required=True, help="core-seconds per second, e.g. 0.25")
    p.add_argument("--period", type=float, default=DEFAULT_PERIOD_S, help="accounting period in seconds")
    a = p.parse_args(argv)
    run_duty_cycle(a.pid, a.cores, a.period)


if __name__ == "__main__":
    main()
