"""CPU memory in huge pages (flared/model/host_memory.py): the KV pool and the packed bf16 weights."""

import gc
import mmap
import sys

import numpy as np
import pytest
import torch

from flared.model.config import ModelConfig
from flared.model import host_memory
from flared.model.host_memory import host_zeros
from flared.model.kv_cache import PagedKVCache


def _vma_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_zeros_is_zeroed_writable_and_keeps_its_mapping_alive(dtype):
    t = host_zeros((2, 3, 1000, 64), dtype)
    assert t.shape == (2, 3, 1000, 64) and t.dtype == dtype and t.is_contiguous()
    assert not t.any()
    gc.collect()  # the mapping object is only referenced by the tensor now
    t[1, 2, 999, 63] = 5.0
    t[0, 0, 0, 0] = -1.0
    assert t.sum().item() == 4.0
    assert t.view(-1)[-1].item() == 5.0


def _no_mapping(monkeypatch):
    """Fail if host_memory maps anything itself. (Whether torch's own heap is advised depends on the process:
    the suite has seen glibc's heap carry the flag, so a plain tensor's VmFlags prove nothing.)"""
    def refuse(*args, **kwargs):
        raise AssertionError("host_zeros made its own mapping with FLARED_HUGEPAGES=0")

    monkeypatch.setattr(host_memory.mmap, "mmap", refuse)


def test_host_zeros_off_gives_plain_memory(monkeypatch):
    monkeypatch.setenv("FLARED_HUGEPAGES", "0")
    with monkeypatch.context() as m:
        _no_mapping(m)
        t = host_zeros((1024, 1024), torch.float32)
    assert not t.any() and t.shape == (1024, 1024)
    if sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE"):
        monkeypatch.delenv("FLARED_HUGEPAGES")
        assert "hg" in _vma_flags(host_zeros((1024, 1024), torch.float32).data_ptr())


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason="transparent huge pages are a Linux feature")
def test_cpu_pool_is_advised_for_huge_pages(monkeypatch):
    monkeypatch.delenv("FLARED_HUGEPAGES", raising=False)
    config = ModelConfig(architecture="llama", vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=4,
                         num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                         rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=False,
                         attention_bias=False, qk_norm=False)
    cache = PagedKVCache(config, num_pages=128, page_tokens=64, dtype=torch.bfloat16)  # 2 x 8 MiB
    # "hg": the mapping carries MADV_HUGEPAGE (whether the kernel then finds 2 MiB pages is its business).
    assert "hg" in _vma_flags(cache.keys.data_ptr())
    assert "hg" in _vma_flags(cache.values.data_ptr())
    assert not cache.keys.any() and not cache.values.any()
    monkeypatch.setenv("FLARED_HUGEPAGES", "0")
    _no_mapping(monkeypatch)
    plain = PagedKVCache(config, num_pages=128, page_tokens=64, dtype=torch.bfloat16)
    assert not plain.keys.any()


def _bf16_model_linears(tmp_path):
    """A small llama3 checkpoint as a bf16 DecoderModel; its packed products (LM head last)."""
    from flared._fast.linear import BF16_SUPPORTED
    from flared.model.decoder import DecoderModel
    from flared.model.loader import read_source

    from .conftest import build_hf_checkpoint

    if not BF16_SUPPORTED:
        pytest.skip("this CPU lacks AVX-512 BF16: no packed weights")
    source = read_source(build_hf_checkpoint("llama3", tmp_path))
    model = DecoderModel(source.config, source.tensors, dtype=torch.bfloat16)
    linears = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return linears + [model.lm_head_linear]


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason="transparent huge pages are a Linux feature")
def test_packed_bf16_weights_share_one_advised_mapping(tmp_path, monkeypatch):
    monkeypatch.delenv("FLARED_HUGEPAGES", raising=False)
    linears = _bf16_model_linears(tmp_path)
    storages = {lin.packed.untyped_storage().data_ptr() for lin in linears}
    assert len(storages) == 1  # one arena: a matrix under 2 MiB alone would get no huge page
    assert all("hg" in _vma_flags(lin.packed.data_ptr()) for lin in linears)
    assert all(lin.packed.data_ptr() % 64 == 0 for lin in linears)


def test_packed_weights_stay_put_without_huge_pages(tmp_path, monkeypatch):
    monkeypatch.setenv("FLARED_HUGEPAGES", "0")
    linears = _bf16_model_linears(tmp_path)[:-1]  # the layers' products only
    # No arena: each matrix keeps the storage pack_bf16 gave it.
    assert len({lin.packed.untyped_storage().data_ptr() for lin in linears}) == len(linears)


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason="transparent huge pages are a Linux feature")
@pytest.mark.parametrize("quantization", [None, "q4_1", "q8_0"])
def test_weights_written_in_place_over_several_runs_serve_as_before(tmp_path, monkeypatch, quantization):
    """decoder._Arena writes each packed or quantised matrix straight into its huge-page runs (here 8 KiB runs, so
    the model takes many, and a matrix larger than one gets its own mapping): every matrix advised and 64-byte
    aligned, and the model's logits those of the same model whose matrices were made in plain memory."""
    from flared._fast.linear import BF16_SUPPORTED
    from flared.model import decoder
    from flared.model.batch import ForwardBatch, SequenceChunk
    from flared.model.decoder import DecoderModel
    from flared.model.loader import read_source

    from .conftest import build_hf_checkpoint

    if not BF16_SUPPORTED:
        pytest.skip("this CPU lacks AVX-512 BF16 and AVX2: no packed weights")
    source = read_source(build_hf_checkpoint("llama3", tmp_path))

    def logits(model):
        kv = model.make_kv_cache(num_pages=2, page_tokens=16)
        batch = ForwardBatch.build([SequenceChunk([5, 9, 2, 7, 11], 0, np.arange(1))], page_tokens=16)
        return model.forward(batch, kv).float()

    monkeypatch.setenv("FLARED_HUGEPAGES", "0")
    plain = logits(DecoderModel(source.config, source.tensors, dtype=torch.bfloat16, quantization=quantization))
    monkeypatch.delenv("FLARED_HUGEPAGES")
    monkeypatch.setattr(decoder._Arena, "CHUNK", 8 << 10)
    model = DecoderModel(source.config, source.tensors, dtype=torch.bfloat16, quantization=quantization)
    tensors = [getattr(lin, name) for layer in model.layers for lin in model._linears(layer)
               for name in ("packed", "quant", "quant_scales", "quant_offsets") if getattr(lin, name) is not None]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) > 1
    assert all("hg" in _vma_flags(t.data_ptr()) and t.data_ptr() % 64 == 0 for t in tensors)
    assert torch.equal(logits(model), plain)
