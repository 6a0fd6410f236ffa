"""The actor's overlapped ordered gradient sum (`tidal/engine/actor.py` `_OverlappedSum`) updates bit for bit like the
exchange after the last backward, on real gloo ranks (benchmarks/grad_sum.py runs both modes side by side)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch):
    # imported by name from benchmarks/ (kept on the path for the test): the spawned ranks import the module that
    # defines their entry point
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.delitem(sys.modules, "grad_sum", raising=False)
    import grad_sum
    return grad_sum


@pytest.mark.parametrize("dp,num_mb", [(2, 5), (3, 8)])
def test_overlapped_sum_is_bit_identical_to_the_exchange_after_backward(bench, dp, num_mb):
    # 5 micro-batches on 2 ranks: uneven counts per rank; 3 ranks: uneven ZeRO ranges
    tiny = {**bench.E2E, "hidden_size": 32, "num_layers": 2, "intermediate_size": 64}
    res = bench.measure(dp, iters=2, micro_batch=2, num_mb=num_mb, seq=12, cores=None, model=tiny)
    assert res["bit_identical"]
    assert set(res["overlapped"]) >= {"seconds", "compute", "sync", "update", "publish"}


def test_bad_arguments_name_the_flag(bench, tmp_path):
    with pytest.raises(SystemExit, match="--dp"):
        bench.main(["--json", str(tmp_path / "x.json"), "--dp", "1"])
    with pytest.raises(SystemExit, match="--cores"):
        bench.main(["--json", str(tmp_path / "x.json"), "--cores", "a-b"])
