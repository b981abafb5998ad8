"""Tool-call and reasoning parsers on adversarial chunkings: whole, split at every character
boundary, and one character at a time must all give the same content, reasoning and calls, and
no marker may ever reach the content."""

from __future__ import annotations

import json

import pytest

from pathlib import Path

from flared.frontend.reasoning import (
    APERTUS_INNER,
    GEMMA4_THOUGHT,
    MISTRAL_THINK,
    SEED_THINK,
    THINK,
    ReasoningParser,
    opens_reasoning,
    reasoning_format_for_template,
)
from flared.frontend.toolcalls import (
    PARSERS,
    OutputParser,
    merge_call_deltas,
    tool_parser_for_template,
)

WEATHER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}}}}}]

# family -> [(text, expected content, [(name, arguments object)])]
CASES = {
    "hermes": [
        ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
         '</tool_call>\n<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n</tool_call>',
         "Let me look.", [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Oslo"})]),
        ("No tools here, only a < and a <tool and </tool_call> text.",
         "No tools here, only a < and a <tool and </tool_call> text.", []),
        ('<tool_call>{"name": "f", "arguments": {"s": "a}\\"</tool_call>{"}}</tool_call>', "",
         [("f", {"s": "a}\"</tool_call>{"})]),
        ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
        ('<tool_call>{"name": "f"}</tool_call>', "", [("f", {})]),
    ],
    "qwen3_coder": [
        ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n<parameter=zip>\n75001\n</parameter>\n</function>\n</tool_call>",
         "Checking.", [("get_weather", {"city": "Paris", "days": 3, "zip": "75001"})]),
        ("<tool_call>\n<function=ping>\n</function>\n</tool_call>\nDone.", "Done.", [("ping", {})]),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_weather", '
         '"parameters": {"city": "Rome", "days": 2}}', "",
         [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome", "days": 2})]),
        ('<|python_tag|>{"name": "f", "parameters": {}}', "", [("f", {})]),
        ('{"answer": 42}', '{"answer": 42}', []),
        ("The weather is fine.", "The weather is fine.", []),
    ],
    "llama4_json": [  # (Llama 4's template: the calls between <|python_start|> and <|python_end|>)
        ('<|python_start|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}<|python_end|>', "",
         [("get_weather", {"city": "Paris", "days": 3})]),
        ('<|python_start|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"x": [1]}}<|python_end|>'
         " Done.", "Done.", [("f", {}), ("g", {"x": [1]})]),
        ("It is sunny.", "It is sunny.", []),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", days=3), get_weather(city="Oslo")]', "",
         [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Oslo"})]),
        ('<|python_start|>[ping(), weather.now(zip="75001", units=["c", "f"], exact=True)]<|python_end|>', "",
         [("ping", {}), ("weather.now", {"zip": "75001", "units": ["c", "f"], "exact": True})]),
        ('[f(s="a], b(")] Then text.', "Then text.", [("f", {"s": "a], b("})]),
        ("[1, 2, 3] is a list.", "[1, 2, 3] is a list.", []),
        ("[see(above) + 1]", "[see(above) + 1]", []),
        ("Plain words.", "Plain words.", []),
    ],
    "mistral": [
        ('Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
         '{"name": "f", "arguments": {"x": [1, {"y": "]"}]}}]', "Sure.",
         [("get_weather", {"city": "Paris"}), ("f", {"x": [1, {"y": "]"}]})]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [("get_weather", {"city": "Paris"})]),
        ("Plain [TOOL text.", "Plain [TOOL text.", []),
    ],
    "deepseek": [
        ("Let me see.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
         '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n'
         '{"x": "```"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Let me see.",
         [("get_weather", {"city": "Paris"}), ("f", {"x": "```"})]),
        ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo"}'
         "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "", [("get_weather", {"city": "Oslo"})]),
    ],
    "functionary": [
        ('Sure.<function=get_weather>{"city": "Paris"}</function><function=f>{"x": "</function>"}</function>',
         "Sure.", [("get_weather", {"city": "Paris"}), ("f", {"x": "</function>"})]),
        ("<function=ping>{}</function>\nDone.", "Done.", [("ping", {})]),
    ],
    "seed_oss": [
        ("Checking.\n<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n"
         "<parameter=days>3</parameter>\n</function>\n</seed:tool_call>", "Checking.",
         [("get_weather", {"city": "Paris", "days": 3})]),
        ("No <seed:tool call here.", "No <seed:tool call here.", []),
    ],
    "glm45": [
        ("Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
         "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>", "Let me check.",
         [("get_weather", {"city": "Paris", "days": 3})]),
        # GLM-4.7's: no newline after the name; a value with tags and quotes inside; two calls
        ('<tool_call>get_weather<arg_key>city</arg_key><arg_value>"a<b>c"</arg_value></tool_call>\n'
         "<tool_call>ping</tool_call>", "", [("get_weather", {"city": '"a<b>c"'}), ("ping", {})]),
        ("A <tool_call> that is not one: <tool_call>{bad}</tool_call>", "A <tool_call> that is not one: "
         "<tool_call>{bad}</tool_call>", []),
    ],
    "minimax_m2": [
        ('Checking both.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
         '<parameter name="days">3</parameter>\n</invoke>\n<invoke name="get_weather">\n<parameter name="city">Oslo'
         "</parameter>\n</invoke>\n</minimax:tool_call>", "Checking both.",
         [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Oslo"})]),
        ("No <minimax:tool call here.", "No <minimax:tool call here.", []),
    ],
    "lfm2": [
        ('Let me check.<|tool_call_start|>[get_weather(city="Paris", days=3), get_weather(city=\'Oslo\', '
         'zip=None)]<|tool_call_end|>Checking now.', "Let me check.Checking now.",
         [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Oslo", "zip": None})]),
        ('<|tool_call_start|>[search(query="a ] b <|tool_call_end", filters={"tags": ["x", true], "n": 1.5})]'
         '<|tool_call_end|>', "", [("search", {"query": "a ] b <|tool_call_end", "filters": {"tags": ["x", True],
                                                                                       "n": 1.5}})]),
        ("<|tool_call_start|>[ping()]<|tool_call_end|>", "", [("ping", {})]),
        # not a call list (a positional argument, an expression): the model's text, markers included
        ('<|tool_call_start|>[get_weather("Paris")]<|tool_call_end|>',
         '<|tool_call_start|>[get_weather("Paris")]<|tool_call_end|>', []),
        ("No <|tool_call here.", "No <|tool_call here.", []),
    ],
    "nemotron": [
        ('Let me check.\n<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
         '{"name": "get_weather", "arguments": {"city": "Oslo"}}]</TOOLCALL>', "Let me check.",
         [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Oslo"})]),
        # arguments as a JSON string (the template's own instructions show one); a "]" and the marker in a value
        ('<TOOLCALL>[{"name": "f", "arguments": "{\\"x\\": \\"]</TOOLCALL>\\"}"}]</TOOLCALL>\nDone.', "Done.",
         [("f", {"x": "]</TOOLCALL>"})]),
        ('<TOOLCALL>[{"name": "ping", "arguments": {}}]', "", [("ping", {})]),  # (stopped before the closing marker)
        ("A <TOOLCALL> that is not a list.", "A <TOOLCALL> that is not a list.", []),
        ("No <TOOL call here.", "No <TOOL call here.", []),
    ],
    "gemma4": [
        ('Checking.<|tool_call>call:get_weather{city:<|"|>Paris, {the} "city"<|"|>,days:3}<tool_call|>'
         '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>,zip:null,opts:{units:[<|"|>C<|"|>,true,-2.5]}}<tool_call|>'
         "<|tool_response>", "Checking.", [("get_weather", {"city": 'Paris, {the} "city"', "days": 3}),
                                            ("get_weather", {"city": "Oslo", "zip": None,
                                                             "opts": {"units": ["C", True, -2.5]}})]),
        ("<|tool_call>call:ping{}<tool_call|>", "", [("ping", {})]),
        ('<|tool_call>call:f{s:<|"|>a <tool_call|> inside<|"|>}<tool_call|>\nDone.', "Done.",
         [("f", {"s": "a <tool_call|> inside"})]),
        ("A <|tool_call> that is not a call.", "A <|tool_call> that is not a call.", []),
        ("No <|tool call here.", "No <|tool call here.", []),
    ],
    "apertus": [
        ('Checking.<|tools_prefix|>[{"get_weather": {"city": "Paris", "days": 3}}, {"get_weather": {"city": "Oslo"}}]'
         "<|tools_suffix|>", "Checking.", [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Oslo"})]),
        ('<|tools_prefix|>[{"f": {"s": "]<|tools_suffix|>"}}]<|tools_suffix|>\nDone.', "Done.",
         [("f", {"s": "]<|tools_suffix|>"})]),
        ('<|tools_prefix|>[{"ping": {}}]', "", [("ping", {})]),  # (stopped before the closing marker)
        ("A <|tools_prefix|> that is not a list.", "A <|tools_prefix|> that is not a list.", []),
        ("No <|tools call here.", "No <|tools call here.", []),
    ],
    "firefunction": [
        (' functools[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, {"name": "get_weather", '
         '"arguments": {"city": "Oslo"}}]', "", [("get_weather", {"city": "Paris", "days": 3}),
                                                 ("get_weather", {"city": "Oslo"})]),
        ('Sure. functools[{"name": "ping", "arguments": {}}]', "Sure.", [("ping", {})]),
        ("No functools here.", "No functools here.", []),
    ],
    "cohere": [
        ('<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris", '
         '"days": 3}},\n    {"tool_call_id": "1", "tool_name": "get_weather", "parameters": {"city": "Oslo"}}\n]'
         "<|END_ACTION|>", "", [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Oslo"})]),
        ("<|START_RESPONSE|>It is sunny in Paris.<|END_RESPONSE|>", "It is sunny in Paris.", []),
    ],
    "harmony": [  # (the analysis channel's reasoning: test_harmony_every_split)
        ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
         'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}<|call|>', "",
         [("get_weather", {"city": "Paris", "days": 3})]),
        ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>",
         "It is 4.", []),
        ('<|channel|>commentary<|message|>Checking both.<|end|><|start|>assistant<|channel|>commentary '
         'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|end|><|start|>assistant to='
         'functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome"}<|call|>', "Checking both.",
         [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]),
        ("A plain answer, <|channel|> and all.", "A plain answer, <|channel|> and all.", []),
    ],
}

MARKERS = ("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "[TOOL_CALLS]", "[ARGS]",
           "<|python_tag|>", "tool▁call", "<think>", "</think>", "[THINK]", "[/THINK]", "<|channel|>", "<|message|>",
           "<|end|>", "<|start|>", "<|call|>", "<|constrain|>", "<seed:tool_call>", "</seed:tool_call>", "<seed:think>",
           "</seed:think>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
           "<|START_ACTION|>", "<|END_ACTION|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_THINKING|>",
           "<|END_THINKING|>", "<minimax:tool_call>", "</minimax:tool_call>", "<invoke name=", "</invoke>", "<TOOLCALL>",
           "</TOOLCALL>", "<|tool_call>", "<tool_call|>", "<|tool_response>", '<|"|>', "<|channel>", "<channel|>",
           "<|tools_prefix|>", "<|tools_suffix|>", "<|inner_prefix|>", "<|inner_suffix|>", "functools[",
           "<|python_start|>", "<|python_end|>")


def chunkings(text: str):
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)


def run(make, chunks):
    parser = make()
    content, reasoning, deltas = [], [], []
    for chunk in chunks:
        d = parser.push(chunk)
        content.append(d.content)
        reasoning.append(d.reasoning)
        deltas.extend(d.calls)
    d = parser.finish()
    content.append(d.content)
    reasoning.append(d.reasoning)
    deltas.extend(d.calls)
    return content, "".join(reasoning), deltas, parser


def check_calls(deltas, parser_calls, expected):
    merged = merge_call_deltas(deltas)
    assert [(c.name, json.loads(c.arguments)) for c in merged] == expected
    # what a streaming client assembled equals what the parser reports at the end
    assert [(c.id, c.name, c.arguments) for c in merged] == [(c.id, c.name, c.arguments) for c in parser_calls]
    first = {}
    for d in deltas:
        if d.index not in first:
            first[d.index] = d
            assert d.id and d.name, "a call's first delta carries its id and name"
        else:
            assert d.id is None and d.name is None


@pytest.mark.parametrize("family,case", [(f, i) for f, cases in CASES.items() for i in range(len(cases))])
def test_tool_parser_every_split(family, case):
    text, want_content, want_calls = CASES[family][case]
    cls = PARSERS[family]
    for chunks in chunkings(text):
        content, _, deltas, parser = run(lambda: OutputParser(cls(WEATHER_TOOLS)), chunks)
        joined = "".join(content)
        assert joined == want_content, chunks
        if want_calls:
            for piece in content:
                assert not any(m in piece for m in MARKERS), (piece, chunks)
        check_calls(deltas, parser.calls, want_calls)


def test_arguments_stream_as_several_deltas():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>'
    _, _, deltas, _ = run(lambda: OutputParser(PARSERS["hermes"]()), list(text))
    arg_pieces = [d.arguments for d in deltas if d.arguments]
    assert len(arg_pieces) > 5 and "".join(arg_pieces) == '{"city": "Paris", "days": 3}'


REASONING_CASES = [
    # (text, starts_inside, reasoning, content)
    ("<think>\nStep one.\nStep two.\n</think>\n\nThe answer is 4.", False, "Step one.\nStep two.\n",
     "The answer is 4."),
    ("  <think>a<b</think>c", False, "a<b", "c"),
    ("No reasoning <think> here.", False, "", "No reasoning <think> here."),
    ("Thinking inside.</think>Answer.", True, "Thinking inside.", "Answer."),
    ("<think>Repeated opener.</think>Answer.", True, "Repeated opener.", "Answer."),
    ("<think>cut off by max_tokens", False, "cut off by max_tokens", ""),
    ("<thin", False, "", "<thin"),
    (" la la", False, "", " la la"),
    ("  ", False, "", "  "),
]


def _mistral(text: str) -> str:
    return text.replace("<think>", "[THINK]").replace("</think>", "[/THINK]")


def _seed(text: str) -> str:
    return text.replace("<think>", "<seed:think>").replace("</think>", "</seed:think>")


REASONING_CASES += [(_mistral(t), inside, r, _mistral(c), MISTRAL_THINK) for t, inside, r, c in REASONING_CASES[:3]]
REASONING_CASES += [(_seed(t), inside, r, _seed(c), SEED_THINK) for t, inside, r, c in REASONING_CASES[:3]]
REASONING_CASES += [  # Apertus' inner thoughts
    ("<|inner_prefix|>Step one.<|inner_suffix|>The answer is 4.", False, "Step one.", "The answer is 4.", APERTUS_INNER),
]
REASONING_CASES += [  # Gemma 4's thought channel
    ("<|channel>thought\nStep one.<channel|>The answer is 4.", False, "Step one.", "The answer is 4.", GEMMA4_THOUGHT),
    ("The answer is 4.", False, "", "The answer is 4.", GEMMA4_THOUGHT),
]


@pytest.mark.parametrize("case", range(len(REASONING_CASES)))
def test_reasoning_every_split(case):
    text, inside, want_reasoning, want_content, *fmt = REASONING_CASES[case]
    for chunks in chunkings(text):
        parser = ReasoningParser(fmt[0] if fmt else THINK, starts_inside=inside)
        r, c = [], []
        for chunk in chunks:
            a, b = parser.push(chunk)
            r.append(a)
            c.append(b)
        a, b = parser.finish()
        assert ("".join(r) + a, "".join(c) + b) == (want_reasoning, want_content), chunks
        assert not any(m in x for x in c + r for m in ("</think>", "[/THINK]", "</seed:think>", "<channel|>"))


def test_reasoning_then_tool_call_every_split():
    text = ('<think>I should call it.</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>')
    for chunks in chunkings(text):
        content, reasoning, deltas, parser = run(
            lambda: OutputParser(PARSERS["hermes"](), THINK), chunks)
        assert "".join(content) == "" and reasoning == "I should call it."
        check_calls(deltas, parser.calls, [("get_weather", {"city": "Paris"})])


def test_gemma4_thought_then_call_every_split():
    """Gemma 4's thought channel, then a call in its own syntax and the turn's end: reasoning apart, the call typed as
    JSON, no marker in the content."""
    text = ('<|channel>thought\nI will look it up.<channel|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>,'
            "days:2}<tool_call|><|tool_response>")
    for chunks in chunkings(text):
        content, reasoning, deltas, parser = run(lambda: OutputParser(PARSERS["gemma4"](WEATHER_TOOLS),
                                                                      GEMMA4_THOUGHT), chunks)
        assert "".join(content) == "" and reasoning == "I will look it up.", chunks
        check_calls(deltas, parser.calls, [("get_weather", {"city": "Paris", "days": 2})])


def test_apertus_inner_thoughts_then_calls_every_split():
    """Apertus' inner thoughts, then its tool list: reasoning apart, the calls, no marker in the content."""
    text = ('<|inner_prefix|>I will look it up.<|inner_suffix|><|tools_prefix|>[{"get_weather": {"city": "Paris"}}]'
            "<|tools_suffix|>")
    for chunks in chunkings(text):
        content, reasoning, deltas, parser = run(lambda: OutputParser(PARSERS["apertus"](WEATHER_TOOLS),
                                                                      APERTUS_INNER), chunks)
        assert "".join(content) == "" and reasoning == "I will look it up.", chunks
        check_calls(deltas, parser.calls, [("get_weather", {"city": "Paris"})])


def test_cohere_thinking_then_action_every_split():
    """Command A's reasoning block, then its action list: reasoning apart, the call, no marker in the content."""
    from flared.frontend.reasoning import COHERE_THINK

    text = ('<|START_THINKING|>I will look it up.<|END_THINKING|><|START_ACTION|>[{"tool_call_id": "0", '
            '"tool_name": "get_weather", "parameters": {"city": "Paris"}}]<|END_ACTION|>')
    for chunks in chunkings(text):
        content, reasoning, deltas, parser = run(lambda: OutputParser(PARSERS["cohere"](WEATHER_TOOLS), COHERE_THINK),
                                                 chunks)
        assert ("".join(content), reasoning) == ("", "I will look it up."), chunks
        check_calls(deltas, parser.calls, [("get_weather", {"city": "Paris"})])


HARMONY_CASES = [
    # (text, tools, reasoning, content, calls)
    ("<|channel|>analysis<|message|>Two and two.<|end|><|start|>assistant<|channel|>final<|message|>Four.", None,
     "Two and two.", "Four.", []),
    ('<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather '
     '<|constrain|>json<|message|>{"city": "Paris"}', WEATHER_TOOLS, "Call it.", "",
     [("get_weather", {"city": "Paris"})]),
    # no tools in the request: a message to a function is the model's text, not a call
    ('<|channel|>commentary to=functions.get_weather<|message|>{"city": "Paris"}<|call|>', None, "",
     '{"city": "Paris"}', []),
    ("<|channel|>analysis<|message|>cut off by max_tokens", None, "cut off by max_tokens", "", []),
    ("<|channel|>analys", None, "", "", []),  # (an unfinished header is no message)
]


@pytest.mark.parametrize("case", range(len(HARMONY_CASES)))
def test_harmony_every_split(case):
    """gpt-oss' channels: the analysis channel is reasoning, final the answer, a message to functions.NAME a call; the
    harmony reasoning format hands the whole text to the harmony parser, with tools or without."""
    from flared.frontend.reasoning import HARMONY

    text, tools, want_reasoning, want_content, want_calls = HARMONY_CASES[case]
    tool_parser = PARSERS["harmony"] if tools else None
    for chunks in chunkings(text):
        content, reasoning, deltas, parser = run(
            lambda: OutputParser(tool_parser(tools) if tool_parser else None, HARMONY), chunks)
        assert ("".join(content), reasoning) == (want_content, want_reasoning), chunks
        assert not any(m in piece for piece in content for m in MARKERS), chunks
        check_calls(deltas, parser.calls, want_calls)


def test_selection_from_templates():
    assert tool_parser_for_template("{{ '<tool_call>' }}").name == "hermes"
    assert tool_parser_for_template("<tool_call><function={{ n }}>").name == "qwen3_coder"
    assert tool_parser_for_template("[TOOL_CALLS]").name == "mistral"
    assert tool_parser_for_template("<｜tool▁calls▁begin｜>").name == "deepseek"
    assert tool_parser_for_template("<|python_tag|>").name == "llama3_json"
    assert tool_parser_for_template("{{ messages }}") is None
    assert tool_parser_for_template("<tool_call>", "none") is None
    assert tool_parser_for_template("", "mistral").name == "mistral"
    harmony = "<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|><think></think>"
    assert tool_parser_for_template(harmony).name == "harmony"
    glm = "<tool_call>{{ tc.name }}\n{% for k, v in args %}<arg_key>{{ k }}</arg_key><arg_value>{{ v }}</arg_value>"
    assert tool_parser_for_template(glm).name == "glm45"
    command_a = "<|START_THINKING|>{{ t }}<|END_THINKING|><|START_ACTION|>{{ calls }}<|END_ACTION|>"
    assert tool_parser_for_template(command_a).name == "cohere"
    lfm2 = "List of tools: <|tool_list_start|>{{ tools | tojson }}<|tool_list_end|> ... <|tool_call_start|>"
    assert tool_parser_for_template(lfm2).name == "lfm2"
    assert tool_parser_for_template("<AVAILABLE_TOOLS>{{ tools }}</AVAILABLE_TOOLS> <TOOLCALL>[").name == "nemotron"
    llama4 = ("<|header_start|>system<|header_end|>\n\nRespond in the format {\"name\": function name, \"parameters\": "
              "dictionary of argument name and its value}. {{- '<|python_start|>' }}")
    assert tool_parser_for_template(llama4).name == "llama3_json"
    pythonic = "respond with [func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]"
    assert tool_parser_for_template(pythonic).name == "pythonic"
    assert tool_parser_for_template("", "llama4_pythonic").name == "pythonic"
    assert reasoning_format_for_template(command_a).name == "cohere"
    assert reasoning_format_for_template(harmony).name == "harmony"  # (before <think>: harmony's channels win)
    assert reasoning_format_for_template("<think>{{ x }}</think>") is THINK
    assert reasoning_format_for_template("<think></think>", "none") is None
    assert opens_reasoning("<|im_start|>assistant\n<think>\n", THINK)
    assert not opens_reasoning("<|im_start|>assistant\n", THINK)


# The shared template corpus (beside the repository): the family each real template gets.
TEMPLATES = Path(__file__).resolve().parents[3] / "shared" / "templates"
CORPUS_FAMILIES = {
    "Qwen-Qwen2.5-7B-Instruct.jinja": ("hermes", None),
    "Qwen-QwQ-32B.jinja": ("hermes", "think"),
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja": ("hermes", None),
    "ibm-granite-granite-4.0.jinja": ("hermes", None),
    "trl-qwen3_training.jinja": ("hermes", "think"),
    "Qwen3-Coder.jinja": ("qwen3_coder", None),
    "trl-qwen3_5_think.jinja": ("qwen3_coder", "think"),
    "meta-llama-Llama-3.2-3B-Instruct.jinja": ("llama3_json", None),
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": ("mistral", None),
    "unsloth-mistral-Devstral-Small-2507.jinja": ("mistral", None),
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja": ("mistral", "mistral"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": ("deepseek", "think"),
    "trl-deepseekv3.jinja": ("deepseek", "think"),
    "meetkai-functionary-medium-v3.1.jinja": ("functionary", None),
    "HuggingFaceTB-SmolLM3-3B.jinja": (None, "think"),
    "google-gemma-2-2b-it.jinja": (None, None),
    "microsoft-Phi-3.5-mini-instruct.jinja": (None, None),
    "ByteDance-Seed-OSS.jinja": ("seed_oss", "seed"),
    "MiniMax-M2.jinja": ("minimax_m2", "think"),
    "NVIDIA-Nemotron-Nano-v2.jinja": ("nemotron", "think"),
    "google-gemma-4-31B-it.jinja": ("gemma4", "gemma4"),
    "Apertus-8B-Instruct.jinja": ("apertus", "apertus"),
    "fireworks-ai-llama-3-firefunction-v2.jinja": ("firefunction", None),
}


def test_selection_on_the_template_corpus():
    if not TEMPLATES.is_dir():
        pytest.skip(f"template corpus not found at {TEMPLATES}")
    for name, (tools, reasoning) in CORPUS_FAMILIES.items():
        source = (TEMPLATES / name).read_text()
        t = tool_parser_for_template(source)
        r = reasoning_format_for_template(source)
        assert (t.name if t else None, r.name if r else None) == (tools, reasoning), name


@pytest.mark.parametrize("text", ['{"a": "}\\"{", "b": [1, {"c": "]"}]}', '["x\\\\", {}]', '"str\\"ing"', '{}'])
def test_value_scanner_grows_one_character_at_a_time(text):
    from flared.frontend.toolcalls import ValueScanner, value_end

    tail = text + ' , "more"}'
    scanner = ValueScanner(0)
    for n in range(1, len(tail) + 1):
        end = scanner.scan(tail[:n])
        assert end == (len(text) if n >= len(text) else None), n
    assert value_end(tail, 0) == len(text)


def test_long_arguments_stay_linear():
    """A 200 KB argument streamed in 4-character pieces: the parser must not re-scan it per piece."""
    import time

    body = json.dumps({"path": "a.py", "content": "x = {'k': [1, 2]}\n" * 11000})
    text = '<tool_call>{"name": "write", "arguments": ' + body + "}</tool_call>"
    parser = OutputParser(PARSERS["hermes"]())
    t0 = time.perf_counter()
    pieces = [parser.push(text[i:i + 4]) for i in range(0, len(text), 4)]
    pieces.append(parser.finish())
    elapsed_s = time.perf_counter() - t0
    args = "".join(c.arguments for p in pieces for c in p.calls)
    assert args == body and parser.calls[0].arguments == body
    assert elapsed_s < 5.0, f"{elapsed_s:.1f} s for {len(text)} characters"  # quadratic takes minutes


ALL_CASES = [(f, i) for f, cases in CASES.items() for i in range(len(cases))]


def test_random_multi_way_splits():
    """Arbitrary cut sets (not only one cut): the same content and calls (hypothesis, derandomized)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(ALL_CASES), st.lists(st.integers(0, 400), max_size=12))
    def check(case, cuts):
        family, index = case
        text, want_content, want_calls = CASES[family][index]
        points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
        chunks = [text[a:b] for a, b in zip(points, points[1:])]
        content, _, deltas, parser = run(lambda: OutputParser(PARSERS[family](WEATHER_TOOLS)), chunks)
        assert "".join(content) == want_content
        check_calls(deltas, parser.calls, want_calls)

    check()


def test_calls_are_marked_complete_as_they_close():
    parser = OutputParser(PARSERS["hermes"]())
    parser.push('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"name": "b", ')
    assert parser.num_closed_calls == 1 and [c.name for c in parser.calls] == ["a", "b"]
    parser.push('"arguments": {}}</tool_call>')
    assert parser.num_closed_calls == 2
