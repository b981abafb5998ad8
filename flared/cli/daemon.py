"""`flared`: the serving daemon.

`flared run [CORE]` loads a core (the embedded default model when CORE is
omitted), starts the model thread, and serves HTTP until SIGTERM/SIGINT:
then it stops admission (new generation requests get 503), gives admitted
responses the grace period, cancels the rest, drains the model thread and
exits 0. An unexpected model-thread failure sends every client an error and
exits 1.

Operations: the admin socket (``--admin-socket``, default under the runtime
directory) serves flarectl; under systemd (``$NOTIFY_SOCKET``) startup stages
go out as STATUS=, READY=1 follows the bound listener, WATCHDOG=1 is sent
only while the model thread turns, STOPPING=1 starts shutdown; when stderr
is a terminal the dashboard draws after loading (``--no-dashboard``: plain
logs).

Only this layer reads the environment (FLARED_API_KEY, click's FLARED_*
auto variables, NOTIFY_SOCKET/WATCHDOG_USEC, JOURNAL_STREAM,
XDG_RUNTIME_DIR).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
from pathlib import Path

import click

from flared.cli.ctl import capacity_options
from flared.errors import FlareError

log = logging.getLogger("flared")


_quantization_option = click.option(
    "--quantization", "-q", type=click.Choice(["q8_0", "q4_1", "gguf", "none"], case_sensitive=False), default=None,
    help="Keep the weights quantised (a bfloat16 core; on the CPU executor faster decode, on a GPU the layers' "
         "matrices in a third of the memory, slower): q8_0 (int8 in blocks of "
         "32, 0.56x bf16's memory), q4_1 (4 bits in blocks of 32 with a step and offset, 0.31x; on a CPU the LM head "
         "as q8_0), gguf (a core exported from a GGUF file: each layer matrix at about the bits of its tensors there, "
         "5 to 8 bits (Q5_K, Q6_K, Q8_0) as q8_0, 4 and fewer as q4_1) or none (default: as the core is; a GGUF "
         "served directly on the CPU, as gguf; a quantised checkpoint directory served directly on the CPU: GPTQ, "
         "AWQ, compressed-tensors at 4 bits as q4_1, at 8 bits, fp8 and bitsandbytes as q8_0).")


def _quantization_override(quantization: str | None) -> dict:
    """--quantization as a ServerConfig override ("none": the core's weights as they are)."""
    if quantization is None:
        return {}
    return {"quantization": None if quantization.lower() == "none" else quantization.lower()}


def _lora_options(fn):
    """llama.cpp's --lora and --lora-scaled (each repeatable): PEFT adapters merged into the weights at load; vLLM's
    --lora-modules NAME=PATH: adapters served per request under their own model names."""
    fn = click.option("--lora-modules", "lora_modules", multiple=True, metavar="NAME=PATH",
                      help="A LoRA adapter served as model NAME, run for the requests that name it (repeatable; "
                           "CPU backend).")(fn)
    fn = click.option("--lora-scaled", "lora_scaled", type=(str, float), multiple=True, metavar="PATH SCALE",
                      help="A LoRA adapter merged at this scale (repeatable).")(fn)
    return click.option("--lora", "lora", multiple=True, metavar="PATH",
                        help="A LoRA adapter (a PEFT directory) merged into the weights at load (repeatable).")(fn)


def _lora_overrides(lora, lora_scaled, lora_modules) -> dict:
    from flared.config import ConfigError

    out = {}
    if lora or lora_scaled:
        out["lora_adapters"] = tuple((p, 1.0) for p in lora) + tuple((p, float(s)) for p, s in lora_scaled)
    if lora_modules:
        pairs = [m.partition("=") for m in lora_modules]
        bad = [m for m, (name, eq, path) in zip(lora_modules, pairs) if not (name and eq and path)]
        if bad:
            raise ConfigError(f"--lora-modules {bad[0]!r}: give NAME=PATH")
        out["lora_modules"] = tuple((name, path) for name, _, path in pairs)
    return out


@click.group(context_settings={"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "FLARED"})
@click.version_option(package_name="flared")
def main() -> None:
    """The flared LLM serving daemon."""


@main.command()
@click.argument("core", required=False)
@click.option("--model", "-m", "model_option", default=None,
              help="CORE as an option (vLLM's and llama.cpp's server's --model / -m).")
@click.option("--config", "config_path", type=click.Path(path_type=Path), default=None, help="TOML config file.")
@click.option("--host", default=None, help="Address to bind (default 127.0.0.1).")
@click.option("--port", type=int, default=None, help="Port to bind (default 8000; 0 = ephemeral).")
@click.option("--port-file", default=None, help="Write the bound port to this file once listening.")
@click.option("--api-key", default=None, envvar="FLARED_API_KEY", help="Bearer token clients must send.")
@click.option("--queue-capacity", type=int, default=None, help="Requests that may wait beyond max-active.")
@click.option("--max-active", type=int, default=None, help="Requests admitted at once (default: the core's concurrency).")
@click.option("--frontend-workers", type=int, default=None, help="Template/tokenizer worker threads (default 2).")
@click.option("--served-name", "--alias", "-a", "served_names", multiple=True,
              help="Extra model name clients may use (repeatable; llama.cpp's --alias).")
@click.option("--served-model-name", "served_model_names", multiple=True,
              help="The model's name in place of the core's, as vLLM's flag: the /v1/models card's id (repeated: "
                   "the first; the rest as --served-name); the core's own names stay usable.")
@click.option("--no-prefix-cache", is_flag=True, default=False, help="Disable prefix reuse.")
@click.option("--threads", "-t", "torch_threads", type=int, default=None, help="CPU threads for the model.")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None,
              help="Where exported cores are cached (the default model's, and those of a GGUF file or checkpoint "
                   "served directly).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True,
              help="The embedded default model, or a GGUF file or checkpoint served directly: the dtype to export it "
                   "in (auto: bfloat16 on a GPU or a CPU with native bfloat16, else float32).")
@click.option("--tool-call-parser", "tool_parser", default=None,
              help="The tool-call format to read from the model's output (the config's tool_parser: hermes, "
                   "qwen3_coder, llama3_json, mistral, pythonic, harmony, ..., vLLM's names too; none; default auto: "
                   "from the chat template's markers).")
@click.option("--reasoning-parser", "reasoning_parser", default=None,
              help="The reasoning format to split from the answer (the config's reasoning_parser: think, mistral, "
                   "seed, harmony, ..., vLLM's names too such as deepseek_r1 or qwen3; none; default auto).")
@click.option("--reasoning-format", "reasoning_format", type=click.Choice(["auto", "none", "deepseek",
                                                                            "deepseek-legacy"]), default=None,
              help="llama.cpp's server's flag: none leaves the reasoning in the content (--reasoning-parser none), "
                   "deepseek splits <think> blocks out (think); auto (default): from the chat template.")
@click.option("--enable-auto-tool-choice", is_flag=True, default=False,
              help="Accepted for vLLM command lines: flared always lets the model call tools (tool_choice auto) "
                   "where a tool-call format is known.")
@click.option("--jinja", is_flag=True, default=False,
              help="Accepted for llama.cpp's server's command lines: flared always renders Jinja chat templates.")
@capacity_options
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default=None)
@click.option("--log-format", type=click.Choice(["auto", "plain", "journal"]), default=None,
              help="auto: journald format when stderr is the journal.")
@click.option("--api-key-file", default=None, help="File holding the bearer token.")
@click.option("--admin-socket", default=None,
              help="Admin Unix socket for flarectl (default $XDG_RUNTIME_DIR/flared/admin.sock).")
@click.option("--no-admin-socket", is_flag=True, default=False, help="Serve no admin socket.")
@click.option("--no-dashboard", is_flag=True, default=False, help="Plain logs even on a terminal.")
@click.option("--chat-template", default=None,
              help="Serve this chat template instead of the core's: a Jinja file, or the template text itself.")
@click.option("--allowed-origins", default=None,
              help="Browser origins that get CORS headers, comma-separated (e.g. https://app.example); '*': any.")
@click.option("--ssl-certfile", default=None, help="Serve HTTPS with this PEM certificate chain (and --ssl-keyfile).")
@click.option("--ssl-keyfile", default=None, help="The private key of --ssl-certfile (PEM).")
@click.option("--no-webui", is_flag=True, default=False, help="Serve no chat page at / (it is served by default).")
@_lora_options
@click.option("--allow-runtime-lora-updating", is_flag=True, default=False,
              help="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (adapters added while serving).")
@click.option("--max-loras", type=int, default=None,
              help="With --allow-runtime-lora-updating on a GPU: adapters the CUDA graphs hold at once "
                   "(default 4).")
@click.option("--max-lora-rank", type=int, default=None,
              help="With --allow-runtime-lora-updating on a GPU: the largest adapter rank loaded while serving "
                   "(default 16).")
@click.option("--max-cpu-loras", type=int, default=None,
              help="With --allow-runtime-lora-updating on a GPU: adapters that may be loaded at once, their factors "
                   "in host memory, swapped into the --max-loras slots as requests need them (default: max-loras).")
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8", "fp8_e4m3"]), default=None,
              help="KV cache element type: auto (the model's) or fp8 (float8 e4m3: twice the cached tokens in the "
                   "same memory, half the bytes each decode step reads; default auto).")
@_quantization_option
@click.option("--enforce-eager", is_flag=True, default=None,
              help="On a GPU, serve with torch's eager forward instead of CUDA graphs (vLLM's flag; slower).")
@click.option("--mmproj", "-mm", "mmproj", type=click.Path(exists=True, dir_okay=False), default=None,
              help="With a GGUF model: its image tower or audio encoder, llama.cpp's mmproj file (llama-server's "
                   "flag; SmolVLM, Mistral Small 3.1, Pixtral 12B, Gemma 3, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, InternVL; "
                   "Qwen2-Audio, Audio Flamingo 3), so that the model takes images or audio.")
@click.option("--speculative-tokens", "--draft-max", "speculative_tokens", type=int, default=None,
              help="Speculative decoding: up to N draft tokens a step, copied from earlier in a request's prompt and "
                   "output (prompt lookup), or drafted by --speculative-model (default 0: off; 4 with a draft "
                   "model).")
@click.option("--speculative-model", "--model-draft", "-md", "speculative_model", default=None,
              help="Draft model for speculative decoding (vLLM's --speculative-model, llama.cpp's --model-draft): a "
                   "core, GGUF file or checkpoint directory with the served model's vocabulary, whose greedy "
                   "continuation of each request the served model verifies.")
@click.option("--ctx-size-draft", "-cd", "draft_kv_tokens", type=int, default=None,
              help="With --speculative-model: the tokens its KV cache holds in all (llama.cpp's flag; default: as "
                   "many as the served model's, at most every live request's whole context).")
@click.option("--draft-p-min", type=float, default=None,
              help="With --speculative-model: stop drafting at a token the draft model gives less than this "
                   "probability (llama.cpp's flag; default 0: drafts to the cap, which adapts to what is kept).")
@click.option("--prompt-lookup-max", type=int, default=None, help="Longest n-gram prompt lookup matches (default 4).")
@click.option("--prompt-lookup-min", type=int, default=None, help="Shortest n-gram prompt lookup matches (default 2).")
@click.option("--allowed-media-domains", default=None,
              help="Fetch image URLs only from these hosts, comma-separated (default: any host).")
@click.option("--allowed-local-media-path", default=None,
              help="Read file:// image URLs under this directory (default: refused).")
@click.option("--no-media-fetch", is_flag=True, default=False,
              help="Refuse http(s) image URLs (images then come as base64 data URLs only).")
@click.option("--limit-mm-per-prompt", default=None,
              help="Images a request may carry: image=N or vLLM's JSON {\"image\": N} (default 8).")
@click.option("--debug-fail-after-steps", type=int, default=None, hidden=True,
              help="Fault injection for tests: the model thread fails after N steps.")
def run(core, model_option, config_path, host, port, port_file, api_key, queue_capacity, max_active, frontend_workers,
        served_names, served_model_names, no_prefix_cache, torch_threads, cache_dir, dtype, log_level, log_format,
        api_key_file,
        admin_socket, no_admin_socket, no_dashboard, chat_template, allowed_origins, ssl_certfile, ssl_keyfile,
        no_webui, lora, lora_scaled, lora_modules, allow_runtime_lora_updating, max_loras, max_lora_rank,
        max_cpu_loras, kv_cache_dtype, quantization, enforce_eager, mmproj,
        speculative_tokens, speculative_model, draft_kv_tokens, draft_p_min, prompt_lookup_max, prompt_lookup_min,
        allowed_media_domains, allowed_local_media_path,
        no_media_fetch, limit_mm_per_prompt, debug_fail_after_steps, context, concurrency, kv_cache_mib, prefill_chunk,
        tool_parser, reasoning_parser, reasoning_format, enable_auto_tool_choice, jinja):
    """Serve CORE: a core directory, a GGUF file or a Hugging Face checkpoint directory (exported once into the
    cache), or, omitted, the embedded default model."""
    from flared.config import ConfigError, ServerConfig

    try:
        if model_option is not None:
            if core is not None and core != model_option:
                raise ConfigError(f"CORE {core!r} and --model {model_option!r} name different models: give one")
            core = model_option
        if reasoning_format is not None:
            if reasoning_parser is not None:
                raise ConfigError("give --reasoning-parser or llama.cpp's --reasoning-format, not both")
            reasoning_parser = {"none": "none", "auto": "auto"}.get(reasoning_format, "think")
        config = ServerConfig.from_toml(config_path) if config_path else ServerConfig()
        overrides = {k: v for k, v in dict(
            host=host, port=port, port_file=port_file, api_key=api_key, queue_capacity=queue_capacity,
            max_active=max_active, frontend_workers=frontend_workers, torch_threads=torch_threads,
            log_level=log_level, log_format=log_format, admin_socket=admin_socket,
            chat_template=chat_template, ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile,
            speculative_tokens=speculative_tokens, prompt_lookup_max=prompt_lookup_max,
            prompt_lookup_min=prompt_lookup_min, draft_p_min=draft_p_min, draft_kv_tokens=draft_kv_tokens,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
            kv_cache_dtype=kv_cache_dtype, enforce_eager=enforce_eager, tool_parser=tool_parser,
            reasoning_parser=reasoning_parser).items() if v is not None}
        overrides.update(_quantization_override(quantization))
        if served_names or served_model_names[1:]:
            overrides["served_names"] = (*served_model_names[1:], *served_names)
        if served_model_names:
            overrides["served_model_name"] = served_model_names[0]
        if allowed_origins is not None:
            overrides["cors_allow_origins"] = tuple(o.strip() for o in allowed_origins.split(",") if o.strip())
        if no_prefix_cache:
            overrides["prefix_cache"] = False
        if no_webui:
            overrides["web_ui"] = False
        if allow_runtime_lora_updating:
            overrides["runtime_lora_updating"] = True
        if allowed_media_domains is not None:
            overrides["allowed_media_domains"] = tuple(
                d.strip().lower() for d in allowed_media_domains.split(",") if d.strip())
        if allowed_local_media_path is not None:
            overrides["allowed_local_media_path"] = allowed_local_media_path
        if no_media_fetch:
            overrides["media_fetch"] = False
        if limit_mm_per_prompt is not None:
            overrides["max_images_per_request"] = _image_limit(limit_mm_per_prompt)
        overrides.update(_lora_overrides(lora, lora_scaled, lora_modules))
        if api_key_file is not None:
            overrides.update(api_key_file=api_key_file, api_key=None)
        elif api_key is not None:
            overrides["api_key_file"] = None
        admin_default = False
        if no_admin_socket:
            overrides["admin_socket"] = None
        elif admin_socket is None and config.admin_socket is None:
            from flared.server.admin import default_admin_socket

            overrides["admin_socket"] = str(default_admin_socket())
            admin_default = True
        config = dataclasses.replace(config, **overrides).with_secrets()
    except FlareError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    configure_logging(config.log_level, config.log_format)
    dashboard = not no_dashboard and sys.stderr.isatty()
    try:
        capacities = dict(context=context, concurrency=concurrency, kv_cache_mib=kv_cache_mib,
                          prefill_chunk=prefill_chunk)
        core_path, config = _serving_core(core, cache_dir, dtype, capacities, config, quantization, mmproj)
        draft = speculative_model or config.speculative_model
        if draft is not None:  # (a GGUF or checkpoint exported once into the cache, as CORE is)
            config = dataclasses.replace(config, speculative_model=str(_draft_core_path(draft, cache_dir, dtype)))
        code = serve(core_path, config, fail_after_steps=debug_fail_after_steps, dashboard=dashboard,
                     admin_default=admin_default)
    except FlareError as e:
        log.error("%s", e)
        sys.exit(1)
    except OSError as e:
        # A listener or admin socket that cannot be bound: say which, no traceback.
        log.error("cannot start: %s", e)
        sys.exit(1)
    sys.exit(code)


def _image_limit(text: str) -> int:
    """--limit-mm-per-prompt: "image=N" or vLLM's JSON {"image": N} (other modalities are not served)."""
    import json

    from flared.config import ConfigError

    try:
        value = json.loads(text) if text.strip().startswith("{") else dict(
            (k.strip(), int(v)) for k, v in (item.split("=", 1) for item in text.split(",") if item.strip()))
    except (ValueError, TypeError):
        raise ConfigError(f"--limit-mm-per-prompt: {text!r} is neither image=N nor a JSON object") from None
    if not isinstance(value, dict) or set(value) - {"image"} or not isinstance(value.get("image", 8), int):
        raise ConfigError(f"--limit-mm-per-prompt: {text!r} must give an integer for image (the one modality served)")
    return value.get("image", 8)


def _serving_core(core: str | None, cache_dir: Path | None, dtype: str, capacities: dict, config,
                  quantization: str | None, mmproj: str | None = None):
    """CORE's core (``_core_path``) and the config to serve it with: a GGUF file or checkpoint served directly is
    also known by the path given (as vLLM and llama.cpp's server name it), and on the CPU a GGUF's or a quantised
    checkpoint's layer matrices stay at about their bits, as llama.cpp's server keeps a GGUF's (--quantization gguf:
    a Q4_K_M file's Q4_K matrices as q4_1, its Q6_K ones as q8_0; a GPTQ, AWQ, compressed-tensors, fp8 or
    bitsandbytes directory's: integer 4-bit ones as q4_1, the rest as q8_0, sources.checkpoint_quantization):
    its cached core stores them so (flarectl export --quantization), where neither -q nor the config says
    otherwise and the core is bfloat16 (the kernels' input; a CPU without them exports float32). On a GPU the
    graphs take bf16 weights: nothing changes. ``mmproj``: a GGUF's image tower (llama.cpp's file), in its core."""
    from flared.core.sources import kept_quantization, served_source_name

    fmt, words = None, ""
    if quantization is None and config.quantization is None and dtype in ("auto", "bfloat16"):
        fmt, words = kept_quantization(core)
    core_path = _core_path(core, cache_dir, dtype, capacities, stored=fmt, mmproj=mmproj)
    if fmt is not None:
        log.info("%s holds its layers' weights as %s: each served at about its bits on the CPU (-q %s; -q none: "
                 "bfloat16), its cached core storing them so", core, words, fmt)
    if served_source_name(core):
        config = dataclasses.replace(config, served_names=(*config.served_names, *served_source_name(core)))
    return core_path, config


def _draft_core_path(draft: str, cache_dir: Path | None, dtype: str) -> Path:
    """--speculative-model's core: as CORE's (_core_path), a quantised GGUF's or checkpoint's layer matrices stored at
    about their bits, as the CPU serves them."""
    from flared.core.sources import kept_quantization

    fmt = kept_quantization(draft)[0] if dtype in ("auto", "bfloat16") else None
    return _core_path(draft, cache_dir, dtype, stored=fmt)


def _core_path(core: str | None, cache_dir: Path | None, dtype: str, capacities: dict | None = None,
               stored: str | None = None, mmproj: str | None = None) -> Path:
    """CORE as given; the embedded default model's core where it is omitted, or a GGUF file's or a Hugging Face
    checkpoint directory's (flared/core/sources.py), each exported once into the cache in ``dtype`` (a source's
    layer matrices stored quantised where ``stored`` names a quantization)."""
    from flared.cli.ctl import resolve_core

    if core is not None and dtype != "auto":
        from flared.core.sources import source_kind

        if source_kind(core) is None:
            log.warning("--dtype applies to the embedded default model and to a GGUF or checkpoint served directly; "
                        "%s keeps the dtype it was exported in", core)
    from flared.cli.notify import Notifier

    notifier = Notifier()

    def progress(text: str) -> None:  # (under systemd: its status line, and more time to start)
        notifier.status(text, extend_timeout_s=STARTUP_STAGE_EXTEND_S)

    try:
        return Path(resolve_core(core or "default", cache_dir, dtype, progress, capacities, stored=stored,
                                 mmproj=mmproj))
    finally:
        notifier.close()


@main.command("run-batch")
@click.argument("core", required=False)
@click.option("-i", "--input", "input_path", required=True,
              help="JSONL file of requests, one {custom_id, method: POST, url, body} a line ('-': stdin).")
@click.option("-o", "--output", "output_path", required=True,
              help="Where the results go, one a line in input order ('-': stdout).")
@click.option("--config", "config_path", type=click.Path(path_type=Path), default=None, help="TOML config file.")
@click.option("--max-active", type=int, default=None, help="Requests run at once (default: the core's concurrency).")
@click.option("--served-name", "served_names", multiple=True, help="Extra model name the lines may use.")
@click.option("--chat-template", default=None,
              help="Use this chat template instead of the core's: a Jinja file, or the template text itself.")
@click.option("--threads", "torch_threads", type=int, default=None, help="CPU threads for the model.")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None,
              help="Where exported cores are cached (the default model's, and those of a GGUF file or checkpoint "
                   "served directly).")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto", show_default=True,
              help="The embedded default model, or a GGUF file or checkpoint given directly: the dtype to export it "
                   "in.")
@capacity_options
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="warning",
              show_default=True)
@_lora_options
@_quantization_option
@click.option("--mmproj", "-mm", "mmproj", type=click.Path(exists=True, dir_okay=False), default=None,
              help="With a GGUF model: its image tower, llama.cpp's mmproj file (as `flared run` takes it).")
def run_batch(core, input_path, output_path, config_path, max_active, served_names, chat_template, torch_threads,
              cache_dir, dtype, context, concurrency, kv_cache_mib, prefill_chunk, log_level, lora, lora_scaled,
              lora_modules,
              quantization, mmproj):
    """Run a file of OpenAI-style requests through CORE offline (as vLLM's run-batch) and write the results. CORE
    is as `flared run` takes it.

    Each line's url is /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses, /v1/rerank,
    /v1/score or /v1/messages; each result line is {id, custom_id, response: {status_code, request_id, body},
    error}. A file that is not such lines runs nothing and exits 1, naming each bad line."""
    from flared.config import ServerConfig

    try:
        config = ServerConfig.from_toml(config_path) if config_path else ServerConfig()
        overrides = {k: v for k, v in dict(max_active=max_active, torch_threads=torch_threads,
                                           chat_template=chat_template).items() if v is not None}
        if served_names:
            overrides["served_names"] = tuple(served_names)
        overrides.update(_lora_overrides(lora, lora_scaled, lora_modules))
        overrides.update(_quantization_override(quantization))
        # serve nothing outside: an ephemeral loopback port, no admin socket, no port file
        config = dataclasses.replace(config, host="127.0.0.1", port=0, port_file=None, admin_socket=None,
                                     api_key=None, api_key_file=None, log_level=log_level, **overrides)
    except FlareError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    configure_logging(config.log_level, "plain")
    try:
        data = sys.stdin.buffer.read() if input_path == "-" else Path(input_path).read_bytes()
    except OSError as e:
        click.echo(f"error: cannot read {input_path}: {e}", err=True)
        sys.exit(2)
    try:
        from flared.runtime.session import LoadedSession

        capacities = dict(context=context, concurrency=concurrency, kv_cache_mib=kv_cache_mib,
                          prefill_chunk=prefill_chunk)
        core_path, config = _serving_core(core, cache_dir, dtype, capacities, config, quantization, mmproj)
        session = LoadedSession.load(core_path, config)
        code = asyncio.run(_run_batch_async(session, data, output_path))
    except FlareError as e:
        log.error("%s", e)
        sys.exit(1)
    sys.exit(code)


async def _run_batch_async(session, data: bytes, output_path: str) -> int:
    from flared.server.batch_routes import jsonl, run_offline

    serving = await session.start()
    try:
        def report(done: int, total: int) -> None:
            click.echo(f"run-batch: {done}/{total} requests done", err=True)

        rows, errors = await run_offline(serving.state.batches, data, report=report)
    finally:
        await serving.close(0.0)
    if errors is not None:
        for e in errors:
            click.echo(f"error: line {e['line']}: {e['message']} ({e['code']})", err=True)
        return 1
    out = jsonl(rows)
    if output_path == "-":
        sys.stdout.buffer.write(out)
        sys.stdout.flush()
    else:
        Path(output_path).write_bytes(out)
    ok = sum(1 for r in rows if r["response"] is not None and 200 <= r["response"]["status_code"] < 300)
    click.echo(f"run-batch: {len(rows)} requests, {ok} answered 2xx, {len(rows) - ok} not; results in "
               f"{output_path}", err=True)
    return 0


# Each startup stage asks systemd for this much more time (EXTEND_TIMEOUT_USEC),
# so a long weight load or graph capture is not killed by TimeoutStartSec.
STARTUP_STAGE_EXTEND_S = 300.0


def configure_logging(level: str, fmt: str, env: dict | None = None) -> None:
    """Plain timestamped lines, or journald's ``<priority>`` prefix (the journal
    adds its own timestamp) when stderr is the journal. Log records never
    carry prompt text: the request path logs ids and counts only."""
    env = os.environ if env is None else env
    journal = fmt == "journal" or (fmt == "auto" and _stderr_is_journal(env))
    handler = logging.StreamHandler(sys.stderr)
    if journal:
        handler.setFormatter(_JournalFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())


def _stderr_is_journal(env) -> bool:
    # $JOURNAL_STREAM is "device:inode" of the journal's stream; it is
    # inherited, so compare with what stderr really is now.
    value = env.get("JOURNAL_STREAM")
    if not value:
        return False
    try:
        dev, ino = (int(x) for x in value.split(":"))
        st = os.fstat(sys.stderr.fileno())
    except (ValueError, OSError):
        return False
    return st.st_dev == dev and st.st_ino == ino


class _JournalFormatter(logging.Formatter):
    _PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}

    def format(self, record: logging.LogRecord) -> str:
        prio = self._PRIORITY.get(record.levelno, 6)
        return "\n".join(f"<{prio}>{line}" for line in super().format(record).splitlines())


def serve(core_path: Path, config, *, fail_after_steps: int | None = None, dashboard: bool = False,
          admin_default: bool = False) -> int:
    """Load, serve until a signal or a model-thread failure; return the exit code."""
    from flared.cli.notify import Notifier
    from flared.runtime.session import LoadedSession, StartupProgress

    notifier = Notifier()
    progress = StartupProgress()
    progress.subscribe(lambda s: notifier.status(f"{s.stage}: {s.detail}" if s.detail else s.stage,
                                                 extend_timeout_s=STARTUP_STAGE_EXTEND_S))
    progress.subscribe(lambda s: log.info("startup: %s%s", s.stage, f" ({s.detail})" if s.detail else ""))
    try:
        session = LoadedSession.load(core_path, config, fail_after_steps=fail_after_steps, progress=progress)
        try:
            import uvloop

            runner = uvloop.run
        except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
            runner = asyncio.run
        return runner(_serve_async(session, notifier, dashboard=dashboard, admin_default=admin_default))
    finally:
        notifier.close()


async def _serve_async(session, notifier, *, dashboard: bool = False, admin_default: bool = False) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    admin_path = session.config.admin_socket
    if admin_default:
        # The default admin socket is best effort: another daemon may hold it
        # (tests, a second instance); an explicit path is required to work.
        session.config = dataclasses.replace(session.config, admin_socket=None)
    serving = await session.start()
    if admin_default and admin_path:
        try:
            await serving.start_admin(admin_path)
        except OSError as e:
            log.warning("no admin socket: %s", e)
    host, port = serving.address
    scheme = "https" if session.config.ssl_certfile else "http"
    log.info("listening on %s://%s:%d (model %s)", scheme, host, port, session.manifest.model_name)
    if serving.admin_path:
        log.info("admin socket %s", serving.admin_path)
    if session.config.port_file:
        _write_atomic(session.config.port_file, f"{port}\n")
    notifier.ready(f"serving {session.manifest.model_name} on {host}:{port}")
    watchdog = asyncio.ensure_future(_feed_watchdog(serving, notifier)) if notifier.watchdog_usec else None
    board = None
    if dashboard:
        from flared.dashboard.app import InProcessDashboard
        from flared.dashboard.telemetry import TelemetryFeed

        board = InProcessDashboard(TelemetryFeed(session.runtime, serving.snapshot))
        board.start()
    failed = asyncio.ensure_future(serving.wait_failed())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({failed, stopped}, return_when=asyncio.FIRST_COMPLETED)
    crashed = failed.done() and failed.result() is not None
    for t in (failed, stopped):
        t.cancel()
    if board is not None:
        await loop.run_in_executor(None, board.stop)
    if watchdog is not None:
        watchdog.cancel()
    notifier.stopping("model thread failed" if crashed else "draining")
    if crashed:
        log.error("model thread failed: %s", serving.failure)
    else:
        log.info("shutting down: admission stopped, %.1fs grace for active responses",
                 session.config.shutdown_grace_s)
    await serving.close(grace_s=0.5 if crashed else session.config.shutdown_grace_s)
    return 1 if crashed else 0


async def _feed_watchdog(serving, notifier) -> None:
    """WATCHDOG=1 at half the interval, only while the model thread turns.

    The thread beats at least every IDLE_WAIT_S even when idle, so a beat
    older than the watchdog interval means a wedged step: we stay silent and
    systemd restarts us (Restart=on-failure)."""
    interval_s = notifier.watchdog_usec / 1e6
    runtime = serving.loaded.runtime
    while True:
        ok, _ = runtime.health()
        if ok and runtime.beat_age_s() < max(interval_s, 1.0):
            notifier.watchdog()
        await asyncio.sleep(interval_s / 2)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
