"""Mistral3 (Mistral-Small-3.1's architecture: Pixtral tower, patch merger, Mistral decoder) end to end: a
random-weight model exported and served by a real `flared run`, its greedy tokens checked against transformers'
Mistral3ForConditionalGeneration on the same weights, prompt and pixels (transformers' Pixtral image processor;
the image as rows of [IMG] tokens, each row ended by [IMG_BREAK], the last by [IMG_END])."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from flared_testing.vision import ask_greedy, assert_cases_match, noise_image, pixtral_reference  # noqa: E402

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def daemon(tiny_mistral3, tmp_path_factory):
    from flared_testing.daemon import Daemon

    d = Daemon(tiny_mistral3[1], tmp_path_factory.mktemp("mistral3-daemon"))
    yield d
    d.kill()


@pytest.fixture(scope="module")
def reference(tiny_mistral3):
    from transformers import Mistral3ForConditionalGeneration

    return pixtral_reference(tiny_mistral3[0], Mistral3ForConditionalGeneration, merge=2, patch=8,
                             new_tokens=NEW_TOKENS)


def _ask(daemon, images, text, **kw):
    return ask_greedy(daemon, images, text, NEW_TOKENS, **kw)


def test_greedy_tokens_match_transformers(daemon, reference):
    wide, tall, small = noise_image(51, (90, 40)), noise_image(52, (30, 100)), noise_image(53, (20, 12))
    assert_cases_match(daemon, reference, (([wide], "What is in the picture?"), ([tall], "And this one?"),
                                           ([small], "Tiny."), ([wide, tall], "Compare them."),
                                           ([tall, wide], "Compare them.")), NEW_TOKENS)

