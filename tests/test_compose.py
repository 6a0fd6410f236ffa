"""Static checks of docker-compose.yml (no Docker engine on our machines): health checks, loopback-only ports,
commands that exist in our dependencies, telemetry off, healthy-dependency ordering, the Dockerfile in sync."""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "docker-compose.yml"
TELEMETRY = {"DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
ENV = {"TIDAL_PG_PASSWORD": "pw"}  # what a team's .env provides


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution: ${VAR}, ${VAR:-default}, ${VAR:?error}, $$ -> $."""
    def sub(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if name in env and env[name] != "":
            return env[name]
        if op == ":?":
            raise KeyError(f"{name}: {arg}")
        return arg if op == ":-" else ""
    out = re.sub(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}", sub, text.replace("$$", "\0"))
    return out.replace("\0", "$")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(interpolate(COMPOSE.read_text(), ENV))


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def argv_of(command: object) -> list[list[str]]:
    """The commands a service runs: a list form, a string, or `sh -c SCRIPT` split on && and ;."""
    words = shlex.split(command) if isinstance(command, str) else [str(w) for w in command]
    if words[:2] != ["sh", "-c"]:
        return [words]
    lexer = shlex.shlex(words[2], posix=True, punctuation_chars=True)  # quotes respected, && and ; tokens
    cmds: list[list[str]] = [[]]
    for tok in lexer:
        if tok in ("&&", ";", "||"):
            cmds.append([])
        else:
            cmds[-1].append(tok)
    return [c[1:] if c[0] == "exec" else c for c in cmds if c]


def test_password_is_required_not_written_down():
    text = COMPOSE.read_text()
    assert "${TIDAL_PG_PASSWORD:?" in text
    with pytest.raises(KeyError, match="TIDAL_PG_PASSWORD"):
        interpolate(text, {})
    value = re.search(r"POSTGRES_PASSWORD:\s*(\S+)", text).group(1)
    assert value.startswith("${TIDAL_PG_PASSWORD"), f"literal password {value!r}"
    assert "tidal:${TIDAL_PG_PASSWORD}@postgres" in text  # service URLs take it from the same variable


def test_services_and_healthchecks(compose):
    services = compose["services"]
    assert set(services) == {"postgres", "prefect", "mlflow", "optuna-dashboard", "worker"}
    for name, svc in services.items():
        hc = svc.get("healthcheck")
        assert hc and hc["test"][0] in ("CMD", "CMD-SHELL"), f"{name} has no healthcheck"
        assert {"interval", "timeout", "retries"} <= set(hc), name
        if hc["test"][1:3] == ["python", "-c"]:
            compile(hc["test"][3], f"{name}.healthcheck", "exec")  # at least valid Python


def test_ports_are_loopback_only(compose):
    seen = set()
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            assert isinstance(port, str) and port.startswith("127.0.0.1:"), f"{name} publishes {port!r}"
            host_port = port.split(":")[1]
            assert host_port not in seen, f"host port {host_port} published twice"
            seen.add(host_port)
    assert compose["services"]["worker"].get("ports") is None  # the worker serves nothing outside


def test_health_probes_hit_the_served_port(compose):
    for name, svc in compose["services"].items():
        words = [w for c in argv_of(svc.get("command", [])) for w in c]
        url = re.search(r"http://127\.0\.0\.1:(\d+)(/\S*?)'", " ".join(svc["healthcheck"]["test"]))
        if name == "postgres":
            continue
        assert url, name
        if name == "worker":
            assert svc["environment"]["PREFECT_RUNNER_SERVER_PORT"] == url.group(1)
            assert svc["environment"]["PREFECT_RUNNER_SERVER_ENABLE"] == "true"
        else:
            joined = " ".join(words)
            assert re.search(rf"--port[ =]{url.group(1)}\b", joined), (name, joined)
            assert f"127.0.0.1:{url.group(1)}:{url.group(1)}" in svc["ports"]


def test_depends_on_waits_for_healthy(compose):
    services = compose["services"]
    for name, svc in services.items():
        deps = svc.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: use the mapping form with conditions"
        for dep, spec in deps.items():
            assert dep in services and spec == {"condition": "service_healthy"}, (name, dep, spec)
    for name in ("prefect", "mlflow", "optuna-dashboard", "worker"):
        assert "postgres" in services[name]["depends_on"]
    assert {"prefect", "mlflow"} <= set(services["worker"]["depends_on"])


def test_telemetry_off_and_mlflow_jobs_off(compose):
    for name, svc in compose["services"].items():
        if name == "postgres":
            continue
        env = svc["environment"]
        for k, v in TELEMETRY.items():
            assert env.get(k) == v, (name, k)
    assert compose["services"]["mlflow"]["environment"]["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"


def test_worker_gets_gpus_and_the_platform(compose):
    worker = compose["services"]["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert worker["command"] == ["tidal", "serve"]
    env = worker["environment"]
    assert env["PREFECT_API_URL"] == "http://prefect:4200/api"
    assert env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    allowed = next(w for w in compose["services"]["mlflow"]["command"] if w.startswith("--allowed-hosts="))
    assert "mlflow:5000" in allowed.split("=", 1)[1].split(",")  # the worker's Host header is accepted


def test_databases_exist(compose):
    init = (REPO / "docker" / "postgres-init.sql").read_text()
    created = set(re.findall(r"CREATE DATABASE (\w+)", init)) | {
        compose["services"]["postgres"]["environment"]["POSTGRES_DB"]}
    text = yaml.safe_dump(compose)
    used = set(re.findall(r"postgresql\+\w+://tidal:pw@postgres:5432/(\w+)", text))
    assert used and used <= created, (used, created)
    mounts = compose["services"]["postgres"]["volumes"]
    assert any(m.startswith("./docker/postgres-init.sql:/docker-entrypoint-initdb.d/") for m in mounts)


def test_named_volumes_declared(compose):
    declared = set(compose.get("volumes") or {})
    for name, svc in compose["services"].items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith((".", "/")):
                assert (REPO / src).exists(), (name, src)
            else:
                assert src in declared, (name, src)


def _console_scripts_of_dependencies(pyproject: dict) -> dict[str, str]:
    deps = {re.split(r"[\[<>=!~; ]", d, maxsplit=1)[0].lower().replace("_", "-")
            for d in pyproject["project"]["dependencies"]}
    out = {}
    for ep in metadata.entry_points(group="console_scripts"):
        dist = ep.dist.metadata["Name"].lower().replace("_", "-") if ep.dist else ""
        if dist in deps:
            out[ep.name] = dist
    return out


def _cli_subcommands() -> set[str]:
    tree = ast.parse((REPO / "tidal" / "cli" / "main.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("_optional", "register") \
                and node.args and isinstance(node.args[0], ast.Constant):
            names.add(node.args[0].value)
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "COMMANDS":
            names |= {k.value for k in node.value.keys}
    return names


def test_commands_exist(compose, pyproject):
    scripts = _console_scripts_of_dependencies(pyproject)
    assert {"prefect", "mlflow", "optuna-dashboard"} <= set(scripts), scripts
    assert pyproject["project"]["scripts"]["tidal"] == "tidal.cli.main:main"
    for name, svc in compose["services"].items():
        if name == "postgres":
            continue
        assert svc["image"] == "tidal:local" and svc["build"]["dockerfile"] == "docker/Dockerfile"
        for argv in argv_of(svc["command"]):
            exe = argv[0]
            if exe == "tidal":
                assert argv[1] in _cli_subcommands(), f"`tidal {argv[1]}` is not a registered sub-command"
            elif exe == "python":
                assert argv[1] == "-c"
                compile(argv[2], f"{name}.command", "exec")
            else:
                assert exe in scripts, f"{name} runs {exe!r}, not a console script of our dependencies"


@pytest.mark.parametrize("service,help_argv", [
    ("mlflow", ["mlflow", "server", "--help"]),
    ("prefect", ["prefect", "server", "start", "--help"]),
    ("optuna-dashboard", ["optuna-dashboard", "--help"]),
])
def test_flags_are_known_to_the_installed_tools(compose, service, help_argv):
    """Each --flag a service passes appears in that tool's --help (catches renamed options)."""
    exe = Path(sys.executable).parent / help_argv[0]
    out = subprocess.run([str(exe), *help_argv[1:]], capture_output=True, text=True, timeout=120,
                         env={"PATH": str(exe.parent), "COLUMNS": "200", **TELEMETRY})
    assert out.returncode == 0, out.stderr
    for argv in argv_of(compose["services"][service]["command"]):
        if argv[0] != help_argv[0]:
            continue
        for word in argv:
            if word.startswith("--"):
                assert word.split("=")[0] in out.stdout, f"{service}: {word} unknown to {' '.join(help_argv)}"


def test_dockerfile_in_sync_with_pyproject(pyproject):
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    folders = {name.rstrip("*") for name in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = set(re.findall(r"^COPY (\S+) \./\1$", dockerfile, flags=re.M))
    assert folders <= copied, f"Dockerfile misses package folders {folders - copied}"
    assert "['project']['dependencies']" in dockerfile  # the dependency layer reads pyproject, not a copy
    ignore = (REPO / "docker" / "Dockerfile.dockerignore").read_text().split()
    for src in copied | {"pyproject.toml", "README.md"}:
        assert (REPO / src).exists(), src
        assert f"!{src}/" in ignore or f"!{src}" in ignore, f"{src} filtered out of the build context"
    assert "USER tidal" in dockerfile  # services do not run as root
