"""Every result the README and docs/ cite exists, and every cited GPU result says where, when and what it measured.

What counts as a citation, in README.md and every docs/*.md:
- a path under `benchmarks/results/`, e.g. `benchmarks/results/rollout/2026-11-29_e04e634_h200.json`; brace forms
  expand (`..._2xh200_{1b,7b}.json` is two files); a folder (`benchmarks/results/hf_parity/`) cites its JSON files;
  templates (`<date>_<commit7>_<machine>.json`) are not citations;
- a result file named by its benchmark folder alone, e.g. `rollout/2026-12-04_e4d4b42_h200_paged_4k.json`;
- a result file named alone, `2026-12-02_e24212f_h200.json`, or elided, `..._e4d4b42_h200.json`: some folder of
  benchmarks/results/ holds a file of that name (ending);
- a path with a folder ending in `.png` (a bare `timeline.png` names a run's artifact, not a file of this tree).
Each must exist.

A cited JSON is a GPU result when its name carries a GPU machine (`_h200`, `_h100`, `_2xh200`, ...; the
convention of benchmarks/results/README.md) or its `device` field names a GPU (`cuda`, `NVIDIA H200`). Such a file
must hold the machine, the date and the commit: the fields `machine`, `date`, `commit` (the keys every result
file uses). Where its contents lack one, the file name supplies it, by the convention
`<YYYY-MM-DD>_<commit7>_<machine>[_<variant>].json` (benchmarks/results/README.md); a file whose contents lack a
field and whose name does not follow the convention fails. Where the contents hold a field, they must agree with
the name: the date starts with the name's date, the commit and the name's commit7 share their first 7 characters,
and the machine mentions the name's GPU (`h200` -> "H200").

Reads text and JSON only: no torch, no Ray.
"""

import datetime
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_PATH_CHARS = r"[A-Za-z0-9_.{},/<>*+-]"
_FULL = re.compile(rf"benchmarks/results/{_PATH_CHARS}*")
_SHORT = re.compile(r"(?<![\w/.-])([a-z][a-z0-9_]*)/(\d{4}-\d{2}-\d{2}_[0-9a-f]{7}[A-Za-z0-9_.{},+-]*)")
_BARE = re.compile(r"(?<![\w/.-])(\d{4}-\d{2}-\d{2}_[0-9a-f]{7}[A-Za-z0-9_.{},+-]*\.json)")
_ELIDED = re.compile(r"\.\.\._([A-Za-z0-9_.{},+-]+\.json)")
_PNG = re.compile(r"(?<![\w/.-])([\w.{},+-]+/[\w./{},+-]*\.png)")
_NAME = re.compile(r"^(?P<date>\d{4}-\d{2}-\d{2})_(?P<commit>[0-9a-f]{7,40})_(?P<machine>[A-Za-z0-9.-]+)(?:_.+)?$")
_GPU_MACHINE = re.compile(r"^(?:\d+x)?(?P<gpu>h100|h200|a100|h20|b200|l40s?|gb200)$", re.IGNORECASE)
_GPU_DEVICE = re.compile(r"cuda|nvidia|gpu|\bh100\b|\bh200\b", re.IGNORECASE)


def expand_braces(text: str) -> list[str]:
    """`a_{1b,7b}.json` -> [`a_1b.json`, `a_7b.json`]; several groups multiply; no braces: [text]."""
    m = re.search(r"\{([^{}]*)\}", text)
    if m is None:
        return [text]
    return [out for alt in m.group(1).split(",")
            for out in expand_braces(text[:m.start()] + alt + text[m.end():])]


def _clean(path: str) -> str:
    return path.rstrip(".,;:)")


def cited_paths(text: str) -> set[str]:
    """Repository-relative paths the text cites under benchmarks/results/ and .png paths, braces expanded."""
    found = {_clean(m.group(0)) for m in _FULL.finditer(text)}
    folders = {p.name for p in RESULTS.iterdir() if p.is_dir()}
    found |= {f"benchmarks/results/{m.group(1)}/{_clean(m.group(2))}" for m in _SHORT.finditer(text)
              if m.group(1) in folders}
    found |= {_clean(m.group(1)) for m in _PNG.finditer(text)}
    paths = {p for raw in found if "<" not in raw and "*" not in raw for p in expand_braces(raw)}
    for pattern, regex in (("*/{}", _BARE), ("*/*_{}", _ELIDED)):
        for m in regex.finditer(text):
            for name in expand_braces(_clean(m.group(1))):
                hits = {h.relative_to(ROOT).as_posix() for h in RESULTS.glob(pattern.format(name))}
                paths |= hits or {f"benchmarks/results/{pattern.format(name)}"}   # none: reported as missing
    return paths


def citations() -> dict[str, set[str]]:
    """cited path -> the documents citing it."""
    out: dict[str, set[str]] = {}
    for doc in DOCS:
        for path in cited_paths(doc.read_text(encoding="utf-8")):
            out.setdefault(path, set()).add(doc.relative_to(ROOT).as_posix())
    return out


def cited_json_files() -> dict[Path, set[str]]:
    """Every existing cited result JSON (a cited folder: its JSON files) -> the documents citing it."""
    out: dict[Path, set[str]] = {}
    for path, docs in citations().items():
        p = ROOT / path
        files = sorted(p.rglob("*.json")) if p.is_dir() else [p] if p.suffix == ".json" and p.is_file() else []
        for f in files:
            out.setdefault(f, set()).update(docs)
    return out


def name_fields(path: Path) -> dict[str, str] | None:
    """date, commit, machine from `<YYYY-MM-DD>_<commit7>_<machine>[_<variant>].json`; None if it does not follow."""
    m = _NAME.match(path.stem)
    if m is None:
        return None
    try:
        datetime.date.fromisoformat(m.group("date"))
    except ValueError:
        return None
    return m.groupdict()


def is_gpu_result(path: Path, data: object) -> bool:
    fields = name_fields(path)
    if fields is not None and _GPU_MACHINE.match(fields["machine"]):
        return True
    device = data.get("device") if isinstance(data, dict) else None
    return isinstance(device, str) and bool(_GPU_DEVICE.search(device))


def provenance_problems(path: Path, data: object) -> list[str]:
    """What a GPU result lacks or contradicts (empty: machine, date and commit are known and agree)."""
    data = data if isinstance(data, dict) else {}
    named = name_fields(path)
    problems = []
    for key in ("machine", "date", "commit"):
        if not data.get(key) and named is None:
            problems.append(f"no `{key}` field, and the name does not follow <YYYY-MM-DD>_<commit7>_<machine>.json")
    if named is None:
        return problems
    if data.get("date") and not str(data["date"]).startswith(named["date"]):
        problems.append(f"`date` {data['date']!r} is not the name's {named['date']}")
    if data.get("commit") and str(data["commit"])[:7] != named["commit"][:7]:
        problems.append(f"`commit` {data['commit']!r} is not the name's {named['commit']}")
    gpu = _GPU_MACHINE.match(named["machine"])
    if data.get("machine") and gpu and gpu.group("gpu").lower() not in str(data["machine"]).lower():
        problems.append(f"`machine` {str(data['machine'])[:80]!r} does not mention the name's {gpu.group('gpu')}")
    return problems


def test_brace_expansion():
    assert expand_braces("r/x_{1b,7b}.json") == ["r/x_1b.json", "r/x_7b.json"]
    assert expand_braces("{a,b}_{c,d}") == ["a_c", "a_d", "b_c", "b_d"]
    assert expand_braces("plain.json") == ["plain.json"]


def test_citations_are_found_in_every_form():
    text = ("see `benchmarks/results/reshard/2026-11-29_56e02d6_2xh200_{1b,7b}.json`, "
            "(`rollout/2026-12-04_e4d4b42_h200_paged_4k.json`), `benchmarks/results/hf_parity/`, "
            "`benchmarks/results/e2e/<date>_<commit7>_cpu2.json`, `timeline.png`, "
            "`benchmarks/results/e2e/2026-12-04_f631347_h200_1gpu_timeline.png`, "
            "`2026-12-02_e24212f_h200.json`, `..._ad515d9_h200_sampled.json`, `..._0000000_h200.json`.")
    assert cited_paths(text) == {
        "benchmarks/results/collocated/2026-12-02_e24212f_h200.json",
        "benchmarks/results/rollout/2026-12-03_ad515d9_h200_sampled.json",
        "benchmarks/results/*/*_0000000_h200.json",   # elided, and no file ends so: reported as missing
        "benchmarks/results/reshard/2026-11-29_56e02d6_2xh200_1b.json",
        "benchmarks/results/reshard/2026-11-29_56e02d6_2xh200_7b.json",
        "benchmarks/results/rollout/2026-12-04_e4d4b42_h200_paged_4k.json",
        "benchmarks/results/hf_parity/",
        "benchmarks/results/e2e/2026-12-04_f631347_h200_1gpu_timeline.png",
    }


def test_the_name_rule():
    assert name_fields(Path("2026-11-29_56e02d6_2xh200_7b.json")) == {
        "date": "2026-11-29", "commit": "56e02d6", "machine": "2xh200"}
    assert name_fields(Path("e2e_cpu.json")) is None
    assert is_gpu_result(Path("2026-12-03_5be6418_h200.json"), {})
    assert not is_gpu_result(Path("2026-11-30_f47a983_host16.json"), {"machine": "16 host cores of a 1 x H200"})
    assert is_gpu_result(Path("x.json"), {"device": "cuda"})
    assert provenance_problems(Path("x.json"), {"device": "cuda"}) != []
    assert provenance_problems(Path("2026-12-03_5be6418_h200.json"), {"machine": "NVIDIA H200"}) == []
    assert provenance_problems(Path("2026-12-03_5be6418_h200.json"), {"commit": "0a6cd8f"}) != []


def test_every_cited_result_exists():
    cites = citations()
    assert any(p.startswith("benchmarks/results/") for p in cites), "no citation found: is the scan broken?"
    missing = {path: sorted(docs) for path, docs in cites.items() if not (ROOT / path).exists()}
    assert not missing, f"cited but not in the tree (path: citing documents): {missing}"


def test_every_cited_gpu_result_names_machine_date_and_commit():
    bad = {}
    gpu_files = 0
    for path, docs in cited_json_files().items():
        data = json.loads(path.read_text(encoding="utf-8"))
        if not is_gpu_result(path, data):
            continue
        gpu_files += 1
        problems = provenance_problems(path, data)
        if problems:
            bad[path.relative_to(ROOT).as_posix()] = (problems, sorted(docs))
    assert gpu_files, "no cited GPU result found: is the scan broken?"
    assert not bad, f"cited GPU results without a known machine, date and commit: {bad}"
