"""A run's inputs, read and checked on the driver before any worker starts: model, tokenizer, prompts, verifier.

    inputs = read_inputs(cfg)
      inputs.args        ModelArgs (from model.path's config.json, or Tidal's own model.* keys)
      inputs.hf          HFModel of model.path (None: Tidal's own model)
      inputs.tok         Tokenizer (the checkpoint's through transformers, or the tiny tasks' characters)
      inputs.source      PromptSource (data files, or the built-in task)
      inputs.reward      reward.function as the workers run it (None: Tidal's own model on the built-in task's exact
                         verifier)

Every mistake a user can make in these (a missing directory or file, an unsupported architecture, a damaged or
incomplete weight file, a key missing from the data, a ground truth the verifier can never pay, no chat template
while apply_chat_template is on, a tokenizer larger than the embedding, a reward module that fails, hangs or exits
while it imports) is a `TidalError` here, named by its config field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import cast

from tidal.core.config import TidalConfig
from tidal.core.errors import ConfigError
from tidal.engine.datasets import DataSpec
from tidal.engine.hf_checkpoint import HFModel, HFWeights, read_hf_config, weight_inventory
from tidal.engine.hf_tokenizer import HFTokenizer, Tokenizer, TokenizerSpec
from tidal.engine.model import ModelArgs
from tidal.engine.prompt_source import FileSource, PromptSource, TaskSource
from tidal.engine.rewards import check_reward, ground_truth_check
from tidal.engine.rl_tasks import get_task
from tidal.engine.tokenizer import check_compatible, default_tokenizer


@dataclass
class RunInputs:
    args: ModelArgs
    hf: HFModel | None
    tok: Tokenizer
    tokenizer_spec: TokenizerSpec
    source: PromptSource
    reward: str | None

    @property
    def vocab_limit(self) -> int | None:
        """Ids generation may emit: the tokenizer's, when the embedding is padded past it."""
        return self.tok.vocab_size if self.tok.vocab_size < self.args.vocab_size else None

    def initial_weights(self) -> HFWeights | None:
        """The checkpoint's weights, read by each worker itself, or None: Tidal's own model starts from its warm
        start."""
        return HFWeights(self.hf) if self.hf is not None else None


def _checkpoint_inputs(cfg: TidalConfig) -> RunInputs:
    d = cfg.data
    path = cast(str, cfg.model.path)   # set: read_inputs calls this only with model.path
    hf = read_hf_config(path, cfg.max_seq_len)
    weight_inventory(hf)   # the weight files' headers as loading reads them (no tensor data): damage fails here
    tok = HFTokenizer(path, d.apply_chat_template, d.chat_template_kwargs)
    if tok.vocab_size > hf.args.vocab_size:
        raise ConfigError("model.path", cfg.model.path, f"its tokenizer has {tok.vocab_size} tokens, more than the "
                          f"model's {hf.args.vocab_size} embedding rows", "use the tokenizer saved with the model")
    spec = TokenizerSpec("hf", path=str(cfg.model.path), apply_chat_template=tok.chat,
                         chat_template_kwargs=json.dumps(d.chat_template_kwargs, sort_keys=True))
    if d.train_files:
        reward = cfg.reward.function or "gsm8k"
        source: PromptSource = FileSource(
            DataSpec(tuple(d.train_files), d.prompt_key, d.answer_key, "data.train_files"),
            DataSpec(tuple(d.val_files), d.prompt_key, d.answer_key, "data.val_files"),
            tok, d.max_prompt_length, d.truncation, d.seed, d.shuffle,
            answer_check=ground_truth_check(reward), unpayable=d.unpayable_answers)
    else:   # a built-in task's text prompts through the checkpoint's tokenizer; its answers compared exactly
        source = TaskSource(get_task(d.task), tok, d.seed)
        reward = cfg.reward.function or "exact"
    return RunInputs(hf.args, hf, tok, spec, source, reward)


def _own_model_inputs(cfg: TidalConfig) -> RunInputs:
    char = default_tokenizer()
    task = get_task(cfg.data.task)
    task.check_tokenizer(char)
    if task.max_response_tokens > cfg.response_length:
        raise ConfigError("rollout.max_new_tokens", cfg.response_length,
                          f"is shorter than task {task.name!r}'s answers ({task.max_response_tokens} tokens)",
                          f"set rollout.max_new_tokens >= {task.max_response_tokens}")
    args = ModelArgs.from_config(cfg.model, char.vocab_size)
    check_compatible(char, args.vocab_size)
    spec = TokenizerSpec("char", chars=char.chars)
    tok = spec.build()
    return RunInputs(args, None, tok, spec, TaskSource(task, tok, cfg.data.seed), cfg.reward.function)


def read_inputs(cfg: TidalConfig) -> RunInputs:
    inputs = _checkpoint_inputs(cfg) if cfg.model.path else _own_model_inputs(cfg)
    if inputs.reward is not None:   # a bad spec fails here, not on the first rollout; a custom module is imported
        check_reward(inputs.reward, cfg.reward.timeout_s)   # in a child process, never in the driver
    return inputs
