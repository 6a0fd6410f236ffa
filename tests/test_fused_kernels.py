"""Packed projections and the kernels a forward runs (`Transformer.pack_projections`, `Kernels`), on CPU.

The compiled (fused) stages themselves need CUDA and Triton: tests/test_generation_cuda.py covers them."""

import pytest
import torch

from tidal.core.errors import TidalError
from tidal.engine.generation import EngineConfig, NativeEngine
from tidal.engine.model import EAGER, Kernels, ModelArgs, Transformer, init_global_weights

ARGS = ModelArgs(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
                 max_seq_len=32, qkv_bias=True)


def _model(seed=0):
    m = Transformer(ARGS)
    m.load_global(init_global_weights(ARGS, seed))
    return m.eval()


@torch.no_grad()
def test_packed_projections_compute_the_separate_ones_and_follow_weight_updates():
    m, ref = _model(), _model()
    ids = torch.randint(0, ARGS.vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    m.pack_projections()
    attn = m.layers[0].self_attn
    assert attn.packed is not None and attn.q_proj.weight.data_ptr() == attn.packed[0].data_ptr()
    packed = Kernels(packed=True)
    torch.testing.assert_close(m(ids, kernels=packed), ref(ids), rtol=1e-5, atol=1e-5)
    assert torch.equal(m(ids), ref(ids))   # EAGER: the separate projections, bit for bit
    new = init_global_weights(ARGS, 1)
    for name, p in m.named_parameters():
        p.copy_(new[name])       # what an engine's weight update does
    ref.load_global(new)
    torch.testing.assert_close(m(ids, kernels=packed), ref(ids), rtol=1e-5, atol=1e-5)
    m.pack_projections(False)
    assert attn.packed is None and torch.equal(m(ids, kernels=packed), ref(ids))


def test_eager_kernels_are_the_default_and_fusing_off_cuda_is_refused():
    assert Kernels() == EAGER and not EAGER.packed
    engine = NativeEngine(_model(), EngineConfig(max_running_requests=2))
    assert "fused=0" in engine.numerics and engine.model.layers[0].self_attn.packed is None
    with pytest.raises(TidalError, match="fused_kernels"):
        NativeEngine(_model(), EngineConfig(max_running_requests=2, fused_kernels=True))
    with pytest.raises(TidalError, match="decode_attention"):   # the Triton attention rides on the fused mode
        NativeEngine(_model(), EngineConfig(max_running_requests=2, decode_attention="triton"))
    with pytest.raises(TidalError, match="decode_attention"):
        EngineConfig(decode_attention="flash")  # type: ignore[arg-type]
