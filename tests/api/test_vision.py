"""Images through a vision-language core, end to end: a random-weight SmolVLM (Idefics3 family) exported and
served by a real `flared run`, its greedy tokens checked against transformers' SmolVLMForConditionalGeneration
on the same weights, prompt and pixels (transformers' own image processor and prompt expansion)."""

from __future__ import annotations


import pytest

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from conftest import SMOLVLM_PREPROCESSOR  # noqa: E402 - after the skips
from flared_testing.vision import (  # noqa: E402
    ask_greedy, assert_cases_match, assert_greedy, data_url, metric, noise_image, reference_tokenizer, token_ids,
)

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def reference(tiny_hf_smolvlm):
    """Greedy tokens transformers makes for [image, text] user turns."""
    import torch
    from transformers import SmolVLMForConditionalGeneration
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    model = SmolVLMForConditionalGeneration.from_pretrained(tiny_hf_smolvlm, dtype=torch.float32).eval()
    tok = reference_tokenizer(tiny_hf_smolvlm)
    settings = {k: v for k, v in SMOLVLM_PREPROCESSOR.items() if k != "image_processor_type"}
    processor = SmolVLMImageProcessorPil(**settings)

    def run(images, text: str):
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        prompt = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
        out = processor(images=[images], return_row_col_info=True, return_tensors="pt")
        pieces = prompt.split("<image>")
        expanded = pieces[0]
        for k, piece in enumerate(pieces[1:]):
            expanded += get_image_prompt_string(out["rows"][0][k], out["cols"][0][k], 4, "<fake_token_around_image>",
                                                "<image>", "<global-img>") + piece
        ids = tok(expanded, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            gen = model.generate(input_ids=ids, pixel_values=out["pixel_values"],
                                 pixel_attention_mask=out["pixel_attention_mask"], max_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        return ids.shape[1], gen[0, ids.shape[1]:].tolist()

    return run


@pytest.fixture(scope="module")
def vlm_daemon(tiny_vlm_core, tmp_path_factory):
    from flared_testing.daemon import Daemon

    d = Daemon(tiny_vlm_core, tmp_path_factory.mktemp("vlm-daemon"))
    yield d
    d.kill()


def _ask(daemon, images, text, **kw):
    return ask_greedy(daemon, images, text, NEW_TOKENS, **kw)


def test_export_records_the_image_tower(tiny_vlm_core):
    from flared.core.load import open_core

    core = open_core(tiny_vlm_core)
    assert core.manifest.capabilities["vision"] is True
    assert core.vision_config.image_seq_len == 4
    assert core.image_processor().tile == 32
    assert set(core.load_vision_tensors()) >= {"patch_embed.weight", "proj.weight", "layers.1.qkv.weight"}


def test_greedy_tokens_match_transformers(vlm_daemon, reference):
    a, b = noise_image(1), noise_image(2, (40, 90))
    assert_cases_match(vlm_daemon, reference, (([a], "What is in the picture?"), ([b], "What is in the picture?"),
                                               ([a, b], "Compare them."), ([b, a], "Compare them."),
                                               ([a], "What is in the picture?")), NEW_TOKENS)


def test_a_cached_prompt_is_reused_only_with_the_same_image(vlm_daemon, reference):
    """The prefix cache keys image tokens by the image: the same text with another image recomputes from the
    image on (and still matches transformers), the same image again reuses the cached prompt."""
    text = "Describe the image in one word, please, with as much care as you can muster."
    a, c = noise_image(3, (96, 64)), noise_image(4, (96, 64))
    first = _ask(vlm_daemon, [a], text)
    other = _ask(vlm_daemon, [c], text)
    again = _ask(vlm_daemon, [a], text)
    assert_greedy(other, reference([c], text)[1], "other image")
    assert_greedy(first, reference([a], text)[1], "first")
    assert token_ids(first) == token_ids(again)
    cached = lambda body: (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)  # noqa: E731
    assert cached(again) > cached(other)


def test_an_image_sent_again_reuses_its_tower_rows(vlm_daemon, reference):
    """A conversation re-sends its image every turn: the tower runs once for it (the rows of recent images are
    kept), and the answer is still transformers'."""
    image = noise_image(11, (50, 50))
    before = metric(vlm_daemon, "flare_vision_images")
    first = _ask(vlm_daemon, [image], "Look at this.")
    assert metric(vlm_daemon, "flare_vision_images") == before + 1
    second = _ask(vlm_daemon, [image], "And now, what do you see in it?")
    third = _ask(vlm_daemon, [image, image], "Twice.")  # one image twice in a prompt: one run, none here
    assert metric(vlm_daemon, "flare_vision_images") == before + 1
    assert_greedy(first, reference([image], "Look at this.")[1], "first")
    assert_greedy(second, reference([image], "And now, what do you see in it?")[1], "second")
    assert_greedy(third, reference([image, image], "Twice.")[1], "twice")


def test_bad_images_are_a_400_naming_the_part(vlm_daemon):
    def ask(part):
        return vlm_daemon.chat([{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}], max_tokens=2)

    status, body = ask({"type": "image_url", "image_url": {"url": "data:image/png;base64,not-base64!"}})
    assert status == 400 and body["error"]["param"] == "messages[0].content[1]", body
    status, body = ask({"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/cat.png"}})
    assert status == 400 and "fetching the image from 127.0.0.1 failed" in body["error"]["message"], body
    status, body = ask({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}})
    assert status == 400 and "file:// image URLs are not read" in body["error"]["message"], body
    status, body = ask({"type": "image_url", "image_url": {}})
    assert status == 400 and body["error"]["param"] == "messages[0].content[1].image_url.url", body
    too_many = [{"type": "image_url", "image_url": {"url": data_url(noise_image(k, (8, 8)))}} for k in range(9)]
    status, body = vlm_daemon.chat([{"role": "user", "content": too_many}], max_tokens=2)
    assert status == 400 and "at most 8 images" in body["error"]["message"], body
    # the daemon serves on
    assert _ask(vlm_daemon, [noise_image(5)], "hi")["choices"][0]["finish_reason"] == "length"


def test_a_text_model_refuses_images(start_daemon, tiny_core):
    d = start_daemon(tiny_core)
    status, body = d.chat([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(noise_image(1))}}, {"type": "text", "text": "hi"}]}],
        max_tokens=2)
    assert status == 400 and "'image_url' is not supported (this model takes text)" in body["error"]["message"], body
    assert body["error"]["param"] == "messages[0].content[0]"



def test_every_api_shape_takes_images(vlm_daemon):
    """Anthropic image blocks, Ollama's images (chat and generate) and Responses' input_image give the answer
    the OpenAI chat route gives for the same image and text (all greedy)."""
    image, text = noise_image(7, (64, 40)), "What is it?"
    url = data_url(image)
    b64 = url.split(",", 1)[1]
    status, openai = vlm_daemon.chat([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}],
        max_tokens=NEW_TOKENS, temperature=0)
    assert status == 200, openai
    expected = openai["choices"][0]["message"]["content"]
    assert expected

    status, body = vlm_daemon.request("POST", "/v1/messages", {
        "model": "tiny", "max_tokens": NEW_TOKENS, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
            {"type": "text", "text": text}]}]})
    assert status == 200 and body["content"][0]["text"] == expected, body

    status, body = vlm_daemon.request("POST", "/api/chat", {
        "model": "tiny", "stream": False, "options": {"temperature": 0, "num_predict": NEW_TOKENS},
        "messages": [{"role": "user", "content": text, "images": [b64]}]})
    assert status == 200 and body["message"]["content"] == expected, body

    status, body = vlm_daemon.request("POST", "/api/generate", {
        "model": "tiny", "stream": False, "prompt": text, "images": [b64],
        "options": {"temperature": 0, "num_predict": NEW_TOKENS}})
    assert status == 200 and body["response"] == expected, body

    status, body = vlm_daemon.request("POST", "/v1/responses", {
        "model": "tiny", "max_output_tokens": NEW_TOKENS, "temperature": 0, "store": False, "input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": url},
                                         {"type": "input_text", "text": text}]}]})
    assert status == 200 and body["output"][-1]["content"][0]["text"] == expected, body

    status, body = vlm_daemon.request("GET", "/v1/models")
    assert body["data"][0]["capabilities"]["vision"] is True
    status, body = vlm_daemon.request("POST", "/api/show", {"model": "tiny"})
    assert "vision" in body["capabilities"]
    status, body = vlm_daemon.request("POST", "/v1/messages", {
        "model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:1/a.png"}}]}]})
    assert status == 400 and "fetching the image" in body["error"]["message"], body


def test_image_tokens_come_only_from_images(vlm_daemon):
    """A message's text that spells the image token would run its embedding where no image is: a 400, as is an
    image on a route that does not read them; /v1/systemone reads them as chat does."""
    status, body = vlm_daemon.chat([{"role": "user", "content": "Look: <image> here"}], max_tokens=2)
    assert status == 400 and "image tokens" in body["error"]["message"], body
    image = noise_image(31, (40, 40))
    part = {"type": "image_url", "image_url": {"url": data_url(image)}}
    status, body = vlm_daemon.request("POST", "/v1/decisions", {
        "model": "tiny", "messages": [{"role": "user", "content": [
            {"type": "image", "image": data_url(image)}, {"type": "text", "text": "yes or no?"}]}],
        "options": ["yes", "no"]})
    assert status == 400, body
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "What?"}]}]
    status, chat = vlm_daemon.chat(messages, max_tokens=6, temperature=0)
    status1, one = vlm_daemon.request("POST", "/v1/systemone", {"model": "tiny", "messages": messages,
                                                                "max_tokens": 6, "temperature": 0})
    assert status == status1 == 200, one
    assert one["choices"][0]["message"]["content"] == chat["choices"][0]["message"]["content"]


def test_the_chat_page_sends_images(vlm_daemon, tmp_path):
    """The chat page's request code (chat.js's userContent and streamChat, under Node) sends an attached image
    as the OpenAI SDK does, and gets the answer the API gives; the page offers the attach button only where the
    model card says vision."""
    from flared_testing.webui import ask_through_chat_js

    url = data_url(noise_image(41, (50, 30)))
    out = ask_through_chat_js(vlm_daemon, url, "What is it?", tmp_path)
    status, body = vlm_daemon.chat([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]}],
        max_tokens=6, temperature=0)
    assert out["content"] == body["choices"][0]["message"]["content"] and out["text"] == "only text"
    assert out["usage"]["prompt_tokens"] == body["usage"]["prompt_tokens"]


class _Images:
    """A local HTTP server for image URLs: /cat.png, /big.png (past the byte limit), /missing (404) and
    /elsewhere (a redirect to the same server by the name localhost)."""

    def __init__(self, png: bytes):
        import http.server
        import threading

        files = {"/cat.png": png}

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                port = self.server.server_address[1]
                if self.path == "/elsewhere":
                    self.send_response(302)
                    self.send_header("Location", f"http://localhost:{port}/cat.png")
                    self.end_headers()
                elif self.path == "/big.png":
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.end_headers()
                    self.wfile.write(b"\0" * ((10 << 20) + 10))
                elif self.path in files:
                    self.send_response(200)
                    self.send_header("Content-Type", "image/png")
                    self.end_headers()
                    self.wfile.write(files[self.path])
                else:
                    self.send_error(404)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def test_image_urls_are_fetched_as_vllm_fetches_them(vlm_daemon, tiny_vlm_core, tmp_path):
    """An http(s) image URL gives the answer its bytes give as a data URL; a 404, a file past the byte limit and a
    refused connection are 400s saying so; file:// URLs are read only under --allowed-local-media-path, and
    --allowed-media-domains holds for redirects too."""
    import base64

    from flared_testing.daemon import Daemon

    image = noise_image(61, (40, 30))
    url = data_url(image)
    png = base64.b64decode(url.split(",", 1)[1])
    server = _Images(png)

    def ask(daemon, source):
        return daemon.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": source}},
                                                          {"type": "text", "text": "What?"}]}],
                           max_tokens=6, temperature=0)

    try:
        expected = ask(vlm_daemon, url)[1]["choices"][0]["message"]["content"]
        status, body = ask(vlm_daemon, server.base + "/cat.png")
        assert status == 200 and body["choices"][0]["message"]["content"] == expected, body
        status, body = ask(vlm_daemon, server.base + "/missing")
        assert status == 400 and "HTTP 404" in body["error"]["message"], body
        status, body = ask(vlm_daemon, server.base + "/big.png")
        assert status == 400 and "larger than" in body["error"]["message"], body
        assert ask(vlm_daemon, server.base + "/elsewhere")[0] == 200  # any host: the redirect is followed

        (tmp_path / "media").mkdir()
        (tmp_path / "media" / "cat.png").write_bytes(png)
        d = Daemon(tiny_vlm_core, tmp_path, "--allowed-media-domains", "127.0.0.1",
                   "--allowed-local-media-path", str(tmp_path / "media"), "--limit-mm-per-prompt", "image=1")
        try:
            status, body = ask(d, (tmp_path / "media" / "cat.png").as_uri())
            assert status == 200 and body["choices"][0]["message"]["content"] == expected, body
            status, body = ask(d, (tmp_path / "media" / ".." / "daemon.log").as_uri())
            assert status == 400 and "only under" in body["error"]["message"], body
            assert ask(d, server.base + "/cat.png")[0] == 200
            status, body = ask(d, server.base + "/elsewhere")  # to localhost, not an allowed host
            assert status == 400 and "not localhost" in body["error"]["message"], body
            status, body = d.chat([{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}}, {"type": "image_url", "image_url": {"url": url}}]}],
                max_tokens=2)
            assert status == 400 and "at most 1 image a request" in body["error"]["message"], body
        finally:
            d.kill()
    finally:
        server.close()
