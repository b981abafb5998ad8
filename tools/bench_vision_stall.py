#!/usr/bin/env python
"""How long an image holds other requests' tokens back: a text stream's largest gap between tokens while another
request's image runs through the tower, with the tower run a layer or so a model-thread turn (FLARED_TOWER_TURN_S
0.02, the default) against the whole tower in one turn (what flared did before), in one run.

A random-weight SmolVLM with SmolVLM-256M's tower (SigLIP-B/16 at 512 px, 12 layers of 768, pixel shuffle 4) and
a small Llama decoder is exported to a float32 core (images resized to a longest edge of 1024 px: 2 x 2 tiles of
512 px and the global tile) and served by ``flared run`` twice. Each time a greedy text request streams
``--tokens`` tokens; once it has streamed a quarter of them, a request with a ``--image-side`` px image is sent.
Reported: the text stream's largest gap between tokens while the image request runs, its median gap, and the
image request's time to its answer.

    .venv/bin/python tools/bench_vision_stall.py [--tokens 160] [--image-side 1024] [--repeats 2] [--json]

Prints a table; with --json, one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = ("<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
            "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
            "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
            "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
            "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


def build_core(work: Path) -> Path:
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration

    sys.path.insert(0, str(ROOT))
    from flared.core.export import ExportOptions, export_core

    hf = work / "hf"
    hf.mkdir()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog. Tell me a story."] * 50, trainer)
    special = ["<end_of_utterance>", "<image>", "<fake_token_around_image>", "<global-img>",
               *[f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]]
    tok.add_special_tokens([AddedToken(t, special=True) for t in special])
    tok.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<end_of_utterance>", "chat_template": TEMPLATE}))
    (hf / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "SmolVLMImageProcessor", "size": {"longest_edge": 1024}, "resample": 1,
        "max_image_size": {"longest_edge": 512}, "do_image_splitting": True, "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3, "rescale_factor": 1 / 255}))
    (hf / "processor_config.json").write_text(json.dumps({"image_seq_len": 64}))
    config = SmolVLMConfig(
        text_config=dict(model_type="llama", vocab_size=tok.get_vocab_size(), hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=8, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=4096, tie_word_embeddings=True),
        vision_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                           image_size=512, patch_size=16),
        scale_factor=4, image_token_id=tok.token_to_id("<image>"), tie_word_embeddings=True)
    torch.manual_seed(0)
    SmolVLMForConditionalGeneration(config).eval().save_pretrained(hf, safe_serialization=True)
    core = work / "core"
    export_core(hf, core, ExportOptions(concurrency=4, context_tokens=4096))
    return core


def serve(core: Path, work: Path, turn_s: str):
    port_file = work / f"port-{turn_s}"
    env = {**os.environ, "FLARED_TOWER_TURN_S": turn_s}
    proc = subprocess.Popen([sys.executable, "-m", "flared.cli.daemon", "run", str(core), "--port", "0",
                             "--port-file", str(port_file), "--no-dashboard", "--no-admin-socket", "--served-name", "x"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        if port_file.exists() and port_file.read_text().endswith("\n"):
            return proc, f"http://127.0.0.1:{int(port_file.read_text())}"
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the daemon did not start")


def post(base: str, body: dict):
    request = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    return urllib.request.urlopen(request, timeout=600)


def one_run(base: str, image_url: str, tokens: int) -> dict:
    stamps: list[float] = []
    image_done: dict = {}

    def ask_image():
        started = time.perf_counter()
        with post(base, {"model": "x", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": "What?"}]}]}) as r:
            r.read()
        image_done.update(seconds=time.perf_counter() - started, at=time.perf_counter())

    sender = threading.Thread(target=ask_image)
    with post(base, {"model": "x", "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                     "messages": [{"role": "user", "content": "Tell me a story."}]}) as r:
        for line in r:
            if line.startswith(b"data: {"):
                stamps.append(time.perf_counter())
                if len(stamps) == tokens // 4:
                    sent = time.perf_counter()
                    sender.start()
    sender.join()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    during = [b - a for a, b in zip(stamps, stamps[1:]) if sent <= b <= image_done["at"]]
    return {"max_gap_s": max(during or gaps), "median_gap_s": statistics.median(gaps),
            "image_s": image_done["seconds"], "tokens": len(stamps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--image-side", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import numpy as np
    from PIL import Image

    seeds = iter(range(1000))

    def image_url() -> str:
        """A new image each time: the server keeps recent images' tower rows (and prompts), which would skip
        the tower on a repeat."""
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(next(seeds)).integers(0, 256, (args.image_side, args.image_side, 3),
                                                                  dtype=np.uint8)).save(buf, "PNG")
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        core = build_core(work)
        results = {}
        for name, turn_s in (("a layer a turn (0.02 s)", "0.02"), ("whole tower a turn (before)", "1e9")):
            proc, base = serve(core, work, turn_s)
            try:
                one_run(base, image_url(), 16)  # warm up (first-call costs)
                runs = [one_run(base, image_url(), args.tokens) for _ in range(args.repeats)]
            finally:
                proc.kill()
                proc.wait()
            results[name] = {key: min(r[key] for r in runs) for key in ("max_gap_s", "median_gap_s", "image_s")}
    print(f"{'tower scheduling':<30} {'largest text gap s':>18} {'median gap s':>13} {'image answer s':>15}")
    for name, r in results.items():
        print(f"{name:<30} {r['max_gap_s']:>18.3f} {r['median_gap_s']:>13.4f} {r['image_s']:>15.2f}")
    print(f"image {args.image_side} px -> 5 tiles of 512 px (SmolVLM-256M's tower); best of {args.repeats}")
    if args.json:
        print(json.dumps({"results": results, "image_side": args.image_side, "tiles": 5, "repeats": args.repeats}))


if __name__ == "__main__":
    main()
