"""Gemma 4's images end to end: random-weight models exported and served by a real `flared run`, their greedy tokens
checked against transformers' Gemma4ForConditionalGeneration on the same weights, prompt and pixels (transformers'
Gemma4ImageProcessorPil; each <|image|> as Gemma4Processor expands it).

Two models: one like E2B (per-layer inputs, whose image rows take the pad token's table rows; a layer sharing an
earlier one's keys; a tower with clipped products), and one like 26B-A4B and 31B (use_bidirectional_attention
"vision": an image's tokens attend to each other both ways on the windowed layers, as the mm_token_type_ids mask
has it; global layers of wider heads with keys as values; a standardizing tower).

The random models may emit a media token (<|image|>, <|video|>, <|audio|>) as output, which transformers then feeds
as the pad token's embedding (its placeholder mask), and flared, as vLLM, as the token's own; no trained model
emits them, and the tests keep these from doing so (transformers' suppress_tokens, our logit_bias of -100)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from flared_testing.vision import (  # noqa: E402
    ask_greedy, assert_cases_match, data_url, metric, noise_image, token_ids, user_turn,
)

NEW_TOKENS = 10
MODELS = ("tiny_gemma4_vision", "tiny_gemma4_vision_both_ways")


@pytest.fixture(scope="module", params=MODELS)
def served(request, tmp_path_factory):
    """(daemon, reference, checkpoint) for each model."""
    import torch

    from flared_testing.daemon import Daemon
    from flared_testing.vision import gemma4_reference

    checkpoint, core = request.getfixturevalue(request.param)
    model, tok, images, media = gemma4_reference(checkpoint)
    image_id = model.config.image_token_id

    def run(pictures, text: str, text_first: bool = False, both_ways: bool = True, scores: bool = False):
        """(prompt tokens, greedy tokens) of transformers; ``scores``: and each greedy token's logprob;
        ``both_ways`` False: without the image tokens' mm_token_type_ids (a causal mask over the images)."""
        prompt = user_turn(tok, ["image"] * len(pictures), text, text_first=text_first)
        kwargs = {}
        if pictures:
            prepared = images(pictures, return_tensors="pt")
            pieces = prompt.split("<|image|>")
            prompt = pieces[0] + "".join(f"<|image>{'<|image|>' * n}<image|>" + rest for n, rest in zip(
                prepared["num_soft_tokens_per_image"], pieces[1:]))
            kwargs = dict(pixel_values=prepared["pixel_values"], image_position_ids=prepared["image_position_ids"])
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        if pictures and both_ways:
            kwargs["mm_token_type_ids"] = (ids == image_id).long()
        with torch.no_grad():
            gen = model.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                                 suppress_tokens=media, **kwargs)
        tokens = gen.sequences[0, ids.shape[1]:].tolist()
        if not scores:
            return ids.shape[1], tokens
        # (the model's own logprobs, before suppress_tokens: ours are the model's before logit_bias, as vLLM's)
        logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(gen.logits, tokens)]
        return ids.shape[1], tokens, logprobs

    run.tokenizer = tok
    run.bias = {str(t): -100 for t in media}  # (our side of suppress_tokens)
    d = Daemon(core, tmp_path_factory.mktemp(request.param))
    yield d, run, request.param
    d.kill()


def test_greedy_tokens_match_transformers(served):
    daemon, reference, name = served
    wide, tall, small = noise_image(71, (90, 40)), noise_image(72, (30, 100)), noise_image(76, (10, 14))
    assert_cases_match(daemon, reference, (([wide], "What is in the picture?"), ([tall], "And this one?"),
                                           ([small], "Tiny."), ([wide, tall], "Compare them."),
                                           ([tall, wide], "Compare them.")), NEW_TOKENS, label=(name,),
                       logit_bias=reference.bias)
    assert metric(daemon, "flare_vision_images") == 3  # (three pictures; a repeated one's rows are cached)


def test_the_answer_depends_on_the_picture(served):
    _, reference, _ = served
    one = reference([noise_image(71, (90, 40))], "What is in the picture?")
    other = reference([noise_image(74, (90, 40))], "What is in the picture?")
    assert one[0] == other[0] and one[1] != other[1]


def test_an_image_the_prefill_chunk_would_cut_is_fed_whole(served):
    """The core's prefill chunk is 64 tokens: prompts whose image starts a token to three before the chunk's end
    answer as transformers. On the model whose images attend both ways, the chunk would have cut the image (its
    mask matters: transformers' own causal logprobs move by far more than ours differ)."""
    daemon, reference, name = served
    tok, image = reference.tokenizer, noise_image(73, (40, 40))  # (48 x 48 pixels: 16 image tokens)
    offsets = set()
    for words, filler in ((n, f) for f in ("Paris ", "dog ", "a ") for n in range(40)):
        text = filler * words + "Tell me."
        prompt = user_turn(tok, ["image"], text, text_first=True)
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        first = ids.index(tok.convert_tokens_to_ids("<|image|>")) + 1  # (after <|image>)
        if not first < 64 < first + 16 or 64 - first in offsets:
            continue
        offsets.add(64 - first)
        parts = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
        status, body = daemon.chat([{"role": "user", "content": parts}], max_tokens=NEW_TOKENS, temperature=0,
                                   logprobs=True, top_logprobs=3, return_tokens_as_token_ids=True, ignore_eos=True,
                                   logit_bias=reference.bias)
        assert status == 200, body
        num_prompt, expected, logprobs = reference([image], text, text_first=True, scores=True)
        assert body["usage"]["prompt_tokens"] == num_prompt
        assert token_ids(body) == expected, (name, filler, words)
        ours = [step["logprob"] for step in body["choices"][0]["logprobs"]["content"]]
        error = max(abs(a - b) for a, b in zip(ours, logprobs))
        assert error < 1e-3, (name, filler, words, error)
        if name == "tiny_gemma4_vision_both_ways":
            _, causal, causal_logprobs = reference([image], text, text_first=True, both_ways=False, scores=True)
            moved = max(abs(a - b) for a, b in zip(causal_logprobs, logprobs))
            assert causal != expected or moved > 10 * error, (filler, words, error, moved)
    assert len(offsets) >= 2


def test_a_repeated_image_is_answered_from_the_prefix_cache_as_transformers(served):
    daemon, reference, _ = served
    image = noise_image(75, (64, 48))
    first = ask_greedy(daemon, [image], "Describe it.", NEW_TOKENS, logit_bias=reference.bias)
    again = ask_greedy(daemon, [image], "Describe it.", NEW_TOKENS, logit_bias=reference.bias)
    assert token_ids(first) == token_ids(again) == reference([image], "Describe it.")[1]


def test_the_soft_token_budget_is_a_request_setting(served):
    """vLLM's mm_processor_kwargs ``max_soft_tokens`` (70 to 1120) sizes a request's images; another value is a 400
    naming it. Where images attend both ways, an image past the prefill chunk (64 tokens here) is a 400 that says
    so."""
    daemon, _, name = served
    image = noise_image(77, (200, 150))
    content = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": "Hi"}]
    sizes = {}
    for budget in (70, 140):
        status, body = daemon.chat([{"role": "user", "content": content}], max_tokens=1,
                                   mm_processor_kwargs={"max_soft_tokens": budget})
        if budget == 140 and name == "tiny_gemma4_vision_both_ways":
            assert status == 400 and "prefill chunk" in body["error"]["message"], body
            continue
        assert status == 200, body
        sizes[budget] = body["usage"]["prompt_tokens"]
    if name == "tiny_gemma4_vision":
        assert sizes[140] - sizes[70] == 130 - 63  # (10 x 13 blocks of 12 pixels at 140, 7 x 9 at 70)
    status, body = daemon.chat([{"role": "user", "content": content}], max_tokens=1,
                               mm_processor_kwargs={"max_soft_tokens": 100})
    assert status == 400 and "max_soft_tokens" in body["error"]["message"], body
    status, body = daemon.chat([{"role": "user", "content": content}], max_tokens=1,
                               mm_processor_kwargs={"max_pixels": 20000})  # (a Qwen processor's)
    assert status == 400 and "mm_processor_kwargs.max_pixels" in str(body["error"]), body


def test_a_checkpoint_with_its_processors_nested_exports_the_same(tiny_gemma4_vision, tmp_path):
    """transformers 5 saves a processor's parts nested in processor_config.json ("image_processor",
    "video_processor", "feature_extractor") with no preprocessor_config.json: the export reads the same settings."""
    import json
    import shutil

    from flared.core.export import ExportOptions, export_core

    checkpoint = tmp_path / "nested"
    shutil.copytree(tiny_gemma4_vision[0], checkpoint)
    proc = json.loads((checkpoint / "processor_config.json").read_text())
    proc["image_processor"] = json.loads((checkpoint / "preprocessor_config.json").read_text())
    proc["video_processor"] = json.loads((checkpoint / "video_preprocessor_config.json").read_text())
    (checkpoint / "processor_config.json").write_text(json.dumps(proc))
    (checkpoint / "preprocessor_config.json").unlink()
    (checkpoint / "video_preprocessor_config.json").unlink()
    options = ExportOptions(concurrency=2, context_tokens=512, prefill_chunk_tokens=64)
    ours = export_core(checkpoint, tmp_path / "ours", options).vision
    want = export_core(tiny_gemma4_vision[0], tmp_path / "want", options).vision
    assert (ours["processor"], ours["video"], ours["audio"]) == (want["processor"], want["video"], want["audio"])
