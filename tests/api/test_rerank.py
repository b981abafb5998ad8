"""Reranking and vLLM's /v1/score against a daemon serving the embedded SmolLM2-135M (float32): each pair's
score is transformers' P(yes) / (P(yes) + P(no)) for the next token after the same judgment prompt, rendered by
transformers' own chat template from the same GGUF; and the routes' errors."""

from __future__ import annotations

import math

import pytest
import torch
from flared_testing.daemon import Daemon

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital and largest city of France.", "The mitochondria is the powerhouse of the cell.",
        "Berlin is the capital of Germany.", "France is a country in Europe; its capital is Paris."]


@pytest.fixture(scope="module")
def smol(default_core, tmp_path_factory):
    d = Daemon(default_core, tmp_path_factory.mktemp("rerank"), "--threads", "2")
    yield d
    d.kill()


@pytest.fixture(scope="module")
def reference(default_gguf):
    """(query, document, instruction) -> transformers' relevance for the pair."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flared.server.rerank import DEFAULT_INSTRUCTION, judgment_messages

    tok = AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    hf = AutoModelForCausalLM.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name,
                                              dtype=torch.float32).eval()
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")

    def score(query: str, document: str, instruction: str = DEFAULT_INSTRUCTION) -> float:
        text = tok.apply_chat_template(judgment_messages(instruction, query, document), add_generation_prompt=True,
                                       tokenize=False)
        ids = tok(text, add_special_tokens=False).input_ids
        with torch.no_grad():
            logits = hf(torch.tensor([list(ids)])).logits[0, -1]
        return 1 / (1 + math.exp(-(logits[yes] - logits[no]).item()))
    return score


def _post(daemon, path, body, status=200):
    got, out = daemon.request("POST", path, body)
    assert got == status, out
    return out


def test_rerank_scores_are_the_models_yes_no_judgment(smol, reference):
    want = [reference(QUERY, d) for d in DOCS]
    out = _post(smol, "/v1/rerank", {"model": "smollm2-135m-instruct", "query": QUERY,
                                     "documents": [DOCS[0], {"text": DOCS[1]}, *DOCS[2:]]})
    assert out["model"] == "smollm2-135m-instruct" and out["id"].startswith("rerank-")
    assert [r["index"] for r in out["results"]] == sorted(range(4), key=lambda i: -want[i])
    for r in out["results"]:
        assert abs(r["relevance_score"] - want[r["index"]]) < 1e-4
        assert r["document"] == {"text": DOCS[r["index"]]}
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] > 4 * 40
    # llama.cpp's route and name, top_n, no texts back, an instruction of the client's own
    top = _post(smol, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": False,
                                  "instruction": "Find facts about European capitals"})
    mine = [reference(QUERY, d, "Find facts about European capitals") for d in DOCS]
    assert [r["index"] for r in top["results"]] == sorted(range(4), key=lambda i: -mine[i])[:2]
    assert all(set(r) == {"index", "relevance_score"} for r in top["results"])
    assert abs(top["results"][0]["relevance_score"] - max(mine)) < 1e-4


def test_score_pairs_one_to_many_and_pairwise(smol, reference):
    one = _post(smol, "/v1/score", {"text_1": QUERY, "text_2": DOCS[:2]})
    assert [d["index"] for d in one["data"]] == [0, 1] and one["object"] == "list"
    for d, doc in zip(one["data"], DOCS[:2]):
        assert d["object"] == "score" and abs(d["score"] - reference(QUERY, doc)) < 1e-4
    pairs = _post(smol, "/score", {"text_1": [QUERY, "Who wrote Hamlet?"], "text_2": [DOCS[3], DOCS[1]]})
    assert abs(pairs["data"][1]["score"] - reference("Who wrote Hamlet?", DOCS[1])) < 1e-4
    single = _post(smol, "/v1/score", {"text_1": QUERY, "text_2": DOCS[3]})
    assert abs(single["data"][0]["score"] - pairs["data"][0]["score"]) < 1e-6


@pytest.mark.parametrize("path, body, needle", [
    ("/v1/rerank", {"documents": DOCS}, "'query': is required"),
    ("/v1/rerank", {"query": "", "documents": DOCS}, "'query': must be a non-empty string"),
    ("/v1/rerank", {"query": QUERY, "documents": []}, "'documents': must be a non-empty array"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a", 3]}, "documents[1] must be a string or an object"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 0}, "'top_n': must be between 1"),
    ("/v1/rerank", {"query": QUERY, "documents": ["word " * 3000]}, "model's context holds"),
    ("/v1/rerank", {"model": "other", "query": QUERY, "documents": DOCS}, "model 'other' does not exist"),
    ("/v1/score", {"text_1": [QUERY, QUERY], "text_2": DOCS}, "text_1 has 2 texts and text_2 has 4"),
    ("/v1/score", {"text_1": QUERY}, "'text_2': is required"),
])
def test_bad_requests_are_400s_and_the_daemon_keeps_serving(smol, path, body, needle):
    got, out = smol.request("POST", path, body)
    assert got in (400, 404) and needle in out["error"]["message"], out
    assert _post(smol, "/v1/score", {"text_1": QUERY, "text_2": DOCS[0]})["data"]


def test_a_vocabulary_without_single_yes_and_no_tokens_says_so(daemon, tool_hf_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tool_hf_dir / "tokenizer.json"))
    if all(len(tok.encode(w).ids) == 1 for w in ("yes", "no")):
        pytest.skip("the tool model's vocabulary spells both in one token")
    got, out = daemon.request("POST", "/v1/rerank", {"query": "q", "documents": ["d"]})
    assert got == 400 and "no single token for 'yes' and 'no'" in out["error"]["message"], out
