"""Optuna sweeps on the simulator: trials complete, the best settings and the Pareto front are reported, and
every trial is in the study storage (the platform database) and linked to its MLflow run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tidal.cli.compare import compare_groups, select_runs
from tidal.cli.main import main as cli_main
from tidal.core.errors import TidalError
from tidal.sweep import check_space, load_space

pytestmark = pytest.mark.usefixtures("shared_ray")

REPO = Path(__file__).resolve().parents[1]


def _space(tmp_path: Path, body: dict, name: str = "space.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(body, sort_keys=False))
    return p


def _tracking(tmp_path: Path) -> list[str]:
    return ["-o", f"tracking.db_url=sqlite:///{tmp_path}/tidal.db",
            "-o", f"tracking.mlflow_uri=sqlite:///{tmp_path}/mlruns.db",
            "-o", f"tracking.mlflow_artifacts={tmp_path}/mlartifacts"]


def _dominates(a: list[float], b: list[float]) -> bool:
    return all(x <= y for x, y in zip(a, b)) and any(x < y for x, y in zip(a, b))


def test_sweep_on_the_simulator_reports_best_and_pareto_and_stores_every_trial(tmp_path, monkeypatch):
    import mlflow
    import optuna
    monkeypatch.delenv("TIDAL_OPTUNA_STORAGE", raising=False)
    space = _space(tmp_path, {
        "study": "flags", "objectives": ["step_time", "reshards"],
        "simulator": {"workload": "rlinf-example", "devices": 8, "steps": 2, "seed": 1},
        "space": {"scheduler.policy": {"choices": ["static", "rlinf", "tidal"]},
                  "cluster.use_pre_process_policy": {"type": "bool"},
                  "cluster.use_wait_before_last_iter_policy": {"type": "bool"},
                  "scheduler.pre_process_threshold": {"low": 0.1, "high": 0.9, "when": {
                      "scheduler.policy": "rlinf", "cluster.use_pre_process_policy": True}}}})
    out = tmp_path / "report.json"
    assert cli_main(["sweep", str(space), "--trials", "8", "--json", str(out), *_tracking(tmp_path)]) == 0
    report = json.loads(out.read_text())
    assert report["n_trials"] == 8 and report["n_failed"] == 0
    assert set(report["best_values"]) == {"step_time", "reshards"}
    assert set(report["best_params"]) <= {"scheduler.policy", "cluster.use_pre_process_policy",
                                          "cluster.use_wait_before_last_iter_policy", "scheduler.pre_process_threshold"}

    study = optuna.load_study(study_name="flags-sim", storage=f"sqlite:///{tmp_path}/tidal.db")
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 8
    values = {t.number: t.values for t in done}
    # The Pareto front is exactly the non-dominated trials, and best is the front's fastest.
    front = {row["number"] for row in report["pareto"]}
    assert front == {n for n, v in values.items() if not any(_dominates(w, v) for w in values.values())}
    assert report["best_values"]["step_time"] == min(values[n][0] for n in front)
    assert report["pareto"][0]["number"] == report["best_trial"]
    # The conditional threshold is drawn exactly when its conditions hold.
    for t in done:
        cond = t.params["scheduler.policy"] == "rlinf" and t.params["cluster.use_pre_process_policy"]
        assert ("scheduler.pre_process_threshold" in t.params) == cond
    # Static never reshards; each trial's MLflow run is a child of the sweep's run and holds its values.
    for t in done:
        if t.params["scheduler.policy"] == "static":
            assert t.values[1] == 0
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlruns.db")
    for t in done:
        run = client.get_run(t.user_attrs["mlflow_run_id"])
        assert run.data.tags["mlflow.parentRunId"] == report["mlflow_parent_run_id"]
        # tagged for `tidal compare --sweep flags-sim --group-by policy`
        assert run.data.tags["tidal.sweep"] == "flags-sim" and run.data.tags["tidal.trial"] == str(t.number)
        assert run.data.tags["tidal.policy"] == t.params["scheduler.policy"]
        assert run.data.metrics["sweep/step_time_s"] == pytest.approx(t.values[0])
        assert run.data.metrics["sweep/reshards"] == t.values[1]
        assert "mlflow_run_url" not in t.user_attrs   # a local store has no run page
    parent = client.get_run(report["mlflow_parent_run_id"])
    assert "tidal.sweep" not in parent.data.tags   # the sweep's trials are what `--sweep` compares
    assert parent.data.metrics["sweep/trial_count"] == 8
    assert set(parent.data.metrics) == {"sweep/trial_count", "best/step_time_s", "best/reshards"}
    trials = select_runs(f"sqlite:///{tmp_path}/mlruns.db", sweep="flags-sim")
    assert sorted(trials) == sorted(t.user_attrs["mlflow_run_id"] for t in done)
    names, rows = compare_groups(trials, f"sqlite:///{tmp_path}/mlruns.db", "policy")
    assert set(names) == {t.params["scheduler.policy"] for t in done}
    assert sum(rows[0].values) == 8   # runs per policy
    # Optuna's tables sit beside the platform's: the platform schema is still exactly at head.
    from db.migrate import open_database, schema_diff
    engine = open_database(f"sqlite:///{tmp_path}/tidal.db")
    assert schema_diff(engine) == []
    engine.dispose()

    # Running again adds trials to the same study (and does not redraw the same random points), under the same
    # MLflow parent run
    assert study.user_attrs["mlflow_parent_run_id"] == report["mlflow_parent_run_id"]
    assert cli_main(["sweep", str(space), "--trials", "2", "--json", str(out), *_tracking(tmp_path)]) == 0
    again = json.loads(out.read_text())
    assert again["n_trials"] == 10 and again["mlflow_parent_run_id"] == report["mlflow_parent_run_id"]
    trials = select_runs(f"sqlite:///{tmp_path}/mlruns.db", sweep="flags-sim")
    assert len(trials) == 10
    assert {client.get_run(r).data.tags["mlflow.parentRunId"] for r in trials} == {report["mlflow_parent_run_id"]}
    parent = client.get_run(report["mlflow_parent_run_id"])
    assert parent.info.status == "FINISHED"
    assert [m.value for m in client.get_metric_history(parent.info.run_id, "sweep/trial_count")] == [8, 10]


def test_single_objective_sweep_of_thresholds_finds_the_minimum(tmp_path, monkeypatch):
    monkeypatch.delenv("TIDAL_OPTUNA_STORAGE", raising=False)
    space = _space(tmp_path, {
        "study": "thr", "objectives": ["step_time"], "simulator": {"steps": 2},
        "space": {"scheduler.policy": {"choices": ["rlinf"]},
                  "cluster.use_pre_process_policy": {"choices": [True]},
                  "scheduler.pre_process_threshold": {"low": 0.05, "high": 0.95},
                  "rollout.max_running_requests": {"type": "int", "low": 128, "high": 1024, "log": True}}})
    out = tmp_path / "r.json"
    assert cli_main(["sweep", str(space), "--trials", "8", "--json", str(out),
                     "--storage", f"sqlite:///{tmp_path}/optuna.db", *_tracking(tmp_path)]) == 0
    report = json.loads(out.read_text())
    values = [row["values"]["step_time"] for row in report["pareto"]]
    assert len(values) == 1 and report["best_values"]["step_time"] == values[0]
    import optuna
    study = optuna.load_study(study_name="thr-sim", storage=f"sqlite:///{tmp_path}/optuna.db")
    assert report["best_values"]["step_time"] == min(t.value for t in study.trials)
    assert 128 <= report["best_params"]["rollout.max_running_requests"] <= 1024


def test_shipped_sweep_spaces_load_and_check():
    paths = sorted((REPO / "experiments").glob("sweep_*.yaml"))
    assert paths
    for p in paths:
        space = load_space(p)
        check_space(space, real=False)
        if space.config:
            check_space(space, real=True)


@pytest.mark.parametrize("body, field, words", [
    ({"study": "x"}, "space", "top-level `space:`"),
    ({"space": {"scheduler.polcy": {"choices": ["rlinf"]}}}, "space.scheduler.polcy", "did you mean scheduler.policy"),
    ({"space": {"scheduler.pre_process_threshold": {"low": 0.1, "high": 0.9, "when": {"scheduler.policy": "rlinf"}},
                "scheduler.policy": {"choices": ["rlinf"]}}}, "when", "list scheduler.policy above"),
    ({"space": {"scheduler.pre_process_threshold": {"low": 0.9, "high": 0.1}}}, "pre_process_threshold", "low <= high"),
    ({"space": {"scheduler.policy": {"choices": []}}}, "choices", "non-empty list"),
    ({"objectives": ["speed"], "space": {"scheduler.policy": {"choices": ["rlinf"]}}}, "objectives", "step_time"),
    ({"objectives": ["accuracy"], "space": {"scheduler.policy": {"choices": ["rlinf"]}}}, "objectives", "--real"),
    ({"space": {"actor.lr": {"low": 1e-5, "high": 1e-3}}}, "actor.lr", "rlinf-example"),
])
def test_bad_spaces_name_the_key_and_the_fix(tmp_path, body, field, words):
    p = _space(tmp_path, body)
    with pytest.raises(TidalError) as e:
        check_space(load_space(p), real=False)
    assert field in str(e.value) and words in str(e.value), str(e.value)


def test_real_sweeps_need_a_config_and_the_cli_exits_2_with_the_fix(tmp_path, capsys):
    p = _space(tmp_path, {"space": {"scheduler.policy": {"choices": ["rlinf", "tidal"]}}})
    assert cli_main(["sweep", str(p), "--trials", "1", "--real", *_tracking(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "real.config" in err and "experiments/rlinf_dynamic.yaml" in err
    assert cli_main(["sweep", str(tmp_path / "missing.yaml")]) == 2


def test_shipped_policy_sweep_draws_20_distinct_valid_trials_with_named_metrics(tmp_path, monkeypatch):
    """experiments/sweep_policy.yaml on the simulator: 20 trials, no two with the same settings, RLinf's flags
    only under `rlinf` and the tidal knobs only under `tidal`, the study's metrics named with their units."""
    import optuna
    monkeypatch.delenv("TIDAL_OPTUNA_STORAGE", raising=False)
    out = tmp_path / "report.json"
    space = str(REPO / "experiments" / "sweep_policy.yaml")
    assert cli_main(["sweep", space, "--trials", "20", "--json", str(out), *_tracking(tmp_path)]) == 0
    assert json.loads(out.read_text())["n_trials"] == 20
    study = optuna.load_study(study_name="policy-flags-sim", storage=f"sqlite:///{tmp_path}/tidal.db")
    assert study.metric_names == ["step_time_s", "reshards"]
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 20
    settings = [json.dumps(t.params, sort_keys=True) for t in done]
    assert len(set(settings)) == 20
    rlinf_keys = {"cluster.use_pre_process_policy", "cluster.use_wait_before_last_iter_policy",
                  "scheduler.pre_process_threshold"}
    tidal_keys = {"scheduler.lend_actor", "scheduler.grow_on_return", "scheduler.return_on_generated"}
    for t in done:
        policy, keys = t.params["scheduler.policy"], set(t.params) - {"scheduler.policy"}
        assert keys <= {"rlinf": rlinf_keys, "tidal": tidal_keys, "static": set()}[policy], t.params
    for t in study.trials:   # a draw that repeated an earlier trial was set aside, naming which
        if t.state == optuna.trial.TrialState.PRUNED:
            assert t.user_attrs["duplicate_of"] in {d.number for d in study.trials}


def test_the_summary_shows_the_front_the_best_settings_to_paste_and_the_links(tmp_path, monkeypatch):
    """The smallest sweep (3 trials, 1 simulated step): its summary (the flow run's markdown artifact, what
    `tidal sweep` prints) marks the Pareto front, gives the best settings as config YAML and as overrides, and
    links the study and the MLflow parent run, or says how to serve a local store."""
    from tidal.sweep import as_overrides, run_sweep, summary_markdown, trials_table
    monkeypatch.delenv("TIDAL_OPTUNA_STORAGE", raising=False)
    monkeypatch.delenv("TIDAL_OPTUNA_DASHBOARD_URL", raising=False)
    monkeypatch.setenv("TIDAL_HOME", str(tmp_path / "home"))   # no `tidal up` dashboard here
    space = load_space(_space(tmp_path, {
        "study": "small", "objectives": ["step_time", "reshards"], "simulator": {"steps": 1},
        "space": {"scheduler.policy": {"choices": ["static", "rlinf", "tidal"]},
                  "cluster.use_pre_process_policy": {"type": "bool"}}}))
    tracking = [o for o in _tracking(tmp_path) if o != "-o"]
    report = run_sweep(space, 3, overrides=tracking)
    text = summary_markdown(report)

    assert text.startswith("# Sweep `small-sim`\n") and "3 complete trials, 0 failed" in text
    assert f"## Best settings: trial {report.best_trial}" in text
    snippet = "```yaml\n" + "\n".join(
        f"{section}:\n  {leaf}: {yaml.safe_dump(value).splitlines()[0]}" for section, leaf, value in (
            (k.split(".")[0], k.split(".")[1], v) for k, v in report.best_params.items())) + "\n```"
    assert snippet in text, text
    assert " ".join(f"`{o}`" for o in as_overrides(report.best_params)) in text
    front = text.split("## Pareto front")[1].split("## Trials")[0]
    assert [int(line.split("|")[1]) for line in front.splitlines() if line.startswith("| ") and "trial" not in line] \
        == [row["number"] for row in report.pareto]
    trials = [line for line in text.split("## Trials")[1].split("## Links")[0].splitlines()
              if line.startswith("| ") and "trial" not in line]
    assert len(trials) == 3
    assert {int(line.split("|")[1]) for line in trials if "★" in line} == {row["number"] for row in report.pareto}
    # links: a local store has no pages, so the summary says how to serve each and where the page then is
    assert report.study_id is not None and report.dashboard_url is None and report.mlflow_parent_run_url is None
    assert f"`optuna-dashboard sqlite:///{tmp_path}/tidal.db`" in text
    assert f"http://127.0.0.1:8080/dashboard/studies/{report.study_id}" in text
    assert f"MLflow parent run `{report.mlflow_parent_run_id}`" in text
    assert f"mlflow ui --backend-store-uri sqlite:///{tmp_path}/mlruns.db" in text
    assert (f"http://127.0.0.1:5000/#/experiments/{report.mlflow_experiment_id}/runs/"
            f"{report.mlflow_parent_run_id}") in text
    rows = trials_table(report)
    assert [r["trial"] for r in rows] == [t["number"] for t in report.trials]
    assert {r["trial"] for r in rows if r["pareto"]} == {row["number"] for row in report.pareto}
    assert all(set(r) == set(rows[0]) for r in rows) and "step_time_s" in rows[0]

    # a known dashboard and a tracking server: links to their pages
    from dataclasses import replace
    monkeypatch.setenv("TIDAL_OPTUNA_DASHBOARD_URL", "http://dash.example:8080/")
    from tidal.sweep import dashboard_url
    linked = replace(report, dashboard_url=dashboard_url("sqlite:///x.db", report.study_id),
                     mlflow_parent_run_url="http://mlflow.example/#/experiments/1/runs/abc")
    text = summary_markdown(linked)
    assert f"[optuna-dashboard](http://dash.example:8080/dashboard/studies/{report.study_id})" in text
    assert f"[{report.mlflow_parent_run_id}](http://mlflow.example/#/experiments/1/runs/abc)" in text


def test_tidal_sweep_prints_the_summary(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TIDAL_OPTUNA_STORAGE", raising=False)
    monkeypatch.setenv("TIDAL_HOME", str(tmp_path / "home"))
    space = _space(tmp_path, {"study": "cli", "simulator": {"steps": 1},
                              "space": {"scheduler.policy": {"choices": ["static", "tidal"]}}})
    assert cli_main(["sweep", str(space), "--trials", "2", *_tracking(tmp_path)]) == 0
    out = capsys.readouterr().out
    for words in ("Sweep cli-sim", "Best settings", "scheduler:", "policy:", "Best trial", "Trials", "Links",
                  "optuna-dashboard", "mlflow ui --backend-store-uri"):
        assert words in out, (words, out)
