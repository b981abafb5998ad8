"""llama.cpp's prompt objects on /completion: ``{"prompt_string": "... <__media__> ...", "multimodal_data": [base64]}``
(as llama-server takes them, and as text-generation-webui sends them). Each marker takes its item's place, an image
or, on an audio model, a clip; the answer is the one the same prompt gets through the chat API."""

from __future__ import annotations

import base64

import pytest

pytest.importorskip("transformers")

from flared_testing.audio import input_audio, tone, wav_bytes  # noqa: E402

QWEN2_AUDIO_TURN = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nAudio 1: "
                    "<|audio_bos|><__media__><|audio_eos|>\nListen.<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def audio_daemon(tiny_qwen2_audio, tmp_path_factory):
    from flared_testing.daemon import Daemon

    d = Daemon(tiny_qwen2_audio[1], tmp_path_factory.mktemp("llamacpp-media"))
    yield d
    d.kill()


def complete(daemon, prompt, **kw):
    return daemon.request("POST", "/completion", {"prompt": prompt, "n_predict": 6, "temperature": 0,
                                                  "return_tokens": True, **kw})


def test_a_clip_at_a_marker_answers_as_the_chat_api(audio_daemon):
    x = tone(41, 1.2)
    clip = base64.b64encode(wav_bytes(x)).decode()
    status, got = complete(audio_daemon, {"prompt_string": QWEN2_AUDIO_TURN, "multimodal_data": [clip]})
    assert status == 200, got
    status, want = audio_daemon.chat([{"role": "user", "content": [input_audio(x), {"type": "text",
                                                                                   "text": "Listen."}]}],
                                     max_tokens=6, temperature=0, return_token_ids=True)
    assert status == 200, want
    assert got["tokens_evaluated"] == want["usage"]["prompt_tokens"]
    assert got["tokens"] == want["choices"][0]["token_ids"]
    status, several = complete(audio_daemon, [{"prompt_string": QWEN2_AUDIO_TURN, "multimodal_data": [clip]},
                                              "plain text"])
    assert status == 200 and several[0]["tokens"] == got["tokens"], several
    status, text = complete(audio_daemon, {"prompt_string": "no media here"})
    assert status == 200 and text["tokens_evaluated"] == complete(audio_daemon, "no media here")[1][
        "tokens_evaluated"]


def test_prompt_objects_that_do_not_fit_are_a_400(audio_daemon, tiny_core, start_daemon):
    clip = base64.b64encode(wav_bytes(tone(42, 0.5))).decode()
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(32)).decode()
    for prompt, param, words in (
            ({"prompt_string": "<__media__> <__media__>", "multimodal_data": [clip]}, "prompt.prompt_string",
             "holds 2 <__media__> markers for 1"),
            ({"prompt_string": "<__media__>", "multimodal_data": [png]}, "prompt.multimodal_data[0]",
             "takes text and audio"),
            ({"prompt_string": "<__media__>", "multimodal_data": ["%%%"]}, "prompt.multimodal_data[0]",
             "not valid base64"),
            ({"prompt_string": 5}, "prompt.prompt_string", "must be a string"),
            ({"prompt_string": "x", "multimodal_data": "abc"}, "prompt.multimodal_data", "array of base64")):
        status, body = complete(audio_daemon, prompt)
        assert status == 400 and body["error"]["param"] == param and words in body["error"]["message"], body
    text_model = start_daemon(tiny_core)
    status, body = complete(text_model, {"prompt_string": "<__media__>", "multimodal_data": [clip]})
    assert status == 400 and "this model takes text" in body["error"]["message"], body


def test_an_image_at_a_marker_on_a_vision_model(tiny_vlm_core, start_daemon):
    """SmolVLM: an image's tile tokens take the marker's place (the prompt grows by them); the answer is the
    chat API's for the same prompt (the chat template's turn, its image where the template puts it)."""
    from flared_testing.vision import data_url, noise_image

    d = start_daemon(tiny_vlm_core)
    image = noise_image(43, (60, 40))
    url = data_url(image)
    status, chat = d.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                        {"type": "text", "text": "What is it?"}]}],
                          max_tokens=6, temperature=0, return_token_ids=True)
    assert status == 200, chat
    from flared.core.load import open_core
    from flared.frontend.template import ChatTemplate

    core = open_core(tiny_vlm_core)
    text = ChatTemplate(core.chat_template()).render(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}],
        add_generation_prompt=True)
    assert text.count("<image>") == 1, text
    prompt = text.replace("<image>", "<__media__>")
    status, got = complete(d, {"prompt_string": prompt, "multimodal_data": [url.split(",", 1)[1]]})
    assert status == 200, got
    assert got["tokens_evaluated"] == chat["usage"]["prompt_tokens"]
    assert got["tokens"] == chat["choices"][0]["token_ids"]
