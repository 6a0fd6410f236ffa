"""Credentials stay secret: every sink that sees a config, an argv or an error value gets it masked
(`tidal.core.secrets`), while the run itself keeps the real URL."""

import os
import socket

import pytest

from tasks.requests import BenchmarkRequest, SweepRequest, TrainingRequest
from tidal.cli import main as cli
from tidal.core.config import build_config, flatten, public_dump
from tidal.core.errors import SHOWN_VALUE_CHARS, ConfigError, TidalError
from tidal.core.secrets import redact, redacted

pytestmark = pytest.mark.usefixtures("shared_ray")

SECRET = "s3cret-Pa55"
PG = f"postgresql+psycopg://tidal:{SECRET}@127.0.0.1:5432/tidal"
MLFLOW = f"http://alice:{SECRET}@127.0.0.1:5000"


@pytest.mark.parametrize("text, want", [
    (PG, "postgresql+psycopg://tidal:***@127.0.0.1:5432/tidal"),
    (f"mysql://u:{SECRET}@h/db?x=1", "mysql://u:***@h/db?x=1"),
    (f"--backend-store-uri postgresql://u:{SECRET}@h/db --port 5000",
     "--backend-store-uri postgresql://u:***@h/db --port 5000"),
    (f"https://h/api?token={SECRET}&page=2", "https://h/api?token=***&page=2"),
    (f"PASSWORD={SECRET} other=1", "PASSWORD=*** other=1"),
    ("postgresql://u%40corp:p%40ss@h/db", "postgresql://u%40corp:***@h/db"),
    ("postgresql://tidal@127.0.0.1/tidal", "postgresql://tidal@127.0.0.1/tidal"),    # no password: unchanged
    ("sqlite:///runs/tidal.db", "sqlite:///runs/tidal.db"),
    ("lr=1e-4 at 10:30", "lr=1e-4 at 10:30"),
    # a path library's spelling of a URL (`https://` collapsed to `https:/`), inside a list's repr
    (f"got ['https:/bob:{SECRET}@example.com/train.jsonl']", "got ['https:/bob:***@example.com/train.jsonl']"),
    (f"s3:bob:{SECRET}@bucket/key", "s3:bob:***@bucket/key"),
    (f"https://bob:p@{SECRET}@h/x", "https://bob:***@h/x"),             # an `@` inside the password
    ("git@github.com:org/repo mailto:bob@x.org", "git@github.com:org/repo mailto:bob@x.org"),
])
def test_redact(text, want):
    assert redact(text) == want


def test_redacted_walks_trees_and_keeps_other_values():
    tree = {"a": [PG, 1, 2.5, None, True], "b": {"c": (MLFLOW,)}}
    assert redacted(tree) == {"a": [redact(PG), 1, 2.5, None, True], "b": {"c": (redact(MLFLOW),)}}


def _cfg():
    return build_config({}, [f"tracking.db_url={PG}", f"tracking.mlflow_uri={MLFLOW}"])


def test_stored_and_tracked_config_views_hold_no_credential():
    cfg = _cfg()
    assert cfg.tracking.db_url == PG and cfg.tracking.mlflow_uri == MLFLOW   # the run itself connects with them
    params, dump = flatten(cfg), public_dump(cfg)                             # MLflow params; runs.config row
    assert SECRET not in repr(params) and SECRET not in repr(dump)
    assert params["tracking.db_url"] == "postgresql+psycopg://tidal:***@127.0.0.1:5432/tidal"
    assert dump["tracking"]["mlflow_uri"] == "http://alice:***@127.0.0.1:5000"


def test_error_messages_mask_credentials_and_cut_long_values():
    from db.session import make_engine
    with pytest.raises(ConfigError, match="tracking.db_url") as err:
        make_engine(f"mongodb://u:{SECRET}@h/db")
    assert "mongodb://u:***@h/db" in str(err.value) and SECRET not in str(err.value)
    long = TidalError("data.prompt_key", "x" * 100_000, "is not a column", "name a column")
    assert len(str(long)) < SHOWN_VALUE_CHARS + 200 and "100,002 chars" in str(long)


def test_validate_prints_no_credential(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("run:\n  num_steps: 1\n")
    assert cli.main(["validate", str(cfg), f"tracking.db_url={PG}", f"tracking.mlflow_uri={MLFLOW}"]) == 0
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err
    assert cli.main(["validate", str(cfg), f"tracking.db_url={PG}", "run.num_steps=-1"]) == 2
    out = capsys.readouterr()
    assert "run.num_steps" in out.err and SECRET not in out.out + out.err


def test_tidal_up_logs_no_credential(tmp_path, capsys):
    """`tidal up` logs each service's argv to the console and its log file: the storage URL's password masked."""
    state = tmp_path / "state"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    store = f"sqlite:///{tmp_path}/optuna.db?password={SECRET}"     # SQLite ignores the parameter
    rc = cli.main(["up", "--only", "optuna", "--optuna-port", str(port), "--optuna-storage", store,
                   "--state-dir", str(state), "--timeout", "60"])
    out = capsys.readouterr()
    assert cli.main(["down", "--state-dir", str(state)]) == 0
    logs = "".join(p.read_text(errors="replace") for p in state.rglob("*.log"))
    assert rc == 0, out.err
    assert "optuna.db?password=***" in out.out + logs and SECRET not in out.out + out.err + logs
    # a storage that cannot be reached is a one-line error naming the flag, its password masked
    rc = cli.main(["up", "--only", "optuna", "--optuna-port", str(port), "--optuna-storage",
                   f"postgresql+psycopg://u:{SECRET}@127.0.0.1:9/optuna", "--state-dir", str(state)])
    out = capsys.readouterr()
    assert rc == 2 and "--optuna-storage" in out.err and "u:***@127.0.0.1:9" in out.err
    assert SECRET not in out.out + out.err


@pytest.mark.skipif(not os.environ.get("TIDAL_TEST_PG_URL"),
                    reason="TIDAL_TEST_PG_URL is unset; run `eval \"$(.ci/postgres.sh)\"` to test PostgreSQL")
def test_a_tracked_run_stores_no_credential(tmp_path, caplog):
    """A run tracked in PostgreSQL (a password in tracking.db_url) and MLflow: neither the MLflow params, nor the
    database's run row, nor the logs hold the password."""
    import mlflow
    from sqlalchemy import create_engine, text

    from tidal.pipeline.tracked_run import RunTracking
    url = os.environ["TIDAL_TEST_PG_URL"]
    password = create_engine(url).url.password
    assert password, "TIDAL_TEST_PG_URL must carry a password for this test"
    cfg = build_config({}, [f"tracking.db_url={url}", f"tracking.mlflow_uri=sqlite:///{tmp_path}/mlruns.db",
                            f"tracking.mlflow_artifacts={tmp_path}/artifacts"])
    caplog.set_level("DEBUG")
    tracking = RunTracking.open(cfg, tmp_path / "run")
    tracking.close("FINISHED")
    params = mlflow.MlflowClient(cfg.tracking.mlflow_uri).get_run(tracking.mlflow_run_id).data.params
    with create_engine(url).connect() as conn:
        row = conn.execute(text("SELECT config::text FROM runs WHERE id = :i"), {"i": tracking.db_run_id}).scalar()
    assert params["tracking.db_url"] == redact(url)
    for where, value in {"mlflow params": repr(params), "runs.config": row, "logs": caplog.text}.items():
        assert password not in value, where


@pytest.mark.parametrize("make", [
    lambda: TrainingRequest(overrides=[f"tracking.db_url={PG}"]),
    lambda: SweepRequest(storage=PG),
    lambda: BenchmarkRequest(overrides=[f"tracking.mlflow_uri={MLFLOW}"]),
], ids=["training overrides", "sweep storage", "benchmark overrides"])
def test_flow_parameters_refuse_credentials(make):
    """Prefect stores a flow run's parameters in its database and shows them in its UI: a credential there is
    refused, its value masked, pointing at the worker's environment instead."""
    with pytest.raises(ConfigError, match="Prefect stores flow parameters") as err:
        make()
    assert SECRET not in str(err.value) and "TIDAL_DB_URL" in str(err.value)
