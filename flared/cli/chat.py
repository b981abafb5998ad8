"""`flarectl chat`: talk to a running server from the terminal, as `ollama run` does.

A client of /v1/chat/completions (streamed) and nothing else, so it works against any OpenAI-compatible server.
The conversation is kept for the session; lines that start with ``/`` are commands (``/help``). A message of
several lines goes between two lines of ``\"\"\"``. Ctrl-C stops an answer (what came so far stays in the
conversation), Ctrl-D or ``/bye`` leaves. On a terminal the model's reasoning is shown dim; with ``--no-think``
the template is asked to leave it out (``chat_template_kwargs.enable_thinking``). Standard input that is not a
terminal is read as messages, one a line (a script or a pipe).
"""

from __future__ import annotations

import http.client
import json
import os
import sys
from urllib.parse import urlsplit

import click

HELP = """commands:
  /bye              leave (or Ctrl-D)
  /clear            forget the conversation
  /system TEXT      set the system prompt (empty: none)
  /set temperature X | /set max_tokens N
  /show             the settings and the conversation's length
  \"\"\"               start or end a message of several lines"""


class ChatError(Exception):
    pass


def _connection(url: str, timeout_s: float):
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ChatError(f"not an http(s) URL: {url!r}")
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return cls(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80), timeout=timeout_s), \
        parts.path.rstrip("/")


def _headers(api_key: str | None) -> dict:
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def _error_of(resp) -> str:
    body = resp.read()
    try:
        return f"{resp.status}: {json.loads(body)['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{resp.status}: {body[:200].decode('utf-8', 'replace')}"


def first_model(url: str, api_key: str | None, timeout_s: float = 30.0) -> str:
    conn, prefix = _connection(url, timeout_s)
    try:
        conn.request("GET", prefix + "/v1/models", headers=_headers(api_key))
        resp = conn.getresponse()
        if resp.status != 200:
            raise ChatError(f"cannot list the models: {_error_of(resp)}")
        data = json.loads(resp.read())["data"]
        if not data:
            raise ChatError("the server lists no model")
        return data[0]["id"]
    except OSError as e:
        raise ChatError(f"cannot reach {url}: {e}") from None
    finally:
        conn.close()


def stream_chat(url: str, api_key: str | None, body: dict, on_text, on_reasoning, timeout_s: float = 600.0) -> dict:
    """One streamed chat completion; calls on_text / on_reasoning with each piece. Returns {finish, usage}."""
    conn, prefix = _connection(url, timeout_s)
    try:
        conn.request("POST", prefix + "/v1/chat/completions", body=json.dumps(body).encode(), headers=_headers(api_key))
        resp = conn.getresponse()
        if resp.status != 200:
            raise ChatError(_error_of(resp))
        finish, usage, data = None, None, []
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.rstrip(b"\r\n")
            if line.startswith(b"data:"):
                data.append(line[5:].lstrip(b" "))
                continue
            if line or not data:
                continue  # comments and other fields
            payload, data = b"\n".join(data), []
            if payload == b"[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                raise ChatError(chunk["error"].get("message", "the stream failed"))
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("reasoning_content"):
                    on_reasoning(delta["reasoning_content"])
                if delta.get("content"):
                    on_text(delta["content"])
                finish = choice.get("finish_reason") or finish
        return {"finish": finish, "usage": usage}
    except OSError as e:
        raise ChatError(f"the connection failed: {e}") from None
    finally:
        conn.close()


def _read_message(prompt: str, interactive: bool):
    """The next message (several lines between \"\"\" lines), or None at the end of input."""
    def line_in(p: str) -> str | None:
        if not interactive:
            line = sys.stdin.readline()
            return None if line == "" else line.rstrip("\n")
        try:
            return input(p)
        except EOFError:
            return None

    first = line_in(prompt)
    if first is None or first.strip() != '"""':
        return first
    lines = []
    while True:
        line = line_in("... ")
        if line is None or line.strip() == '"""':
            return "\n".join(lines)
        lines.append(line)


@click.command("chat")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, help="The server's base URL.")
@click.option("--api-key", envvar="FLARED_API_KEY", default=None, help="Bearer token (also FLARED_API_KEY).")
@click.option("--model", default=None, help="Model name (default: the first the server lists).")
@click.option("--system", default=None, help="System prompt.")
@click.option("--temperature", type=float, default=None, help="Sampling temperature (default: the model's).")
@click.option("--max-tokens", type=int, default=None, help="Most tokens an answer may take.")
@click.option("--think/--no-think", default=None, help="Ask the template for the model's reasoning, or not.")
def chat(url, api_key, model, system, temperature, max_tokens, think):
    """Chat with a running server from the terminal (Ctrl-C stops an answer, /bye or Ctrl-D leaves)."""
    interactive = sys.stdin.isatty()
    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    try:
        model = model or first_model(url, api_key)
    except ChatError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    if interactive:
        click.echo(f"{model} at {url} (/help for commands)")
    settings = {"temperature": temperature, "max_tokens": max_tokens}
    history: list[dict] = []
    failures = 0
    while True:
        text = _read_message(">>> " if interactive else "", interactive)
        if text is None or text.strip() == "/bye":
            break
        if not text.strip():
            continue
        if text.startswith("/"):
            cmd, _, arg = text.strip().partition(" ")
            if cmd == "/clear":
                history = []
                click.echo("(conversation cleared)")
            elif cmd == "/system":
                system = arg or None
                click.echo(f"(system prompt {'set' if system else 'removed'})")
            elif cmd == "/set":
                key, _, value = arg.partition(" ")
                try:
                    settings[{"temperature": "temperature", "max_tokens": "max_tokens"}[key]] = \
                        float(value) if key == "temperature" else int(value)
                    click.echo(f"({key} = {value})")
                except (KeyError, ValueError):
                    click.echo("usage: /set temperature X | /set max_tokens N", err=True)
            elif cmd == "/show":
                click.echo(f"model {model}; system prompt: {system!r}; temperature {settings['temperature']}; "
                           f"max_tokens {settings['max_tokens']}; {len(history)} messages")
            elif cmd == "/help":
                click.echo(HELP)
            else:
                click.echo(f"unknown command {cmd} (/help)", err=True)
            continue
        history.append({"role": "user", "content": text})
        body = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                "messages": ([{"role": "system", "content": system}] if system else []) + history}
        body.update({k: v for k, v in settings.items() if v is not None})
        if think is not None:
            body["chat_template_kwargs"] = {"enable_thinking": think}
        answer: list[str] = []
        thinking = [False]

        def on_reasoning(piece: str) -> None:
            if not interactive:
                return  # a script gets the answers only
            if not thinking[0]:
                thinking[0] = True
                click.echo("\x1b[2m" if color else "Thinking...\n", nl=False)
            click.echo(piece, nl=False)

        def on_text(piece: str) -> None:
            if thinking[0]:
                thinking[0] = False
                click.echo("\x1b[0m\n" if color else "\n...done thinking.\n", nl=False)
            answer.append(piece)
            click.echo(piece, nl=False)

        try:
            stream_chat(url, api_key, body, on_text, on_reasoning)
        except KeyboardInterrupt:
            click.echo("\x1b[0m" if color else "", nl=False)
            click.echo("\n(stopped)", err=True)
        except ChatError as e:
            history.pop()
            failures += 1
            click.echo(f"\nerror: {e}", err=True)
            continue
        if thinking[0] and color:
            click.echo("\x1b[0m", nl=False)
        click.echo()
        history.append({"role": "assistant", "content": "".join(answer)})
    if interactive:
        click.echo()
    sys.exit(1 if failures and not interactive else 0)
