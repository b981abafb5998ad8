"""Pixtral 12B (LLaVA's layout: Pixtral tower, LLaVA's two linears over every patch, Mistral decoder) end to end:
a random-weight model exported and served by a real `flared run`, its greedy tokens checked against transformers'
LlavaForConditionalGeneration on the same weights, prompt and pixels (transformers' Pixtral image processor; the
image as rows of [IMG] tokens, a token a patch, each row ended by [IMG_BREAK], the last by [IMG_END])."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

from flared_testing.vision import assert_cases_match, noise_image, pixtral_reference  # noqa: E402

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def daemon(tiny_pixtral, tmp_path_factory):
    from flared_testing.daemon import Daemon

    d = Daemon(tiny_pixtral[1], tmp_path_factory.mktemp("pixtral-daemon"))
    yield d
    d.kill()


@pytest.fixture(scope="module")
def reference(tiny_pixtral):
    from transformers import LlavaForConditionalGeneration

    return pixtral_reference(tiny_pixtral[0], LlavaForConditionalGeneration, merge=1, patch=8,
                             new_tokens=NEW_TOKENS)


def test_greedy_tokens_match_transformers(daemon, reference):
    wide, tall, small = noise_image(61, (90, 40)), noise_image(62, (30, 100)), noise_image(63, (20, 12))
    assert_cases_match(daemon, reference, (([wide], "What is in the picture?"), ([tall], "And this one?"),
                                           ([small], "Tiny."), ([wide, tall], "Compare them.")), NEW_TOKENS)


def test_the_model_card_says_vision(daemon):
    status, body = daemon.request("GET", "/v1/models")
    assert status == 200 and body["data"][0]["capabilities"]["vision"] is True


def test_the_answer_depends_on_the_picture(reference):
    """(the cases above would pass for a model that ignored its images only if transformers' did too)"""
    one = reference([noise_image(61, (90, 40))], "What is in the picture?")
    other = reference([noise_image(64, (90, 40))], "What is in the picture?")
    assert one[0] == other[0] and one[1] != other[1]
