"""Package boundaries that the architecture relies on: import names are folder paths, each package imports only
the packages below it, private modules stay private, and an import inside a function is there only to keep a
heavy dependency out of a module that otherwise does without it."""

import ast
import re
import tomllib
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = ("tidal", "scheduler", "flows", "tasks", "db")   # the import names the distribution installs
PACKAGE_DATA = {ROOT / "db" / "migrations"}                  # Alembic scripts: files shipped with db, not modules
OUTSIDE = ("tidal/engine/generation/vllm_server.py",)        # runs inside the vLLM environment, never imported

# The packages each package may import (besides itself and the standard library), bottom to top. A package of
# tidal is named `tidal.<name>`; `tidal.cli` (the entry points) may import everything.
MAY_IMPORT = {
    "tidal.core": set(),
    "tidal.engine": {"tidal.core"},
    "tidal.workers": {"tidal.core", "tidal.engine"},
    "scheduler": {"tidal.core"},
    "db": {"tidal.core"},
    "tidal.convert": {"tidal.core"},
    "tidal.tracking": {"tidal.core"},
    "tidal.pipeline": {"tidal.core", "tidal.engine", "tidal.workers", "scheduler", "db", "tidal.tracking"},
    "tidal.sweep": {"tidal.core", "scheduler", "tidal.pipeline", "tidal.tracking"},
    "tasks": {"tidal.core", "scheduler", "tidal.pipeline", "tidal.sweep", "tidal.tracking"},
    "flows": {"tidal.core", "tasks"},
    "tidal": set(),
}
# Third-party packages a package must not import at all (at any depth of its files).
ORCHESTRATION = {"prefect", "mlflow", "ray", "sqlalchemy", "optuna", "alembic"}
MUST_NOT_IMPORT = {
    "tidal.core": ORCHESTRATION | {"torch", "transformers"},
    "tidal.engine": ORCHESTRATION,
    "tidal.workers": ORCHESTRATION - {"ray"},
    "scheduler": ORCHESTRATION | {"torch"},
    "db": ORCHESTRATION - {"sqlalchemy", "alembic"} | {"torch"},
    "tidal.convert": ORCHESTRATION | {"torch"},
    "tidal.tracking": ORCHESTRATION - {"mlflow"} | {"torch"},
    "tidal.pipeline": {"prefect", "mlflow", "optuna", "ray"},   # Ray stays inside tidal.workers
    "tidal.sweep": {"prefect", "mlflow", "torch"},
    "tasks": {"mlflow", "torch", "ray"},
    "flows": {"mlflow", "torch", "ray"},
}
# Heavy to import, or present only on some machines (triton: beside a CUDA build of torch): a function-level import
# of one of these (or of our module that loads one) is a lazy import with a reason, provided the importing module
# does not load it anyway. Everything else is imported at the top.
HEAVY = {"torch", "ray", "prefect", "mlflow", "optuna", "optuna_dashboard", "megatron", "vllm", "transformers",
         "matplotlib", "sqlalchemy", "alembic", "pyarrow", "math_verify", "triton"}


@cache
def _modules() -> dict[str, Path]:
    out = {}
    for top in TOP_LEVEL:
        for p in (ROOT / top).rglob("*.py"):
            if any(d in p.parents for d in PACKAGE_DATA) or str(p.relative_to(ROOT)) in OUTSIDE:
                continue
            parts = p.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


@cache
def _tree(module: str) -> ast.Module:
    return ast.parse(_modules()[module].read_text())


def _named(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules (and, for `from m import n`, the `m.n` candidates) an import statement names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level or not node.module:
        return []
    return [node.module] + [f"{node.module}.{a.name}" for a in node.names]


def _imports(module: str, top_only: bool = False) -> list[tuple[ast.Import | ast.ImportFrom, list[str]]]:
    """Every import statement of `module` (top_only: those that run when it is imported, TYPE_CHECKING excluded)."""
    if not top_only:
        return [(n, _named(n)) for n in ast.walk(_tree(module)) if isinstance(n, ast.Import | ast.ImportFrom)]
    out = []

    def visit(body):
        for n in body:
            if isinstance(n, ast.Import | ast.ImportFrom):
                out.append((n, _named(n)))
            elif isinstance(n, ast.If) and not (isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING"):
                visit(n.body)
                visit(n.orelse)
            elif isinstance(n, ast.Try):
                visit(n.body)
                for h in n.handlers:
                    visit(h.body)
                visit(n.orelse)
    visit(_tree(module).body)
    return out


def _unit(module: str) -> str:
    """The package a module belongs to for MAY_IMPORT: `tidal.<name>` inside tidal, else its top-level name."""
    parts = module.split(".")
    return f"tidal.{parts[1]}" if parts[0] == "tidal" and len(parts) > 1 else parts[0]


def _own(name: str) -> str | None:
    """Our module that an imported name refers to (`m` for `m` or for `m.attr`), if any."""
    mods = _modules()
    return name if name in mods else (name.rsplit(".", 1)[0] if name.rsplit(".", 1)[0] in mods else None)


def test_import_names_are_folder_paths():
    """Every folder of Python files is a package named by its path, and pyproject installs exactly these roots."""
    for top in TOP_LEVEL:
        for folder in [ROOT / top, *(p for p in (ROOT / top).rglob("*") if p.is_dir())]:
            if folder.name == "__pycache__" or any(d == folder or d in folder.parents for d in PACKAGE_DATA):
                continue
            if any(folder.glob("*.py")):
                assert (folder / "__init__.py").is_file(), f"{folder.relative_to(ROOT)} has modules, no __init__.py"
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "package-dir" not in setuptools, "import names must be folder paths: no package-dir remapping"
    assert {n.rstrip("*") for n in setuptools["packages"]["find"]["include"]} == set(TOP_LEVEL)


def test_no_script_folder_shadows_a_package():
    """`python benchmarks/X.py` puts benchmarks/ first on sys.path: a script there named like a top-level package
    (benchmarks/scheduler.py) would be imported in its place."""
    for folder in ("benchmarks", "benchmarks/host", "scripts", "docker"):
        clash = sorted(p.name for p in (ROOT / folder).glob("*.py") if p.stem in TOP_LEVEL)
        assert not clash, f"{folder}/{clash} shadow the packages of the same name"


def test_each_package_imports_only_the_packages_below_it():
    offenders = []
    for module in _modules():
        unit = _unit(module)
        if unit == "tidal.cli":
            continue
        for node, names in _imports(module):
            for name in names[:1] if isinstance(node, ast.ImportFrom) else names:
                target = _unit(name)
                if name.split(".")[0] in TOP_LEVEL and target != unit and target not in MAY_IMPORT[unit]:
                    offenders.append(f"{module} imports {name}")
                if name.split(".")[0] in MUST_NOT_IMPORT.get(unit, set()):
                    offenders.append(f"{module} imports {name.split('.')[0]}")
    assert not offenders, offenders


def test_mlflow_is_imported_by_the_tracking_module_only():
    users = {m for m in _modules() for _, names in _imports(m) for n in names if n.split(".")[0] == "mlflow"}
    assert users <= {"tidal.tracking"}, users


def _private_module(name: str) -> str | None:
    """The package owning the first `_private` module on the dotted path `name`, if there is one."""
    parts = name.split(".")
    for i, part in enumerate(parts[1:], start=1):
        if part.startswith("_") and not part.startswith("__") and ".".join(parts[:i + 1]) in _modules():
            return ".".join(parts[:i])
    return None


def test_no_private_module_or_name_is_imported_from_outside_its_package():
    """`pkg._mod` is imported only inside `pkg`; `_name` of another package's module only inside that package
    (tests may reach a private function, never a private module)."""
    offenders = []
    files = dict(_modules())
    for folder in ("tests", "benchmarks"):
        files |= {f"{folder}.{p.stem}": p for p in (ROOT / folder).rglob("*.py")}
    for module, path in files.items():
        tree = _tree(module) if module in _modules() else ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for name in _named(node):
                owner = _private_module(name)
                if owner and not module.startswith(owner + "."):
                    offenders.append(f"{path.relative_to(ROOT)} imports private module {name}")
            if (isinstance(node, ast.ImportFrom) and node.module and _own(node.module) and module in _modules()
                    and _unit(node.module) != _unit(module)):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private:
                    offenders.append(f"{path.relative_to(ROOT)} imports {private} from {node.module}")
    assert not offenders, offenders


@cache
def _heavy_loaded(module: str, stack: tuple[str, ...] = ()) -> frozenset[str]:
    """The HEAVY packages importing `module` loads (its package parents included)."""
    if module in stack:
        return frozenset()
    parents = [".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)]
    out: set[str] = set()
    for name in [n for _, names in _imports(module, top_only=True) for n in names] + parents:
        if name.split(".")[0] in HEAVY:
            out.add(name.split(".")[0])
        elif (own := _own(name)) and own != module:
            out |= _heavy_loaded(own, (*stack, module))
    return frozenset(out)


def test_imports_inside_functions_keep_a_heavy_dependency_out():
    """A function-level import is lazy for a reason: it loads a heavy package (HEAVY, directly or through our
    module that imports it) that its module does not load anyway. Any other import belongs at the top."""
    offenders = []
    for module in _modules():
        for fn in ast.walk(_tree(module)):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if not isinstance(node, ast.Import | ast.ImportFrom) or not (names := _named(node)):
                    continue
                name = names[0]
                brings = {name.split(".")[0]} & HEAVY or (_heavy_loaded(_own(name)) if _own(name) else set())
                if not brings - _heavy_loaded(module):
                    offenders.append(f"{_modules()[module].relative_to(ROOT)}:{node.lineno} imports {name} in "
                                     f"{fn.name}() for no heavy dependency")
    assert not offenders, offenders


def test_the_driver_names_worker_functions_by_reference_not_by_string():
    """Worker calls pass the function itself (`roles_rollout.rollout_run`): a typo is an import or attribute error where
    the code is read, not a failure on a worker at run time."""
    path = re.compile(r"""["']tidal\.workers\.[a-z_.]+:[a-z_]+["']""")
    for module, p in _modules().items():
        if _unit(module) in {"tidal.pipeline", "flows", "tasks", "tidal.cli", "tidal.sweep"}:
            hits = path.findall(p.read_text())
            assert not hits, f"{p.relative_to(ROOT)} names worker functions as strings: {hits}"


#: the placement's fields as the pipeline names them (`tidal.pipeline.placement.LivePlacement`, `Homes`)
PLACEMENT_FIELDS = {"actor", "actor_layout", "rollout", "inference", "lent", "inference_lent", "inf_lent", "homes",
                    "initial_layout", "rollout_home", "inference_home", "_placement", "placement"}
#: methods that change a container in place
MUTATORS = {"append", "extend", "insert", "remove", "pop", "clear", "add", "discard", "update", "sort",
            "__setitem__", "__delitem__"}
#: where placement fields may be written: the owner, and the worker-side role slots (`roles.rollout` is a
#: worker's engine, not the run's placement)
PLACEMENT_WRITERS = {"tidal.pipeline.actuator"}
PLACEMENT_READERS = ("tidal.pipeline", "tidal.cli", "tidal.sweep", "tidal.tracking", "tasks", "flows")


def _placement_writes(module: str) -> list[str]:
    out = []
    for node in ast.walk(_tree(module)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [t for tgt in node.targets for t in (tgt.elts if isinstance(tgt, ast.Tuple) else [tgt])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            targets = [node.func.value]
        for t in targets:
            if isinstance(t, ast.Subscript):
                t = t.value
            if isinstance(t, ast.Attribute) and t.attr in PLACEMENT_FIELDS:
                out.append(f"{module}:{node.lineno} {ast.unparse(node)[:80]}")
    return out


def test_only_the_actuator_changes_the_placement():
    """One owner of placement: every other module of the pipeline and above reads the actuator's frozen snapshot
    and never assigns or changes a placement field in place."""
    writes = [w for m in _modules() if m.startswith(PLACEMENT_READERS) and m not in PLACEMENT_WRITERS
              for w in _placement_writes(m)]
    assert not writes, "placement written outside the actuator:\n" + "\n".join(writes)
    assert _placement_writes("tidal.pipeline.actuator"), "the scan finds the owner's own writes"


def test_placement_records_are_frozen_and_made_by_the_owner():
    from tidal.pipeline.placement import Homes, LivePlacement
    assert LivePlacement.__dataclass_params__.frozen and Homes.__dataclass_params__.frozen
    makers = [m for m in _modules() if m not in ("tidal.pipeline.placement", "tidal.pipeline.actuator")
              and any(isinstance(n, ast.Call) and "LivePlacement" in ast.unparse(n.func).split(".")
                      for n in ast.walk(_tree(m)))]
    assert not makers, f"modules that build a LivePlacement: {makers}"


def test_the_pipeline_calls_workers_through_the_role_endpoints():
    """The pipeline submits no role function itself: every worker call goes through `tidal.workers.endpoints`,
    whose methods are typed by the role functions' signatures and return typed `CallHandle`s."""
    direct = []
    for module in _modules():
        if _unit(module) != "tidal.pipeline":
            continue
        for node in ast.walk(_tree(module)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in {"submit", "submit_all", "call", "call_all"}:
                direct.append(f"{module}:{node.lineno} {ast.unparse(node)[:80]}")
    assert not direct, "worker calls outside the endpoints:\n" + "\n".join(direct)
