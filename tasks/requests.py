"""What a flow run is asked to do: typed, validated parameters (the Prefect UI renders each as a form).

A run is a config file plus a few `key.path=value` overrides, exactly as on the command line::

    rl-training   TrainingRequest(config="experiments/rlinf_dynamic.yaml", overrides=["run.num_steps=2"])
    policy-sweep  SweepRequest(space="experiments/sweep_policy.yaml", trials=16)
    benchmark     BenchmarkRequest(workload="rlinf-example", policies=["static", "rlinf", "tidal"])

Paths are resolved by the process that runs the flow (`tidal serve` runs it in the directory it was started in).
Deeper checks (does the file exist, is every key known) happen when the flow loads the config, and fail with a
`TidalError` naming the field, the value and the fix.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tidal.core.errors import ConfigError
from tidal.core.secrets import redact

CREDENTIALS_FIX = ("set it in the flow worker's environment instead (TIDAL_DB_URL, MLFLOW_TRACKING_URI, "
                   "TIDAL_OPTUNA_STORAGE), which the run reads and Prefect does not store")


class Request(BaseModel):
    """Parameters of a flow run. Prefect stores them in its database and shows them in its UI, so none may hold
    a credential: a password in a URL is refused here, naming the parameter (its value masked)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*")
    @classmethod
    def _no_credentials(cls, value, info):
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and redact(item) != item:
                raise ConfigError(info.field_name, redact(item), "holds a credential, and Prefect stores flow "
                                  "parameters in its database", CREDENTIALS_FIX)
        return value


class TrainingRequest(Request):
    config: str = Field("experiments/rlinf_dynamic.yaml", description="Experiment config (YAML path).")
    overrides: list[str] = Field(default_factory=list,
                                 description="key.path=value overrides, e.g. run.num_steps=4 scheduler.policy=rlinf.")
    track: bool = Field(True, description="Log to MLflow (tracking.mlflow_uri) and the database (tracking.db_url).")


class SweepRequest(Request):
    space: str = Field("experiments/sweep_policy.yaml", description="Sweep space (YAML with a top-level `space:`).")
    trials: int = Field(16, ge=1, description="Trials to add to the study.")
    real: bool = Field(False, description="Real training runs instead of the simulator.")
    overrides: list[str] = Field(default_factory=list,
                                 description="key.path=value overrides of the sweep's base config "
                                             "(e.g. tracking.db_url).")
    storage: str | None = Field(None, description="Optuna storage URL; default: $TIDAL_OPTUNA_STORAGE, else "
                                                  "tracking.db_url (the platform database).")


class BenchmarkRequest(Request):
    workload: str = Field("rlinf-example", description="`rlinf-example` (RLinf's 8-GPU workload) or a config path.")
    policies: list[str] = Field(default_factory=lambda: ["static", "rlinf", "tidal"],
                                description="Scheduler policies to compare.")
    devices: int | None = Field(None, ge=4, description="Scale the placement to N devices (simulator).")
    steps: int = Field(5, ge=1, description="RL steps per policy.")
    seed: int = Field(0, description="Workload seed (simulator).")
    real: bool = Field(False, description="Also run each policy for real (an rl-training subflow each; the "
                                          "workload must then be a config path).")
    overrides: list[str] = Field(default_factory=list, description="Overrides for the real runs.")
    json_path: str | None = Field(None, description="Write the comparison as JSON here.")
