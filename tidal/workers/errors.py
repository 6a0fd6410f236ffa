"""Errors of the worker runtime: each names the device id, never a count or a Ray internal.

* `WorkerDied`: the worker process of a device is gone (killed, OOM, crashed). Survivors may be blocked in a
  collective with the dead rank: every later `gather` raises it until the caller `retire`s the device (it has
  taken it out of its work); a group whose work needs every rank is broken: shut it down and start anew.
* `WorkerTimeout`: a call did not finish within its timeout; the devices still running it are named.
* `WorkerCallError`: the function raised inside the worker; the worker itself is fine.
"""

from __future__ import annotations


class WorkerError(RuntimeError):
    """Base of the runtime's errors."""


class WorkerDied(WorkerError):
    """The worker of `device_id` died; `reason` says how we know."""

    def __init__(self, device_id: int, reason: str):
        self.device_id, self.reason = device_id, reason
        super().__init__(f"worker of device {device_id} died: {reason}")

    def __reduce__(self) -> tuple[type[WorkerDied], tuple[int, str]]:
        return (type(self), (self.device_id, self.reason))


class WorkerTimeout(WorkerError, TimeoutError):
    """`fn` was still running on `device_ids` after `timeout_s` seconds."""

    def __init__(self, device_ids: tuple[int, ...], fn: str, timeout_s: float):
        self.device_ids, self.fn, self.timeout_s = tuple(device_ids), fn, timeout_s
        super().__init__(f"{fn} still running on devices {list(self.device_ids)} after {timeout_s:.1f}s "
                         "(raise the timeout, or check the workers with group.health())")

    def __reduce__(self) -> tuple[type[WorkerTimeout], tuple[tuple[int, ...], str, float]]:
        return (type(self), (self.device_ids, self.fn, self.timeout_s))


class WorkerCallError(WorkerError):
    """`fn` raised on `device_id`; `remote_traceback` is the worker-side traceback."""

    def __init__(self, device_id: int, fn: str, remote_traceback: str):
        self.device_id, self.fn, self.remote_traceback = device_id, fn, remote_traceback
        super().__init__(f"{fn} failed on device {device_id}:\n{remote_traceback}")

    def __reduce__(self) -> tuple[type[WorkerCallError], tuple[int, str, str]]:
        return (type(self), (self.device_id, self.fn, self.remote_traceback))

    @property
    def cause(self) -> str:
        """The remote exception's own line (`Type: message`), the part worth a one-line log."""
        lines = [ln.strip() for ln in self.remote_traceback.strip().splitlines() if ln.strip()]
        return lines[-1] if lines else ""
