"""Config loading and placement validation: table-driven cases and a property test (no tracebacks, ever)."""

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidal.cli.main import main
from tidal.core.config import build_config, load_config
from tidal.core.errors import ConfigError
from tidal.core.placement import Mode, parse_device_ids

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def _cluster(placement, **kw):
    return {"cluster": {"component_placement": placement, **kw}}


@pytest.mark.parametrize("spec, ids", [
    ("0-3", (0, 1, 2, 3)), ("0-1,4-5", (0, 1, 4, 5)), (5, (5,)), ("6,7", (6, 7)), ("2", (2,)), (" 1 - 2 ", (1, 2)),
])
def test_device_ids_parse(spec, ids):
    assert parse_device_ids(spec, "f") == ids


@pytest.mark.parametrize("spec, needle", [
    ("3-1", "runs backwards"), ("a-b", "not an id"), ("0-1,,2", "empty entry"), ("0,0", "twice"),
    (True, "not a device list"), ([0, 1], "not a device list"), ("-1", "not an id"),
])
def test_device_ids_errors(spec, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_device_ids(spec, "cluster.component_placement.actor")


RLINF = {"actor": "0-1", "rollout": "2-5", "inference": "6-7"}


@pytest.mark.parametrize("placement, extra, mode", [
    (RLINF, {"auto_scheduler": True}, Mode.AUTO),                                     # RLinf's dynamic example
    (RLINF, {"auto_scheduler": True, "use_pre_process_policy": True}, Mode.AUTO),     # its pre-process variant
    (RLINF, {}, Mode.DISAGGREGATED),
    ({"actor,rollout,inference": "0-7"}, {}, Mode.COLLOCATED),
    ({"actor,rollout": "0-5", "inference": "6-7"}, {}, Mode.HYBRID),
    ({"actor": "0-3", "rollout": "4-5", "inference": "6,7"}, {"auto_scheduler": True}, Mode.AUTO),
])
def test_placement_modes(placement, extra, mode):
    cfg = build_config(_cluster(placement, **extra))
    assert cfg.placement.mode is mode
    assert set(cfg.placement.owners()) == set(range(8))


@pytest.mark.parametrize("data, field, needle", [
    (_cluster({**RLINF, "actor": "0-2"}), "cluster.component_placement.rollout", "also placed by entry 'actor'"),
    (_cluster({"actor,rollout": "0-5", "inference": "5-7"}), "cluster.component_placement.inference", "also placed"),
    (_cluster({**RLINF, "inference": "6-8"}), "cluster.component_placement.inference", "beyond"),
    (_cluster({"actor": "2-3", "rollout": "0-1,4-5", "inference": "6-7"}, auto_scheduler=True),
     "cluster.component_placement", "actor -> rollout -> inference"),
    (_cluster({"actor": "0-1", "inference": "2-5", "rollout": "6-7"}, auto_scheduler=True),
     "cluster.component_placement", "actor -> rollout -> inference"),
    (_cluster({**RLINF, "critic": "0-1"}, auto_scheduler=True), "cluster.component_placement.critic", "falls back"),
    (_cluster({"actro": "0-1", "rollout": "2-5", "inference": "6-7"}), "cluster.component_placement.actro",
     "did you mean 'actor'"),
    (_cluster({"actor": "0-1", "rollout": "2-5"}), "cluster.component_placement", "no placement for inference"),
    (_cluster({"actor,rollout,inference": "0-7"}, auto_scheduler=True), "cluster.component_placement", "exactly one"),
    ({"cluster": {"auto_schedulr": True}}, "cluster.auto_schedulr", "did you mean 'cluster.auto_scheduler'"),
    ({"actor": {"tensor_parallel_size": 4}}, "actor.tensor_parallel_size", "does not divide"),
    ({"actor": {"tensor_parallel_size": 0}}, "actor.tensor_parallel_size", "greater than or equal"),
    ({"rollout": {"tensor_parallel_size": 3}}, "rollout.tensor_parallel_size", "does not divide"),
    ({"algorithm": {"n_minibatches": 3}}, "algorithm.n_minibatches", "does not divide"),
    ({"model": {"num_heads": 3}}, "model", "multiple"),
    ({"cluster": {"use_pre_process_policy": True}}, "cluster.use_pre_process_policy", "auto_scheduler"),
    ({"cluster": {"num_nodes": "two"}}, "cluster.num_nodes", "integer"),
    ({"rollout": {"max_new_tokens": 64}}, "rollout.max_new_tokens", "max_seq_len"),
    ({"cluster": 3}, "cluster", "mapping"),
    ([1, 2], "<config>", "mapping"),
])
def test_bad_configs_name_field_and_fix(data, field, needle):
    with pytest.raises(ConfigError) as info:
        build_config(data)
    err = info.value
    assert err.field == field
    assert err.fix
    import re
    assert re.search(needle, str(err)), str(err)


def test_flags_default_once():
    cfg = build_config(_cluster(RLINF, auto_scheduler=True))
    assert cfg.cluster.use_pre_process_policy is False
    assert cfg.cluster.use_wait_before_last_iter_policy is False


def test_overrides_apply_and_are_validated():
    cfg = build_config({}, ["actor.lr=3e-4", "cluster.component_placement.actor=0-1"])
    assert cfg.actor.lr == 3e-4
    with pytest.raises(ConfigError, match="key.path=value"):
        build_config({}, ["actor.lr"])


@pytest.mark.parametrize("path", sorted(EXPERIMENTS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_experiments_validate(path, tmp_path):
    data = yaml.safe_load(path.read_text())
    if "space" in data:  # sweep spaces are checked by the sweep tests
        pytest.skip("sweep space")
    overrides = []
    if str(data.get("model", {}).get("path", "")).startswith("runs/"):
        # The checkpoint and files are made by a documented command (tidal warm-start); stand-ins of the same
        # layout take their place so that validation sees everything else of the shipped file.
        from conftest import make_gsm8k_files, make_hf_checkpoint
        ckpt = make_hf_checkpoint(tmp_path / "ckpt", "llama")
        train, val = make_gsm8k_files(tmp_path / "data")
        overrides = [f"model.path={ckpt}", f"data.train_files=[{train}]", f"data.val_files=[{val}]"]
    assert main(["validate", str(path), *overrides]) == 0


def test_cli_bad_config_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster:\n  component_placement:\n    actor: 3-1\n")
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "cluster.component_placement.actor" in err and "Fix:" in err
    bad.write_text("cluster: [unclosed\n")
    assert main(["validate", str(bad)]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    assert main(["validate", str(tmp_path / "missing.yaml")]) == 2


# ---- property test: random YAML never produces a traceback --------------------------------------------------
_keys = st.sampled_from(["cluster", "actor", "rollout", "model", "algorithm", "data", "run", "scheduler",
                         "component_placement", "auto_scheduler", "tensor_parallel_size", "num_nodes",
                         "actor,rollout", "inference", "n_minibatches", "x", "0-3", "critic"])
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 20), st.floats(allow_nan=True),
                     st.text(max_size=8), st.sampled_from(["0-3", "3-1", "a-b", "0-1,4-5", "6,7", "-", ","]))
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(_keys, inner, max_size=4)), max_leaves=12)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_values, st.dictionaries(_keys, _values, max_size=5)))
def test_random_configs_never_traceback(data):
    try:
        build_config(data)
    except ConfigError as err:
        assert err.field and err.fix


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=60))
def test_random_yaml_text_never_traceback(text):
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(text)
    try:
        load_config(f.name)
    except ConfigError as err:
        assert err.field and err.fix
    finally:
        Path(f.name).unlink()


def test_rlinf_cluster_section_is_accepted_verbatim():
    """RLinf's `cluster:` keys as RLinf spells them: `num_gpus_per_node` and the placement value `all`."""
    cfg = build_config({"cluster": {"num_nodes": 1, "num_gpus_per_node": 4,
                                    "component_placement": {"actor,rollout,inference": "all"}}})
    assert cfg.cluster.num_devices == 4 and cfg.placement.actor == (0, 1, 2, 3)
    with pytest.raises(ConfigError, match="num_gpus_per_node=4 contradicts num_devices_per_node=8"):
        build_config({"cluster": {"num_gpus_per_node": 4, "num_devices_per_node": 8}})


def test_model_path_and_architecture_keys_are_exclusive():
    with pytest.raises(ConfigError, match="model.hidden_size.*contradicts model.path"):
        build_config({"model": {"path": "/models/qwen", "hidden_size": 64}})
    with pytest.raises(ConfigError, match="data.val_files"):
        build_config({"model": {"path": "/m"}, "data": {"train_files": ["t.jsonl"]}})
    with pytest.raises(ConfigError, match="data.train_files.*needs model.path"):
        build_config({"data": {"train_files": ["t.jsonl"], "val_files": ["v.jsonl"]}})
    with pytest.raises(ConfigError, match="data.max_response_length.*contradicts rollout.max_new_tokens"):
        build_config({"data": {"max_response_length": 32}, "rollout": {"max_new_tokens": 16}})
    cfg = build_config({"model": {"path": "/m"}, "data": {"train_files": ["t.jsonl"], "val_files": ["v.jsonl"],
                                                          "max_prompt_length": 100, "max_response_length": 28}})
    assert cfg.max_seq_len == 128 and cfg.response_length == 28


@pytest.mark.parametrize("override", [
    "actor.lr=.inf", "actor.lr=inf", "actor.eps=nan", "actor.weight_decay=inf", "actor.betas=[nan,0.999]",
    "rollout.temperature=inf", "model.rope_theta=inf", "algorithm.clip_eps=inf", "scheduler.margin_s=inf",
    "actor.betas=[0.9,-.inf]"])
def test_non_finite_numbers_are_refused_naming_the_field(override):
    """An infinite learning rate would train to NaN weights without a single error: every number is finite."""
    field = override.split("=")[0]
    with pytest.raises(ConfigError, match="finite number") as e:
        build_config({}, [override])
    assert e.value.field.startswith(field), (e.value.field, field)
