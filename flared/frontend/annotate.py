"""Static analysis of chat-template syntax trees: checking {% mark %}, adding automatic marks.

Rules:
- A mark records a position only where output streams straight out of the root
  render function. Inside a macro, a call block (including {% generation %}),
  a captured {% set %}, a {% filter %} block or a recursive loop the output is
  buffered, so a mark there is a compile error.
- Automatic marks go around every streaming loop over the conversation that
  emits output: one before the loop (end of the preamble), one at the end of
  each iteration (end of a message). They never change output bytes.
"""

from __future__ import annotations

import jinja2.ext
import jinja2.nodes as nodes
from jinja2.exceptions import TemplateSyntaxError

from flared.frontend.jinja_env import GenerationExtension, mark_node

def is_call_to(node: nodes.Node, extension: type[jinja2.ext.Extension], method: str) -> bool:
    return (
        isinstance(node, nodes.Call)
        and isinstance(node.node, nodes.ExtensionAttribute)
        and node.node.identifier == extension.identifier
        and node.node.name == method
    )


def is_mark(node: nodes.Node) -> bool:
    return (
        isinstance(node, nodes.Output)
        and len(node.nodes) == 1
        and isinstance(node.nodes[0], nodes.EnvironmentAttribute)
        and node.nodes[0].name == "flared_mark_sentinel"
    )


def check_marks(node: nodes.Node, buffered_by: str | None, found: list[int]) -> None:
    """Collect the line of every {% mark %}; reject those whose output would be buffered."""
    if is_mark(node):
        if buffered_by is not None:
            raise TemplateSyntaxError(f"{{% mark %}} is not allowed inside {buffered_by}", node.lineno)
        found.append(node.lineno)
        return
    if isinstance(node, nodes.Macro):
        buffered_by = buffered_by or "a macro"
    elif isinstance(node, nodes.CallBlock):
        buffered_by = buffered_by or (
            "{% generation %}" if is_call_to(node.call, GenerationExtension, "_generation") else "a call block"
        )
    elif isinstance(node, nodes.AssignBlock):
        buffered_by = buffered_by or "a captured {% set %}"
    elif isinstance(node, nodes.FilterBlock):
        buffered_by = buffered_by or "a {% filter %} block"
    elif isinstance(node, nodes.For) and node.recursive:
        buffered_by = buffered_by or "a recursive loop"
    for child in node.iter_child_nodes():
        check_marks(child, buffered_by, found)


def _names_messages(expression: nodes.Node) -> bool:
    """Whether a loop's iterable mentions the conversation (messages, loop_messages, ns.messages, ...)."""
    for node in (expression, *expression.find_all((nodes.Name, nodes.Getattr))):
        if not isinstance(node, (nodes.Name, nodes.Getattr)):
            continue
        name = node.name if isinstance(node, nodes.Name) else node.attr
        if "messages" in name:
            return True
    return False


def _is_message_loop(node: nodes.Node) -> bool:
    return (
        isinstance(node, nodes.For)
        and not node.recursive
        and _names_messages(node.iter)
        and any(not is_mark(output) for output in node.find_all(nodes.Output))
    )


def auto_annotate(node: nodes.Node, buffered: bool, *, apply: bool = True) -> int:
    """Mark every streaming loop over the messages that emits output: before the loop (the end of
    the preamble: BOS, system prompt, tool list) and at the end of each iteration; count the loops.

    Loops that only compute (a reverse scan for the last user turn) emit nothing and get no mark;
    loops in macros, call blocks, captured sets and filter blocks are buffered and are skipped.
    """
    count = 0
    if isinstance(node, (nodes.Macro, nodes.CallBlock, nodes.AssignBlock, nodes.FilterBlock)):
        buffered = True
    for field in node.fields:
        statements = getattr(node, field)
        if not isinstance(statements, list):
            continue
        annotated = []
        for child in statements:
            if isinstance(child, nodes.Node) and not buffered and _is_message_loop(child):
                count += 1
                if apply:
                    annotated.append(mark_node(child.lineno))
                    child.body.append(mark_node(child.lineno))
            annotated.append(child)
        if len(annotated) != len(statements):
            setattr(node, field, annotated)
    for child in node.iter_child_nodes():
        count += auto_annotate(child, buffered, apply=apply)
    return count
