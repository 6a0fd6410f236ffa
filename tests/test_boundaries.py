"""Package boundaries that the architecture relies on (README: dependency direction)."""

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORCHESTRATION = {"prefect", "mlflow", "ray", "sqlalchemy", "optuna", "alembic"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_engine_imports_no_orchestration_code():
    offenders = {str(p.relative_to(ROOT)): sorted(_imports(p) & ORCHESTRATION)
                 for p in (ROOT / "engine").rglob("*.py") if _imports(p) & ORCHESTRATION}
    assert not offenders, offenders


def test_engine_imports_only_torch_numpy_and_tidal_core():
    allowed_tidal = ("tidal.engine", "tidal.errors", "tidal.placement")
    for p in (ROOT / "engine").rglob("*.py"):
        if p.name == "vllm_server.py":  # runs inside the vLLM environment, imports vllm there
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tidal"):
                assert node.module.startswith(allowed_tidal), f"{p.relative_to(ROOT)} imports {node.module}"


def test_every_package_folder_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    mapping = cfg["package-dir"]
    found = set()
    for pkg, folder in mapping.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            if "migrations" in rel.parts:  # Alembic scripts ship as package data of tidal.db
                continue
            found.add(".".join((pkg, *rel.parts)) if rel.parts else pkg)
    assert found == listed, {"missing from pyproject": sorted(found - listed), "stale": sorted(listed - found)}


def _tidal_imports(path: Path) -> set[str]:
    """Every `tidal.*` module a file imports, at any depth of the file."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("tidal"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("tidal")}
    return out


def test_scheduler_is_pure_decisions_over_typed_records():
    """scheduler/ (policies, observe, reconcile, learning, simulator) imports neither the workers, the pipeline,
    the engine nor Ray: the real run's actuator lives in tidal.pipeline and implements its Actuator protocol."""
    allowed = ("tidal.scheduler", "tidal.errors", "tidal.devices", "tidal.config", "tidal.placement")
    for p in (ROOT / "scheduler").rglob("*.py"):
        bad = sorted(m for m in _tidal_imports(p) if not m.startswith(allowed))
        assert not bad, f"{p.relative_to(ROOT)} imports {bad}"
        assert not _imports(p) & ORCHESTRATION, f"{p.relative_to(ROOT)} imports {_imports(p) & ORCHESTRATION}"


def test_the_driver_names_worker_functions_by_reference_not_by_string():
    """Worker calls pass the function itself (`roles.rollout_run`): a typo is an import or attribute error where
    the code is read, not a failure on a worker at run time."""
    import re
    path = re.compile(r"""["']tidal\.workers\.[a-z_.]+:[a-z_]+["']""")
    for p in [*(ROOT / "tidal").rglob("*.py"), *(ROOT / "flows").rglob("*.py"), *(ROOT / "tasks").rglob("*.py")]:
        hits = path.findall(p.read_text())
        assert not hits, f"{p.relative_to(ROOT)} names worker functions as strings: {hits}"
