"""DeepSeek V2 / V3 beyond the shared parity tests (test_parity_hf.py runs both families: latent attention, YaRN with
DeepSeek's mscales, V2's scaled softmax routing and V3's grouped sigmoid routing, shared experts, a dense first layer):
a served core's greedy tokens, and what is refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flared.errors import CoreError, ErrorKind  # noqa: E402
from flared.model.loader import read_source  # noqa: E402

from .conftest import build_hf_checkpoint  # noqa: E402


def test_a_deepseek_core_serves_transformers_tokens(tmp_path):
    """Exported (the router kept float32) and served by flared run: greedy chat tokens equal transformers'; asked
    again, the prompt's latent rows come back from the prefix cache and give the same tokens."""
    from flared_testing.served import assert_served_greedy_equals_transformers

    directory = build_hf_checkpoint("deepseek_v3", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    again = []

    def ask_again(daemon):
        status, body = daemon.chat([{"role": "user", "content": "Tell me a story about a fox."}], max_tokens=16,
                                   temperature=0, ignore_eos=True, logprobs=True, return_tokens_as_token_ids=True)
        assert status == 200, body
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        again.extend(int(t["token"].split(":")[1]) for t in body["choices"][0]["logprobs"]["content"])

    assert assert_served_greedy_equals_transformers(directory, hf, tmp_path, also=ask_again) == again


def test_the_cache_holds_one_latent_row_a_token(tmp_path, monkeypatch):
    """Latent attention is served absorbed (ModelConfig.latent_kv): a layer keeps one kv_lora_rank + rope wide row a
    token and no values, where the expanded layout (FLARED_MLA_EXPANDED=1) keeps a key and a value of head_dim per
    head; an exported core's KV budget holds as many more pages."""
    from flared_testing.served import write_char_tokenizer

    from flared.core.export import ExportOptions, export_core
    from flared.core.manifest import read_manifest
    from flared.model.kv_cache import PagedKVCache

    directory = build_hf_checkpoint("deepseek_v2", tmp_path / "hf")
    write_char_tokenizer(directory, 512)
    config = read_source(directory).config
    assert (config.num_heads, config.head_dim, config.rotary_dim, config.v_head_dim, config.kv_lora_rank) == \
        (4, 24, 8, 12, 32)
    assert config.graph_obstacle == "multi-head latent attention" and config.router_float32
    assert config.latent_kv and (config.kv_storage_heads, config.kv_value_rows, config.kv_row_dim) == (1, 0, 40)
    latent = PagedKVCache(config, num_pages=4, page_tokens=8, dtype=torch.float32)
    pages = {}
    export_core(directory, tmp_path / "latent", ExportOptions(concurrency=64, context_tokens=256, kv_cache_mib=1))
    pages["latent"] = read_manifest(tmp_path / "latent").capacities.kv_pages
    monkeypatch.setenv("FLARED_MLA_EXPANDED", "1")
    assert not config.latent_kv and (config.kv_storage_heads, config.kv_value_rows, config.kv_row_dim) == (4, 4, 24)
    expanded = PagedKVCache(config, num_pages=4, page_tokens=8, dtype=torch.float32)
    export_core(directory, tmp_path / "expanded", ExportOptions(concurrency=64, context_tokens=256, kv_cache_mib=1))
    pages["expanded"] = read_manifest(tmp_path / "expanded").capacities.kv_pages
    assert latent.values.numel() == 0 and latent.num_bytes * 2 * 4 * 24 == expanded.num_bytes * 40
    assert pages["latent"] > 4 * pages["expanded"], pages


@pytest.mark.parametrize("family, long", [("deepseek_v2", False), ("deepseek_v3", False), ("minicpm3", False),
                                          ("deepseek_v2", True), ("minicpm3", True)])
def test_absorbed_attention_keeps_the_expanded_forms_tokens(family, long, tmp_path, monkeypatch):
    """float32: the absorbed form's greedy tokens over pages, chunked prefills and decode rows sharing forwards are
    the expanded form's, their logits within rounding (``long``: 90-token chunks, which attend with their keys
    expanded, the rest absorbed); a float8 cache of latent rows (bf16) keeps the short prompts' last logits near."""
    from flared.model.decoder import DecoderModel
    from flared.model.kv_cache import FP8_KV

    from .test_parity_hf import make_prompts, run_paged_greedy

    source = read_source(build_hf_checkpoint(family, tmp_path / "hf"))
    prompts = make_prompts(source.config.vocab_size, seed=3)[:3]
    chunk = 5
    if long:  # (two chunks of 90: the second over a cached prefix)
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(3, source.config.vocab_size, (n,), generator=g).tolist() for n in (120, 70, 12)]
        chunk = 90
    absorbed = DecoderModel(source.config, source.tensors, dtype=torch.float32)
    got = run_paged_greedy(absorbed, prompts, num_new_tokens=10, page_tokens=4, chunk_tokens=chunk)
    monkeypatch.setenv("FLARED_MLA_EXPANDED", "1")
    expanded = DecoderModel(source.config, source.tensors, dtype=torch.float32)
    want = run_paged_greedy(expanded, prompts, num_new_tokens=10, page_tokens=4, chunk_tokens=chunk)
    monkeypatch.delenv("FLARED_MLA_EXPANDED")
    for (tokens, logits), (want_tokens, want_logits) in zip(got, want):
        assert tokens == want_tokens
        assert (logits - want_logits).abs().max().item() < 1e-4
    if long:
        return
    bf16 = DecoderModel(source.config, source.tensors, dtype=torch.bfloat16)
    make = bf16.make_kv_cache
    plain = run_paged_greedy(bf16, prompts, num_new_tokens=6, page_tokens=4, chunk_tokens=chunk)
    bf16.make_kv_cache = lambda **kw: make(**{**kw, "storage_dtype": FP8_KV})
    narrow = run_paged_greedy(bf16, prompts, num_new_tokens=6, page_tokens=4, chunk_tokens=chunk)
    for (_, logits), (_, narrow_logits) in zip(plain, narrow):  # (the prompts' last logits: the same inputs)
        # (float8 e4m3 keeps 3 mantissa bits of each latent value: logits move by a few percent of their range)
        assert (logits[0] - narrow_logits[0]).abs().max().item() < 0.2 * logits[0].abs().max().item()


def test_what_latent_attention_models_refuse(tmp_path):
    from flared.model.lora import LoraAdapter, merge_adapters

    from .test_lora import write_adapter

    hf_dir = build_hf_checkpoint("deepseek_v2", tmp_path / "hf")
    source = read_source(hf_dir)
    write_adapter(tmp_path / "adapter", {"model.layers.0.self_attn.kv_b_proj": (32, 4 * 28, False)})
    with pytest.raises(CoreError, match="latent attention") as info:
        merge_adapters(dict(source.tensors), source.config, [LoraAdapter(tmp_path / "adapter", 1.0)])
    assert info.value.kind == ErrorKind.UNSUPPORTED_MODEL
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "topk_method": "group_limited_greedy", "n_group": 2,
                                                    "topk_group": 1}))
    with pytest.raises(CoreError, match="group_limited_greedy") as info:
        read_source(hf_dir)
    assert info.value.kind == ErrorKind.UNSUPPORTED_MODEL


def test_v32_keeps_its_indexer_keys_in_the_latent_row(tmp_path, monkeypatch):
    """DeepSeek V3.2: a cache row holds the latent, the rotated part and the indexer's key (the expanded layout has no
    room for it, so FLARED_MLA_EXPANDED leaves it absorbed); the graphs refuse the indexer (the eager executor serves
    it on a GPU); the indexer's choice is what parts its logits from the same weights' dense attention."""
    from flared.model.decoder import DecoderModel

    from .test_parity_hf import run_paged_greedy

    directory = build_hf_checkpoint("deepseek_v32", tmp_path / "hf")
    source = read_source(directory)
    config = source.config
    assert (config.index_topk, config.index_heads, config.index_head_dim) == (6, 16, 16)
    assert (config.kv_row_dim, config.kv_storage_heads, config.kv_value_rows) == (32 + 8 + 16, 1, 0)
    assert "indexer" in config.torch_graphs_obstacle("bfloat16")
    monkeypatch.setenv("FLARED_MLA_EXPANDED", "1")
    assert config.latent_kv
    monkeypatch.delenv("FLARED_MLA_EXPANDED")
    prompt = [[int(t) for t in torch.randint(3, config.vocab_size, (30,), generator=torch.Generator().manual_seed(1))]]
    sparse = run_paged_greedy(DecoderModel(config, source.tensors), prompt, num_new_tokens=4, page_tokens=4,
                              chunk_tokens=8)[0][1]
    dense_config = dataclasses.replace(config, index_topk=10_000)
    dense = run_paged_greedy(DecoderModel(dense_config, source.tensors), prompt, num_new_tokens=4, page_tokens=4,
                             chunk_tokens=8)[0][1]
    assert (sparse - dense).abs().max().item() > 1e-2


def test_a_v32_core_serves_the_same_tokens_from_its_prefix_cache(tmp_path):
    """Exported and served (the eager executor, the indexer's keys in the latent rows, the prefix snapshots of them):
    a repeated question comes from the prefix cache with the same greedy tokens."""
    from flared_testing.daemon import Daemon
    from flared_testing.served import write_char_tokenizer

    from flared.core.export import ExportOptions, export_core

    directory = build_hf_checkpoint("deepseek_v32", tmp_path / "hf")
    write_char_tokenizer(directory, 512)
    export_core(directory, tmp_path / "core", ExportOptions(concurrency=2, context_tokens=256, prefill_chunk_tokens=64))
    daemon = Daemon(tmp_path / "core", tmp_path)
    answers = []
    try:
        for _ in range(2):
            status, body = daemon.chat([{"role": "user", "content": "Tell me a story about a fox, a long one."}],
                                       max_tokens=24, temperature=0, ignore_eos=True, logprobs=True,
                                       return_tokens_as_token_ids=True)
            assert status == 200, body
            answers.append(([t["token"] for t in body["choices"][0]["logprobs"]["content"]],
                            body["usage"]["prompt_tokens_details"]["cached_tokens"]))
    finally:
        daemon.kill()
    (first, _), (second, cached) = answers
    assert first == second and len(first) == 24 and cached > 0
