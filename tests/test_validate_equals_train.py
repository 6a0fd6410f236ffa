"""`tidal validate` runs every check `tidal train` makes before a worker starts (tidal/pipeline/preflight.py):
for each config train refuses, validate refuses it with the same message, and neither starts a worker."""

import os

import pytest

from tidal.cli.main import main

pytestmark = pytest.mark.usefixtures("shared_ray")

CONFIG = "experiments/addition_dynamic.yaml"
CASES = {
    "rollout TP 2": (["rollout.tensor_parallel_size=2"], "rollout.tensor_parallel_size"),
    "unknown task": (["data.task=adition"], "data.task"),
    "unsupported database": (["tracking.db_url=mongodb://u:pw@127.0.0.1/x"], "tracking.db_url"),
    "database folder missing": (["tracking.db_url=sqlite:////nonexistent/dir/tidal.db"], "tracking.db_url"),
    "cores the machine lacks": ([f"cluster.cpu_device_cores=0-{(os.cpu_count() or 1) + 7}"],
                                "cluster.cpu_device_cores"),
    "cuda without GPUs": (["cluster.device=cuda"], "cluster.device"),
    "beta of 1.5": (["actor.betas=[0.9, 1.5]"], "actor.betas"),
    "NUL in the run name": (["run.name=a\x00b"], "run.name"),
    "run name leaving output_dir": (["run.name=../elsewhere"], "run.name"),
    "shared placement": (["cluster.component_placement={actor,rollout,inference: 0-7}"], "cluster.component_placement"),
    "missing model": (["model.path=/nonexistent/model"], "model.path"),
    "host copy folder missing": (["actor.redundancy=host", "actor.redundancy_dir=/nonexistent/shm"],
                                 "actor.redundancy_dir"),
    "host copy without restarts": (["actor.redundancy=host", "run.max_restarts=0"], "actor.redundancy"),
    # keys the pipeline would ignore or fail on mid-run
    "vLLM rollout": (["rollout.backend=vllm"], "rollout.backend"),
    "KL to a reference": (["algorithm.kl_coef=0.01"], "algorithm.kl_coef"),
    "log-prob micro-batch size": (["inference.micro_batch_size=16"], "inference.micro_batch_size"),
}


@pytest.mark.parametrize("overrides, field", CASES.values(), ids=CASES.keys())
def test_validate_refuses_what_train_refuses(tmp_path, capsys, overrides, field):
    if field == "cluster.device":
        import torch
        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
    out = [f"run.output_dir={tmp_path}", f"tracking.mlflow_uri=sqlite:///{tmp_path}/mlruns.db"]
    db = [] if field == "tracking.db_url" else [f"tracking.db_url=sqlite:///{tmp_path}/tidal.db"]
    assert main(["validate", CONFIG, *overrides, *out, *db]) == 2
    said_validate = capsys.readouterr().err
    assert main(["train", CONFIG, *overrides, *out, *db]) == 2
    said_train = capsys.readouterr().err
    assert field in said_validate, said_validate
    assert said_validate.strip().splitlines()[-1] == said_train.strip().splitlines()[-1]
    assert not any(tmp_path.glob("addition-dynamic-*")), "train made a run folder for a config it refuses"


def test_a_host_copy_folder_without_room_for_two_copies_is_refused(tmp_path):
    """`actor.redundancy: host` needs room for two generations of the state (the new one lands before the old one
    goes): a model far larger than any disk is refused naming the folder's key, before anything is written."""
    from tidal.core.config import build_config
    from tidal.core.errors import ConfigError
    from tidal.pipeline.preflight import CHECKPOINT_BYTES_PER_PARAM, check_host_copy

    cfg = build_config({"actor": {"redundancy": "host", "redundancy_dir": str(tmp_path)}})
    assert check_host_copy(cfg, 1000) == tmp_path
    with pytest.raises(ConfigError) as err:
        check_host_copy(cfg, 10**18 // CHECKPOINT_BYTES_PER_PARAM)
    assert err.value.field == "actor.redundancy_dir" and "--shm-size" in err.value.fix, err.value
    assert list(tmp_path.iterdir()) == []
