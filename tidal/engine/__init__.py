"""tidal.engine: what one device computes, in torch: the model, the actor's training and resharding, generation,
GRPO, checkpoints, tokenizers, data and rewards. It knows nothing of Ray, device workers or scheduling: the
caller hands it a torch.distributed world and a layout.

Entry points (modules):
- `model` (`Transformer`, `ModelArgs`, `param_specs`: a Llama/Qwen-style decoder with Megatron-style TP, HF
  Llama parameter names), `layout` (`Layout(tp, dp, devices)`, `ParamSpec`), `tp`, `groups` (`GroupCache`);
- `optim` (`OptimConfig`, `lr_at`: ZeRO-1 AdamW on flat buffers), `actor` (`ActorShard`: one world rank of the
  actor, `train_iter`, `reshard`), `reshard/`, `backends/` (`ActorBackend`: native, megatron-core), `checkpoint`
  (`save_actor`, `load_actor`: per-rank shard generations, loadable into any layout);
- `generation/` (rollout engines), `grpo` (advantages, packing, `grpo_loss`), `records` (`PromptGroup` ->
  `RolloutGroup` -> `ScoredGroup`), `evaluation` (`greedy_accuracy`), `warmstart` (`warm_start`);
- `hf_checkpoint` (`read_hf_config`, `load_hf_weights`, `save_hf`), `hf_tokenizer`, `tokenizer`, `datasets`,
  `prompt_source` (`FileSource`, `TaskSource`), `rl_tasks` (`get_task`), `rewards`, `verifier`;
- `testing` (`run_ranks`: a function on N spawned gloo ranks, for tests and `tidal reshard-check`).

Imports: torch (with torch.distributed) and safetensors; transformers, tokenizers, pyarrow, math-verify and
megatron-core only inside the code that needs them; from Tidal only `tidal.engine.*`, `tidal.core.errors` and
`tidal.core.placement`. Never Ray, Prefect, MLflow, SQLAlchemy, Optuna or Alembic, and nothing from workers,
scheduler, pipeline, db, flows or tasks (tests/test_boundaries.py). One exception: `generation/vllm_server.py`
is a script run in `.venv-vllm` that imports vLLM; Tidal never imports it.

Invariants:
- ranks talk through torch.distributed only (gloo on CPU, NCCL on GPU), in the world the caller set up; collective
  calls (`GroupCache.get`, `ActorShard(...)`, `reshard`) are made by every world rank at the same point, ranks
  outside the layout included;
- an actor iter's update is bit-identical for every DP size and micro-batch assignment at a fixed TP (each owner
  sums the micro-batch gradients in index order);
- resharding is exact and all-or-nothing (reshard/); a generated request's tokens and log-probs depend only on
  weights, prompt, sampling params and seed, not on its batch, slot or migrations (generation/);
- the rollout log-prob is the temperature-1 fp32 log-softmax, the quantity `Transformer.token_logprobs` gives;
- a checkpoint generation counts only once its marker is written; bad user input is a `TidalError`.
"""
