"""Per-request LoRA adapters stacked for the CUDA graphs (flared/model/kernels/lora_rows.py), on the CPU: the stacked
term of each row equals DecoderModel._lora's per-adapter loop, the masks pick each row's adapter's columns, base
rows keep their bits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from .test_lora import hf_modules, write_adapter

torch = pytest.importorskip("torch")

PRODUCTS = ("qkv", "o", "gate_up", "down")


@pytest.fixture(scope="module")
def adapters(tiny_hf_llama, tmp_path_factory):
    """The tiny model's source and three PEFT adapters as lora_factors reads them: rank 4 on every projection of
    layer 0 and o of layer 1; rank 8 on q and v of layer 0 and down of layer 1 (rsLoRA, another alpha); rank 2 on
    o of layer 1. Nothing targets layer 1's qkv or gate_up."""
    from transformers import LlamaForCausalLM

    from flared.model.loader import read_source
    from flared.model.lora import LoraAdapter, lora_factors

    src = read_source(tiny_hf_llama)
    modules = hf_modules(LlamaForCausalLM.from_pretrained(tiny_hf_llama, torch_dtype=torch.float32))
    picks = [
        (dict(r=4, alpha=8, seed=1), [m for m in modules if m.startswith("model.layers.0.")]
         + ["model.layers.1.self_attn.o_proj"]),
        (dict(r=8, alpha=4, seed=2, use_rslora=True),
         ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj"]),
        (dict(r=2, alpha=2, seed=3), ["model.layers.1.self_attn.o_proj"]),
    ]
    shapes = {k: torch.empty(v.shape, device="meta") for k, v in src.tensors.items()}
    out = []
    for i, (options, names) in enumerate(picks):
        d = tmp_path_factory.mktemp(f"adapter{i}")
        write_adapter(d, {m: modules[m] for m in names}, **options)
        out.append(lora_factors(LoraAdapter(d, 1.0), src.config, shapes)[0])
    return src, out


def _model(src, factors, dtype):
    from flared.model.decoder import DecoderModel

    model = DecoderModel(src.config, src.tensors, dtype=dtype, device="cpu", max_positions=64)
    model.fused_decode = False  # the per-op forward's _lora is the reference
    for f in factors:
        model.add_lora_module(f)
    return model


def _in_features(config, product):
    return {"qkv": config.hidden_size, "o": config.q_size, "gate_up": config.hidden_size,
            "down": config.intermediate_size}[product]


def _reference(model, ids, name, x, y):
    """DecoderModel._lora over rows grouped by adapter, as the eager executor groups them."""
    groups = [(a, torch.tensor([i for i, r in enumerate(ids) if r == a], dtype=torch.int64))
              for a in sorted(set(ids) - {0})]
    return model._lora(SimpleNamespace(lora_groups=groups), name, x, y)


def test_stacked_terms_equal_the_per_adapter_loop_on_mixed_rows(adapters):
    from flared.model.kernels.lora_rows import StackedLora

    src, factors = adapters
    model = _model(src, factors, torch.float32)
    stacked = StackedLora(src.config, factors, dtype=torch.float32, device="cpu")
    ids = [0, 1, 2, 3, 1, 0, 3, 2, 2, 0, 1]
    mask = stacked.masks(torch.tensor(ids, dtype=torch.int32), torch.float32)
    g = torch.Generator().manual_seed(0)
    moved = 0
    for layer in range(src.config.num_layers):
        for product in PRODUCTS:
            name = f"layers.{layer}.{product}.weight"
            x = torch.randn(len(ids), _in_features(src.config, product), generator=g)
            y = getattr(model.layers[layer], product)(x)
            want = _reference(model, ids, name, x, y.clone())
            got = stacked.add(layer, product, x, y.clone(), mask)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            base = [i for i, a in enumerate(ids) if a == 0]
            assert torch.equal(got[base], y[base])  # base rows keep their bits
            moved += int(not torch.equal(got, y))
    assert moved == 6  # layer 0's four products, layer 1's o and down
    assert (1, "qkv") not in stacked.factors and (1, "gate_up") not in stacked.factors


def test_masks_pick_each_rows_adapter_columns(adapters):
    from flared.model.kernels.lora_rows import StackedLora

    src, factors = adapters
    stacked = StackedLora(src.config, factors, dtype=torch.float32, device="cpu")
    # widest stacked rank of each: adapter 1's qkv (q, k, v at rank 4), adapter 2's (q, v at rank 8), adapter 3's o
    assert stacked.offsets == [0, 12, 28, 30] and stacked.rank == 30
    ids = torch.tensor([0, 3, 1, 2, 0], dtype=torch.int32)
    mask = stacked.masks(ids, torch.bfloat16)
    assert mask.dtype == torch.bfloat16 and mask.shape == (5, 30)
    for row, adapter in enumerate(ids.tolist()):
        want = torch.zeros(30)
        if adapter:
            want[stacked.offsets[adapter - 1]:stacked.offsets[adapter]] = 1
        assert torch.equal(mask[row].float(), want)


def test_an_index_without_an_adapter_gets_no_columns(adapters):
    """An unloaded adapter's index (None) owns no columns: its rows, like base rows, are left alone."""
    from flared.model.kernels.lora_rows import StackedLora

    src, factors = adapters
    stacked = StackedLora(src.config, [None, factors[2]], dtype=torch.float32, device="cpu")
    assert stacked.offsets == [0, 0, 2]
    x = torch.randn(3, src.config.q_size)
    y = torch.randn(3, src.config.hidden_size)
    got = stacked.add(1, "o", x, y.clone(), stacked.masks(torch.tensor([1, 2, 0], dtype=torch.int32), torch.float32))
    assert torch.equal(got[[0, 2]], y[[0, 2]]) and not torch.equal(got[1], y[1])


def test_bfloat16_terms_round_like_the_per_adapter_loop(adapters):
    """In bf16 the stacked term rounds once where the loop rounds each part's term: equal to bf16 resolution,
    base rows still bit for bit."""
    from flared.model.kernels.lora_rows import StackedLora

    src, factors = adapters
    model = _model(src, factors, torch.bfloat16)
    stacked = StackedLora(src.config, factors, dtype=torch.bfloat16, device="cpu")
    assert all(a.dtype == b.dtype == torch.bfloat16 for a, b in stacked.factors.values())
    ids = [2, 0, 1, 1, 3, 0, 2]
    mask = stacked.masks(torch.tensor(ids, dtype=torch.int32), torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    for product in PRODUCTS:
        x = torch.randn(len(ids), _in_features(src.config, product), generator=g).to(torch.bfloat16)
        y = getattr(model.layers[0], product)(x)
        want = _reference(model, ids, f"layers.0.{product}.weight", x, y.clone()).float()
        got = stacked.add(0, product, x, y.clone(), mask)
        assert (got.float() - want).abs().max().item() <= 2 ** -6 * want.abs().max().item()
        assert torch.equal(got[[1, 5]], y[[1, 5]])


def test_a_name_outside_the_layers_products_is_refused(adapters):
    from flared.model.kernels.lora_rows import StackedLora

    src, factors = adapters
    with pytest.raises(ValueError, match="layers' products"):
        StackedLora(src.config, [{"lm_head.weight": []}], dtype=torch.float32, device="cpu")


def test_slots_take_adapters_loaded_later_and_release_them(adapters):
    """A stack laid out with slots (for adapters loaded while serving): an adapter installed into a slot gives
    its rows the terms of a stack built with it from the start, and it is picked by the index it was installed
    as; a released slot's columns go to no row; the slot then takes another adapter under a new index."""
    from flared.model.kernels.lora_rows import StackedLora, stacked_width
    from flared.model.loader import serving_tensor_shapes

    src, factors = adapters
    widest = max(stacked_width(f) for f in factors)
    assert widest == 16  # adapter 2: q and v at rank 8
    slotted = StackedLora(src.config, [factors[2]], dtype=torch.float32, device="cpu", slots=2, slot_width=12)
    assert slotted.slot_width == 12 and slotted.rank == 24 and slotted.slot_adapter == [1, -1]
    assert len(slotted.factors) == src.config.num_layers * len(PRODUCTS)  # room in every product
    assert slotted.free_slot() == 1 and slotted.slot_of(1) == 0
    with pytest.raises(ValueError, match="needs 16 stacked columns"):
        slotted.install(1, factors[1], 2)  # wider than a slot
    slotted.install(1, factors[0], 5)
    assert slotted.slot_adapter == [1, 5] and slotted.free_slot() is None and slotted.slot_of(5) == 1
    with pytest.raises(ValueError, match="holds adapter 5"):
        slotted.install(1, factors[0], 6)
    plain = StackedLora(src.config, [factors[2], factors[0]], dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(1)
    ids_slotted = torch.tensor([0, 5, 1, 5, 2], dtype=torch.int32)  # 2: nobody's index here
    ids_plain = torch.tensor([0, 2, 1, 2, 0], dtype=torch.int32)
    m_slotted = slotted.masks(ids_slotted, torch.float32)
    m_plain = plain.masks(ids_plain, torch.float32)
    serving = serving_tensor_shapes(src.config)
    for layer in range(src.config.num_layers):
        for product in PRODUCTS:
            out_features, in_features = serving[f"layers.{layer}.{product}.weight"]
            x = torch.randn(5, in_features, generator=g)
            y = torch.randn(5, out_features, generator=g)
            got = slotted.add(layer, product, x, y.clone(), m_slotted)
            want = plain.add(layer, product, x, y.clone(), m_plain)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(got[[0, 4]], y[[0, 4]])  # base rows and an index no slot holds keep their bits
    slotted.release(1)
    assert slotted.slot_adapter == [1, -1] and slotted.slot_of(5) is None and slotted.free_slot() == 1
    x = torch.randn(2, src.config.hidden_size, generator=g)
    y = torch.randn(2, serving["layers.0.qkv.weight"][0], generator=g)
    released = slotted.add(0, "qkv", x, y.clone(), slotted.masks(torch.tensor([5, 0], dtype=torch.int32),
                                                                 torch.float32))
    assert torch.equal(released, y)  # the released adapter's rows get no terms
    slotted.install(1, factors[2], 7)  # the slot takes another adapter, under a new index
    o_in = torch.randn(1, src.config.q_size, generator=g)
    again = slotted.add(1, "o", o_in, torch.zeros(1, src.config.hidden_size),
                        slotted.masks(torch.tensor([7], dtype=torch.int32), torch.float32))
    torch.testing.assert_close(again, plain.add(1, "o", o_in, torch.zeros(1, src.config.hidden_size),
                                                plain.masks(torch.tensor([1], dtype=torch.int32), torch.float32)))


def test_an_adapter_load_its_caller_gave_up_on_writes_nothing(tiny_core):
    """POST /v1/load_lora_adapter on the GPU waits for the model thread's job (_LoraInstall); a caller that gave
    up before the job began leaves no adapter behind: the job refuses to write, and no index is taken."""
    from flared.core.load import open_core
    from flared.errors import AdmissionError
    from flared.runtime.worker import ModelRuntime, _LoraInstall

    rt = ModelRuntime(open_core(tiny_core), prefix_cache=False)
    rt.start(max_pending=4)
    try:
        job = _LoraInstall(rt, "late", "/nowhere", {}, b"id", done=lambda *_: None, abandoned=True)
        with pytest.raises(AdmissionError, match="stopped waiting"):
            job.step(rt.model, 0, rt.stats)
        assert not job.started and rt.lora_modules == () and rt.model.lora_modules == []
    finally:
        rt.stop()
