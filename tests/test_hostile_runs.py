"""What users bring around a run, hostile or careless: URLs with credentials where Tidal wants local paths, a
`--json` that names a folder. Each case exits 2 before anything starts, naming the field, with no credential
printed (tests/hostile.py runs them)."""

import hashlib
from pathlib import Path

from hostile import Case, assert_refused, run_cases

SECRET = "hunter2-Pa55"


def test_urls_and_outputs_are_refused_before_the_run_with_credentials_masked(tmp_path):
    ok = tmp_path / "ok.yaml"
    ok.write_text("run:\n  num_steps: 1\n")
    out = tmp_path / "out"
    url = f"https://bob:{SECRET}@example.com"
    data = [f"data.train_files=[{url}/train.jsonl]", f"data.val_files=[{url}/val.jsonl]"]
    cases = [
        Case("data file URL with a password", ["validate", str(ok), *data, "--no-track"], ["data.train_files"]),
        Case("model URL with a password", ["validate", str(ok), f"model.path=hf://bob:{SECRET}@hub/m", "--no-track"],
             ["model.path"]),
        Case("data file URL, train", ["train", str(ok), *data, f"run.output_dir={out}", "--no-track"],
             ["data.train_files"], leftovers=[str(out)]),
        Case("--json a folder", ["train", str(ok), f"run.output_dir={out}", "--json", str(tmp_path), "--no-track"],
             ["--json"], leftovers=[str(out)]),
        Case("--json under a file", ["train", str(ok), f"run.output_dir={out}", "--json", f"{ok}/x.json",
                                     "--no-track"], ["--json"], leftovers=[str(out)]),
    ]
    results = run_cases(cases, tmp_path)
    assert_refused(cases, results)
    leaked = [name for name, r in results.items() if SECRET in r["err"] + r["out"]]
    assert not leaked, leaked
    assert "bob:***@example.com" in results["data file URL with a password"]["err"]


def _garbled_generation(root: Path, text: str) -> Path:
    """A generation whose COMPLETE marker holds its manifest's true sha256, the manifest garbled."""
    gen = root / "gen-2"
    gen.mkdir(parents=True)
    (gen / "manifest.json").write_text(text)
    (gen / "COMPLETE").write_text(hashlib.sha256(text.encode()).hexdigest())
    return gen


def test_a_garbled_checkpoint_is_refused_naming_its_file(tmp_path):
    ok = tmp_path / "ok.yaml"
    ok.write_text("run:\n  num_steps: 4\n")
    cases = []
    fmt = '"format": "tidal-actor-checkpoint/1"'
    manifests = {"not JSON": "{garbled", "a list": "[1, 2]", "fields missing": f"{{{fmt}}}",
                 "fields of the wrong type": f'{{{fmt}, "meta": 5, "layout": []}}'}
    for name, text in manifests.items():
        root = tmp_path / name.replace(" ", "-")
        _garbled_generation(root, text)
        cases.append(Case(f"manifest {name}", ["validate", str(ok), "--resume", str(root), "--no-track"],
                          ["manifest.json"]))
    assert_refused(cases, run_cases(cases, tmp_path))


def _listening(rank: int, world: int) -> list[tuple[int, str, int]]:
    import os

    import torch.distributed as dist

    from tidal.cli.services import listening_sockets
    dist.barrier()   # every rank's sockets are open
    socks = listening_sockets([os.getpid()])
    dist.barrier()
    return socks


def test_the_self_tests_process_groups_listen_on_loopback_only():
    """`tidal reshard-check` and the distributed tests open process groups: every listening socket they own
    (the rendezvous store's, gloo's) is on 127.0.0.1."""
    from tidal.engine.testing import run_ranks
    socks = [s for rank in run_ranks(2, _listening) for s in rank]
    assert socks and all(addr in ("127.0.0.1", "::1") for _, addr, _ in socks), socks


def test_train_refuses_what_validate_refuses_and_leaves_nothing(tmp_path):
    """`tidal train`, tracked, on inputs that cannot train: refused before a run folder, a database row or an MLflow
    run exists."""
    from conftest import make_gsm8k_files, make_hf_checkpoint
    ckpt = make_hf_checkpoint(tmp_path / "ckpt", "qwen2")
    train, val = make_gsm8k_files(tmp_path / "data")
    ok = tmp_path / "ok.yaml"
    ok.write_text("run:\n  num_steps: 1\n")
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    for f in ckpt.iterdir():
        if f.name != "tokenizer.json":
            (no_tokenizer / f.name).write_bytes(f.read_bytes())
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    for f in ckpt.iterdir():
        data = f.read_bytes()
        (truncated / f.name).write_bytes(data[: len(data) // 2] if f.suffix == ".safetensors" else data)
    no_number = tmp_path / "no-number.jsonl"
    no_number.write_text(train.read_text() + '{"question": "1+1=", "answer": "two"}\n')
    hangs = tmp_path / "hangs"
    hangs.mkdir()
    (hangs / "hanging_reward.py").write_text("import time\ntime.sleep(600)\n\n"
                                             "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                             "    return 0.0\n")
    out, db, ml = tmp_path / "out", tmp_path / "db", tmp_path / "mlflow"
    for d in (db, ml):
        d.mkdir()
    common = [f"run.output_dir={out}", f"tracking.db_url=sqlite:///{db}/tidal.db",
              f"tracking.mlflow_uri=sqlite:///{ml}/mlflow.db", "data.prompt_key=question",
              "data.max_prompt_length=20", f"data.val_files=[{val}]"]

    def case(name, names, *over, env=None):
        return Case(name, ["train", str(ok), *common, *over], names, leftovers=[str(out), str(db), str(ml)],
                    env=env or {})
    cases = [
        case("no tokenizer.json", ["tokenizer.json"], f"model.path={no_tokenizer}", f"data.train_files=[{train}]"),
        case("a truncated weight file", ["model.safetensors"], f"model.path={truncated}",
             f"data.train_files=[{train}]"),
        case("an answer the verifier cannot pay", ["no-number.jsonl"], f"model.path={ckpt}",
             f"data.train_files=[{no_number}]"),
        case("a reward module that hangs at import", ["reward.function"], f"model.path={ckpt}",
             f"data.train_files=[{train}]", "reward.function=hanging_reward:score", "reward.timeout_s=2",
             env={"PYTHONPATH": str(hangs)}),
    ]
    assert_refused(cases, run_cases(cases, tmp_path))
