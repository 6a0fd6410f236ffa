"""Runs hostile-input cases of the `tidal` command line in one fresh process and checks what each one cost.

    results = run_cases(cases, tmp_path)      # cases: [Case(name, argv, names)], argv as after `tidal`
    assert_refused(cases, results)            # every case: exit 2, one line naming `names`, no traceback,
                                              # under SECONDS_PER_CASE and MEMORY_PER_CASE, nothing left behind

A case's argv runs through `tidal.cli.main.main` (what the `tidal` executable runs), with stdout and stderr
captured. The runner prints a line before each case, so a case that hangs is named when the whole run times out.
"Nothing left behind": the folders a case names as `leftovers` (its `run.output_dir`, the folder of its
`tracking.db_url` and `tracking.mlflow_uri`) hold nothing after it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

SECONDS_PER_CASE = 10.0
MEMORY_PER_CASE_MB = 2048
REPO = Path(__file__).resolve().parents[1]

RUNNER = r"""
import contextlib, io, json, os, resource, sys, time
from tidal.cli.main import main
from tidal.pipeline import preflight   # warm: imports (torch, transformers) are not a case's cost
import transformers, safetensors.torch
cases = json.load(open(sys.argv[1]))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for c in cases:
    print(json.dumps({"start": c["name"]}), flush=True)
    err, out = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    os.environ.update(c["env"])
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = main(c["argv"])
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException as e:   # anything else escaping main is a crash
            rc = f"crash: {type(e).__name__}: {e}"[:300]
    for k in c["env"]:
        os.environ.pop(k, None)
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    print(json.dumps({"name": c["name"], "rc": rc, "s": time.perf_counter() - t0, "mb": grew,
                      "err": err.getvalue()[-1500:], "out": out.getvalue()[-600:]}), flush=True)
"""


@dataclass
class Case:
    """One hostile input: the `tidal` arguments that meet it and the words its error must name (a file, a
    field, a sample). `leftovers`: folders that must hold nothing afterwards (a run's output_dir)."""

    name: str
    argv: list[str]
    names: list[str]
    leftovers: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


def run_cases(cases: list[Case], tmp: Path, timeout_s: float = 600) -> dict[str, dict]:
    """Every case's result: rc, seconds, MB of peak-memory growth, stderr's tail."""
    spec = tmp / "hostile-cases.json"
    spec.write_text(json.dumps([asdict(c) for c in cases]))
    try:
        proc = subprocess.run([sys.executable, "-c", RUNNER, str(spec)], capture_output=True, text=True,
                              timeout=timeout_s, cwd=REPO)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        started = [json.loads(line)["start"] for line in out.splitlines() if line.startswith('{"start"')]
        raise AssertionError(f"hostile cases hung at {started[-1] if started else 'start-up'!r}") from None
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{") and '"start"' not in line[:10]:
            r = json.loads(line)
            results[r["name"]] = r
    missing = [c.name for c in cases if c.name not in results]
    assert not missing, f"the runner stopped (rc {proc.returncode}) at {missing[:1]}: {proc.stderr[-3000:]}"
    return results


def problems(cases: list[Case], results: dict[str, dict]) -> list[str]:
    """What is wrong with each case's handling (empty: every case was a cheap, clear refusal)."""
    bad = []
    for c in cases:
        r = results[c.name]
        lines = [line for line in r["err"].strip().splitlines() if line.strip()]
        said = lines[-1] if lines else ""
        if r["rc"] != 2 or "Traceback" in r["err"] or not said.startswith("error:"):
            bad.append(f"{c.name}: rc {r['rc']}, said {r['err'][-400:]!r}")
        elif not all(n in said for n in c.names):
            bad.append(f"{c.name}: does not name {c.names}: {said[:300]!r}")
        elif r["s"] > SECONDS_PER_CASE or r["mb"] > MEMORY_PER_CASE_MB:
            bad.append(f"{c.name}: {r['s']:.1f} s, {r['mb']:.0f} MB")
        for folder in c.leftovers:
            p = Path(folder)
            if p.exists() and any(p.iterdir()):
                bad.append(f"{c.name}: left {sorted(x.name for x in p.iterdir())[:5]} in {folder}")
    return bad


def assert_refused(cases: list[Case], results: dict[str, dict]) -> None:
    bad = problems(cases, results)
    worst = max(r["s"] for r in results.values())
    peak = max(r["mb"] for r in results.values())
    print(f"hostile input: {len(cases)} cases; {len(cases) - len(bad)} refused cleanly; slowest {worst:.2f} s, "
          f"peak +{peak:.0f} MB")
    assert not bad, "\n".join(bad)
