"""The decode megakernel (kernels/decode_layers.cu) against the fused decode path it replaces.

Same weights, same paged KV cache (random contents, scattered pages, rows at different context lengths
and a padding row): the step's logits, the K/V it writes and nothing else it touches must agree with the
cuBLAS + fused-kernel forward to bfloat16 rounding; a captured graph must replay it bit for bit.
"""

import pytest

torch = pytest.importorskip("torch")

PAGE = 16
# one resident block a kv head at every context (decode_layers.cu: RES_SPLIT no context reaches, RES_SPLIT4 off)
NO_GROUPS = {"RES_SPLIT": 1 << 30, "RES_SPLIT4": 0}


def _hf(kind, seed=0):
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    torch.manual_seed(seed)
    common = dict(vocab_size=512, num_hidden_layers=3, max_position_embeddings=1024, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=0)
    if kind == "llama64":  # head_dim 64, GQA 2:1
        cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, **common)
        return LlamaForCausalLM(cfg)
    if kind == "smollm":  # SmolLM2-135M's widths (a row of 576 ends mid-way through a warp's third chunk); a
        # vocabulary that takes the in-kernel LM head two rounds of four rows per warp, the last one partial
        cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                          **dict(common, num_hidden_layers=2, vocab_size=8192))
        return LlamaForCausalLM(cfg)
    if kind == "long":  # a row over 2,048 elements: the long-row build (16 warps), as 8B's
        cfg = LlamaConfig(hidden_size=256, intermediate_size=2304, num_attention_heads=2, num_key_value_heads=1,
                          **common)
        return LlamaForCausalLM(cfg)
    if kind == "wide":  # every row over 2,048 elements (8B-like: P1 and P3 stream, k pairs fill two rounds)
        cfg = LlamaConfig(hidden_size=2304, intermediate_size=2560, num_attention_heads=18, num_key_value_heads=2,
                          **dict(common, num_hidden_layers=2))
        return LlamaForCausalLM(cfg)
    if kind == "tailed":  # a long MLP row: the product-input buffer holds 32 keys of attention's tail (RES)
        cfg = LlamaConfig(hidden_size=256, intermediate_size=8192, num_attention_heads=2, num_key_value_heads=1,
                          **common)
        return LlamaForCausalLM(cfg)
    if kind == "llama128":  # head_dim 128, GQA 4:1 (Llama-3 8B's grouping)
        cfg = LlamaConfig(hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=1,
                          **common)
        return LlamaForCausalLM(cfg)
    if kind == "mistral":  # a 48-token sliding window: the megakernel serves contexts inside it
        cfg = MistralConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                            sliding_window=48, **common)
        return MistralForCausalLM(cfg)
    cfg = Qwen2Config(hidden_size=384, intermediate_size=768, num_attention_heads=6, num_key_value_heads=2, **common)
    return Qwen2ForCausalLM(cfg)  # QKV bias, head_dim 64, GQA 3:1


def _serving(hf, dtype):
    from gpu_models import serving_model

    return serving_model(hf, dtype=dtype, max_positions=1024)  # contexts here reach 1,000 tokens


def _decoder(kind, batch, contexts):
    from flared.model.kernels.paged_decoder import PagedCudaDecoder, StaticInputs

    hf = _hf(kind).eval().to(device="cuda", dtype=torch.bfloat16)
    model = _serving(hf, torch.bfloat16)
    dev = model.device
    max_pages = 1024 // PAGE
    num_pages = batch * max_pages
    g = torch.Generator(device=dev).manual_seed(1)
    i64, i32, f32 = torch.int64, torch.int32, torch.float32
    inputs = StaticInputs(
        token_ids=torch.randint(3, 512, (batch,), device=dev, generator=g),
        positions=torch.zeros(batch, dtype=i64, device=dev), slot_ids=torch.zeros(batch, dtype=i64, device=dev),
        state_rows=torch.arange(1, batch + 1, dtype=i64, device=dev),
        block_tables=torch.randperm(num_pages, device=dev, generator=g).to(i32).view(batch, max_pages),
        context_lens=torch.tensor(contexts, dtype=i32, device=dev),
        chunk_meta=torch.zeros(batch, 2, dtype=i32, device=dev), logit_rows=torch.zeros(batch, dtype=i64, device=dev),
        temperature=torch.zeros(batch, dtype=f32, device=dev), top_k=torch.zeros(batch, dtype=i32, device=dev),
        top_p=torch.ones(batch, dtype=f32, device=dev), seeds=torch.zeros(batch, dtype=i64, device=dev),
        steps=torch.zeros(batch, dtype=i64, device=dev))
    dec = PagedCudaDecoder(model, inputs, num_pages=num_pages, page_tokens=PAGE, num_state_rows=batch + 1,
                           max_batch=batch, max_tokens=batch)
    for row, ctx in enumerate(contexts):
        if ctx == 0:  # a padding row: position 0, the scratch slot, no context
            inputs.slot_ids[row] = dec.scratch_slot
            inputs.block_tables[row] = num_pages
            continue
        pos = ctx - 1
        inputs.positions[row] = pos
        inputs.slot_ids[row] = int(inputs.block_tables[row, pos // PAGE]) * PAGE + pos % PAGE
    for pool in (dec.k_pool, dec.v_pool):
        pool.copy_(torch.randn(pool.shape, device=dev, generator=g).to(pool.dtype))
    return model, dec


def _step(dec, batch, mega):
    dec.skinny_max_rows = 0
    dec.mega_max_rows = batch if mega else 0
    k0, v0 = dec.k_pool.clone(), dec.v_pool.clone()
    dec.decode(batch, False, mega=mega)
    torch.cuda.synchronize()
    result = dec.logits[:batch].clone(), dec.k_pool.clone(), dec.v_pool.clone()
    dec.k_pool.copy_(k0)
    dec.v_pool.copy_(v0)
    return result


@pytest.mark.parametrize("kind, contexts", [
    ("llama64", [1]),
    ("llama64", [255, 3]),  # shorter than 3 * SPLIT_KEYS: attention unsplit
    ("llama64", [700, 33, 0, 5]),
    ("llama128", [1000, 64]),
    ("long", [700, 33]),  # 44 keys a warp: more than one V tile
    ("long", [700]),  # one row: split attention at 16 warps, merged by each head's last block
    ("wide", [300, 17]),
    ("wide", [300]),  # 18 heads in 2 pieces of 150 keys
    ("smollm", [255, 3]),
    ("smollm", [600]),
    ("qwen2", [300, 17, 129, 1, 0, 2, 999, 48]),
    ("mistral", [48, 9, 0, 1]),  # every context inside the window (the longest fills it)
])
def test_megakernel_matches_the_fused_path(kind, contexts):
    from flared.model.kernels import megakernel

    batch = len(contexts)
    model, dec = _decoder(kind, batch, contexts)
    assert megakernel.unsupported(model) is None and dec.mega_limit >= min(batch, 8)
    ref_logits, ref_k, ref_v = _step(dec, batch, mega=False)
    logits, k, v = _step(dec, batch, mega=True)
    # greedy: the kernel's argmax (first maximal index) is the token, also recorded for the state row
    assert torch.equal(dec.sampled[:batch], logits.argmax(-1))
    assert torch.equal(dec.last_token[dec.inputs.state_rows[:batch]], dec.sampled[:batch])
    assert torch.equal(dec.state_logits[dec.inputs.state_rows[:batch]], logits)
    live = [r for r, c in enumerate(contexts) if c > 0]
    scale = ref_logits[live].abs().max().item()
    assert (logits[live] - ref_logits[live]).abs().max().item() <= 0.03 * scale
    cos = torch.nn.functional.cosine_similarity(logits[live], ref_logits[live], dim=-1)
    assert cos.min().item() > 0.999
    assert (logits[live].argmax(-1) == ref_logits[live].argmax(-1)).float().mean().item() >= 0.75
    # K/V: the new tokens' slots agree to rounding, every other slot is untouched
    slots = dec.inputs.slot_ids[:batch]
    live_slots = slots[live]
    for got, ref in ((k, ref_k), (v, ref_v)):
        assert (got[:, live_slots].float() - ref[:, live_slots].float()).abs().max().item() <= 0.05 * (
            ref[:, live_slots].float().abs().max().item())
        other = torch.ones(got.shape[1], dtype=torch.bool, device=got.device)
        other[slots] = False
        assert torch.equal(got[:, other], ref[:, other])


@pytest.mark.parametrize("kind, context, overrides", [
    ("long", 100, {}),  # 2 query heads a kv head, one block
    ("long", 200, {}),  # from 129 tokens a pair of resident blocks a kv head: keys [0, 112) and [112, 200)
    ("long", 330, NO_GROUPS),  # every key in one block (336 fit on an H200 at this width)
    ("long", 400, {"RES_SPLIT4": 0}),  # past RES_CAP (no tail room: a short MLP row): a pair, [0, 208) and [208, 400)
    ("long", 400, {}),  # from 257 tokens four blocks: [0, 112), [112, 208), [208, 304), [304, 400)
    ("long", 700, {}),  # four, past a pair's keys
    ("long", 700, NO_GROUPS),  # past one block's keys without groups: the split path, V tiles in the resident region
    ("long", 100, {"RES_SPLIT": 64}),  # a pair from 64 tokens: [0, 64) and [64, 100)
    ("long", 33, {"RES_SPLIT": 32}),  # the shortest pair: [0, 32) and the step's own key
    ("wide", 1, {}),  # only the step's own key
    ("wide", 300, {}),  # 9 query heads a kv head (rows 8.. of the 16-row operand); two kv heads' fours
    ("wide", 300, {"RES_SPLIT4": 0}),  # the same in pairs
    ("wide", 300, NO_GROUPS),  # and in one block a kv head
    ("tailed", 340, NO_GROUPS),  # 320 resident, 20 copied into the product-input buffer during attention
    ("tailed", 400, {"RES_SPLIT4": 0}),  # a pair
    ("tailed", 90, {"RES_CAP": 64}),  # 64 resident, 26 in the product-input buffer
    ("tailed", 128, {"RES_CAP": 64, "RES_SPLIT": 97}),  # past 64 + 32 keys of tail: a pair of 64 keys (2 * RES_CAP)
    ("tailed", 128, {"RES_CAP": 64, "RES_SPLIT4": 128}),  # the shortest four: 32 keys a part
    ("llama64", 300, {"RES": 1}),  # head_dim 64, 8 warps, the LM head inside; four blocks
    ("qwen2", 129, {"RES": 1}),  # 3 query heads a kv head, QKV bias; a pair
    ("llama128", 250, {"RES": 1}),  # Llama-3's grouping, one kv head; a pair
    ("llama128", 250, {"RES": 1, "RES_SPLIT4": 129}),  # the same in four blocks
    ("llama128", 250, {"RES": 1, **NO_GROUPS}),  # and in one
    ("llama128", 40, {"RES": 1, "RES_CAP": 16}),  # no tail room (a short MLP row): the split path
])
def test_resident_attention_matches_the_fused_path(kind, context, overrides):
    """One row's attention from keys the kv heads' blocks (or groups of two or four, RES_SPLIT and RES_SPLIT4)
    copied into shared memory a layer ahead (RES): the fused path's logits to bfloat16 rounding, the same K/V
    written, and launch after launch the same bits."""
    from flared.model.kernels import megakernel

    model, dec = _decoder(kind, 1, [context])
    ref_logits, ref_k, ref_v = _step(dec, 1, mega=False)
    kernel = megakernel.DecodeLayers(model, dec.k_pool, dec.v_pool, 1, head=dec.mega_head, overrides=overrides)
    kernel.compile(PAGE)
    assert kernel.resident_keys >= 16 and kernel.resident_keys % 16 == 0
    if not overrides:
        assert megakernel.resident(model, 1, False)
    dec.mega[(1, dec.mega_head)] = kernel
    logits, k, v = _step(dec, 1, mega=True)
    scale = ref_logits.abs().max().item()
    assert (logits - ref_logits).abs().max().item() <= 0.03 * scale
    assert torch.nn.functional.cosine_similarity(logits, ref_logits, dim=-1).min().item() > 0.999
    slot = dec.inputs.slot_ids[0]
    for got, ref in ((k, ref_k), (v, ref_v)):
        assert (got[:, slot].float() - ref[:, slot].float()).abs().max().item() <= 0.05 * (
            ref[:, slot].float().abs().max().item())
        other = torch.ones(got.shape[1], dtype=torch.bool, device=got.device)
        other[slot] = False
        assert torch.equal(got[:, other], ref[:, other])
    for _ in range(2):
        again, _, _ = _step(dec, 1, mega=True)
        assert torch.equal(again, logits)
    # and the same launch without residence (the split path) agrees to float32 order and P's bf16 rounding
    plain_kernel = megakernel.DecodeLayers(model, dec.k_pool, dec.v_pool, 1, head=dec.mega_head,
                                           overrides={**overrides, "RES": 0})
    plain_kernel.compile(PAGE)
    dec.mega[(1, dec.mega_head)] = plain_kernel
    plain, _, _ = _step(dec, 1, mega=True)
    assert (logits - plain).abs().max().item() <= 0.02 * plain.abs().max().item()


@pytest.mark.parametrize("kind, contexts", [
    ("llama64", [1]),
    ("llama64", [700, 33, 0, 5]),  # split attention: partials through the tagged words
    ("llama64", [200, 190, 7]),  # pieces of 64 keys (its split threshold) and short V tiles
    ("long", [700, 1]),
    ("smollm", [255, 3]),
    ("qwen2", [300, 17, 129, 1, 0, 2, 999, 48]),
])
def test_the_low_latency_exchange_matches_the_barrier_kernel(kind, contexts):
    """The tagged-word build (no grid barrier between phases; attention takes the step's own key and value
    from P1's words): the same logits as the barrier build to float32 summation order, the same K/V written,
    and launch after launch (the epoch in the tags) the same result bit for bit."""
    batch = len(contexts)
    model, dec = _decoder(kind, batch, contexts)
    plain, pk, pv = _step(dec, batch, mega=True)
    dec._set_low_latency(batch, True)
    ll, lk, lv = _step(dec, batch, mega=True)
    assert dec.mega[(batch, dec.mega_head)].low_latency
    tokens = dec.sampled[:batch].clone()
    for _ in range(3):
        again, _, _ = _step(dec, batch, mega=True)
        assert torch.equal(again, ll) and torch.equal(dec.sampled[:batch], tokens)
    assert torch.equal(tokens, ll.argmax(-1))
    live = [r for r, c in enumerate(contexts) if c > 0]
    scale = plain[live].abs().max().item()
    assert (ll[live] - plain[live]).abs().max().item() <= 0.01 * scale
    assert torch.nn.functional.cosine_similarity(ll[live], plain[live], dim=-1).min().item() > 0.9999
    assert torch.equal(lk[0], pk[0]) and torch.equal(lv[0], pv[0])
    for got, ref in ((lk, pk), (lv, pv)):
        assert (got.float() - ref.float()).abs().max().item() <= 0.02 * ref.float().abs().max().item()
    # and back: the barrier build again gives its own result (the counters carry on across builds' launches)
    dec._set_low_latency(batch, False)
    back, _, _ = _step(dec, batch, mega=True)
    assert torch.equal(back, plain)


@pytest.mark.parametrize("overrides", [{"P1_BALANCE": 0}, {"GEMV_BATCH": 8}, {"GEMV_BATCH": 6, "GEMV_BATCH_PAIR": 4}])
def test_p1_slots_and_load_batches_change_no_bit(overrides):
    """Which warp streams which QKV row, and how many loads a lane issues together, change no arithmetic:
    the same logits and K/V bit for bit."""
    from flared.model.kernels import megakernel

    contexts = [300, 17]
    batch = len(contexts)
    model, dec = _decoder("wide", batch, contexts)
    plain, pk, pv = _step(dec, batch, mega=True)
    kernel = megakernel.DecodeLayers(model, dec.k_pool, dec.v_pool, batch, head=dec.mega_head, overrides=overrides)
    kernel.compile(PAGE)
    dec.mega[(batch, dec.mega_head)] = kernel
    for _ in range(2):
        got, k, v = _step(dec, batch, mega=True)
        assert torch.equal(got, plain) and torch.equal(k, pk) and torch.equal(v, pv)


def test_megakernel_graph_replay_is_bit_identical():
    from flared.execution.graphs import time_graph_us

    model, dec = _decoder("llama64", 2, [700, 9])
    logits, k, v = _step(dec, 2, mega=True)
    # eager once, then captured and replayed six times: every replay rewrites the same slots with the same
    # values and reads the same cache, so it must give the eager step's results exactly (the split heads'
    # arrival counters too must start each launch at zero)
    time_graph_us(lambda: dec.decode(2, False), torch.cuda.Stream(), replays=5)
    torch.cuda.synchronize()
    assert torch.equal(dec.logits[:2], logits)
    assert torch.equal(dec.k_pool, k) and torch.equal(dec.v_pool, v)


def test_calibration_times_the_megakernel():
    model, dec = _decoder("llama64", 4, [0, 0, 0, 0])  # padding inputs, as GraphSet calibrates
    dec.calibrate(torch.cuda.Stream())
    cal = dec.calibration
    assert "megakernel_error" not in cal, cal
    assert cal["mega_us"] and set(cal["mega_us"]) <= {1, 2, 4}
    assert dec.mega_max_rows in (0, 1, 2, 4)
    # both builds timed at each batch tried; the tagged-word one kept only where it won
    assert set(cal["mega_ll_us"]) == set(cal["mega_barrier_us"]) == set(cal["mega_us"])
    assert set(cal["mega_ll_rows"]) == {b for b in cal["mega_ll_us"]
                                        if cal["mega_ll_us"][b] < 0.99 * cal["mega_barrier_us"][b]
                                        and b <= dec.mega_max_rows}


def test_a_tagged_word_build_that_fails_leaves_the_barrier_build(monkeypatch):
    """A tagged-word build that cannot be made (here: compile raises, as for a build needing more registers
    than its block allows) leaves calibration with the barrier build, not without the megakernel."""
    from flared.model.kernels import megakernel

    real = megakernel.DecodeLayers.compile

    def compile_(self, page_tokens):
        if self.low_latency:
            raise RuntimeError("the decode megakernel needs 256 threads per block; this build allows 128")
        real(self, page_tokens)

    monkeypatch.setattr(megakernel.DecodeLayers, "compile", compile_)
    model, dec = _decoder("llama64", 2, [0, 0])
    dec.calibrate(torch.cuda.Stream())
    cal = dec.calibration
    assert "megakernel_error" not in cal and "needs 256 threads" in cal["megakernel_ll_error"]
    assert cal["mega_ll_rows"] == [] and dec.mega_ll_rows == set()
    assert cal["mega_ll_us"] and set(cal["mega_ll_us"]) == set(cal["mega_us"])
    assert all(us == float("inf") for us in cal["mega_ll_us"].values())
    assert cal["mega_us"] == cal["mega_barrier_us"]


def test_unsupported_models_say_why():
    from gpu_models import serving_model, tiny_hf

    from flared.model.kernels import megakernel

    assert "head_dim 32" in megakernel.unsupported(serving_model(tiny_hf(dtype=torch.bfloat16),
                                                                 dtype=torch.bfloat16))
    model = _serving(_hf("llama64").eval().to("cuda"), torch.float32)
    assert "bfloat16 only" in megakernel.unsupported(model)
    with pytest.raises(ValueError, match="does not support"):
        megakernel.DecodeLayers(model, None, None, 1)


def _record_picks(monkeypatch, ex) -> list:
    """(longest context, graph kind) of every decode graph ``ex`` picks from now on."""
    picked = []
    real = ex.graphs.pick_decode

    def record(rows, full, longest, adapters=False):
        key = real(rows, full, longest, adapters=adapters)
        picked.append((longest, key[0]))
        return key

    monkeypatch.setattr(ex.graphs, "pick_decode", record)
    return picked


def test_executor_runs_the_megakernel_graphs_while_contexts_are_short(monkeypatch):
    """Forced on, the executor captures megakernel decode graphs beside the plain ones and takes them only
    while the step's longest context is within the limit; greedy output is repeatable across drives."""
    from gpu_models import make_executor, make_scheduler

    from flared.execution.offline import drive
    from flared.model.sampling import SamplingParams

    monkeypatch.setenv("FLARED_MEGAKERNEL", "1")
    monkeypatch.setenv("FLARED_MEGAKERNEL_MAX_CONTEXT", "40")
    model = _serving(_hf("llama64").eval().to(device="cuda", dtype=torch.bfloat16), torch.bfloat16)
    ex = make_executor(model)
    try:
        mega_keys = {(k[0], k[1]) for k in ex.graphs.graph_execs if k[0] == "decode_mega"}
        assert mega_keys == {("decode_mega", 1), ("decode_mega", 2), ("decode_mega", 4)}
        picked = _record_picks(monkeypatch, ex)
        p = SamplingParams(max_tokens=24, temperature=0.0)
        first = drive(make_scheduler(), ex, [list(range(5, 30))], [p])
        again = drive(make_scheduler(), ex, [list(range(5, 30))], [p])
        assert first.tokens == again.tokens and len(first.tokens[0]) == 24
        # prompt 25 + up to 24 new tokens: contexts 26..49 cross the limit of 40
        assert all(kind == ("decode_mega" if longest <= 40 else "decode") for longest, kind in picked)
        assert {kind for _, kind in picked} == {"decode", "decode_mega"}
    finally:
        ex.close()


def _same_bits_as(kind, context, *, reference: dict, build: dict) -> None:
    """A one-row resident build with the ``build`` overrides gives the logits and K/V of one with ``reference``'s,
    bit for bit, launch after launch."""
    from flared.model.kernels import megakernel

    model, dec = _decoder(kind, 1, [context])
    kernels = [megakernel.DecodeLayers(model, dec.k_pool, dec.v_pool, 1, head=dec.mega_head, overrides=o)
               for o in (reference, build)]
    for kernel in kernels:
        kernel.compile(PAGE)
    assert kernels[0].resident_keys
    dec.mega[(1, dec.mega_head)] = kernels[0]
    ref, rk, rv = _step(dec, 1, mega=True)
    dec.mega[(1, dec.mega_head)] = kernels[1]
    for _ in range(3):
        got, k, v = _step(dec, 1, mega=True)
        assert torch.equal(got, ref) and torch.equal(k, rk) and torch.equal(v, rv)


@pytest.mark.parametrize("hx", [1, 2, 4, 7])
@pytest.mark.parametrize("kind, context", [("long", 200), ("wide", 300), ("tailed", 340), ("long", 700), ("wide", 1)])
def test_the_word_exchange_around_resident_attention_changes_no_bit(kind, context, hx):
    """HX: phase boundaries as tagged words instead of grid barriers (bit 0: P1 -> P2 -> P3, the resident blocks
    poll the queries and the step's key and value, every block polls the attention output; bit 1: P3 -> P4; bit 2:
    P5 -> the next P1): the barrier build's logits and K/V bit for bit, launch after launch, with one resident
    block a kv head (groups need bit 0: below); past the resident keys (700) bit 0 exchanges the same words around
    the split path (its blocks poll q and the step's key and value, the head's last block writes attn as words)."""
    _same_bits_as(kind, context, reference={"HX": 0, **NO_GROUPS}, build={"HX": hx, **NO_GROUPS})


@pytest.mark.parametrize("kind, context, groups", [("long", 200, {}), ("wide", 300, {}),
                                                   ("tailed", 400, {"RES_SPLIT4": 0}), ("long", 400, {})])
def test_the_later_word_exchanges_around_resident_groups_change_no_bit(kind, context, groups):
    """With groups of resident blocks, pairs or fours (which exchange their partials as words, so HX bit 0 only):
    P3 -> P4 and P5 -> the next P1 as words too (bits 1 and 2) give bit 0's logits and K/V bit for bit, launch
    after launch."""
    _same_bits_as(kind, context, reference={"HX": 1, **groups}, build={"HX": 7, **groups})


@pytest.mark.parametrize("kind, context, groups", [("long", 100, {}), ("wide", 300, {}), ("long", 200, {}),
                                                   ("long", 700, NO_GROUPS), ("wide", 1, {})])
def test_staged_o_rows_change_no_bit(kind, context, groups):
    """STAGE_O (the default where the rows fit): the non-resident blocks copy their warps' first o rows into the idle
    resident region during attention and P3 sums them in warp_dot's order, so the logits and K/V are those of the
    build without it bit for bit, launch after launch (beside fours at 300, a pair at 200); past the resident keys
    (700 without groups) the blocks without an attention piece do."""
    _same_bits_as(kind, context, reference={"STAGE_O": 0, **groups}, build=groups)


def test_a_window_model_runs_the_megakernel_while_contexts_fit_the_window(monkeypatch):
    """A sliding-window model (Mistral, window 48): the megakernel has no window, so the decoder caps its contexts
    at the window and the executor takes its graphs only while every context is inside it; the plain graphs
    (windowed Triton attention) after that. Greedy output is repeatable, and the first token (the prefill's)
    is the megakernel-free executor's."""
    from gpu_models import make_executor, make_scheduler

    from flared.execution.offline import drive
    from flared.model.kernels import megakernel
    from flared.model.sampling import SamplingParams

    model = _serving(_hf("mistral").eval().to(device="cuda", dtype=torch.bfloat16), torch.bfloat16)
    assert model.config.sliding_window == 48 and megakernel.unsupported(model) is None
    p = SamplingParams(max_tokens=24, temperature=0.0)
    prompt = [list(range(5, 40))]  # 35 tokens + 24 new: contexts 36..59 cross the window
    monkeypatch.setenv("FLARED_MEGAKERNEL", "0")
    ex = make_executor(model)
    try:
        plain = drive(make_scheduler(), ex, prompt, [p]).tokens
    finally:
        ex.close()
    monkeypatch.setenv("FLARED_MEGAKERNEL", "1")
    ex = make_executor(model)
    try:
        assert ex.decoder.window == 48 and ex.decoder.mega_max_context == 48 and ex.decoder.mega_max_rows == 4
        picked = _record_picks(monkeypatch, ex)
        first = drive(make_scheduler(), ex, prompt, [p]).tokens
        again = drive(make_scheduler(), ex, prompt, [p]).tokens
    finally:
        ex.close()
    assert first == again and len(first[0]) == 24 and first[0][0] == plain[0][0]
    assert all(kind == ("decode_mega" if longest <= 48 else "decode") for longest, kind in picked)
    assert {kind for _, kind in picked} == {"decode", "decode_mega"}
