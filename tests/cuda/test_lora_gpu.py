"""Per-request LoRA adapters on the CUDA graph executor (kernels/lora_rows.StackedLora, PagedCudaDecoder.lora).

float32: greedy tokens of requests under two adapters and of base requests, in the same batched prefill and
decode graphs, equal the CPU path's (DecoderModel._lora), exactly. bfloat16: the fused forward's logits with
each adapter track a float32 reference of the CPU path, prefill and decode; the captured graphs serve mixed
batches; and the model thread (ModelRuntime, --lora-modules) runs adapters on the GPU from their PEFT files.
"""

import json
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).parent))

from gpu_models import PAGE_TOKENS, make_cpu_executor, make_executor, make_scheduler, serving_model  # noqa: E402

F = torch.nn.functional
# 100 + 10 + 1 + 40 tokens: one batched prefill cohort of both adapters and the base, the last prompt cut at the
# cohort's capacity (it continues in a chunk of its own)
PROMPTS = [list(range(5, 105)), list(range(200, 210)), [7], list(range(300, 340))]
LORAS = [1, 0, 2, 0]
BATCH_SHAPES = ((2, 64), (2, 128), (4, 128))


def random_factors(config, rank, seed, products=("qkv", "o", "gate_up", "down"), scale=0.1):
    """A per-request adapter as lora.lora_factors gives one (tools/bench_lora_cpu.py's random factors: q and v of
    qkv, gate and up of gate_up), sized to move the tiny model's tokens."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from bench_lora_cpu import adapter_factors

    return adapter_factors(config, rank, seed=seed, scale=scale, products=products)


def two_adapters(config):
    """Adapter 1: rank 4 on every product; adapter 2: rank 8 on qkv and down only."""
    return [random_factors(config, 4, seed=1), random_factors(config, 8, seed=2, products=("qkv", "down"))]


def greedy(executor, scheduler, loras, max_tokens=16, prompts=PROMPTS):
    from flared.execution.offline import drive
    from flared.model.sampling import SamplingParams

    ticks = iter(range(1, 10**9))  # a fake scheduler clock: no step looks late, decodes overlap
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens)] * len(prompts)
    return drive(scheduler, executor, prompts, params, loras=loras, clock_ns=lambda: next(ticks)).tokens


def cpu_model(hf, factors):
    """The CPU path's float32 model over the same weights, with ``factors`` as per-request adapters 1, 2, ..."""
    model = serving_model(hf, "cpu")
    for f in factors:
        model.add_lora_module(f)
    return model


def test_float32_greedy_tokens_with_mixed_adapters_match_the_cpu_path(hf):
    from flared.model.kernels.lora_rows import StackedLora

    gpu = serving_model(hf)
    factors = two_adapters(gpu.config)
    stacked = StackedLora(gpu.config, factors, dtype=torch.float32, device="cuda")
    ex = make_executor(gpu, prefill_batch_shapes=BATCH_SHAPES, lora=stacked)
    try:
        assert ex.decoder.lora is stacked
        got = greedy(ex, make_scheduler(graph_shapes=ex.graph_shapes), LORAS)
    finally:
        ex.close()
    cpu = cpu_model(hf, factors)
    assert got == greedy(make_cpu_executor(cpu), make_scheduler(), LORAS)
    base = greedy(make_cpu_executor(cpu), make_scheduler(), None)
    for tokens, base_tokens, adapter in zip(got, base, LORAS):  # the adapters moved their requests' tokens only
        assert (tokens == base_tokens) == (adapter == 0)


def _gpu_prefill_then_decode(dec, inputs, tokens, nxt, adapter):
    """One sequence's prefill chunk (pages 0.. in order: slot = position) then one decode step of token ``nxt``,
    both run eagerly on ``dec`` through the executor's static inputs with ``adapter`` on every row: (every prefill
    row's logits [n, V], the decode step's logits [V]), float32 on the host."""
    n, cap = len(tokens), 64
    s, d = inputs
    with torch.inference_mode():
        s.token_ids[:cap] = 0
        s.token_ids[:n] = torch.tensor(tokens)
        s.positions[:cap] = 0
        s.positions[:n] = torch.arange(n)
        s.slot_ids[:cap] = dec.scratch_slot
        s.slot_ids[:n] = torch.arange(n)
        s.block_tables[0, :8] = torch.arange(8)
        s.chunk_meta.zero_()
        s.chunk_meta[0, 1] = n
        s.logit_rows.zero_()
        s.logit_rows[0] = n - 1
        s.state_rows.zero_()
        s.state_rows[0] = 1
        s.temperature.zero_()
        s.lora_ids[:cap] = 0
        s.lora_ids[:n] = adapter
        h = dec.prefill(1, cap)
        prefill = F.linear(h[:n], dec.model.lm_head).float()
        d.token_ids[0] = nxt
        d.positions[0] = n
        d.slot_ids[0] = n
        d.state_rows[0] = 1
        d.block_tables[0, :8] = torch.arange(8)
        d.context_lens[0] = n + 1
        d.temperature[0] = 0
        d.lora_ids[0] = adapter
        dec.decode(1, False, mega=False, adapters=True)
        torch.cuda.synchronize()
        return prefill.cpu(), dec.logits[0].cpu()


def _cpu_prefill_then_decode(model, tokens, nxt, adapter):
    """The same on the CPU path (DecoderModel, its own KV cache)."""
    from flared.model.batch import ForwardBatch, SequenceChunk
    from flared.model.decoder import rms_norm

    n = len(tokens)
    kv = model.make_kv_cache(num_pages=8, page_tokens=PAGE_TOKENS)
    with torch.inference_mode():
        batch = ForwardBatch.build([SequenceChunk(tokens, 0, list(range(8)))], page_tokens=PAGE_TOKENS)
        if adapter:
            batch.lora_groups = [(adapter, torch.arange(n))]
        h = model._layers_forward(batch, kv)
        prefill = F.linear(rms_norm(h, model.final_norm, model.config.rms_norm_eps), model.lm_head).float()
        step = ForwardBatch.build([SequenceChunk([nxt], n, list(range(8)))], page_tokens=PAGE_TOKENS)
        if adapter:
            step.lora_groups = [(adapter, torch.tensor([0]))]
        return prefill, model.forward(step, kv)[0]


def test_bfloat16_fused_forward_with_adapters_tracks_the_cpu_path(hf):
    """The half-precision executor runs the fused layer loop with the LoRA hooks (prefill, and decode steps with
    ``adapters``, for which it captures a "decode_lora" graph of every decode capacity over both input regions):
    each adapter's prefill and decode logits agree with the float32 CPU path's to bf16 rounding, far closer than an
    adapter moves them; the captured graphs serve a mixed batch, where one prompt under one adapter gives the same
    tokens twice and other tokens under another adapter or none."""
    from flared.model.kernels.lora_rows import StackedLora

    model = serving_model(hf, dtype=torch.bfloat16)
    factors = two_adapters(model.config)
    stacked = StackedLora(model.config, factors, dtype=torch.bfloat16, device="cuda")
    assert all(a.dtype == torch.bfloat16 for pair in stacked.factors.values() for a in pair)
    ex = make_executor(model, prefill_batch_shapes=BATCH_SHAPES, lora=stacked)
    try:
        dec = ex.decoder
        assert dec.fused
        want_keys = {("decode_lora", b, b, full) for b in (1, 2, 4) for full in (False, True)}
        for execs in (ex.graphs.graph_execs, ex.graphs.graph_execs_b):
            assert {k for k in execs if k[0] == "decode_lora"} == want_keys
        prompt = list(range(300, 340))
        reference = cpu_model(hf, factors)
        want = {a: _cpu_prefill_then_decode(reference, prompt, 77, a) for a in (0, 1, 2)}
        for adapter in (0, 1, 2):
            got = _gpu_prefill_then_decode(dec, (ex.graphs.inputs, ex.graphs.decode_inputs), prompt, 77, adapter)
            for g, w, base in zip(got, want[adapter], want[0]):
                scale = w.abs().max().item()
                assert (g - w).abs().max().item() <= 0.05 * scale
                assert F.cosine_similarity(g.reshape(-1, w.shape[-1]), w.reshape(-1, w.shape[-1]), dim=-1).min() > 0.995
                if adapter:
                    assert (w - base).abs().max().item() > 0.2 * scale
        tokens = greedy(ex, make_scheduler(graph_shapes=ex.graph_shapes), [1, 0, 1, 2], prompts=[prompt] * 4)
    finally:
        ex.close()
    assert all(len(t) == 16 for t in tokens)
    assert tokens[0] == tokens[2] and tokens[3] != tokens[0] and tokens[1] not in (tokens[0], tokens[3])


def test_steps_without_an_adapter_row_take_the_graphs_without_adapters(hf, monkeypatch):
    """With adapters loaded, a decode step whose rows all run the base weights takes the graphs an executor without
    adapters has (here the skinny kernels, pinned on): base requests get the same tokens as there, bit for bit. A step
    with an adapter row takes a "decode_lora" graph, and once the adapter requests finish the base ones go back."""
    from flared.execution.offline import drive
    from flared.model.kernels.lora_rows import StackedLora
    from flared.model.sampling import SamplingParams

    monkeypatch.setenv("FLARED_SKINNY_MAX_ROWS", "4")
    monkeypatch.setenv("FLARED_MEGAKERNEL", "0")
    model = serving_model(hf, dtype=torch.bfloat16)
    plain = make_executor(model, prefill_batch_shapes=BATCH_SHAPES)
    try:
        assert plain.decoder.skinny_max_rows == 4
        base = greedy(plain, make_scheduler(graph_shapes=plain.graph_shapes), None)
    finally:
        plain.close()
    stacked = StackedLora(model.config, two_adapters(model.config), dtype=torch.bfloat16, device="cuda")
    ex = make_executor(model, prefill_batch_shapes=BATCH_SHAPES, lora=stacked)
    picked = []
    real = ex.graphs.pick_decode

    def record(rows, full, longest, adapters=False):
        key = real(rows, full, longest, adapters=adapters)
        picked.append(key[0])
        return key

    monkeypatch.setattr(ex.graphs, "pick_decode", record)
    try:
        assert ex.decoder.skinny_max_rows == 4
        assert greedy(ex, make_scheduler(graph_shapes=ex.graph_shapes), [0, 0, 0, 0]) == base
        assert set(picked) == {"decode"}
        picked.clear()
        ticks = iter(range(1, 10**9))
        # the adapter requests stop after 4 tokens, the base ones run on to 16
        params = [SamplingParams(temperature=0.0, max_tokens=4 if a else 16) for a in LORAS]
        mixed = drive(make_scheduler(graph_shapes=ex.graph_shapes), ex, PROMPTS, params, loras=LORAS,
                      clock_ns=lambda: next(ticks)).tokens
    finally:
        ex.close()
    assert [len(t) for t in mixed] == [4, 16, 4, 16]
    assert "decode_lora" in picked and picked[-1] == "decode"  # the base requests' last steps left the adapters' graphs


@pytest.mark.parametrize("rows,rank,n", [(1, 16, 6144), (5, 40, 576), (33, 100, 4096), (64, 24, 28672)])
def test_lora_expand_equals_the_torch_ops(rows, rank, n):
    """fused.lora_expand (the mask and the product back up in one launch) against mask.mul_ then addmm_: the same
    bf16 result up to the order of a float32 sum; masked rows keep their bits."""
    from flared.model.kernels import fused

    g = torch.Generator(device="cuda").manual_seed(rows + rank)
    low = torch.randn(rows, rank, device="cuda", generator=g).to(torch.bfloat16)
    mask = (torch.rand(rows, rank, device="cuda", generator=g) < 0.5).to(torch.bfloat16)
    mask[0] = 0
    b = (torch.randn(rank, n, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    y = torch.randn(rows, n, device="cuda", generator=g).to(torch.bfloat16)
    want = y.clone().addmm_(low * mask, b)
    got = fused.lora_expand(low, mask, b, y.clone())
    exact = (want.float() - y.float()).abs().max().item()
    assert exact > 0 or rows == 1
    assert torch.equal(got[0], y[0])
    assert (got.float() - want.float()).abs().max().item() <= 0.02 * max(1.0, want.float().abs().max().item())


def _write_peft_adapter(directory: Path, config, r=4, alpha=8, seed=0) -> None:
    """A PEFT adapter directory (save_pretrained's files) on q, v, o and down of every layer."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    c = config
    shapes = {"self_attn.q_proj": (c.hidden_size, c.q_size), "self_attn.v_proj": (c.hidden_size, c.kv_size),
              "self_attn.o_proj": (c.q_size, c.hidden_size), "mlp.down_proj": (c.intermediate_size, c.hidden_size)}
    tensors = {}
    for layer in range(c.num_layers):
        for name, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, fan_in, generator=g) * 0.3
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, r, generator=g) * 0.3
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"],
        "bias": "none"}))


def test_the_model_thread_serves_lora_modules_on_the_gpu(tiny_hf_llama, tmp_path):
    """ModelRuntime with --lora-modules on a bf16 core: the GraphExecutor's decoder gets the stacked adapter,
    requests naming it get other tokens than the base's in the same steps (the same tokens each time), and loading
    another adapter while serving is refused with a message that says why."""
    from flared.core.export import ExportOptions, export_core
    from flared.core.load import open_core
    from flared.errors import AdmissionError, ErrorKind
    from flared.model.sampling import SamplingParams
    from flared.runtime.request import ErrorEvent, GenerateRequest, TokenEvent
    from flared.runtime.worker import ModelRuntime
    from flared_testing.runtime import run_requests

    core = tmp_path / "tiny-bf16"
    export_core(tiny_hf_llama, core, ExportOptions(dtype="bfloat16", concurrency=4, context_tokens=256,
                                                   prefill_chunk_tokens=128))
    opened = open_core(core)
    adapter = tmp_path / "adapter"
    _write_peft_adapter(adapter, opened.config)
    rt = ModelRuntime(opened, prefix_cache=False, lora_modules=(("sql", str(adapter)),))
    rt.start(max_pending=16)
    try:
        assert type(rt.executor).__name__ == "GraphExecutor"
        assert rt.executor.decoder.lora is not None and rt.executor.decoder.lora.num_adapters == 1
        prompt = tuple([5, 17, 40, 99, 7] * 4)

        def request(lora):
            return GenerateRequest(prompt, (), SamplingParams(max_tokens=12, temperature=0.0), frozenset(), lora=lora)

        out = []
        for events in run_requests(rt, [request(1), request(0), request(1), request(0)]):
            assert not isinstance(events[-1], ErrorEvent), events[-1]
            out.append([t for e in events if isinstance(e, TokenEvent) for t in e.token_ids])
        assert out[0] == out[2] and out[1] == out[3] and out[0] != out[1]
        with pytest.raises(AdmissionError, match="needs adapter slots") as refused:
            rt.add_lora_module("other", str(adapter))  # started without --allow-runtime-lora-updating's slots
        assert refused.value.kind == ErrorKind.UNSUPPORTED
    finally:
        rt.stop()


def _greedy_tokens(rt, loras):
    """12 greedy tokens of one repeating prompt for each adapter index in ``loras`` (0: none), run at once."""
    from flared.model.sampling import SamplingParams
    from flared.runtime.request import ErrorEvent, GenerateRequest, TokenEvent
    from flared_testing.runtime import run_requests

    prompt = tuple([5, 17, 40, 99, 7] * 4)
    out = []
    for events in run_requests(rt, [GenerateRequest(prompt, (), SamplingParams(max_tokens=12, temperature=0.0),
                                                    frozenset(), lora=a) for a in loras]):
        assert not isinstance(events[-1], ErrorEvent), events[-1]
        out.append([t for e in events if isinstance(e, TokenEvent) for t in e.token_ids])
    return out


def test_float32_adapters_installed_into_slots_match_the_cpu_path(hf):
    """A stack captured with two empty slots (adapters loaded while serving): adapters written into the slots after
    capture (GraphExecutor.install_lora, on the model stream) give the float32 greedy tokens of the CPU path,
    exactly; a third finds no slot (503); a released slot takes the first adapter back under a new index."""
    from flared.errors import AdmissionError, ErrorKind
    from flared.model.kernels.lora_rows import StackedLora

    gpu = serving_model(hf)
    factors = two_adapters(gpu.config)
    stacked = StackedLora(gpu.config, [], dtype=torch.float32, device="cuda", slots=2, slot_width=24)
    ex = make_executor(gpu, prefill_batch_shapes=BATCH_SHAPES, lora=stacked)
    try:
        base = greedy(ex, make_scheduler(graph_shapes=ex.graph_shapes), None)
        assert [ex.install_lora(f, k + 1) for k, f in enumerate(factors)] == [0, 1]
        with pytest.raises(AdmissionError, match="all 2 LoRA adapter slots") as full:
            ex.install_lora(factors[0], 3)
        assert full.value.kind == ErrorKind.MODEL_CAPACITY
        got = greedy(ex, make_scheduler(graph_shapes=ex.graph_shapes), LORAS)
        ex.release_lora(1)
        assert ex.install_lora(factors[0], 3) == 0
        again = greedy(ex, make_scheduler(graph_shapes=ex.graph_shapes), [3, 0, 2, 0])
        gone = greedy(ex, make_scheduler(graph_shapes=ex.graph_shapes), [1, 1, 1, 1])  # 1 has no slot now
    finally:
        ex.close()
    cpu = cpu_model(hf, factors)
    want = greedy(make_cpu_executor(cpu), make_scheduler(), LORAS)
    assert got == want and again == want
    assert gone == base == greedy(make_cpu_executor(cpu), make_scheduler(), None)
    assert all((t == b) == (a == 0) for t, b, a in zip(got, base, LORAS))


def test_the_model_thread_loads_and_unloads_adapters_on_the_gpu_while_serving(tiny_hf_llama, tmp_path):
    """ModelRuntime with adapter slots (--allow-runtime-lora-updating --max-loras 1 --max-lora-rank 8) on a bf16
    core: an adapter loaded while serving gives the tokens the same adapter gives when given at start; with the
    slot taken another load is a 503; an adapter over the rank is refused; unloading frees the slot once the
    model thread drops it, and the next adapter takes it under a new index."""
    from flared.core.export import ExportOptions, export_core
    from flared.core.load import open_core
    from flared.errors import AdmissionError, CoreError, ErrorKind
    from flared.runtime.worker import ModelRuntime

    core = tmp_path / "tiny-bf16"
    export_core(tiny_hf_llama, core, ExportOptions(dtype="bfloat16", concurrency=4, context_tokens=256,
                                                   prefill_chunk_tokens=128))
    opened = open_core(core)
    first, second, wide = tmp_path / "first", tmp_path / "second", tmp_path / "wide"
    _write_peft_adapter(first, opened.config, seed=1)
    _write_peft_adapter(second, opened.config, seed=2)
    _write_peft_adapter(wide, opened.config, r=16, seed=3)

    at_start = ModelRuntime(opened, prefix_cache=False, lora_modules=(("first", str(first)),), lora_slots=1,
                            max_lora_rank=8)
    at_start.start(max_pending=16)
    try:
        assert at_start.executor.decoder.lora.slot_adapter == [1]
        want = _greedy_tokens(at_start, [1, 0])
    finally:
        at_start.stop()
    rt = ModelRuntime(opened, prefix_cache=False, lora_slots=1, max_lora_rank=8)
    rt.start(max_pending=16)
    try:
        stack = rt.executor.decoder.lora
        assert stack.slots == 1 and stack.slot_width == 24 and stack.slot_adapter == [-1]
        base = _greedy_tokens(rt, [0, 0])
        assert base == [want[1]] * 2
        assert rt.add_lora_module("first", str(first)) == 1 and stack.slot_adapter == [1]
        loaded = _greedy_tokens(rt, [1, 0, 1])
        assert loaded == [want[0], want[1], want[0]] and want[0] != want[1]
        with pytest.raises(AdmissionError, match="all 1 LoRA adapter slots") as full:
            rt.add_lora_module("second", str(second))
        assert full.value.kind == ErrorKind.MODEL_CAPACITY
        with pytest.raises(CoreError, match="rank 16 is over the slots' 8") as over:
            rt.add_lora_module("wide", str(wide))
        assert over.value.kind == ErrorKind.VALIDATION
        rt.remove_lora_module(1)
        for _ in range(200):
            if stack.free_slot() == 0:
                break
            time.sleep(0.01)
        assert stack.slot_adapter == [-1]
        assert rt.add_lora_module("second", str(second)) == 2 and stack.slot_adapter == [2]
        swapped = _greedy_tokens(rt, [2, 0])
        assert swapped[1] == want[1] and swapped[0] not in (want[0], want[1])
        with pytest.raises(AdmissionError, match="was unloaded"):
            _greedy_tokens(rt, [1])
    finally:
        rt.stop()


def test_the_model_thread_swaps_adapters_through_the_slots(tiny_hf_llama, tmp_path):
    """--max-cpu-loras 2 with one slot: a second adapter loads into host memory; a request naming it brings it into
    the slot in place of the idle first one, and gives the tokens that adapter gives when it holds the slot from
    the start; requests for both at once take turns in the slot (the base request beside them does not wait); a
    third load is a 503; an unloaded adapter's requests are refused; an adapter kept busy by a stream of requests
    does not keep another out of the slot."""
    from flared.core.export import ExportOptions, export_core
    from flared.core.load import open_core
    from flared.errors import AdmissionError, ErrorKind
    from flared.runtime.worker import ModelRuntime

    core = tmp_path / "tiny-bf16"
    export_core(tiny_hf_llama, core, ExportOptions(dtype="bfloat16", concurrency=4, context_tokens=256,
                                                   prefill_chunk_tokens=128))
    opened = open_core(core)
    paths = {name: tmp_path / name for name in ("first", "second", "third")}
    for seed, path in enumerate(paths.values(), 1):
        _write_peft_adapter(path, opened.config, seed=seed)

    want = {}
    for name in ("first", "second"):
        at_start = ModelRuntime(opened, prefix_cache=False, lora_modules=((name, str(paths[name])),), lora_slots=1,
                                max_lora_rank=8)
        at_start.start(max_pending=16)
        try:
            want[name], want["base"] = _greedy_tokens(at_start, [1, 0])
        finally:
            at_start.stop()
    assert len({tuple(v) for v in want.values()}) == 3
    rt = ModelRuntime(opened, prefix_cache=False, lora_slots=1, max_lora_rank=8, max_cpu_loras=2)
    rt.start(max_pending=16)
    try:
        stack = rt.executor.decoder.lora
        assert rt.add_lora_module("first", str(paths["first"])) == 1 and stack.slot_adapter == [1]
        assert rt.add_lora_module("second", str(paths["second"])) == 2 and stack.slot_adapter == [1]
        with pytest.raises(AdmissionError, match="2 LoRA adapters are loaded") as full:
            rt.add_lora_module("third", str(paths["third"]))
        assert full.value.kind == ErrorKind.MODEL_CAPACITY
        assert _greedy_tokens(rt, [2]) == [want["second"]] and stack.slot_adapter == [2]
        assert rt.stats["lora_swaps_in"] == 1
        assert _greedy_tokens(rt, [1, 2, 0, 1]) == [want["first"], want["second"], want["base"], want["first"]]
        # the slot held 2: both adapters served means 1 came in, then 2 again if it went last (either order)
        assert rt.stats["lora_swaps_in"] >= 2
        rt.remove_lora_module(2)
        for _ in range(200):
            if 2 not in rt._lora_host:
                break
            time.sleep(0.01)
        with pytest.raises(AdmissionError, match="was unloaded"):
            _greedy_tokens(rt, [2])
        assert rt.add_lora_module("third", str(paths["third"])) == 3
        assert _greedy_tokens(rt, [1]) == [want["first"]]
        # An adapter in constant use does not keep another out of the slot: with three requests for "third"
        # always in flight, one for "first" gets the slot once those admitted before it finish.
        order, tokens = _stream_with_one_other(rt, stream_lora=3, other_lora=1, total=24, in_flight=3)
        assert tokens[1] == [want["first"]]
        assert order.index("other") <= 12, order
    finally:
        rt.stop()


def _stream_with_one_other(rt, *, stream_lora, other_lora, total, in_flight):
    """``total`` greedy requests naming ``stream_lora``, ``in_flight`` at a time (a new one as each ends), and one
    naming ``other_lora`` submitted once three of them have finished. The stream's requests run 7, 12 and 17
    tokens in turn, so they end at different steps and the adapter is never out of use between them. Returns the
    order of finishes ("stream" / "other") and {adapter: [tokens of each of its requests]}."""
    import asyncio

    from flared.model.sampling import SamplingParams
    from flared.runtime.request import ErrorEvent, EventSink, FinishEvent, GenerateRequest, TokenEvent

    prompt = tuple([5, 17, 40, 99, 7] * 4)

    def request(lora, max_tokens):
        return GenerateRequest(prompt, (), SamplingParams(max_tokens=max_tokens, temperature=0.0), frozenset(),
                               lora=lora)

    async def go():
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        events: dict[int, list] = {}
        kinds: dict[int, str] = {}
        submitted = 0
        order: list[str] = []

        def submit(kind, lora):
            key = len(kinds)
            kinds[key], events[key] = kind, []
            rt.submit(request(lora, 12 if kind == "other" else (7, 12, 17)[key % 3]), EventSink(loop, queue, key))

        for _ in range(in_flight):
            submit("stream", stream_lora)
            submitted += 1
        while len(order) < total + 1:
            key, e = await queue.get()
            events[key].append(e)
            assert not isinstance(e, ErrorEvent), e
            if not isinstance(e, FinishEvent):
                continue
            order.append(kinds[key])
            if order.count("stream") == 3 and "other" not in kinds.values():
                submit("other", other_lora)
            if kinds[key] == "stream" and submitted < total:
                submit("stream", stream_lora)
                submitted += 1
        tokens: dict[int, list] = {}
        for key, evs in events.items():
            lora = stream_lora if kinds[key] == "stream" else other_lora
            tokens.setdefault(lora, []).append([t for e in evs if isinstance(e, TokenEvent) for t in e.token_ids])
        return order, tokens

    return asyncio.run(go())
