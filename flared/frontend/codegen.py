"""jinja2's code generator, changed where chat templates spend their time; same meaning.

Three changes: piecewise output of string concatenations (below), inline lookups
for ``dict`` items and loop properties (see visit_Getattr), and ``{% mark %}``
yielding its sentinel object itself (annotate.py, template.py).

Chat templates write ``{{ '<|im_start|>' + message.role + '\\n' + message.content
+ '<|im_end|>\\n' }}``; jinja2 compiles that to ``yield str(((a + b) + c) + d)``,
which copies the message once per ``+`` after it, and the render's final join
copies it once more. With 260 KB messages those copies are most of a render.

Rules (output bytes, exceptions and evaluation order are jinja2's):
- An ``{{ }}`` child that is a chain ``o0 + o1 + ... + on`` (left-nested
  ``Add`` nodes) evaluates its non-constant operands into temporaries, left to
  right, each followed by ``type(t) is str``. When every operand is an exact
  ``str``, each ``+`` is plain concatenation (no ``__add__``/``__radd__`` can
  run, none can raise), so the operands are output one by one: the same text.
  As soon as one is not an exact ``str`` the original expression runs from
  there on, with the operands already evaluated, so the additions happen in
  the original order and raise what they raised (UndefinedError, TypeError).
  An operand is evaluated no earlier than in the original, except after
  additions of exact strings, which have no effect to observe.
- A ``~`` chain (``Concat``) evaluates all its operands first, then ``str()``
  of each in order, as jinja2's ``str_join`` does; the results are output
  piecewise when they are exact strs, joined as ``str_join`` joins them if not.
- Pieces whose non-constant operands total under _PIECEWISE_MIN_CHARS code
  points are concatenated into one chunk (cheaper than more chunks).
- Only for streamed and buffered output without autoescape, finalize or
  ``{% extends %}``; anything else takes jinja2's own path.
"""

from __future__ import annotations

import jinja2.nodes as nodes
from jinja2.compiler import CodeGenerator, Frame, optimizeconst

# Past this many non-constant operands the fallback branches (quadratic in their number) are not
# worth their code size; such chains compile as jinja2 compiles them.
_MAX_DYNAMIC_OPERANDS = 8
# Names a dict has as attributes: `d.items` is the method, not the item (the sandbox's rule).
_DICT_ATTRIBUTES = frozenset(dir(dict))
# LoopContext properties the sandbox always allows (ChatSandbox.getattr's _LOOP_PROPERTIES).
_LOOP_PROPERTIES = frozenset(
    ("index", "index0", "revindex", "revindex0", "first", "last", "length", "previtem", "nextitem", "depth", "depth0")
)
# Below this many code points in the non-constant operands, a chain is concatenated as before.
_PIECEWISE_MIN_CHARS = 1024


def _add_operands(node: nodes.Expr) -> list[nodes.Expr]:
    """The operands of a left-nested ``+`` chain, in evaluation order."""
    operands = []
    while isinstance(node, nodes.Add):
        operands.append(node.right)
        node = node.left
    operands.append(node)
    operands.reverse()
    return operands


def _is_str_const(node: nodes.Expr) -> bool:
    return isinstance(node, nodes.Const) and type(node.value) is str


def _splittable(node: nodes.Expr) -> bool:
    if isinstance(node, nodes.Concat):
        operands = node.nodes
    elif isinstance(node, nodes.Add):
        operands = _add_operands(node)
    else:
        return False
    num_dynamic = sum(not _is_str_const(op) for op in operands)
    return len(operands) > 1 and 0 < num_dynamic <= _MAX_DYNAMIC_OPERANDS


class ChatCodeGenerator(CodeGenerator):
    """Emits ``+`` and ``~`` chains in ``{{ }}`` as separate output pieces (rules in the module header)."""

    def visit_Output(self, node: nodes.Output, frame: Frame) -> None:
        if (
            frame.buffer is None
            and not frame.require_output_check
            and len(node.nodes) == 1
            and isinstance(node.nodes[0], nodes.EnvironmentAttribute)
            and node.nodes[0].name == "flared_mark_sentinel"
        ):
            # A {% mark %}: the render loop finds its sentinel by identity, so it is yielded as is
            # (str() would turn the empty str subclass into a plain "" and lose the mark).
            self.writeline("yield environment.flared_mark_sentinel", node)
            return
        if (
            frame.require_output_check
            or frame.eval_ctx.volatile
            or frame.eval_ctx.autoescape
            or self.environment.finalize is not None
            or not any(_splittable(child) for child in node.nodes)
        ):
            super().visit_Output(node, frame)
            return
        plain: list[nodes.Expr] = []
        for child in node.nodes:
            if not _splittable(child):
                plain.append(child)
                continue
            if plain:
                super().visit_Output(nodes.Output(plain, lineno=node.lineno), frame)
                plain = []
            self.newline(child)
            if isinstance(child, nodes.Concat):
                self._output_concat(child, frame)
            else:
                self._output_add_chain(_add_operands(child), frame)
        if plain:
            super().visit_Output(nodes.Output(plain, lineno=node.lineno), frame)

    # -- attribute and item access --------------------------------------------------------------
    # `message.role`, `message['role']` and `loop.last` are most of a chat template's work. For an
    # exact dict holding the key, or a LoopContext property, the sandbox's answer is the plain
    # lookup; the generated code does that lookup inline and calls the environment otherwise. The
    # object expression is evaluated once (an assignment expression), as before.

    @optimizeconst
    def visit_Getattr(self, node: nodes.Getattr, frame: Frame) -> None:
        if self.environment.is_async or node.attr in _DICT_ATTRIBUTES:
            super().visit_Getattr(node, frame)
            return
        name = self.temporary_identifier()
        key = repr(node.attr)
        if node.attr in _LOOP_PROPERTIES:
            self.write(f"({name}.{node.attr} if type({name} := ")
            self.visit(node.node, frame)
            self.write(f") is LoopContext else {name}[{key}] if type({name}) is dict and {key} in {name} ")
        else:
            self.write(f"({name}[{key}] if type({name} := ")
            self.visit(node.node, frame)
            self.write(f") is dict and {key} in {name} ")
        self.write(f"else environment.getattr({name}, {key}))")

    @optimizeconst
    def visit_Getitem(self, node: nodes.Getitem, frame: Frame) -> None:
        if self.environment.is_async or not _is_str_const(node.arg):
            super().visit_Getitem(node, frame)
            return
        name = self.temporary_identifier()
        key = repr(node.arg.value)
        self.write(f"({name}[{key}] if type({name} := ")
        self.visit(node.node, frame)
        self.write(f") is dict and {key} in {name} else environment.getitem({name}, {key}))")

    # -- emitting ---------------------------------------------------------------------------------
    # A piece is (True, text) for a literal or (False, source) for an expression that is an exact
    # str at run time.

    def _emit_pieces(self, pieces: list[tuple[bool, str]], frame: Frame) -> None:
        """Output the pieces in order, adjacent literals as one."""
        sources: list[str] = []
        literal = ""
        for is_literal, text in pieces:
            if is_literal:
                literal += text
                continue
            if literal:
                sources.append(repr(literal))
                literal = ""
            sources.append(text)
        if literal:
            sources.append(repr(literal))
        if not sources:
            return
        if frame.buffer is None:
            for source in sources:
                self.writeline(f"yield {source}")
        elif len(sources) == 1:
            self.writeline(f"{frame.buffer}.append({sources[0]})")
        else:
            self.writeline(f"{frame.buffer}.extend(({', '.join(sources)},))")

    def _emit_str_of(self, write_expression, frame: Frame) -> None:
        """Output ``str(expression)``, the way jinja2 outputs a runtime child."""
        if frame.buffer is None:
            self.writeline("yield str(")
        else:
            self.writeline(f"{frame.buffer}.append(str(")
        write_expression()
        self.write(")" if frame.buffer is None else "))")

    def _emit_sized(self, pieces: list[tuple[bool, str]], frame: Frame) -> None:
        """Output exact-str pieces: as one concatenated chunk while they are short, else piecewise.

        Copying short strings costs less than the extra chunks (each is yielded, listed, joined and
        scanned for marks); long ones are never copied.
        """
        names = [text for is_literal, text in pieces if not is_literal]
        self.writeline(f"if {' + '.join(f'len({name})' for name in names)} < {_PIECEWISE_MIN_CHARS}:")
        self.indent()
        sources = [repr(text) if is_literal else text for is_literal, text in pieces]
        self._emit_pieces([(False, " + ".join(sources))], frame)
        self.outdent()
        self.writeline("else:")
        self.indent()
        self._emit_pieces(pieces, frame)
        self.outdent()

    def _output_concat(self, node: nodes.Concat, frame: Frame) -> None:
        # str_join((a, b, ...)) evaluates every operand, then str() of each, in order.
        names = []
        for operand in node.nodes:
            name = None
            if not _is_str_const(operand):
                name = self.temporary_identifier()
                self.writeline(f"{name} = ")
                self.visit(operand, frame)
            names.append(name)
        pieces = []
        for operand, name in zip(node.nodes, names):
            if name is None:
                pieces.append((True, operand.value))
            else:
                self.writeline(f"{name} = str({name})")
                pieces.append((False, name))
        # str() may return a str subclass (from a __str__); those are joined as str_join joins them.
        dynamic = [text for is_literal, text in pieces if not is_literal]
        self.writeline(f"if {' and '.join(f'type({name}) is str' for name in dynamic)}:")
        self.indent()
        self._emit_sized(pieces, frame)
        self.outdent()
        self.writeline("else:")
        self.indent()
        sources = [repr(text) if is_literal else text for is_literal, text in pieces]
        self._emit_pieces([(False, f"concat(({', '.join(sources)},))")], frame)
        self.outdent()

    def _output_add_chain(self, operands: list[nodes.Expr], frame: Frame) -> None:
        # pieces[i]: operand i once evaluated (its literal, or the temporary holding it); None before.
        pieces = [(True, op.value) if _is_str_const(op) else None for op in operands]
        self._add_chain_from(operands, pieces, 0, frame)

    def _add_chain_from(self, operands, pieces, start: int, frame: Frame) -> None:
        """Code for the chain once every operand before ``start`` is evaluated and an exact str."""
        index = start
        while index < len(operands) and pieces[index] is not None:
            index += 1
        if index == len(operands):
            self._emit_sized(pieces, frame)
            return
        name = self.temporary_identifier()
        self.writeline(f"{name} = ")
        self.visit(operands[index], frame)
        pieces = [*pieces[:index], (False, name), *pieces[index + 1:]]
        self.writeline(f"if type({name}) is str:")
        self.indent()
        self._add_chain_from(operands, pieces, index + 1, frame)
        self.outdent()
        self.writeline("else:")
        self.indent()
        self._emit_str_of(lambda: self._write_original_sum(operands, pieces, index + 1, frame), frame)
        self.outdent()

    def _write_original_sum(self, operands, pieces, num_evaluated: int, frame: Frame) -> None:
        """``((v0 + v1) + ...)`` as jinja2 writes it: evaluated operands by name, later ones inline."""
        self.write("(" * (len(operands) - 1))
        for position, operand in enumerate(operands):
            if position:
                self.write(" + ")
            if position < num_evaluated:
                is_literal, text = pieces[position]
                self.write(repr(text) if is_literal else text)
            else:
                self.visit(operand, frame)
            if position:
                self.write(")")
