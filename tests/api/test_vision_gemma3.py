"""Gemma 3 (SigLIP tower, 2 x 2 average pool, Gemma RMSNorm and projection; a Gemma 3 decoder whose image tokens
attend to each other both ways) end to end: a random-weight model exported and served by a real `flared run`,
its greedy tokens checked against transformers' Gemma3ForConditionalGeneration on the same weights, prompt and
pixels (transformers' Gemma 3 image processor; each <start_of_image> as Gemma3Processor expands it; the image
tokens' token_type_ids, which make transformers' mask bidirectional within an image)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from flared_testing.vision import (  # noqa: E402
    ask_greedy, assert_cases_match, data_url, noise_image, processor_settings, reference_tokenizer, token_ids, user_turn,
)

NEW_TOKENS = 10
IMAGE_TOKENS = 16


@pytest.fixture(scope="module")
def daemon(tiny_gemma3, tmp_path_factory):
    from flared_testing.daemon import Daemon

    d = Daemon(tiny_gemma3[1], tmp_path_factory.mktemp("gemma3-daemon"))
    yield d
    d.kill()


@pytest.fixture(scope="module")
def reference(tiny_gemma3):
    import torch
    from transformers import Gemma3ForConditionalGeneration
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    checkpoint = tiny_gemma3[0]
    model = Gemma3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tok = reference_tokenizer(checkpoint, bos_token="<bos>", eos_token="<end_of_turn>")
    settings = processor_settings(checkpoint)
    del settings["image_seq_length"]  # (Gemma3Processor's, in the released preprocessor configs too)
    images = Gemma3ImageProcessorPil(**settings)
    image_id = model.config.image_token_id
    full = "\n\n<start_of_image>" + "<image_soft_token>" * IMAGE_TOKENS + "<end_of_image>\n\n"

    def run(pictures, text: str, text_first: bool = False, both_ways: bool = True, scores: bool = False):
        """(prompt tokens, greedy tokens) of transformers; ``scores``: and each greedy token's logprob;
        ``both_ways`` False: without the image tokens' token_type_ids (a causal mask over the images)."""
        prompt = user_turn(tok, ["image"] * len(pictures), text, text_first=text_first)
        ids = tok(prompt.replace("<start_of_image>", full), add_special_tokens=False, return_tensors="pt")["input_ids"]
        kwargs = {}
        if pictures:
            kwargs = dict(pixel_values=images(pictures, return_tensors="pt")["pixel_values"])
            if both_ways:
                kwargs["token_type_ids"] = (ids == image_id).long()
        with torch.no_grad():
            gen = model.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, output_scores=True, return_dict_in_generate=True, **kwargs)
        tokens = gen.sequences[0, ids.shape[1]:].tolist()
        if not scores:
            return ids.shape[1], tokens
        logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(gen.scores, tokens)]
        return ids.shape[1], tokens, logprobs

    run.tokenizer, run.full = tok, full
    return run


def test_greedy_tokens_match_transformers(daemon, reference):
    wide, tall = noise_image(71, (90, 40)), noise_image(72, (30, 100))
    assert_cases_match(daemon, reference, (([wide], "What is in the picture?"), ([tall], "And this one?"),
                                           ([wide, tall], "Compare them."), ([tall, wide], "Compare them.")),
                       NEW_TOKENS)


def test_an_image_the_prefill_chunk_would_cut_is_fed_whole(daemon, reference):
    """The core's prefill chunk is 64 tokens: prompts whose image starts a token to three before the chunk's end
    (a chunk cut there would leave the image's first tokens without its last ones) answer as transformers."""
    tok, image = reference.tokenizer, noise_image(73, (50, 50))
    offsets = set()
    for words, filler in ((n, f) for f in ("Paris ", "dog ", "a ") for n in range(40)):
        text = filler * words + "Tell me."
        prompt = user_turn(tok, ["image"], text, text_first=True)
        ids = tok(prompt.replace("<start_of_image>", reference.full), add_special_tokens=False)["input_ids"]
        first = ids.index(tok.convert_tokens_to_ids("<image_soft_token>"))
        if not first < 64 < first + IMAGE_TOKENS or 64 - first in offsets:
            continue
        offsets.add(64 - first)
        parts = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
        status, body = daemon.chat([{"role": "user", "content": parts}], max_tokens=NEW_TOKENS, temperature=0,
                                   logprobs=True, top_logprobs=3, return_tokens_as_token_ids=True, ignore_eos=True)
        assert status == 200, body
        num_prompt, expected, logprobs = reference([image], text, text_first=True, scores=True)
        assert body["usage"]["prompt_tokens"] == num_prompt == len(ids)
        assert token_ids(body) == expected, (filler, words)
        ours = [step["logprob"] for step in body["choices"][0]["logprobs"]["content"]]
        error = max(abs(a - b) for a, b in zip(ours, logprobs))
        # (the mask matters: causal over the image, transformers' own logprobs move by far more than ours differ)
        _, causal, causal_logprobs = reference([image], text, text_first=True, both_ways=False, scores=True)
        moved = max(abs(a - b) for a, b in zip(causal_logprobs, logprobs))
        assert error < 1e-3 and (causal != expected or moved > 10 * error), (filler, words, error, moved)
    assert len(offsets) >= 2


def test_the_answer_depends_on_the_picture(reference):
    one = reference([noise_image(71, (90, 40))], "What is in the picture?")
    other = reference([noise_image(74, (90, 40))], "What is in the picture?")
    assert one[0] == other[0] and one[1] != other[1]


def test_a_repeated_image_is_answered_from_the_prefix_cache_as_transformers(daemon, reference):
    """A second turn about the same image: its prompt's first turn comes from the prefix cache (the image's
    tokens were computed attending both ways when it was cached), the rest computed, as transformers does all."""
    image = noise_image(75, (64, 48))
    first = ask_greedy(daemon, [image], "Describe it.", NEW_TOKENS)
    again = ask_greedy(daemon, [image], "Describe it.", NEW_TOKENS)
    assert token_ids(first) == token_ids(again) == reference([image], "Describe it.")[1]
