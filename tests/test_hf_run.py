"""A user's run: a Hugging Face checkpoint and GSM8K-format files in, a Hugging Face model out.

Bad input is an error naming the field before any worker starts (nothing written); a short run on real workers
exports `hf/step-N` that `transformers` loads with logits equal to the trained weights; a resumed run reads exactly
the prompts an uninterrupted one reads (the data position is in the checkpoint).
"""

from __future__ import annotations

import json

import pytest
import torch

from tidal.core.config import build_config
from tidal.core.errors import TidalError
from tidal.engine.datasets import DataPosition
from tidal.pipeline.inputs import read_inputs
from tidal.pipeline.run import TrainingRun

pytestmark = pytest.mark.usefixtures("shared_ray")

BASE = {
    "run": {"num_steps": 1, "seed": 1},
    "cluster": {"num_devices_per_node": 3, "component_placement": {"actor": "0", "rollout": "1", "inference": "2"}},
    "actor": {"micro_batch_size": 8, "lr": 1e-3, "warmup_iters": 0},
    "rollout": {"max_new_tokens": 8, "max_running_requests": 16},
    "algorithm": {"group_size": 4, "n_minibatches": 2},
    "data": {"rollout_batch_size": 8, "eval_size": 8},
}


def _cfg(tmp_path, overrides):
    return build_config(BASE, [f"run.output_dir={tmp_path}", *overrides])


def test_inputs_render_filter_and_label_the_prompts(tmp_path, hf_run_inputs):
    cfg = _cfg(tmp_path, hf_run_inputs("qwen2") + ["data.max_prompt_length=16"])
    inputs = read_inputs(cfg)
    assert inputs.hf.architecture == "Qwen2ForCausalLM" and inputs.args.qkv_bias
    assert inputs.reward == "gsm8k" and inputs.vocab_limit == inputs.tok.vocab_size < inputs.args.vocab_size
    summary = inputs.source.summary()
    assert summary["train"]["kept"] + summary["train"]["too_long"] == 64
    assert summary["train"]["longest_kept"] <= 16
    items, pos = inputs.source.take(8, DataPosition())
    ids, label = items[0]
    assert inputs.tok.hf.decode(list(ids)).startswith("<|im_start|>user\n")   # the chat template was applied
    assert label.answer.startswith("The sum is #### ") and label.uid.startswith("train:")
    assert pos == DataPosition(0, 8)


@pytest.mark.parametrize("change, field", [
    (lambda d: [f"model.path={d / 'nope'}"], "model.path"),
    (lambda d: ["data.prompt_key=problem"], "data.prompt_key"),
    (lambda d: ["data.apply_chat_template=true", "model.path=" + str(d / "no_template")], "data.apply_chat_template"),
    (lambda d: ["reward.function=nosuchmodule:score"], "reward.function"),
    (lambda d: [f"data.train_files=[{d / 'missing.jsonl'}]"], "data.train_files"),
    (lambda d: ["model.path=" + str(d / "moe")], "architectures"),
])
def test_bad_input_fails_before_any_worker_naming_the_field(tmp_path, hf_run_inputs, change, field):
    overrides = hf_run_inputs("qwen2")
    ckpt = next(o.split("=", 1)[1] for o in overrides if o.startswith("model.path="))
    import shutil
    shutil.copytree(ckpt, tmp_path / "no_template")
    (tmp_path / "no_template" / "chat_template.jinja").unlink()
    cfgjson = json.loads((tmp_path / "no_template" / "tokenizer_config.json").read_text())
    cfgjson.pop("chat_template", None)
    (tmp_path / "no_template" / "tokenizer_config.json").write_text(json.dumps(cfgjson))
    shutil.copytree(ckpt, tmp_path / "moe")
    moe = json.loads((tmp_path / "moe" / "config.json").read_text())
    moe["architectures"] = ["Qwen2MoeForCausalLM"]
    (tmp_path / "moe" / "config.json").write_text(json.dumps(moe))
    cfg = _cfg(tmp_path / "runs", overrides + change(tmp_path))
    run = TrainingRun(cfg, tmp_path / "runs" / "r")
    with pytest.raises(TidalError, match=field):
        run.open()
    assert run.group is None and not (tmp_path / "runs" / "r").exists()


def test_workers_read_the_checkpoint_themselves_and_start_from_its_weights(tmp_path, hf_run_inputs):
    """The driver hands the workers a reference to `model.path` (`HFWeights`: no tensor), each worker reads the
    checkpoint itself, and the actor starts from exactly its weights."""
    import pickle

    from tidal.engine.hf_checkpoint import HFWeights, load_hf_weights
    cfg = _cfg(tmp_path, hf_run_inputs("qwen2") + ["run.name=ref"])
    ref = read_inputs(cfg).initial_weights()
    assert isinstance(ref, HFWeights) and len(pickle.dumps(ref)) < 20_000
    run = TrainingRun(cfg, tmp_path / "ref")
    try:
        run.open()
        got, want = run.pipe.global_weights(), load_hf_weights(ref.model)
        assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    finally:
        run.close()


def _train(tmp_path, name, overrides, steps, resume=None):
    cfg = _cfg(tmp_path, overrides + [f"run.num_steps={steps}", f"run.name={name}"])
    run = TrainingRun(cfg, tmp_path / name)
    try:
        run.open(resume_from=resume)
        prompts = []
        while run.next_step < steps:
            before = run.pipe.data_pos   # the step takes its prompts from here (a pure function of the position)
            run.step()
            taken, after = run.inputs.source.take(cfg.data.rollout_batch_size, before)
            assert after == run.pipe.data_pos
            prompts.append([label.uid for _, label in taken])
        ckpt = run.checkpoint()
        return run, prompts, ckpt, run.pipe.global_weights()
    finally:
        run.close()


@pytest.mark.slow
def test_export_loads_in_transformers_and_resume_reads_the_same_prompts(tmp_path, hf_run_inputs):
    transformers = pytest.importorskip("transformers")
    overrides = hf_run_inputs("qwen3") + ["run.save_hf=true", "data.rollout_batch_size=24"]
    # 64 prompts, 24 a step: step 2 crosses into the second (reshuffled) epoch
    full, p_full, _, w_full = _train(tmp_path, "full", overrides, 3)
    _half, p_half, ckpt, _ = _train(tmp_path, "half", overrides, 2)
    _resumed, p_res, _, w_res = _train(tmp_path, "resumed", overrides, 3, resume=ckpt.parent)
    assert p_half + p_res == p_full and len(set(p_full[0]) | set(p_full[1])) == 48
    assert all(torch.equal(w_full[k], w_res[k]) for k in w_full)
    export = tmp_path / "full" / "hf" / "step-000003"
    assert sorted(p.name for p in (tmp_path / "full" / "hf").iterdir()) == ["step-000003"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(export))
    assert model.config.architectures == ["Qwen3ForCausalLM"] and tok.chat_template
    assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] == tok.eos_token_id
    from tidal.engine.model import Transformer
    ours = Transformer(full.inputs.args)
    ours.load_global(w_full)
    ids = torch.randint(0, len(tok), (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (model(ids).logits - ours.full_logits(ours(ids))).abs().max().item()
    assert diff < 1e-5, diff


@pytest.mark.slow
def test_a_reward_function_that_raises_stops_the_run_naming_the_sample(tmp_path, hf_run_inputs):
    """A reward with verl's signature that raises on every call (`tests.parity_reward:fails`): it raises in the
    reward child process of the worker that scores (here the first held-out evaluation, as the run opens); the run
    stops with the user's error itself (a `RewardError`: exit 2), naming the sample id, the function, the error and
    the device that raised it."""
    from tidal.engine.rewards import RewardError
    spec = "tests.parity_reward:fails"
    cfg = _cfg(tmp_path, hf_run_inputs("qwen2") + [f"reward.function={spec}", "run.name=raises"])
    run = TrainingRun(cfg, tmp_path / "raises")
    try:
        with pytest.raises(RewardError) as info:
            run.open()
            run.step()
        text = str(info.value)
        assert info.value.field == "reward.function" and spec in text and "ZeroDivisionError" in text, text
        assert "sample 'val:0'" in text, text   # the sample id: file stem and row
        assert "raised on device" in text, text
    finally:
        run.close()
