"""One-shot local generation on a core (``flarectl generate``).

Opens a core (validated and hash-checked), builds the model runner on the CPU,
renders chat messages with the core's template, generates, detokenizes. No
server, no scheduler: the daemon's model thread is the serving path; this is
the shortest honest path from a core to text.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from flared.core.load import Core, open_core
from flared.errors import AdmissionError, ErrorKind, ExecutionError, FrontendError


class OneShot:
    def __init__(self, core: Core, runner, tokenizer, template):
        self.core = core
        self.runner = runner
        self.tokenizer = tokenizer
        self.template = template  # flared.frontend.ChatTemplate or None

    @classmethod
    def open(cls, path: str | Path, *, max_batch: int = 8, quantization: str | None = None) -> "OneShot":
        """``quantization``: "q8_0" or "q4_1" keeps a bfloat16 core's products so, "gguf" each at about its bits in
        the GGUF file it was exported from (flared/model/quant.py)."""
        import torch
        from tokenizers import Tokenizer

        from flared.frontend import ChatTemplate
        from flared.model.quant import resolve_quantization
        from flared.model.runner import ModelRunner

        core = open_core(path)
        m = core.manifest
        try:
            kept = resolve_quantization(quantization, m.source, m.weights_quantization)  # (a stored core: as it is)
        except ValueError as e:
            raise ExecutionError(f"--quantization {quantization}: {e}", ErrorKind.VALIDATION) from None
        try:
            tokenizer = Tokenizer.from_file(str(core.tokenizer_path))
        except Exception as e:
            raise FrontendError(f"{core.tokenizer_path}: unreadable tokenizer: {e}", ErrorKind.TOKENIZER) from None
        source = core.chat_template()
        template = ChatTemplate(source) if source is not None else None
        try:
            runner = ModelRunner(core.config, core.load_tensors(), dtype=getattr(torch, m.dtype), device="cpu",
                                 num_pages=m.capacities.kv_pages, page_tokens=m.capacities.page_tokens,
                                 max_batch=min(max_batch, m.capacities.concurrency),
                                 prefill_chunk_tokens=m.capacities.prefill_chunk_tokens, quantization=kept)
        except ValueError as e:
            if quantization is None:
                raise
            raise ExecutionError(f"--quantization {quantization}: {e}", ErrorKind.VALIDATION) from None
        return cls(core, runner, tokenizer, template)

    def prompt_ids(self, *, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
        tokens = self.core.manifest.tokens
        if messages is not None:
            if self.template is None:
                raise AdmissionError(f"core {self.core.path} has no chat template; use a raw prompt",
                                     ErrorKind.UNSUPPORTED)
            text = self.template.render(messages, add_generation_prompt=True,
                                        bos_token=tokens.bos_token, eos_token=tokens.eos_token)
            # The template writes any BOS itself, as transformers' apply_chat_template assumes.
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        return self.tokenizer.encode(prompt or "", add_special_tokens=True).ids

    def generate(self, *, prompt: str | None = None, messages: list[dict] | None = None, max_tokens: int = 128,
                 temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                 seed: int | None = None) -> dict[str, Any]:
        from flared.model.sampling import SamplingParams

        m = self.core.manifest
        ids = self.prompt_ids(prompt=prompt, messages=messages)
        if not ids:
            raise AdmissionError("the prompt is empty", ErrorKind.VALIDATION)
        if len(ids) + max_tokens > m.capacities.context_tokens:
            raise AdmissionError(
                f"prompt of {len(ids)} tokens plus max_tokens {max_tokens} exceeds the context of "
                f"{m.capacities.context_tokens} tokens", ErrorKind.CONTEXT_LENGTH, hint=m.context_hint)
        d = m.generation_defaults
        params = SamplingParams(
            temperature=temperature if temperature is not None else 0.0,
            top_p=top_p if top_p is not None else (d.get("top_p", 1.0) if temperature else 1.0),
            top_k=top_k if top_k is not None else (d.get("top_k", 0) if temperature else 0),
            seed=seed, max_tokens=max_tokens)
        started = time.monotonic()
        result = self.runner.generate([ids], [params], stop_token_ids=frozenset(m.tokens.eos_token_ids))[0]
        total_s = time.monotonic() - started
        out = list(result.token_ids)
        visible = out[:-1] if result.finish_reason == "stop" and out and out[-1] in m.tokens.eos_token_ids else out
        text = self.tokenizer.decode(visible, skip_special_tokens=True)
        n = len(out)
        return {
            "text": text,
            "token_ids": out,
            "prompt_token_ids": ids,
            "finish_reason": result.finish_reason,
            "usage": {"prompt_tokens": len(ids), "completion_tokens": n},
            "timings": {
                "total_s": round(total_s, 4),
                "prefill_s": round(result.timings.prefill_s, 4),
                "decode_s": round(result.timings.decode_s, 4),
                "decode_tokens_per_s": round((n - 1) / result.timings.decode_s, 2)
                if n > 1 and result.timings.decode_s > 0 else None,
            },
        }
