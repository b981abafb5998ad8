"""Admission limits, auth, shutdown, failures, disconnects and prefix reuse on the real daemon."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time

from flared_testing.rawhttp import post_bytes, read_until, read_until_first_token

MSGS = [{"role": "user", "content": "Hello, world! How are you today?"}]


def test_api_key_is_required_except_on_health(tiny_core, start_daemon):
    d = start_daemon(tiny_core, "--api-key", "s3cret")
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    assert d.request("POST", "/v1/completions", body)[0] == 401
    assert d.request("POST", "/v1/completions", body, headers={"authorization": "Bearer nope"})[0] == 401
    status, payload = d.request("POST", "/v1/completions", {**body, "model": "x"},
                                headers={"authorization": "Bearer s3cret"})
    assert status == 404  # authenticated, then the model is checked
    assert d.request("GET", "/health")[0] == 200
    assert d.request("GET", "/ping")[0] == 200 and d.request("POST", "/ping")[0] == 200  # vLLM's / SageMaker's
    assert d.request("GET", "/version")[0] == 401
    status, v = d.request("GET", "/version", headers={"authorization": "Bearer s3cret"})
    assert status == 200 and v["version"]
    assert d.stop() == 0


def test_http_admission_beyond_capacity_is_429_with_the_hint(tiny_core, start_daemon):
    d = start_daemon(tiny_core, "--max-active", "1", "--queue-capacity", "0")
    holder = socket.create_connection(("127.0.0.1", d.port))
    try:
        # Headers only: the request is admitted (its permit taken) and waits for its body.
        holder.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 100\r\n\r\n")
        deadline = time.monotonic() + 30
        while True:
            status, body = d.request("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
            if status == 429 or time.monotonic() > deadline:
                break
        assert status == 429, body
        assert "export --concurrency" in body["error"]["message"]
    finally:
        holder.close()
    # The permit comes back with the connection.
    deadline = time.monotonic() + 30
    while True:
        status, body = d.request("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
        if status == 200:
            break
        assert time.monotonic() < deadline, (status, body)
    assert d.stop() == 0


def test_sigterm_lets_an_inflight_stream_finish_then_exits_0(tiny_core, start_daemon):
    d = start_daemon(tiny_core)
    sock = socket.create_connection(("127.0.0.1", d.port))
    sock.sendall(post_bytes("/v1/completions", {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 200,
                                           "temperature": 0, "ignore_eos": True, "stream": True}))
    first = read_until(sock, b"data: ")
    assert b"200 OK" in first
    d.proc.send_signal(signal.SIGTERM)
    rest = read_until(sock, b"data: [DONE]")
    sock.close()
    stream = first + rest
    assert b"data: [DONE]" in stream and b'"finish_reason":"length"' in stream
    assert d.proc.wait(60) == 0, d.log()


def test_model_thread_failure_errors_clients_and_exits_1(tiny_core, start_daemon):
    d = start_daemon(tiny_core, "--debug-fail-after-steps", "3")
    sock = socket.create_connection(("127.0.0.1", d.port))
    sock.sendall(post_bytes("/v1/chat/completions", {"model": "tiny", "messages": MSGS, "max_tokens": 50,
                                                "temperature": 0, "stream": True}))
    stream = read_until(sock, b"data: [DONE]")
    sock.close()
    assert b"injected model-thread failure" in stream and b'"error"' in stream
    try:
        status, body = d.request("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert status == 503, body
    except ConnectionError:
        pass  # already exited
    assert d.proc.wait(60) == 1


def test_disconnect_mid_stream_cancels_and_frees_the_slot(default_core):
    """In-process session: the snapshot shows the cancellation and every slot and page back."""
    from flared.config import ServerConfig
    from flared.runtime.session import LoadedSession

    session = LoadedSession.load(default_core, ServerConfig(port=0, torch_threads=1))
    started = threading.Event()
    box: dict = {}

    async def serve():
        serving = await session.start()
        box["serving"] = serving
        box["loop"] = asyncio.get_running_loop()
        box["stop"] = asyncio.Event()
        started.set()
        await box["stop"].wait()
        await serving.close(grace_s=1.0)

    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    assert started.wait(120)
    serving = box["serving"]
    total_pages = serving.snapshot()["runtime"]["total_pages"]
    try:
        port = serving.address[1]
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(post_bytes("/v1/chat/completions", {"model": "smollm2-135m-instruct", "messages": MSGS,
                                                    "max_tokens": 1000, "ignore_eos": True, "stream": True}))
        got = read_until_first_token(sock)
        assert b"200 OK" in got
        sock.close()
        deadline = time.monotonic() + 60
        while True:
            rt = serving.snapshot()["runtime"]
            if rt["live_slots"] == 0 and rt["counters"]["cancelled"] == 1:
                break
            assert time.monotonic() < deadline, rt
            time.sleep(0.01)
        # Every page is free or held by the prefix cache; none by a request.
        scheduler = serving.loaded.runtime.scheduler
        scheduler.check_integrity()
        cached_pages = sum(1 for p in range(total_pages) if scheduler.cache.owns_page(p))
        assert rt["free_pages"] + cached_pages == total_pages
        assert rt["counters"]["finished"] == 0 and rt["outstanding"] == 0
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(60)


def test_multi_turn_conversation_reuses_previous_turns_and_matches_uncached(default_core, start_daemon):
    from flared.frontend import Frontend, TokenSettings

    cached = start_daemon(default_core)
    uncached = start_daemon(default_core, "--no-prefix-cache")
    m = json.loads((default_core / "manifest.json").read_text())
    fe = Frontend.load(default_core / "tokenizer.json", default_core / "chat_template.jinja",
                       settings=TokenSettings(bos_token=m["tokens"]["bos_token"], bos_token_id=m["tokens"]["bos_token_id"],
                                              eos_token=m["tokens"]["eos_token"],
                                              eos_token_id=m["tokens"]["eos_token_ids"][0]))
    questions = ["What is the capital of France?", "And of Germany?", "Which one is bigger?",
                 "Name a river in each.", "Which is longer?", "Tell me one fact about Paris.",
                 "And one about Berlin?", "Which city is older?", "Summarise our chat.", "Thank you!"]
    messages: list[dict] = []
    for turn, q in enumerate(questions):
        messages.append({"role": "user", "content": q})
        body = {"model": "smollm2-135m-instruct", "messages": messages, "max_tokens": 24, "temperature": 0}
        s1, a = cached.request("POST", "/v1/chat/completions", body)
        s2, b = uncached.request("POST", "/v1/chat/completions", body)
        assert s1 == 200 and s2 == 200, (a, b)
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"], turn
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        if turn >= 1:
            # Everything up to and including the previous user message was checkpointed last turn.
            previous = fe.render_chat(messages[:-2], add_generation_prompt=False)
            assert a["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(previous.token_ids), turn
        messages.append({"role": "assistant", "content": a["choices"][0]["message"]["content"]})
    assert cached.stop() == 0 and uncached.stop() == 0
