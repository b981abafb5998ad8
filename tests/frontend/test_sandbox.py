"""ChatSandbox's shortcuts reach the stock immutable sandbox's verdicts: same output, same errors."""

from __future__ import annotations

import jinja2
import pytest

from flared.frontend.jinja_env import make_environment

MESSAGES = [{"role": "user", "content": "  Hi  ", "items": "shadowed", "meta": {"k": [1, 2]}},
            {"role": "assistant", "content": "ok"}]

EXPRESSIONS = [
    "{% for m in messages %}{{ m.role }}|{{ m.content.strip() }}|{{ loop.index }}{{ loop.last }}{% endfor %}",
    "{{ messages[0].items }}",  # a dict method name: the method, not the key
    "{{ messages[0]['items'] }}",
    "{{ messages[0].missing is defined }}",
    "{{ messages[0].meta.k.index(2) }}|{{ messages[0].meta.k.count(1) }}",
    "{{ messages[0].get('role') }}|{{ messages[0].keys() | list }}",
    "{{ 'a{}b'.format(1) }}",
    "{{ ''.__class__ }}",
    "{{ messages[0].__class__ }}",
    "{{ messages.append(3) }}",
    "{{ messages[0].update({'x': 1}) }}",
    "{{ messages[0].pop('role') }}",
    "{{ messages.__len__() }}",
    "{% for m in messages %}{{ loop.__class__ }}{% endfor %}",
    "{% for m in messages %}{{ loop.cycle('a', 'b') }}{{ loop.previtem is defined }}{% endfor %}",
    "{{ messages[0].content.__add__ }}",
    "{{ 'x'.mro }}",
    "{{ namespace(_private=1) }}",
    "{% for m in messages %}{{ m.content.strip().upper().split('I') }}{{ m.get('x', 'd') }}{% endfor %}",
    "{{ messages[0].meta.k.index(7) }}",
    "{{ (messages[0].meta.k.copy()).append(1) }}",
    "{{ 'a b'.split(maxsplit=1) }}|{{ 'x'.startswith(('x', 'y')) }}",
    "{% set ns = namespace(a=1, f='{0}'.format) %}{% set ns.b = 2 %}{{ ns.a }}{{ ns.b }}{{ ns.c is defined }}"
    "{{ ns.f('x') }}",
    "{% set ns = namespace(a=1) %}{{ ns._Namespace__attrs }}",
    "{% set ns = namespace(a=1) %}{{ ns.__class__ }}",
    "{% set ns = namespace(f='{0.__class__}'.format) %}{{ ns.f('x') }}",
]


def _outcome(env, source):
    try:
        return ("ok", env.from_string(source).render(messages=MESSAGES))
    except Exception as exc:  # noqa: BLE001 - comparing whatever each raises
        return ("raised", type(exc).__name__)


@pytest.mark.parametrize("source", EXPRESSIONS)
def test_same_verdict_as_the_stock_sandbox(source):
    ours = _outcome(make_environment(), source)
    stock = _outcome(make_environment(stock_sandbox=True), source)
    assert ours == stock


def test_unsafe_access_still_raises():
    env = make_environment()
    with pytest.raises(jinja2.exceptions.SecurityError):
        env.from_string("{{ messages.append(3) }}").render(messages=[])
    with pytest.raises(jinja2.exceptions.SecurityError):
        env.from_string("{{ ''.__class__.__mro__ }}").render()
