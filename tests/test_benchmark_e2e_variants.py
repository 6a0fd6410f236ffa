"""benchmarks/e2e.py policy variants: `tidal+KEY=VALUE` runs tidal with scheduler.* keys overridden."""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from tidal.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def e2e():
    spec = importlib.util.spec_from_file_location("bench_e2e", ROOT / "benchmarks" / "e2e.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def args(**kw):
    base = dict(steps=3, seed=0, share=0.125, share_period_ms=50.0, device_cores="1", max_running=16,
                prompts=32, group_size=8, max_new_tokens=48, hidden=128, layers=4, intermediate=384)
    return argparse.Namespace(**{**base, **kw})


def test_variant_overrides_scheduler_keys(e2e, tmp_path):
    assert e2e.parse_variant("tidal") == ("tidal", {})
    assert e2e.parse_variant("tidal+grow_on_return=false+margin_s=0.25") == (
        "tidal", {"grow_on_return": "false", "margin_s": "0.25"})
    cfg = e2e.build("tidal+grow_on_return=false+margin_s=0.25", args(), tmp_path)
    assert (cfg.scheduler.policy, cfg.scheduler.grow_on_return, cfg.scheduler.margin_s) == ("tidal", False, 0.25)
    assert cfg.run.name == "e2e-tidal_grow_on_return-false_margin_s-0.25"
    plain = e2e.build("tidal", args(), tmp_path)
    assert (plain.scheduler.grow_on_return, plain.scheduler.margin_s, plain.scheduler.margin_frac,
            plain.cluster.auto_scheduler) == (True, 0.0, 0.01, True)
    assert not e2e.build("static", args(), tmp_path).cluster.auto_scheduler


def test_bad_variants_name_the_fix(e2e, tmp_path):
    with pytest.raises(SystemExit, match="not KEY=VALUE"):
        e2e.parse_variant("tidal+grow_on_return")
    with pytest.raises(ConfigError, match="scheduler.margin_s"):
        e2e.build("tidal+margin_s=-1", args(), tmp_path)
    with pytest.raises(ConfigError, match="scheduler.no_such_key"):
        e2e.build("tidal+no_such_key=1", args(), tmp_path)


def test_variant_dotted_key_overrides_another_section(e2e, tmp_path):
    cfg = e2e.build("static+rollout.slices_ahead=1", args(), tmp_path)
    assert (cfg.rollout.slices_ahead, cfg.cluster.auto_scheduler) == (1, False)
    assert e2e.build("tidal", args(), tmp_path).rollout.slices_ahead == 2
    with pytest.raises(ConfigError, match="rollout.slices_ahead"):
        e2e.build("tidal+rollout.slices_ahead=0", args(), tmp_path)


def test_a_hugging_face_checkpoint_on_gpus_is_the_same_script(e2e, tmp_path):
    """`--model` / `--device cuda`: the checkpoint and data files through model.path and data.train_files, the
    parity reward, no CPU share keys; the placement and policies as on CPU."""
    from conftest import make_gsm8k_files, make_hf_checkpoint
    ckpt = make_hf_checkpoint(tmp_path / "ckpt", "qwen2")
    train, val = make_gsm8k_files(tmp_path / "data")
    a = args(device="cuda", gpu_memory_utilization=0.8, inputs=(ckpt, train, val))
    cfg = e2e.build("tidal", a, tmp_path)
    assert (cfg.model.path, cfg.data.train_files, cfg.cluster.device) == (str(ckpt), [str(train)], "cuda")
    assert cfg.reward.function == e2e.hf_inputs.PARITY_REWARD and cfg.rollout.gpu_memory_utilization == 0.8
    assert cfg.cluster.component_placement == {"actor": "0-1", "rollout": "2-5", "inference": "6-7"}
    assert e2e.build("collocated", a, tmp_path).cluster.component_placement == {"actor,rollout,inference": "0-7"}
