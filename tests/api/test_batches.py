"""OpenAI's Files and Batch APIs through the openai SDK, as its users call them (flared.server.batch_routes).

The tool model's greedy output is known (tests/api/conftest.py): with thinking off it answers "It is sunny in
Paris." and then its EOS; after " la" it repeats " la" until max_tokens."""

from __future__ import annotations

import json
import time

import openai
import pytest

ANSWER = "It is sunny in Paris."
NO_THINK = {"enable_thinking": False}


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.base + "/v1", api_key="unused", max_retries=0)


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _chat(content: str = "What is the weather in Paris?", **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 8,
            "chat_template_kwargs": NO_THINK, **extra}


def _upload(client, lines: list[str], name: str = "in.jsonl"):
    return client.files.create(file=(name, ("\n".join(lines) + "\n").encode()), purpose="batch")


def _wait(client, batch_id: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "expired", "cancelled"):
            return b
        assert time.monotonic() < deadline, f"batch still {b.status}"
        time.sleep(0.05)


def _jsonl(client, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_a_chat_batch_answers_each_line_in_input_order(client):
    lines = [_line("a", "/v1/chat/completions", _chat()),
             _line("bad-temperature", "/v1/chat/completions", _chat(temperature=-1)),
             _line("b", "/v1/chat/completions", _chat(max_tokens=1)),
             _line("streamed", "/v1/chat/completions", _chat(stream=True)),
             _line("c", "/v1/chat/completions", _chat())]
    f = _upload(client, lines)
    assert f.purpose == "batch" and f.bytes > 0 and f.filename == "in.jsonl" and f.id.startswith("file-")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"job": "weather"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "weather"}
    done = _wait(client, batch.id)
    assert done.status == "completed" and done.completed_at and done.in_progress_at and done.finalizing_at
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 3, 2)
    out = _jsonl(client, done.output_file_id)
    assert [r["custom_id"] for r in out] == ["a", "b", "c"]
    for r in out:
        assert r["response"]["status_code"] == 200 and r["error"] is None and r["id"].startswith("batch_req_")
        assert r["response"]["body"]["object"] == "chat.completion" and r["response"]["request_id"]
    for r in out:
        assert r["response"]["body"]["choices"][0]["message"]["content"] == ANSWER
    assert [r["response"]["body"]["choices"][0]["finish_reason"] for r in out] == ["stop", "length", "stop"]
    errors = _jsonl(client, done.error_file_id)
    assert [r["custom_id"] for r in errors] == ["bad-temperature", "streamed"]
    assert all(r["response"]["status_code"] == 400 for r in errors)
    assert "temperature" in errors[0]["response"]["body"]["error"]["message"]
    assert "stream" in errors[1]["response"]["body"]["error"]["message"]
    output_file = client.files.retrieve(done.output_file_id)
    assert output_file.purpose == "batch_output"
    assert batch.id in [b.id for b in client.batches.list()]


def test_completions_and_embeddings_batches(client):
    f = _upload(client, [_line(f"p{i}", "/v1/completions",
                               {"model": "tiny", "prompt": "Sing: la", "max_tokens": 2 + i, "temperature": 0})
                         for i in range(4)])
    done = _wait(client, client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                               completion_window="24h").id)
    assert done.status == "completed" and done.error_file_id is None
    texts = [r["response"]["body"]["choices"][0]["text"] for r in _jsonl(client, done.output_file_id)]
    assert texts == [" la" * (2 + i) for i in range(4)]
    f = _upload(client, [_line("e1", "/v1/embeddings", {"model": "tiny", "input": "hello"}),
                         _line("e2", "/v1/embeddings", {"model": "tiny", "input": ["a", "b"]})])
    done = _wait(client, client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings",
                                               completion_window="24h").id)
    out = _jsonl(client, done.output_file_id)
    direct = client.embeddings.create(model="tiny", input="hello").data[0].embedding
    assert out[0]["response"]["body"]["data"][0]["embedding"] == pytest.approx(direct)
    assert len(out[1]["response"]["body"]["data"]) == 2


def test_a_file_that_is_not_a_batch_fails_it_before_anything_runs(client):
    lines = [_line("x", "/v1/chat/completions", _chat()), "{not json", _line("x", "/v1/chat/completions", _chat()),
             _line("y", "/v1/completions", {"prompt": "hi"}),
             json.dumps({"custom_id": "z", "method": "GET", "url": "/v1/chat/completions", "body": {}})]
    f = _upload(client, lines)
    done = _wait(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                               completion_window="24h").id)
    assert done.status == "failed" and done.failed_at and done.output_file_id is None
    assert [(e.code, e.line) for e in done.errors.data] == [
        ("invalid_json_line", 2), ("duplicate_custom_id", 3), ("invalid_url", 4), ("invalid_method", 5)]
    assert done.request_counts.total == 0


def test_cancelling_stops_the_lines_not_yet_started(client, daemon):
    lines = [_line(f"s{i}", "/v1/completions", {"model": "tiny", "prompt": "Sing: la", "max_tokens": 400,
                                                  "temperature": 0, "ignore_eos": True}) for i in range(64)]
    f = _upload(client, lines)
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.APIStatusError) as busy:  # a running batch's input stays
        client.files.delete(f.id)
    assert busy.value.status_code == 409
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = _wait(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    errors = _jsonl(client, done.error_file_id)
    assert errors and all(e["error"]["code"] == "batch_cancelled" and e["response"] is None for e in errors)
    ran = done.request_counts.completed + done.request_counts.failed
    assert ran + len(errors) == 64 and ran < 64
    if ran:
        assert all(r["response"]["body"]["choices"][0]["text"] == " la" * 400
                   for r in _jsonl(client, done.output_file_id))
    with pytest.raises(openai.BadRequestError):  # ended: no second cancel
        client.batches.cancel(batch.id)
    assert client.files.delete(f.id).deleted


def test_files_can_be_listed_read_and_deleted(client):
    f = client.files.create(file=("notes.txt", b"hello\n"), purpose="user_data")
    assert client.files.retrieve(f.id).bytes == 6
    assert client.files.content(f.id).content == b"hello\n"
    listed = client.files.list(purpose="user_data")
    assert f.id in [x.id for x in listed.data]
    assert all(x.purpose == "user_data" for x in listed.data)
    gone = client.files.delete(f.id)
    assert gone.id == f.id and gone.deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="nonsense")
    with pytest.raises(openai.BadRequestError, match="purpose"):  # a batch reads only files of purpose batch
        other = client.files.create(file=("x.jsonl", b"{}\n"), purpose="user_data")
        client.batches.create(input_file_id=other.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        f2 = _upload(client, [_line("a", "/v1/chat/completions", _chat())])
        client.batches.create(input_file_id=f2.id, endpoint="/v1/moderations", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-missing", endpoint="/v1/chat/completions", completion_window="24h")


def test_an_upload_may_exceed_the_json_routes_body_limit(client, daemon):
    """The files route takes up to 200 MB where JSON routes take ~1 MB (flared run's body limit)."""
    data = b"x" * (3 << 20)
    f = client.files.create(file=("big.bin", data), purpose="user_data")
    assert f.bytes == len(data) and client.files.content(f.id).content == data
    client.files.delete(f.id)
    with pytest.raises(openai.APIStatusError) as too_big:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * (3 << 20)}])
    assert too_big.value.status_code == 413


def test_flared_run_batch_runs_a_file_offline(tool_core, tmp_path):
    """`flared run-batch -i in.jsonl -o out.jsonl CORE`, as vLLM's run-batch: each line names its own url; the
    results come back one a line in input order, errors included; a file that is not such lines runs nothing."""
    import subprocess
    import sys

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "temperature": 0, "max_tokens": 8, "chat_template_kwargs": NO_THINK}
    lines = [_line("chat", "/v1/chat/completions", chat),
             _line("emb", "/v1/embeddings", {"model": "tiny", "input": "hello"}),
             _line("cmpl", "/v1/completions", {"model": "tiny", "prompt": "Sing: la", "max_tokens": 3,
                                               "temperature": 0}),
             _line("bad", "/v1/chat/completions", {**chat, "temperature": -1})]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    cmd = [sys.executable, "-m", "flared.cli.daemon", "run-batch", "-i", str(src), "-o", str(out), "--served-name",
           "tiny", str(tool_core)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in rows] == ["chat", "emb", "cmpl", "bad"]
    assert [r["response"]["status_code"] for r in rows] == [200, 200, 200, 400]
    assert rows[0]["response"]["body"]["choices"][0]["message"]["content"] == ANSWER
    assert len(rows[1]["response"]["body"]["data"][0]["embedding"]) > 0
    assert rows[2]["response"]["body"]["choices"][0]["text"] == " la" * 3
    assert "4 requests, 3 answered 2xx" in done.stderr
    src.write_text(lines[0] + "\n" + _line("x", "/v1/models", {}) + "\n")
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "line 2" in bad.stderr and "invalid_url" in bad.stderr


def test_a_deeply_nested_line_fails_the_batch_cleanly(client):
    f = _upload(client, ['{"custom_id": "a", "body": ' + "[" * 100_000 + "]" * 100_000 + "}"])
    done = _wait(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                               completion_window="24h").id)
    assert done.status == "failed" and done.errors.data[0].code == "invalid_json_line"


def test_batch_lines_yield_to_interactive_requests():
    """Chat and text completion lines without a priority run at BATCH_PRIORITY (behind priority-0 requests); a
    line's own priority, and the routes without one, are left alone."""
    from flared.server.batch_routes import BATCH_PRIORITY, line_body

    assert line_body("/v1/chat/completions", {"model": "m"}) == {"model": "m", "priority": BATCH_PRIORITY}
    assert line_body("/v1/completions", {"priority": -3}) == {"priority": -3}
    assert line_body("/v1/embeddings", {"input": "x"}) == {"input": "x"}
