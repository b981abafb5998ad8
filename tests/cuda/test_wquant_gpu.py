"""Layer matrices kept quantised on the GPU (Q4_1, Q8_0 blocks: quant.gpu_layout, kernels/wquant.py): the products
against float64 over the blocks' values and against cuBLAS over the same values, in a CUDA graph; the GPU quantiser
against the CPU's; a quantised model served by the graphs, its greedy tokens as near transformers' float32 argmax
(over the blocks' values) as the bf16 model's of those values. Skipped without a GPU (tests/cuda/conftest.py)."""

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))

from gpu_models import argmax_distance, make_executor, make_scheduler  # noqa: E402

FORMATS = ("q4_1", "q8_0")
PROMPTS = [list(range(5, 155)), list(range(200, 210)), [7], list(range(300, 340))]


def _values(fmt, weight):
    """``weight`` quantised on its device, and the blocks' values [out, in] as bf16."""
    from flared.model.quant import gpu_quantize, gpu_values

    parts = gpu_quantize(fmt, weight)
    return parts, gpu_values(parts, fmt, in_features=weight.shape[1])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("out_features, in_features", [(72, 96), (4096, 4096), (1000, 576), (384, 14336)])
def test_the_products_against_float64_and_cublas(fmt, out_features, in_features):
    """Every row count through each path (tiles on the tensor cores, two tile sizes, input splits summed by each
    tile's last program, inputs padded to whole turns (96, 576), the widened weight through cuBLAS), with and
    without a bias: as near float64 over the blocks' values as cuBLAS' bf16 product over them is."""
    from flared.model.kernels import wquant
    from flared.model.quant import dequantize_q4_1, dequantize_q8_0, quantize_q4_1, quantize_q8_0

    g = torch.Generator(device="cuda").manual_seed(out_features + in_features)
    weight = (torch.randn(out_features, in_features, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    parts, values = _values(fmt, weight)
    # (the CPU's blocks, laid out on the GPU)
    cpu = weight.cpu()
    cpu = dequantize_q4_1(*quantize_q4_1(cpu)) if fmt == "q4_1" else dequantize_q8_0(*quantize_q8_0(cpu))
    assert torch.equal(values.cpu(), cpu)
    wide = wquant.widen(fmt, parts)
    assert torch.equal(wide[:in_features], values.t()) and not wide[in_features:].any()
    bias = torch.randn(out_features, device="cuda", generator=g).to(torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for rows in (1, 3, 16, 17, 40, 64, 100, wquant.WIDEN_MIN_ROWS, 300):
        x = torch.randn(rows, in_features, device="cuda", generator=g).to(torch.bfloat16)
        padded = parts[1].shape[0] * 32
        launches = [None] + ([wquant.plan(rows, out_features, padded, sms, fmt, block_n=64),
                              wquant.plan(rows, out_features, padded, 8 * sms, fmt, warps=8)]
                             if rows < wquant.WIDEN_MIN_ROWS else [])
        for b in (None, bias):
            exact = x.double() @ values.double().t() + (0 if b is None else b.double())
            blas = torch.nn.functional.linear(x, values, b).double()
            bound = 2 * (blas - exact).abs().max().item() + 1e-3
            for launch in launches:
                got = wquant.linear(x, fmt, parts, b, launch=launch).double()
                assert (got - exact).abs().max().item() <= bound, (rows, b is not None, launch)


@pytest.mark.parametrize("rows", [2, 200])
def test_the_products_replay_in_a_graph(rows):
    """Captured once, replayed over new rows: the eager call's bits (input splits summed in a fixed order by each
    tile's last program, which resets the tile's count for the next replay)."""
    from flared.model.kernels import wquant

    g = torch.Generator(device="cuda").manual_seed(rows)
    weight = (torch.randn(4096, 2048, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    parts, _ = _values("q4_1", weight)
    x = torch.randn(rows, 2048, device="cuda", generator=g).to(torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        wquant.linear(x, "q4_1", parts)  # (compiles the kernels before the capture)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        y = wquant.linear(x, "q4_1", parts)
    for seed in range(3):
        x.copy_(torch.randn(rows, 2048, device="cuda", generator=g.manual_seed(seed)).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, wquant.linear(x, "q4_1", parts))


def test_bad_inputs_are_refused():
    from flared.model.kernels import wquant

    parts, _ = _values("q8_0", torch.ones(64, 96, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"does not match Q8_0 weight \[64, 128 \(padded\)\]"):
        wquant.linear(torch.ones(2, 64, device="cuda", dtype=torch.bfloat16), "q8_0", parts)
    with pytest.raises(ValueError, match="bfloat16 or float16 rows"):
        wquant.linear(torch.ones(2, 96, device="cuda"), "q8_0", parts)
    with pytest.raises(ValueError, match="3 input splits do not divide the weight's 2 turns"):  # (would drop inputs)
        wquant.linear(torch.ones(2, 96, device="cuda", dtype=torch.bfloat16), "q8_0", parts,
                      launch=wquant.Launch(16, 64, 3, 4, 3))


def _quantised(family, fmt, tmp_path):
    """(the checkpoint's directory, its serving tensors, the bf16 model quantised at load on the GPU)."""
    from flared_testing.checkpoints import build_hf_checkpoint

    from flared.model.decoder import DecoderModel
    from flared.model.loader import read_source

    directory = tmp_path / family
    build_hf_checkpoint(family, directory)
    source = read_source(directory)
    return directory, source, DecoderModel(source.config, source.tensors, dtype=torch.bfloat16, device="cuda",
                                           max_positions=512, quantization=fmt)


def _twins(directory, source, fmt):
    """(the bf16 model whose layer matrices are the blocks' values, on the fused kernels; transformers' float32 model
    of those values, on the GPU)."""
    from transformers import AutoModelForCausalLM

    from flared.model.decoder import DecoderModel

    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to("cuda").eval()
    # (each row's blocks are its own: q, k and v rows, and gate and up rows, quantise as their fused matrices do)
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".weight") and name.split(".")[-2] in projections:
                p.copy_(_values(fmt, p.to(torch.bfloat16))[1].float())
    tensors = dict(source.tensors)
    for name, t in source.tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in ("qkv", "o", "gate_up", "down"):
            tensors[name] = _values(fmt, t.to("cuda", torch.bfloat16))[1].cpu()
    return DecoderModel(source.config, tensors, dtype=torch.bfloat16, device="cuda", max_positions=512), hf


@pytest.mark.parametrize("family, fmt", [("llama3", "q4_1"), ("llama3", "q8_0"), ("qwen2", "q4_1")])
def test_a_quantised_model_serves_from_the_graphs(family, fmt, tmp_path):
    """The layer matrices kept quantised (0.31x their bf16 bytes as Q4_1, 0.56x as Q8_0; Qwen2's biases beside
    them), the LM head bf16; the graphs run the model's torch layers; greedy tokens as near transformers' float32
    argmax over the same values as the bf16 twin's on the fused kernels."""
    from flared.execution.offline import drive
    from flared.model.sampling import SamplingParams

    directory, source, quantised = _quantised(family, fmt, tmp_path)
    twin, hf = _twins(directory, source, fmt)
    for layer in quantised.layers:
        assert all(lin.on_gpu and lin.quant_kind == fmt for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert quantised.lm_head_linear.quant is None
    ratio = sum(lin.nbytes for layer in quantised.layers for lin in quantised._linears(layer)) / \
        sum(lin.nbytes for layer in twin.layers for lin in twin._linears(layer))
    # (the GPU layout pads each matrix's inputs with zero blocks to whole turns: GPU_TURN)
    from flared.model.quant import GPU_TURN

    turn = GPU_TURN[fmt]
    shapes = [(lin.out_features, lin.in_features) for layer in twin.layers for lin in twin._linears(layer)]
    padded = sum(n * -(-k // turn) * turn for n, k in shapes) / sum(n * k for n, k in shapes)
    assert abs(ratio - padded * (0.3125 if fmt == "q4_1" else 0.5625)) < 0.01, (ratio, padded)
    params = [SamplingParams(max_tokens=24, temperature=0.0)] * len(PROMPTS)
    runs = {}
    for name, model in (("quantised", quantised), ("twin", twin)):
        ex = make_executor(model)
        try:
            assert ex.graphs.decoder.generic == (name == "quantised")
            runs[name] = drive(make_scheduler(), ex, PROMPTS, params).tokens
        finally:
            ex.close()
    (q_exact, q_gap), (t_exact, t_gap) = (argmax_distance(hf, PROMPTS, runs[k]) for k in ("quantised", "twin"))
    total = len(PROMPTS) * 24
    assert q_exact >= min(t_exact - 0.1 * total, 0.8 * total), (q_exact, t_exact, total)
    assert q_gap <= t_gap + 0.02, (q_gap, t_gap)
    print(f"{family} {fmt}: quantised {q_exact}/{total} argmax (mean gap {q_gap:.4f}), twin {t_exact}/{total} "
          f"({t_gap:.4f})")


def test_a_mixtures_layers_are_quantised_and_its_experts_kept(tmp_path):
    """A mixture (Qwen3-MoE): its attention matrices quantised, its routed experts bf16 stacks (torch's grouped
    products), served by the graphs."""
    from flared.execution.offline import drive
    from flared.model.sampling import SamplingParams

    _, _, quantised = _quantised("qwen3_moe", "q4_1", tmp_path)
    layer = quantised.layers[0]
    assert layer.qkv.on_gpu and layer.o.on_gpu and layer.expert_stacks is not None
    assert all(lin.quant is None for pair in layer.experts for lin in pair)
    ex = make_executor(quantised)
    try:
        tokens = drive(make_scheduler(), ex, PROMPTS, [SamplingParams(max_tokens=8, temperature=0.0)] * 4).tokens
    finally:
        ex.close()
    assert all(len(t) == 8 for t in tokens)
