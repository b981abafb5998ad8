"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 cores end to end: random-weight models exported and served by a real `flared run`,
their greedy tokens checked against transformers on the same weights, prompt and pixels (transformers' own image
processor, prompt expansion and 3D rope positions). The decoder runs mRoPE (interleaved on Qwen3-VL, with
DeepStack rows added after its first layers); the tower a 2D rope over any image size, windowed on Qwen2.5-VL,
with a resampled position table on Qwen3-VL and Qwen3.5 (whose decoder mixes Gated DeltaNet layers with gated
attention ones, rotating a quarter of each head in mRoPE)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from flared_testing.vision import (  # noqa: E402
    ask_greedy, assert_cases_match, assert_greedy, metric, noise_image, processor_settings, reference_tokenizer,
    token_ids,
)

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def served(tiny_qwen_vl, tmp_path_factory):
    from flared_testing.daemon import Daemon

    family, checkpoint, core = tiny_qwen_vl
    d = Daemon(core, tmp_path_factory.mktemp(f"{family}-daemon"))
    yield family, checkpoint, d
    d.kill()


@pytest.fixture(scope="module")
def reference(served):
    """Greedy tokens transformers makes for a user turn of images then text."""
    import torch
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    _, checkpoint, _ = served
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tok = reference_tokenizer(checkpoint)
    processor = Qwen2VLImageProcessorPil(**processor_settings(checkpoint))

    def run(images, text: str):
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        prompt = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
        out = processor(images=images, return_tensors="pt")
        pieces = prompt.split("<|image_pad|>")
        expanded = pieces[0]
        for grid, piece in zip(out["image_grid_thw"].tolist(), pieces[1:]):
            expanded += "<|image_pad|>" * (grid[0] * grid[1] * grid[2] // 4) + piece
        ids = tok(expanded, add_special_tokens=False, return_tensors="pt")["input_ids"]
        mm = (ids == model.config.image_token_id).int()
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=mm,
                                 pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                                 max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
        return ids.shape[1], gen[0, ids.shape[1]:].tolist()

    return run


def _ask(daemon, images, text, **kw):
    return ask_greedy(daemon, images, text, NEW_TOKENS, **kw)


def test_greedy_tokens_match_transformers(served, reference):
    family, _, daemon = served
    wide, tall, small = noise_image(21, (90, 40)), noise_image(22, (30, 100)), noise_image(23, (12, 12))
    assert_cases_match(daemon, reference, (([wide], "What is in the picture?"), ([tall], "And this one?"),
                                           ([small], "Tiny."), ([wide, tall], "Compare them."),
                                           ([tall, wide], "Compare them.")), NEW_TOKENS, label=(family,))


def test_text_requests_and_images_share_the_daemon(served, reference):
    """Text-only requests on a VL core run plain positions beside a request with 3D ones, in one batch."""
    import concurrent.futures

    family, _, daemon = served
    image = noise_image(24, (64, 64))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        text_jobs = [pool.submit(daemon.chat, [{"role": "user", "content": f"Say something {k}."}], max_tokens=8,
                                 temperature=0) for k in range(3)]
        vision = pool.submit(_ask, daemon, [image], "Describe it.")
        texts = [job.result() for job in text_jobs]
        body = vision.result()
    assert all(status == 200 for status, _ in texts)
    assert_greedy(body, reference([image], "Describe it.")[1], family)
    again = [daemon.chat([{"role": "user", "content": f"Say something {k}."}], max_tokens=8, temperature=0)[1]
             for k in range(3)]
    assert [t["choices"][0]["message"]["content"] for _, t in texts] == \
        [t["choices"][0]["message"]["content"] for t in again]
    assert token_ids(_ask(daemon, [image], "Describe it.")) == token_ids(body)  # prefix-cached this time


def test_speculative_steps_keep_3d_positions(served, reference, tiny_qwen_vl, tmp_path):
    """With speculative decoding, a request with images has its drafts checked at its own 3D positions: drafts
    are kept, and the tokens are still transformers'. The drafts come from a prediction of the answer (OpenAI's
    predicted outputs) where the answer's text tokenizes back to its own ids; else (random weights write raw
    bytes) from prompt lookup over the answer's own repeats. Either way some must be kept (Qwen3.5's Gated DeltaNet
    layers take none: the tokens are still transformers')."""
    from flared_testing.daemon import Daemon
    from tokenizers import Tokenizer

    family, checkpoint, _ = served
    tok = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    text = "Tell me about it."
    for seed in range(25, 35):  # an image whose answer's text tokenizes back to it
        image = noise_image(seed, (70, 44))
        expected = reference([image], text)[1]
        answer = tok.decode(expected)
        if tok.encode(answer, add_special_tokens=False).ids[:6] == expected[:6]:
            extra = {"prediction": {"type": "content", "content": answer}}
            break
    else:  # no such answer (Qwen3-VL's tiny model): its first, whose drafts come from its own repeats
        image = noise_image(25, (70, 44))
        expected, extra = reference([image], text)[1], {}
    d = Daemon(tiny_qwen_vl[2], tmp_path, "--speculative-tokens", "4")
    try:
        body = _ask(d, [image], text, **extra)
        accepted = metric(d, "flare_speculative_accepted_tokens")
    finally:
        d.kill()
    assert_greedy(body, expected, family)
    if family == "qwen3_5":  # a Gated DeltaNet model never speculates: a rejected draft would move its state on
        assert accepted == 0 and "speculative decoding is off" in d.log()
    else:
        assert accepted > 0, family

