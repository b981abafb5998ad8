"""The relevance judgment's prompt (flared/server/rerank.py) through real chat templates: on Qwen3's it is
Qwen3-Reranker's own prompt, character for character (its model card's prefix, query and document lines and
suffix); Gemma-2's refuses a system turn, and the user-turn form renders."""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest

from flared.frontend.template import ChatTemplate
from flared.server.rerank import DEFAULT_INSTRUCTION, judgment_messages

TEMPLATES_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "templates"


def _template(name: str) -> ChatTemplate:
    path = TEMPLATES_DIR / name
    if not path.exists():
        pytest.skip(f"template corpus not found at {TEMPLATES_DIR.resolve()} (expected ../shared/templates)")
    return ChatTemplate(path.read_text())


def test_on_qwen3s_template_the_prompt_is_qwen3_rerankers():
    got = _template("trl-qwen3_training.jinja").render(
        judgment_messages(DEFAULT_INSTRUCTION, "What is the capital of China?", "The capital of China is Beijing."),
        add_generation_prompt=True, enable_thinking=False)
    prefix = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
              'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n')
    suffix = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    body = (f"<Instruct>: {DEFAULT_INSTRUCTION}\n<Query>: What is the capital of China?\n"
            "<Document>: The capital of China is Beijing.")
    assert got == prefix + body + suffix


def test_a_template_that_refuses_a_system_turn_takes_the_judgment_in_the_user_turn():
    gemma = _template("google-gemma-2-2b-it.jinja")
    with pytest.raises(jinja2.TemplateError, match="System role not supported"):
        gemma.render(judgment_messages("task", "q", "d"), add_generation_prompt=True, bos_token="<bos>")
    got = gemma.render(judgment_messages("task", "q", "d", system=False), add_generation_prompt=True,
                       bos_token="<bos>")
    assert got.startswith("<bos><start_of_turn>user\nJudge whether the Document") and got.endswith(
        "<Document>: d<end_of_turn>\n<start_of_turn>model\n")
