"""Helpers the vision tests share: images as data URLs, and greedy tokens checked against transformers'."""

from __future__ import annotations

import base64
import io

import numpy as np


def noise_image(seed: int, size=(70, 50)):
    """A random RGB image of ``size`` (width, height)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), "RGB")


def data_url(image, fmt="PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


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
    ignored), with the token ids (``token_ids``) and three alternatives a step (``assert_greedy``)."""
    content = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
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
