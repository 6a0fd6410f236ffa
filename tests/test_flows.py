"""Flows, tasks and deployments.

The slow test is the platform's end-to-end check: a real Prefect server on loopback, `tidal serve` registering
the deployments, runs triggered through the REST API (as the UI does), then the flow runs, the MLflow run
(metrics, reshard events) and the database rows are looked up where they were written.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tasks import registry
from tasks.requests import SweepRequest, TrainingRequest
from tidal.cli.main import main as cli_main
from tidal.pipeline.tracked_run import load_run_config

REPO = Path(__file__).resolve().parents[1]
TELEMETRY = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true",
             "RAY_USAGE_STATS_ENABLED": "0"}


# ---- fast checks ----------------------------------------------------------------------------------------------

def test_deployments_are_module_entrypoints_with_typed_parameter_forms():
    from flows.serve import NAMES, deployments
    deps = {d.name: d for d in deployments()}
    assert set(deps) == set(NAMES)
    assert deps["rl-training"].entrypoint == "flows.rl_training.rl_training"
    assert deps["policy-sweep"].entrypoint == "flows.policy_sweep.policy_sweep"
    from flows.rl_training import rl_training
    form = rl_training.parameters.model_dump()["definitions"]["TrainingRequest"]["properties"]
    assert list(form) == ["config", "policy", "auto_scheduler", "use_pre_process_policy",
                          "use_wait_before_last_iter_policy", "num_steps", "seed", "overrides", "track",
                          "resume_from"]
    assert form["overrides"]["type"] == "array" and form["config"]["type"] == "string"
    assert form["policy"]["enum"] == ["tidal", "rlinf", "static", None]   # plain fields: tests/test_requests_form.py
    assert form["num_steps"]["type"] == "integer" and (form["num_steps"]["minimum"], form["num_steps"]["maximum"]) \
        == (1, 1 << 24)
    assert form["auto_scheduler"]["enum"] == [True, False, None]
    # a plain text input (no type switch, nothing prefilled): empty starts the run at step 0
    assert {k: v for k, v in form["resume_from"].items() if k != "description"} == {"type": "string",
                                                                                   "title": "Resume From"}
    for name in ("policy", "auto_scheduler", "num_steps", "seed"):   # empty: the config's value, its default named
        assert "default" not in form[name] and "Empty: the config's" in form[name]["description"]
    assert "(without one: 10)" in form["num_steps"]["description"]
    assert deps["rl-training"].enforce_parameter_schema


def test_requests_refuse_unknown_fields():
    from pydantic import ValidationError
    with pytest.raises(ValidationError, match="num_stepz"):
        TrainingRequest(config="x.yaml", num_stepz=3)
    with pytest.raises(ValidationError, match="trials"):
        SweepRequest(trials=0)


def test_typed_fields_become_overrides_after_the_list():
    req = TrainingRequest(config="x.yaml", policy="rlinf", auto_scheduler=True, use_pre_process_policy=False,
                          num_steps=2, seed=7, overrides=["actor.lr=3e-4"])
    assert req.config_overrides() == ["actor.lr=3e-4", "scheduler.policy=rlinf", "cluster.auto_scheduler=true",
                                      "cluster.use_pre_process_policy=false", "run.num_steps=2", "run.seed=7"]
    assert TrainingRequest(overrides=["run.num_steps=2"]).config_overrides() == ["run.num_steps=2"]   # as before
    cfg = load_run_config(REPO / "experiments/addition_dynamic.yaml",
                          TrainingRequest(policy="static", num_steps=3, seed=5).config_overrides())
    assert (cfg.scheduler.policy, cfg.run.num_steps, cfg.run.seed) == ("static", 3, 5)


def test_a_field_and_an_override_of_its_key_must_agree():
    from tidal.core.errors import ConfigError
    with pytest.raises(ConfigError, match=r"num_steps: conflicts with the override 'run.num_steps=2'.*"
                                          r"clear the field num_steps, or drop 'run.num_steps=2'") as info:
        TrainingRequest(num_steps=3, overrides=["actor.lr=1e-4", "run.num_steps=2"])
    assert (info.value.field, info.value.value) == ("num_steps", 3)
    with pytest.raises(ConfigError, match="auto_scheduler: conflicts with the override 'cluster.auto_scheduler=no'"):
        TrainingRequest(auto_scheduler=True, overrides=["cluster.auto_scheduler=no"])
    # the same value said twice is no conflict (YAML's spellings of a boolean are one value)
    assert TrainingRequest(auto_scheduler=True, num_steps=2, overrides=[
        "cluster.auto_scheduler=True", " run.num_steps = 2"]).config_overrides()[-2:] == [
        "cluster.auto_scheduler=true", "run.num_steps=2"]


@pytest.mark.parametrize("fields, field", [({"num_steps": 0}, "num_steps"), ({"seed": -1}, "seed"),
                                           ({"policy": "rlinx"}, "policy"), ({"auto_scheduler": "maybe"},
                                                                             "auto_scheduler")])
def test_typed_fields_refuse_values_out_of_range(fields, field):
    from pydantic import ValidationError
    with pytest.raises(ValidationError, match=field):
        TrainingRequest(**fields)


def test_the_policy_field_offers_exactly_the_configs_policies():
    from typing import get_args

    from tasks.requests import PolicyName
    from tidal.core.config import SchedulerConfig
    assert get_args(PolicyName) == get_args(SchedulerConfig.model_fields["policy"].annotation)


def test_a_moving_policy_on_a_static_run_is_an_error_naming_the_field():
    from tidal.core.errors import ConfigError
    req = TrainingRequest(policy="rlinf", auto_scheduler=False)
    cfg = load_run_config(REPO / "experiments/addition_dynamic.yaml", req.config_overrides())
    with pytest.raises(ConfigError, match="policy: acts only with dynamic scheduling.*set auto_scheduler: true"):
        req.check_against(cfg)
    TrainingRequest(policy="static", auto_scheduler=False).check_against(cfg)   # says what the run does: fine


def test_serve_without_a_server_says_how_to_get_one(monkeypatch, capsys):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert cli_main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "PREFECT_API_URL" in err and "tidal up" in err


def test_registry_hands_out_live_objects_by_key_only_in_this_process():
    obj = object()
    key = registry.put("run", obj)
    try:
        assert registry.get(key, "run") is obj
        with pytest.raises(LookupError, match="no live sweep"):
            registry.get(key, "sweep")
        with pytest.raises(KeyError, match="already taken"):
            registry.put("run", object(), key=key)
    finally:
        assert registry.pop(key) is obj
    with pytest.raises(LookupError, match=key):
        registry.get(key, "run")


def test_environment_points_runs_at_the_platform_but_overrides_win(monkeypatch, tmp_path):
    monkeypatch.setenv("TIDAL_DB_URL", f"sqlite:///{tmp_path}/env.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/envml.db")
    cfg = load_run_config(REPO / "experiments/rlinf_dynamic.yaml", [f"tracking.db_url=sqlite:///{tmp_path}/x.db"])
    assert cfg.tracking.db_url == f"sqlite:///{tmp_path}/x.db"
    assert cfg.tracking.mlflow_uri == f"sqlite:///{tmp_path}/envml.db"


def test_bad_config_in_a_request_is_a_config_error_naming_the_field():
    from tidal.core.errors import ConfigError
    with pytest.raises(ConfigError, match="run.num_stepz"):
        load_run_config(REPO / "experiments/rlinf_dynamic.yaml", ["run.num_stepz=2"])



# ---- links between Prefect and MLflow; the opening's lines ------------------------------------------------------

def test_tidals_experiments_open_in_mlflows_model_training_view(tmp_path):
    """MLflow 3 opens an experiment as GenAI unless its kind says otherwise: a new experiment is created with the
    kind, an existing one without a kind (or with one MLflow only inferred) gets it, a person's choice stays."""
    from mlflow.tracking import MlflowClient

    from tidal.tracking import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, MlflowSink
    uri = f"sqlite:///{tmp_path}/mlruns.db"
    client = MlflowClient(tracking_uri=uri)

    def kind(name: str) -> str | None:
        MlflowSink(uri, name, str(tmp_path / "art"))
        return client.get_experiment_by_name(name).tags.get(EXPERIMENT_KIND_TAG)
    assert EXPERIMENT_KIND == "custom_model_development" and kind("new") == EXPERIMENT_KIND
    client.create_experiment("untagged")
    assert kind("untagged") == EXPERIMENT_KIND
    client.create_experiment("inferred", tags={EXPERIMENT_KIND_TAG: "genai_development_inferred"})
    assert kind("inferred") == EXPERIMENT_KIND
    client.create_experiment("chosen", tags={EXPERIMENT_KIND_TAG: "genai_development"})
    assert kind("chosen") == "genai_development"


def test_every_mlflow_link_opens_the_run_in_the_model_training_view():
    from tasks.reporting import mlflow_run_markdown
    from tidal.tracking import run_url, ui_run_url
    page = "http://127.0.0.1:5000/#/experiments/3/runs/abc?workflowType=machine_learning"
    assert ui_run_url("http://127.0.0.1:5000/", "3", "abc") == run_url("http://127.0.0.1:5000", "3", "abc") == page
    assert f"({page})" in mlflow_run_markdown("http://127.0.0.1:5000", "3", "abc")
    assert f"({page})" in mlflow_run_markdown("sqlite:///mlruns.db", "3", "abc")   # `mlflow ui`'s page


def test_the_mlflow_runs_description_links_its_flow_run():
    from tidal.tracking import flow_run_note
    url = "http://127.0.0.1:4200/runs/flow-run/1f0c"
    assert flow_run_note(url, "brave-fox", "1f0c") == (
        f"Driven by the Prefect flow run [brave-fox]({url}): its log, tasks and artifacts.")
    assert flow_run_note(url, "a [b]", "1f0c").startswith("Driven by the Prefect flow run [a (b)](")
    assert flow_run_note(None, "brave-fox", "1f0c") == "Driven by the Prefect flow run `brave-fox` (id `1f0c`)."
    assert flow_run_note(None, None, None) is None


def test_prefect_links_name_the_flow_runs_page_from_the_api_url(monkeypatch):
    """Outside a flow run there is nothing to link; inside one, the page is PREFECT_UI_URL's (derived from
    PREFECT_API_URL) `/runs/flow-run/<id>`, in the tag and in the description."""
    import uuid
    from types import SimpleNamespace

    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, temporary_settings

    import tasks.training
    from tasks.training import prefect_links
    assert prefect_links() == {}
    fid = uuid.uuid4()
    monkeypatch.setattr(tasks.training, "flow_run", SimpleNamespace(id=fid, name="brave-fox"))
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:4321/api"}, restore_defaults={PREFECT_UI_URL}):
        links = prefect_links()
    page = f"http://127.0.0.1:4321/runs/flow-run/{fid}"
    assert links["prefect.flow_run_id"] == str(fid) and links["prefect.flow_run_url"] == page
    assert links["mlflow.note.content"] == f"Driven by the Prefect flow run [brave-fox]({page}): its log, tasks " \
                                           "and artifacts."


def test_the_opening_logs_a_line_per_stage_each_naming_the_next():
    """`OpeningLog` as `TrainingRun.open` calls it: a line as each stage ends (what it did, seconds, what comes
    next), then the run open; nothing between two lines but one stage."""
    from types import SimpleNamespace

    from tasks.training import OpeningLog
    from tidal.pipeline.run import OPEN_STAGES
    lines: list[str] = []
    logger = SimpleNamespace(info=lambda fmt, *args: lines.append(fmt % args))
    cfg = load_run_config(REPO / "experiments/tiny_dynamic.yaml")
    opening = OpeningLog(logger, cfg)
    opening.run = SimpleNamespace(ws_meta={"source": "warm start", "heldout_accuracy": 0.25},   # type: ignore
                                  evals=[(0, 0.5)], next_step=0)
    for stage in (*OPEN_STAGES, "open"):
        opening.stage(stage)
    assert [line.split(" (")[0] for line in lines[:-1]] == [
        "tracking ready", "model loaded: warm start, held-out 0.250", "Ray up, 4 workers started",
        "weights placed on the workers", "first evaluation: held-out accuracy 0.500"]
    assert lines[0].endswith("; loading the model (a checkpoint, the cached warm start, or a warm start)...")
    assert lines[1].endswith("; starting Ray and 4 workers (cpu devices)...")
    assert lines[-1].startswith("run open after ") and lines[-1].endswith(" s: step 0 of 2 next")

# ---- a real Prefect server, served deployments, REST-triggered runs --------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(method: str, url: str, body: dict | None = None, attempts: int = 5) -> dict | list:
    """One REST call; a 503 (the server busy on a loaded machine, seen once in CI) is retried a few times."""
    data = None if body is None else json.dumps(body).encode()
    for k in range(attempts):
        req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError as err:
            if err.code != 503 or k == attempts - 1:
                raise
            time.sleep(2.0 * (k + 1))
    raise AssertionError("unreachable")


def _wait(what: str, fn, timeout_s: float, every_s: float = 1.0, proc: subprocess.Popen | None = None,
          log: Path | None = None):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: process exited {proc.returncode}\n{log.read_text()[-3000:] if log else ''}")
        try:
            out = fn()
        except (urllib.error.URLError, ConnectionError, OSError):
            out = None
        if out:
            return out
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s\n{log.read_text()[-3000:] if log else ''}")


def _start(argv: list[str], env: dict, log: Path, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, env=env, cwd=cwd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _stop(proc: subprocess.Popen, sig: int = signal.SIGINT, grace_s: float = 30.0) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect")
    port = _free_port()
    env = {**os.environ, **TELEMETRY, "PREFECT_HOME": str(home)}
    env.pop("PREFECT_API_URL", None)
    log = home / "server.log"
    exe = str(Path(sys.executable).parent / "prefect")
    proc = _start([exe, "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui"], env, log, home)
    api = f"http://127.0.0.1:{port}/api"
    try:
        _wait("prefect server healthy", lambda: _http("GET", f"{api}/health"), 180, proc=proc, log=log)
        yield api, home
    finally:
        _stop(proc, signal.SIGTERM)


def _run_deployment(api: str, name: str, parameters: dict, timeout_s: float, serve_proc, serve_log) -> dict:
    dep = _wait(f"deployment {name} registered", lambda: _http("GET", f"{api}/deployments/name/{name}/{name}"),
                180, proc=serve_proc, log=serve_log)
    assert "request" in dep["parameter_openapi_schema"]["properties"]   # the UI's form
    run = _http("POST", f"{api}/deployments/{dep['id']}/create_flow_run",
                {"parameters": parameters, "name": f"{name}-by-test"})

    def final():
        fr = _http("GET", f"{api}/flow_runs/{run['id']}")
        return fr if fr["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None

    fr = _wait(f"flow run of {name} finished", final, timeout_s, every_s=2.0, proc=serve_proc, log=serve_log)
    assert fr["state"]["type"] == "COMPLETED", f"{fr['state']}\n{serve_log.read_text()[-4000:]}"
    return fr


def _task_names(api: str, flow_run_id: str) -> list[str]:
    runs = _http("POST", f"{api}/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}, "limit": 200})
    assert all(r["state"]["type"] == "COMPLETED" for r in runs), [(r["name"], r["state"]["type"]) for r in runs]
    return [r["name"].rsplit("-", 1)[0] for r in runs]   # "run-step-1a2" -> "run-step"


@pytest.mark.slow
@pytest.mark.timeout(1500)   # a training run starts 8 workers and Ray: minutes on a loaded 2-core machine
def test_served_deployments_run_from_the_rest_api(prefect_server, tmp_path):
    import mlflow
    import optuna

    from db import repository as repo
    from db.migrate import open_database
    from db.session import session_scope
    api, home = prefect_server
    db_url, ml_uri = f"sqlite:///{tmp_path}/tidal.db", f"sqlite:///{tmp_path}/mlruns.db"
    tracking = [f"tracking.db_url={db_url}", f"tracking.mlflow_uri={ml_uri}",
                f"tracking.mlflow_artifacts={tmp_path}/mlartifacts", f"run.output_dir={tmp_path}/runs"]
    env = {**os.environ, **TELEMETRY, "PREFECT_API_URL": api, "PREFECT_HOME": str(home),
           "PREFECT_RUNNER_POLL_FREQUENCY": "2"}
    for k in ("TIDAL_DB_URL", "MLFLOW_TRACKING_URI", "TIDAL_OPTUNA_STORAGE"):
        env.pop(k, None)
    log = tmp_path / "serve.log"
    serve = _start([str(Path(sys.executable).parent / "tidal"), "serve"], env, log, REPO)
    try:
        # 1. a short real training run (rlinf policy: it reshards the actor onto the rollout devices once they are
        # done), on 4 devices
        fr = _run_deployment(api, "rl-training", {"request": {
            "config": "experiments/addition_dynamic.yaml",
            "overrides": ["run.num_steps=2", "warm_start.iters=20", "data.eval_size=32", "scheduler.policy=rlinf",
                          "cluster.num_devices_per_node=4",
                          "cluster.component_placement={actor: 0, rollout: 1-2, inference: 3}",
                          "run.name=rest-run", *tracking]}}, 900, serve, log)
        names = _task_names(api, fr["id"])
        assert {"open-run", "finish-run", "close-run"} <= set(names), names
        steps = _http("POST", f"{api}/flow_runs/filter",
                      {"flow_runs": {"parent_flow_run_id": {"any_": [fr["id"]]}}, "sort": "START_TIME_ASC"})
        assert [s["name"] for s in steps] == ["step-0", "step-1"]
        assert all(s["state"]["type"] == "COMPLETED" for s in steps)
        step_tasks = set(_task_names(api, steps[-1]["id"]))
        assert {"run-step", "sync-weights", "evaluate", "checkpoint", "record-step"} <= step_tasks, step_tasks

        engine = open_database(db_url)
        with session_scope(engine) as s:
            (run,) = repo.list_runs(s)
            assert run.status == "finished" and run.name == "rest-run" and run.mlflow_run_id
            assert run.prefect_flow_run_id == fr["id"]   # the row links both: its flow run and its MLflow run
            db_steps = repo.list_steps(s, run.id)
            reshards = repo.list_reshards(s, run.id)
            decisions = repo.list_scheduler_events(s, run.id)
            transitions = repo.list_transitions(s, run.id)
        engine.dispose()
        assert [st.step for st in db_steps] == [0, 1]
        assert db_steps[-1].eval_accuracy is not None          # evaluated before the step was recorded
        assert reshards and all(r.ok for r in reshards)
        assert decisions and transitions
        from tidal.pipeline.checkpointing import find_generation
        assert find_generation(Path(run.output_dir) / "checkpoints").name == "gen-2"   # checkpoint_every 0: at the end
        assert sorted(p.name for p in (Path(run.output_dir) / "checkpoints").glob("gen-*")) == ["gen-2"]

        client = mlflow.tracking.MlflowClient(tracking_uri=ml_uri)
        mr = client.get_run(run.mlflow_run_id)
        assert mr.info.status == "FINISHED" and mr.data.tags["tidal.db_run_id"] == str(run.id)
        # linked to its flow run, and named apart from a run of the same config under another policy
        assert mr.data.tags["prefect.flow_run_id"] == fr["id"]
        assert fr["name"] == mr.data.tags["prefect.flow_run_name"] == "rl-training-by-test"   # the given name stays
        assert mr.data.tags["prefect.flow_run_url"].endswith(fr["id"])
        assert mr.info.run_name.startswith("rest-run-rlinf-")
        for key in ("grpo/reward_mean", "step/time_s", "sync/time_s", "eval/heldout_accuracy"):
            assert key in mr.data.metrics, key
        assert len(client.get_metric_history(mr.info.run_id, "step/time_s")) == 2
        assert sum(m.value for m in client.get_metric_history(mr.info.run_id, "reshard/count")) == len(reshards)
        events = json.loads(Path(client.download_artifacts(mr.info.run_id, "events.json", str(tmp_path))).read_text())
        assert sum(e["kind"] == "reshard" for e in events) == len(reshards)
        assert sum(e["kind"] == "weight_sync" for e in events) == 2
        artifacts = {a.path for a in client.list_artifacts(mr.info.run_id)}
        assert {"timeline.png", "summary.json", "events.json"} <= artifacts

        # 2. a sweep on the simulator, through the same server
        _run_deployment(api, "policy-sweep", {"request": {
            "space": "experiments/sweep_policy.yaml", "trials": 8, "overrides": tracking}}, 300, serve, log)
        study = optuna.load_study(study_name="policy-flags-sim", storage=db_url)
        assert sum(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials) == 8

        # 3. the policy benchmark on the simulator
        out = tmp_path / "bench.json"
        _run_deployment(api, "benchmark", {"request": {"steps": 2, "json_path": str(out)}}, 300, serve, log)
        rows = {r["policy"]: r for r in json.loads(out.read_text())["simulated"]}
        assert set(rows) == {"static", "rlinf", "tidal"} and rows["static"]["reshards"] == 0
    finally:
        _stop(serve)


def test_the_opening_says_a_stage_goes_on_at_least_every_heartbeat(monkeypatch):
    """While `TrainingRun.open` is in one stage (Ray and the workers take seconds), the open-run task's log gets a
    line every HEARTBEAT_S: the flow run's page never shows nothing for longer."""
    import time as _time

    from tasks import training
    from tidal.core.config import build_config
    monkeypatch.setattr(training, "HEARTBEAT_S", 0.05)
    lines: list[str] = []

    class Logger:
        def info(self, msg: str, *args: object) -> None:
            lines.append(msg % args)

    opening = training.OpeningLog(Logger(), build_config({}, []))
    opening.current = "workers"
    with opening:
        _time.sleep(0.3)
    beats = [ln for ln in lines if ln.startswith("... still starting Ray")]
    assert len(beats) >= 3, lines
    opening.current = "open"
    n = len(lines)
    with opening:
        _time.sleep(0.15)
    assert len(lines) == n   # the run is open: nothing more to say
