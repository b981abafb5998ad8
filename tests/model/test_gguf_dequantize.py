"""GGUF files read without gguf.GGUFReader (flared/frontend/gguf_metadata.py's GGUFFile) and their tensors
dequantised in C (flared/_fast/gguf.pyx): both against the `gguf` package, value for value and bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
fast = pytest.importorskip("flared._fast.gguf")

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from flared.frontend.gguf_metadata import GGUFFile  # noqa: E402

# where each type keeps its float16 scales (the rest of a block is bits of any value)
HALVES = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.Q2_K: [80, 82], T.Q3_K: [108],
          T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208], T.BF16: []}


def _blocks(qtype: T, count: int, seed: int) -> np.ndarray:
    """``count`` blocks of random bits, their float16 scales finite: normal, subnormal, zero and negative."""
    rng = np.random.default_rng(seed)
    _, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
    for offset in HALVES[qtype]:
        halves = (rng.standard_normal(count) * 0.02).astype(np.float16)
        halves[::7] = np.float16(3e-6)  # (subnormal)
        halves[1::11] = np.float16(-0.0)
        halves[2::13] = np.float16(60000.0)
        raw[:, offset:offset + 2] = halves.view(np.uint8).reshape(count, 2)
    return raw


def test_every_type_it_takes_is_one_gguf_has():
    assert fast.TYPES == {int(t) for t in HALVES}


@pytest.mark.parametrize("qtype", list(HALVES), ids=lambda t: t.name)
@pytest.mark.parametrize("threads", [1, 3])
def test_the_c_dequantisers_give_the_gguf_packages_values_bit_for_bit(qtype, threads):
    block, _ = GGML_QUANT_SIZES[qtype]
    count = 1000 if block > 1 else 64000  # (several of the kernel's 256-block tasks, one left short)
    raw = _blocks(qtype, count, seed=int(qtype))
    expected = dequantize(raw.reshape(-1) if qtype == T.BF16 else raw, qtype).reshape(-1)
    got = fast.dequantize(int(qtype), raw, count * block, threads)
    assert got.dtype == np.float32 and got.shape == (count * block,)
    np.testing.assert_array_equal(got.view(np.uint32), expected.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("qtype", list(HALVES), ids=lambda t: t.name)
def test_straight_to_bf16_rounds_as_torch_rounds(qtype):
    """With bf16=True (a bf16 export's matrices) each value is the float32 one rounded as .to(torch.bfloat16) rounds
    it: to nearest-even, ties included."""
    import torch

    block, _ = GGML_QUANT_SIZES[qtype]
    count = 700 if block > 1 else 64000
    raw = _blocks(qtype, count, seed=7 * int(qtype))
    exact = torch.from_numpy(fast.dequantize(int(qtype), raw, count * block, 2))
    if qtype == T.BF16:  # (every bf16 value comes back as it was; NaNs aside, whose bits torch may keep)
        exact = exact[~exact.isnan()]
        raw = exact.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8).reshape(-1, 2)
        count = raw.shape[0]
    got = fast.dequantize(int(qtype), raw, count * block, 3, True)
    assert got.dtype == np.uint16
    assert torch.equal(torch.from_numpy(got.view(np.int16)), exact.to(torch.bfloat16).view(torch.int16))


def test_the_dequantiser_refuses_what_is_not_whole_blocks():
    raw = _blocks(T.Q4_K, 2, seed=0)
    with pytest.raises(ValueError, match="whole blocks"):
        fast.dequantize(int(T.Q4_K), raw, 300)
    with pytest.raises(ValueError, match="bytes for"):
        fast.dequantize(int(T.Q4_K), raw[:, :100], 512)
    with pytest.raises(ValueError, match="not one this module takes"):
        fast.dequantize(int(T.IQ4_XS), raw, 512)
    assert fast.dequantize(int(T.Q8_0), raw[:0], 0).shape == (0,)


def _same_as_gguf_reader(path) -> None:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    # (the reader adds its own GGUF.* entries for the header)
    assert list(ours.fields) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for key, field in ours.fields.items():
        mine, reference = field.contents(), theirs.fields[key].contents()
        assert mine == reference and type(mine) is type(reference), key
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == \
               (b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset)
        assert np.array_equal(a.shape, b.shape)
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype, a.name
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name


def test_the_file_reader_reads_the_embedded_model_as_gguf_does(default_gguf):
    _same_as_gguf_reader(default_gguf)


def test_the_file_reader_reads_every_tensor_type_and_alignment_as_gguf_does(tmp_path):
    path = tmp_path / "mixed.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "ü"])
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.25])
    writer.add_float32("llama.rope.freq_base", 500000.0)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_string("general.name", "mixed")
    rng = np.random.default_rng(3)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 64)).astype(np.float16))
    writer.add_tensor("i32", np.arange(7, dtype=np.int32))
    for qtype in (T.Q8_0, T.Q4_K, T.Q6_K):
        _, size = GGML_QUANT_SIZES[qtype]
        # two rows of two blocks, given as their bytes
        writer.add_tensor(qtype.name.lower(), _blocks(qtype, 4, seed=int(qtype)).reshape(2, 2 * size), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _same_as_gguf_reader(path)
    ours = GGUFFile(path)
    q4k = next(t for t in ours.tensors if t.name == "q4_k")
    values = fast.dequantize(int(q4k.tensor_type), q4k.data, q4k.n_elements)
    np.testing.assert_array_equal(values.reshape(2, 512), dequantize(q4k.data, q4k.tensor_type))


def test_a_truncated_file_is_refused(default_gguf, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(default_gguf.read_bytes()[:4_000_000])
    with pytest.raises(ValueError, match="past the end"):
        GGUFFile(cut)
