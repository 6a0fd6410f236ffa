"""Equality tests compare runs that trained: the helper every one of them goes through refuses runs that did not,
and no test module compares two runs' final weights around it."""

import re
from pathlib import Path

import pytest
import torch
from training_equality import Trained, assert_same_training, assert_trained

from tidal.pipeline.run import weights_sha

TESTS = Path(__file__).resolve().parent
#: what a test reads to compare runs' ends, and the comparisons; only the helper may put the two on one line
FINAL_WEIGHTS = re.compile(r"\bfinal_weights(_sha)?\b")
COMPARISON = re.compile(r"==|!=|torch\.equal|assert_close|allclose")


def test_no_test_module_compares_final_weights_around_the_helper():
    around = [f"{p.name}:{i}" for p in sorted(TESTS.glob("*.py"))
              if p.name not in ("training_equality.py", Path(__file__).name)
              for i, line in enumerate(p.read_text().splitlines(), start=1)
              if FINAL_WEIGHTS.search(line) and COMPARISON.search(line)]
    assert not around, f"compare runs with training_equality.assert_same_training, not by hand: {around}"


W0 = {"w": torch.zeros(3)}
W1 = {"w": torch.tensor([0.0, 1e-3, 0.0])}


def _run(name="run", initial=W0, final=W1, norms=(0.5, 0.4, 0.3, 0.2)) -> Trained:
    iters = tuple((s, k, n) for (s, k), n in zip([(0, 0), (0, 1), (1, 0), (1, 1)], norms))
    return Trained(name, weights_sha(initial), weights_sha(final), final, iters, 2)


def test_a_run_that_trained_passes_and_equal_runs_are_equal():
    assert_trained(_run())
    assert_same_training(_run("a"), _run("b"))
    with pytest.raises(AssertionError, match="differs"):
        assert_same_training(_run("a"), _run("b", final={"w": torch.tensor([0.0, 2e-3, 0.0])}))


@pytest.mark.parametrize("run, says", [
    (_run(final=W0), "the ones it started from"),                  # lr too small to move a weight
    (_run(norms=(0.5, 0.0, 0.3, 0.2)), "gradient norm 0.0"),        # every group's advantage zero
    (_run(norms=(0.5, float("nan"), 0.3, 0.2)), "gradient norm nan"),
    (_run(norms=(0.5, None, 0.3, 0.2)), "gradient norm None"),      # an iter that reported nothing
    (_run(norms=(0.5, 0.4, 0.3)), "step 1 ran iters"),              # an iter missing
    (Trained("run", None, "x", None, (), 2), "no iter ran"),
])
def test_a_run_that_did_not_train_fails_before_any_comparison(run, says):
    with pytest.raises(AssertionError, match=says):
        assert_trained(run)
    with pytest.raises(AssertionError, match=says):
        assert_same_training(run, run)   # two untrained runs are equal for no reason


def test_a_tolerance_compares_within_it():
    near = {"w": torch.tensor([0.0, 1e-3 + 1e-7, 0.0])}
    assert_same_training(_run("a"), _run("b", final=near), atol=1e-6)
    with pytest.raises(AssertionError):
        assert_same_training(_run("a"), _run("b", final=near), atol=1e-9)
