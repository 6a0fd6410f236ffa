"""Actor backends: one protocol (`protocol.py`), the native engine behind it (`native.py`), and megatron-core interop
(`megatron_map.py`: names, fused layouts, vocab padding, TransformerConfig; `megatron_cpu.py`: the narrow CPU
workarounds; `megatron_ckpt.py`: dist_checkpointing read/write; `megatron_reshard.py`: Megatron-layout weights
through the reshard planner). megatron-core is imported lazily: this package imports without it. See
docs/megatron.md."""
