"""`tidal up` / `tidal down`: the local services a person needs, without Docker.

    tidal up                    # Prefect server :4200, MLflow UI :5000, optuna-dashboard :8080 on 127.0.0.1
    tidal up --only mlflow --mlflow-port 5001
    tidal down                  # SIGTERM each service's process group, SIGKILL after --grace seconds

Each service runs as a background process in its own session (so its process group holds it and whatever it
spawns, e.g. MLflow's uvicorn worker), with its log and a JSON pid file in the state dir:

    $TIDAL_HOME/services/  or  ./.tidal/services/   (--state-dir overrides)
        prefect.pid  prefect.log  prefect/   (PREFECT_HOME: the server's SQLite database)
        mlflow.pid   mlflow.log
        optuna.pid   optuna.log
        env          (`source` it: flows, runs and sweeps then use these services, see `env_lines`)

MLflow serves the same store the runs write (`tracking.mlflow_uri`: $MLFLOW_TRACKING_URI, else
`sqlite:///mlruns.db` in the current directory) and optuna-dashboard the store `tidal sweep` writes
(`tidal.core.config.sweep_storage`: $TIDAL_OPTUNA_STORAGE, else the platform database `tracking.db_url`,
$TIDAL_DB_URL or `sqlite:///tidal.db`), so a sweep shows in the dashboard `up` starts. optuna-dashboard does not
create tables, so `up` initialises the Optuna storage first.

Lifecycle of one `tidal up`:

    for each service:  pid file alive, same settings? -> "already running" (idempotent)
                       alive with other settings?    -> error naming the service and `tidal down --only`
                       stale pid file?           -> removed
                       port taken?               -> error naming the flag to change
                       spawn (new session), write pid file
    wait (bounded, progress every 5 s) until every spawned service answers its HTTP health probe
    check every listening socket of each service's process group is on --host (warn if not)
    print addresses

Telemetry is off for every child: PREFECT_SERVER_ANALYTICS_ENABLED=false, DO_NOT_TRACK=true,
MLFLOW_DISABLE_TELEMETRY=true; MLflow runs with MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false and one worker
(about 0.5 GB instead of several). Everything binds 127.0.0.1 unless --host says otherwise.

A pid file is trusted only if its process is alive, not a zombie, and its command line still contains the
service's executable, so a recycled pid is never signalled.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tidal.core.config import TrackingConfig, sweep_storage
from tidal.core.errors import TidalError
from tidal.core.secrets import redact

SERVICES = ("prefect", "mlflow", "optuna")
DEFAULT_PORTS = {"prefect": 4200, "mlflow": 5000, "optuna": 8080}
TELEMETRY_ENV = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "true",
                 "MLFLOW_DISABLE_TELEMETRY": "true"}
Log = Callable[[str], None]


@dataclass(frozen=True)
class ServiceSpec:
    """How to run one service: pure data built from the options (see `build_specs`)."""

    name: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]   # added to the parent's environment
    host: str
    port: int
    health_path: str                   # GET answers 2xx once the service is usable
    ui_path: str = "/"

    @property
    def url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.port}{self.ui_path}"

    @property
    def health_url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.port}{self.health_path}"

    @property
    def settings(self) -> str:
        """A digest of the command line (stores, ports, host): a running service is reused only if it matches.
        A digest, not the command, because a store URL may hold a password and the pid file is plain JSON."""
        return hashlib.sha256("\0".join(self.argv[1:]).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class PidRecord:
    """Contents of `<state>/<name>.pid` (JSON)."""

    name: str
    pid: int            # also the process group id: the service leads its own session
    host: str
    port: int
    url: str
    health_url: str
    exe: str            # must still appear in /proc/<pid>/cmdline for the record to be trusted
    log: str
    started_at: float
    settings: str = ""  # digest of the command it runs (`ServiceSpec.settings`); "" in records that predate it


@dataclass(frozen=True)
class UpOptions:
    state_dir: Path
    host: str = "127.0.0.1"
    prefect_port: int = DEFAULT_PORTS["prefect"]
    mlflow_port: int = DEFAULT_PORTS["mlflow"]
    optuna_port: int = DEFAULT_PORTS["optuna"]
    mlflow_uri: str = "sqlite:///mlruns.db"
    mlflow_artifacts: str = "mlartifacts"
    optuna_storage: str = field(default_factory=lambda: default_stores()[1])
    only: tuple[str, ...] = SERVICES
    timeout_s: float = 180.0


def default_stores() -> tuple[str, str]:
    """(MLflow store, Optuna storage) the runs and sweeps of this environment write: the services show those."""
    fields = TrackingConfig.model_fields
    mlflow = os.environ.get("MLFLOW_TRACKING_URI") or fields["mlflow_uri"].default
    return mlflow, sweep_storage(os.environ.get("TIDAL_DB_URL") or fields["db_url"].default)


def _url_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else (f"[{host}]" if ":" in host else host)


def default_state_dir() -> Path:
    home = os.environ.get("TIDAL_HOME")
    return (Path(home) / "services") if home else Path.cwd() / ".tidal" / "services"


def absolute_sqlite(url: str) -> str:
    """`sqlite:///rel.db` -> `sqlite:////abs/rel.db` (services may run from another directory)."""
    prefix = "sqlite:///"
    if not url.startswith(prefix) or url.startswith(prefix + "/") or url.endswith(":memory:"):
        return url
    return prefix + str((Path.cwd() / url[len(prefix):]).resolve())


def executable(name: str) -> str:
    """The console script next to this interpreter (the venv), else on PATH."""
    here = Path(sys.executable).parent / name
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which(name)
    if not found:
        raise TidalError("service", name, "executable not found next to Python or on PATH",
                         "install tidal's dependencies into this environment (pip install -e .)")
    return found


def build_specs(opts: UpOptions) -> list[ServiceSpec]:
    """The commands `tidal up` runs, in start order. Pure apart from locating executables."""
    telemetry = tuple(TELEMETRY_ENV.items())
    specs: dict[str, ServiceSpec] = {}
    specs["prefect"] = ServiceSpec(
        "prefect", (executable("prefect"), "server", "start", "--host", opts.host, "--port", str(opts.prefect_port),
                    "--analytics-off"),
        # the UI asks its API at PREFECT_UI_API_URL, which defaults to port 4200 whatever --port says
        telemetry + (("PREFECT_HOME", str(opts.state_dir / "prefect")),
                     ("PREFECT_UI_API_URL", f"http://{_url_host(opts.host)}:{opts.prefect_port}/api")),
        opts.host, opts.prefect_port, "/api/health")
    artifacts = opts.mlflow_artifacts
    if "://" not in artifacts:
        artifacts = str(Path(artifacts).expanduser().resolve())
    specs["mlflow"] = ServiceSpec(
        "mlflow", (executable("mlflow"), "server", "--host", opts.host, "--port", str(opts.mlflow_port),
                   "--workers", "1", "--backend-store-uri", absolute_sqlite(opts.mlflow_uri),
                   "--default-artifact-root", artifacts),
        telemetry + (("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false"),),
        opts.host, opts.mlflow_port, "/health")
    specs["optuna"] = ServiceSpec(
        "optuna", (executable("optuna-dashboard"), absolute_sqlite(opts.optuna_storage), "--host", opts.host,
                   "--port", str(opts.optuna_port)),
        telemetry, opts.host, opts.optuna_port, "/api/meta")
    return [specs[n] for n in SERVICES if n in opts.only]


# ---- processes and sockets (Linux /proc) ------------------------------------------------------------------------

def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()  # fields after "pid (comm) ": state, ppid, pgrp, ...


def is_alive(pid: int) -> bool:
    """Running and not a zombie (a zombie answers kill(pid, 0) but is gone)."""
    f = _stat_fields(pid)
    return f is not None and f[0] not in ("Z", "X")


def group_members(pgid: int) -> list[int]:
    """Live processes whose process group is `pgid`."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            f = _stat_fields(int(entry))
            if f is not None and int(f[2]) == pgid and f[0] not in ("Z", "X"):
                out.append(int(entry))
    return sorted(out)


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _decode_addr(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    # /proc/net/tcp{,6} prints each 32-bit word in host (little-endian) order.
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def listening_sockets(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket in LISTEN state owned by `pids`."""
    inode_pid: dict[str, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inode_pid[target[8:-1]] = pid
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inode_pid:  # 0A: TCP_LISTEN
                addr, port = cols[1].rsplit(":", 1)
                out.append((inode_pid[cols[9]], _decode_addr(addr), int(port, 16)))
    return sorted(out)


def _port_free(host: str, port: int) -> bool:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is not "taken"
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _probe(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


# ---- pid files --------------------------------------------------------------------------------------------------

def _pid_path(state: Path, name: str) -> Path:
    return state / f"{name}.pid"


def read_record(state: Path, name: str) -> PidRecord | None:
    try:
        return PidRecord(**json.loads(_pid_path(state, name).read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError):
        return None  # unreadable: treated as stale


def trusted(rec: PidRecord) -> bool:
    """The pid file still describes the process we started (alive, same executable)."""
    return bool(group_members(rec.pid)) and (not is_alive(rec.pid) or rec.exe in _cmdline(rec.pid))


# ---- up ---------------------------------------------------------------------------------------------------------

def _init_optuna_storage(url: str) -> None:
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    import optuna  # creates the tables optuna-dashboard expects (it opens storage with skip_table_creation)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        optuna.storages.RDBStorage(url).remove_session()
    except Exception as err:  # noqa: BLE001 - any driver's connection error is the user's URL or server
        raise TidalError("--optuna-storage", url, f"cannot be opened ({redact(str(err).splitlines()[0])})",
                         "start that database server or pass a reachable URL") from None


def _spawn(spec: ServiceSpec, state: Path) -> PidRecord:
    log_path = state / f"{spec.name}.log"
    env = {**os.environ, **dict(spec.env)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    with open(log_path, "ab") as log:
        log.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} {redact(' '.join(spec.argv))}\n".encode())
        log.flush()
        proc = subprocess.Popen(spec.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True, close_fds=True)
    rec = PidRecord(spec.name, proc.pid, spec.host, spec.port, spec.url, spec.health_url, spec.argv[0],
                    str(log_path), time.time(), spec.settings)
    _pid_path(state, spec.name).write_text(json.dumps(asdict(rec), indent=1))
    return rec


def _log_tail(path: str, n: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def wait_healthy(recs: list[PidRecord], timeout_s: float, log: Log) -> dict[str, str]:
    """Poll each service's health URL until all answer, one exits, or `timeout_s`. Returns name -> failure."""
    pending = {r.name: r for r in recs}
    failed: dict[str, str] = {}
    t0 = last_report = time.monotonic()
    while pending:
        for name, rec in list(pending.items()):
            if _probe(rec.health_url):
                del pending[name]
                log(f"  {name} healthy after {time.monotonic() - t0:.1f} s")
            elif not group_members(rec.pid):
                del pending[name]
                failed[name] = f"exited during start; last lines of {rec.log}:\n{_log_tail(rec.log)}"
        elapsed = time.monotonic() - t0
        if pending and elapsed > timeout_s:
            for name, rec in pending.items():
                failed[name] = (f"not healthy at {rec.health_url} after {timeout_s:.0f} s; last lines of "
                                f"{rec.log}:\n{_log_tail(rec.log)}")
            break
        if pending and time.monotonic() - last_report >= 5:
            last_report = time.monotonic()
            log(f"  waiting for {', '.join(pending)} ({elapsed:.0f} s of {timeout_s:.0f} s)")
        if pending:
            time.sleep(0.25)
    return failed


def up(opts: UpOptions, log: Log = print) -> tuple[list[PidRecord], dict[str, str]]:
    """Start what is not running; returns (records of running services, failures)."""
    state = opts.state_dir
    state.mkdir(parents=True, exist_ok=True)
    running: list[PidRecord] = []
    spawned: list[PidRecord] = []
    specs = build_specs(opts)
    for spec in specs:   # before anything starts: a running service asked for other settings is refused
        rec = read_record(state, spec.name)
        if rec is not None and trusted(rec) and (
                (rec.host, rec.port) != (spec.host, spec.port) or (rec.settings and rec.settings != spec.settings)):
            raise TidalError(spec.name, f"pid {rec.pid} on {rec.host}:{rec.port}",
                             "is already running with other settings (store, port or host) than this `tidal up` asks",
                             f"`tidal down --only {spec.name}`, then `tidal up` again with these settings")
    for spec in specs:
        rec = read_record(state, spec.name)
        if rec is not None and trusted(rec):
            log(f"  {spec.name} already running (pid {rec.pid})")
            running.append(rec)
            continue
        if rec is not None:
            _pid_path(state, spec.name).unlink(missing_ok=True)  # stale: its process is gone
        if not _port_free(spec.host, spec.port):
            raise TidalError(f"--{spec.name}-port", spec.port, f"is already in use on {spec.host}",
                             f"stop what listens there or pass --{spec.name}-port with a free port")
        if spec.name == "optuna":
            _init_optuna_storage(spec.argv[1])
        if spec.name == "mlflow" and "://" not in spec.argv[-1]:
            Path(spec.argv[-1]).mkdir(parents=True, exist_ok=True)
        log(f"  starting {spec.name}: {redact(' '.join(spec.argv[1:]))}")
        spawned.append(_spawn(spec, state))
    failed = wait_healthy(running + spawned, opts.timeout_s, log)
    for rec in spawned:
        if rec.name in failed:
            stop(rec, grace_s=5.0)
            _pid_path(state, rec.name).unlink(missing_ok=True)
    ok = [r for r in running + spawned if r.name not in failed]
    for rec in ok:
        if rec.host in ("0.0.0.0", "::"):
            continue
        wrong = [(a, p) for _, a, p in listening_sockets(group_members(rec.pid)) if a != rec.host]
        if wrong:
            log(f"  warning: {rec.name} also listens on {', '.join(f'{a}:{p}' for a, p in wrong)}, "
                f"not only {rec.host}")
    write_env(state, opts, ok)
    return ok, failed


#: how often a served deployment asks the server for runs to start (Prefect's default: 10 s), and how long a flow
#: run's log lines wait before they are sent (default 2 s): a run submitted in the UI starts within the first, and
#: its page shows each line of the opening the second after it is written. Both cost a request a second or two to
#: a server on this machine.
RUNNER_POLL_S = 1
LOG_BATCH_S = 0.5


def env_lines(recs: list[PidRecord], opts: UpOptions, db_url: str) -> list[str]:
    """The `export` lines that point flows, runs and sweeps at the running services `recs`:

        PREFECT_API_URL                 the Prefect server (the UI's address, PREFECT_UI_URL, follows from it)
        PREFECT_RUNNER_POLL_FREQUENCY   RUNNER_POLL_S, so a submitted run starts within a second
        PREFECT_LOGGING_TO_API_BATCH_INTERVAL   LOG_BATCH_S, so its page shows a log line half a second after it
        MLFLOW_TRACKING_URI             the MLflow server: runs log there (tracking.mlflow_uri), links open its pages
        TIDAL_OPTUNA_STORAGE            the storage optuna-dashboard shows: `tidal sweep` writes its studies there
        TIDAL_OPTUNA_DASHBOARD_URL      that dashboard: a sweep's summary links its study's page
        TIDAL_DB_URL                    the platform database (`db_url`, made absolute), where the dashboard's
                                        storage is that database (`tidal sweep`'s default): one database, wherever
                                        a run or sweep starts

    Store URLs are quoted for the shell (`write_env` makes the file readable by its owner only: a store URL may
    hold a password)."""
    by = {r.name: r for r in recs}
    lines = []
    if "prefect" in by:
        lines += [f"export PREFECT_API_URL={by['prefect'].url.rstrip('/')}/api",
                  f"export PREFECT_RUNNER_POLL_FREQUENCY={RUNNER_POLL_S}",
                  f"export PREFECT_LOGGING_TO_API_BATCH_INTERVAL={LOG_BATCH_S}"]
    if "mlflow" in by:
        lines.append(f"export MLFLOW_TRACKING_URI={by['mlflow'].url.rstrip('/')}")
    if "optuna" in by:
        storage = absolute_sqlite(opts.optuna_storage)
        lines.append(f"export TIDAL_OPTUNA_STORAGE={shlex.quote(storage)}")
        lines.append(f"export TIDAL_OPTUNA_DASHBOARD_URL={by['optuna'].url.rstrip('/')}")
        if storage == absolute_sqlite(db_url):
            lines.append(f"export TIDAL_DB_URL={shlex.quote(storage)}")
    return lines


def write_env(state: Path, opts: UpOptions, started: list[PidRecord]) -> Path:
    """`<state>/env` from every service running under `state` (those this `up` started or found, and those an
    earlier `up --only ...` left running); returns its path."""
    names = {r.name for r in started}
    others = [r for n in SERVICES if n not in names and (r := read_record(state, n)) is not None and trusted(r)]
    path = state / "env"
    db_url = os.environ.get("TIDAL_DB_URL") or TrackingConfig.model_fields["db_url"].default
    path.touch(mode=0o600)
    path.chmod(0o600)
    path.write_text("".join(f"{line}\n" for line in env_lines([*started, *others], opts, db_url)))
    return path


# ---- down -------------------------------------------------------------------------------------------------------

def stop(rec: PidRecord, grace_s: float = 10.0) -> str:
    """SIGTERM the service's process group, SIGKILL what is left after `grace_s`. Returns what happened."""
    def signal_group(sig: int) -> None:
        try:
            os.killpg(rec.pid, sig)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(rec.pid, os.WNOHANG)  # reap it if it is our own child (tests, `up` failures)
        except ChildProcessError:
            pass

    if not group_members(rec.pid):
        return "not running"
    signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        signal_group(0)
        if not group_members(rec.pid):
            return "stopped"
        time.sleep(0.1)
    signal_group(signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while group_members(rec.pid) and time.monotonic() < deadline:
        signal_group(0)
        time.sleep(0.1)
    return "killed after grace period" if not group_members(rec.pid) else "still running after SIGKILL"


def down(state: Path, grace_s: float = 10.0, only: tuple[str, ...] = SERVICES, log: Log = print) -> dict[str, str]:
    results: dict[str, str] = {}
    for name in only:
        rec = read_record(state, name)
        if rec is None:
            if _pid_path(state, name).exists():
                _pid_path(state, name).unlink()
                results[name] = "removed unreadable pid file"
            continue
        results[name] = stop(rec, grace_s) if trusted(rec) else "not running (stale pid file)"
        if results[name] != "still running after SIGKILL":
            _pid_path(state, name).unlink(missing_ok=True)
        log(f"  {name} (pid {rec.pid}): {results[name]}")
    return results


# ---- CLI --------------------------------------------------------------------------------------------------------

def _only(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    for n in names:
        if n not in SERVICES:
            raise TidalError("--only", n, "is not a service", f"use a comma list of {', '.join(SERVICES)}")
    return names


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is outside 1..65535")
    return port


def up_main(argv: list[str]) -> int:
    fields = TrackingConfig.model_fields
    ap = argparse.ArgumentParser(prog="tidal up", description="Start Prefect server, MLflow UI and "
                                 "optuna-dashboard in the background (127.0.0.1 unless --host).")
    ap.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    for name in SERVICES:
        ap.add_argument(f"--{name}-port", type=_port, default=DEFAULT_PORTS[name], help=f"{name} port")
    mlflow_store, optuna_store = default_stores()
    ap.add_argument("--mlflow-uri", default=mlflow_store,
                    help="MLflow backend store (tracking.mlflow_uri of your runs; default $MLFLOW_TRACKING_URI or "
                         f"{fields['mlflow_uri'].default})")
    ap.add_argument("--mlflow-artifacts", default=fields["mlflow_artifacts"].default,
                    help="default artifact root for experiments the server creates")
    ap.add_argument("--optuna-storage", default=optuna_store,
                    help="Optuna storage URL (default: where `tidal sweep` writes: $TIDAL_OPTUNA_STORAGE, else "
                         f"the platform database, $TIDAL_DB_URL or {fields['db_url'].default})")
    ap.add_argument("--only", type=_only, default=SERVICES, help="comma list of services (default: all)")
    ap.add_argument("--state-dir", type=Path, default=None,
                    help="pid files and logs (default $TIDAL_HOME/services or ./.tidal/services)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for health (default 180)")
    args = ap.parse_args(argv)
    state = (args.state_dir or default_state_dir()).resolve()
    opts = UpOptions(state, args.host, args.prefect_port, args.mlflow_port, args.optuna_port, args.mlflow_uri,
                     args.mlflow_artifacts, args.optuna_storage, args.only, args.timeout)
    print(f"tidal up: state in {state}")
    ok, failed = up(opts)
    for rec in ok:
        print(f"  {rec.name:<8} {rec.url:<28} pid {rec.pid}  log {rec.log}")
    if ok:
        print(f"  flows, runs and sweeps use these services after: source {state / 'env'}")
    for name, why in failed.items():
        print(f"error: {name} {why}", file=sys.stderr)
    return 1 if failed else 0


def down_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="tidal down", description="Stop the services `tidal up` started.")
    ap.add_argument("--state-dir", type=Path, default=None, help="as given to `tidal up`")
    ap.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL (default 10)")
    ap.add_argument("--only", type=_only, default=SERVICES, help="comma list of services (default: all)")
    args = ap.parse_args(argv)
    state = (args.state_dir or default_state_dir()).resolve()
    results = down(state, args.grace, args.only)
    if not results:
        print(f"tidal down: nothing running (no pid files in {state})")
    return 1 if any(v == "still running after SIGKILL" for v in results.values()) else 0
