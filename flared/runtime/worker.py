"""The model thread: one native thread that owns the scheduler and the executor.

Each turn of the loop is a few named steps:

    take_ingress   new requests and cancellations from the event loop
    admit          pending requests into scheduler slots (FIFO; waits for room)
    plan           the scheduler picks the next graph (pure policy)
    submit         commit the plan under a new fence and execute it
    complete       validate the completion, publish tokens, finish, retire

Rules:
- The event loop never touches the scheduler, the executor or a request's
  state; it reaches the thread only through ``submit``/``cancel``, which
  append to the ingress queue under a lock and wake the thread.
- Every request handed to ``submit`` gets exactly one terminal event: a
  FinishEvent (stop, length, cancelled) or an ErrorEvent. A failure of the
  loop sends ErrorEvent to every live, pending and queued request before the
  thread exits; after that ``submit`` refuses with 503.
- Token events carry ids only; detokenizing is the consumer's business.
- A cancelled request stops being scheduled at once; its slot, pages and
  sampler state are released when the scheduler retires it (after its last
  in-flight use).
- A constrained request (``grammar``) advances its matcher with every token
  it emits, before the next plan; a token the grammar rejects ends that
  request alone with an ErrorEvent (the others in its batch go on).
- A model job (``submit_job``: embeddings, prompt logprobs) runs between
  steps, up to a prefill chunk's tokens of it a turn, through the model on a
  scratch KV cache (nothing shared with the serving cache); its result goes
  to its ``done`` callback, here on this thread. Its failure ends that job
  alone.
- A scoring request (``score_from``) is admitted with a private conditioning
  identity at ``score_from``: the context before it is shared through the
  prefix cache, nothing after it ever is, so every scored token is fed. Its
  prefill-end sample is never published: it gets one ScoredEvent, then a
  "stop" finish.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import os
import threading
import time
from pathlib import Path

from flared.errors import AdmissionError, CoreError, ErrorKind, ExecutionError, FlareError
from flared.runtime.request import (
    ErrorEvent, EventSink, FinishEvent, GenerateRequest, ScoredEvent, TokenEvent, as_error,
)

log = logging.getLogger("flared.runtime")

# How long the idle loop sleeps between checks when nothing wakes it: the
# health heartbeat's resolution.
IDLE_WAIT_S = 0.5
# /health fails when the loop has not turned for this long (a wedged step).
STALL_LIMIT_S = 60.0
# How long POST /v1/load_lora_adapter waits for the model thread to write an adapter into the CUDA graphs' slots.
LORA_INSTALL_TIMEOUT_S = 120.0


@dataclasses.dataclass
class _Live:
    request: GenerateRequest
    sink: EventSink
    handle: int = 0
    sampler_state: object = None
    reused_tokens: int = 0
    admitted_ns: int = 0
    first_token_ns: int = 0
    scheduled_ns: int = 0
    num_generated: int = 0
    terminal_sent: bool = False
    # Dashboard request rows: when output was last published, and how many
    # completed steps published output (a multi-token step counts once).
    last_output_ns: int = 0
    num_bursts: int = 0
    grammar: object = None  # flared.model.grammar.GrammarMatcher of a constrained request
    scores: list | None = None  # a scoring request's log-probabilities so far
    drafted: int = 0  # draft tokens its speculative steps fed, and kept
    accepted_drafts: int = 0


class ModelJob:
    """Work the model thread runs between steps, outside the scheduler. ``step(model, budget, stats)`` runs
    up to about ``budget`` tokens of it (short sequences together, a long one a prefill chunk at a time) and
    returns True when it is complete; then ``done(result(), None)`` is called, or ``done(None, error)`` if a
    step raised. Both on the model thread."""

    done: object  # Callable[[object, FlareError | None], None]

    def step(self, model, budget: int, stats) -> bool:
        raise NotImplementedError

    def result(self):
        raise NotImplementedError


@dataclasses.dataclass
class _LoraInstall(ModelJob):
    """A per-request LoRA adapter loaded while serving on the CUDA graph executor: the model thread writes its
    factors into a free slot between steps (ModelRuntime._install_lora); the result is its ``lora`` index."""
    runtime: object  # ModelRuntime
    name: str
    path: str
    factors: dict
    ident: bytes
    done: object
    index: int = 0
    # Set under the runtime's lock: the model thread began writing the slot (started), or the caller gave up
    # waiting before that (abandoned: the job then writes nothing, so no slot is left taken with no name).
    started: bool = False
    abandoned: bool = False

    def step(self, model, budget: int, stats) -> bool:
        self.index = self.runtime._install_lora(self)
        return True

    def result(self):
        return self.index


@dataclasses.dataclass
class EmbeddingJob(ModelJob):
    """Sequences to embed (``DecoderModel.pooled_embeddings``); the result is float32 [len(token_lists),
    hidden] on the CPU. With ``project`` (token ids), each pooled vector goes through those rows of the LM head
    instead: the result is those tokens' logits [len(token_lists), len(project)] (pooling ``last``, not
    normalized: the next-token logits after each sequence). ``counter`` names the stats it adds to."""
    token_lists: list[list[int]]
    pooling: str
    normalize: bool
    done: object
    project: tuple = ()
    counter: str = "embedded"
    parts: list = dataclasses.field(default_factory=list)  # the vectors of the sequences run so far
    _long: object = None  # DecoderModel.embedding_chunks of a sequence longer than a step's budget, running

    def step(self, model, budget: int, stats) -> bool:
        start = sum(p.shape[0] for p in self.parts)
        tokens = self.token_lists[start]
        if self._long is None and len(tokens) > budget:
            self._long = model.embedding_chunks(tokens, pooling=self.pooling, chunk_tokens=budget)
        if self._long is not None:  # one chunk of it this turn
            vector = next(self._long)
            if vector is None:
                return False
            self._long = None
            from torch.nn.functional import normalize

            vectors = normalize(vector[None], dim=-1) if self.normalize else vector[None]
            end, count = start + 1, len(tokens)
        else:  # the short sequences that fit the budget, together
            end, count = start, 0
            while (end < len(self.token_lists) and len(self.token_lists[end]) <= budget
                   and (end == start or count + len(self.token_lists[end]) <= budget)):
                count += len(self.token_lists[end])
                end += 1
            vectors = model.pooled_embeddings(self.token_lists[start:end], pooling=self.pooling,
                                              normalize=self.normalize, chunk_tokens=budget)
        if self.project:
            vectors = model.token_logits(vectors, self.project)
        self.parts.append(vectors.cpu())
        stats[f"{self.counter}_sequences"] += end - start
        stats[f"{self.counter}_tokens"] += count
        return end == len(self.token_lists)

    def result(self):
        import torch

        return torch.cat(self.parts)


# A turn of the model thread runs an image tower's layers for about this long before the turn's step: a large
# image then holds other requests' tokens back by a layer or so (~0.1-0.3 s of a 2B tower on a CPU), not by its
# whole tower (seconds). FLARED_TOWER_TURN_S sets it (tools/bench_vision_stall.py compares).
TOWER_TURN_S = float(os.environ.get("FLARED_TOWER_TURN_S", "0.02"))


@dataclasses.dataclass
class VisionJob(ModelJob):
    """Images through the model's image tower (flared.model.vision): the result is each image's rows [its
    num_image_tokens, hidden] in the model's dtype, on its device, in order. A turn runs the tower's layers for
    about ``turn_s`` (at least one layer), so that a large image shares the thread with live requests' steps."""
    images: list  # flared.frontend.images.PreparedImage
    done: object
    turn_s: float = TOWER_TURN_S
    parts: list = dataclasses.field(default_factory=list)  # finished images' rows
    _stages: object = None  # the current image's tower, a generator over its layers

    def step(self, model, budget: int, stats) -> bool:
        import torch

        started = time.perf_counter()
        while len(self.parts) < len(self.images):
            image = self.images[len(self.parts)]
            second = getattr(model, "audio", None)  # (Gemma 4's clips: the audio tower beside the image tower)
            vision = second if image.modality == "audio" and second is not None else model.vision
            if vision is None:
                raise ExecutionError("this model has no image tower", ErrorKind.UNSUPPORTED)
            if self._stages is None:
                pixels = torch.as_tensor(image.pixel_values)
                if image.modality == "video" and hasattr(vision, "video_stages"):  # (LLaVA-OneVision's frames)
                    self._stages = vision.video_stages(pixels)
                else:
                    self._stages = vision.stages(pixels, grid=image.grid)
            try:
                next(self._stages)
            except StopIteration as finished:
                self.parts.append(finished.value)
                self._stages = None
                stats["vision_videos" if image.modality == "video" else "vision_images"] += 1
                if image.pixel_values.ndim == 4:  # tiles (SmolVLM's, InternVL's, LLaVA-NeXT's; video frames)
                    stats["vision_tiles"] += len(image.pixel_values)
                continue
            if time.perf_counter() - started >= self.turn_s:
                return False
        return True

    def result(self):
        return self.parts


@dataclasses.dataclass
class PromptLogprobsJob(ModelJob):
    """One prompt's token logprobs (``DecoderModel.prompt_logprobs``): for p >= 1, (logprob, top alternatives,
    rank)."""
    token_ids: list[int]
    top: int
    done: object
    _result: list = dataclasses.field(default_factory=list)
    _chunks: object = None  # DecoderModel.prompt_logprobs_chunks, one prefill chunk a turn

    def step(self, model, budget: int, stats) -> bool:
        if self._chunks is None:
            self._chunks = model.prompt_logprobs_chunks(self.token_ids, self.top, chunk_tokens=budget)
        part = next(self._chunks, None)
        if part is None:
            stats["scored_prompt_tokens"] += len(self.token_ids)
            return True
        self._result.extend(part)
        return False

    def result(self):
        return self._result


def _salt_identity(salt: str) -> bytes:
    """The 32-byte conditioning identity of a cache_salt."""
    return hashlib.sha256(b"flared.cache_salt\0" + salt.encode("utf-8")).digest()


def tower_dtype(dtype):
    """The dtype an image tower runs in on the CPU: a bf16 core's in float32 unless the CPU has native bf16
    products (AVX-512 BF16). torch's bf16 matmul elsewhere ran the towers 6.4x slower than float32
    (tools/bench_vision.py on an AVX2 host); the tower's rows are cast to the decoder's dtype."""
    import torch

    if dtype == torch.bfloat16:
        from flared._fast.linear import KERNEL

        if KERNEL != "avx512_bf16":
            return torch.float32
    return dtype


def _cpu_products(dtype: str) -> str:
    """", bf16 products on ..." for the log: which of flared/_fast/linear.pyx's kernels a bf16 core's products take."""
    if dtype != "bfloat16":
        return ""
    from flared._fast.linear import AMX, KERNEL

    kernel = "AMX tiles" if AMX else {"avx512_bf16": "AVX-512 BF16", "avx2": "AVX2"}.get(KERNEL, "torch's ops")
    return f", bf16 products on {kernel}"


def cuda_backend_available(dtype) -> bool:
    """The CUDA graph backend serves bf16/fp16 cores when torch sees a GPU and CuPy and Triton import;
    anything else runs on the CPU eager executor."""
    import importlib.util

    import torch

    if dtype not in (torch.bfloat16, torch.float16) or not torch.cuda.is_available():
        return False
    return all(importlib.util.find_spec(name) is not None for name in ("cupy", "triton"))


class ModelRuntime:
    def __init__(self, core, *, prefix_cache: bool = True, torch_threads: int | None = None,
                 fail_after_steps: int | None = None, policy=None, pipeline: bool = True, lora_adapters=(),
                 lora_modules=(), speculative=(0, 4, 2), lora_slots: int | None = None, max_lora_rank: int = 16,
                 max_cpu_loras: int | None = None, kv_cache_dtype: str = "auto", enforce_eager: bool = False,
                 quantization: str | None = None, draft_core=None, draft_p_min: float = 0.0,
                 draft_kv_tokens: int | None = None):
        self.core = core
        # vLLM's --kv-cache-dtype: "auto" (the model's dtype) or "fp8" / "fp8_e4m3" (either executor's pool and
        # snapshots in float8 e4m3: the core's KV memory holds twice a bf16 core's pages).
        self.kv_cache_dtype = kv_cache_dtype
        # --quantization: "q8_0" or "q4_1" keeps the layers' matrices so (on a CPU, the LM head too), "gguf" each at
        # about its bits in the GGUF file the core was exported from (flared/model/quant.py); None serves the core's
        # weights as they are (a core that stores them quantised: so).
        from flared.model.quant import GGUF, check_quantization

        self.quantization = quantization if quantization == GGUF else check_quantization(quantization)
        self._weights_info: dict = {}  # weights_info(), once loaded
        # vLLM's --enforce-eager: a GPU serves through the eager executor, without graphs
        self.enforce_eager = enforce_eager
        # Speculative decoding by prompt lookup: (draft tokens a step, longest and shortest n-gram); 0 drafts: off.
        # Both executors verify drafts as decode rows (the CUDA graph executor in its speculative decode graphs).
        self.speculative = tuple(speculative)
        self.spec_tokens = 0  # what load() turned on
        # vLLM's --speculative-model, llama.cpp's --model-draft: a core sharing this one's vocabulary whose greedy
        # continuations are the drafts instead of prompt lookup's (flared.execution.drafter), each stopped where
        # the draft model gives its token less than draft_p_min (llama.cpp's --draft-p-min).
        self.draft_core = draft_core
        self.draft_p_min = draft_p_min
        self.draft_kv_tokens = draft_kv_tokens  # (llama.cpp's --ctx-size-draft; None: _build_drafter's rule)
        self.drafter = None
        # (path, scale) of PEFT LoRA adapters merged into the weights at load (flared.model.lora).
        self.lora_adapters = tuple(lora_adapters)
        # (name, path) of per-request adapters (vLLM's --lora-modules): a request's ``lora`` k runs adapter k - 1
        # beside the weights; each one's prefix-cache identity is _lora_ids[k - 1].
        self.lora_modules = tuple(lora_modules)
        self._lora_ids: list[bytes] = []
        self._lora_dropping: set[int] = set()  # unloaded adapters whose factors go once no request holds them
        # Adapters loaded while serving on the CUDA graph executor (vLLM's --max-loras / --max-lora-rank): the
        # graphs are captured with this many adapter slots, each for ranks up to max_lora_rank (StackedLora's
        # slots). None: the graphs hold the start adapters only, and loading more while serving is refused there.
        self.lora_slots = lora_slots
        self.max_lora_rank = max_lora_rank
        # vLLM's --max-cpu-loras (with slots, on the CUDA graph executor): up to this many adapters loaded, more than
        # the slots; each one's factors stay in host memory (_lora_host, index -> factors) and a request brings its
        # adapter into a slot as it is admitted (_lora_resident), in place of the idle one asked for least recently
        # (_lora_used: index -> admission tick). None: no more adapters than slots, each keeping its slot.
        self.max_cpu_loras = max_cpu_loras
        self._lora_swapping = False
        self._lora_host: dict[int, dict] = {}
        self._lora_used: dict[int, int] = {}
        self._lora_ticks = 0
        self._weight_shapes: dict = {}  # serving tensor name -> a meta tensor of its shape (adapters loaded later)
        # With an executor that has submit/poll (CUDA graphs), up to two decode steps are in flight: the
        # host plans, packs and launches step N+1 while the GPU runs step N. False: one step at a time.
        self.pipeline = pipeline
        # Steps submitted and not yet completed: (fence, plan, handles, exclusive). An exclusive step (one with
        # a grammar row) has nothing stacked behind it.
        self._inflight: collections.deque[tuple[int, object, list[int], bool]] = collections.deque()
        self.policy = policy  # flared.scheduler.PolicyConfig; None: its defaults
        self.prefix_cache = prefix_cache
        self.torch_threads = torch_threads
        self._fail_after_steps = fail_after_steps  # fault injection for tests (--debug-fail-after-steps)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ingress: collections.deque[_Live] = collections.deque()
        self._jobs: collections.deque[ModelJob] = collections.deque()  # guarded by _lock
        self._cancels: collections.deque[int] = collections.deque()
        self._pending: collections.deque[_Live] = collections.deque()  # thread-owned: waiting for a slot
        self._by_id: dict[int, _Live] = {}  # request_id -> live (thread-owned)
        self._by_handle: dict[int, _Live] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._max_pending = 0
        # Request ids submitted, not yet terminal and not cancelled (guarded by _lock): what model admission
        # counts. A cancelled request stops counting at cancel(), before the model thread has dropped it,
        # so the HTTP permit its client released can admit a successor at once.
        self._outstanding_ids: set[int] = set()
        self.failed = threading.Event()
        self.failure: BaseException | None = None
        self.ready = threading.Event()
        self._last_beat = time.monotonic()
        self.steps = 0
        self.scheduler = None
        self.executor = None
        self.model = None  # the DecoderModel the executor runs (model jobs call it directly)
        self.stats = collections.Counter()
        # Dashboard completion buffer (flared.dashboard.telemetry), set only
        # while a dashboard runs; its record() never blocks this thread.
        self.telemetry = None

    # -- lifecycle (caller's thread) ---------------------------------------------------------------

    def start(self, *, max_pending: int) -> None:
        """Load the model and start the thread; returns when it is stepping."""
        self._max_pending = max_pending
        self._build()
        self._thread = threading.Thread(target=self._main, name="flared-model", daemon=True)
        self._thread.start()
        self.ready.wait()
        if self.failed.is_set():
            raise ExecutionError(f"the model thread failed at start: {self.failure}")

    def _build(self) -> None:
        import torch

        from flared.execution.eager import EagerExecutor
        from flared.model.decoder import DecoderModel
        from flared.scheduler import PolicyConfig, RequestScheduler, SchedulerConfig

        m = self.core.manifest
        caps = m.capacities
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        dtype = getattr(torch, m.dtype)
        use_cuda = cuda_backend_available(dtype)
        device = "cuda" if use_cuda else "cpu"
        if self.quantization is not None and m.dtype != "bfloat16":
            raise ExecutionError(f"--quantization {self.quantization} runs over a bfloat16 core; this core is "
                                 f"{m.dtype} (export it with --dtype bfloat16, or leave --quantization off)")
        from flared.model.graph_layers import generic_reason
        from flared.model.quant import QuantPlan, resolve_quantization

        try:
            # (gguf: the core's plan; a core that stores its matrices quantised: its own on the CPU, where a GPU
            # takes their values back to the fused kernels unless -q keeps them)
            kept = resolve_quantization(self.quantization, m.source,
                                        m.weights_quantization if device == "cpu" else None)
        except ValueError as exc:
            raise ExecutionError(f"--quantization {self.quantization}: {exc}") from None
        if m.weights_quantization is not None and kept is None:
            log.info("this core stores its layer matrices as %s: the GPU takes them back to %s for its fused kernels "
                     "(-q in that format keeps them so: a third to a half the memory, slower)",
                     m.weights_quantization["default"], m.dtype)
        if self.quantization is not None and kept is None:  # (gguf over a file mostly at 16 bits or more)
            log.info("--quantization %s: the source's layer matrices are mostly 16-bit or wider: served as the core "
                     "is (%s)", self.quantization, m.dtype)
        obstacle = generic_reason(self.core.config, kept)  # (the graphs over the model's own layers, and why)
        if use_cuda and self.enforce_eager:
            log.info("enforce_eager: serving on the GPU with the eager executor (no CUDA graphs)")
            use_cuda = False
        elif use_cuda and obstacle is not None:
            config = self.core.config
            problem = config.torch_graphs_obstacle(m.dtype)
            if problem is None and (self.lora_modules or self.lora_slots):
                problem = "per-request LoRA adapters"
            if problem is None:
                # The graphs capture the model's own torch layers with the paged Triton attention (no fused
                # kernels: kernels/paged_decoder.py's generic decoder)
                log.info("the CUDA graphs run %s through the model's torch layers", obstacle)
            else:
                # The eager executor's torch forward on the GPU: no graphs, a host sync a step (and a layer's
                # routing)
                log.warning("the CUDA graphs do not run %s: serving on the GPU with the eager executor", problem)
                use_cuda = False
        tensors = self.core.load_tensors()
        identity = hashlib.sha256(f"{m.checkpoint_id}|{m.dtype}|{caps.page_tokens}".encode())
        if kept is not None:  # cached keys and values come from the quantised weights
            identity.update(f"|weights {kept.digest() if isinstance(kept, QuantPlan) else kept}".encode())
        elif m.weights_quantization is not None:  # (a GPU's: the stored matrices' values, not the source's)
            identity.update(f"|stored {QuantPlan.from_dict(m.weights_quantization).digest()}".encode())
        if self.kv_cache_dtype != "auto":  # cached prefixes hold keys and values at the pool's precision
            identity.update(b"|kv float8_e4m3fn")  # "fp8" and "fp8_e4m3" name the same pool
        scaling = self.core.config.rope_scaling
        if scaling is not None and scaling["rope_type"] == "longrope":  # cached keys turned by one table of the two
            from flared.model.rope import longrope_is_long

            long = longrope_is_long(scaling, caps.context_tokens)
            identity.update(b"|longrope long" if long else b"|longrope short")
            log.info("LongRoPE: a context of %d tokens %s the original %d: the %s factors", caps.context_tokens,
                     "passes" if long else "fits", scaling["original_max_position_embeddings"],
                     "long" if long else "short")
        if self.lora_adapters:
            from flared.model.lora import LoraAdapter, merge_adapters

            if m.weights_quantization is not None:
                raise ExecutionError("--lora merges adapters into a core's weights, and this core stores its layer "
                                     "matrices quantised: export it without --quantization (or serve the adapter "
                                     "per request: --lora-modules)", ErrorKind.VALIDATION)

            adapters = [LoraAdapter(Path(p), float(scale)) for p, scale in self.lora_adapters]
            # cached prefixes belong to the merged weights
            identity.update(merge_adapters(tensors, self.core.config, adapters))
            log.info("merged LoRA adapters: %s", ", ".join(f"{p} (scale {s:g})" for p, s in self.lora_adapters))
        identity = identity.digest()
        from flared.model.loader import serving_tensor_shapes

        self._weight_shapes = {k: torch.empty(v, device="meta")  # (by the serving names: a stored core's too)
                               for k, v in serving_tensor_shapes(self.core.config).items()}
        factors = [self._lora_factors(path) for _, path in self.lora_modules]
        if factors:
            log.info("per-request LoRA adapters: %s", ", ".join(f"{n} ({p})" for n, p in self.lora_modules))
        try:
            model = DecoderModel(self.core.config, tensors, dtype=dtype, device=device,
                                 max_positions=caps.context_tokens, quantization=kept)
        except ValueError as exc:
            if kept is None:
                raise
            raise ExecutionError(f"--quantization {self.quantization}: {exc}") from exc
        del tensors
        products = [lin for layer in model.layers for lin in model._linears(layer)] + [model.lm_head_linear]
        formats: dict[str, int] = {}
        for lin in products:
            formats[lin.quant_kind or "bf16"] = formats.get(lin.quant_kind or "bf16", 0) + 1
        # (quantization: the one format, or a plan's default: the format most of the weights are in)
        self._weights_info = {"quantization": model.quantization, "dtype": m.dtype,
                              "quantized_products": sum(lin.quant is not None for lin in products),
                              "products": len(products), "product_bytes": sum(lin.nbytes for lin in products),
                              "formats": formats}
        if kept is not None:
            head = model.lm_head_linear.quant_kind
            kinds = ", ".join(f"{n} as {fmt}" for fmt, n in sorted(formats.items(), key=lambda kv: -kv[1]))
            log.info("weights: products kept as %s (%d: %s)%s, %.1f MiB (%.1f MiB as bf16)", model.quantization,
                     len(products), kinds,
                     f"; the LM head as {head}" if head is not None else "",
                     self._weights_info["product_bytes"] / 2**20,
                     sum(2 * lin.out_features * lin.in_features for lin in products) / 2**20)
        if self.core.manifest.vision is not None:
            # The image tower runs between steps (VisionJob); its rows take the image tokens' places in the eager
            # executor's forward, and on the CUDA graph executor in an eager run of the prefill graph's forward
            # (the graphs take token ids only: GraphExecutor._place_images; Gemma 3's images, which attend both
            # ways, attended again there: graph_layers.ImageBlocks).
            from flared.model.vision import attach_tower, vision_encoder

            config = self.core.vision_config
            on = dict(dtype=tower_dtype(dtype) if model.device.type == "cpu" else dtype, device=model.device)
            audio = self.core.audio_config  # (Gemma 4's audio tower beside its image tower)
            towers = self.core.load_tower_tensors()  # (one read of the file for both)
            attach_tower(model, config, vision_encoder(config, towers[0], **on),
                         vision_encoder(audio, towers[1], **on) if audio is not None else None)
            del towers
            log.info("%s (%s): %d layers in %s", "audio encoder" if config.is_audio else "image tower",
                     config.family, config.num_layers,
                     str(model.vision.dtype).removeprefix("torch."))
            if audio is not None:
                log.info("audio encoder (%s): %d layers in %s", audio.family, audio.num_layers,
                         str(model.audio.dtype).removeprefix("torch."))
        for f, ident in factors:
            # On CUDA the graphs run the stacked copy below; the model's entry only marks the adapter live (an
            # unloaded one's becomes None), so it holds no second copy of the factors on the GPU.
            model.add_lora_module({} if use_cuda else f)
            self._lora_ids.append(ident)
        stacked = None
        if (factors or self.lora_slots) and use_cuda:
            # The CUDA graphs run every adapter at once, its factors stacked per product (kernels/lora_rows.py);
            # a row's lora_ids input picks its adapter's columns. With slots, every product of every layer has
            # room for lora_slots adapters (a fused qkv stacks q, k and v: three times the rank).
            from flared.model.kernels.lora_rows import StackedLora

            slots = None if self.lora_slots is None else max(self.lora_slots, len(factors))
            stacked = StackedLora(self.core.config, [f for f, _ in factors], dtype=dtype, device=model.device,
                                  slots=slots, slot_width=3 * self.max_lora_rank if slots else None)
            log.info("per-request LoRA adapters stacked for the CUDA graphs: %d columns%s, %.1f MB", stacked.rank,
                     f" ({slots} slots)" if slots else "", stacked.nbytes / 1e6)
            if slots and self.max_cpu_loras is not None and self.max_cpu_loras > slots:
                self._lora_swapping = True
                self._lora_host = {i + 1: f for i, (f, _) in enumerate(factors)}  # swappable like later ones
                log.info("up to %d per-request LoRA adapters loaded, swapped into the %d slots as requests need them",
                         self.max_cpu_loras, slots)
        self.model = model
        num_snapshots = max(16, 4 * caps.concurrency)
        config = self.core.config
        if config.linear_layers:
            # A recurrent model's snapshots hold its state rows (Qwen3.5-9B's: 50 MB a row, float32): one
            # a live request, eight at least, keeps the prefix cache's exact checkpoints (multi-turn chats) in bounds
            num_snapshots = max(8, caps.concurrency)
        kv_pages = caps.kv_pages
        if self.kv_cache_dtype != "auto":
            # The core's KV budget (kv_pages at the model's dtype) holds more float8 pages, one byte a value, as
            # vLLM's float8 cache holds twice the tokens in the same memory.
            kv_pages = caps.kv_pages * dtype.itemsize
        if use_cuda:
            # CUDA graph executor (flared.execution.executor): captures the manifest's graphs here, before ready;
            # the scheduler then plans exactly the shapes it captured (multi-sequence prefill included).
            from flared.execution.executor import GraphExecutor

            self.executor = GraphExecutor(model, num_pages=kv_pages, page_tokens=caps.page_tokens,
                                          num_state_rows=caps.concurrency + 1, num_snapshots=num_snapshots,
                                          vocab_size=self.core.config.vocab_size, max_live=caps.concurrency,
                                          decode_batch_sizes=caps.decode_batch_sizes,
                                          prefill_token_sizes=caps.prefill_token_sizes,
                                          max_pages_per_sequence=-(-caps.context_tokens // caps.page_tokens),
                                          lora=stacked, speculative=self.speculative[0],
                                          kv_cache_dtype=self.kv_cache_dtype)
            graph_shapes = self.executor.graph_shapes
            dec = self.executor.decoder
            log.info("executor: CUDA graphs on %s (%s)", torch.cuda.get_device_name(), m.dtype)
            from flared.model.kernels.megakernel import describe_decode_paths

            log.info("executor: %s", describe_decode_paths(
                skinny_max_rows=dec.skinny_max_rows, mega_max_rows=dec.mega_max_rows,
                mega_max_context=dec.mega_max_context, calibration=dec.calibration))
        else:
            self.executor = EagerExecutor(model, num_pages=kv_pages, page_tokens=caps.page_tokens,
                                          num_state_rows=caps.concurrency + 1, num_snapshots=num_snapshots,
                                          vocab_size=self.core.config.vocab_size, max_live=caps.concurrency,
                                          kv_cache_dtype=self.kv_cache_dtype)
            graph_shapes = ()  # default_graph_shapes: one-sequence prefill chunks
            if model.device.type == "cpu":
                log.info("executor: eager on the CPU (%s, %d threads%s)", m.dtype, torch.get_num_threads(),
                         _cpu_products(m.dtype))
            else:
                log.info("executor: eager on %s (%s)", torch.cuda.get_device_name(), m.dtype)
        kv_dtype, kv_bytes = self.executor.kv_cache
        log.info("KV cache: %s, %d pages of %d tokens (the core's %d at %s), %.1f MiB with the prefix snapshots",
                 kv_dtype, kv_pages, caps.page_tokens, caps.kv_pages, m.dtype, kv_bytes / 2**20)
        if config.linear_layers:
            log.info("recurrent state (%d %s of %d): %d rows (%d live, %d prefix snapshots), %.1f MiB",
                     len(config.linear_layers), config.graph_obstacle, config.num_layers,
                     caps.concurrency + 1 + num_snapshots, caps.concurrency + 1, num_snapshots,
                     self.executor.recurrent_bytes / 2**20)
        spec_tokens = self.speculative[0]
        if spec_tokens and config.linear_layers:
            log.warning("speculative decoding is off for this model: its recurrent layers' state cannot take back a "
                        "rejected draft")
            spec_tokens = 0
        if spec_tokens and self.draft_core is not None:
            self.drafter = self._build_drafter(model.device, caps, spec_tokens, graphs=use_cuda)
            log.info("speculative decoding with the draft model %s: up to %d draft tokens a step (p_min %g)",
                     self.draft_core.manifest.model_name, spec_tokens, self.draft_p_min)
        elif spec_tokens:
            log.info("speculative decoding by prompt lookup: up to %d draft tokens a step (n-grams %d..%d)",
                     spec_tokens, self.speculative[2], self.speculative[1])
        self.spec_tokens = spec_tokens
        self.scheduler = RequestScheduler(
            SchedulerConfig(model_identity=identity, max_live_requests=caps.concurrency, num_pages=kv_pages,
                            num_snapshots=num_snapshots, page_tokens=caps.page_tokens,
                            context_capacity=caps.context_tokens, prefill_chunk_size=caps.prefill_chunk_tokens,
                            graph_shapes=graph_shapes, speculative_tokens=spec_tokens,
                            prompt_lookup_max=self.speculative[1], prompt_lookup_min=self.speculative[2],
                            speculative_max_rows=self.executor.spec_max_rows if use_cuda else 0,
                            initialize_state=bool(config.linear_layers), drafter=self.drafter),
            self.policy if self.policy is not None else PolicyConfig())

    def _build_drafter(self, device, caps, spec_tokens: int, graphs: bool = False):
        """The draft model (flared.execution.drafter.DraftModel) on the served model's device: the draft core's
        weights as it is served alone there (a stored or GGUF core's quantised matrices kept on a CPU), its KV pool
        no more tokens than the served model's (or draft_kv_tokens); ``graphs``: its forwards as CUDA graphs (where
        the served model runs on them), for every live request and ``spec_tokens`` drafts."""
        import torch

        from flared.execution.drafter import DraftModel
        from flared.model.decoder import DecoderModel
        from flared.model.quant import resolve_quantization

        dm = self.draft_core.manifest
        config = self.draft_core.config
        if config.linear_layers:
            raise ExecutionError(f"the draft model {dm.model_name} has recurrent layers, whose state cannot take "
                                 "back a rejected draft: draft with an attention-only model", ErrorKind.VALIDATION)
        kept = resolve_quantization(None, dm.source, dm.weights_quantization if device.type == "cpu" else None)
        model = DecoderModel(config, self.draft_core.load_tensors(), dtype=getattr(torch, dm.dtype), device=device,
                             max_positions=caps.context_tokens, quantization=kept)
        # as many tokens as the served model's pool, or every live request's whole context where that is fewer;
        # or as many as --ctx-size-draft says
        pages = min(caps.kv_pages, caps.concurrency * -(-caps.context_tokens // caps.page_tokens)) + 1
        if self.draft_kv_tokens is not None:
            pages = max(2, -(-self.draft_kv_tokens // caps.page_tokens) + 1)
        args = dict(num_pages=pages, page_tokens=caps.page_tokens, max_context=caps.context_tokens,
                    vocab_limit=self.core.config.vocab_size, p_min=self.draft_p_min)
        try:
            drafter = DraftModel(model, graphs=graphs, max_rows=caps.concurrency, max_depth=spec_tokens, **args)
        except ExecutionError as exc:
            if not graphs:
                raise
            log.warning("the draft model %s runs eagerly: its CUDA graphs failed (%s)", dm.model_name, exc)
            graphs = False
            drafter = DraftModel(model, graphs=False, **args)
        drafter.warm_up(min(caps.concurrency, 16))
        a, b = drafter.forward_cost()
        log.info("draft model %s: %d layers, %s%s%s, KV %d pages of %d tokens (%.1f MiB); a forward %.2f ms + %.3f ms "
                 "a row", dm.model_name, config.num_layers, dm.dtype, ", CUDA graphs" if graphs else "",
                 f", products as {model.quantization}" if kept is not None else "", pages, caps.page_tokens,
                 drafter.num_bytes / 2**20, a / 1e6, b / 1e6)
        return drafter

    def _lora_factors(self, path: str) -> tuple[dict, bytes]:
        """A per-request adapter's factors (checked against the weights' shapes) and its prefix-cache identity."""
        from flared.model.lora import LoraAdapter, lora_factors

        factors, digest = lora_factors(LoraAdapter(Path(path)), self.core.config, self._weight_shapes)
        return factors, hashlib.sha256(b"flared.lora\0" + digest).digest()

    def add_lora_module(self, name: str, path: str) -> int:
        """Load a per-request adapter while serving (POST /v1/load_lora_adapter); returns its ``lora`` index.
        The files are read on the caller's thread; CoreError for an adapter that does not fit the model. On the
        CUDA graph executor the model thread writes it into a free slot of the graphs' stack between steps
        (the caller waits for that); AdmissionError when there are no slots or none is free."""
        if self.model is None:
            raise AdmissionError("the model is not loaded", ErrorKind.UNAVAILABLE)
        if getattr(self.executor, "decoder", None) is not None:  # the CUDA graphs' stacked adapters
            return self._add_lora_on_gpu(name, path)
        factors, ident = self._lora_factors(path)
        with self._lock:
            index = self.model.add_lora_module(factors)
            self._lora_ids.append(ident)
            self.lora_modules = self.lora_modules + ((name, path),)
        log.info("per-request LoRA adapter %s loaded (%s) as adapter %d", name, path, index)
        return index

    def _add_lora_on_gpu(self, name: str, path: str) -> int:
        from flared.model.kernels.lora_rows import stacked_width

        stack = getattr(self.executor, "decoder", None) and self.executor.decoder.lora
        if not stack or stack.slots is None:
            raise AdmissionError("loading a per-request LoRA adapter while serving needs adapter slots in the CUDA "
                                 "graphs: start the server with --allow-runtime-lora-updating (--max-loras slots)",
                                 ErrorKind.UNSUPPORTED)
        factors, ident = self._lora_factors(path)
        rank = max((A.shape[0] for parts in factors.values() for _, _, A, _ in parts), default=0)
        if stacked_width(factors) > stack.slot_width:
            raise CoreError(f"{path}: the adapter's rank {rank} is over the slots' {stack.slot_width // 3} (start "
                            "the server with a larger --max-lora-rank)", ErrorKind.VALIDATION)
        finished = threading.Event()
        outcome: list = []

        def done(result, error) -> None:
            outcome.append((result, error))
            finished.set()

        job = _LoraInstall(self, name, path, factors, ident, done)
        self.submit_job(job)
        if not finished.wait(LORA_INSTALL_TIMEOUT_S):
            with self._lock:
                job.abandoned = not job.started
            if job.abandoned:
                raise AdmissionError(f"loading LoRA adapter {name!r}: the model thread did not take it up in "
                                     f"{LORA_INSTALL_TIMEOUT_S:g} s", ErrorKind.UNAVAILABLE)
            finished.wait()  # it is being written: a few copies
        index, error = outcome[0]
        if error is not None:
            raise error
        slot = stack.slot_of(index)
        log.info("per-request LoRA adapter %s loaded (%s) as adapter %d, %s", name, path, index,
                 "in host memory until a request names it" if slot is None else f"slot {slot}")
        return index

    def _install_lora(self, job: _LoraInstall) -> int:
        """The model thread's half of _add_lora_on_gpu: the next index, its factors into a free slot (on the
        model stream, behind the steps in flight), then the index becomes nameable."""
        with self._lock:
            if job.abandoned:
                raise AdmissionError("the caller stopped waiting for this adapter", ErrorKind.UNAVAILABLE)
            job.started = True
        index = len(self.model.lora_modules) + 1  # only this thread appends to it
        if not self._lora_swapping or self.executor.decoder.lora.free_slot() is not None:
            self.executor.install_lora(job.factors, index)  # (503 when no slot is free)
        else:
            loaded = sum(m is not None for m in self.model.lora_modules)
            if loaded >= self.max_cpu_loras:
                raise AdmissionError(f"{loaded} LoRA adapters are loaded, the most --max-cpu-loras allows: unload one "
                                     "first", ErrorKind.MODEL_CAPACITY)
            # in host memory only: the first request that names it brings it into a slot (_lora_resident)
        if self._lora_swapping:
            self._lora_host[index] = job.factors
        with self._lock:
            if self.model.add_lora_module({}) != index:
                raise ExecutionError(f"LoRA adapter index {index} was taken while its slot was written")
            self._lora_ids.append(job.ident)
            self.lora_modules = self.lora_modules + ((job.name, job.path),)
        return index

    def remove_lora_module(self, index: int) -> None:
        """Unload adapter ``index`` (POST /v1/unload_lora_adapter): no request may name it from now on; its factors
        are dropped on the model thread once the requests already holding it are gone."""
        with self._lock:
            self._lora_dropping.add(index)
            self._wake.notify()

    def _drop_loras(self) -> None:
        with self._lock:
            dropping = set(self._lora_dropping)
            queued = {live.request.lora for live in self._ingress}
        held = queued | {live.request.lora for live in self._by_id.values()}
        for index in dropping - held:
            self.model.lora_modules[index - 1] = None
            self._lora_host.pop(index, None)
            self._lora_used.pop(index, None)
            release = getattr(self.executor, "release_lora", None)
            if release is not None:  # its slot in the CUDA graphs' stack takes another adapter from now on
                release(index)
            with self._lock:
                self._lora_dropping.discard(index)
            log.info("per-request LoRA adapter %d unloaded", index)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Cancel everything, drain, join. Idempotent."""
        with self._lock:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
        close = getattr(self.executor, "close", None)  # the CUDA executor drains its streams and frees pinned frames
        if close is not None and (self._thread is None or not self._thread.is_alive()):
            close()

    def beat_age_s(self) -> float:
        """Seconds since the loop last turned (it turns at least every IDLE_WAIT_S)."""
        return time.monotonic() - self._last_beat

    def health(self) -> tuple[bool, str]:
        if self.failed.is_set():
            return False, "model thread failed"
        if not self.ready.is_set():
            return False, "loading"
        if self._thread is None or not self._thread.is_alive():
            return False, "model thread stopped"
        if time.monotonic() - self._last_beat > STALL_LIMIT_S:
            return False, "model thread stalled"
        return True, "ok"

    # -- the event loop's side ---------------------------------------------------------------------

    def submit(self, request: GenerateRequest, sink: EventSink) -> None:
        with self._lock:
            if self.failed.is_set():
                raise AdmissionError(f"the model thread has failed: {self.failure}", ErrorKind.UNAVAILABLE)
            if self._stopping or self._thread is None:
                raise AdmissionError("the model is not serving (stopping or not started)", ErrorKind.UNAVAILABLE)
            if not 0 <= request.lora <= len(self.lora_modules):
                raise AdmissionError(f"no LoRA adapter {request.lora} (this server has {len(self.lora_modules)})",
                                     ErrorKind.VALIDATION)
            if request.lora and (request.lora in self._lora_dropping
                                 or self.model.lora_modules[request.lora - 1] is None):
                raise AdmissionError(f"LoRA adapter {self.lora_modules[request.lora - 1][0]!r} was unloaded",
                                     ErrorKind.NOT_FOUND)
            if len(self._outstanding_ids) >= self._max_pending:
                raise AdmissionError(f"model admission is full ({self._max_pending} requests)",
                                     ErrorKind.MODEL_CAPACITY, hint=self.core.manifest.capacity_hint)
            self._outstanding_ids.add(request.request_id)
            self._ingress.append(_Live(request, sink))
            self._wake.notify()

    def submit_job(self, job: ModelJob) -> None:
        """Queue a model job for the model thread (at most max_pending jobs wait)."""
        with self._lock:
            if self.failed.is_set():
                raise AdmissionError(f"the model thread has failed: {self.failure}", ErrorKind.UNAVAILABLE)
            if self._stopping or self._thread is None:
                raise AdmissionError("the model is not serving (stopping or not started)", ErrorKind.UNAVAILABLE)
            if len(self._jobs) >= self._max_pending:
                raise AdmissionError(f"model admission is full ({self._max_pending} embedding or scoring requests "
                                     "waiting)", ErrorKind.MODEL_CAPACITY, hint=self.core.manifest.capacity_hint)
            self._jobs.append(job)
            self._wake.notify()

    def cancel(self, request_id: int) -> None:
        with self._lock:
            self._outstanding_ids.discard(request_id)
            self._cancels.append(request_id)
            self._wake.notify()

    def weights_info(self) -> dict:
        """How the layers' products and the LM head hold their weights once the model is loaded: ``quantization``
        (None, "q8_0" or "q4_1": with --quantization gguf, the format most of them are in), the core's ``dtype``,
        ``quantized_products`` of ``products``, ``formats`` (products by format, "bf16" too) and
        ``product_bytes``; {} before."""
        return dict(self._weights_info)

    def kv_cache_info(self) -> dict:
        """The KV cache's element type (``dtype``: "bfloat16", "float8_e4m3fn", ...), ``pages`` (the pool's: the
        core's kv_pages, more with a float8 cache) and ``bytes`` (the pool and the prefix cache's K/V snapshots)
        once the model is loaded; {} before."""
        ex, s = self.executor, self.scheduler
        if ex is None or s is None:
            return {}
        dtype, nbytes = ex.kv_cache
        return {"dtype": dtype, "pages": int(s.pages.num_pages), "bytes": int(nbytes)}

    def snapshot(self) -> dict:
        """Gauges and counters for metrics and tests (independent reads)."""
        s = self.scheduler
        out = {"steps": self.steps, "pending": len(self._pending) + len(self._ingress),
               "outstanding": len(self._outstanding_ids), "failed": self.failed.is_set(), **self.stats}
        if s is not None:
            out.update(live_slots=s.num_live, free_pages=s.pages.num_free, total_pages=s.pages.num_pages,
                       free_snapshots=s.snapshots.num_free, counters=dict(s.counters))
        return out

    def request_rows(self) -> list[dict]:
        """Dashboard request rows, read from another thread: each field is an
        independent read; a request retired mid-read is skipped."""
        s = self.scheduler
        rows = []
        if s is None:
            return rows
        for handle, live in list(self._by_handle.items()):
            try:
                r = s.request(handle)
                rows.append({"handle": int(handle), "slot": int(r.slot), "generation": int(r.generation),
                             "phase": r.phase_name, "arrival_ns": int(r.arrival_ns),
                             "last_progress_ns": int(r.last_progress_ns), "prompt_consumed": int(r.num_computed_tokens),
                             "prompt_len": int(r.prompt_len), "output": live.num_generated,
                             "last_output_ns": live.last_output_ns, "bursts": live.num_bursts,
                             "request_id": live.request.request_id, "params": live.request.params})
            except Exception:  # noqa: BLE001 - retired between the two reads
                continue
        return rows

    # -- the thread --------------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            self.ready.set()
            while self._turn():
                pass
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the clients
            log.exception("model thread failed")
            with self._lock:  # after this, submit() refuses: nothing new can slip into the ingress
                self.failure = exc
                self.failed.set()
            self._fail_all(as_error(exc))
            self.ready.set()

    def _turn(self) -> bool:
        """One loop turn; False when stopped and drained."""
        self._last_beat = time.monotonic()
        stopping = self._take_ingress()
        if self._lora_dropping:
            self._drop_loras()
        if not stopping:
            self._run_one_job()
        if stopping:
            self._cancel_everything()
            if not self._by_handle and not self._pending and not self._inflight:
                return False
        now = time.monotonic_ns()
        self._admit(now)
        pipelined = self.pipeline and hasattr(self.executor, "submit")
        plan = None
        if not self._inflight or (pipelined and not self._inflight[-1][3] and self.executor.outstanding < 2):
            # With a step in flight the scheduler offers only a decode that may stack behind it.
            plan = self.scheduler.plan(now)
        if plan is not None and self._inflight and self._needs_empty_window(plan):
            self._complete_oldest()  # the plan is not committed, so dropping it changes nothing: drain first
            return True
        if plan is None:
            if self._inflight:
                self._complete_oldest()
                return True
            if self._by_handle and self.scheduler.num_inflight == 0 and not self._idle_ok():
                raise ExecutionError("scheduler has live requests but planned nothing")
            with self._lock:
                if not self._ingress and not self._cancels and not self._stopping and not self._jobs:
                    self._wake.wait(IDLE_WAIT_S)
            return True
        if pipelined:
            self._submit(plan, now)
        else:
            self._execute(plan, now)
        return True

    def _run_one_job(self) -> None:
        """A piece of the first waiting model job (a prefill chunk's tokens, at least one sequence), so that a
        large job shares the thread with the steps of live requests."""
        with self._lock:
            job = self._jobs.popleft() if self._jobs else None
        if job is None:
            return
        budget = max(self.core.manifest.capacities.prefill_chunk_tokens, 512)
        try:
            finished = job.step(self.model, budget, self.stats)
            result = job.result() if finished else None
        except Exception as exc:  # noqa: BLE001 - the job's client gets it; the thread serves on
            log.warning("%s failed: %s: %s", type(job).__name__, type(exc).__name__, exc)
            self.stats["failed_model_jobs"] += 1
            job.done(None, as_error(exc))
            return
        if not finished:
            with self._lock:
                self._jobs.appendleft(job)
            return
        job.done(result, None)

    def _fail_jobs(self, error: FlareError) -> None:
        with self._lock:
            jobs = list(self._jobs)
            self._jobs.clear()
        for job in jobs:
            job.done(None, error)

    def _needs_empty_window(self, plan) -> bool:
        """A grammar row's mask needs its previous token on the host: such a step never stacks."""
        for h in plan.handles:
            live = self._by_handle.get(int(h))
            if live is not None and live.grammar is not None:
                return True
        return False

    def _idle_ok(self) -> bool:
        # Live requests with nothing plannable: everyone is finished/cancelled and draining.
        return all(l.terminal_sent for l in self._by_handle.values())

    def _take_ingress(self) -> bool:
        with self._lock:
            new = list(self._ingress)
            self._ingress.clear()
            cancels = list(self._cancels)
            self._cancels.clear()
            stopping = self._stopping
        for live in new:
            self._by_id[live.request.request_id] = live
            live.admitted_ns = time.monotonic_ns()
            self._enqueue(live)
        for rid in cancels:
            live = self._by_id.get(rid)
            if live is None or live.terminal_sent:
                continue
            if live.handle == 0:  # still pending
                self._pending.remove(live)
                self._terminal(live, FinishEvent("cancelled", len(live.request.prompt_token_ids), 0,
                                                 live.num_generated, 0, 0))
                self._forget(live)
            else:
                self.stats["cancelled"] += 1
                self._end(live, "cancelled")
                self._on_retired(self.scheduler.cancel(live.handle))
        return stopping

    def _enqueue(self, live: _Live) -> None:
        """Into the queue for a slot: behind every waiting request of the same or a lower priority value (vLLM's
        priority; FIFO among equals)."""
        pending = self._pending
        i = len(pending)
        while i > 0 and pending[i - 1].request.priority > live.request.priority:
            i -= 1
        pending.insert(i, live)

    def _lora_resident(self, index: int) -> bool:
        """With adapter swapping: whether adapter ``index`` holds a slot of the CUDA graphs' stack, bringing it into
        a free one, or into the slot of the loaded adapter asked for least recently that no admitted request uses
        (its factors stay in host memory). False: every slot is in use; the request naming it waits. The copies
        run on the model stream, behind the steps in flight, so no step sees a half-written slot."""
        stack = self.executor.decoder.lora
        self._lora_ticks += 1
        if stack.slot_of(index) is not None:
            self._lora_used[index] = self._lora_ticks
            return True
        factors = self._lora_host.get(index)
        if factors is None:
            raise AdmissionError(f"LoRA adapter {index} was unloaded", ErrorKind.NOT_FOUND)
        if stack.free_slot() is None:
            held = {live.request.lora for live in self._by_id.values() if live.handle}
            idle = [i for i in stack.slot_adapter if i != -1 and i not in held]
            if not idle:
                return False
            victim = min(idle, key=lambda i: self._lora_used.get(i, 0))
            self.executor.release_lora(victim)
            log.info("per-request LoRA adapter %d leaves its slot for adapter %d", victim, index)
        self.executor.install_lora(factors, index)
        self.stats["lora_swaps_in"] += 1
        self._lora_used[index] = self._lora_ticks
        return True

    def _lora_victim(self, spared: set[int]) -> int | None:
        """The adapter holding a slot, outside ``spared``, asked for least recently: the one a request waiting for a
        slot has the requests behind it leave alone until it drains (None: every holder is spared)."""
        held = [i for i in self.executor.decoder.lora.slot_adapter if i != -1 and i not in spared]
        return min(held, key=lambda i: self._lora_used.get(i, 0)) if held else None

    def _atomic_spans(self, req) -> tuple:
        """The prompt spans one prefill chunk must feed whole (flared.execution.images.atomic_spans)."""
        from flared.execution.images import atomic_spans

        return atomic_spans(getattr(self.executor, "model", None), req.vision)

    def _admit(self, now: int) -> None:
        i = 0
        # With adapter swapping: adapters whose requests wait this turn. A request whose adapter finds every slot in
        # use waits, and so do the requests behind it naming its adapter or the slot holder it waits on
        # (_lora_victim): that one's running requests finish and no later one takes their place, so an adapter in
        # constant use cannot keep another out. Base requests and the other adapters' go on.
        blocked: set[int] = set()
        while i < len(self._pending):
            live = self._pending[i]
            req = live.request
            try:
                if req.lora and self._lora_swapping and (req.lora in blocked or not self._lora_resident(req.lora)):
                    if req.lora not in blocked:
                        blocked.add(req.lora)
                        victim = self._lora_victim(blocked)
                        if victim is not None:
                            blocked.add(victim)
                    i += 1  # it waits for a slot; the requests behind it go on
                    continue
                # Without the prefix cache, a fresh random conditioning identity at
                # position 0 makes every key of this request unique: nothing is reused.
                conditioning = () if self.prefix_cache else ((0, os.urandom(32)),)
                if req.cache_salt is not None and self.prefix_cache:
                    conditioning = ((0, _salt_identity(req.cache_salt)),)
                if req.lora and self.prefix_cache:  # an adapter's prefixes are its own (K/V differ)
                    salted = conditioning[0][1] if conditioning else b""
                    conditioning = ((0, hashlib.sha256(self._lora_ids[req.lora - 1] + salted).digest()),)
                if req.score_from is not None and self.prefix_cache:
                    conditioning = conditioning + ((req.score_from, os.urandom(32)),)
                if req.vision is not None and self.prefix_cache:  # a cached prefix holds its images' rows
                    conditioning = conditioning + tuple((int(p), ident) for p, ident in req.vision.spans)
                handle = self.scheduler.admit(
                    list(req.prompt_token_ids), req.params.max_tokens, now,
                    message_boundaries=req.message_endpoints if self.prefix_cache else (),
                    conditioning=conditioning,
                    # Scoring the whole prompt: no shared context to reuse, the scheduler's scored prefill fits.
                    score_prompt=req.score_from is not None and req.score_from <= 1,
                    priority=req.priority,
                    # drafts are checked by drawing at their positions: only requests whose draws the executor
                    # can make there (SamplingParams.replayable on the CPU, graph_drawable on the GPU)
                    speculate=bool(self.spec_tokens) and req.score_from is None
                    and self.executor.speculates(req.params, grammar=req.grammar is not None),
                    prediction=req.prediction,
                    atomic_spans=self._atomic_spans(req))
                if req.grammar is not None and live.grammar is None:
                    live.grammar = req.grammar.matcher()
                if req.score_from is not None:
                    live.scores = []
                live.sampler_state = self.executor.sampler.add_sequence(req.params, req.prompt_token_ids,
                                                                        grammar=live.grammar)
                live.sampler_state.lora = req.lora
                live.sampler_state.vision = req.vision
            except AdmissionError as e:
                if e.kind is ErrorKind.MODEL_CAPACITY:
                    if self.scheduler.num_live == 0:
                        # Nothing will free room: this request can never fit.
                        del self._pending[i]
                        self._terminal(live, ErrorEvent(e))
                        self._forget(live)
                        continue
                    return  # wait for a slot or pages
                del self._pending[i]
                self._terminal(live, ErrorEvent(e))
                self._forget(live)
                continue
            del self._pending[i]
            live.handle = handle
            live.reused_tokens = int(self.scheduler.request(handle).reused_tokens)
            self._by_handle[handle] = live
            self.stats["admitted"] += 1

    def _commit(self, plan, now: int):
        s = self.scheduler
        fence = s.last_committed_fence + 1
        handles = [int(h) for h in plan.handles]
        block_tables = [s.block_table(h) for h in handles]
        states = [self._by_handle[h].sampler_state if h in self._by_handle else None for h in handles]
        score_from = [self._by_handle[h].request.score_from if h in self._by_handle else None for h in handles]
        s.commit(plan, fence)
        self.steps += 1
        if self._fail_after_steps is not None and self.steps > self._fail_after_steps:
            raise ExecutionError("injected model-thread failure (--debug-fail-after-steps)")
        for h in handles:
            live = self._by_handle.get(h)
            if live is not None and not live.scheduled_ns:
                live.scheduled_ns = now
        return fence, handles, block_tables, states, score_from

    def _execute(self, plan, now: int) -> None:
        """One step, synchronously (the eager CPU executor, or pipelining off)."""
        fence, handles, block_tables, states, score_from = self._commit(plan, now)
        records, duration_ns, logprobs, scores = self.executor.run(plan, block_tables, states, score_from)
        self._finish_step(plan, fence, handles, records, duration_ns, logprobs, scores)

    def _submit(self, plan, now: int) -> None:
        """Launch one step without waiting for it (the GPU executor's two-frame window)."""
        fence, handles, block_tables, states, score_from = self._commit(plan, now)
        if self.executor.submit(plan, block_tables, states, score_from) is None:
            raise ExecutionError("the executor refused a step the scheduler allowed (window full)")
        self._inflight.append((fence, plan, handles, self._needs_empty_window(plan)))

    def _complete_oldest(self) -> None:
        """Wait for the oldest in-flight step and publish what it produced."""
        polled = self.executor.poll(block=True)
        if polled is None:
            raise ExecutionError("the executor has no step in flight but the model thread expected one")
        fence, plan, handles, _ = self._inflight.popleft()
        _, records, duration_ns, logprobs, scores = polled
        self._finish_step(plan, fence, handles, records, duration_ns, logprobs, scores)

    def _finish_step(self, plan, fence: int, handles: list[int], records, duration_ns: int, logprobs,
                     scores) -> None:
        s = self.scheduler
        done_ns = time.monotonic_ns()
        result = s.complete(fence, records, duration_ns, done_ns)
        kind_name = plan.kind_name.lower()
        self.stats[f"launches_{kind_name}"] += 1
        if kind_name in ("prefill", "scored_prefill"):
            self.stats["prompt_tokens"] += int(plan.num_tokens.sum())
        self.stats["generated_tokens"] += len(result.emitted)
        telemetry = self.telemetry
        if telemetry is not None:
            telemetry.record(done_ns, int(plan.kind), int(plan.batch_capacity), int(plan.token_capacity),
                             len(handles), int(duration_ns), handles,
                             estimate_ns=int(plan.estimated_duration_ns))
        index = {h: i for i, h in enumerate(handles)}
        if kind_name == "speculative" and records.accepted_drafts is not None:  # each participant's drafts fed, kept
            for i, h in enumerate(handles):
                live = self._by_handle.get(h)
                if live is not None:
                    live.drafted += int(plan.num_tokens[i]) - 1
                    live.accepted_drafts += len(records.accepted_drafts[i])
        spoken: dict[int, int] = {}  # a speculative participant's tokens emitted so far this step
        # Handles this completion already released (a last token at max_tokens): nothing left to finish.
        released = {int(h) for h in result.retired}
        for h, chunk_scores in zip(handles, scores):
            live = self._by_handle.get(h)
            if chunk_scores is not None and live is not None and live.scores is not None:
                live.scores.extend(chunk_scores)
        for handle, token in result.emitted:
            live = self._by_handle.get(handle)
            if live is None or live.terminal_sent:
                continue
            if live.scores is not None:
                # The prompt is fed: report the scores, never the sample.
                live.sink.put(ScoredEvent(tuple(live.scores)))
                self._end(live, "stop")
                if handle not in released:
                    self._on_retired(s.finish(handle, done_ns))
                continue
            # A matcher that failed while computing this step's mask allows only EOS, and accepts it: check both.
            if live.grammar is not None and (not live.grammar.consume(token) or live.grammar.failed):
                self._terminal(live, ErrorEvent(ExecutionError(
                    f"constrained decoding failed after {live.grammar.num_consumed} tokens: token {token} "
                    f"is outside the grammar ({live.grammar.error or 'no allowed continuation'})",
                    ErrorKind.EXECUTION)))
                if handle not in released:
                    self._on_retired(s.finish(handle, done_ns))
                continue
            if not live.first_token_ns:
                live.first_token_ns = done_ns
            live.num_generated += 1
            if live.last_output_ns != done_ns:
                live.last_output_ns = done_ns
                live.num_bursts += 1
            lp = logprobs[index[handle]]
            if isinstance(lp, tuple):  # a speculative step's: one a token, the kept drafts' then its own
                k = spoken.get(handle, 0)
                spoken[handle] = k + 1
                lp = lp[k] if k < len(lp) else None
            live.sink.put(TokenEvent((token,), (lp,) if lp is not None else None))
            if token in live.request.stop_token_ids:
                self._end(live, "stop")
                if handle not in released:
                    self._on_retired(s.finish(handle, done_ns))
        for handle in result.finished:
            live = self._by_handle.get(handle)
            if live is not None and not live.terminal_sent:
                self._end(live, "length")
        self._on_retired(result.retired)

    def _end(self, live: _Live, reason: str) -> None:
        req = live.request
        self._terminal(live, FinishEvent(
            reason, len(req.prompt_token_ids), live.reused_tokens, live.num_generated,
            live.scheduled_ns - live.admitted_ns if live.scheduled_ns else 0,
            live.first_token_ns - live.admitted_ns if live.first_token_ns else 0, live.drafted, live.accepted_drafts))

    def _terminal(self, live: _Live, event) -> None:
        if live.terminal_sent:
            return
        live.terminal_sent = True
        if isinstance(event, ErrorEvent):
            self.stats["failed_requests"] += 1
        live.sink.put(event)
        with self._lock:
            self._outstanding_ids.discard(live.request.request_id)

    def _on_retired(self, handles) -> None:
        for handle in handles:
            live = self._by_handle.pop(int(handle), None)
            if live is None:
                continue
            if live.sampler_state is not None:
                self.executor.sampler.release(live.sampler_state)
                live.sampler_state = None
            self._forget(live)

    def _forget(self, live: _Live) -> None:
        self._by_id.pop(live.request.request_id, None)

    def _cancel_everything(self) -> None:
        self._fail_jobs(AdmissionError("the model stopped serving before this request ran", ErrorKind.UNAVAILABLE))
        for live in list(self._pending):
            self._terminal(live, FinishEvent("cancelled", len(live.request.prompt_token_ids), 0, 0, 0, 0))
            self._forget(live)
        self._pending.clear()
        for handle, live in list(self._by_handle.items()):
            if not self.scheduler.request(handle).cancelled:
                self._end(live, "cancelled")
                self._on_retired(self.scheduler.cancel(handle))

    def _fail_all(self, error: FlareError) -> None:
        self._fail_jobs(error)
        with self._lock:
            queued = list(self._ingress)
            self._ingress.clear()
        for live in [*queued, *self._pending, *self._by_handle.values()]:
            self._terminal(live, ErrorEvent(error))
        self._pending.clear()
        self._by_handle.clear()
        self._by_id.clear()
