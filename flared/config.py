"""Server configuration: one frozen dataclass, validated on construction.

``ServerConfig.from_toml(path)`` reads a TOML file whose keys are the field
names below (top level or under ``[server]``), plus a ``[policy]`` table whose
keys are ``flared.scheduler.PolicyConfig`` fields; an unknown key or a value
of the wrong type or range is an error naming the key (``policy.<key>`` for
the policy table). systemd/flared.toml is a complete example. CLI flags override file
values (the CLI builds the final object with ``dataclasses.replace``). Only
the CLI reads the environment.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from pathlib import Path
from typing import Any

from flared.errors import AdmissionError, ErrorKind
from flared.scheduler.config import PolicyConfig

# --draft-p-min's default (llama.cpp's now; 0.75 before): a draft model's token under this probability ends its
# drafts. 0: none is cut (the scheduler's per-request caps and pricing weigh what drafts are kept).
DRAFT_P_MIN = 0.0
# speculative_tokens where a speculative_model is given without it
DRAFT_TOKENS = 4


class ConfigError(AdmissionError):
    """A configuration file or flag is wrong; the message names the key."""


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    # Listener. port 0 asks the kernel for an ephemeral port (logged, and
    # written to port_file when set).
    host: str = "127.0.0.1"
    port: int = 8000
    port_file: str | None = None
    # Bearer token required on every route but /health, /ping, /metrics and the chat page; or a
    # file holding it (read at load, so the token stays out of the config
    # and the process list). At most one of the two.
    api_key: str | None = None
    api_key_file: str | None = None
    # Admin Unix socket (flarectl); None: no admin socket. Mode 0600, or
    # 0660 with admin_socket_group as its group (operators in that group).
    admin_socket: str | None = None
    admin_socket_group: str | None = None
    # HTTP admission: at most queue_capacity + max_active requests are held
    # (queued for preparation or the model, or streaming) before a body is
    # read; more get 429. None: derived from the core (4x and 1x its
    # concurrency, as the reference's export does).
    queue_capacity: int | None = None
    max_active: int | None = None
    # Threads that render templates and tokenize, one request each at a time.
    frontend_workers: int = 2
    # Largest request body; None: 1 MiB plus 32 bytes per context token.
    body_limit_bytes: int | None = None
    header_timeout_s: float = 10.0
    keep_alive_timeout_s: float = 5.0
    max_connections: int = 1024
    # Shutdown: admitted responses get this long to finish before the rest
    # are cancelled.
    shutdown_grace_s: float = 5.0
    # Names clients may use for the model, in addition to the core's own.
    served_names: tuple[str, ...] = ()
    # The model's name in place of the core's (vLLM's --served-model-name): the /v1/models card's id; the core's
    # own names stay usable. None: the core's.
    served_model_name: str | None = None
    # Prefix cache on/off (off is for comparisons and debugging).
    prefix_cache: bool = True
    # CPU threads torch may use for the model (None: torch's default).
    torch_threads: int | None = None
    log_level: str = "info"
    # "auto": journald's format when $JOURNAL_STREAM says stderr is the
    # journal, else plain timestamped lines; "plain" or "journal" to force.
    log_format: str = "auto"
    # Tool-call parser family (hermes, qwen3_coder, llama3_json, mistral, deepseek, functionary) and
    # reasoning parser (think, mistral); "auto" picks them from the chat template, "none" turns parsing off.
    tool_parser: str = "auto"
    reasoning_parser: str = "auto"
    # Embeddings (/v1/embeddings, /api/embed): the final-normed hidden state of each input's last token
    # ("last", as embedding models built on decoders pool) or the mean over its tokens ("mean").
    embedding_pooling: str = "last"
    # vLLM's per-request chat_template: a request may bring its own Jinja chat template (rendered in the same
    # sandbox as the model's). Off by default, as vLLM's --trust-request-chat-template: a 400 names this key.
    trust_request_chat_template: bool = False
    # The chat template to serve instead of the core's own (vLLM's --chat-template, llama.cpp's
    # --chat-template-file): a path to a Jinja file, or the template text itself where it is no file's path.
    chat_template: str | None = None
    # Browser origins that get CORS headers (vLLM's --allowed-origins); "*" for any; empty: no CORS headers.
    cors_allow_origins: tuple[str, ...] = ()
    # HTTPS (vLLM's --ssl-certfile / --ssl-keyfile): the certificate chain and its private key, PEM files; both or
    # neither. The admin socket stays plain (a local Unix socket).
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    # The chat page at / (as llama.cpp's server serves its web UI); false: / is a 404.
    web_ui: bool = True
    # LoRA adapters (PEFT directories) merged into the weights at load, in order, as llama.cpp's --lora and
    # --lora-scaled: each (path, scale). In TOML a list of paths or [path, scale] pairs.
    lora_adapters: tuple[tuple[str, float], ...] = ()
    # Per-request LoRA adapters (vLLM's --lora-modules): each (name, path) is served as a model of that name,
    # run beside the base weights for the requests that name it (CPU and CUDA backends). In TOML a table name = path.
    lora_modules: tuple[tuple[str, str], ...] = ()
    # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: POST /v1/load_lora_adapter and /v1/unload_lora_adapter add and remove
    # per-request adapters while serving (a client then names files this server reads); off: those routes are 400.
    runtime_lora_updating: bool = False
    # With runtime_lora_updating on the CUDA graph executor (vLLM's --max-loras / --max-lora-rank): the graphs are
    # captured with room for this many per-request adapters at once (--lora-modules included), each of rank up
    # to max_lora_rank. The room is GPU memory whether used or not (docs/gpu.md). The CPU backend has no such limit.
    max_loras: int = 4
    max_lora_rank: int = 16
    # vLLM's --max-cpu-loras: with runtime_lora_updating on the CUDA graph executor, up to this many adapters may be
    # loaded (their factors kept in host memory), more than the max_loras the graphs hold: a request naming one that
    # holds no slot brings it in, in place of the adapter least recently asked for that no running request uses
    # (it waits, and the requests behind it go on, while every slot is in use). None: max_loras (no swapping).
    max_cpu_loras: int | None = None
    # vLLM's --kv-cache-dtype: "auto" keeps the KV cache in the model's dtype; "fp8" (or "fp8_e4m3") stores keys and
    # values as float8 e4m3: the core's KV memory holds twice a bf16 core's pages, and a decode step reads half the
    # bytes of bf16, at a precision of 3 mantissa bits, no scale (values past +-448 saturate). GPUs of compute
    # capability 8.9+ and the CPU backend.
    kv_cache_dtype: str = "auto"
    # vLLM's --quantization (llama.cpp's quantised weights): "q8_0" keeps every layer's products and the LM head as
    # Q8_0 (int8 in blocks of 32 with a float32 scale: 0.56x bf16's bytes, so a CPU decode step, which streams the
    # weights, reads fewer), "q4_1" the layers' as Q4_1 (4 bits a weight in blocks of 32 with a float16 step and
    # offset: 0.31x bf16's bytes) and the LM head as Q8_0, quantised at load from a bfloat16 core; "gguf" each layer
    # matrix of a core exported from a GGUF file at about the bits of its tensors there (a Q4_K_M file's Q4_K
    # matrices as Q4_1, its Q6_K ones as Q8_0: quant.gguf_plan); the CPU executor only. None: as the core is.
    quantization: str | None = None
    # vLLM's --enforce-eager: on a GPU, the eager executor (torch's forward, no CUDA graphs) serves every core, as
    # it does those the graphs' kernels do not run. Slower; images on a vision core's GPU need it (the graphs take
    # text only). No effect on a CPU.
    enforce_eager: bool = False
    # Speculative decoding by prompt lookup (vLLM's ngram method): up to this many draft tokens a step
    # for greedy requests, copied from where their latest prompt_lookup_max .. prompt_lookup_min tokens occurred
    # before in their prompt and output. 0 = off.
    speculative_tokens: int = 0
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # vLLM's --speculative-model, llama.cpp's --model-draft: the drafts come from this model instead (a core, a
    # GGUF file or a checkpoint directory sharing the served model's vocabulary), its greedy continuation of each
    # request, speculative_tokens at most (DRAFT_TOKENS where that is 0); a draft the model gives less than
    # draft_p_min stops the drafting (llama.cpp's --draft-p-min). None: prompt lookup.
    speculative_model: str | None = None
    draft_p_min: float = DRAFT_P_MIN
    # llama.cpp's --ctx-size-draft: the tokens the draft model's KV cache holds in all (None: as many as the served
    # model's pool, at most every live request's whole context). Fewer: the requests drafted for least recently give
    # their pages back sooner, and one whose context does not fit is not drafted for.
    draft_kv_tokens: int | None = None
    # Images named by URL (vision cores): http(s) URLs are fetched, as vLLM and OpenAI do, within
    # media_fetch_timeout_s, redirects to at most 3 more hosts; allowed_media_domains (vLLM's
    # --allowed-media-domains) limits the hosts (empty: any); media_fetch = false refuses remote URLs. file:// URLs
    # are read only under allowed_local_media_path (vLLM's --allowed-local-media-path; unset: refused).
    media_fetch: bool = True
    media_fetch_timeout_s: float = 5.0
    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: str | None = None
    # vLLM's --limit-mm-per-prompt image=N: images one request may carry.
    max_images_per_request: int = 8
    # Scheduler policy coefficients (the [policy] table).
    policy: PolicyConfig = dataclasses.field(default_factory=PolicyConfig)

    def __post_init__(self):
        def need(cond: bool, key: str, what: str) -> None:
            if not cond:
                raise ConfigError(f"config key '{key}': {what}", ErrorKind.VALIDATION)

        need(isinstance(self.host, str) and bool(self.host), "host", "must be a nonempty string")
        need(_is_int(self.port) and 0 <= self.port <= 65535, "port", "must be an integer in 0..65535")
        need(self.api_key is None or (isinstance(self.api_key, str) and bool(self.api_key)), "api_key",
             "must be a nonempty string")
        for key in ("max_active", "body_limit_bytes", "torch_threads"):
            v = getattr(self, key)
            need(v is None or (_is_int(v) and v > 0), key, "must be a positive integer")
        need(self.queue_capacity is None or (_is_int(self.queue_capacity) and self.queue_capacity >= 0),
             "queue_capacity", "must be a non-negative integer")
        for key in ("frontend_workers", "max_connections"):
            v = getattr(self, key)
            need(_is_int(v) and v > 0, key, "must be a positive integer")
        for key in ("header_timeout_s", "keep_alive_timeout_s"):
            v = getattr(self, key)
            need(_is_num(v) and v > 0, key, "must be a positive number of seconds")
        need(_is_num(self.shutdown_grace_s) and self.shutdown_grace_s >= 0, "shutdown_grace_s",
             "must be a non-negative number of seconds")
        need(isinstance(self.served_names, tuple) and all(isinstance(n, str) and n for n in self.served_names),
             "served_names", "must be a list of nonempty strings")
        name = self.served_model_name
        need(name is None or (isinstance(name, str) and bool(name)), "served_model_name", "must be a nonempty string")
        need(isinstance(self.prefix_cache, bool), "prefix_cache", "must be true or false")
        need(isinstance(self.web_ui, bool), "web_ui", "must be true or false")
        need(isinstance(self.runtime_lora_updating, bool), "runtime_lora_updating", "must be true or false")
        need(isinstance(self.enforce_eager, bool), "enforce_eager", "must be true or false")
        for key, most in (("max_loras", 256), ("max_lora_rank", 1024)):
            v = getattr(self, key)
            need(_is_int(v) and 1 <= v <= most, key, f"must be an integer in 1..{most}")
        need(self.max_cpu_loras is None or (_is_int(self.max_cpu_loras) and _is_int(self.max_loras)
                                             and self.max_loras <= self.max_cpu_loras <= 4096),
             "max_cpu_loras", "must be an integer from max_loras up to 4096")
        from flared.model.kv_cache import KV_CACHE_DTYPES
        from flared.scheduler.config import MAX_SPECULATIVE_TOKENS

        need(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}")
        from flared.model.quant import GGUF, QUANTIZATIONS

        need(self.quantization is None or self.quantization in (*QUANTIZATIONS, GGUF), "quantization",
             f"must be one of {', '.join((*QUANTIZATIONS, GGUF))} (or absent)")
        need(_is_int(self.speculative_tokens) and 0 <= self.speculative_tokens <= MAX_SPECULATIVE_TOKENS,
             "speculative_tokens", f"must be an integer in 0..{MAX_SPECULATIVE_TOKENS}")
        need(self.speculative_model is None or (isinstance(self.speculative_model, str) and self.speculative_model),
             "speculative_model", "must be a path (a core, a GGUF file or a checkpoint directory)")
        if self.speculative_model is not None and self.speculative_tokens == 0:  # (unset: a draft model's default)
            object.__setattr__(self, "speculative_tokens", DRAFT_TOKENS)
        need(_is_num(self.draft_p_min) and 0 <= self.draft_p_min <= 1, "draft_p_min", "must be a number in 0..1")
        need(self.draft_kv_tokens is None or (_is_int(self.draft_kv_tokens) and self.draft_kv_tokens >= 256),
             "draft_kv_tokens", "must be an integer of at least 256 (or absent)")
        need(_is_int(self.prompt_lookup_min) and _is_int(self.prompt_lookup_max)
             and 1 <= self.prompt_lookup_min <= self.prompt_lookup_max, "prompt_lookup_min",
             "prompt_lookup_min and prompt_lookup_max must be integers with 1 <= min <= max")
        need(self.log_level in ("debug", "info", "warning", "error"), "log_level",
             "must be one of debug, info, warning, error")
        need(self.log_format in ("auto", "plain", "journal"), "log_format", "must be one of auto, plain, journal")
        for key in ("api_key_file", "admin_socket", "admin_socket_group"):
            v = getattr(self, key)
            need(v is None or (isinstance(v, str) and bool(v)), key, "must be a nonempty path")
        need(not (self.api_key and self.api_key_file), "api_key_file", "give api_key or api_key_file, not both")
        need(isinstance(self.policy, PolicyConfig), "policy", "must be a [policy] table")
        from flared.frontend.reasoning import FORMATS
        from flared.frontend.toolcalls import PARSERS

        for key, known in (("tool_parser", PARSERS), ("reasoning_parser", FORMATS)):  # (the parsers' own names)
            names = ("auto", "none", *known)
            need(getattr(self, key) in names, key, f"must be one of {', '.join(names)}")
        need(self.embedding_pooling in ("last", "mean"), "embedding_pooling", "must be one of last, mean")
        for key in ("ssl_certfile", "ssl_keyfile"):
            v = getattr(self, key)
            need(v is None or (isinstance(v, str) and Path(v).expanduser().is_file()), key, "must be a readable file")
        need((self.ssl_certfile is None) == (self.ssl_keyfile is None), "ssl_keyfile",
             "give ssl_certfile and ssl_keyfile together")
        need(isinstance(self.cors_allow_origins, tuple)
             and all(isinstance(o, str) and (o == "*" or "://" in o) for o in self.cors_allow_origins),
             "cors_allow_origins", "must be a list of origins such as \"https://app.example\", or \"*\"")
        need(self.chat_template is None or (isinstance(self.chat_template, str) and bool(self.chat_template)),
             "chat_template", "must be a nonempty path or template text")
        if self.chat_template is not None and "{{" not in self.chat_template and "{%" not in self.chat_template:
            need(Path(self.chat_template).expanduser().is_file(), "chat_template",
                 f"{self.chat_template[:200]!r} is neither a file nor a Jinja template")
        need(isinstance(self.lora_adapters, tuple) and all(
            isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], str) and a[0] and _is_num(a[1])
            and math.isfinite(a[1]) for a in self.lora_adapters),
            "lora_adapters", "must be a list of adapter paths or [path, scale] pairs")
        need(isinstance(self.lora_modules, tuple) and all(
            isinstance(m, tuple) and len(m) == 2 and all(isinstance(x, str) and x for x in m)
            for m in self.lora_modules), "lora_modules", "must be a table of adapter names and paths")
        names = [m[0] for m in self.lora_modules]
        need(len(set(names)) == len(names), "lora_modules", f"names repeat: {names}")
        need(isinstance(self.media_fetch, bool), "media_fetch", "must be true or false")
        need(_is_num(self.media_fetch_timeout_s) and 0 < self.media_fetch_timeout_s <= 600, "media_fetch_timeout_s",
             "must be a number of seconds in (0, 600]")
        need(isinstance(self.allowed_media_domains, tuple) and all(
            isinstance(d, str) and d and "/" not in d for d in self.allowed_media_domains),
            "allowed_media_domains", "must be a list of host names such as \"images.example.com\"")
        need(self.allowed_local_media_path is None or (isinstance(self.allowed_local_media_path, str) and Path(
            self.allowed_local_media_path).expanduser().is_dir()), "allowed_local_media_path", "must be a directory")
        need(isinstance(self.max_images_per_request, int) and not isinstance(self.max_images_per_request, bool)
             and 0 <= self.max_images_per_request <= 64, "max_images_per_request", "must be an integer in 0..64")
        if self.lora_adapters or self.lora_modules:
            from flared.model.lora import check_adapter_path

            for key, label, path in ([("lora_adapters", "", p) for p, _ in self.lora_adapters]
                                     + [("lora_modules", f"{n}: ", p) for n, p in self.lora_modules]):
                problem = check_adapter_path(path)
                need(problem is None, key, f"{label}{problem}")

    def with_secrets(self) -> "ServerConfig":
        """The config with api_key read from api_key_file (first line, stripped)."""
        if not self.api_key_file:
            return self
        try:
            key = Path(self.api_key_file).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ConfigError(f"config key 'api_key_file': cannot read {self.api_key_file}: {e.strerror}",
                              ErrorKind.VALIDATION) from None
        if not key:
            raise ConfigError(f"config key 'api_key_file': {self.api_key_file} is empty", ErrorKind.VALIDATION)
        return dataclasses.replace(self, api_key=key, api_key_file=None)

    def ssl_context(self):
        """The server side TLS context of ssl_certfile and ssl_keyfile, or None (plain HTTP)."""
        if self.ssl_certfile is None:
            return None
        import ssl

        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(str(Path(self.ssl_certfile).expanduser()), str(Path(self.ssl_keyfile).expanduser()))
        except (ssl.SSLError, OSError) as e:
            raise ConfigError(f"config keys 'ssl_certfile' / 'ssl_keyfile': cannot load them: {e}") from None
        return ctx

    @classmethod
    def from_toml(cls, path: str | Path) -> "ServerConfig":
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid TOML: {e}") from None
        if "server" in data and isinstance(data["server"], dict):
            data = {**{k: v for k, v in data.items() if k != "server"}, **data["server"]}
        return cls.from_mapping(data, where=str(path))

    @classmethod
    def from_mapping(cls, data: dict[str, Any], *, where: str = "config") -> "ServerConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ConfigError(f"{where}: unknown config key(s) {', '.join(map(repr, unknown))}")
        values = dict(data)
        if "policy" in values:
            values["policy"] = _policy_from_mapping(values["policy"], where)
        for key in ("served_names", "cors_allow_origins", "allowed_media_domains"):
            if key in values:
                if not isinstance(values[key], list):
                    raise ConfigError(f"{where}: config key '{key}': must be a list of strings")
                values[key] = tuple(values[key])
        if "lora_modules" in values:
            table = values["lora_modules"]
            if not isinstance(table, dict):
                raise ConfigError(f"{where}: config key 'lora_modules': must be a table of adapter names and paths")
            values["lora_modules"] = tuple(table.items())
        if "lora_adapters" in values:
            items = values["lora_adapters"]
            if not isinstance(items, list):
                raise ConfigError(f"{where}: config key 'lora_adapters': must be a list of adapter paths or "
                                  f"[path, scale] pairs")
            values["lora_adapters"] = tuple((item, 1.0) if isinstance(item, str) else
                                            tuple(item) if isinstance(item, list) else item for item in items)
        try:
            return cls(**values)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None


def _policy_from_mapping(table: Any, where: str) -> PolicyConfig:
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: config key 'policy': must be a table")
    fields = {f.name: f for f in dataclasses.fields(PolicyConfig)}
    unknown = sorted(set(table) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown config key(s) {', '.join(repr('policy.' + k) for k in unknown)}")
    for key, value in table.items():
        want_int = fields[key].type in ("int", int)
        ok = _is_int(value) if want_int else _is_num(value)
        if not ok:
            kind = "an integer" if want_int else "a number"
            raise ConfigError(f"{where}: config key 'policy.{key}': must be {kind}")
    try:
        return PolicyConfig(**table)
    except ValueError as e:
        raise ConfigError(f"{where}: config key 'policy': {e}") from None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
