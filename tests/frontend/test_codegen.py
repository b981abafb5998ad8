"""ChatCodeGenerator's piecewise output renders exactly what jinja2's own code generator renders.

Same text, same exception type and message, same order of calls, for operands of every kind a
template can produce (exact str, str subclasses with their own ``__add__``/``__radd__``/``__str__``,
Markup, numbers, None, containers, Undefined), in streamed and buffered output.
"""

from __future__ import annotations

import itertools

import jinja2
import pytest
from jinja2.compiler import CodeGenerator
from markupsafe import Markup

from flared.frontend.codegen import ChatCodeGenerator
from flared.frontend.jinja_env import ChatSandbox, make_environment


class _StockCodegenSandbox(ChatSandbox):
    code_generator_class = CodeGenerator


class _Loud(str):
    """A str subclass whose operators differ from concatenation."""

    def __add__(self, other):
        return _Loud(f"<{str.__str__(self)}+{other}>")

    def __radd__(self, other):
        return _Loud(f"<{other}+{str.__str__(self)}>")

    def __str__(self):
        return f"loud:{str.__str__(self)}"


class _Opaque:
    def __str__(self):
        return "opaque"

    def __radd__(self, other):
        return f"{other}&opaque"


class _StrMakesLoud:
    def __str__(self):
        return _Loud("made")


VALUES = {
    "str": "plain",
    "empty": "",
    "big": "x" * 5000 + "🚀",
    "loud": _Loud("loud"),
    "markup": Markup("<b>"),
    "int": 7,
    "none": None,
    "list": [1, 2],
    "opaque": _Opaque(),
    "makes_loud": _StrMakesLoud(),
}

TEMPLATES = [
    "{{ 'a' + x + 'b' + y }}",
    "{{ x + y }}",
    "{{ x + 'c' + 'd' }}",
    "{{ 'a' + (x + y) + 'b' }}",
    "{{ 'n' + missing_name + x }}",
    "{{ x ~ y ~ 'c' }}",
    "{{ 'p' ~ x + y ~ 'q' }}",
    "{{ (x + y) | trim }}",
    "{{ x }}{{ 'a' + x + y }}{{ y }}",
    "{% macro m(u, v) %}[{{ '(' + u + ')' + v }}]{% endmacro %}{{ m(x, y) }}",
    "{% set s %}{{ '<' + x + '>' ~ y }}{% endset %}{{ s + '|' + s }}",
    "{% for i in [1, 2] %}{{ 'i' + x + y }}{% endfor %}",
    "{{ f('a', x) + f('b', y) + f('c', x) }}",
    "{{ f('a', x) ~ f('b', y) }}",
    "{{ x ~ big }}{{ 'a' + x + big + y }}",
    "{% filter upper %}{{ 'a' + x + big }}{% endfilter %}",
    "{% macro m() %}{{ caller() }}{% endmacro %}{% call m() %}{{ x + big ~ y }}{% endcall %}",
    "{% for i in [[x], [y]] recursive %}{{ 'r' + i[0] + big }}{% endfor %}",
    "{% autoescape true %}{{ '<' + x + big }}{{ x ~ '>' }}{% endautoescape %}",
    "{% generation %}{{ 'g' + x + big }}{% endgeneration %}",
]


def _outcome(env, source, variables, calls):
    calls.clear()
    try:
        result = env.from_string(source).render(variables)
    except Exception as exc:  # noqa: BLE001 - the exception is what is compared
        result = (type(exc), str(exc))
    return result, list(calls)


@pytest.mark.parametrize("source", TEMPLATES)
def test_same_text_errors_and_call_order(source):
    ours = make_environment()
    stock = make_environment()
    stock.code_generator_class = CodeGenerator
    assert ours.code_generator_class is ChatCodeGenerator
    calls = []

    def f(label, value):
        calls.append(label)
        return value

    for (name_x, x), (name_y, y) in itertools.product(VALUES.items(), repeat=2):
        variables = {"x": x, "y": y, "f": f, "big": VALUES["big"]}
        expected = _outcome(stock, source, variables, calls)
        assert _outcome(ours, source, variables, calls) == expected, (source, name_x, name_y)


def test_large_operands_are_output_without_copies():
    """The message object itself is a chunk of the render: no concatenation copied it."""
    template = make_environment().from_string("{{ '<s>' + role + '\\n' + content + '</s>' + '\\n' }}")
    content = "y" * 100_000
    chunks = list(template.root_render_func(template.new_context({"role": "user", "content": content})))
    assert any(chunk is content for chunk in chunks)
    assert "".join(chunks) == f"<s>user\n{content}</s>\n"


def test_undefined_operand_raises_like_jinja2():
    template = make_environment().from_string("{{ 'a' + nothing + 'b' }}")
    with pytest.raises(jinja2.UndefinedError):
        template.render()


@pytest.mark.parametrize("source", [
    "{% macro m(a, b='d') %}{{ a }}-{{ b }}{% endmacro %}{{ m('x') }}|{{ m('x', b='y') }}|{{ m(a='z') }}",
    "{% macro m(a) %}{{ a }}{% endmacro %}{{ m('x', 'extra') }}",
    "{% macro m(a) %}{{ a }}{% endmacro %}{{ m('x', nope=1) }}",
    "{% macro m() %}{{ varargs }}{{ kwargs }}{% endmacro %}{{ m(1, 2, k=3) }}",
    "{% macro m() %}<{{ caller() }}>{% endmacro %}{% call m() %}inner{% endcall %}",
    "{% for i in [1] %}{% macro m(a) %}{{ a }}{{ i }}{% endmacro %}{{ m(i) }}{% endfor %}",
    "{% set ns = namespace(a=1) %}{% set ns.a = ns.a + 1 %}{{ ns.a }}{{ namespace(b=2).b }}",
    "{{ dict(a=1) }}{{ raise_exception('boom') }}",
])
def test_direct_calls_match_the_stock_sandbox(source):
    """ChatSandbox.call's shortcuts (macros, our globals) give the stock sandbox's results and errors."""
    ours = make_environment()
    stock = make_environment(stock_sandbox=True)
    assert _outcome(ours, source, {}, []) == _outcome(stock, source, {}, [])


def test_mark_offsets_match_a_walk_over_the_chunks(goldens, templates_dir):
    """_run's C-level offsets (accumulate + compress on identity) equal a plain walk over the chunks,
    for every corpus template and case, with empty and sentinel-lookalike contents mixed in."""
    from flared.frontend.jinja_env import MARK_SENTINEL
    from flared.frontend.template import ChatTemplate, _compile_auto_marked, _new_context

    extra_case = {"messages": [{"role": "system", "content": ""}, {"role": "user", "content": ""},
                               {"role": "assistant", "content": str(MARK_SENTINEL)},
                               {"role": "user", "content": "x"}], "add_generation_prompt": True}
    num_checked = 0
    for name in sorted(goldens["templates"]):
        template = ChatTemplate((templates_dir / name).read_bytes().decode("utf-8"))
        marked = _compile_auto_marked(template.sha256, template.source)
        for case in [*goldens["cases"].values(), extra_case]:
            kwargs = dict(tools=case.get("tools"), documents=case.get("documents"),
                          add_generation_prompt=case["add_generation_prompt"], bos_token="<s>", eos_token="</s>",
                          **case.get("template_kwargs", {}))
            try:
                rendered = template.render_traced(case["messages"], auto_marks=True, **kwargs)
            except Exception:  # noqa: BLE001 - cases a template refuses
                continue
            parent, _ = template._variables(case["messages"], kwargs.pop("tools"), kwargs.pop("documents"),
                                            kwargs.pop("add_generation_prompt"), False, kwargs.pop("bos_token"),
                                            kwargs.pop("eos_token"), False, kwargs, marked.flared_flat_globals)
            if template.has_generation_blocks:
                continue  # rendered by _run_traced, which walks the chunks itself
            position, expected = 0, []
            for chunk in marked.root_render_func(_new_context(marked, parent)):
                if chunk is MARK_SENTINEL:
                    expected.append(position)
                else:
                    position += len(chunk)
            assert rendered.mark_offsets == tuple(expected), (name, case["messages"][:1])
            assert expected, name  # every corpus template is auto-marked
            num_checked += 1
    assert num_checked > 300


@pytest.mark.parametrize("source", [
    "{% for m in messages %}{{ m.role }}|{{ m['role'] }}|{{ m.items }}|{{ m.get('role') }}|{{ loop.last }}{% endfor %}",
    "{{ m.role }}|{{ m['role'] }}|{{ m.nope }}|{{ m['nope'] }}|{{ m.keys }}",
    "{% set loop = {'last': 'shadow'} %}{{ loop.last }}{{ loop['last'] }}",
    "{{ m.role.upper() }}{{ m['role'][0] }}{{ m.__class__ }}{{ m._private }}",
])
@pytest.mark.parametrize("m", [{"role": "user", "_private": 1, "items": "item"}, {}, ["role"], "role", None, 3,
                               type("Obj", (), {"role": "attr"})()])
def test_inline_lookups_match_the_stock_code(source, m):
    """visit_Getattr/visit_Getitem's inline dict and loop lookups give the environment's answers."""
    ours = make_environment()
    stock = _StockCodegenSandbox(trim_blocks=True, lstrip_blocks=True)
    variables = {"m": m, "messages": [m, {"role": "x"}]}
    assert _outcome(ours, source, variables, []) == _outcome(stock, source, variables, [])


@pytest.mark.parametrize("source", [
    "{% set ns = namespace(a=1, s='x', f='{}'.format, l=[1]) %}{{ ns.a }}{{ ns.s }}{{ ns.l }}{{ ns.missing }}"
    "{{ ns.f('y') }}{{ ns.missing is defined }}",
    "{% set ns = namespace(a='{0.__class__}') %}{{ ns.a.format(ns) }}",
    "{% set ns = namespace() %}{% set ns.f = 'a{0}'.format %}{{ ns.f(1) }}",
])
def test_namespace_attributes_match_the_stock_sandbox(source):
    assert _outcome(make_environment(), source, {}, []) == _outcome(make_environment(stock_sandbox=True), source, {}, [])
