"""Frontend.load, render_chat (text, ids, message endpoints) and its parity with transformers."""

from __future__ import annotations

import asyncio
import hashlib
import json

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flared.errors import ErrorKind, FrontendError
from flared.frontend import ChatTemplate, EndpointStrategy, Frontend, TokenSettings

CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Write a haiku about 🚀 and 東京."},
        {"role": "assistant", "content": "Rockets rise at dawn\n東京 lights fade below\n  silence in the stars"},
        {"role": "user", "content": "  Now in French, please.\n\n"},
    ],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "def f(x):\n    return x * 2"},
        {"role": "assistant", "content": "It doubles x."},
        {"role": "user", "content": "<|im_start|> is a special token"},
        {"role": "assistant", "content": "Yes."},
    ],
]


@pytest.fixture(scope="module")
def smollm2_files(tmp_path_factory, smollm2_assets):
    root = tmp_path_factory.mktemp("smollm2")
    tokenizer_path = root / "tokenizer.json"
    tokenizer_path.write_text(smollm2_assets.tokenizer_json, encoding="utf-8")
    template_path = root / "chat_template.jinja"
    template_path.write_text(smollm2_assets.chat_template, encoding="utf-8")
    return tokenizer_path, template_path


@pytest.fixture(scope="module")
def frontend(smollm2_files, smollm2_assets):
    tokenizer_path, template_path = smollm2_files
    return Frontend.load(
        tokenizer_path,
        template_path,
        tokenizer_sha256=hashlib.sha256(tokenizer_path.read_bytes()).hexdigest(),
        template_sha256=hashlib.sha256(template_path.read_bytes()).hexdigest(),
        settings=TokenSettings.from_gguf_assets(smollm2_assets),
    )


@pytest.mark.parametrize("chat_index", range(len(CHATS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_chat_matches_apply_chat_template(frontend, hf_smollm2_tokenizer, chat_index, add_generation_prompt):
    chat = CHATS[chat_index]
    rendered = frontend.render_chat(chat, add_generation_prompt=add_generation_prompt)
    expected_text = hf_smollm2_tokenizer.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=add_generation_prompt)
    expected_ids = hf_smollm2_tokenizer.apply_chat_template(
        chat, tokenize=True, return_dict=False, add_generation_prompt=add_generation_prompt)
    assert rendered.text == expected_text
    assert rendered.token_ids == list(expected_ids)
    # The template writes <|im_start|> itself; nothing adds a second BOS-like token in front.
    assert rendered.token_ids[:2] != [frontend.settings.bos_token_id] * 2


@pytest.mark.parametrize("chat_index", range(len(CHATS)))
def test_endpoints_are_message_ends(frontend, chat_index):
    chat = CHATS[chat_index]
    rendered = frontend.render_chat(chat, add_generation_prompt=True)
    ids = rendered.token_ids
    # SmolLM2's template closes every message with "<|im_end|>\n": one endpoint per message.
    assert len(rendered.message_endpoints) == len(chat)
    assert list(rendered.message_endpoints) == sorted(set(rendered.message_endpoints))
    assert all(0 < endpoint < len(ids) for endpoint in rendered.message_endpoints)
    for count, endpoint in enumerate(rendered.message_endpoints, start=1):
        prefix = frontend.render_chat(chat[:count], add_generation_prompt=False)
        assert ids[:endpoint] == prefix.token_ids
        assert frontend.decode(ids[:endpoint]).endswith("<|im_end|>\n")
    # Without a generation prompt the last message ends the prompt: not strictly inside.
    closed = frontend.render_chat(chat, add_generation_prompt=False)
    assert len(closed.message_endpoints) == len(chat) - 1


def test_marked_template_gives_the_same_endpoints(frontend, smollm2_assets):
    source = smollm2_assets.chat_template.replace("{% endfor %}", "{% mark %}{% endfor %}")
    marked = Frontend(frontend.tokenizer, ChatTemplate(source), frontend.settings)
    assert marked.chat_template.num_marks == 1
    for chat in CHATS:
        ours = marked.render_chat(chat)
        reference = frontend.render_chat(chat)
        assert ours.text == reference.text
        assert ours.message_endpoints == reference.message_endpoints


def test_prefix_render_strategy_agrees_on_smollm2(frontend):
    prefix = Frontend(frontend.tokenizer, frontend.chat_template, frontend.settings,
                      endpoint_strategy=EndpointStrategy.PREFIX_RENDERS)
    assert frontend.chat_template.has_auto_marks
    for chat in CHATS:
        for add_generation_prompt in (True, False):
            auto = frontend.render_chat(chat, add_generation_prompt=add_generation_prompt)
            assert prefix.render_chat(chat, add_generation_prompt=add_generation_prompt) == auto


def test_prefix_renders_keep_only_exact_prefixes(frontend):
    # The last message renders differently (no closing tag), so its end in a longer chat is no prefix.
    template = ChatTemplate(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if not loop.last %}</{{ m.role }}>{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    prefix = Frontend(frontend.tokenizer, template, frontend.settings,
                      endpoint_strategy=EndpointStrategy.PREFIX_RENDERS)
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    rendered = prefix.render_chat(chat)
    assert rendered.text == "<user>a</user><assistant>b</assistant><user>c<assistant>"
    # Each prefix render ends right after its last content ("<user>a", "...<assistant>b", the whole
    # chat without the generation prompt): exact prefixes, but mid-message for the first two.
    assert rendered.byte_endpoints == (7, 26, 45)
    auto = Frontend(frontend.tokenizer, template, frontend.settings).render_chat(chat)
    assert auto.byte_endpoints == (14, 38, 45)  # loop-iteration ends
    # A template that closes every shorter rendering with a trailer has no exact prefixes at all.
    trailer = ChatTemplate("{% for m in messages %}[{{ m.content }}]{% endfor %}"
                           "{% if not add_generation_prompt %}<end>{% endif %}")
    strict = Frontend(frontend.tokenizer, trailer, frontend.settings,
                      endpoint_strategy=EndpointStrategy.PREFIX_RENDERS)
    assert strict.render_chat(chat).byte_endpoints == ()
    assert Frontend(frontend.tokenizer, trailer, frontend.settings).render_chat(chat).byte_endpoints == (3, 6)


def test_endpoint_crossed_by_a_token_is_dropped(frontend):
    template = ChatTemplate("{% for m in messages %}{{ m.content }}{% mark %}{% endfor %}")
    marked = Frontend(frontend.tokenizer, template, frontend.settings)
    chat = [{"role": "user", "content": "hel"}, {"role": "user", "content": "lo world"}, {"role": "user", "content": "!"}]
    rendered = marked.render_chat(chat, add_generation_prompt=False)
    assert rendered.byte_endpoints == (3, 11)
    encoding = frontend.tokenizer.encode("hello world!", add_special_tokens=False)
    assert (0, 5) in encoding.offsets  # "hello" is one token: it crosses byte 3
    expected = tuple(i for i, (start, _) in enumerate(encoding.offsets) if start == 11)
    assert rendered.message_endpoints == expected


def test_non_ascii_endpoints_are_utf8_offsets(frontend):
    template = ChatTemplate("{% for m in messages %}{{ m.content }}\n{% mark %}{% endfor %}")
    marked = Frontend(frontend.tokenizer, template, frontend.settings)
    rendered = marked.render_chat([{"role": "user", "content": "東京"}, {"role": "user", "content": "ok"}],
                                  add_generation_prompt=False)
    assert rendered.byte_endpoints == (len("東京\n".encode()),)
    endpoint, = rendered.message_endpoints
    assert frontend.decode(rendered.token_ids[:endpoint]) == "東京\n"


@pytest.mark.parametrize("body", [
    "{% macro m() %}{% mark %}{% endmacro %}",
    "{% set x %}{% mark %}{% endset %}",
    "{% filter upper %}{% mark %}{% endfilter %}",
    "{% generation %}{% mark %}{% endgeneration %}",
    "{% for x in [1] recursive %}{% mark %}{% endfor %}",
])
def test_mark_in_buffered_output_is_a_compile_error(body, tmp_path, smollm2_files, smollm2_assets):
    with pytest.raises(jinja2.TemplateSyntaxError, match="mark"):
        ChatTemplate(body)
    template_path = tmp_path / "bad.jinja"
    template_path.write_text(body)
    with pytest.raises(FrontendError) as info:
        Frontend.load(smollm2_files[0], template_path, settings=TokenSettings.from_gguf_assets(smollm2_assets))
    assert info.value.kind is ErrorKind.TEMPLATE and "bad.jinja" in str(info.value)


def test_load_rejects_fingerprint_mismatch_and_unreadable_assets(tmp_path, smollm2_files, smollm2_assets):
    tokenizer_path, template_path = smollm2_files
    settings = TokenSettings.from_gguf_assets(smollm2_assets)
    with pytest.raises(FrontendError) as info:
        Frontend.load(tokenizer_path, template_path, tokenizer_sha256="0" * 64, settings=settings)
    assert info.value.kind is ErrorKind.FINGERPRINT and "tokenizer.json" in str(info.value)
    with pytest.raises(FrontendError) as info:
        Frontend.load(tokenizer_path, template_path, template_sha256="0" * 64, settings=settings)
    assert info.value.kind is ErrorKind.FINGERPRINT and "chat_template.jinja" in str(info.value)
    broken = tmp_path / "broken.json"
    broken.write_text('{"version": "1.0", "model": ')
    with pytest.raises(FrontendError) as info:
        Frontend.load(broken, template_path, settings=settings)
    assert info.value.kind is ErrorKind.TOKENIZER and "broken.json" in str(info.value)
    with pytest.raises(FrontendError) as info:
        Frontend.load(tmp_path / "absent.json", template_path, settings=settings)
    assert info.value.kind is ErrorKind.TOKENIZER and "absent.json" in str(info.value)
    uncompilable = tmp_path / "uncompilable.jinja"
    uncompilable.write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(FrontendError) as info:
        Frontend.load(tokenizer_path, uncompilable, settings=settings)
    assert info.value.kind is ErrorKind.TEMPLATE and "uncompilable.jinja" in str(info.value)
    wrong_ids = TokenSettings(bos_token="<|im_start|>", bos_token_id=7, eos_token="<|im_end|>", eos_token_id=2)
    with pytest.raises(FrontendError, match="bos_token"):
        Frontend.load(tokenizer_path, template_path, settings=wrong_ids)


TOOL_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}:{% if m.tool_calls %}"
    "{% for c in m.tool_calls %}{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}"
    "{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
)


def test_tool_call_arguments(frontend):
    tool_frontend = Frontend(frontend.tokenizer, ChatTemplate(TOOL_TEMPLATE), frontend.settings)

    def chat(arguments):
        return [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "get", "arguments": arguments}}]},
        ]

    as_string = tool_frontend.render_chat(chat('{"z": 1, "a": "東京", "m": [true, null]}'), add_generation_prompt=False)
    as_object = tool_frontend.render_chat(chat({"z": 1, "a": "東京", "m": [True, None]}), add_generation_prompt=False)
    assert as_string.text == as_object.text
    assert 'get{"z": 1, "a": "東京", "m": [true, null]}' in as_string.text  # insertion order kept
    for bad in ('{"unterminated": ', '[1, 2]', '"text"', 7):
        with pytest.raises(FrontendError) as info:
            tool_frontend.render_chat(chat(bad))
        assert info.value.kind.http_status == 400 and "messages[1]" in str(info.value)


def test_template_errors_are_400_with_the_templates_message(frontend):
    raising = Frontend(frontend.tokenizer, ChatTemplate("{{ raise_exception('roles must alternate') }}"),
                       frontend.settings)
    with pytest.raises(FrontendError) as info:
        raising.render_chat([{"role": "user", "content": "x"}])
    assert info.value.kind is ErrorKind.TEMPLATE and info.value.http_status == 400
    assert "roles must alternate" in str(info.value)


def test_token_settings_round_trip_and_validation(smollm2_assets):
    settings = TokenSettings.from_gguf_assets(smollm2_assets)
    assert TokenSettings.from_dict(json.loads(json.dumps(settings.to_dict()))) == settings
    with pytest.raises(FrontendError):
        TokenSettings.from_dict({**settings.to_dict(), "sep_token": "x"})
    with pytest.raises(FrontendError):
        TokenSettings(bos_token="<s>")  # a token without its id
    with pytest.raises(FrontendError):
        TokenSettings(add_bos_token=True)
    with pytest.raises(FrontendError):
        TokenSettings(bos_token="<s>", bos_token_id=-1)


def test_reserved_template_kwargs_are_rejected(frontend):
    with pytest.raises(FrontendError) as info:
        frontend.render_chat(CHATS[0], auto_marks=False)
    assert info.value.kind is ErrorKind.VALIDATION and "auto_marks" in str(info.value)


def test_template_defaults_fill_and_request_kwargs_win(frontend):
    template = ChatTemplate("{{ 'think' if enable_thinking else 'plain' }}|{{ messages[0].content }}")
    with_defaults = Frontend(frontend.tokenizer, template, frontend.settings,
                             template_defaults={"enable_thinking": True})
    chat = [{"role": "user", "content": "x"}]
    assert with_defaults.render_chat(chat).text == "think|x"
    assert with_defaults.render_chat(chat, enable_thinking=False).text == "plain|x"


def test_from_gguf_equals_load(frontend, smollm2_path):
    direct = Frontend.from_gguf(smollm2_path)
    for chat in CHATS:
        assert direct.render_chat(chat) == frontend.render_chat(chat)


def test_render_chat_async_runs_off_the_loop(frontend):
    async def main():
        return await frontend.render_chat_async(CHATS[1])

    assert asyncio.run(main()) == frontend.render_chat(CHATS[1])


def test_continue_final_message(frontend, hf_smollm2_tokenizer):
    chat = [{"role": "user", "content": "Count to 3"}, {"role": "assistant", "content": "1, 2,"}]
    rendered = frontend.render_chat(chat, add_generation_prompt=False, continue_final_message=True)
    expected = hf_smollm2_tokenizer.apply_chat_template(chat, tokenize=False, continue_final_message=True)
    assert rendered.text == expected and rendered.text.endswith("1, 2,")
    assert len(rendered.message_endpoints) == 1


_CONTENT = st.lists(st.sampled_from(list("ab \n\t東京😀<|>") + ["<|im_end|>", "  ", "\n\n"]), max_size=12).map("".join)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(contents=st.lists(_CONTENT, min_size=1, max_size=5), add_generation_prompt=st.booleans())
def test_endpoints_cut_the_prompt_at_exact_text_positions(frontend, contents, add_generation_prompt):
    """Every token endpoint splits the ids exactly at one of the byte endpoints; they are sorted and inside."""
    roles = ["user", "assistant"]
    chat = [{"role": roles[i % 2], "content": content} for i, content in enumerate(contents)]
    rendered = frontend.render_chat(chat, add_generation_prompt=add_generation_prompt)
    prompt = rendered.prompt_bytes
    ids = rendered.token_ids
    assert list(rendered.message_endpoints) == sorted(set(rendered.message_endpoints))
    assert all(0 < t < len(ids) for t in rendered.message_endpoints)
    assert all(0 < b < len(prompt) for b in rendered.byte_endpoints)
    for endpoint in rendered.message_endpoints:
        head = frontend.decode(ids[:endpoint]).encode("utf-8")
        tail = frontend.decode(ids[endpoint:]).encode("utf-8")
        assert head + tail == prompt
        assert len(head) in rendered.byte_endpoints


def test_auto_marks_include_the_preamble_before_the_message_loop(frontend):
    template = ChatTemplate(
        "{{ bos_token }}{% if messages[0].role == 'system' %}<sys>{{ messages[0].content }}</sys>\n"
        "{% set messages = messages[1:] %}{% endif %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert template.has_auto_marks
    auto = Frontend(frontend.tokenizer, template, frontend.settings)
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    rendered = auto.render_chat(chat)
    text = rendered.text
    assert text == "<|im_start|><sys>S</sys>\n<user>u</user>\n<assistant>a</assistant>\n<assistant>"
    # The system preamble ends before the loop; each message ends with its iteration.
    expected = tuple(text.index(end) + len(end) for end in ("</sys>\n", "</user>\n", "</assistant>\n"))
    assert rendered.byte_endpoints == expected
    assert len(rendered.message_endpoints) == 3


@pytest.mark.parametrize("source,parts", [
    ("{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}", True),
    ("{% for m in messages %}{% for p in m.content | selectattr('type', 'equalto', 'text') %}{{ p.text }}"
     "{% endfor %}{% endfor %}", True),
    ("{% for m in messages %}{% set c = m['content'] %}{% for p in c %}{{ p }}{% endfor %}{% endfor %}", True),
    ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}{% endfor %}", False),
    ("{% for m in messages %}{% if m.content is string %}{{ m.content }}{% endif %}{% endfor %}", False),
    ("{% for m in messages %}{% for t in m['tool_calls'] %}{{ t }}{% endfor %}{{ m['content'] }}{% endfor %}", False),
])
def test_templates_that_walk_content_parts_are_told_apart(source, parts):
    """ChatTemplate.reads_content_parts: a loop over a message's content (filtered, or through a name set from it)
    reads parts; a template that only prints or concatenates it reads a string (image parts then reach it as their
    placeholders, flared.server.app.parts_for_template)."""
    from flared.frontend.template import ChatTemplate

    assert ChatTemplate(source).reads_content_parts is parts


def test_parts_for_a_string_template_are_one_string_with_placeholders():
    from flared.server.app import parts_for_template

    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "image", "image": "x"}, {"type": "text", "text": "What?"},
                                             {"type": "image", "image": "y"}, {"type": "video", "video": "z"}]}]
    assert parts_for_template(messages, {"image": "<IMG>", "video": "<VID>"}) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "<IMG>\nWhat?\n<IMG>\n<VID>"}]
    assert parts_for_template(messages)[1]["content"] == [{"type": "image"}, {"type": "text", "text": "What?"},
                                                          {"type": "image"}, {"type": "video"}]


def test_media_placeholders_are_matched_by_kind_in_the_templates_order():
    """A template may write a turn's images before its videos (LLaVA-OneVision's): the k-th placeholder of a kind
    takes the k-th item of that kind, and the order the items landed in comes back."""
    from flared.errors import FrontendError
    from flared.frontend.frontend import _expand_images

    text = "A<image>B<video>C<image>D"
    out, ends, order = _expand_images(text, [2, 9, 25], ("[v1]", "[i1]", "[i2]"), ("<video>", "<image>", "<image>"))
    assert out == "A[i1]B[v1]C[i2]D" and order == (1, 0, 2)
    assert ends == [2, 6, 16]
    with pytest.raises(FrontendError, match="do not match"):
        _expand_images(text, [], ("[v1]", "[i1]"), ("<video>", "<image>"))
