"""Helpers the vision tests share: test images (noise, gradients, every PIL mode), images as data URLs, and greedy
tokens checked against transformers'."""

from __future__ import annotations

import base64
import io
import json

import numpy as np


def noise_image(seed: int, size=(70, 50)):
    """A random RGB image of ``size`` (width, height)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def noise_rgb(width: int, height: int, seed: int = 4321):
    """Random RGB pixels, a different image for every size and seed."""
    from PIL import Image

    rng = np.random.default_rng(seed + width * 7919 + height)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def gradient(width: int, height: int):
    """A smooth RGB gradient (compresses well and survives JPEG roughly intact)."""
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    arr = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], -1)
    return Image.fromarray(arr.astype(np.uint8))


def encode(image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def reopen(image, fmt: str, **kw):
    """``image`` saved as ``fmt`` and decoded again (what a client's file is when it arrives)."""
    from PIL import Image

    out = Image.open(io.BytesIO(encode(image, fmt, **kw)))
    out.load()
    return out


def mode_images(width: int = 61, height: int = 37, seed: int = 11, border: int = 4) -> dict:
    """A gradient in each PIL mode a client may send: RGB, RGBA and LA (random alpha, its first ``border`` rows clear
    and last opaque), L, 1, palette without and with a transparent index, and RGB with a tRNS colour; keyed by mode
    ("+..." where the mode alone does not say it)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    base = gradient(width, height)
    alpha = rng.integers(0, 256, (height, width), dtype=np.uint8)
    alpha[:border] = 0
    alpha[-border:] = 255
    rgba = base.copy()
    rgba.putalpha(Image.fromarray(alpha))
    la = base.convert("L")
    la.putalpha(Image.fromarray(alpha))
    pal = base.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    pal_t = pal.copy()
    pal_t.info["transparency"] = 3
    return {
        "RGB": base,
        "RGBA": rgba,
        "L": base.convert("L"),
        "LA": la,
        "P": reopen(pal, "PNG"),
        "P+transparency": reopen(pal_t, "PNG"),
        "1": base.convert("1"),
        "RGB+tRNS": reopen(base, "PNG", transparency=tuple(int(v) for v in np.asarray(base)[border + 1, border + 2])),
    }


def mode_image(width: int, height: int, mode: str, seed: int):
    """Random RGB pixels over a vertical gradient (in green, so resampling sees structure), as ``mode``: "RGB",
    "RGBA" (random alpha), "L" or "P" (an adaptive palette of 37 colours)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    rgb = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    y, _ = np.mgrid[0:height, 0:width]
    rgb[..., 1] = (rgb[..., 1] // 4 + (y * 191 // max(height - 1, 1))).astype(np.uint8)
    im = Image.fromarray(rgb, "RGB")
    if mode == "RGBA":
        im.putalpha(Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8), "L"))
    elif mode == "L":
        im = im.convert("L")
    elif mode == "P":
        im = im.convert("P", palette=Image.Palette.ADAPTIVE, colors=37)
    return im


def data_url(image, fmt="PNG") -> str:
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(encode(image, fmt)).decode()


def reference_tokenizer(checkpoint, **special_tokens):
    """transformers' fast tokenizer of a test checkpoint's tokenizer.json, with its chat template."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"), **special_tokens)
    tok.chat_template = json.loads((checkpoint / "tokenizer_config.json").read_text())["chat_template"]
    return tok


def processor_settings(checkpoint, **overrides) -> dict:
    """A test checkpoint's preprocessor_config.json as keyword arguments for transformers' image processor class."""
    settings = json.loads((checkpoint / "preprocessor_config.json").read_text())
    return {k: v for k, v in {**settings, **overrides}.items() if k != "image_processor_type"}


def assert_cases_match(daemon, reference, cases, max_tokens: int, label=(), **kw) -> None:
    """Each (images, text) user turn asked greedily of the daemon (``kw``: more request fields): its prompt length
    and tokens are what ``reference(images, text)`` (transformers) gives."""
    for images, text in cases:
        body = ask_greedy(daemon, images, text, max_tokens, **kw)
        num_prompt, expected = reference(images, text)
        assert body["usage"]["prompt_tokens"] == num_prompt, (*label, len(images))
        assert_greedy(body, expected, (*label, len(images), text))


def token_ids(resp) -> list[int]:
    """The output ids of a chat answer asked with logprobs and return_tokens_as_token_ids."""
    return [int(t["token"].split(":", 1)[1]) for t in resp["choices"][0]["logprobs"]["content"]]


def assert_greedy(resp, expected: list[int], what) -> None:
    """Our greedy tokens are transformers', up to a near tie (float32 sums in another order): where they first
    differ, transformers' token must be within 1e-3 of ours in our logprobs; after it the two texts part."""
    got = token_ids(resp)
    assert len(got) == len(expected), what
    for k, (g, e) in enumerate(zip(got, expected)):
        if g != e:
            step = resp["choices"][0]["logprobs"]["content"][k]
            top = {t["token"]: t["logprob"] for t in step["top_logprobs"]}
            assert step["logprob"] - top.get(f"token_id:{e}", -1e9) < 1e-3, (what, k, got, expected)
            return


def ask_greedy(daemon, images, text: str, max_tokens: int, **kw):
    """One user turn of images then text through /v1/chat/completions, greedy, ``max_tokens`` tokens (EOS
    ignored), with the token ids (``token_ids``) and three alternatives a step (``assert_greedy``). An item of
    ``images`` that is a dict is a content part of its own (a video's, an audio clip's) and goes as it is."""
    content = [im if isinstance(im, dict) else {"type": "image_url", "image_url": {"url": data_url(im)}}
               for im in images]
    content.append({"type": "text", "text": text})
    status, body = daemon.chat([{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0,
                               logprobs=True, top_logprobs=3, return_tokens_as_token_ids=True, ignore_eos=True, **kw)
    assert status == 200, body
    return body


def metric(daemon, name: str) -> float:
    """A counter's value (its first sample) from the daemon's /metrics, parsed as Prometheus does."""
    from prometheus_client.parser import text_string_to_metric_families

    _, text = daemon.request("GET", "/metrics")
    for family in text_string_to_metric_families(text.decode()):
        if family.name == name:
            return family.samples[0].value
    raise AssertionError(f"no {name} metric")


def pixtral_reference(checkpoint, model_class, *, merge: int, patch: int, new_tokens: int):
    """transformers' answer ``run(pictures, text) -> (prompt tokens, greedy tokens)`` for a Pixtral-tower
    checkpoint (``model_class``: Mistral3ForConditionalGeneration, or LlavaForConditionalGeneration for Pixtral
    12B) on the same pixels and prompt: transformers' Pixtral image processor, and each image as rows of [IMG]
    tokens (a token a ``merge`` x ``merge`` block of patches), each row ended by [IMG_BREAK], the last by
    [IMG_END]. transformers' PixtralProcessor module needs torchvision (not installed here): it hands the image
    processor patch x merge as its patch size and writes that rule (tests/frontend/test_images_pixtral.py checks
    the rule against its own code)."""
    import torch
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    model = model_class.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tok = reference_tokenizer(checkpoint, bos_token="<s>", eos_token="</s>")
    unit = patch * merge
    images = PixtralImageProcessorPil(**processor_settings(checkpoint, patch_size=unit))

    def run(pictures, text: str):
        content = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": text}]
        prompt = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False)
        out = images(pictures, return_tensors="pt")
        pieces = prompt.split("[IMG]")
        expanded = pieces[0]
        for (h, w), piece in zip(out["image_sizes"].tolist(), pieces[1:]):
            rows = ["[IMG]" * (w // unit) + "[IMG_BREAK]"] * (h // unit)
            expanded += "".join(rows)[:-len("[IMG_BREAK]")] + "[IMG_END]" + piece
        ids = tok(expanded, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            gen = model.generate(input_ids=ids, pixel_values=out["pixel_values"], image_sizes=out["image_sizes"],
                                 max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        return ids.shape[1], gen[0, ids.shape[1]:].tolist()

    return run


def user_turn(tok, kinds, text: str, *, text_first: bool = False) -> str:
    """One user turn rendered by a reference tokenizer's chat template (and the generation prompt): a part of each
    of ``kinds`` ("image", "video", "audio") and the text, after them or (``text_first``) before."""
    parts = [{"type": kind} for kind in kinds]
    parts = [{"type": "text", "text": text}, *parts] if text_first else [*parts, {"type": "text", "text": text}]
    return tok.apply_chat_template([{"role": "user", "content": parts}], tokenize=False, add_generation_prompt=True)


def gemma4_reference(checkpoint):
    """(transformers' Gemma4ForConditionalGeneration of a test checkpoint, in float32; its tokenizer and template;
    its image processor; its media tokens' ids, which the Gemma 4 parity tests keep out of outputs: transformers
    feeds a generated media token back as the pad token's embedding, flared as vLLM as its own)."""
    import torch
    from transformers import Gemma4ForConditionalGeneration
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    model = Gemma4ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tok = reference_tokenizer(checkpoint, bos_token="<bos>", eos_token="<turn|>", pad_token="<pad>")
    images = Gemma4ImageProcessorPil(**processor_settings(checkpoint))
    config = model.config
    return model, tok, images, [config.image_token_id, config.video_token_id, config.audio_token_id]
