"""The daemon on a GPU, end to end: export a bf16 core, serve it, drive it over HTTP.

Run on a CUDA machine from the repository root after building the Cython
extensions:

    python3 setup.py -q build_ext --inplace && python3 tools/gpu_daemon_smoke.py [--quantization q4_1] [--json]

Builds a random-weight Llama of SmolLM2-135M's shape (with a byte-level BPE
tokenizer trained on the spot, so nothing is downloaded), exports it as a
bf16 core, starts `flared run` (which picks the CUDA graph executor), and
checks: greedy answers are repeatable, the prefix cache reuses a repeated
conversation, a streamed answer equals the non-streamed one, n concurrent
streams all finish, a request with a logit bias, penalties and logprobs (which the graphs shape and draw)
answers with its biased token and three logprobs a token and repeats itself under its seed, an Ollama request with
llama.cpp's window (repeat_last_n) answers; it reports single-stream and 32-stream output tok/s seen
by the clients (HTTP, SSE and detokenizing included), and exits the daemon
with SIGTERM (exit 0 expected). The figures are end-to-end serving numbers,
not the graph-only numbers of tools/bench_gpu.py.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_source(d: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"Sentence number {i} talks about the weather, rivers, cities and code." for i in range(2000)]
    trainer = trainers.BpeTrainer(vocab_size=2048, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": TEMPLATE}))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rope_theta=100000.0, tie_word_embeddings=True, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)


def post(port: int, path: str, body: dict, stream: bool = False):
    t0 = time.perf_counter()  # time to first token counts from the request, not the response head
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", path, body=json.dumps(body), headers={"content-type": "application/json"})
    resp = conn.getresponse()
    if not stream:
        data = json.loads(resp.read())
        conn.close()
        return resp.status, data
    text, n_chunks, first = [], 0, None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        for c in event.get("choices", []):
            piece = (c.get("delta") or {}).get("content") or c.get("text") or ""
            if piece:
                if first is None:
                    first = time.perf_counter() - t0
                text.append(piece)
                n_chunks += 1
    conn.close()
    return resp.status, "".join(text), n_chunks, first


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantization", default=None, help="serve with -q FORMAT (q4_1, q8_0: the layer matrices "
                    "kept quantised on the GPU)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="flared-gpu-smoke-"))
    src, core = tmp / "src", tmp / "core"
    src.mkdir()
    build_source(src)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    subprocess.run([sys.executable, "-m", "flared.cli.ctl", "export", str(src), "--out", str(core),
                    "--dtype", "bfloat16", "--concurrency", "32", "--context", "2048"], check=True, env=env)
    port_file = tmp / "port"
    log = open(tmp / "daemon.log", "wb")
    t_start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "flared.cli.daemon", "run", str(core), "--port", "0",
                             "--port-file", str(port_file), "--served-name", "m", "--no-dashboard",
                             "--no-admin-socket", *(["-q", args.quantization] if args.quantization else [])],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    results: dict = {}
    try:
        while not (port_file.exists() and port_file.read_text().endswith("\n")):
            if proc.poll() is not None:
                raise SystemExit(f"daemon exited {proc.returncode}:\n{(tmp / 'daemon.log').read_text()}")
            time.sleep(0.1)
        port = int(port_file.read_text())
        results["startup_s"] = round(time.perf_counter() - t_start, 1)
        msgs = [{"role": "user", "content": "Sentence number 7 talks about the weather"}]
        body = {"model": "m", "messages": msgs, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
        s1, a = post(port, "/v1/chat/completions", body)
        s2, b = post(port, "/v1/chat/completions", body)
        results["status"] = [s1, s2]
        results["greedy_repeatable"] = a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
        results["cached_tokens_second"] = b["usage"]["prompt_tokens_details"]["cached_tokens"]
        st, streamed, _, _ = post(port, "/v1/chat/completions", {**body, "stream": True}, stream=True)
        results["stream_equals"] = streamed == a["choices"][0]["message"]["content"]
        # Single stream.
        one = {"model": "m", "prompt": "Sentence number 3 talks about", "max_tokens": 256, "temperature": 0,
               "ignore_eos": True, "stream": True}
        post(port, "/v1/completions", {**one, "max_tokens": 8}, stream=True)  # warm the shape
        t = time.perf_counter()
        _, _, n, ttft = post(port, "/v1/completions", one, stream=True)
        dt = time.perf_counter() - t
        results["single_stream_tok_s"] = round(256 / dt, 1)
        results["single_stream_ttft_ms"] = round(ttft * 1000, 1)
        # 32 concurrent streams.
        def run(i):
            return post(port, "/v1/completions", {**one, "prompt": f"Sentence number {i} talks about",
                                                  "temperature": 1.0, "seed": i}, stream=True)
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            list(pool.map(run, range(32)))  # warm
            t = time.perf_counter()
            outs = list(pool.map(run, range(32)))
            dt = time.perf_counter() - t
        results["streams32_all_ok"] = all(o[0] == 200 for o in outs)
        results["streams32_tok_s"] = round(32 * 256 / dt, 1)
        # The model thread's eager jobs on the GPU: embeddings and a scored prompt (echo with logprobs).
        se, emb = post(port, "/v1/embeddings", {"model": "m", "input": ["The weather is sunny.", "Hello"],
                                                "encoding_format": "float"})
        norms = [sum(x * x for x in d["embedding"]) ** 0.5 for d in emb.get("data", [])] if se == 200 else []
        results["embeddings_ok"] = se == 200 and len(norms) == 2 and all(abs(n - 1) < 1e-3 for n in norms)
        ss, sc = post(port, "/v1/completions", {"model": "m", "prompt": "Sentence number 3 talks about",
                                                "echo": True, "logprobs": 1, "max_tokens": 0})
        lps = sc["choices"][0]["logprobs"]["token_logprobs"] if ss == 200 else []
        results["prompt_logprobs_ok"] = ss == 200 and len(lps) > 1 and lps[0] is None and all(
            v is not None and v <= 0 for v in lps[1:])
        # Sampling the graphs shape and draw (bias, penalties, llama.cpp's window) with logprobs beside them.
        shaped = {"model": "m", "messages": msgs, "max_tokens": 8, "temperature": 0.8, "seed": 5,
                  "ignore_eos": True, "logprobs": True, "top_logprobs": 3, "frequency_penalty": 0.5,
                  "presence_penalty": 0.5, "repetition_penalty": 1.2, "logit_bias": {"100": 100}}
        s3, c = post(port, "/v1/chat/completions", shaped)
        s4, d = post(port, "/v1/chat/completions", shaped)
        content = c["choices"][0]["logprobs"]["content"] if s3 == 200 else []
        results["bias_penalties_logprobs_ok"] = (
            s3 == s4 == 200 and len(content) == 8 and len({e["token"] for e in content}) == 1
            and all(len(e["top_logprobs"]) == 3 and e["logprob"] <= 0 for e in content)
            and c["choices"][0]["message"]["content"] == d["choices"][0]["message"]["content"])
        s5, o = post(port, "/api/generate", {"model": "m", "prompt": "Sentence number 5 talks about", "stream": False,
                                             "options": {"repeat_penalty": 1.3, "repeat_last_n": 8, "seed": 3,
                                                         "temperature": 0.7, "num_predict": 32}})
        results["ollama_repeat_last_n_ok"] = s5 == 200 and o.get("eval_count", 0) > 0
        # llama.cpp's /completion: its default chain with top-k, top-p and min-p, drawn in the graphs, seeded
        chain = {"prompt": "Sentence number 9 talks about", "n_predict": 32, "top_k": 40, "top_p": 0.9,
                 "min_p": 0.05, "temperature": 0.8, "seed": 9, "ignore_eos": True}
        s6, e = post(port, "/completion", chain)
        s7, f = post(port, "/completion", chain)
        results["llamacpp_chain_ok"] = (s6 == s7 == 200 and e.get("tokens_predicted") == 32
                                        and e.get("content") == f.get("content"))

        def run_chain(i):
            return post(port, "/completion", {**chain, "prompt": f"Sentence number {i} talks about", "seed": i,
                                              "n_predict": 256})
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            list(pool.map(run_chain, range(32)))  # warm
            t = time.perf_counter()
            outs = list(pool.map(run_chain, range(32)))
            dt = time.perf_counter() - t
        results["llamacpp_chain_streams32_tok_s"] = round(sum(o[1].get("tokens_predicted", 0) for o in outs) / dt, 1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            results["exit_code"] = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            results["exit_code"] = "killed"
        log.close()
        tail = (tmp / "daemon.log").read_text(errors="replace")[-3000:]
        results["executor"] = "cuda graphs" if "executor: CUDA graphs" in tail else "NOT cuda (see log)"
        print(tail)
    print("\n| check | value |\n| --- | --- |")
    for k, v in results.items():
        print(f"| {k} | {v} |")
    if args.json:
        print(json.dumps(results))
    ok = (results.get("greedy_repeatable") and results.get("stream_equals") and results.get("streams32_all_ok")
          and results.get("embeddings_ok") and results.get("prompt_logprobs_ok") and results.get("exit_code") == 0
          and results.get("bias_penalties_logprobs_ok") and results.get("ollama_repeat_last_n_ok")
          and results.get("llamacpp_chain_ok"))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
