"""What a flow run is asked to do: typed, validated parameters (the Prefect UI renders each as a form).

A run is a config file plus a few `key.path=value` overrides, exactly as on the command line; the settings people
change most are typed fields of their own (None: the config's value), applied as overrides after the list::

    rl-training   TrainingRequest(config="experiments/rlinf_dynamic.yaml", overrides=["run.num_steps=2"])
                  TrainingRequest(config="experiments/rlinf_dynamic.yaml", resume_from="runs/<run>/checkpoints")
                  TrainingRequest(config="experiments/addition_dynamic.yaml", policy="rlinf", num_steps=2)
                      -> overrides ["scheduler.policy=rlinf", "run.num_steps=2"]
    policy-sweep  SweepRequest(space="experiments/sweep_policy.yaml", trials=16)
    benchmark     BenchmarkRequest(workload="rlinf-example", policies=["static", "rlinf", "tidal"])

Paths are resolved by the process that runs the flow (`tidal serve` runs it in the directory it was started in).
Types and ranges are the schema the Prefect server checks a request against when it is made; a field that
disagrees with an override fails the model's validation.

An optional field (default None: "as the config says") is a plain property in the JSON schema, its type and its
range and no `anyOf [X, null]` and no default (`Request._plain_optional_fields`): Prefect's form shows a plain
input instead of a type switch, an empty input leaves the field out, and a bad value reads
`0 is less than the minimum of 1` under the field's name. Prefect's server reads a property without a default as
optional and lets null through. So that a request never sends the null back, an unset field is absent from the
request's serialised form (the default the form starts from, the parameters Prefect stores), and an empty string
is an unset field (what a cleared text input sends). Deeper checks (does the file exist, is every key known,
does a field act on this config: `TrainingRequest.check_against`) happen when the flow loads the config, before
anything is made, and fail with a `TidalError` naming the field, the value and the fix.
"""

from __future__ import annotations

from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from tidal.core.bounded_yaml import MAX_VALUE_BYTES, load_yaml
from tidal.core.config import MAX_SEED, TidalConfig
from tidal.core.errors import ConfigError
from tidal.core.secrets import redact

#: scheduler.policy's values (tests/test_flows.py checks they are the config's)
PolicyName = Literal["tidal", "rlinf", "static"]
#: num_steps' upper bound (the form's maximum)
MAX_STEPS = 1 << 24
#: TrainingRequest field -> the config key it sets
TRAINING_FIELD_KEYS = {"policy": "scheduler.policy", "auto_scheduler": "cluster.auto_scheduler",
                       "use_pre_process_policy": "cluster.use_pre_process_policy",
                       "use_wait_before_last_iter_policy": "cluster.use_wait_before_last_iter_policy",
                       "num_steps": "run.num_steps", "seed": "run.seed"}

CREDENTIALS_FIX = ("set it in the flow worker's environment instead (TIDAL_DB_URL, MLFLOW_TRACKING_URI, "
                   "TIDAL_OPTUNA_STORAGE), which the run reads and Prefect does not store")


def _plain_optional_fields(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """JSON schema of a request: each field whose default is None loses its `anyOf [X, null]` and its default.

        int | None (ge=1)        -> {"type": "integer", "minimum": 1}     a number input; empty sends nothing
        str | None               -> {"type": "string"}                    a text input
        Literal["a", "b"] | None -> {"enum": ["a", "b", null]}            a select, left empty it sends null
        bool | None              -> {"enum": [true, false, null]}         a select, not a toggle: a toggle sends
                                                                          false untouched, overriding the config

    Prefect's form renders an anyOf as a type switch and reports a constraint broken inside one as "not valid
    under any of the given schemas"; a plain property is one input and its error names the constraint. Prefect's
    server reads a typed property without a default as optional (null passes); an enum says so itself."""
    for name, prop in schema.get("properties", {}).items():
        field = model.model_fields.get(name)
        if field is None or field.default is not None:
            continue
        prop.pop("default", None)
        branches = prop.pop("anyOf", None)
        if branches is None:
            continue
        (plain,) = [b for b in branches if b != {"type": "null"}]   # X | None: one branch besides null
        if plain.get("type") == "boolean":
            plain = {"enum": [True, False]}
        if "enum" in plain:
            plain = {"enum": [*plain["enum"], None]}
        prop.update(plain)


class Request(BaseModel):
    """Parameters of a flow run. Prefect stores them in its database and shows them in its UI, so none may hold
    a credential: a password in a URL is refused here, naming the parameter (its value masked).

    Invariant: a field whose default is None is unset when None, and an unset field is absent from the JSON
    schema's defaults and from the serialised request (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=_plain_optional_fields)

    @field_validator("*", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object, info: ValidationInfo) -> object:
        """A cleared text input sends "": for an optional field that is the field unset."""
        field = cls.model_fields[info.field_name] if info.field_name else None
        return None if value == "" and field is not None and field.default is None else value

    @model_serializer(mode="wrap")
    def _unset_fields_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}

    @field_validator("*")
    @classmethod
    def _no_credentials(cls, value: object, info: ValidationInfo) -> object:
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and redact(item) != item:
                raise ConfigError(str(info.field_name), redact(item), "holds a credential, and Prefect stores flow "
                                  "parameters in its database", CREDENTIALS_FIX)
        return value


def _sets(key: str) -> str:
    """How a typed field's description ends: the config key it sets, that empty takes the config's value, and what
    that is in a config without the key (TidalConfig's default, read from the config's own fields)."""
    model: type[BaseModel] = TidalConfig
    *sections, leaf = key.split(".")
    for section in sections:
        model = model.model_fields[section].annotation   # type: ignore[assignment]   # a section is a model
    default = _yaml_value(model.model_fields[leaf].default)
    return f"Sets {key}. Empty: the config's {key} (without one: {default})."


def _config_value(cfg: TidalConfig, key: str) -> object:
    node: object = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _yaml_value(value: object) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _override_value(key: str, raw: str) -> object:
    """An override's value as the config reads it (YAML: `True`, `true` and `yes` are one boolean)."""
    try:
        return load_yaml(raw, key, MAX_VALUE_BYTES) if raw.strip() else None
    except yaml.YAMLError:
        return raw


class TrainingRequest(Request):
    """One training run: a config, the typed settings people change most (each None: the config's value), and any
    other `key.path=value` overrides. A field and an override of the same key with different values is an error
    naming both (`config_overrides`)."""

    config: str = Field("experiments/rlinf_dynamic.yaml",
                        description="Experiment config (YAML path, relative to where the flow runs).")
    policy: PolicyName | None = Field(
        None, description="Device reallocation policy: tidal, rlinf or static; it acts only with auto_scheduler on. "
                          + _sets("scheduler.policy"))
    auto_scheduler: bool | None = Field(
        None, description="Dynamic scheduling: devices move between actor, rollout and inference while the run "
                          "trains; needs a disjoint placement. " + _sets("cluster.auto_scheduler"))
    use_pre_process_policy: bool | None = Field(
        None, description="RLinf flag, read by the rlinf policy: at step start the actor's devices also generate. "
                          "Needs auto_scheduler. " + _sets("cluster.use_pre_process_policy"))
    use_wait_before_last_iter_policy: bool | None = Field(
        None, description="RLinf flag, read by the rlinf policy: before the last iter the actor waits for rollout "
                          "and inference, then grows onto their devices. Needs auto_scheduler. "
                          + _sets("cluster.use_wait_before_last_iter_policy"))
    num_steps: int | None = Field(None, ge=1, le=MAX_STEPS, description=f"RL steps, 1 to {MAX_STEPS}. "
                                                                         + _sets("run.num_steps"))
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description=f"Seed of the model init and of sampling, 0 to "
                                                                  f"{MAX_SEED}. " + _sets("run.seed"))
    overrides: list[str] = Field(default_factory=list,
                                 description="Other key.path=value overrides, e.g. actor.lr=3e-4 data.eval_size=64 "
                                             "(a key a field above also sets must agree with it).")
    track: bool = Field(True, description="Log to MLflow (tracking.mlflow_uri) and the database (tracking.db_url).")
    resume_from: str | None = Field(
        None, description="Resume from this checkpoint folder (a run's <run folder>/checkpoints: its newest complete "
                          "generation; the placement may differ), a path where the flow runs. The run goes on at the "
                          "step the checkpoint names; it must be of this model and leave steps to train, checked "
                          "before any worker starts. Empty: start at step 0.")

    @model_validator(mode="after")
    def _fields_agree_with_overrides(self) -> TrainingRequest:
        self.config_overrides()
        return self

    def field_overrides(self) -> list[str]:
        """One `key=value` per field that is set, in the form's order."""
        return [f"{key}={_yaml_value(getattr(self, name))}" for name, key in TRAINING_FIELD_KEYS.items()
                if getattr(self, name) is not None]

    def config_overrides(self) -> list[str]:
        """What the flow applies on top of the config: the overrides list, then the fields (so a field wins over
        anything before it, e.g. the worker's environment). An override that sets a field's key to another value
        is a ConfigError naming both."""
        fields = {key: name for name, key in TRAINING_FIELD_KEYS.items() if getattr(self, name) is not None}
        for ov in self.overrides:
            key, _, raw = ov.partition("=")
            name = fields.get(key.strip())
            if name is not None and _override_value(key.strip(), raw) != getattr(self, name):
                raise ConfigError(name, getattr(self, name), f"conflicts with the override {ov!r}: both set "
                                  f"{key.strip()}", f"keep one: clear the field {name}, or drop {ov!r} from overrides")
        return [*self.overrides, *self.field_overrides()]

    def effective(self, cfg: TidalConfig) -> list[str]:
        """What the run does for each typed field, and who said so: `num_steps: 3 (form)`, `seed: 0 (config)`,
        `policy: rlinf (override)`. `cfg` is the config this request loaded (`config_overrides()` applied), so the
        value is the run's own; the source is the field if it is set, else an override of its key, else the config
        (with the worker's environment and TidalConfig's defaults under it). For the flow run's log, at its start."""
        overridden = {ov.partition("=")[0].strip() for ov in self.overrides}
        lines = []
        for name, key in TRAINING_FIELD_KEYS.items():
            source = ("form" if getattr(self, name) is not None else "override" if key in overridden else "config")
            lines.append(f"{name}: {_yaml_value(_config_value(cfg, key))} ({source})")
        return lines

    def check_against(self, cfg: TidalConfig) -> None:
        """Fields that would do nothing with this config are errors, not silence: a moving policy on a static
        run (cluster.auto_scheduler off)."""
        if self.policy in ("tidal", "rlinf") and not cfg.cluster.auto_scheduler:
            raise ConfigError("policy", self.policy, "acts only with dynamic scheduling, and this run's "
                              "cluster.auto_scheduler is off", "set auto_scheduler: true (a disjoint placement), "
                              "or leave policy empty")


class SweepRequest(Request):
    space: str = Field("experiments/sweep_policy.yaml", description="Sweep space (YAML with a top-level `space:`).")
    trials: int = Field(16, ge=1, description="Trials to add to the study, at least 1.")
    real: bool = Field(False, description="Real training runs instead of the simulator.")
    overrides: list[str] = Field(default_factory=list,
                                 description="key.path=value overrides of the sweep's base config "
                                             "(e.g. tracking.db_url).")
    storage: str | None = Field(None, description="Optuna storage URL. Empty: $TIDAL_OPTUNA_STORAGE, else "
                                                  "tracking.db_url (the platform database).")


class BenchmarkRequest(Request):
    workload: str = Field("rlinf-example", description="`rlinf-example` (RLinf's 8-GPU workload) or a config path.")
    policies: list[str] = Field(default_factory=lambda: ["static", "rlinf", "tidal"],
                                description="Scheduler policies to compare.")
    devices: int | None = Field(None, ge=4, description="Scale the placement to N devices (simulator), at least 4. "
                                                        "Empty: the workload's own placement.")
    steps: int = Field(5, ge=1, description="RL steps per policy, at least 1.")
    seed: int = Field(0, description="Workload seed (simulator).")
    real: bool = Field(False, description="Also run each policy for real (an rl-training subflow each; the "
                                          "workload must then be a config path).")
    overrides: list[str] = Field(default_factory=list, description="Overrides for the real runs.")
    json_path: str | None = Field(None, description="Write the comparison as JSON here. Empty: no file.")
