"""The `gpu_h200` preset's figures, fitted from the H200 benchmark results committed under benchmarks/results/.

`gpu_h200()` (costs.py) holds the figures as constants so that the simulator needs no result files; `fit()`
derives them again from the files named in `SOURCES`, and tests/test_costs_h200.py holds the two equal (to the
constants' rounding). A new measurement changes `SOURCES`, then the constants: `python -m scheduler.costs_h200`
prints the fit beside the preset.

What each figure is fitted from (one H200, a Qwen2.5-1.5B-shaped model in bf16, unless named otherwise):

    decode      ms per decode step over windows of 128 steps as the context grows (batch 64 and 256, prompt 256,
                1,024 new tokens, the engine's default CUDA kernels): least squares of
                t = step_s + per_seq_s x batch + per_seq_token_s x batch x context over the windows that end
                inside the requested length (the last window holds the end of every row: dropped).
                The preset folds the context term in at a 1,024-token mean context.
    prefill     the same run's prefill seconds over its prompt tokens (both batches together).
    actor       seconds per token of one training iter (8 x 2,048-token sequences a micro-batch, 2 micro-batches,
                the optimizer step included).
    scoring     the scoring phase of one collocated GRPO step (64 prompts x 8 samples, responses up to 1,024):
                seconds per token scored; the same step's weight sync and hand-over (offload, onload).
    reshard     every case of the 1B- and 7B-shaped reshard benchmarks on 2 x H200 (NCCL): least squares of
                t = fixed_s + bytes into the busiest device / bw.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scheduler.costs import gpu_h200

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
SOURCES: dict[str, tuple[str, ...]] = {   # result files (under RESULTS) of each kind of figure
    "decode": ("rollout/2026-12-03_2886162_h200.json",),
    "actor": ("train_throughput/2026-12-03_923f3cf_h200.json",),
    "collocated": ("collocated/2026-12-03_2e88f4d_h200.json",),
    "reshard": ("reshard/2026-11-29_56e02d6_2xh200_1b.json", "reshard/2026-11-29_56e02d6_2xh200_7b.json"),
}
MEAN_CONTEXT = 1024  #: the context at which the preset folds the decode's context term into per_seq_s
BASE_PARAMS = 1.54e9   #: the measured shape's parameters: its state (bf16 weights, fp32 master + Adam) is 14 B each
INSTANCE_START_S = 1.0  #: an engine instance's start or stop, `gpu_h200_1p5b`'s (one GPU measures none)


@dataclass(frozen=True)
class H200Fit:
    decode_step_s: float
    decode_per_seq_s: float          #: at context 0
    decode_per_seq_token_s: float    #: per sequence per token of context
    decode_windows: int
    decode_max_rel_residual: float
    prefill_per_token_s: float
    train_per_token_s: float
    train_mfu: float
    score_per_token_s: float
    weight_sync_s: float
    offload_s: float
    onload_s: float
    reshard_fixed_s: float
    reshard_bw: float                #: bytes/s into the busiest device
    reshard_cases: int
    reshard_max_rel_residual: float

    @property
    def decode_per_seq_at_mean_context_s(self) -> float:
        return self.decode_per_seq_s + self.decode_per_seq_token_s * MEAN_CONTEXT


def _load(rel: str, root: Path) -> dict:
    with open(root / rel) as f:
        return json.load(f)


def _lstsq(rows: list[list[float]], y: list[float]) -> tuple[np.ndarray, float]:
    a, t = np.asarray(rows, dtype=float), np.asarray(y, dtype=float)
    x, *_ = np.linalg.lstsq(a, t, rcond=None)
    return x, float(np.max(np.abs(a @ x - t) / t))


def fit(root: Path = RESULTS) -> H200Fit:
    """The figures of `gpu_h200()` from the result files in `SOURCES` (module doc)."""
    dec = _load(SOURCES["decode"][0], root)
    end = dec["prompt_len"] + dec["new_tokens"]
    rows, ys = [], []
    for run in dec["throughput"]:
        b = run["batch"]
        starts = [c for c, _ in run["ms_per_step_by_context"]]
        width = starts[1] - starts[0]
        for context, ms in run["ms_per_step_by_context"]:
            if context + width < end:   # a whole window inside the requested length
                rows.append([1.0, b, b * context])
                ys.append(ms * 1e-3)
    (step_s, per_seq_s, per_seq_token_s), dec_res = _lstsq(rows, ys)
    prefill = (sum(r["prefill_s"] for r in dec["throughput"])
               / sum(r["batch"] * dec["prompt_len"] for r in dec["throughput"]))

    act = _load(SOURCES["actor"][0], root)
    col = _load(SOURCES["collocated"][0], root)
    (variant,) = col["variants"].values()

    cases = [c for rel in SOURCES["reshard"] for c in _load(rel, root)["cases"]]
    (fixed_s, inv_bw), res_res = _lstsq([[1.0, c["busiest_gpu_bytes"]] for c in cases], [c["seconds"] for c in cases])
    return H200Fit(
        decode_step_s=float(step_s), decode_per_seq_s=float(per_seq_s), decode_per_seq_token_s=float(per_seq_token_s),
        decode_windows=len(ys), decode_max_rel_residual=dec_res, prefill_per_token_s=prefill,
        train_per_token_s=1.0 / act["tokens_per_s"], train_mfu=act["mfu"],
        score_per_token_s=1.0 / variant["tokens_per_s"]["inference"], weight_sync_s=variant["weight_sync_s"],
        offload_s=variant["offload_s"], onload_s=variant["onload_s"],
        reshard_fixed_s=float(fixed_s), reshard_bw=1.0 / float(inv_bw), reshard_cases=len(cases),
        reshard_max_rel_residual=res_res,
    )


def preset_figures(f: H200Fit) -> dict[str, tuple[float, float]]:
    """(fitted, preset) for every figure `gpu_h200()` takes from the fit."""
    c = gpu_h200()
    return {
        "decode.step_s": (f.decode_step_s, c.decode.step_s),
        "decode.per_seq_s": (f.decode_per_seq_at_mean_context_s, c.decode.per_seq_s),
        "decode.prefill_per_token_s": (f.prefill_per_token_s, c.decode.prefill_per_token_s),
        "actor.train_per_token_s": (f.train_per_token_s, c.actor.train_per_token_s),
        "inference.per_token_s": (f.score_per_token_s, c.inference.per_token_s),
        "weight sync s": (f.weight_sync_s, c.sync_time()),
        "lend_s": (f.offload_s + INSTANCE_START_S, c.lend_s),
        "return_s": (f.onload_s + INSTANCE_START_S, c.return_s),
        "offload_bw": (14 * BASE_PARAMS / f.offload_s, c.offload_bw),
        "onload_bw": (14 * BASE_PARAMS / f.onload_s, c.onload_bw),
        "reshard.fixed_s": (f.reshard_fixed_s, c.reshard.fixed_s),
        "reshard.bw": (f.reshard_bw, c.reshard.bw),
    }


def main() -> None:
    f = fit()
    print(f"decode: {f.decode_step_s * 1e3:.3f} ms + {f.decode_per_seq_s * 1e6:.2f} us/seq + "
          f"{f.decode_per_seq_token_s * 1e9:.2f} ns/seq-token ({f.decode_windows} windows, largest residual "
          f"{f.decode_max_rel_residual:.1%}); reshard over {f.reshard_cases} cases, largest residual "
          f"{f.reshard_max_rel_residual:.1%}; actor MFU {f.train_mfu:.1%}")
    print(f"{'figure':28s} {'fitted':>12s} {'preset':>12s}")
    for name, (fitted, preset) in preset_figures(f).items():
        print(f"{name:28s} {fitted:12.4g} {preset:12.4g}")


if __name__ == "__main__":
    main()
