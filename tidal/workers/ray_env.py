"""Starting or joining Ray with the network surface contained, and checking what it really binds.

Embedded local Ray (``address=None``) is started like this, each line for a reason found with ``ss -ltnp``
on Ray 2.60 (see docs/workers.md for the measured tables):

* ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: Ray's ``ray.init`` rewrites ``_node_ip_address="127.0.0.1"``
  to the host's external address (``resolve_ip_for_localhost``), and every gRPC server (GCS, raylet,
  core workers, dashboard agent) then listens on ``*``. With single-node mode on, the node address stays
  loopback and all of them listen on ``127.0.0.1`` only. It must be in the environment before ``ray`` is
  imported (Ray reads it into a constant); if ``ray`` was imported first we set that constant.
* ``RAY_AUTH_MODE=token``: every gRPC call needs the token. Ray writes its generated token world-readable
  (``~/.ray/auth_token``, 0644); we create the file ourselves with mode 0600 before Ray looks for it,
  or chmod an existing one.
* ``RAY_USAGE_STATS_ENABLED=0``, ``include_dashboard=False``, a small object store (we pass tensors
  through torch.distributed, not through Ray).

Joining a cluster (``address="host:port"``): the cluster's own settings decide what it binds; we only
turn usage stats off. The token must be given the usual Ray way (``RAY_AUTH_TOKEN_PATH`` or
``~/.ray/auth_token``).

`ray_listeners()` lists the TCP sockets that the local Ray's processes listen on, so tests and docs can
state what is exposed instead of guessing.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("tidal.workers.ray")

LOCAL_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "token",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}
OBJECT_STORE_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class RaySession:
    """How this process is connected to Ray; `owned` sessions are shut down by `disconnect`."""

    address: str
    embedded: bool
    owned: bool
    token_path: Path | None


@dataclass(frozen=True)
class Listener:
    """One listening TCP socket of a Ray process, as `ss -ltnp` shows it."""

    address: str
    port: int
    process: str
    pid: int

    @property
    def loopback(self) -> bool:
        a = self.address.strip("[]")
        return a.startswith(("127.", "::ffff:127.")) or a in ("::1", "::ffff:127.0.0.1")


def ensure_token(path: Path | None = None) -> Path:
    """The token file Ray will use, created or tightened to mode 0600."""
    if path is None:
        env = os.environ.get("RAY_AUTH_TOKEN_PATH")
        path = Path(env) if env else Path.home() / ".ray" / "auth_token"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        os.chmod(path, 0o600)
    else:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return path


def connect(address: str | None = None, *, num_cpus: int | None = None) -> RaySession:
    """Join `address`, or start an embedded single-node Ray bound to loopback. Reuses a live connection."""
    if address is None:
        for k, v in LOCAL_ENV.items():
            os.environ.setdefault(k, v)
        if os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] != "0":
            log.warning("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=%s: Ray will listen on all interfaces",
                        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"])
        if "ray" in sys.modules:
            # Imported before we could set the variable: the constant it feeds was read at import.
            from ray._private import ray_constants

            ray_constants.ENABLE_RAY_CLUSTER = os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] != "0"
    else:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        ctx = ray.get_runtime_context()
        return RaySession(ctx.gcs_address, address is None, owned=False, token_path=None)
    token_path = None
    # ray.init replaces the SIGTERM handler with sys.exit; a handler the program installed (the CLI's, which
    # shuts a run down as SIGINT does and exits 143) is put back
    ours = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    if address is None:
        if os.environ.get("RAY_AUTH_MODE") == "token" and not os.environ.get("RAY_AUTH_TOKEN"):
            token_path = ensure_token()
        ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, _node_ip_address="127.0.0.1",
                 object_store_memory=OBJECT_STORE_BYTES, logging_level=logging.WARNING,
                 log_to_driver=True)
    else:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=True)
    if callable(ours):
        signal.signal(signal.SIGTERM, ours)
    gcs = ray.get_runtime_context().gcs_address
    log.info("Ray %s at %s", "started" if address is None else "joined", gcs)
    return RaySession(gcs, address is None, owned=True, token_path=token_path)


def disconnect(session: RaySession) -> None:
    """Shut Ray down if `session` started the connection; a borrowed one is left to its owner."""
    if session.owned:
        import ray

        ray.shutdown()


def ray_listeners() -> list[Listener]:
    """Listening TCP sockets of this node's Ray processes (GCS, raylet, agents, workers)."""
    from ray._private import worker as ray_worker

    node = ray_worker._global_node
    if node is None:
        return []
    roots = {p.process.pid for procs in node.all_processes.values() for p in procs if p.process is not None}
    pids = _with_descendants(roots)
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        cols = line.split()
        if len(cols) < 6:
            continue
        addr, _, port = cols[3].rpartition(":")
        for name, pid in re.findall(r'\("([^"]+)",pid=(\d+)', cols[5]):
            if int(pid) in pids:
                found.append(Listener(addr, int(port), name, int(pid)))
    return sorted(set(found), key=lambda x: (x.process, x.port))


def _with_descendants(roots: set[int]) -> set[int]:
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
    found = set(roots)
    grew = True
    while grew:
        new = {p for p, pp in parent.items() if pp in found and p not in found}
        found |= new
        grew = bool(new)
    return found
