"""Equality tests compare runs that trained.

Two runs that never trained end equal for no reason: a random model on a task's 0/1 reward earns 0 in every group,
so every GRPO advantage, and every update, is zero. So every comparison of runs goes through
`assert_same_training`, which first holds each run to `assert_trained`: every iter of every step it ran has a
finite, non-zero gradient norm (the loss says little: GRPO's is near zero on-policy), and its final weights differ
from the weights it started from. `tests/test_equality_trains.py` keeps test modules from comparing final weights
any other way.

    start = start_weights(run)              # right after run.open()
    ...steps..., run.finish()
    a = trained(run, start)
    assert_same_training(a, b)              # bit for bit; atol=... where the math allows no more

Runs whose models are random train on `tests/parity_reward.py`'s reward (`PARITY_REWARD`), which pays about half
of every group.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from tidal.pipeline.run import weights_sha

#: `reward.function` of runs whose models are random: about half of every group rewarded, so every iter trains
PARITY_REWARD = "tests.parity_reward:score"


@dataclass(frozen=True)
class Trained:
    """What an equality test compares of one run."""

    name: str
    initial_sha: str | None
    """`weights_sha` of the weights the run's first step started from; None only for a run resumed from a
    checkpoint by the CLI, whose starting weights the test cannot read (its reference is held to the full check)."""
    final_sha: str
    final: dict[str, torch.Tensor] | None
    """The final weights where the run was in process (needed for a comparison within a tolerance)."""
    iters: tuple[tuple[int, int, float | None], ...]
    """(step, iter, global gradient norm) of every iter the run took, from its `iter` events."""
    n_minibatches: int


def start_weights(run) -> dict[str, torch.Tensor]:
    """The actor's weights as the run holds them after `open()`: what its first step starts from."""
    return {k: v.clone() for k, v in run.pipe.global_weights().items()}


def _iters(events: list[dict]) -> tuple[tuple[int, int, float | None], ...]:
    return tuple((e["step"], e["iter"], e["grad_norm"]) for e in events if e["kind"] == "iter")


def trained(run, initial: dict[str, torch.Tensor], final: dict[str, torch.Tensor] | None = None) -> Trained:
    """An in-process `TrainingRun` after `finish()` (`final`: its weights when it stops short of that)."""
    final = run.final_weights if final is None else final
    return Trained(run.cfg.run.name, weights_sha(initial), weights_sha(final), final,
                   _iters(run.pipe.cluster.events), run.cfg.algorithm.n_minibatches)


def trained_from_folder(run_dir: Path, n_minibatches: int, initial_sha: str | None) -> Trained:
    """A `tidal train` run from its output folder (`events.json`, `summary.json`)."""
    events = json.loads((run_dir / "events.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    return Trained(summary["name"], initial_sha, summary["final_weights_sha"], None, _iters(events), n_minibatches)


def checkpoint_sha(model_dir: Path) -> str:
    """`weights_sha` of a Hugging Face checkpoint's weights as a run loads them (`model.path`): the starting point of
    a `tidal train` run on it."""
    from tidal.engine.hf_checkpoint import load_hf_weights, read_hf_config

    hf = read_hf_config(model_dir, 2)   # max_seq_len shapes no weight: any value the reader accepts
    return weights_sha(load_hf_weights(hf))


def assert_trained(run: Trained) -> None:
    assert run.iters, f"{run.name}: no iter ran"
    steps = sorted({s for s, _, _ in run.iters})
    for s in steps:   # every iter of every step it ran (a redone step adds its iters again)
        done = {k for t, k, _ in run.iters if t == s}
        assert done == set(range(run.n_minibatches)), f"{run.name}: step {s} ran iters {sorted(done)}"
    for s, k, norm in run.iters:
        assert norm is not None and math.isfinite(norm) and norm > 0, \
            f"{run.name}: step {s} iter {k} has gradient norm {norm}: it trained nothing"
    if run.initial_sha is not None:
        assert run.final_sha != run.initial_sha, f"{run.name}: its final weights are the ones it started from"


def assert_same_training(ref: Trained, other: Trained, *, atol: float = 0.0, rtol: float = 0.0) -> None:
    """Both runs trained, and end with the same weights: bit for bit, or within atol + rtol x |ref| elementwise
    where the math allows no more."""
    assert_trained(ref)
    assert_trained(other)
    if atol == 0 and rtol == 0:
        if ref.final is not None and other.final is not None:
            assert set(ref.final) == set(other.final)
            for k, w in ref.final.items():
                assert torch.equal(w, other.final[k]), f"{other.name} differs from {ref.name} at {k}"
        assert ref.final_sha == other.final_sha, f"{other.name} ends with other weights than {ref.name}"
        return
    assert ref.final is not None and other.final is not None, "a tolerance compares in-process runs' weights"
    assert set(ref.final) == set(other.final)
    for k, w in ref.final.items():
        torch.testing.assert_close(other.final[k], w, atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}")
