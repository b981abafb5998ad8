"""A vision core on the CUDA graph executor: the image tower runs between steps, and a prefill that feeds image
tokens runs the prefill graph's forward eagerly with the tower's rows in their places (Qwen VL's 3D rope from
each row's own cos and sin rows, Qwen3-VL's DeepStack rows after its first layers); every other step, Qwen VL's
later ones included (their plain-rope positions shifted by the prompt's delta), replays the graphs.

float32: greedy tokens equal the eager executor's on the same model (which tests/api/test_vision*.py hold to
transformers'); bf16 (the fused kernels, and the generic graphs of a mixture of experts): the prefill's logits
as near the eager executor's as bf16 allows, far from those without the images. Through a daemon, images are
taken without --enforce-eager, Gemma 3's too (its images' tokens attending to each other both ways). Skipped
without a GPU (tests/cuda/conftest.py)."""

from __future__ import annotations

import base64
import collections
import io
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).parent))

from gpu_models import make_executor, make_scheduler  # noqa: E402

NEW_TOKENS = 10


def _params(max_tokens=NEW_TOKENS):
    from flared.model.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def _served(core_path, dtype):
    """The core's decoder and image tower on the GPU, as the model thread loads them."""
    from flared.core.load import open_core
    from flared.model.decoder import DecoderModel
    from flared.model.vision import attach_tower, vision_encoder

    core = open_core(core_path)
    model = DecoderModel(core.config, core.load_tensors(), dtype=dtype, device="cuda", max_positions=512)
    config = core.vision_config
    attach_tower(model, config, vision_encoder(config, core.load_vision_tensors(), dtype=dtype, device="cuda"))
    return core, model


def _requests(core, model):
    """Three prompts and their images: text, an image that straddles the 128-token prefill chunk's end, text; text
    alone; two images. The tower's rows made by VisionJob, as the worker makes them."""
    from flared_testing.vision import noise_image

    from flared.frontend.images import DecodedImage, image_processor_from_dict
    from flared.model.vision import mrope_positions
    from flared.runtime.request import VisionInput
    from flared.runtime.worker import VisionJob

    vision = core.manifest.vision
    processor = image_processor_from_dict(vision["processor"])
    token = int(vision["config"]["image_token_id"])
    merge = int(vision["config"]["scale_factor"]) if vision["config"].get("mrope_section") else 0
    if processor.modality == "audio":  # (Qwen2-Audio: clips of 1.3 and 2 s, 32 and 50 audio tokens)
        from flared.frontend.audio import DecodedAudio

        rng = np.random.default_rng(31)
        images = [processor.prepare(DecodedAudio(rng.uniform(-0.5, 0.5, int(16000 * s)).astype(np.float32), 16000))
                  for s in (1.3, 2.0)]
    else:
        images = [processor.prepare(DecodedImage.from_pil(noise_image(seed, size)))
                  for seed, size in ((31, (90, 40)), (32, (30, 100)))]
    job = VisionJob(images, done=None)
    while not job.step(model, 0, collections.Counter()):
        pass
    rows = job.result()

    def request(parts):
        ids, spans, features = [], [], []
        for part in parts:
            if isinstance(part, int):
                spans.append((len(ids), images[part].num_image_tokens, images[part].grid))
                ids += [token] * images[part].num_image_tokens
                features.append(rows[part])
            else:
                ids += list(part)
        if not spans:
            return ids, None
        mrope, delta = mrope_positions(ids, spans, merge) if merge else (None, 0)
        positions = np.flatnonzero(np.asarray(ids) == token)
        return ids, VisionInput(positions, torch.cat(features), (), mrope, delta)

    cases = [request([range(20, 144), 0, range(40, 52)]), request([range(60, 90)]),
             request([range(5, 12), 1, range(70, 75), 0, range(80, 86)])]
    return [ids for ids, _ in cases], [v for _, v in cases]


def _drive(model, prompts, visions, *, graphs: bool, max_tokens=NEW_TOKENS):
    from flared.execution.eager import EagerExecutor
    from flared.execution.offline import drive

    if graphs:
        ex = make_executor(model)
    else:
        ex = EagerExecutor(model, num_pages=128, page_tokens=16, num_state_rows=5, num_snapshots=16,
                           vocab_size=model.config.vocab_size, max_live=4)
    try:
        result = drive(make_scheduler(), ex, prompts, [_params(max_tokens)] * len(prompts), visions=visions)
        logits = (ex.decoder.state_logits if graphs else ex.state_logits).float().clone()
    finally:
        if graphs:
            ex.close()
    return result.tokens, logits


def _check_float32(core_path):
    core, model = _served(core_path, torch.float32)
    prompts, visions = _requests(core, model)
    graphs, logits = _drive(model, prompts, visions, graphs=True)
    eager, _ = _drive(model, prompts, visions, graphs=False)
    assert graphs == eager
    blind, blind_logits = _drive(model, prompts, [None] * len(prompts), graphs=True)
    assert blind[1] == graphs[1]  # (the text-only request)
    assert (logits - blind_logits).abs().max().item() > 1e-2  # the images' rows reach the logits


def _check_bf16(core_path):
    """The prefill's logits (each request's first token's), graphs against the eager executor's: the differences
    bf16 makes are a small part of those the images make."""
    core, model = _served(core_path, torch.bfloat16)
    prompts, visions = _requests(core, model)
    rows = list(range(1, 1 + len(prompts)))  # the requests' state rows (row 0 is the padding rows' scratch)
    runs = [_drive(model, prompts, v, graphs=g, max_tokens=1)[1][rows]
            for v, g in ((visions, True), (visions, False), ([None] * len(prompts), True))]
    assert all(bool((r.abs().sum(-1) > 0).all()) for r in runs)  # every request's row holds its logits
    graphs, eager, blind = (r.log_softmax(-1) for r in runs)
    near = (graphs - eager).abs().max().item()
    far = (graphs - blind).abs().max().item()
    print(f"{core_path.name}: graphs against eager {near:.4f}, against no images {far:.4f}")
    assert near < 0.1 * far, (near, far)


OTHER_FAMILIES = {"smolvlm": "tiny_vlm_core", "mistral3": "tiny_mistral3", "llava": "tiny_llava",
                  "gemma3": "tiny_gemma3", "internvl": "tiny_internvl", "llava_next": "tiny_llava_next",
                  "gemma4": "tiny_gemma4_vision",  # (per-layer inputs; a layer sharing another's keys)
                  "gemma4_both_ways": "tiny_gemma4_vision_both_ways",  # (both ways on the windowed layers only)
                  "granite_vision": "tiny_granite_vision",  # (SigLIP's layers side by side; Granite's multiplier)
                  "llava_onevision": "tiny_llava_onevision",
                  "qwen2_audio": "tiny_qwen2_audio",  # (audio clips' rows, as images')
                  "audioflamingo3": "tiny_audioflamingo3", "glmasr": "tiny_glmasr", "qwen3_asr": "tiny_qwen3_asr"}
# (Gemma 3: images attending both ways, a window shorter than an image)


def _core_of(request, family):
    value = request.getfixturevalue(OTHER_FAMILIES[family])
    return value[1] if isinstance(value, tuple) else value


@pytest.mark.parametrize("family", sorted(OTHER_FAMILIES))
def test_float32_graph_tokens_with_images_equal_the_eager_executors(family, request):
    _check_float32(_core_of(request, family))


def test_float32_qwen_vl_graph_tokens_equal_the_eager_executors(tiny_qwen_vl):
    family, _, core = tiny_qwen_vl
    if family in ("qwen3_5", "qwen3_vl_moe"):  # (recurrent layers; float32 experts: the eager executor serves them)
        pytest.skip(f"{family} in float32 is served by the eager executor on a GPU")
    _check_float32(core)


def test_float32_qwen_vl_speculative_steps_keep_their_positions(tiny_qwen_vl):
    """Speculative steps (decode graphs, a row per fed token) of requests with 3D positions: drafts that are the
    plain tokens (a predicted output) are all kept only where every row turns at its shifted position."""
    from flared.execution.offline import drive

    family, _, core = tiny_qwen_vl
    if family not in ("qwen2_vl", "qwen3_vl"):
        pytest.skip(f"{family}: the 3D positions of qwen2_vl and qwen3_vl cover it")
    core, model = _served(core, torch.float32)
    prompts, visions = _requests(core, model)
    plain, _ = _drive(model, prompts, visions, graphs=True)
    ex = make_executor(model, speculative=4)
    try:
        sched = make_scheduler(graph_shapes=ex.graph_shapes, speculative_tokens=4, spec_max_rows=ex.spec_max_rows)
        got = drive(sched, ex, prompts, [_params()] * len(prompts), visions=visions, speculate=True,
                    predictions=plain)
    finally:
        ex.close()
    assert got.tokens == plain
    assert got.steps_by_kind["SPECULATIVE"] > 0 and sched.counters["speculative_accepted"] > NEW_TOKENS


@pytest.mark.parametrize("family", sorted(OTHER_FAMILIES))
def test_bf16_prefill_logits_with_images_match_the_eager_executors(family, request):
    _check_bf16(_core_of(request, family))


def test_bf16_qwen_vl_prefill_logits_match_the_eager_executors(tiny_qwen_vl):
    family, _, core = tiny_qwen_vl
    if family == "qwen3_5":  # (recurrent layers: the eager executor serves it on a GPU)
        pytest.skip("qwen3_5 is served by the eager executor on a GPU")
    _check_bf16(core)


def _image_chat(daemon, url, **kw):
    return daemon.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "What is in it?"}]}],
                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, **kw)


def _served_images_match_enforce_eager(checkpoint, tmp_path, start_daemon):
    """A bf16 core served as a user serves it: the CUDA graphs (no --enforce-eager) take image parts, and the first
    token's log-probabilities match those of the same core under --enforce-eager."""
    from PIL import Image

    from flared.core.export import ExportOptions, export_core

    core = tmp_path / "core"  # bf16: the dtype the CUDA backend serves
    export_core(checkpoint, core, ExportOptions(dtype="bfloat16", concurrency=4, context_tokens=512,
                                                prefill_chunk_tokens=128))
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 30, 3), dtype=np.uint8)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    firsts = []
    for args in ((), ("--enforce-eager",)):
        d = start_daemon(core, *args)
        status, body = d.chat([{"role": "user", "content": "What?"}], max_tokens=4)
        assert status == 200, body
        text_tokens = body["usage"]["prompt_tokens"]
        status, body = _image_chat(d, url)
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] > text_tokens + 4  # the image's tokens
        firsts.append({t["token"]: t["logprob"] for t in body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]})
        status, models = d.request("GET", "/v1/models")
        assert models["data"][0]["capabilities"]["vision"] is True
        log = d.log()
        assert ("executor: eager on" in log) == bool(args), log[-2000:]
        d.kill()
    graphs, eager = firsts
    shared = set(graphs) & set(eager)
    assert shared, (graphs, eager)
    assert max(abs(graphs[t] - eager[t]) for t in shared) < 0.1, (graphs, eager)


def test_a_smolvlm_core_takes_images_on_the_cuda_graphs(tiny_hf_smolvlm, tmp_path, start_daemon):
    _served_images_match_enforce_eager(tiny_hf_smolvlm, tmp_path, start_daemon)


def test_a_qwen_vl_core_takes_images_on_the_cuda_graphs(tiny_qwen_vl, tmp_path, start_daemon):
    family, checkpoint, _ = tiny_qwen_vl
    if family not in ("qwen2_vl", "qwen3_vl"):  # (the other families' graphs: the executor tests above)
        pytest.skip(f"{family}: its images on the graphs are checked by the executor tests")
    _served_images_match_enforce_eager(checkpoint, tmp_path, start_daemon)


def test_a_gemma3_core_takes_images_on_the_cuda_graphs(tiny_gemma3, tmp_path, start_daemon):
    """Gemma 3's image tokens attend to each other both ways (graph_layers.ImageBlocks on the graphs)."""
    _served_images_match_enforce_eager(tiny_gemma3[0], tmp_path, start_daemon)


@pytest.mark.parametrize("fixture", ["tiny_gemma4_vision", "tiny_gemma4_vision_both_ways"])
def test_a_gemma4_core_takes_images_on_the_cuda_graphs(fixture, request, tmp_path, start_daemon):
    """Gemma 4: E2B-like per-layer inputs; 26B-like images both ways on the windowed layers (ImageBlocks)."""
    _served_images_match_enforce_eager(request.getfixturevalue(fixture)[0], tmp_path, start_daemon)


def test_a_gemma4_core_takes_audio_on_the_cuda_graphs(tiny_gemma4_vision, tmp_path, start_daemon):
    """Gemma 4's second tower: a clip through the audio conformer on the GPU, its rows in an eager prefill of the
    graphs' forward; the first token as --enforce-eager gives it."""
    from flared_testing.audio import input_audio, tone

    from flared.core.export import ExportOptions, export_core

    core = tmp_path / "core"
    export_core(tiny_gemma4_vision[0], core, ExportOptions(dtype="bfloat16", concurrency=4, context_tokens=512,
                                                           prefill_chunk_tokens=128))
    firsts = []
    for args in ((), ("--enforce-eager",)):
        d = start_daemon(core, *args)
        status, body = d.chat([{"role": "user", "content": [input_audio(tone(3, 2.0)),
                                                             {"type": "text", "text": "What is it?"}]}],
                              max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] > 50  # (2 s: 50 audio tokens)
        firsts.append({t["token"]: t["logprob"] for t in body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]})
        assert ("executor: eager on" in d.log()) == bool(args)
        d.kill()
    graphs, eager = firsts
    shared = set(graphs) & set(eager)
    assert shared and max(abs(graphs[t] - eager[t]) for t in shared) < 0.1, (graphs, eager)
