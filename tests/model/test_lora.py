"""LoRA adapters in PEFT's format merged at load (flared.model.lora): greedy tokens equal to transformers on the
weights PEFT's merge gives, every refusal with a clear error, and the --lora / --lora-scaled flags end to end."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

LINEAR = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
          "mlp.up_proj", "mlp.down_proj"]


def hf_modules(hf):
    """PEFT module name -> (in_features, out_features, is_embedding) of the tiny model."""
    cfg = hf.config
    out = {}
    for i in range(cfg.num_hidden_layers):
        layer = hf.model.layers[i]
        for name in LINEAR:
            mod = layer.get_submodule(name)
            out[f"model.layers.{i}.{name}"] = (mod.in_features, mod.out_features, False)
    out["lm_head"] = (cfg.hidden_size, cfg.vocab_size, False)
    out["model.embed_tokens"] = (cfg.vocab_size, cfg.hidden_size, True)
    return out


def write_adapter(directory: Path, modules: dict, *, r=4, alpha=8, seed=0, adapter_name="", **config) -> dict:
    """A PEFT adapter as save_pretrained writes it; returns {module: (A, B)} (float32)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors, pairs = {}, {}
    suffix = f".{adapter_name}" if adapter_name else ""
    for module, (fan_in, fan_out, embedding) in modules.items():
        A = torch.randn(r, fan_in, generator=g) * 0.3
        B = torch.randn(fan_out, r, generator=g) * 0.3
        pairs[module] = (A, B)
        if embedding:
            tensors[f"base_model.model.{module}.lora_embedding_A{suffix}"] = A
            tensors[f"base_model.model.{module}.lora_embedding_B{suffix}"] = B
        else:
            tensors[f"base_model.model.{module}.lora_A{suffix}.weight"] = A
            tensors[f"base_model.model.{module}.lora_B{suffix}.weight"] = B
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": sorted({m.split(".")[-1]
                                                                                      for m in modules}),
           "bias": "none", "fan_in_fan_out": False, "use_dora": False, "use_rslora": False, "modules_to_save": None}
    cfg.update(config)
    (directory / "adapter_config.json").write_text(json.dumps(cfg))
    return pairs


def peft_merge(hf, pairs: dict, cfg: dict, scale: float) -> None:
    """PEFT's merge_and_unload on the transformers model: W += scale * alpha / r * B @ A (embeddings: its
    transpose), alpha from alpha_pattern where a pattern names the module; rsLoRA divides by sqrt(r)."""
    import re

    with torch.no_grad():
        for module, (A, B) in pairs.items():
            alpha = cfg["lora_alpha"]
            for key, value in (cfg.get("alpha_pattern") or {}).items():
                if re.match(rf"(.*\.)?({key})$", module):
                    alpha = value
                    break
            r = A.shape[0]
            scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
            delta = scale * scaling * (B @ A)
            weight = hf.get_submodule(module).weight
            weight += delta.t() if module == "model.embed_tokens" else delta


def merged(src, adapters) -> dict:
    """A copy of the tiny model's serving tensors with ``adapters`` merged in."""
    from flared.model.lora import merge_adapters

    tensors = dict(src.tensors)
    merge_adapters(tensors, src.config, adapters)
    return tensors


def greedy_flared(src, tensors, prompts, max_tokens=12):
    from flared.execution.eager import EagerExecutor
    from flared.execution.offline import drive
    from flared.model.decoder import DecoderModel
    from flared.model.sampling import SamplingParams
    from flared.scheduler import PolicyConfig, RequestScheduler, SchedulerConfig

    model = DecoderModel(src.config, tensors, dtype=torch.float32, device="cpu", max_positions=256)
    sched = RequestScheduler(SchedulerConfig(model_identity=hashlib.sha256(b"lora").digest(), max_live_requests=4,
                                             num_pages=64, num_snapshots=16, page_tokens=16, context_capacity=256,
                                             prefill_chunk_size=64), PolicyConfig())
    ex = EagerExecutor(model, num_pages=64, page_tokens=16, num_state_rows=5, num_snapshots=16,
                       vocab_size=src.config.vocab_size, max_live=4)
    params = [SamplingParams(temperature=0, max_tokens=max_tokens)] * len(prompts)
    return drive(sched, ex, prompts, params).tokens


def greedy_hf(hf, prompts, max_tokens=12):
    out = []
    for prompt in prompts:
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(ids[0, len(prompt):].tolist())
    return out


PROMPTS = [list(range(3, 40)), [7, 8, 9]]


@pytest.mark.parametrize("options", [
    dict(scale=1.0, config={}),
    # rsLoRA, a per-module alpha, an adapter name in the keys, and the operator's scale
    dict(scale=0.5, config={"use_rslora": True, "alpha_pattern": {"model.layers.1.mlp.down_proj": 3}},
         adapter_name="default"),
])
def test_merged_adapter_matches_transformers_with_peft_merge(tiny_hf_llama, tmp_path, options):
    from transformers import LlamaForCausalLM

    from flared.model.loader import read_source
    from flared.model.lora import LoraAdapter

    hf = LlamaForCausalLM.from_pretrained(tiny_hf_llama, torch_dtype=torch.float32).eval()
    base = greedy_hf(hf, PROMPTS)
    d = tmp_path / "adapter"
    pairs = write_adapter(d, hf_modules(hf), adapter_name=options.get("adapter_name", ""), **options["config"])
    cfg = json.loads((d / "adapter_config.json").read_text())
    peft_merge(hf, pairs, cfg, options["scale"])
    expected = greedy_hf(hf, PROMPTS)
    assert expected != base  # the adapter changes what the model says

    src = read_source(tiny_hf_llama)
    tensors = merged(src, [LoraAdapter(d, options["scale"])])
    assert greedy_flared(src, tensors, PROMPTS) == expected


def test_two_adapters_add_up_and_scale_zero_changes_nothing(tiny_hf_llama, tmp_path):
    from flared.model.loader import read_source
    from flared.model.lora import LoraAdapter

    src = read_source(tiny_hf_llama)
    modules = {"model.layers.0.self_attn.q_proj": (src.config.hidden_size, src.config.q_size, False),
               "model.layers.1.mlp.up_proj": (src.config.hidden_size, src.config.intermediate_size, False)}
    write_adapter(tmp_path / "a", modules, seed=1)
    write_adapter(tmp_path / "b", modules, seed=2)
    base = dict(src.tensors)
    zero = merged(src, [LoraAdapter(tmp_path / "a", 0.0)])
    assert all(torch.equal(zero[k], base[k]) for k in base)
    one = merged(src, [LoraAdapter(tmp_path / "a"), LoraAdapter(tmp_path / "b")])
    a = merged(src, [LoraAdapter(tmp_path / "a")])
    b = merged(src, [LoraAdapter(tmp_path / "b")])
    for k in base:
        torch.testing.assert_close(one[k] - base[k], (a[k] - base[k]) + (b[k] - base[k]), atol=1e-5, rtol=0)
    q = src.config.q_size
    assert torch.equal(one["layers.0.qkv.weight"][q:], base["layers.0.qkv.weight"][q:])  # k and v rows untouched
    assert not torch.equal(one["layers.0.qkv.weight"][:q], base["layers.0.qkv.weight"][:q])


@pytest.mark.parametrize("change, message", [
    (lambda d, m: _config(d, use_dora=True), "DoRA"),
    (lambda d, m: _config(d, bias="lora_only"), "trained biases"),
    (lambda d, m: _config(d, modules_to_save=["lm_head"]), "modules_to_save"),
    (lambda d, m: _config(d, fan_in_fan_out=True), "fan_in_fan_out"),
    (lambda d, m: _config(d, peft_type="IA3"), "not LORA"),
    (lambda d, m: write_adapter(d, {"model.layers.9.self_attn.q_proj": (m.hidden_size, m.q_size, False)}),
     "not a layer this model has"),
    (lambda d, m: write_adapter(d, {"model.layers.0.self_attn.q_proj": (m.hidden_size, m.q_size + 1, False)}),
     "do not fit"),
    (lambda d, m: _drop(d, "lora_B"), "lora_B missing"),
    (lambda d, m: (d / "adapter_config.json").unlink(), "has no adapter_config.json"),
    (lambda d, m: (d / "adapter_config.json").write_text("{"), "not readable JSON"),
])
def test_adapters_that_cannot_be_merged_are_refused_by_name(tiny_hf_llama, tmp_path, change, message):
    from flared.errors import CoreError
    from flared.model.loader import read_source
    from flared.model.lora import LoraAdapter, merge_adapters

    src = read_source(tiny_hf_llama)
    m = src.config
    d = tmp_path / "adapter"
    write_adapter(d, {"model.layers.0.self_attn.q_proj": (m.hidden_size, m.q_size, False)})
    change(d, m)
    before = {k: v.clone() for k, v in src.tensors.items()}
    tensors = dict(src.tensors)
    with pytest.raises(CoreError, match=message):
        merge_adapters(tensors, m, [LoraAdapter(d)])
    assert all(torch.equal(tensors[k], before[k]) for k in before)  # nothing changed


def test_a_tied_lm_head_or_embedding_is_refused(tiny_hf_llama, tmp_path):
    from flared.errors import CoreError
    from flared.model.loader import read_source
    from flared.model.lora import LoraAdapter, merge_adapters

    src = read_source(tiny_hf_llama)
    tied = dataclasses.replace(src.config, tie_word_embeddings=True)
    for module, shape in (("lm_head", (tied.hidden_size, tied.vocab_size, False)),
                          ("model.embed_tokens", (tied.vocab_size, tied.hidden_size, True))):
        d = tmp_path / module
        write_adapter(d, {module: shape})
        with pytest.raises(CoreError, match="ties"):
            merge_adapters(dict(src.tensors), tied, [LoraAdapter(d)])


def _config(d: Path, **changes) -> None:
    p = d / "adapter_config.json"
    p.write_text(json.dumps({**json.loads(p.read_text()), **changes}))


def _drop(d: Path, part: str) -> None:
    from safetensors.torch import load_file, save_file

    p = d / "adapter_model.safetensors"
    save_file({k: v for k, v in load_file(str(p)).items() if part not in k}, str(p))


def test_lora_flags_reach_the_served_model(tiny_core, tiny_hf_llama, tmp_path):
    """`flared run-batch --lora DIR` (the same load path `flared run` takes) answers differently from the base
    core, `--lora-scaled DIR 0` exactly as the base does, and a path that is no adapter is a config error."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny_hf_llama, torch_dtype=torch.float32)
    d = tmp_path / "adapter"
    write_adapter(d, hf_modules(hf))
    line = {"custom_id": "c", "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": list(range(3, 30)), "max_tokens": 8, "temperature": 0}}
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(line) + "\n")

    def answer(*flags) -> str:
        out = tmp_path / "out.jsonl"
        cmd = [sys.executable, "-m", "flared.cli.daemon", "run-batch", "-i", str(src), "-o", str(out),
               "--served-name", "tiny", *flags, str(tiny_core)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        row = json.loads(out.read_text())
        assert row["response"]["status_code"] == 200, row
        return row["response"]["body"]["choices"][0]["text"]

    base = answer()
    assert answer("--lora", str(d)) != base
    assert answer("--lora-scaled", str(d), "0") == base
    cmd = [sys.executable, "-m", "flared.cli.daemon", "run-batch", "-i", str(src), "-o", str(tmp_path / "x.jsonl"),
           "--lora", str(tmp_path / "missing"), str(tiny_core)]
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "lora_adapters" in bad.stderr and "adapter_config.json" in bad.stderr


def test_flared_run_serves_the_merged_adapter_and_lists_it(tiny_core, tiny_hf_llama, tmp_path):
    """`flared run --lora-scaled DIR 2`: the completions answer differs from the base core's; GET /lora-adapters
    (llama.cpp's route) and `flarectl models` list the adapter and its scale; POST there is a 400 that says why."""
    from flared_testing.daemon import Daemon
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny_hf_llama, torch_dtype=torch.float32)
    d = tmp_path / "adapter"
    write_adapter(d, hf_modules(hf))
    body = {"model": "tiny", "prompt": list(range(3, 30)), "max_tokens": 8, "temperature": 0}
    answers = []
    for flags in ((), ("--lora-scaled", str(d), "2")):
        daemon = Daemon(tiny_core, tmp_path, *flags, admin_socket=True)
        try:
            status, out = daemon.request("POST", "/v1/completions", body)
            assert status == 200, out
            answers.append(out["choices"][0]["text"])
            status, listed = daemon.request("GET", "/lora-adapters")
            assert status == 200
            assert listed == ([{"id": 0, "path": str(d), "scale": 2.0}] if flags else [])
            status, refused = daemon.request("POST", "/lora-adapters", [{"id": 0, "scale": 1.0}])
            assert status == 400 and "merged into the weights at load" in refused["error"]["message"]
            if flags:
                assert f"merged LoRA adapters: {d} (scale 2)" in daemon.log()
                assert f"lora:        {d} (scale 2)" in daemon.ctl("models").stdout  # flarectl models
        finally:
            daemon.kill()
    assert answers[0] != answers[1]


def _batch_answer(tiny_core, tmp_path: Path, prompt, *flags) -> str:
    """One greedy /v1/completions line through `flared run-batch` with ``flags``."""
    line = {"custom_id": "c", "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}}
    src, out = tmp_path / "one.jsonl", tmp_path / "one-out.jsonl"
    src.write_text(json.dumps(line) + "\n")
    cmd = [sys.executable, "-m", "flared.cli.daemon", "run-batch", "-i", str(src), "-o", str(out), "--served-name",
           "tiny", *flags, str(tiny_core)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(out.read_text())
    assert row["response"]["status_code"] == 200, row
    return row["response"]["body"]["choices"][0]["text"]


def test_lora_modules_serve_an_adapter_per_request_beside_the_base(tiny_core, tiny_hf_llama, tmp_path):
    """vLLM's --lora-modules: `flared run --lora-modules sql=DIR` serves model "sql" with the adapter beside the
    weights. Its answers equal the merged adapter's (--lora), the base model's stay the base's, both in one batch,
    a base prompt's cached prefix is not reused for the adapter, /v1/models lists it, and routes that do not
    generate refuse the name."""
    import concurrent.futures

    from flared_testing.daemon import Daemon
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny_hf_llama, torch_dtype=torch.float32)
    d = tmp_path / "adapter"
    write_adapter(d, {k: v for k, v in hf_modules(hf).items() if k.startswith("model.layers.")})
    prompt = list(range(3, 40))
    base = _batch_answer(tiny_core, tmp_path, prompt)
    merged = _batch_answer(tiny_core, tmp_path, prompt, "--lora", str(d))
    assert merged != base
    daemon = Daemon(tiny_core, tmp_path, "--lora-modules", f"sql={d}")
    try:
        def complete(model):
            status, out = daemon.request("POST", "/v1/completions",
                                         {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0})
            assert status == 200, out
            return out["choices"][0]["text"]

        assert complete("tiny") == base  # first: its prefix is now cached
        assert complete("sql") == merged  # not served from the base's cached prefix
        assert complete("sql") == merged  # from its own
        with concurrent.futures.ThreadPoolExecutor(4) as pool:  # rows of both in the same steps
            mixed = list(pool.map(complete, ["sql", "tiny", "sql", "tiny"]))
        assert mixed == [merged, base, merged, base]
        said = {}
        for model in ("sql", "tiny"):  # each generating route runs the adapter its model name picks
            messages = [{"role": "user", "content": "Paris is"}]
            status, chat = daemon.request("POST", "/v1/chat/completions", {
                "model": model, "messages": messages, "max_tokens": 6, "temperature": 0})
            assert status == 200 and chat["model"] == model
            status, msg = daemon.request("POST", "/v1/messages", {
                "model": model, "messages": messages, "max_tokens": 6, "temperature": 0})
            status2, resp = daemon.request("POST", "/v1/responses", {
                "model": model, "input": messages, "max_output_tokens": 6, "temperature": 0})
            status3, ollama = daemon.request("POST", "/api/chat", {
                "model": model, "messages": messages, "stream": False, "options": {"temperature": 0, "num_predict": 6}})
            assert (status, status2, status3) == (200, 200, 200), (msg, resp, ollama)
            said[model] = [chat["choices"][0]["message"]["content"], msg["content"][0]["text"],
                           resp["output"][0]["content"][0]["text"], ollama["message"]["content"]]
            assert len(set(said[model])) == 1, said[model]
        assert said["sql"] != said["tiny"]
        status, models = daemon.request("GET", "/v1/models")
        cards = {c["id"]: c for c in models["data"]}
        assert cards["sql"]["parent"] == models["data"][0]["id"] != "sql" and cards["sql"]["root"] == str(d)
        _, tags = daemon.request("GET", "/api/tags")  # Ollama's clients pick models from here, then /api/show
        assert "sql" in [t["name"] for t in tags["models"]]
        assert daemon.request("POST", "/api/show", {"model": "sql"})[0] == 200
        status, emb = daemon.request("POST", "/v1/embeddings", {"model": "sql", "input": "hi"})
        assert status == 400 and "LoRA adapter" in emb["error"]["message"]
        status, missing = daemon.request("POST", "/v1/completions", {"model": "nope", "prompt": "x"})
        assert status == 404
        status, off = daemon.request("POST", "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(d)})
        assert status == 400 and "--allow-runtime-lora-updating" in off["error"]["message"]
        assert "per-request LoRA adapters: sql" in daemon.log()
    finally:
        daemon.kill()


def test_adapters_load_and_unload_while_serving(tiny_core, tiny_hf_llama, tmp_path):
    """vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (--allow-runtime-lora-updating): a loaded
    adapter answers as the merged one, a taken name, a bad path and a misfit are 400s, an unloaded name is 404
    and may be loaded again."""
    from flared_testing.daemon import Daemon
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny_hf_llama, torch_dtype=torch.float32)
    d = tmp_path / "adapter"
    write_adapter(d, {k: v for k, v in hf_modules(hf).items() if k.startswith("model.layers.")}, seed=5)
    misfit = tmp_path / "misfit"
    write_adapter(misfit, {"model.layers.0.self_attn.q_proj": (7, 7, False)})
    prompt = list(range(3, 40))
    base = _batch_answer(tiny_core, tmp_path, prompt)
    merged = _batch_answer(tiny_core, tmp_path, prompt, "--lora", str(d))
    daemon = Daemon(tiny_core, tmp_path, "--allow-runtime-lora-updating")
    try:
        def complete(model):
            return daemon.request("POST", "/v1/completions",
                                  {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0})

        def load(name, path):
            return daemon.request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})

        assert complete("sql")[0] == 404
        assert load("sql", d) == (200, b"Success: LoRA adapter 'sql' added successfully.")
        assert complete("sql")[1]["choices"][0]["text"] == merged
        assert complete("tiny")[1]["choices"][0]["text"] == base
        status, taken = load("sql", d)
        assert status == 400 and "taken" in taken["error"]["message"]
        for path in (tmp_path / "nowhere", "bad\x00path", "x" * 5000):
            status, missing = load("other", path)
            assert status == 400 and missing["error"]["param"] == "lora_path", missing
        status, bad = load("other", misfit)
        assert status == 400 and "do not fit" in bad["error"]["message"]
        assert "sql" in [c["id"] for c in daemon.request("GET", "/v1/models")[1]["data"]]
        status, text = daemon.request("POST", "/v1/unload_lora_adapter", {"lora_name": "sql"})
        assert (status, text) == (200, b"Success: LoRA adapter 'sql' removed successfully.")
        assert complete("sql")[0] == 404
        assert daemon.request("POST", "/v1/unload_lora_adapter", {"lora_name": "sql"})[0] == 404
        assert load("sql", d)[0] == 200  # again, as a new adapter
        assert complete("sql")[1]["choices"][0]["text"] == merged
        log = daemon.log()
        assert "adapter sql loaded" in log and "adapter 1 unloaded" in log  # the first one's factors are gone
    finally:
        daemon.kill()


def test_lora_modules_refuse_what_only_a_merge_can_serve(tiny_core, tiny_hf_llama, tmp_path):
    """An LM-head adapter can only be merged; a malformed flag and a name the base model already has are refused."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny_hf_llama, torch_dtype=torch.float32)
    d = tmp_path / "head"
    write_adapter(d, {"lm_head": hf_modules(hf)["lm_head"]})
    line = {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"model": "tiny", "prompt": "x"}}
    (tmp_path / "in.jsonl").write_text(json.dumps(line) + "\n")
    cmd = [sys.executable, "-m", "flared.cli.daemon", "run-batch", "-i", str(tmp_path / "in.jsonl"), "-o",
           str(tmp_path / "out.jsonl"), "--lora-modules", f"head={d}", str(tiny_core)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "the layers' projections only" in done.stderr
    bad = subprocess.run(cmd[:-3] + ["--lora-modules", "no-equals-sign", str(tiny_core)], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "NAME=PATH" in bad.stderr
    write_adapter(tmp_path / "ok", {"model.layers.0.mlp.up_proj": hf_modules(hf)["model.layers.0.mlp.up_proj"]})
    taken = subprocess.run(cmd[:-3] + ["--served-name", "tiny", "--lora-modules", f"tiny={tmp_path / 'ok'}",
                                       str(tiny_core)], capture_output=True, text=True, timeout=120)
    assert taken.returncode == 1 and "already names the served model" in taken.stderr


@pytest.mark.parametrize("family", ["phi3", "glm4"])
def test_fused_and_reordered_projections_take_their_adapters(family, tmp_path):
    """Phi-3's and GLM-4's fused qkv_proj / gate_up_proj are our fused rows whole; GLM-4's q and k rows, which the
    loader reorders to rotate-half, take their adapter's rows in the same order: greedy tokens as transformers gives
    them on PEFT's merge."""
    from flared_testing.checkpoints import build_hf_checkpoint
    from transformers import AutoModelForCausalLM

    from flared.model.loader import read_source
    from flared.model.lora import LoraAdapter

    directory = build_hf_checkpoint(family, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    base = greedy_hf(hf, PROMPTS)
    modules = {f"model.layers.{i}.{name}": (mod.in_features, mod.out_features, False)
               for i, layer in enumerate(hf.model.layers) for name, mod in layer.named_modules()
               if isinstance(mod, torch.nn.Linear)}
    assert any(m.endswith("gate_up_proj") for m in modules)
    d = tmp_path / "adapter"
    pairs = write_adapter(d, modules)
    peft_merge(hf, pairs, json.loads((d / "adapter_config.json").read_text()), 1.0)
    expected = greedy_hf(hf, PROMPTS)
    assert expected != base
    src = read_source(directory)
    assert greedy_flared(src, merged(src, [LoraAdapter(d, 1.0)]), PROMPTS) == expected
