"""The `gpu_h200` cost preset is the fit of the H200 results committed under benchmarks/results/
(scheduler/costs_h200.py): every figure it takes from a measurement equals the refit to its rounding."""

import json
import shutil

import pytest

from scheduler.costs_h200 import RESULTS, SOURCES, fit, preset_figures


def test_every_measured_figure_of_the_preset_equals_the_fit_of_its_result_files():
    f = fit()
    assert f.decode_windows >= 12 and f.decode_max_rel_residual < 0.05
    assert f.reshard_cases == 12 and 0.4 < f.train_mfu < 0.5
    for name, (fitted, preset) in preset_figures(f).items():
        assert preset == pytest.approx(fitted, rel=0.01), name


def test_a_new_decode_measurement_moves_the_fit(tmp_path):
    """The fit reads the files, not constants: a copy of the results with every decode step 10% slower refits
    the decode terms 10% higher and leaves the others alone."""
    root = tmp_path / "results"
    for rel in (rel for files in SOURCES.values() for rel in files):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(RESULTS / rel, root / rel)
    path = root / SOURCES["decode"][0]
    data = json.loads(path.read_text())
    for run in data["throughput"]:
        run["ms_per_step_by_context"] = [[c, ms * 1.1] for c, ms in run["ms_per_step_by_context"]]
    path.write_text(json.dumps(data))
    base, slower = fit(), fit(root)
    assert slower.decode_step_s == pytest.approx(base.decode_step_s * 1.1, rel=1e-9)
    assert slower.decode_per_seq_token_s == pytest.approx(base.decode_per_seq_token_s * 1.1, rel=1e-9)
    assert (slower.train_per_token_s, slower.reshard_bw) == (base.train_per_token_s, base.reshard_bw)
