"""Hostile and careless input costs nothing: every generated case (alias bombs, deep nesting, huge files, ranges
and sizes, non-finite numbers, type confusions, override syntax abuse, path escapes) makes `tidal validate`
exit 2 with one message naming its field, within 5 s and 256 MB, without a traceback. The cases run in one
fresh process that measures its own time and peak memory per case; the test prints how many ran."""

import json
import math
import subprocess
import sys
from pathlib import Path

from tidal.core.config import TidalConfig, flatten

SECONDS_PER_CASE = 5.0
EXTRA_MEMORY_MB = 256

RUNNER = r"""
import json, resource, sys, time, io, contextlib
from tidal.cli.main import main
from tidal.pipeline import preflight  # warm: imports (torch, transformers) are not a case's cost
cases = json.load(open(sys.argv[1]))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for c in cases:
    err = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(["validate", c["file"], *c["overrides"], "--no-track"])
        except BaseException as e:   # anything escaping main is a crash
            rc = f"crash: {type(e).__name__}: {e}"[:300]
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    print(json.dumps({"name": c["name"], "rc": rc, "s": time.perf_counter() - t0, "mb": grew,
                      "err": err.getvalue()[-600:]}), flush=True)
"""


def _alias_bomb(levels: int, width: int = 9) -> str:
    lines = [f"a0: &a0 [{', '.join(['x'] * width)}]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def _files(tmp: Path) -> list[dict]:
    """Config files that no parser should spend time or memory on."""
    texts = {
        "alias bomb, 9 levels": ("config", _alias_bomb(9)),
        "alias bomb inside a section": ("config", "run:\n  name: x\n" + "".join(
            f"  k{i}: &k{i} [{', '.join([f'*k{i - 1}'] * 8 if i else ['1'] * 8)}]\n" for i in range(9))),
        "flow nesting 100,000 deep": ("config", "[" * 100_000 + "]" * 100_000),
        "block nesting 200 deep": ("config", "".join("  " * i + f"k{i}:\n" for i in range(200)) + "  " * 200 + "1\n"),
        "file of 2 MB": ("config", "run:\n  name: " + "x" * (2 << 20) + "\n"),
        "a list at the top level": ("<config>", "- a\n- b\n"),
        "a python tag": ("config", "run: !!python/object/apply:os.system ['true']\n"),
        "an unknown section": ("actors", "actors:\n  lr: 1\n"),
        "a section that is a number": ("run", "run: 5\n"),
        "tabs for indentation": ("config", "run:\n\tname: x\n"),
    }
    out = []
    for n, (name, (field, text)) in enumerate(texts.items()):
        path = tmp / f"case{n}.yaml"
        path.write_text(text)
        out.append({"name": name, "file": str(path), "overrides": [], "field": field})
    bad_utf8 = tmp / "latin1.yaml"
    bad_utf8.write_bytes(b"run:\n  name: caf\xe9\n")
    out.append({"name": "not UTF-8", "file": str(bad_utf8), "overrides": [], "field": "config"})
    return out


def _overrides(ok: str) -> list[dict]:
    """Overrides onto a valid config, generated from the config's own fields where they can be."""
    cases: list[tuple[str, list[str], str]] = []
    defaults = flatten(TidalConfig())
    floats = [k for k, v in defaults.items() if isinstance(v, float)]
    for key in floats:   # every float field refuses infinity and NaN
        for bad in (".inf", "-.inf", ".nan"):
            cases.append((f"{key}={bad}", [f"{key}={bad}"], key))
    ints = [k for k, v in defaults.items() if isinstance(v, int) and not isinstance(v, bool)]
    for key in ints:     # every integer field has an upper bound, checked before use
        cases.append((f"{key}=10**20", [f"{key}={10**20}"], key))
    cases += [
        ("betas NaN", ["actor.betas=[.nan, 0.9]"], "actor.betas"),
        ("betas above 1", ["actor.betas=[0.9, 1.5]"], "actor.betas"),
        ("range to a billion", ["cluster.component_placement.inference=6-999999999"], "cluster.component_placement"),
        ("range of a billion ids", ["cluster.component_placement={actor: 0-999999999}"], "cluster.component_placement"),
        ("negative device", ["cluster.component_placement.actor=-1-3"], "cluster.component_placement"),
        ("1e8 devices per node", ["cluster.num_devices_per_node=1e8"], "cluster.num_devices_per_node"),
        ("lr a list", ["actor.lr=[1, 2]"], "actor.lr"),
        ("lr a mapping", ["actor.lr={a: 1}"], "actor.lr"),
        ("steps a word", ["run.num_steps=ten"], "run.num_steps"),
        ("placement a number", ["cluster.component_placement=5"], "cluster.component_placement"),
        ("train files a number", ["data.train_files=7"], "data.train_files"),
        ("no equals sign", ["actor.lr"], "override"),
        ("empty key", ["=3"], "override"),
        ("key below a leaf", ["actor.lr.x=1"], "actor.lr"),
        ("unknown deep key", ["a.b.c.d.e.f=1"], "a"),
        ("alias bomb as a value", ["run.name=" + _alias_bomb(9).replace("\n", "\n")], "run.name"),
        ("value of 100 KB", ["run.name=" + "x" * 100_000], "run.name"),
        ("run name escaping", ["run.name=../../elsewhere"], "run.name"),
        ("run name absolute", ["run.name=/tmp/x"], "run.name"),
        ("run name with NUL", ["run.name=a\x00b"], "run.name"),
        ("model path escaping", ["model.path=../../../../etc"], "model.path"),
        ("seed negative", ["run.seed=-5"], "run.seed"),
    ]
    return [{"name": n, "file": ok, "overrides": ov, "field": f} for n, ov, f in cases]


def test_every_hostile_case_is_a_cheap_clear_error(tmp_path):
    ok = tmp_path / "ok.yaml"
    ok.write_text("run:\n  num_steps: 1\n")
    cases = _files(tmp_path) + _overrides(str(ok))
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps(cases))
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(spec)], capture_output=True, text=True, timeout=900,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["name"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert len(results) == len(cases), proc.stderr[-3000:]
    bad = []
    for c in cases:
        r = results[c["name"]]
        line = r["err"].strip().splitlines()[-1] if r["err"].strip() else ""
        if r["rc"] != 2 or not line.startswith(f"error: {c['field']}") or "Traceback" in r["err"]:
            bad.append(f"{c['name']}: rc {r['rc']}, said {line[:200]!r}")
        elif r["s"] > SECONDS_PER_CASE or r["mb"] > EXTRA_MEMORY_MB:
            bad.append(f"{c['name']}: {r['s']:.1f} s, {r['mb']:.0f} MB")
    worst_s = max(r["s"] for r in results.values())
    peak = max(r["mb"] for r in results.values())
    print(f"hostile input: {len(cases)} cases, all exit 2 naming their field; slowest {worst_s:.2f} s, "
          f"peak +{math.ceil(peak)} MB")
    assert not bad, bad
