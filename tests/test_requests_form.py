"""The flows' parameter forms as Prefect renders and checks them: each optional field a plain property (no
`anyOf [X, null]` type switch), a bad value refused with a message naming the field and the constraint, an
untouched form accepted as "the config's values", and what a run does for each typed field with who set it."""

from __future__ import annotations

from pathlib import Path

import pytest
from prefect.utilities.callables import parameter_schema
from prefect.utilities.schema_tools.validation import ValidationError as PrefectValidationError
from prefect.utilities.schema_tools.validation import build_error_obj, preprocess_schema, validate
from pydantic import ValidationError

from flows.benchmark import benchmark
from flows.policy_sweep import policy_sweep
from flows.rl_training import rl_training
from tasks.requests import MAX_STEPS, TRAINING_FIELD_KEYS, BenchmarkRequest, SweepRequest, TrainingRequest
from tidal.pipeline.tracked_run import load_run_config

REPO = Path(__file__).resolve().parents[1]
FLOWS = {"TrainingRequest": rl_training, "SweepRequest": policy_sweep, "BenchmarkRequest": benchmark}


def _form(flow) -> dict:
    """The deployment's parameter schema, as `tidal serve` registers it."""
    return parameter_schema(flow).model_dump_for_openapi()


def _ui_errors(flow, request: dict) -> dict:
    """What the form shows for `request`: the server's `/ui/schemas/validate` answer, computed as it computes it."""
    return build_error_obj(validate({"request": request}, preprocess_schema(_form(flow))))


@pytest.mark.parametrize("name", list(FLOWS))
def test_no_field_is_a_type_switch_and_the_form_starts_without_nulls(name):
    schema = _form(FLOWS[name])
    props = schema["definitions"][name]["properties"]
    assert not [k for k, p in props.items() if "anyOf" in p or "oneOf" in p]
    model = {"TrainingRequest": TrainingRequest, "SweepRequest": SweepRequest, "BenchmarkRequest": BenchmarkRequest}
    optional = [f for f, info in model[name].model_fields.items() if info.default is None]
    assert optional and not [f for f in optional if "default" in props[f]]   # empty: nothing to prefill
    assert None not in schema["properties"]["request"]["default"].values()


def test_typed_training_fields_are_plain_inputs_with_their_range_and_their_config_key():
    props = TrainingRequest.model_json_schema()["properties"]
    assert _form(rl_training)["definitions"]["TrainingRequest"]["properties"] == props   # Prefect keeps the model's
    assert {k: v for k, v in props["num_steps"].items() if k != "description"} == {
        "type": "integer", "minimum": 1, "maximum": MAX_STEPS, "title": "Num Steps"}
    assert props["seed"]["type"] == "integer" and props["seed"]["minimum"] == 0
    assert props["policy"]["enum"] == ["tidal", "rlinf", "static", None]   # a select; left empty it sends null
    for flag in ("auto_scheduler", "use_pre_process_policy", "use_wait_before_last_iter_policy"):
        assert props[flag]["enum"] == [True, False, None] and "type" not in props[flag]   # a select, not a toggle
    for field, key in TRAINING_FIELD_KEYS.items():
        assert f"Sets {key}. Empty: the config's {key} (without one: " in props[field]["description"], field
    assert "1 to 16777216" in props["num_steps"]["description"]


@pytest.mark.parametrize("request_, field, words", [
    ({"num_steps": 0}, "num_steps", "0 is less than the minimum of 1"),
    ({"seed": -1}, "seed", "-1 is less than the minimum of 0"),
    ({"policy": "rlinx"}, "policy", "'rlinx' is not one of ['tidal', 'rlinf', 'static', None]"),
    ({"auto_scheduler": "maybe"}, "auto_scheduler", "'maybe' is not one of [True, False, None]"),
])
def test_a_bad_value_is_refused_naming_the_field_and_the_constraint(request_, field, words):
    # the form, under the field
    assert _ui_errors(rl_training, request_)["errors"] == [
        {"property": "request", "errors": [{"property": field, "errors": [words]}]}]
    # the server, when the run is asked for (`enforce_parameter_schema`: a 409 with this text)
    with pytest.raises(PrefectValidationError) as e:
        validate({"request": request_}, _form(rl_training), raise_on_error=True)
    assert str(e.value) == f"Validation failed for field 'request.{field}'. Failure reason: {words}"
    # a flow called in Python
    with pytest.raises(ValidationError, match=field):
        TrainingRequest(**request_)


def test_sweep_and_benchmark_forms_name_the_field_too():
    assert _ui_errors(policy_sweep, {"trials": 0})["errors"][0]["errors"] == [
        {"property": "trials", "errors": ["0 is less than the minimum of 1"]}]
    assert _ui_errors(benchmark, {"devices": 2})["errors"][0]["errors"] == [
        {"property": "devices", "errors": ["2 is less than the minimum of 4"]}]


def test_an_untouched_form_is_the_configs_values():
    """What the form sends left empty: null for a select, nothing (or "") for an input; all mean unset."""
    untouched = {"config": "x.yaml", "policy": None, "auto_scheduler": None, "use_pre_process_policy": None,
                 "use_wait_before_last_iter_policy": None, "overrides": [], "track": True}
    assert _ui_errors(rl_training, untouched) == {"errors": [], "valid": True}
    req = TrainingRequest(**untouched, num_steps=None, seed=None)
    assert req.config_overrides() == [] and req == TrainingRequest(config="x.yaml", policy="")
    assert SweepRequest(storage="").storage is None and BenchmarkRequest(json_path="").json_path is None
    # an unset field is absent from what Prefect stores, and the stored form reads back as the same request
    dumped = TrainingRequest(config="x.yaml", num_steps=2).model_dump(mode="json")
    assert dumped == {"config": "x.yaml", "num_steps": 2, "overrides": [], "track": True}
    assert TrainingRequest(**dumped) == TrainingRequest(config="x.yaml", num_steps=2)
    assert _ui_errors(rl_training, dumped)["valid"]


def test_effective_says_what_the_run_does_for_each_field_and_who_set_it():
    req = TrainingRequest(config=str(REPO / "experiments/addition_dynamic.yaml"), num_steps=3,
                          overrides=["scheduler.policy=static"])
    cfg = load_run_config(req.config, req.config_overrides())
    lines = req.effective(cfg)
    assert len(lines) == len(TRAINING_FIELD_KEYS)
    assert "num_steps: 3 (form)" in lines and "policy: static (override)" in lines
    assert f"seed: {cfg.run.seed} (config)" in lines
    assert f"auto_scheduler: {'true' if cfg.cluster.auto_scheduler else 'false'} (config)" in lines
