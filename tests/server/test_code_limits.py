"""llama.cpp's stops for code completion (/completion and /infill's n_indent and t_max_predict_ms), on the text
as it streams in pieces."""

from __future__ import annotations

import pytest

from flared.server.llamacpp_routes import _CodeLimits


def _run(limits, pieces, step_ms=0):
    kept, t = [], 1_000_000
    for piece in pieces:
        text, ended = limits.feed(piece, t)
        kept.append(text)
        t += step_ms * 1_000_000
        if ended:
            return "".join(kept), True
    return "".join(kept), False


@pytest.mark.parametrize("pieces, expected", [
    # the first line never counts; a later line indented less than 4 ends the output before its text
    (["x = 1", "\n    y = 2\n", "z = 3\n"], ("x = 1\n    y = 2\n", True)),
    (["x = 1\n", "  ", "  ", "y", " = 2"], ("x = 1\n    y = 2", False)),  # 4 spaces, in pieces: fine
    (["x = 1\n", "\t", "y"], ("x = 1\n\t", True)),  # a tab counts one
    (["\n", "\n", "        a"], ("\n", True)),  # an empty line ends it too: its newline is text at indent 0
    (["\n", "    ", "    a\n", "  b"], ("\n        a\n  ", True)),
    (["if x:\n", "        return 1\n", "    else"], ("if x:\n        return 1\n    else", False)),
])
def test_n_indent(pieces, expected):
    assert _run(_CodeLimits(4, 0), pieces) == expected


def test_t_max_predict_ms_waits_for_a_newline():
    # 10 ms a piece, a limit of 25 ms: past it, the output ends at the first piece after a newline came
    assert _run(_CodeLimits(0, 25), ["a", "b", "c", "d", "e\n", "f", "g"], step_ms=10) == ("abcde\n", True)
    assert _run(_CodeLimits(0, 25), ["a", "b", "c", "d", "e", "f"], step_ms=10) == ("abcdef", False)
    assert _run(_CodeLimits(0, 0), ["a\n"] * 50, step_ms=10) == ("a\n" * 50, False)
