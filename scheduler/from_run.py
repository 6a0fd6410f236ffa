"""A finished run, step by step: what the cost model predicts for each phase against what the run measured.

A run folder (`tidal train`, the benchmarks' runs) holds `config.json` (the run's config), `model.json` (its model's
shape), `steps.json` (per step: each group's response lengths and prompt length, when the last group was generated
and scored, the step's seconds) and `events.json` (every iter, hand-over and weight sync with its seconds).

Each step is predicted from its own response lengths (not a distribution), with the cost model named by `costs`
scaled to the run's model shape (`model_costs.costs_for`):

- a shared placement (collocated: every component on the same devices), phase by phase with `phased.py`:
  rollout (the last group generated), scoring (from there to the last group scored, the hand-over to scoring
  included as the run spends it there), training (the iters' seconds), hand-over (the actor's state off and back
  on), weight sync, and the step;
- a disaggregated placement, the step and its rollout with the simulator under the run's policy.

Step 0 is left out of the comparison by default (the workers' first allocations and compilations).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from scheduler.costs import CostModel
from scheduler.estimate import LengthModel
from scheduler.model_costs import ModelShape, costs_for
from scheduler.phased import collocated_step
from scheduler.simulator import _Sim
from scheduler.workload import RecordedLengths, SimSpec
from tidal.core.config import TidalConfig
from tidal.core.errors import TidalError

FILES = ("config.json", "model.json", "steps.json", "events.json", "summary.json")


@dataclass(frozen=True)
class RunRecord:
    cfg: TidalConfig
    model: dict[str, Any]
    steps: list[dict[str, Any]]
    events: list[dict[str, Any]]
    folder: Path
    device_kind: str         #: "cpu" or "cuda", as the run ran


def load(folder: str | Path) -> RunRecord:
    root = Path(folder)
    missing = [n for n in FILES if not (root / n).is_file()]
    if missing:
        raise TidalError("--from-run", str(root), f"lacks {', '.join(missing)}",
                         "give the folder of a finished run (tidal train writes these at its end)")
    data = {n: json.loads((root / n).read_text()) for n in FILES}
    cfg = TidalConfig.model_validate(data["config.json"])
    if not data["steps.json"]:
        raise TidalError("--from-run", str(root), "recorded no steps", "give a run that finished a step")
    return RunRecord(cfg, data["model.json"], data["steps.json"], data["events.json"], root,
                     str(data["summary.json"].get("device_kind", "cpu")))


def learned(rec: RunRecord, base: CostModel, step: int) -> CostModel:
    """`base` with what the run learned by the end of `step` (its `learn` event): the decode step and the scoring
    cost per group as the driver saw them, the actor's cost fitted to the step's iters (seconds against tokens
    per data-parallel rank). What a real run's policy predicts the next step with."""
    ev = next((e for e in rec.events if e.get("kind") == "learn" and e.get("step") == step), None)
    if ev is None:
        return base
    c = base
    if ev.get("decode_step_s"):
        c = replace(c, decode=replace(c.decode, step_s=float(ev["decode_step_s"])))
    if ev.get("score_group_s") is not None:
        c = replace(c, inference=replace(c.inference, per_group_s=float(ev["score_group_s"])))
    iters = ev.get("iter_samples") or []
    if iters:
        # seconds per token on the busiest rank, through the origin: the step's iters only, a handful of points
        per = [t / (tok / dp) for tp, dp, tok, t in iters if tok > 0]
        c = replace(c, actor=replace(c.actor, train_per_token_s=float(np.median(per)), iter_fixed_s=0.0,
                                     link_bw=float("inf")))
    return c


def shape_of(model: dict[str, Any], cfg: TidalConfig) -> ModelShape:
    """The run's model shape from its `model.json` (the model's arguments as the run built it)."""
    h, layers, heads = model["hidden_size"], model["num_layers"], model["num_heads"]
    kv, inter, vocab = model["num_kv_heads"], model["intermediate_size"], model["vocab_size"]
    hd = model.get("head_dim") or h // heads
    params = layers * (h * heads * hd * 2 + 2 * h * kv * hd + 3 * h * inter) + vocab * h * (
        1 if model.get("tie_embeddings") else 2)
    return ModelShape(f"{params / 1e9:.2g}B", float(params), layers, kv, hd, cfg.actor.tensor_parallel_size,
                      cfg.rollout.tensor_parallel_size, cfg.inference.tensor_parallel_size,
                      cfg.rollout.max_running_requests)


def _shared(cfg: TidalConfig) -> bool:
    p = cfg.placement
    return set(p.actor) == set(p.rollout) == set(p.inference)


def _measured(rec: RunRecord, st: dict[str, Any]) -> dict[str, float]:
    k = st["step"]
    mine = [e for e in rec.events if e.get("step") == k]

    def total(kind: str) -> float:
        return float(sum(e.get("seconds") or 0.0 for e in mine if e.get("kind") == kind))
    return {"rollout": st["rollout_end_s"], "scoring": st["scoring_end_s"] - st["rollout_end_s"],
            "training": total("iter"), "handover": total("handover"), "sync": total("weight_sync"),
            "step": st["seconds"]}


def spec_of(rec: RunRecord, costs: CostModel) -> SimSpec:
    cfg = rec.cfg
    lengths = RecordedLengths(tuple(np.asarray(s["response_lengths"], dtype=np.int64) for s in rec.steps),
                              float(np.median(np.concatenate([np.ravel(s["response_lengths"]) for s in rec.steps]))))
    prompt = float(np.mean([x for s in rec.steps for x in s["prompt_lengths"]]))
    s = SimSpec.from_config(cfg)
    s = replace(s, lengths=lengths, prompt_tokens=max(1, round(prompt)), name=rec.folder.name)
    if costs.name.startswith("gpu"):   # measured on a GPU with one shape: scaled to the run's
        costs = costs_for(shape_of(rec.model, cfg), prompt + lengths.median / 2, costs)
    return replace(s, costs=costs)


def predict(rec: RunRecord, costs: CostModel, skip_first: bool = True, learn: bool = False) -> dict[str, Any]:
    """Per step: predicted and measured seconds of each phase, and predicted / measured. With `learn`, step k is
    predicted with what the run learned by the end of step k - 1 (`learned`)."""
    s = spec_of(rec, costs)
    base = s.costs
    rows = []
    shared = _shared(rec.cfg)
    policy = rec.cfg.scheduler.policy if rec.cfg.cluster.auto_scheduler else "static"
    shape = s.params
    prev: np.ndarray | None = None
    for k, st in enumerate(rec.steps):
        if learn and k:
            s = replace(s, costs=learned(rec, base, rec.steps[k - 1]["step"]))
        lengths = s.lengths.sample(np.random.default_rng(0), shape.rollout_batch_size, shape.group_size,
                                   s.max_new_tokens, k)
        if shared:
            ph = collocated_step(s, lengths)
            pred = {"rollout": ph.rollout, "scoring": ph.scoring, "training": ph.training,
                    "handover": ph.handover, "sync": ph.sync, "step": ph.total}
        else:   # this step's costs; the length model the run's policy had learned from the step before
            sim = _Sim(s, policy, 0, keep_events=False)
            if prev is not None:
                sim.length_model = LengthModel.fit(prev.reshape(-1), s.max_new_tokens)
            stats = sim.run_step(k)
            pred = {"step": stats.time_s, "rollout": sim.last_rollout_end_s}
        prev = lengths
        if skip_first and k == 0 and len(rec.steps) > 1:
            continue
        meas = _measured(rec, st)
        rows.append({"step": st["step"], "predicted": pred, "measured": {p: meas[p] for p in pred},
                     "ratio": {p: pred[p] / meas[p] if meas[p] > 0 else None for p in pred}})
    worst = max((abs(r - 1.0) for row in rows for r in row["ratio"].values() if r is not None), default=0.0)
    return {"run": str(rec.folder), "placement": "shared" if shared else "disaggregated",
            "costs": s.costs.name + (" + learned" if learn else ""), "steps": rows, "worst_relative_error": worst}
