"""Data files and reward code that users bring, hostile or broken, meet `tidal validate` before any worker starts.

Refused (exit 2, one line naming the file and row, or `reward.function`, in under 10 s, through tests/hostile.py):
a 5,000-digit integer answer, JSON nested 200,000 deep, an answer the gsm8k or math verifier can never pay, a
50 MB prompt with `data.truncation: error`; a reward module that hangs while it imports, one that calls os._exit(3)
while it imports, a function with the wrong signature.
Accepted: a 50 MB prompt among ten normal rows is filtered and counted (without reading it into memory), a file that
starts with a UTF-8 byte-order mark, an unpayable answer with `data.unpayable_answers: warn` (counted).
The reward-value bound (a reward of 1e308 is a RewardError naming the sample) is a unit test of the scorer."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from conftest import make_gsm8k_files, make_hf_checkpoint
from hostile import Case, assert_refused, run_cases

from tidal.engine.datasets import (
    DataError,
    DataSpec,
    PromptRecord,
    filter_by_length,
    max_row_bytes,
    read_bounded,
    read_records,
)
from tidal.engine.rewards import MAX_ABS_REWARD, RewardError, RewardScorer

HUGE_PROMPT_BYTES = 50 << 20
ROWS = [{"question": f"{100 + i}+{500 + i}=", "answer": f"The sum is #### {600 + 2 * i}"} for i in range(10)]
REWARD_MODULES = {
    "hangs_at_import": "import time\ntime.sleep(3600)\n\ndef score(data_source, solution_str, ground_truth, "
                       "extra_info=None):\n    return 1.0\n",
    "exits_at_import": "import os\nos._exit(3)\n",
    "two_arguments": "def score(solution_str, ground_truth):\n    return 1.0\n",
    "huge_reward": "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1e308\n",
}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny checkpoint, GSM8K-layout files, a config and a folder of reward modules: built once for the module."""
    root = tmp_path_factory.mktemp("hostile-data-reward")
    ckpt = make_hf_checkpoint(root / "ckpt", "qwen2")
    train, val = make_gsm8k_files(root / "data")
    config = root / "run.yaml"
    config.write_text("run:\n  num_steps: 1\n")
    modules = root / "modules"
    modules.mkdir()
    for name, text in REWARD_MODULES.items():
        (modules / f"{name}.py").write_text(text)
    return {"root": root, "ckpt": ckpt, "train": train, "val": val, "config": config, "modules": modules}


def _argv(base: dict[str, Path], train: Path, *overrides: str) -> list[str]:
    return ["validate", str(base["config"]), f"model.path={base['ckpt']}", f"data.train_files=[{train}]",
            f"data.val_files=[{base['val']}]", "data.prompt_key=question", "data.max_prompt_length=20", *overrides,
            "--no-track"]


def _jsonl(path: Path, lines: list[str], prefix: bytes = b"") -> Path:
    path.write_bytes(prefix + "".join(line + "\n" for line in lines).encode())
    return path


def _ten_rows_and(path: Path, bad_line: str, at: int = 10) -> Path:
    """The ten normal rows with `bad_line` as row `at`."""
    lines = [json.dumps(r) for r in ROWS]
    return _jsonl(path, lines[:at] + [bad_line] + lines[at:])


def _huge_prompt_file(path: Path) -> Path:
    """Ten normal rows with a 50 MB prompt as row 5, written in pieces (the test holds no 50 MB string either)."""
    with path.open("wb") as f:
        for i, row in enumerate(ROWS):
            if i == 5:
                f.write(b'{"question": "')
                for _ in range(HUGE_PROMPT_BYTES >> 20):
                    f.write(b"x" * (1 << 20))
                f.write(b'", "answer": "#### 1"}\n')
            f.write(json.dumps(row).encode() + b"\n")
    return path


def test_hostile_data_and_reward_code_are_refused_or_filtered_cheaply(base: dict[str, Path]) -> None:
    root, d = base["root"], base
    huge = _huge_prompt_file(root / "huge.jsonl")
    digits = _ten_rows_and(root / "digits.jsonl", '{"question": "1+1=", "answer": ' + "9" * 5000 + "}")
    deep = _ten_rows_and(root / "deep.jsonl",
                         '{"question": "1+1=", "answer": "#### 2", "extra_info": {"a": ' + "[" * 200_000
                         + "]" * 200_000 + "}}")
    no_number = _ten_rows_and(root / "no_number.jsonl", json.dumps({"question": "1+1=", "answer": "two"}))
    empty_math = _ten_rows_and(root / "empty_math.jsonl", json.dumps({"question": "1+1=", "answer": r"\boxed{}"}))
    bom = _jsonl(root / "bom.jsonl", [json.dumps(r) for r in ROWS], prefix=b"\xef\xbb\xbf")
    mods = {"PYTHONPATH": str(d["modules"])}
    wide = {"COLUMNS": "2000"}  # the prompt summary on one line of stdout
    refused = [
        Case("5,000-digit integer answer", _argv(d, digits), [str(digits), "row 10"]),
        Case("JSON nested 200,000 deep", _argv(d, deep), [str(deep), "row 10"]),
        Case("gsm8k answer without a number", _argv(d, no_number), [str(no_number), "row 10", "data.unpayable"]),
        Case("math answer an empty box", _argv(d, empty_math, "reward.function=math"), [str(empty_math), "row 10"]),
        Case("50 MB prompt, truncation error", _argv(d, huge, "data.truncation=error"), [str(huge), "row 5"]),
        Case("reward module hangs at import", _argv(d, d["train"], "reward.function=hangs_at_import:score",
                                                    "reward.timeout_s=1"),
             ["reward.function", "importing hangs_at_import did not finish in 1 s"], env=mods),
        Case("reward module exits at import", _argv(d, d["train"], "reward.function=exits_at_import:score"),
             ["reward.function", "exited with code 3 while importing exits_at_import"], env=mods),
        Case("reward function of two arguments", _argv(d, d["train"], "reward.function=two_arguments:score"),
             ["reward.function", "score(solution_str, ground_truth)", "cannot be called"], env=mods),
    ]
    accepted = [
        Case("50 MB prompt among ten rows", _argv(d, huge), [], env=wide),
        Case("byte-order mark", _argv(d, bom), [], env=wide),
        Case("unpayable answer, warn", _argv(d, no_number, "data.unpayable_answers=warn"), [], env=wide),
    ]
    results = run_cases(refused + accepted, root)
    assert_refused(refused, results)
    for case in accepted:
        r = results[case.name]
        assert r["rc"] == 0 and r["mb"] < 500, (case.name, r)
    assert "'train': {'kept': 10, 'too_long': 1," in results["50 MB prompt among ten rows"]["out"]
    assert "'train': {'kept': 10, 'too_long': 0," in results["byte-order mark"]["out"]
    assert "'unpayable': 1}" in results["unpayable answer, warn"]["out"]


# ---- the pieces, directly ----------------------------------------------------------------------------
def test_a_row_over_the_bound_is_skipped_unparsed_and_counted(tmp_path: Path) -> None:
    limit = 200
    path = _jsonl(tmp_path / "t.jsonl", [json.dumps(ROWS[0]), "{" + "x" * 5000, " " * 5000, json.dumps(ROWS[1])])
    records, oversized = read_bounded(DataSpec((str(path),), prompt_key="question"), limit)
    assert [r.uid for r in records] == ["t:0", "t:2"]  # the blank long line is no row
    assert [(o.uid, o.where, o.num_bytes) for o in oversized] == [("t:1", f"{path} row 1 (line 2)", 5001)]
    _kept, report = filter_by_length(records, lambda p: [0] * len(p), 20, oversized=oversized)
    assert report.too_long == 1 and report.kept == 2
    with pytest.raises(DataError, match=r"row 1 \(line 2\) is 5,001 bytes"):
        filter_by_length(records, lambda p: [0] * len(p), 20, truncation="error", oversized=oversized)


def test_a_prompt_too_long_to_fit_is_not_rendered() -> None:
    rendered: list[object] = []
    records = [PromptRecord("t:0", "x" * 10**6, "1", "t"), PromptRecord("t:1", "ok", "1", "t")]
    kept, report = filter_by_length(records, lambda p: rendered.append(p) or [0], 20)
    assert rendered == ["ok"] and report.too_long == 1 and [r.uid for r, _ in kept] == ["t:1"]


def test_bounds_and_bom(tmp_path: Path) -> None:
    assert max_row_bytes(20) > 20 * 256 * 12  # a prompt of 20 tokens of 256 characters, each escaped, fits
    path = _jsonl(tmp_path / "bom.jsonl", [json.dumps(ROWS[0])], prefix=b"\xef\xbb\xbf")
    assert read_records(DataSpec((str(path),), prompt_key="question"))[0].prompt == ROWS[0]["question"]


def test_a_reward_of_1e308_names_the_sample(base: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(base["modules"]))
    with RewardScorer("huge_reward:score", timeout_s=10) as scorer, pytest.raises(RewardError) as caught:
        scorer.score("gsm8k:17", "d", "#### 1", "1")
    assert "sample 'gsm8k:17'" in caught.value.problem and "1e+308" in caught.value.problem
    assert f"{MAX_ABS_REWARD:g}" in caught.value.problem


def test_a_reward_module_is_never_imported_by_the_driver(base: dict[str, Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """check_reward imports in a child: the driver's modules stay without the user's module."""
    import sys

    from tidal.engine.rewards import check_reward

    monkeypatch.syspath_prepend(str(base["modules"]))
    (base["modules"] / "fine_reward.py").write_text(textwrap.dedent("""
        def score(data_source, solution_str, ground_truth, extra_info=None):
            return 1.0
    """))
    check_reward("fine_reward:score", timeout_s=10)
    assert "fine_reward" not in sys.modules
