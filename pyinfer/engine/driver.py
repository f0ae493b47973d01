"""The driver loop: load a GGUF, keep a KV cache, run the prompt in batches, then one native graph call
per generated token. Sampling and detokenizing stay in Python; nothing per-op is."""

from __future__ import annotations

import dataclasses
import math
import os
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from pyinfer import arguments, models
from pyinfer.engine.expert_cache import ExpertCache
from pyinfer.engine.machine import resolve as resolve_machine
from pyinfer.engine.offload import apply_plan, offload_layers
from pyinfer.engine.placement import (
    STREAM_MIN_TOKENS,
    BudgetTooSmallError,
    MachineProfile,
    Plan,
    ffn_weight_type,
    format_bytes,
    logit_rows,
    model_costs,
    parse_bytes,
    solve,
)
from pyinfer.engine.sampling import Sampler, SamplerParams
from pyinfer.engine.threads import default_threads
from pyinfer.errors import ContextFullError, InvalidArgumentError, ModelFormatError, UnsupportedError
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.formats.tokenizer import Tokenizer
from pyinfer.models import moe, sparse_ffn
from pyinfer.models.common import Builder, GraphInputs
from pyinfer.native import ggml
from pyinfer.native.binding import lib

KV_TYPES = {"f32": ggml.F32, "f16": ggml.F16}
_MAX_CACHED_GRAPHS = 4  # decode graph, full prompt batch, and a few remainders
# precise="auto": models whose weights are at most this many bytes get precise CPU matmuls. Small models
# decide between near-equal tokens often (SmolLM2-135M Q4_1: "The" over "L" by 0.08 nats, flipped by the
# 8-bit activations), and their matmuls are cheap enough to pay for 16-bit activations (a second byte product a
# weight: 1.1-1.4x a rounded dot's time, 2x in the Q4_K tile). Larger models pay more (Qwen2.5-0.5B Q4_K_M, 491 MB,
# when precise still meant two whole dots: tg 0.6x, pp 0.5x on 2 cores; docs/BENCHMARKS.md) and gain nothing measurable
PRECISE_MAX_BYTES = 256 << 20
AUTO_MARGIN = 1 << 30  # --vram-budget auto: the GPU's free memory less this (other processes, fragmentation)
# a budget of 0 puts nothing on the GPU: the figures are not used then
_CPU_ONLY = MachineProfile("cpu only", 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0)
_PLANS: dict[tuple, Plan] = {}
# a model with recurrent layers keeps their states as they stood at the end of its last this many prompts: a
# recurrent state cannot step back, so a chat turn or a cached prompt that shares only part of the sequence restarts
# from the latest of these within the shared part (llama.cpp's server keeps such context checkpoints too)
STATE_CHECKPOINTS = 4


def host_array(shape, dtype, pinned: bool) -> np.ndarray:
    """An array in host memory, pinned for copies to and from the GPU when asked (and a GPU is there): a copy from
    the device into fresh pageable pages runs at a fifth of the speed (a decoded token's 248k logits took 170 us,
    Qwen3.5-9B's recurrent states 10 ms a prompt, on the GPU machine); unpinned when the array is freed."""
    out = np.empty(shape, dtype)
    if not pinned or not ggml.cuda_available():
        return out
    buffer = ggml.ffi.from_buffer(out)
    if lib.ggml_cuda_host_register(buffer, out.nbytes, False) != lib.GGML_STATUS_OK:
        lib.ggml_clear_error()  # still correct, only slower
        return out
    holder = np.ndarray(shape, dtype, buffer=out)  # the array the caller keeps; the finalizer unpins after it goes
    weakref.finalize(holder, lib.ggml_cuda_host_unregister, buffer)
    return holder


class KVCache:
    """Per layer K and V: (n_ctx, n_head_kv, head_dim) each (that layer's sizes), in one context; a layer that
    shares another's KV (Gemma 4) holds that layer's tensors. A linear-attention layer (Qwen3.5) has none but two
    F32 states of a fixed size: its convolution's last inputs `conv` (K-1, channels) and its delta rule's matrices
    `ssm` (H_v, D, D); the others hold None there."""

    def __init__(self, cfg, n_ctx: int, kv_type: int):
        own = [il for il in range(cfg.n_layer) if cfg.kv_layer(il) == il and not cfg.recurrent(il)]
        sizes = {il: ggml.row_size(kv_type, cfg.layer_head_dim(il)) * cfg.layer_n_head_kv(il) * n_ctx for il in own}
        recurrent = [il for il in range(cfg.n_layer) if cfg.recurrent(il)]
        conv_shape, ssm_shape = cfg.ssm_state_shapes
        state_bytes = 4 * (math.prod(conv_shape) + math.prod(ssm_shape)) if recurrent else 0
        self.ctx = ggml.Context(sum(2 * (size + 4096) for size in sizes.values())
                                + len(recurrent) * (state_bytes + 8192) + (1 << 16))
        self.k, self.v, self.conv, self.ssm = [], [], [], []
        for il in range(cfg.n_layer):
            if il in sizes:
                shape = (n_ctx, cfg.layer_n_head_kv(il), cfg.layer_head_dim(il))
                self.k.append(self.ctx.new_tensor(kv_type, shape))
                self.v.append(self.ctx.new_tensor(kv_type, shape))
            else:  # a recurrent layer's none, or the layer's whose KV this one shares
                self.k.append(None if il in recurrent else self.k[cfg.kv_layer(il)])
                self.v.append(None if il in recurrent else self.v[cfg.kv_layer(il)])
            self.conv.append(self.ctx.new_tensor(ggml.F32, conv_shape) if il in recurrent else None)
            self.ssm.append(self.ctx.new_tensor(ggml.F32, ssm_shape) if il in recurrent else None)
        self.n_ctx = n_ctx
        self.nbytes = 2 * sum(sizes.values()) + len(recurrent) * state_bytes

    @property
    def states(self) -> list[ggml.Tensor]:
        """The recurrent layers' state tensors (none without linear attention)."""
        return [t for pair in zip(self.conv, self.ssm, strict=True) for t in pair if t is not None]


@dataclass
class Timings:
    """llama.cpp's perf counters: load, prompt eval and eval time, token counts."""

    load_ms: float = 0.0
    prompt_ms: float = 0.0
    prompt_tokens: int = 0
    eval_ms: float = 0.0
    eval_tokens: int = 0
    sample_ms: float = 0.0
    extra: dict = field(default_factory=dict)

    def reset(self) -> None:
        self.prompt_ms = self.eval_ms = self.sample_ms = 0.0
        self.prompt_tokens = self.eval_tokens = 0
        for key in ("ffn_rows_active", "ffn_rows_total", "ffn_channels_active", "ffn_channels_total",
                    "attn_channels_active", "attn_channels_total", "routings_gpu", "routings_total"):
            if key in self.extra:
                self.extra[key] = 0

    def report(self, prefix: str = "pyinfer_perf_context_print") -> str:
        def rate(ms, n):
            per = ms / n if n else 0.0
            tps = 1e3 * n / ms if ms > 0 else 0.0
            return f"({per:8.2f} ms per token, {tps:8.2f} tokens per second)"

        total = self.load_ms + self.prompt_ms + self.eval_ms + self.sample_ms
        return "\n".join([
            f"{prefix}:        load time = {self.load_ms:10.2f} ms",
            f"{prefix}: prompt eval time = {self.prompt_ms:10.2f} ms / {self.prompt_tokens:5d} tokens "
            + rate(self.prompt_ms, self.prompt_tokens),
            f"{prefix}:        eval time = {self.eval_ms:10.2f} ms / {self.eval_tokens:5d} runs   "
            + rate(self.eval_ms, self.eval_tokens),
            f"{prefix}:       total time = {total:10.2f} ms / {self.prompt_tokens + self.eval_tokens:5d} tokens",
            *self._sparse_lines(prefix),
            *self._routing_lines(prefix),
        ])

    def _routing_lines(self, prefix: str) -> list[str]:
        """A mixture's decoded tokens: the share of their routings (token, expert) the GPU's experts served."""
        if not self.extra.get("routings_total"):
            return []
        x = self.extra
        return [f"{prefix}:  experts on the GPU = {100.0 * x['routings_gpu'] / x['routings_total']:6.2f} % of "
                f"{x['routings_total']} routings of decoded tokens"]

    def _sparse_lines(self, prefix: str) -> list[str]:
        """The sparse FFN's realised density and the predictors' share of a decoded token's time."""
        if "ffn_rows_total" not in self.extra:
            return []
        x = self.extra
        # only the CPU's neurons are counted: the GPU's masks stay on the device
        density = (f"{100.0 * x['ffn_rows_active'] / x['ffn_rows_total']:6.2f} % of the CPU's neurons"
                   if x["ffn_rows_total"] else "not counted (every neuron on the GPU)")
        if x.get("ffn_channels_total"):  # an input file's gate and up
            channels = 100.0 * x["ffn_channels_active"] / x["ffn_channels_total"]
            density += f", {channels:.2f} % of gate's and up's channels"
        if x.get("attn_channels_total"):  # and its attention projections' (models.sparse_attention)
            density += f", {100.0 * x['attn_channels_active'] / x['attn_channels_total']:.2f} % of the attention's"
        pred_ms = x.get("predictor_ms", 0.0)
        per_token = self.eval_ms / self.eval_tokens if self.eval_tokens else 0.0
        share = 100.0 * pred_ms / per_token if per_token > 0 else 0.0
        return [f"{prefix}:   sparse FFN density = {density}, predictors "
                f"{pred_ms:.2f} ms per token ({share:.1f} % of eval time)"]


class _StepGraph:
    """One planned graph for a fixed number of tokens; inputs are written before each compute."""

    def __init__(self, model: Model, n_tokens: int, n_out: int, capture: bool = False):
        cfg = model.config
        self.ctx = ggml.Context(8 << 20)
        if model.plan is not None:  # the dequantized rows' scratch the plan counted
            self.ctx.set_gemm_scratch(model.plan.gemm_scratch)
        tokens = self.ctx.new_tensor(ggml.I32, (n_tokens,))
        pos = self.ctx.new_tensor(ggml.I32, (n_tokens,))
        pos_ids = self.ctx.new_tensor(ggml.I32, (n_tokens,)) if cfg.pos_offset else None
        self.inputs = GraphInputs(tokens=tokens, pos=pos, n_out=n_out, pos_ids=pos_ids)
        self.captured: dict[str, ggml.Tensor] = {}
        spec = (dataclasses.replace(model.sparse_spec, masks={}, channel_masks={}, attn_masks={})
                if model.sparse_spec else None)
        # a prompt batch of a model partly in host memory runs on the GPU, its host weights streamed in
        stream = n_tokens >= STREAM_MIN_TOKENS and model.streams_prompts and not capture
        # --timings counts a mixture's decoded routings by side: the router's choices are outputs then (reading
        # those of a GPU router costs a copy a layer, which only a timed model pays)
        self.routes = cfg.is_moe and (model.timed or model.expert_cache is not None) and n_tokens == 1
        builder = Builder(self.ctx, cfg, model.weights, model.kv_cache,
                          self.captured if capture or self.routes else None, spec, hot_rows=model.hot_rows,
                          stream=stream, precise=model.precise)
        self.logits = models.builder_for(cfg.arch)(builder, self.inputs)  # (n_out, n_vocab)
        # the masks the host can count for free: per layer (n_tokens, rows) of the neurons the CPU computes
        # (the builder records no GPU layer's: reading one would cost a copy and a wait per layer and token)
        masks = list(spec.masks.values()) if spec else []
        channels = list(spec.channel_masks.values()) if spec else []  # an input file's: (n_tokens, n_embd) each
        attn_channels = list(spec.attn_masks.values()) if spec else []  # its attention projections' inputs
        if stream:
            model.pin_host_weights()
        self.graph = ggml.Graph(self.ctx, [self.logits, *self.captured.values(), *masks, *channels, *attn_channels],
                                stream_min_cols=STREAM_MIN_TOKENS if stream else 0).plan()
        self.mask_tensors = masks
        self.mask_rows = sum(m.shape[-1] for m in masks)  # neurons the masks cover per token
        self.channel_masks = [m.numpy() for m in channels]  # on the host, as the CPU's layers are
        self.channel_rows = sum(m.shape[-1] for m in channels)
        self.attn_masks = [m.numpy() for m in attn_channels]
        self.attn_rows = sum(m.shape[-1] for m in attn_channels)
        # host masks are read through views made once (a strided view costs microseconds a layer a token)
        self._mask_views = [None if m.on_device else m.numpy() for m in masks]
        self._tokens, self._pos = tokens.numpy(), pos.numpy()
        self._pos_ids = pos_ids.numpy() if pos_ids is not None else None
        self.shape = (n_out, cfg.n_vocab)
        # host outputs are read through views made once; device outputs are copied after each compute, a decoded
        # token's through pinned memory
        self._logits = None if self.logits.on_device else self.logits.numpy().reshape(self.shape)
        self._pinned = host_array(self.shape, np.float32, True) if self.logits.on_device and n_out == 1 else None
        self.pos_offset = cfg.pos_offset

    @property
    def masks(self) -> list[np.ndarray]:
        return [m.numpy() if v is None else v for m, v in zip(self.mask_tensors, self._mask_views, strict=True)]

    def run(self, pool: ggml.ThreadPool, tokens, n_past: int) -> np.ndarray:
        self._tokens[:] = tokens
        self._pos[:] = np.arange(n_past, n_past + len(tokens), dtype=np.int32)
        if self._pos_ids is not None:
            self._pos_ids[:] = self._pos + self.pos_offset
        self.graph.compute(pool)
        # the caller owns the result: host views are copied, device reads are fresh arrays already
        if self._pinned is not None:
            self.logits.read_into(self._pinned)
            return self._pinned.copy()
        return self.logits.numpy().reshape(self.shape) if self._logits is None else self._logits.copy()

    def active_rows(self) -> int:
        """Neurons (token, layer, row) the last compute's down projections summed."""
        return _selected(self.masks)


def _selected(masks: list[np.ndarray]) -> int:
    """Entries the masks select (positive) in all."""
    return sum(int(np.count_nonzero(m > 0)) for m in masks)


class Model:
    """A loaded model: `pyinfer.Model(path)`, then tokenize / logits / generate."""

    def __init__(self, path: str | os.PathLike[str], *, n_ctx: int = 0, n_batch: int = 512,
                 n_threads: int | None = None, kv_type: str = "f16", sparse: bool | None = None,
                 sparsity_threshold: float = 0.0, oracle: bool = False, n_gpu_layers: int = 0,
                 vram_budget: int | str | None = None, machine: MachineProfile | str | None = None,
                 plan: Plan | None = None, timed: bool = False, precise: bool | str = "auto", n_cpu_moe: int = 0,
                 expert_cache: bool = False):
        """sparse: the predicted-neuron FFN (None: on when the file has predictors); sparsity_threshold is
        added to the predictors' logit threshold (higher = fewer neurons); oracle (tests) masks with the
        true active set, computed densely. n_gpu_layers: the output head and the last n - 1 layers live and run
        on the GPU, as llama.cpp's -ngl (n_layer + 1 or more: the whole model). vram_budget: bytes of GPU memory
        the model may use ("auto": the free memory less a margin; 0: none), placed by pyinfer.engine.placement: per
        layer the attention and the hot neurons on the GPU, the rest on the CPU, both computing at once. machine: the
        figures the placement uses, or a preset name or profile file (default: measured on this machine once,
        then cached). plan: an explicit placement instead (for this file and context size; pyinfer.engine.placement).
        timed: each decode step records how long the CPU and the GPU were busy and overlapped (step_stats).
        precise: CPU matmuls over 16-bit activations instead of 8-bit ones (ggml_mul_mat_precise; about 1e-5
        relative instead of 4e-3, for 1.1-1.4x a rounded matmul's time); "auto": for models of at most
        PRECISE_MAX_BYTES.
        n_cpu_moe: with n_gpu_layers, the experts of a mixture's first n_cpu_moe layers stay on the CPU (llama.cpp's
        --n-cpu-moe). expert_cache: a mixture's split layers re-place their experts while decoding
        (engine.expert_cache)."""
        t0 = time.perf_counter()
        if kv_type not in KV_TYPES:
            raise InvalidArgumentError(f"KV cache type must be one of {', '.join(KV_TYPES)}, not {kv_type!r}")
        n_ctx = arguments.integer("n_ctx", n_ctx, 0, 2**31 - 1)
        n_batch = arguments.integer("n_batch", n_batch, 1, 2**31 - 1)
        n_threads = n_threads and arguments.integer("n_threads", n_threads, 1, 1024)
        n_gpu_layers = arguments.integer("n_gpu_layers", n_gpu_layers)
        n_cpu_moe = arguments.integer("n_cpu_moe", n_cpu_moe, 0)
        sparsity_threshold = arguments.number("sparsity_threshold", sparsity_threshold)
        if precise not in (True, False, "auto"):
            raise InvalidArgumentError(f"precise must be True, False or 'auto', not {precise!r}")
        self.file = GGUFFile(path)
        self.config = cfg = self.file.config
        self.precise = self.file.tensor_bytes <= PRECISE_MAX_BYTES if precise == "auto" else precise
        self.tokenizer = Tokenizer.from_gguf_metadata(self.file.metadata)
        models.builder_for(cfg.arch)  # unsupported architectures fail before anything is allocated
        self.n_ctx = min(n_ctx or 4096, cfg.n_ctx_train) if cfg.pos_offset else (n_ctx or min(cfg.n_ctx_train, 4096))
        self.n_batch = n_batch
        # with the whole model on the GPU the CPU only looks up embeddings: one thread, no barriers (unless
        # --n-cpu-moe leaves experts to it)
        self.n_threads = n_threads or (1 if n_gpu_layers > cfg.n_layer and not n_cpu_moe else default_threads())
        # the file's tensors, and per layer those made at load (expert biases) or by a split (its two sides)
        self.weights_ctx = ggml.Context(1024 * (len(self.file.tensors) + 12 * cfg.n_layer + 16), no_alloc=True)
        self.weights: dict[str, ggml.Tensor] = {}
        for name, info in self.file.tensors.items():
            widen = name.endswith("ssm_conv1d.weight") and info.type != ggml.F32  # the convolution takes F32 taps
            try:
                t = self.weights_ctx.new_tensor(ggml.F32 if widen else info.type, tuple(reversed(info.ne)))
            except InvalidArgumentError as exc:  # a type the engine lacks
                raise UnsupportedError(f"{self.file.path}: tensor {name}: {exc}") from None
            t.set_data(self.file.dequantize(name).astype(np.float32) if widen else info.data)
            t.name = name
            self.weights[name] = t
        if cfg.expert_bias:  # gpt-oss: each layer's expert biases in the one tensor moe_ffn takes
            for il in range(cfg.n_layer):
                biases = moe.expert_biases(self.file, il)
                t = self.weights_ctx.new_tensor(ggml.F32, biases.shape)
                t.set_data(biases)
                t.name = f"blk.{il}.{moe.BIASES}"
                self.weights[t.name] = t
        self.kv_cache = KVCache(cfg, self.n_ctx, KV_TYPES[kv_type])
        self.sparse_spec = self._sparse_spec(sparse, sparsity_threshold, oracle)
        self.plan: Plan | None = None
        self.hot_rows: dict[int, int] = {}  # layers split inside their FFN: rows [0, k) on the GPU
        self.vram_budget: int | None = None
        if bool(n_gpu_layers) + (vram_budget is not None) + (plan is not None) > 1:
            raise InvalidArgumentError("-ngl, --vram-budget and a plan exclude each other: give one")
        if plan is not None and len(plan.attn_gpu) != cfg.n_layer:
            raise InvalidArgumentError(f"the plan is for {len(plan.attn_gpu)} layers, the model has {cfg.n_layer}")
        if vram_budget is not None:
            plan = self._solve(vram_budget, machine, kv_type)  # may measure the machine on models of its own
        # device bytes held before anything of this model; its peak counts from here (0 without a GPU)
        device_before = lib.ggml_cuda_peak_reset()
        if plan is not None:
            self.plan, self.vram_budget = plan, plan.budget
            self.hot_rows = apply_plan(self, plan)
            self.n_gpu_layers = sum(plan.attn_gpu) + plan.head_gpu
        else:
            self.n_gpu_layers = offload_layers(self, n_gpu_layers, n_cpu_moe)
        self.pool = ggml.ThreadPool(self.n_threads)
        if self.sparse_spec is not None and not oracle and self.sparse_spec.kind != "input":
            self._bundle_ffns()
        self._device_base = device_before
        self.streams_prompts = self._has_host_weights_and_gpu()
        self._pinned = None
        self._graphs: OrderedDict[tuple[int, int, bool], _StepGraph] = OrderedDict()
        self.timed = timed
        self._gpu_expert_masks: list[np.ndarray] | None = None
        self.expert_cache = ExpertCache(self) if expert_cache and cfg.is_moe and self.hot_rows else None
        self.step_stats: list[dict] = []  # per decode step when timed: wall, CPU/GPU busy and overlap (ms)
        self.tokens: list[int] = []  # the sequence in the KV cache
        self._checkpoints: list[tuple[int, list[np.ndarray]]] = []  # (n_past, each state's bytes then): see truncate
        self.timings = Timings(load_ms=1e3 * (time.perf_counter() - t0))
        if self.sparse_spec is not None:
            self.timings.extra.update(ffn_rows_active=0, ffn_rows_total=0, predictor_ms=self._predictor_ms())
            if self.sparse_spec.kind == "input":
                self.timings.extra.update(ffn_channels_active=0, ffn_channels_total=0)
            if self.sparse_spec.attn_input:
                self.timings.extra.update(attn_channels_active=0, attn_channels_total=0)

    def _solve(self, vram_budget: int | str, machine: MachineProfile | None, kv_type: str) -> Plan:
        """The placement for a budget ("auto": the GPU's free memory less AUTO_MARGIN)."""
        free = ggml.cuda_memory()[1] if ggml.cuda_available() else 0
        if vram_budget == "auto":
            vram_budget = max(0, free - AUTO_MARGIN) if ggml.cuda_available() else 0
        elif isinstance(vram_budget, str):
            vram_budget = parse_bytes(vram_budget)
        if vram_budget < 0:
            raise InvalidArgumentError(f"VRAM budget must be >= 0, not {vram_budget}")
        sparse = self.sparse_spec is not None and not self.sparse_spec.oracle
        costs = model_costs(self.file, self.n_ctx, 2 if kv_type == "f16" else 4, sparse, self.n_batch)
        if vram_budget and not isinstance(machine, MachineProfile):
            machine = resolve_machine(machine, ffn_weight_type(self.file), self.n_threads)
        stat = os.stat(self.file.path)
        key = (os.path.realpath(self.file.path), stat.st_size, stat.st_mtime_ns, self.n_ctx, kv_type, sparse,
               self.n_batch, vram_budget, machine)
        if key not in _PLANS:  # the solver can take seconds: a process that reloads a model reuses its plan
            _PLANS[key] = solve(costs, machine, vram_budget) if vram_budget else solve(costs, _CPU_ONLY, 0)
        plan = _PLANS[key]
        if plan.uses_gpu and ggml.cuda_available() and plan.device_bytes > free:
            raise BudgetTooSmallError(f"the plan needs {format_bytes(plan.device_bytes)} of GPU memory but only "
                                      f"{format_bytes(free)} is free: give a smaller --vram-budget")
        return plan

    def _has_host_weights_and_gpu(self) -> bool:
        """Some layer's weights live on the GPU and some in host memory (what prompt streaming helps)."""
        if not self.n_gpu_layers:
            return False
        names = [f"blk.{il}.{part}.weight" for il in range(self.config.n_layer)
                 for part in ("ffn_up", "ffn_up_exps", "attn_q")]
        return any(il in self.hot_rows for il in range(self.config.n_layer)) or any(
            not self.weights[n].on_device for n in names if n in self.weights)

    def pin_host_weights(self) -> None:
        """Registers the model file's mapping with the GPU once (read only), so the weights a prompt batch
        streams in are copied at full speed and inside CUDA graphs. Without it they still stream, slower."""
        if self._pinned is not None:
            return
        buffer = ggml.ffi.from_buffer(self.file.mmap_buffer)
        if lib.ggml_cuda_host_register(buffer, len(buffer), True) == lib.GGML_STATUS_OK:
            self._pinned = weakref.finalize(self, lib.ggml_cuda_host_unregister, buffer)
        else:
            lib.ggml_clear_error()
            self._pinned = False

    @property
    def head_on_gpu(self) -> bool:
        """Whether the output head is on the GPU: the plan's choice, or with -ngl any layer count (llama.cpp's -ngl
        counts the head first)."""
        return self.plan.head_gpu if self.plan is not None else self.n_gpu_layers > 0

    @property
    def device_bytes(self) -> int:
        """GPU memory this model's engine holds now (weights, KV cache, graph buffers, scratch, and the cuBLAS
        workspace when this model started the GPU)."""
        return lib.ggml_cuda_allocated() - self._device_base

    @property
    def device_peak_bytes(self) -> int:
        """The most GPU memory this model's engine has held at once: the library's high-water mark since this model
        began to place its weights, so a model loaded meanwhile counts too and a later one starts it again."""
        return lib.ggml_cuda_allocated_peak() - self._device_base

    def _count_routings(self, ids: dict[int, np.ndarray]) -> None:
        """Adds a decoded token's routings (expert ids per layer), and those its GPU experts served, to the timings."""
        x = self.timings.extra
        for il, layer_ids in ids.items():
            x["routings_gpu"] = x.get("routings_gpu", 0) + int(self._gpu_experts[il][layer_ids].sum())
            x["routings_total"] = x.get("routings_total", 0) + layer_ids.size

    def slots_changed(self) -> None:
        """The expert cache moved experts: prompt graphs, which cut their streamed chunks from the slots when built,
        are rebuilt, and the GPU's share is read anew."""
        for key in [k for k in self._graphs if k[0] > 1]:
            del self._graphs[key]
        self._gpu_expert_masks = None

    @property
    def _gpu_experts(self) -> list[np.ndarray]:
        """Per layer, which experts the GPU holds (a split layer's GPU slots; all or none of a whole one's)."""
        if self._gpu_expert_masks is None:
            masks = []
            for il in range(self.config.n_layer):
                slots = self.weights.get(f"blk.{il}.ffn_exps_slots.gpu")
                on_gpu = self.weights[f"blk.{il}.ffn_gate_exps.weight"].on_device
                masks.append(slots.numpy() >= 0 if slots is not None else np.full(self.config.n_expert, on_gpu))
            self._gpu_expert_masks = masks
        return self._gpu_expert_masks

    def _check_budget(self) -> None:
        if self.vram_budget is not None and self.device_bytes > self.vram_budget:
            raise BudgetTooSmallError(
                f"the model now holds {format_bytes(self.device_bytes)} of GPU memory, over the --vram-budget of "
                f"{format_bytes(self.vram_budget)}: its graph buffers for {self.n_batch}-token batches outgrew the "
                f"reserve; give a larger budget or a smaller -b")

    # --- sparse FFN ---
    @property
    def reads_channel_major(self) -> bool:
        """The FFN runs input sparsity: its decode reads the channel-major gate and up (a CPU layer's prompt batches
        the row-major ones, which never go to the GPU)."""
        return self.sparse_spec is not None and self.sparse_spec.kind == "input"

    def _sparse_spec(self, sparse: bool | None, logit_threshold: float, oracle: bool):
        if sparse is None:
            sparse = oracle or self.file.sparse_by_default
        if not sparse:
            return None
        if not (oracle or self.file.sparse_by_default):
            raise InvalidArgumentError(f"{self.file.path} has no predictors (blk.N.fc1/fc2): run pyinfer sparsify")
        if self.file.ffn_layout != "down_t":
            raise InvalidArgumentError("the sparse FFN needs a PowerGGUF (ffn_down_t): convert the model first")
        # per layer at most two vectors per neuron (a predictor's bias, down's threshold), two per channel (gate's
        # and up's threshold, q's, k's and v's) and one over the output projection's input, and their headers
        cfg = self.config
        q_dim = max(cfg.n_head * cfg.layer_head_dim(il) for il in range(cfg.n_layer))
        per_layer = 4 * (2 * cfg.widest_ff + 2 * cfg.n_embd + q_dim) + 4096
        self._sparse_ctx = ggml.Context(cfg.n_layer * per_layer + (1 << 16))
        return sparse_ffn.make_spec(self._sparse_ctx, self.file.tensors, self.file.metadata, self.config,
                                    logit_threshold=logit_threshold, oracle=oracle)

    def _bundle_ffns(self) -> None:
        """Adds blk.N.ffn_bundle for each CPU layer: its gate, up and down_t rows side by side, neuron by
        neuron, the layout of the fused sparse_ffn op, where a predicted neuron is one contiguous read
        instead of three scattered ones. Built once at load (as llama.cpp repacks Q4_0 for its CPU); the
        file's own FFN matrices are no longer read by decoding and stay only in the page cache."""
        cfg = self.config
        if cfg.ffn_kind not in ggml.SPARSE_FFN_KINDS:  # the fused op has no such activation (Falcon's ungated GELU)
            return
        parts = ("ffn_gate", "ffn_up", "ffn_down_t") if cfg.gated else ("ffn_up", "ffn_down_t")
        for il in range(cfg.n_layer):
            tag = ".cold" if il in self.hot_rows else ""  # a split layer bundles the CPU's rows only
            mats = [self.weights.get(f"blk.{il}.{name}{tag}.weight") for name in parts]
            if (any(m is None or m.on_device or m.type != mats[0].type for m in mats)
                    or any(f"blk.{il}.{name}.bias" in self.weights for name in parts)):
                continue
            n_rows = mats[0].ne[1]
            row = ggml.row_size(mats[0].type, cfg.n_embd)
            data = np.empty((n_rows, len(parts), row), np.uint8)
            for k, m in enumerate(mats):
                data[:, k] = m.raw().reshape(n_rows, row)
            bundle = self.weights_ctx.new_tensor(mats[0].type, (len(parts) * n_rows, cfg.n_embd))
            bundle.set_data(data)
            bundle.name = f"blk.{il}.ffn_bundle.weight"
            self.weights[bundle.name] = bundle

    def _predictor_ms(self, reps: int = 5) -> float:
        """Milliseconds one token spends in the predictors, timed on a graph of the predictors alone."""
        if self.sparse_spec.oracle or self.sparse_spec.kind == "input":
            return 0.0
        ctx = ggml.Context(1 << 20)
        x = ctx.tensor_from_numpy(np.random.default_rng(0).standard_normal(self.config.n_embd))  # (n_embd,)
        b = Builder(ctx, self.config, self.weights, None, sparse=self.sparse_spec)
        graph = ggml.Graph(ctx, [sparse_ffn.predict(b, il, x) for il in range(self.config.n_layer)]).plan()
        return graph.median_ms(self.pool, reps)

    # --- tokens ---
    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode(list(ids))

    # --- evaluation ---
    def _graph(self, n_tokens: int, n_out: int, capture: bool = False) -> _StepGraph:
        key = (n_tokens, n_out, capture)
        g = self._graphs.get(key)
        if g is None:
            if self.vram_budget is not None:
                # under a VRAM budget one decode graph and one batch graph: each holds device buffers for its
                # intermediates, and the reserve has room for one batch's (a 700-token prompt at -b 512 had kept
                # the 512- and the 188-token graphs)
                for same_kind in [k for k in self._graphs if (k[0] > 1) == (n_tokens > 1)]:
                    del self._graphs[same_kind]
            while len(self._graphs) >= _MAX_CACHED_GRAPHS:
                self._graphs.popitem(last=False)
            g = self._graphs[key] = _StepGraph(self, n_tokens, n_out, capture)
            if self.timed:
                g.graph.set_timed(True)
            self._check_budget()
        else:
            self._graphs.move_to_end(key)
        return g

    def eval(self, tokens, all_logits: bool = False) -> np.ndarray:
        """Appends tokens to the sequence in the KV cache; returns logits (n, n_vocab) of every new token
        when all_logits, else (n_vocab,) of the last one."""
        tokens = arguments.token_ids(tokens, self.config.n_vocab)
        if self.n_past + len(tokens) > self.n_ctx:
            raise ContextFullError(
                f"context full: {self.n_past} + {len(tokens)} tokens exceed the context size {self.n_ctx} (-c)")
        outs = self._eval_chunks(tokens, all_logits)
        if len(tokens) > 1 and self.kv_cache.states:
            self._checkpoint()
        out = np.concatenate(outs) if all_logits else outs[-1][-1]
        return out

    def _eval_chunks(self, tokens: np.ndarray, all_logits: bool) -> list[np.ndarray]:
        """eval's batches, each appended to self.tokens once computed: the logits of each that has some."""
        outs = []
        # a budgeted model's reserve holds the logits of logit_rows tokens: all of them come that many at a time
        step = logit_rows(self.n_batch) if all_logits and self.vram_budget is not None else self.n_batch
        for start in range(0, len(tokens), step):
            chunk = tokens[start:start + step]
            last_chunk = start + step >= len(tokens)
            n_out = len(chunk) if all_logits else (1 if last_chunk else 0)
            graph = self._graph(len(chunk), max(n_out, 1))
            try:
                logits = graph.run(self.pool, chunk, self.n_past)
                if n_out:
                    _check_finite(logits, self.n_past + len(chunk) - n_out)
            except BaseException:  # an error or Ctrl-C once the chunk ran: the recurrent states may be past the tokens
                if self.kv_cache.states:
                    del self.tokens[self._restore_states(self.n_past):]
                raise
            self.tokens.extend(int(t) for t in chunk)
            if self.timed and len(chunk) == 1:
                self.step_stats.append(graph.graph.stats())
            if graph.mask_tensors:
                self.timings.extra["ffn_rows_active"] += graph.active_rows()
                self.timings.extra["ffn_rows_total"] += len(chunk) * graph.mask_rows
            if graph.channel_masks:
                self.timings.extra["ffn_channels_active"] += _selected(graph.channel_masks)
                self.timings.extra["ffn_channels_total"] += len(chunk) * graph.channel_rows
            if graph.attn_masks:
                self.timings.extra["attn_channels_active"] += _selected(graph.attn_masks)
                self.timings.extra["attn_channels_total"] += len(chunk) * graph.attn_rows
            if graph.routes and len(tokens) == 1:  # a decoded token's (not a prompt's last chunk of one)
                ids = {il: graph.captured[f"moe_ids.{il}"].numpy().reshape(-1) for il in range(self.config.n_layer)}
                if self.timed:
                    self._count_routings(ids)
                if self.expert_cache is not None:
                    self.expert_cache.observe(ids)
            if n_out:
                outs.append(logits)
        return outs

    def _checkpoint(self) -> None:
        """Keeps the recurrent states as they stand now (after n_past tokens), the latest STATE_CHECKPOINTS; the
        arrays of one let go are reused (fresh ones cost page faults: 6 % of a 0.8B model's 512-token prompt)."""
        kept = [c for c in self._checkpoints if c[0] != self.n_past]
        n_old = max(0, len(kept) - (STATE_CHECKPOINTS - 1))
        dropped = [c for c in self._checkpoints if c[0] == self.n_past] + kept[:n_old]
        self._checkpoints = kept[n_old:]  # before its arrays are overwritten: a failed copy leaves no mixed one
        copies = dropped[0][1] if dropped else [host_array(t.nbytes, np.uint8, t.on_device)
                                                 for t in self.kv_cache.states]
        for t, copy in zip(self.kv_cache.states, copies, strict=True):
            t.read_into(copy)
        self._checkpoints.append((self.n_past, copies))

    def _restore_states(self, n_keep: int) -> int:
        """The recurrent states as the latest checkpoint within the first n_keep tokens left them (later ones are let
        go); returns its position, 0 without one (the next eval then starts from position 0, and zeros)."""
        self._checkpoints = [c for c in self._checkpoints if c[0] <= n_keep]
        if not self._checkpoints:
            return 0
        n, copies = self._checkpoints[-1]
        for t, data in zip(self.kv_cache.states, copies, strict=True):
            t.write(data)
        return n

    @property
    def n_past(self) -> int:
        """Tokens in the KV cache."""
        return len(self.tokens)

    @property
    def decode_graph_replayed(self) -> bool:
        """True when single-token steps run as a captured CUDA graph."""
        g = self._graphs.get((1, 1, False))
        return g is not None and g.graph.replayed

    def reset(self) -> None:
        """Forgets the sequence (the KV cache is overwritten from position 0, recurrent states start from zeros)."""
        self.tokens.clear()
        self._checkpoints.clear()

    def truncate(self, n_keep: int) -> None:
        """Keeps the first n_keep tokens of the sequence (later positions are overwritten when reused). Recurrent
        states cannot step back: a model with them keeps fewer, as many as its latest checkpoint within n_keep holds
        (none without one), and restores the states of that point."""
        n_keep = max(0, n_keep)
        if self.kv_cache.states and n_keep < self.n_past:
            n_keep = self._restore_states(n_keep)
        del self.tokens[n_keep:]

    def reuse_prefix(self, tokens) -> int:
        """Keeps the longest prefix of `tokens` that the KV cache already holds (for recurrent layers: up to their
        latest checkpoint within it), but never all of them (the last token must be evaluated for its logits);
        returns its length. Evaluate tokens[returned:] next."""
        common = 0
        for cached, wanted in zip(self.tokens, tokens[:-1], strict=False):
            if cached != wanted:
                break
            common += 1
        self.truncate(common)
        return self.n_past

    def ffn_activations(self, tokens) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Logits (n, n_vocab) of a fresh sequence (at most one batch) and, per layer il, the FFN input
        `ffn_inp.{il}` (n, n_embd) and hidden activations `ffn_act.{il}` (n, n_ff): what a profiler counts."""
        tokens = arguments.token_ids(tokens, self.config.n_vocab)
        if not 0 < len(tokens) <= min(self.n_batch, self.n_ctx):
            raise InvalidArgumentError(f"ffn_activations takes 1 to {min(self.n_batch, self.n_ctx)} tokens")
        self.reset()
        graph = self._graph(len(tokens), len(tokens), capture=True)
        logits = graph.run(self.pool, tokens, 0)
        self.tokens.extend(int(t) for t in tokens)
        n = len(tokens)
        acts = {name: t.numpy().reshape(n, -1).copy() for name, t in graph.captured.items()}
        return logits, acts

    def logits(self, tokens) -> np.ndarray:
        """Logits (n, n_vocab) of every token of a fresh sequence."""
        self.reset()
        return self.eval(tokens, all_logits=True)

    # --- generation ---
    def generate_tokens(self, prompt_tokens, n_predict: int, params: SamplerParams | None = None,
                        seed: int | None = None, stop_at_eos: bool = True,
                        should_stop: Callable[[], bool] | None = None) -> Iterator[int]:
        """Processes the prompt (after what is already cached) and yields up to n_predict sampled tokens."""
        n_predict = arguments.integer("n_predict", n_predict)
        sampler = Sampler(params or SamplerParams(), seed)
        history = [*self.tokens, *prompt_tokens]  # penalties see the cached prefix too
        t0 = time.perf_counter()
        logits = self.eval(prompt_tokens)
        self.timings.prompt_ms += 1e3 * (time.perf_counter() - t0)
        self.timings.prompt_tokens += len(prompt_tokens)
        stops = set(self.tokenizer.eot_ids) if stop_at_eos else set()
        for i in range(n_predict):
            t0 = time.perf_counter()
            token = sampler.sample(logits, history)
            self.timings.sample_ms += 1e3 * (time.perf_counter() - t0)
            if token in stops:
                return
            yield token
            history.append(token)
            if i + 1 == n_predict or (should_stop and should_stop()):
                return
            if self.n_past + 1 > self.n_ctx:
                raise ContextFullError(f"context full at {self.n_ctx} tokens (-c)")
            t0 = time.perf_counter()
            logits = self.eval([token])
            self.timings.eval_ms += 1e3 * (time.perf_counter() - t0)
            self.timings.eval_tokens += 1

    def generate(self, prompt: str, n_predict: int = 128, params: SamplerParams | None = None,
                 seed: int | None = None) -> str:
        """Text continuation of prompt on a fresh sequence."""
        self.reset()
        ids = self.generate_tokens(self.tokenize(prompt), n_predict, params, seed)
        return self.detokenize(list(ids))

    # --- OpenAI-shaped completions, llama-cpp-python's API (pyinfer.engine.completions does the work) ---
    def create_completion(self, prompt, **kwargs):
        """An OpenAI text completion dict, or with stream=True an iterator of chunk dicts."""
        from pyinfer.engine.completions import create_completion

        return create_completion(self, prompt, **kwargs)

    def create_chat_completion(self, messages, **kwargs):
        """An OpenAI chat completion dict of `messages` through the model's chat template, or with
        stream=True an iterator of chunk dicts: what `pyinfer serve` sends."""
        from pyinfer.engine.completions import create_chat_completion

        return create_chat_completion(self, messages, **kwargs)


def _check_finite(logits: np.ndarray, first_pos: int) -> None:
    """Logits with NaN or inf come from broken weights (a corrupt file, a wrong tensor type whose bytes
    fit): said plainly rather than sampled from. Their dot with themselves is finite when they all are (or
    overflows, then the values are looked at one by one): on the GPU machine's host it takes 37 us of a 248k
    vocabulary's logits, the elementwise test 68 us and its fresh array's pages as much again."""
    flat = logits.reshape(-1)
    if np.isfinite(np.dot(flat, flat)) or np.isfinite(logits).all():
        return
    row = int(np.flatnonzero(~np.isfinite(logits).all(axis=-1))[0])
    raise ModelFormatError(f"the model computed non-finite logits (NaN/inf) at position {first_pos + row}: "
                           "its weights are corrupt")
