"""A whole training run: warm start, workers, the pipeline's steps, tracking, summary.

    run_training(cfg, out_dir, sink, db_url) -> RunSummary
      1. tokenizer + task + model args (checked against each other)
      2. warm start (cached by its settings under <output_dir>/.warmstart/) or a given checkpoint
      3. one worker per device (Ray; CPU virtual devices unless enough GPUs), the pipeline on top
      4. the steps (`tidal.pipeline.run_loop`: run_step, sync_weights, evaluate when due, record -> MLflow sink +
         database rows, a checkpoint when due or the host copy), a lost device recovered in process
      5. timeline.png, summary.json in the run's folder; the run's totals (`run/...`) to the sink
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from safetensors.torch import load_file, save_file

from scheduler.costs_cpu import cpu_e2e
from scheduler.policies import Policy, get_policy
from scheduler.state import PolicyParams, SchedState
from tidal.core.config import TidalConfig, flatten
from tidal.core.devices import Transition
from tidal.core.errors import ConfigError, TidalError, TrainingError
from tidal.engine.checkpoint import latest
from tidal.engine.evaluation import greedy_accuracy
from tidal.engine.generation.requests import SamplingParams
from tidal.engine.hf_checkpoint import HFWeights, save_hf
from tidal.engine.hf_tokenizer import CharPromptTokenizer
from tidal.engine.model import ModelArgs, Transformer, init_global_weights, param_specs
from tidal.engine.optim import OptimConfig
from tidal.engine.prompt_source import TaskSource
from tidal.engine.rl_tasks import Task
from tidal.engine.rollout_correction import correction_for
from tidal.engine.verifier import Verifier
from tidal.engine.warmstart import EvalPoint, WarmStartSpec, plateaued, task_examples, warm_start
from tidal.pipeline.checkpointing import resume, save, saved_step
from tidal.pipeline.driver import Pipeline, StepTrace
from tidal.pipeline.inputs import RunInputs
from tidal.pipeline.preflight import Preflight, host_copy_root, preflight
from tidal.pipeline.run_loop import LoopSettings, StepPlan, evaluation_due, run_loop, run_phases
from tidal.pipeline.run_metrics import placement_changes, run_figures, step_event_metrics, table_fields
from tidal.pipeline.run_warnings import RunWarning, RunWarnings
from tidal.pipeline.survivors import NoSurvivors, continue_on_survivors, refusal
from tidal.pipeline.timeline import timeline_title
from tidal.tracking import MetricsSink, NullSink
from tidal.workers.errors import WorkerDied, WorkerError, WorkerTimeout
from tidal.workers.roles import RunSpec
from tidal.workers.runtime import WorkerGroup

if TYPE_CHECKING:
    from tidal.engine.hf_checkpoint import HFModel
    from tidal.pipeline.recording import DbRecorder

log = logging.getLogger("tidal.run")
#: a warm start's progress, each evaluation of it (`tidal.engine.warmstart.warm_start`'s `log`)
WarmStartLog = Callable[[EvalPoint], None]
#: the stages of `TrainingRun.open`, in order: the weights (warm start, cached, or a checkpoint), Ray and one worker
#: per device, the pipeline on them (the weights placed), the held-out evaluation of the starting weights
OPEN_STAGES = ("model", "workers", "pipeline", "evaluation")


@dataclass
class RunSummary:
    name: str
    steps: int
    wall_s: float
    eval_accuracy_start: float
    eval_accuracy_end: float
    reward_per_step: list[float]
    eval_per_step: list[tuple[int, float]]
    phase_seconds: dict[str, float]
    device_idle_fraction: float
    """`run/idle_fraction`: the whole run's window (`tidal.pipeline.timeline`), not a step's."""
    step_seconds: list[float]
    policy: str
    device_kind: str
    output_dir: str
    reshards: int = 0
    migrations: int = 0
    warm_start: dict[str, Any] = field(default_factory=dict)
    final_weights_sha: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    """Where the prompts came from; for data files, prompts kept and filtered as too long (train and val)."""
    warnings: list[dict[str, str]] = field(default_factory=list)
    """`tidal.pipeline.run_warnings`: what the run raised, each kind once ({kind, message})."""
    restarts: list[dict[str, Any]] = field(default_factory=list)
    """`TrainingRun.restart`: each restart from a checkpoint (the failure, the step resumed, seconds, steps redone)."""
    figures: dict[str, float] = field(default_factory=dict)
    """`tidal.pipeline.run_metrics.run_figures`: the run's totals as the MLflow run holds them (`run/...`)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def weights_sha(weights: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(weights):
        h.update(k.encode())
        h.update(weights[k].detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def prepare_weights(cfg: TidalConfig, args: ModelArgs, task: Task, tok: CharPromptTokenizer, cache_dir: Path,
                    log_fn: WarmStartLog | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Warm-start weights (global, fp32) of Tidal's own model on a built-in task and a description of how they were
    made. `tok`: the task's `CharPromptTokenizer`."""

    ws = cfg.warm_start
    if ws.checkpoint:
        path = Path(ws.checkpoint)
        if not path.is_file():
            raise ConfigError("warm_start.checkpoint", ws.checkpoint, "file not found", "give a safetensors path")
        weights = load_file(str(path))
        for ps in param_specs(args):
            w = weights.get(ps.name)
            if w is None or tuple(w.shape) != ps.shape:
                raise TidalError("warm_start.checkpoint", ws.checkpoint,
                                 f"does not fit this model ({ps.name}: "
                                 f"{None if w is None else tuple(w.shape)} vs {ps.shape})",
                                 "use a checkpoint of the same model config (model.* keys) and tokenizer")
        return weights, {"source": str(path)}
    if ws.iters == 0:
        return init_global_weights(args, cfg.run.seed), {"source": "random init"}
    spec = WarmStartSpec.from_config(ws, cfg.data.eval_size, cfg.data.seed)
    key = hashlib.sha256(json.dumps([asdict(spec), asdict(args), cfg.data.task, cfg.run.seed],
                                    sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir / f"warmstart-{key}.safetensors"
    meta_path = path.with_suffix(".json")
    if path.is_file() and meta_path.is_file():
        return load_file(str(path)), json.loads(meta_path.read_text())
    torch.manual_seed(cfg.run.seed)
    model = Transformer(args)
    model.load_global(init_global_weights(args, cfg.run.seed))
    heldout = TaskSource(task, tok, spec.seed).heldout(spec.eval_size)
    examples = [(tok.prompt_ids(e.prompt), tok.encode(e.response) + list(tok.stop_ids))
                for e in task_examples(task, spec)]
    verifier = Verifier(None)
    history = warm_start(model, examples, lambda m: greedy_accuracy(m, heldout, tok, verifier,
                                                                    task.max_response_tokens),
                         spec, tok.pad_id, log=log_fn)
    weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    meta = {"source": "warm start", "examples": ws.num_examples, "iters": ws.iters,
            "history": [asdict(h) for h in history], "plateaued": plateaued(history),
            "heldout_accuracy": history[-1].heldout_accuracy}
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(weights, str(tmp))
    tmp.replace(path)
    meta_path.write_text(json.dumps(meta, indent=1))
    return weights, meta


def run_spec(cfg: TidalConfig, inputs: RunInputs) -> RunSpec:
    total_iters = cfg.run.num_steps * cfg.algorithm.n_minibatches
    r = cfg.rollout
    return RunSpec(args=inputs.args, optim=OptimConfig.from_actor(cfg.actor, total_iters),
                   sampling=SamplingParams(r.temperature, r.top_p, r.top_k, cfg.response_length,
                                           inputs.tok.stop_ids),
                   max_running_requests=r.max_running_requests, group_size=cfg.algorithm.group_size,
                   micro_batch_size=cfg.actor.micro_batch_size,
                   max_tokens_per_micro_batch=cfg.actor.max_tokens_per_micro_batch, clip_eps=cfg.algorithm.clip_eps,
                   kl_coef=cfg.algorithm.kl_coef, tokenizer=inputs.tokenizer_spec, reward=inputs.reward,
                   reward_timeout_s=cfg.reward.timeout_s, vocab_limit=inputs.vocab_limit, seed=cfg.run.seed,
                   gpu_memory_utilization=r.gpu_memory_utilization, dtype=cfg.actor.dtype,
                   activation_checkpointing=cfg.actor.activation_checkpointing, backend=cfg.actor.backend,
                   backend_options={"transformer_engine": cfg.actor.megatron_transformer_engine}
                   if cfg.actor.backend == "megatron" else {},
                   correction=correction_for(cfg.algorithm.rollout_is, cfg.algorithm.rollout_is_threshold,
                                             cfg.algorithm.use_decoupled_loss, cfg.algorithm.behav_imp_weight_cap),
                   partial=r.partial)


class TrainingRun:
    """A run as verbs (what flows and tasks call): `open`, `step`, `evaluate`, `finish`. Holds the workers."""

    def __init__(self, cfg: TidalConfig, out_dir: Path, sink: MetricsSink | None = None,
                 recorder: DbRecorder | None = None, log_fn: WarmStartLog | None = None):
        if sink is None:
            sink = NullSink()
            sink.start_run(cfg.run.name, flatten(cfg))
        self.cfg, self.out_dir, self.sink, self.recorder, self.log_fn = cfg, Path(out_dir), sink, recorder, log_fn
        self.run_warnings = RunWarnings()
        self.warnings: list[RunWarning] = []     # every warning raised (the summary's)
        self._pending_warnings: list[RunWarning] = []   # raised since the last `drain_warnings`
        self.pipe: Pipeline | None = None        # set by `open`
        self.group: WorkerGroup | None = None   # set by `open`, None again after `close`
        self.evals: list[tuple[int, float]] = []
        self.rewards: list[float] = []
        self.step_s: list[float] = []
        self.traces: list[StepTrace] = []   # steps.json: what `tidal plan --from-run` predicts each step from
        self.phase: dict[str, float] = {}
        self.n_reshard = self.n_migr = 0
        self.next_step = 0
        self.first_step = 0   # the step this process started at (a resume's), the index of `rewards[0]`
        self.n_moves_logged = 0   # placement changes (`placement_changes`) already sent to the sink
        self.restarts: list[dict[str, Any]] = []
        self.host_copy: Path | None = None   # actor.redundancy: host: the folder of the newest copy (keep_host_copy)

    def open(self, resume_from: str | Path | None = None, checked: Preflight | None = None,
             on_stage: Callable[[str], None] | None = None) -> TrainingRun:
        """Inputs, warm start, workers, the pipeline (and the resumed state). `checked`: this config's `preflight`,
        when the caller ran it before creating the run's folder and records. `on_stage(name)`: told as each stage
        begins (`OPEN_STAGES`) and with "open" once the run is open, so a caller can show which one is under way."""
        cfg = self.cfg
        stage = on_stage or (lambda name: None)
        # every check `tidal validate` runs too, before any worker starts (tidal/pipeline/preflight.py)
        inputs, self.kind = checked or preflight(cfg, tracked=False, resume_from=resume_from)
        self.inputs = inputs
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.t_run = time.monotonic()
        stage("model")
        weights: dict[str, torch.Tensor] | HFWeights | None = inputs.initial_weights()   # read by each worker itself
        self.ws_meta: dict[str, Any]
        if weights is not None:
            self.ws_meta = {"source": str(cfg.model.path)}
        else:   # Tidal's own model on a built-in task: its source is a TaskSource, its tokenizer the task's
            task, tok = cast(TaskSource, inputs.source).task, cast(CharPromptTokenizer, inputs.tok)
            weights, self.ws_meta = prepare_weights(cfg, inputs.args, task, tok,
                                                    Path(cfg.run.output_dir) / ".warmstart", self.log_fn)
            self._warn(self.run_warnings.after_warm_start(self.ws_meta, cfg.warm_start.stop_at_accuracy))
        self.heldout = inputs.source.heldout(cfg.data.eval_size)
        self.policy_name = cfg.scheduler.policy if cfg.cluster.auto_scheduler else "static"
        stage("workers")
        self.group = WorkerGroup.start(list(range(cfg.cluster.num_devices)), device_kind=self.kind,
                                       compute_share=cfg.cluster.cpu_compute_share,
                                       share_period_s=cfg.cluster.cpu_share_period_ms / 1e3,
                                       ray_address=cfg.cluster.ray_address,
                                       cpu_cores=cfg.cluster.cpu_device_core_ids if self.kind == "cpu" else None)
        try:
            stage("pipeline")
            self.pipe = Pipeline(cfg, self.group, run_spec(cfg, inputs), weights, self.policy or
                                 get_policy(self.policy_name),
                                 SchedState(PolicyParams.from_config(cfg), costs=cpu_e2e()), source=inputs.source)
            self.pipe.start()
            if resume_from is not None:  # tidal/pipeline/checkpointing.py: the actor, data position, version
                self.next_step = resume(self.pipe, resume_from)
            if not self.restarts:
                self.first_step = self.next_step
            stage("evaluation")
            self.evals.append((self.next_step, self.pipe.evaluate(self.heldout)))
        except BaseException:
            self.close()
            raise
        stage("open")
        return self

    policy: Policy | None = None  # a test or sweep may set a policy callable before `open`

    @property
    def _pipe(self) -> Pipeline:
        """The driver, for the verbs after `open` (which sets it)."""
        return cast("Pipeline", self.pipe)

    def step(self) -> dict[str, float]:
        """One RL step in one call, the weight sync inside the stream, and its evaluation when due (no checkpoint,
        no host copy); returns its metrics (also sent to the sink and the database). A whole run goes through
        `tidal.pipeline.run_loop` instead, its phases one verb each."""
        self.run_step(sync=True)
        if self.eval_due():
            self.evaluate()
        return self.record()

    # The verbs of one step (`tidal.pipeline.run_loop.run_phases` calls them in its plan's order):
    #   run_step(sync=False) -> sync_weights -> evaluate (if due) -> record; then `checkpoint` or `keep_host_copy`
    def run_step(self, sync: bool = True) -> dict[str, float]:
        """Stream the next step (generate, score, train iters: concurrently on the workers); with `sync` the
        new weights also reach rollout and inference. Its metrics are written by `record`."""
        self._pipe.timeline.mark_step(self.next_step, self._pipe.clock())
        try:
            self._res = self._pipe.run_step(self.next_step, sync=sync)
        except TrainingError as err:   # a non-finite update (actor.on_nonfinite: stop): say where to resume
            good = latest(self.out_dir / "checkpoints")
            where = f"the last good checkpoint is {good}" if good else "no checkpoint was saved yet"
            raise TrainingError(err.field, err.value, f"RL step {self.next_step}: {err.problem}; {where}",
                                err.fix) from None
        self._extra: dict[str, float] = {}
        return dict(self._res.metrics)

    def sync_weights(self) -> dict[str, float]:
        """Actor weights -> rollout and inference (policy version + 1), after `run_step(sync=False)`."""
        n_events, t0 = len(self._pipe.cluster.events), time.monotonic()
        self._pipe.sync_weights(self.next_step)
        self._res.events.extend(self._pipe.cluster.events[n_events:])
        m = {"sync/time_s": time.monotonic() - t0}
        self._extra.update(m)
        return m

    def eval_due(self) -> bool:
        """Whether the step under way is evaluated (`tidal.pipeline.run_loop.evaluation_due`)."""
        return evaluation_due(LoopSettings.from_config(self.cfg), self.next_step)

    def evaluate(self) -> float:
        """Held-out accuracy of the weights rollout and inference now hold."""
        acc = self._pipe.evaluate(self.heldout)
        self.evals.append((self.next_step + 1, acc))
        self._extra["eval/heldout_accuracy"] = acc
        return acc

    def record(self) -> dict[str, float]:
        """Close the step: its metrics and events to the sink, its rows to the database."""
        step, res = self.next_step, self._res
        m = {**res.metrics, **self._extra}
        self.rewards.append(m.get("grpo/reward_mean", 0.0))
        self.step_s.append(res.seconds)
        t0 = self._pipe.step_state.t_start   # the window of step/time_s and step/idle_fraction
        self._pipe.timeline.add_step_window(step, t0, t0 + res.seconds)
        if res.trace is not None:
            self.traces.append(res.trace)
        for k, v in res.phase_seconds.items():
            self.phase[k] = self.phase.get(k, 0.0) + v
            m[f"phase/{k}_device_s"] = v   # busy seconds summed over the component's devices
        m.update(step_event_metrics(res.events))
        self.sink.log_metrics(m, step)
        self._log_placement(step)
        self._warn(self.run_warnings.after_step(step, m))
        for ev in res.events:
            self.sink.log_event(ev["kind"], table_fields(ev))
            self.n_reshard += ev["kind"] == "reshard"
            self.n_migr += ev["kind"] == "migration"
        if self.recorder:
            self.recorder.step(step, res, m)
        self.next_step += 1
        return m

    def _log_placement(self, step: int) -> None:
        """`devices/<owner>` at each placement change since the last call, each stamped with its wall time. Moves
        within one millisecond (MLflow's resolution) log their end state once."""
        moves = placement_changes(self._pipe.ledger.history, self.cfg.placement.num_devices)
        origin = self.origin()
        by_ms: dict[int, dict[str, int]] = {}
        for t, counts in moves[self.n_moves_logged:]:
            by_ms.setdefault(int((origin + t) * 1000), {}).update(counts)
        for ms, counts in by_ms.items():
            self.sink.log_metrics({f"devices/{owner}": n for owner, n in counts.items()}, step, timestamp=ms / 1000)
        self.n_moves_logged = len(moves)

    def origin(self) -> float:
        """Unix time of the pipeline clock's zero, the run's start (event `time`s and the timeline count from it)."""
        return time.time() - self._pipe.clock()

    def checkpoint(self, dir: str | Path | None = None) -> Path:
        """Save a checkpoint generation after the steps run so far (default dir: <run folder>/checkpoints), and
        with `run.save_hf` the model as a Hugging Face directory beside it (`export_hf`)."""
        path = save(self._pipe, Path(dir) if dir is not None else self.out_dir / "checkpoints", self.next_step)
        if self.cfg.run.save_hf:
            self.export_hf()
        return path

    def keep_host_copy(self) -> Path:
        """`actor.redundancy: host`: the run's state after the steps run so far (a checkpoint generation: the
        actor's parameters, masters, moments and step, the data position) written into host memory, replacing the
        previous copy. `restart` resumes from it when it is newer than the last checkpoint."""
        if self.host_copy is None:
            self.host_copy = Path(tempfile.mkdtemp(prefix=f"tidal-{self.out_dir.name}-", dir=host_copy_root(self.cfg)))
        return save(self._pipe, self.host_copy, self.next_step, keep_last=1)

    def drop_host_copy(self) -> None:
        """The run ended: its host copy's memory is given back."""
        if self.host_copy is not None:
            shutil.rmtree(self.host_copy, ignore_errors=True)
            self.host_copy = None

    def export_hf(self, keep_last: int = 2) -> Path:
        """The actor's weights as a Hugging Face directory `<run folder>/hf/step-<N>`: model.path's config.json
        (its architecture), safetensors in `run.save_hf_dtype`, the tokenizer and generation_config.json, which
        `transformers` and vLLM load. The newest `keep_last` exports are kept."""

        dtype = None if self.cfg.run.save_hf_dtype == "auto" else self.cfg.run.save_hf_dtype
        root = self.out_dir / "hf"
        hf = cast("HFModel", self.inputs.hf)   # exports need model.path (config check of run.save_hf)
        out = save_hf(root / f"step-{self.next_step:06d}", self._pipe.global_weights(), hf, dtype,
                      tokenizer=self.inputs.tok)
        for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep_last]:
            shutil.rmtree(old)
        self._pipe.cluster.record("export_hf", step=self.next_step, path=str(out))
        return out

    def finish(self) -> RunSummary:
        """Timeline picture, events, summary, and the run's totals (`run_figures`) to the sink at its last step;
        the workers stay up until `close`. The summary's `figures` are the floats the sink got, its
        `device_idle_fraction` is `run/idle_fraction`, and timeline.png's title shows it under that name."""
        pipe, cfg, out = self._pipe, self.cfg, self.out_dir
        self._warn(self.run_warnings.at_finish(self.rewards))
        if self.recorder:
            self.recorder.transitions(pipe.ledger.history)
        pipe._close_ownership()
        figures = run_figures(steps=self.next_step, wall_s=time.monotonic() - self.t_run, step_seconds=self.step_s,
                              reshards=self.n_reshard, migrations=self.n_migr,
                              idle_fraction=pipe.timeline.idle_fraction(),
                              step_idle_fraction=pipe.timeline.steps_idle_fraction(),
                              heldout_accuracy_start=self.evals[0][1], heldout_accuracy_end=self.evals[-1][1],
                              rewards=self.rewards)
        self.sink.log_metrics(figures, max(self.next_step - 1, 0))
        idle = figures["run/idle_fraction"]
        self.final_weights = pipe.global_weights()
        pipe.timeline.draw(out / "timeline.png", timeline_title(f"{cfg.run.name}: {self.policy_name} policy", idle),
                           origin=self.origin())
        (out / "timeline.json").write_text(json.dumps(pipe.timeline.to_json()))
        (out / "events.json").write_text(json.dumps(pipe.cluster.events, default=str, indent=1))
        (out / "steps.json").write_text(json.dumps([asdict(t) for t in self.traces]))
        (out / "config.json").write_text(json.dumps(cfg.model_dump(mode="json"), indent=1))
        (out / "model.json").write_text(json.dumps(asdict(self.inputs.args)))
        summary = RunSummary(cfg.run.name, self.next_step, figures["run/wall_s"], self.evals[0][1],
                             self.evals[-1][1], self.rewards, self.evals, self.phase, idle, self.step_s,
                             self.policy_name, self.kind, str(out), self.n_reshard, self.n_migr,
                             {k: v for k, v in self.ws_meta.items() if k != "history"},
                             weights_sha(self.final_weights), self.inputs.source.summary(),
                             [asdict(w) for w in self.warnings], self.restarts, figures)
        (out / "summary.json").write_text(json.dumps(summary.to_json(), indent=1))
        return summary

    def _warn(self, new: list[RunWarning]) -> None:
        """A warning goes to this module's logger, the MLflow run (tag `warning.<kind>`) and the summary; callers
        that show progress take it with `drain_warnings` (the CLI prints it, a flow logs it to Prefect)."""
        for w in new:
            log.warning("%s", w.message)
            self.sink.set_tag(f"warning.{w.kind}", w.message)
            self.warnings.append(w)
            self._pending_warnings.append(w)

    def drain_warnings(self) -> list[RunWarning]:
        """The warnings raised since the last call (each is also in the summary)."""
        out, self._pending_warnings = self._pending_warnings, []
        return out

    def _newest_kept(self) -> tuple[Path, str] | None:
        """The newest state kept: the last checkpoint, or the host copy (actor.redundancy: host) when newer."""
        kept = [g for g in (latest(self.out_dir / "checkpoints"),
                            latest(self.host_copy) if self.host_copy is not None else None) if g is not None]
        if not kept:
            return None
        ckpt = max(kept, key=lambda g: saved_step(g)[1])   # a tie: the checkpoint (listed first)
        return ckpt, "host copy" if self.host_copy is not None and ckpt.parent == self.host_copy else "checkpoint"

    def recover(self, failure: WorkerError) -> dict[str, Any]:
        """Continue after a failure the step could not absorb (an actor device lost, a device lost outside the
        step's streaming loop, the last device of a component, a hung call), from the newest state kept (the last
        checkpoint, or the host copy of `actor.redundancy: host` when newer), the steps since run again; bit for
        bit what `--resume` from that generation gives, without leaving the process. A lost worker's survivors
        carry on with it (`tidal.pipeline.survivors`: no worker started, the lost rank a hole in the world);
        where they cannot (a hung call, the megatron backend, a shared placement, a component with no device
        left) every worker is replaced (`restart`). Returns the record (also in the summary, the events table,
        the database's faults); raises `failure` again when nothing is kept."""
        found = self._newest_kept()
        if found is None:
            raise failure
        ckpt, source = found
        why = refusal(self._pipe) if isinstance(failure, WorkerDied) else f"{type(failure).__name__}: a hung call"
        if why is None:
            t0, now, failed_step = time.monotonic(), self._pipe.clock(), self.next_step
            device = cast(WorkerDied, failure).device_id
            role = self._pipe.ledger.owner(device).value
            try:
                moved = continue_on_survivors(self._pipe, cast(WorkerDied, failure), ckpt)
            except NoSurvivors as e:
                why = str(e)
            else:
                self.next_step = moved["resumed_step"]
                return self._restarted(failure, device, role, failed_step, now, t0, ckpt, source,
                                       {"workers": "kept", **{k: moved[k] for k in (
                                           "layout_from", "layout_to", "borrowed", "lost", "abandon_s", "load_s",
                                           "bytes")}}, self._pipe.ledger.history, new_ledger=False)
        log.warning("step %d: the survivors cannot carry on (%s): every worker is replaced", self.next_step, why)
        return self.restart(failure, ckpt, source)

    def restart(self, failure: WorkerError, ckpt: Path, source: str) -> dict[str, Any]:
        """Every worker replaced, the run reopened from generation `ckpt` (`recover` picks it), the steps since run
        again."""
        t0, now, failed_step = time.monotonic(), self._pipe.clock(), self.next_step
        device = failure.device_id if isinstance(failure, WorkerDied) else cast(WorkerTimeout, failure).device_ids[0]
        role = self._pipe.ledger.owner(device).value
        history = list(self._pipe.ledger.history)
        t_run = self.t_run
        log.warning("step %d: device %d (%s) lost (%s); restarting from %s", failed_step, device, role, failure, ckpt)
        self.close()
        self.open(resume_from=ckpt, checked=(self.inputs, self.kind))
        self.t_run, self.n_moves_logged = t_run, 0   # the run's wall clock goes on; a new ledger's moves
        return self._restarted(failure, device, role, failed_step, now, t0, ckpt, source, {"workers": "replaced"},
                               history, new_ledger=True)

    def _restarted(self, failure: WorkerError, device: int, role: str, failed_step: int, now: float, t0: float,
                   ckpt: Path, source: str, detail: dict[str, Any], history: list[Transition],
                   new_ledger: bool) -> dict[str, Any]:
        """The bookkeeping of a recovery: per-step figures of the steps to run again dropped; the failure and the
        restart recorded (sink, database with the ledger's moves so far, summary)."""
        keep = self.next_step - self.first_step
        del self.rewards[keep:], self.step_s[keep:]
        failed: dict[str, Any] = {"kind": "device_failed", "step": failed_step, "time": now, "device": device,
                                  "role": role, "reason": str(failure), "seconds": 0.0}
        record: dict[str, Any] = {"kind": "restart", "step": failed_step, "time": now, "device": device, "role": role,
                                  "reason": f"restarted from the {source} {ckpt.name}", "source": source,
                                  "resumed_from": str(ckpt), "resumed_step": self.next_step,
                                  "steps_redone": failed_step - self.next_step, "seconds": time.monotonic() - t0,
                                  **detail}
        for ev in (failed, record):
            self.sink.log_event(ev["kind"], table_fields(ev))
        if self.recorder:
            self.recorder.restart(failed, record, history, new_ledger)
        self.restarts.append(record)
        return record

    def close(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None


class DirectRun:
    """The run loop's verbs (`tidal.pipeline.run_loop.RunVerbs`, `StepVerbs`) as direct calls on an open
    `TrainingRun`: what `run_training` drives. `on_step(step, metrics)` follows each step, `on_warning` gets each
    warning the run raised as it is drained; `close` stops the workers and gives the host copy back (the caller
    owns the tracking records and ends them with its own status)."""

    def __init__(self, run: TrainingRun, on_step: Callable[[int, dict[str, float]], None] | None = None,
                 on_warning: Callable[[RunWarning], None] | None = None):
        self.run, self.on_step, self.on_warning = run, on_step, on_warning

    def run_step(self, step: int) -> dict[str, float]:
        assert self.run.next_step == step, (self.run.next_step, step)   # our invariant: steps run once, in order
        return self.run.run_step(sync=False)

    def sync_weights(self) -> dict[str, float]:
        return self.run.sync_weights()

    def evaluate(self) -> float:
        return self.run.evaluate()

    def record(self) -> dict[str, float]:
        return self.run.record()

    def checkpoint(self) -> Path:
        return self.run.checkpoint()

    def keep_host_copy(self) -> Path:
        return self.run.keep_host_copy()

    def step(self, plan: StepPlan) -> dict[str, float]:
        return run_phases(plan, self)

    def recover(self, failure: WorkerError) -> int:
        self.run.recover(failure)
        return self.run.next_step

    def report(self, step: int, metrics: dict[str, float]) -> None:
        if self.on_step:
            self.on_step(step, metrics)
        self._tell()

    def finish(self) -> RunSummary:
        summary = self.run.finish()
        self._tell()
        return summary

    def close(self, status: str) -> None:
        self.run.close()
        self.run.drop_host_copy()

    def _tell(self) -> None:
        for w in self.run.drain_warnings():   # the run logs, tags and keeps every warning itself
            if self.on_warning:
                self.on_warning(w)


def run_training(cfg: TidalConfig, out_dir: Path, sink: MetricsSink | None = None, recorder: DbRecorder | None = None,
                 on_step: Callable[[int, dict[str, float]], None] | None = None, log_fn: WarmStartLog | None = None,
                 policy: Policy | None = None, resume_from: str | Path | None = None, checked: Preflight | None = None,
                 on_warning: Callable[[RunWarning], None] | None = None) -> RunSummary:
    """Run `cfg` end to end; see module doc. `sink`: a MetricsSink (None: NullSink); `recorder`: db rows;
    `resume_from`: a checkpoint folder, the run going on at the step its newest generation names. The steps are
    `tidal.pipeline.run_loop.run_loop` over `DirectRun`: checkpoints every `run.checkpoint_every` steps and after
    the last under <out_dir>/checkpoints. A device lost beyond what the step recovers (`WorkerDied`,
    `WorkerTimeout`) resumes the run in process from its newest checkpoint (or the newer host copy of
    `actor.redundancy: host`, kept after every step that takes no checkpoint), on the surviving workers where they
    can carry on, up to `run.max_restarts` times (`TrainingRun.recover`); an error inside a worker's code
    (`WorkerCallError`) would only repeat, so it ends the run."""
    run = TrainingRun(cfg, out_dir, sink, recorder, log_fn)
    run.policy = policy
    try:
        run.open(resume_from=resume_from, checked=checked)
    except BaseException:
        run.close()
        raise
    return run_loop(DirectRun(run, on_step, on_warning), LoopSettings.from_config(cfg), run.next_step)
