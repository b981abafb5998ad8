"""Embeddings through the real openai and ollama clients against a daemon serving the tiny random Llama:
the vectors are transformers' final hidden states of the same weights (last token, unit length)."""

from __future__ import annotations

import threading

import ollama
import openai
import pytest
import torch

TEXTS = ["Paris is the capital of France.", "def add(a, b):\n    return a + b\n", "Hello"]
LONG = "The quick brown fox jumps over the lazy dog. " * 40  # well over the tiny core's 256-token context


@pytest.fixture(scope="module")
def daemon(tiny_core_daemon):
    return tiny_core_daemon


@pytest.fixture(scope="module")
def reference(tiny_hf_llama):
    """Text -> (token ids, transformers' last-token final hidden state, unit length)."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(tiny_hf_llama / "tokenizer.json"))
    hf = AutoModelForCausalLM.from_pretrained(tiny_hf_llama, dtype=torch.float32).eval()

    def embed(text: str):
        ids = tok.encode(text).ids
        with torch.no_grad():
            h = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
        return ids, (h / h.norm()).tolist()
    return embed


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.base + "/v1", api_key="unused", max_retries=0)


def _close(a, b, tol=1e-5):
    assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


def test_openai_embeddings_are_the_models_hidden_states(client, reference):
    r = client.embeddings.create(model="tiny", input=TEXTS)  # the SDK asks for base64 (numpy is installed)
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == "tiny" and r.object == "list"
    expected = [reference(t) for t in TEXTS]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(ids) for ids, _ in expected)
    for d, (_, vec) in zip(r.data, expected):
        assert len(d.embedding) == 64 and abs(sum(x * x for x in d.embedding) - 1) < 1e-5
        _close(d.embedding, vec, 1e-4)
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    assert [d.embedding for d in floats.data] == [d.embedding for d in r.data]  # float32 either way
    # token ids embed as their text does; an input's vector does not depend on its batch
    ids = client.embeddings.create(model="tiny", input=[expected[0][0], expected[2][0]])
    _close(ids.data[0].embedding, r.data[0].embedding, 1e-6)
    _close(ids.data[1].embedding, r.data[2].embedding, 1e-6)
    alone = client.embeddings.create(model="tiny", input=TEXTS[1], dimensions=64)
    _close(alone.data[0].embedding, r.data[1].embedding, 1e-6)


def test_a_large_request_runs_in_pieces_with_the_same_vectors(client):
    """More tokens than a turn's budget (512 here): the job runs a piece a turn; every vector is the one its
    input gets alone, in input order."""
    one = [d.embedding for d in client.embeddings.create(model="tiny", input=TEXTS).data]
    many = client.embeddings.create(model="tiny", input=TEXTS * 60, encoding_format="float")
    assert many.usage.prompt_tokens > 3 * 512
    assert [d.index for d in many.data] == list(range(180))
    for got, want in zip(many.data, one * 60):  # rows batched differently may differ in float32's last bits
        _close(got.embedding, want, 1e-6)


@pytest.mark.parametrize("body, status, needle", [
    ({"input": ""}, 400, "'input': input is an empty string"),
    ({"input": []}, 400, "'input': must be a string"),
    ({"input": ["a", 3]}, 400, "'input': must be a string"),
    ({"input": [[1, 2], [100000]]}, 400, "input[1]: token id 100000 is outside the vocabulary"),
    ({"input": "Hello", "dimensions": 32}, 400, "have 64 dimensions and cannot be shortened to 32"),
    ({"input": "Hello", "encoding_format": "int8"}, 400, "'encoding_format': must be 'float' or 'base64'"),
    ({"input": LONG}, 400, "tokens; this model's context holds 256"),
    ({"input": "Hello", "model": "gpt-4"}, 404, "model 'gpt-4' does not exist"),
])
def test_openai_embedding_errors(daemon, body, status, needle):
    got, err = daemon.request("POST", "/v1/embeddings", {"model": "tiny", **body})
    assert got == status, err
    assert needle in err["error"]["message"]
    if status == 400 and "context" in needle:
        assert err["error"]["type"] == "context_length_exceeded"


def test_ollama_embed_and_legacy_embeddings(daemon, client):
    oc = ollama.Client(host=daemon.base)
    r = oc.embed(model="tiny", input=TEXTS)
    openai_vectors = [d.embedding for d in client.embeddings.create(model="tiny", input=TEXTS).data]
    assert len(r.embeddings) == 3 and r.prompt_eval_count > 0
    for got, want in zip(r.embeddings, openai_vectors):
        _close(got, want, 1e-7)
    legacy = oc.embeddings(model="tiny:latest", prompt=TEXTS[0]).embedding  # pooled as it is, not unit length
    norm = sum(x * x for x in legacy) ** 0.5
    assert abs(norm - 1) > 1e-3
    _close([x / norm for x in legacy], openai_vectors[0], 1e-6)
    # too long: cut to the context by default, refused with truncate false
    cut = oc.embed(model="tiny", input=LONG)
    assert cut.prompt_eval_count == 256 and len(cut.embeddings[0]) == 64
    with pytest.raises(ollama.ResponseError) as e:
        oc.embed(model="tiny", input=LONG, truncate=False)
    assert e.value.status_code == 400 and "context holds 256" in str(e.value)
    assert oc.embed(model="tiny", input=[]).embeddings == []  # Ollama's "load the model" call


def test_embeddings_share_the_model_with_generation(daemon, client):
    """A long completion streams while embedding requests run between its steps: both finish, and the
    metrics count the embedded inputs."""
    text = []

    def generate():
        stream = client.completions.create(model="tiny", prompt="Hello", max_tokens=120, temperature=0,
                                           stream=True)
        text.extend(c.choices[0].text for c in stream)

    before = _metric(daemon, "flare_embedded_sequences_total")
    worker = threading.Thread(target=generate)
    worker.start()
    for _ in range(5):
        assert len(client.embeddings.create(model="tiny", input=TEXTS).data) == 3
    worker.join(120)
    assert not worker.is_alive() and text
    assert _metric(daemon, "flare_embedded_sequences_total") == before + 15


def _metric(daemon, name: str) -> float:
    status, body = daemon.request("GET", "/metrics")
    assert status == 200
    for line in body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_llama_cpp_embedding_and_its_normalizations(daemon, reference):
    """llama.cpp's /embedding: one pooled vector per input, in a list, normalized as embd_normalize says (the
    default Euclidean: transformers' hidden state at unit length); `content` or `input`."""
    status, r = daemon.request("POST", "/embedding", {"content": TEXTS[0]})
    assert status == 200 and [e["index"] for e in r] == [0] and len(r[0]["embedding"]) == 1
    _close(r[0]["embedding"][0], reference(TEXTS[0])[1], 1e-4)
    status, raw = daemon.request("POST", "/embeddings", {"input": TEXTS[:2], "embd_normalize": -1})
    assert status == 200 and [e["index"] for e in raw] == [0, 1]
    _, legacy = daemon.request("POST", "/api/embeddings", {"model": "tiny", "prompt": TEXTS[0]})
    _close(raw[0]["embedding"][0], legacy["embedding"], 1e-5)  # -1: as it is
    v = torch.tensor(raw[0]["embedding"][0])
    for norm, check in ((0, lambda x: x.abs().max().item() - 32760), (1, lambda x: x.abs().sum().item() - 1),
                        (2, lambda x: x.norm().item() - 1), (3, lambda x: x.abs().pow(3).sum().item() - 1)):
        _, got = daemon.request("POST", "/embedding", {"content": TEXTS[0], "embd_normalize": norm})
        x = torch.tensor(got[0]["embedding"][0])
        assert abs(check(x)) < 1e-3 * (32760 if norm == 0 else 1)
        assert torch.nn.functional.cosine_similarity(x, v, dim=0).item() > 0.9999  # the same direction
    for body, needle in (({"content": 5}, "'content'"), ({"input": ""}, "'input'"),
                         ({"content": "x", "embd_normalize": "two"}, "'embd_normalize'"), ({}, "'input'")):
        status, err = daemon.request("POST", "/embedding", body)
        assert status == 400 and err["error"]["message"].startswith(needle), err
