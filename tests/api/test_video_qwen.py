"""Video input on Qwen2-VL, Qwen2.5-VL and Qwen3-VL cores end to end: random-weight models exported and served by a
real `flared run`, asked with vLLM's ``video_url`` parts, their greedy tokens checked against transformers on the
same weights, frames and prompt (transformers' prompt expansion: Qwen3-VL's timestamps; its 3D rope positions:
Qwen2.5-VL's temporal positions at tokens_per_second x second_per_grid_t). The frames are our VideoProcessor's
(transformers' video processors need torchvision; tests/frontend/test_video.py checks ours against them where it
is installed)."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("av")

from flared_testing.video import assert_media_cases_match, noise_video, video_part  # noqa: E402
from flared_testing.vision import assert_greedy, metric, noise_image, reference_tokenizer  # noqa: E402

NEW_TOKENS = 10
FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
# Small frames: Qwen2/2.5 bound each frame's pixels, Qwen3-VL the whole video's
VIDEO_CONFIGS = {
    "qwen2": {"video_processor_type": "Qwen2VLVideoProcessor", "size": {"shortest_edge": 4 * 28 * 28,
                                                                        "longest_edge": 25 * 28 * 28}},
    "qwen3": {"video_processor_type": "Qwen3VLVideoProcessor", "size": {"shortest_edge": 4 * 32 * 32,
                                                                        "longest_edge": 60 * 32 * 32},
              "fps": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
}


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory):
    from conftest import build_tiny_qwen_vl
    from flared.core.export import ExportOptions, export_core
    from flared_testing.daemon import Daemon

    family = request.param
    d = build_tiny_qwen_vl(tmp_path_factory.mktemp(f"hf-video-{family}"), family)
    (d / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_CONFIGS[
        "qwen3" if family == "qwen3_vl" else "qwen2"]))
    if family == "qwen2_5_vl":  # the released models' 2 (transformers' default is 4)
        config = json.loads((d / "config.json").read_text())
        config["vision_config"]["tokens_per_second"] = 2
        (d / "config.json").write_text(json.dumps(config))
    core = tmp_path_factory.mktemp("cores") / family
    export_core(d, core, ExportOptions(concurrency=4, context_tokens=1024, prefill_chunk_tokens=128))
    media = tmp_path_factory.mktemp(f"{family}-media")
    daemon = Daemon(core, tmp_path_factory.mktemp(f"{family}-video-daemon"), "--allowed-local-media-path", str(media))
    daemon.media = media
    yield family, d, core, daemon
    daemon.kill()


@pytest.fixture(scope="module")
def reference(served):
    """Greedy tokens transformers makes for a user turn of media (("image", PIL image) or ("video", bytes)) then
    text: the videos' frames are our processor's; their prompt expansion and positions transformers'."""
    import torch
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from flared.core.load import open_core
    from flared.frontend.video import probe_video

    family, checkpoint, core, _ = served
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tok = reference_tokenizer(checkpoint)
    settings = {k: v for k, v in json.loads((checkpoint / "preprocessor_config.json").read_text()).items()
                if k != "image_processor_type"}
    images = Qwen2VLImageProcessorPil(**settings)
    videos = open_core(core).video_processor()

    def run(media, text: str):
        content = [{"type": kind} for kind, _ in media] + [{"type": "text", "text": text}]
        prompt = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
        inputs, expanded = {}, prompt
        pictures = [m for kind, m in media if kind == "image"]
        if pictures:
            out = images(images=pictures, return_tensors="pt")
            inputs.update(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
            pieces = expanded.split("<|image_pad|>")
            expanded = pieces[0] + "".join("<|image_pad|>" * (g[0] * g[1] * g[2] // 4) + piece
                                           for g, piece in zip(out["image_grid_thw"].tolist(), pieces[1:]))
        clips = [m for kind, m in media if kind == "video"]
        if clips:
            prepared = [videos.prepare(data) for data in clips]
            infos = [probe_video(data) for data in clips]
            inputs["pixel_values_videos"] = torch.cat([torch.from_numpy(p.pixel_values) for p in prepared])
            inputs["video_grid_thw"] = torch.tensor([p.grid for p in prepared])
            if family == "qwen2_5_vl":  # (Qwen2_5_VLProcessor: temporal_patch_size / the sampled fps)
                inputs["second_per_grid_ts"] = torch.tensor(
                    [2 / (len(videos.sample(i)) / i.total_frames * i.fps) for i in infos])
            wrapper = "<|vision_start|><|video_pad|><|vision_end|>" if family == "qwen3_vl" else "<|video_pad|>"
            pieces = expanded.split(wrapper)
            expanded = pieces[0]
            for p, info, piece in zip(prepared, infos, pieces[1:]):
                t, h, w = p.grid
                if family == "qwen3_vl":  # (Qwen3VLProcessor.replace_video_token, _calculate_timestamps)
                    indices = videos.sample(info)
                    indices = indices + [indices[-1]] * (len(indices) % 2)
                    stamps = [(indices[i] / info.fps + indices[i + 1] / info.fps) / 2
                              for i in range(0, len(indices), 2)]
                    expanded += "".join(f"<{s:.1f} seconds><|vision_start|>" + "<|video_pad|>" * (h * w // 4)
                                        + "<|vision_end|>" for s in stamps) + piece
                else:
                    expanded += "<|video_pad|>" * (t * h * w // 4) + piece
        ids = tok(expanded, add_special_tokens=False, return_tensors="pt")["input_ids"]
        mm = (ids == model.config.image_token_id).int() + 2 * (ids == model.config.video_token_id).int()
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=mm, **inputs,
                                 max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        return ids.shape[1], gen[0, ids.shape[1]:].tolist()

    return run


def test_video_greedy_tokens_match_transformers(served, reference):
    family, _, _, daemon = served
    short = noise_video(25, (96, 64), 10, seed=1)  # 2.5 s: 4 frames (qwen3: 5, the last repeated)
    odd = noise_video(7, (60, 90), 3, seed=2, codec="libvpx-vp9", container="webm")  # frames counted by demuxing
    cases = [([("video", short)], "What happens in the video?"),
             ([("video", odd)], "And here?"),
             ([("image", noise_image(3, (70, 44))), ("video", short)], "Compare the picture and the video."),
             ([("video", short), ("video", odd)], "Two videos.")]
    assert_media_cases_match(daemon, reference, cases, NEW_TOKENS, label=(family,))
    # (two videos, each once through the tower; the image apart)
    assert (metric(daemon, "flare_vision_videos"), metric(daemon, "flare_vision_images")) == (2, 1)


def test_videos_from_files_and_the_model_card(served, reference):
    """A file:// video under --allowed-local-media-path is the same video; the model card says it takes video."""
    family, _, _, daemon = served
    data = noise_video(12, (80, 56), 6, seed=4)
    (daemon.media / "clip.mp4").write_bytes(data)
    content = [{"type": "video_url", "video_url": {"url": f"file://{daemon.media / 'clip.mp4'}"}},
               {"type": "text", "text": "Describe."}]
    status, body = daemon.chat([{"role": "user", "content": content}], max_tokens=NEW_TOKENS, temperature=0,
                               logprobs=True, top_logprobs=3, return_tokens_as_token_ids=True, ignore_eos=True)
    assert status == 200, body
    assert_greedy(body, reference([("video", data)], "Describe.")[1], family)
    status, models = daemon.request("GET", "/v1/models")
    caps = models["data"][0]["capabilities"]
    assert caps["video"] and caps["vision"] and not caps["audio"], caps


def test_bad_videos_are_400s_and_the_daemon_serves_on(served):
    family, _, _, daemon = served

    def ask(*parts, text="hi"):
        return daemon.chat([{"role": "user", "content": [*parts, {"type": "text", "text": text}]}], max_tokens=2)

    status, body = ask({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAAAAAA"}})
    assert status == 400 and body["error"]["param"] == "messages[0].content[0]", body
    assert "could not be read" in body["error"]["message"], body
    status, body = ask({"type": "video_url", "video_url": {}})
    assert status == 400 and body["error"]["param"] == "messages[0].content[0].video_url.url", body
    clip = video_part(noise_video(6, (32, 32), 6))
    status, body = ask(clip, clip, clip)
    assert status == 400 and "at most 2 videos" in body["error"]["message"], body
    assert body["error"]["param"] == "messages[0].content[2]", body
    status, body = ask(clip, text="<|vision_start|><|video_pad|><|vision_end|> twice")
    assert status == 400 and "placeholders" in body["error"]["message"], body
    status, body = ask({"type": "video_url", "video_url": {"url": "file:///etc/passwd"}})
    assert status == 400 and "video files are read only under" in body["error"]["message"], body
    status, body = ask(clip)
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body


def test_models_without_video_refuse_it(start_daemon, tiny_core):
    d = start_daemon(tiny_core)
    status, body = d.chat([{"role": "user", "content": [video_part(noise_video(4)), {"type": "text", "text": "hi"}]}],
                          max_tokens=2)
    assert status == 400 and "'video_url' is not supported (this model takes text)" in body["error"]["message"], body


def test_mm_processor_kwargs_set_a_requests_frames(served, reference):
    """vLLM's mm_processor_kwargs: fps and num_frames choose the frames (fewer frames, fewer tokens); a bad value or
    a key the model cannot apply is a 400 naming it."""
    family, _, _, daemon = served
    data = noise_video(40, (96, 64), 10, seed=6)

    def ask(**options):
        content = [video_part(data), {"type": "text", "text": "Describe."}]
        return daemon.chat([{"role": "user", "content": content}], max_tokens=2, temperature=0,
                           mm_processor_kwargs=options)

    default = ask()[1]["usage"]["prompt_tokens"]
    slower = ask(fps=1.0)[1]["usage"]["prompt_tokens"]  # 4 s: 8 frames at 2 a second, 4 at 1
    fixed = ask(num_frames=2)[1]["usage"]["prompt_tokens"]
    assert default > slower > fixed, (default, slower, fixed)
    status, body = ask(fps=-1)
    assert status == 400 and body["error"]["param"] == "mm_processor_kwargs" and "fps" in body["error"]["message"]
    status, body = ask(sharpen=True)
    assert status == 400 and body["error"]["param"] == "mm_processor_kwargs.sharpen", body


def test_the_chat_page_sends_videos(served, tmp_path):
    """chat.js (under Node) sends an attached video as a video_url part: the answer's prompt holds its tokens."""
    from flared_testing.video import video_url
    from flared_testing.webui import ask_through_chat_js

    family, _, _, daemon = served
    data = noise_video(12, (80, 56), 6, seed=8)
    got = ask_through_chat_js(daemon, video_url(data), "What happens?", tmp_path)
    assert got["mp4"] == {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    content = [video_part(data), {"type": "text", "text": "What happens?"}]
    status, body = daemon.chat([{"role": "user", "content": content}], max_tokens=2)
    assert status == 200 and got["usage"]["prompt_tokens"] == body["usage"]["prompt_tokens"], (got, body)


def test_a_video_past_the_context_is_refused_before_decoding(served):
    """A video whose frames would take more tokens than the context (1024) is a 400 context_length_exceeded
    naming its part, told from its frame count and size before a frame is decoded."""
    family, _, _, daemon = served
    options = {"fps": 30, "max_pixels": 12_000_000} if family == "qwen3_vl" else {"fps": 30, "min_pixels": 19600}
    data = noise_video(300, (160, 160), 30, seed=9, smooth=True)
    status, body = daemon.chat([{"role": "user", "content": [video_part(data), {"type": "text", "text": "Hi."}]}],
                               max_tokens=2, mm_processor_kwargs=options)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert body["error"]["param"] == "messages[0].content[0]", body
    assert "the video takes" in body["error"]["message"] and "300 frames" in body["error"]["message"], body


def test_tokenize_counts_a_videos_tokens(served):
    """vLLM's /tokenize on a chat with a video part counts the video's tokens as the chat does (its
    mm_processor_kwargs too)."""
    family, _, _, daemon = served
    data = noise_video(40, (96, 64), 10, seed=12)
    messages = [{"role": "user", "content": [video_part(data), {"type": "text", "text": "Hi."}]}]
    for options in ({}, {"num_frames": 4}):
        status, chat = daemon.chat(messages, max_tokens=1, mm_processor_kwargs=options)
        assert status == 200, chat
        status, tokens = daemon.request("POST", "/tokenize", {"model": "tiny", "messages": messages,
                                                              "mm_processor_kwargs": options})
        assert status == 200 and tokens["count"] == chat["usage"]["prompt_tokens"], (family, options, tokens)
