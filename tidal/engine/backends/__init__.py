"""Actor backends: the training engine of one world rank behind one protocol, native or megatron-core.

Entry points:
- `protocol`: `ActorBackend` (`train_iter`, `inventory`, `reshard`, `export_weights`, `save_megatron` /
  `load_megatron`), the registry `register_backend`, `backend_names`, `make_backend(name, ...)`: "native" always,
  "megatron" when megatron-core is importable;
- `native`: `NativeBackend`, a thin adapter over `ActorShard` (tidal/engine/actor.py);
- `megatron_backend`: `MegatronBackend`, megatron-core's GPTModel + DDP + DistributedOptimizer; `megatron_stack`
  (what one layout builds on one rank, its state views and memory hand-over);
- `megatron_map` (names, fused QKV / fc1 layouts, vocab padding, `TransformerConfig` from `ModelArgs`),
  `megatron_convert` (a full state, weights and optimizer, between our names and Megatron's),
  `megatron_ckpt` (`save_megatron`, `load_megatron`: dist_checkpointing from native weights, any TP),
  `megatron_reshard` / `megatron_state_reshard` (Megatron-layout weights and optimizer state through the reshard
  planner), `megatron_cpu` (the narrow workarounds that run megatron-core on CPU). See docs/megatron.md.

Imports: torch, `tidal.engine.*` and `tidal.core.errors`; megatron-core only inside the functions that use it, so
this package imports without it (`pip install -e '.[megatron]'` adds it). No Ray, no driver code.

Invariants:
- every protocol verb is collective over the world like `ActorShard`'s: every world rank calls it at the same
  point; ranks outside the layout take part in group creation and votes and return None where a value is due;
- the registry refuses a name registered twice;
- a checkpoint written at one TP size loads at any other, in either direction between native and GPTModel;
- resharding Megatron state (weights, main params, both moments) with Tidal's planner is bit-exact
  (A -> B -> A), like the native actor's;
- on a machine with CUDA every CPU workaround is a no-op.
"""
