"""Falcon-RW's ALiBi as transformers forms it: each key's bias bf16(bf16 slope * key position) / sqrt(head_dim)
(ModelConfig.alibi_bf16_positions). Until this was kept, 32 heads (Falcon-RW-1B's: slopes that are not powers of two)
or positions past 256 moved the logits by up to 0.2 from transformers' on these models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("heads, length", [(32, 80), (12, 300)])
def test_prefill_and_decode_match_transformers(heads, length, tmp_path):
    from flared.model.batch import ForwardBatch, SequenceChunk
    from flared.model.decoder import DecoderModel
    from flared.model.loader import read_source

    torch.manual_seed(0)
    cfg = transformers.FalconConfig(vocab_size=320, hidden_size=heads * 8, num_attention_heads=heads,
                                    num_hidden_layers=2, alibi=True, multi_query=False, parallel_attn=False, bias=True,
                                    bos_token_id=1, eos_token_id=2)
    hf = transformers.FalconForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(3.0)  # (attention that matters: the biases' rounding shows in the logits)
    hf.save_pretrained(tmp_path)
    source = read_source(tmp_path)
    assert source.config.alibi_bf16_positions
    assert "Falcon-RW" in source.config.torch_graphs_obstacle("float32")  # (the GPU serves it eagerly)
    model = DecoderModel(source.config, source.tensors, dtype=torch.float32)
    ids = torch.randint(3, 320, (1, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        want = hf(ids).logits[0]
    pages = np.arange(-(-length // 16))
    kv = model.make_kv_cache(num_pages=len(pages), page_tokens=16)
    prefill = model.forward(ForwardBatch.build([SequenceChunk(ids[0, :-1].tolist(), 0, pages)], page_tokens=16), kv)
    decode = model.forward(ForwardBatch.build([SequenceChunk(ids[0, -1:].tolist(), length - 1, pages)],
                                              page_tokens=16), kv)
    assert (prefill[0] - want[-2]).abs().max().item() < 1e-4
    assert (decode[0] - want[-1]).abs().max().item() < 1e-4
