"""Python face of the tensor library: contexts, tensors, ops, graphs, thread pools.

Shapes on this side are numpy order (outermost first), the reverse of ggml's `ne`.
"""

from __future__ import annotations

import time

import numpy as np

from pyinfer import arguments
from pyinfer.errors import InvalidArgumentError
from pyinfer.native.binding import check, check_ptr, ffi, lib

F32, F16, BF16 = lib.GGML_TYPE_F32, lib.GGML_TYPE_F16, lib.GGML_TYPE_BF16
Q4_0, Q4_1, Q5_0, Q8_0 = lib.GGML_TYPE_Q4_0, lib.GGML_TYPE_Q4_1, lib.GGML_TYPE_Q5_0, lib.GGML_TYPE_Q8_0
Q4_K, Q6_K, MXFP4, I32 = lib.GGML_TYPE_Q4_K, lib.GGML_TYPE_Q6_K, lib.GGML_TYPE_MXFP4, lib.GGML_TYPE_I32
WEIGHT_TYPES = (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K, MXFP4)
FFN_KINDS = ("relu", "reglu", "drelu", "swiglu", "geglu", "swiglu_oai")  # FFN activations, as enum ggml_ffn_kind
SPARSE_FFN_KINDS = FFN_KINDS[:5]  # sparse_ffn's (swiglu_oai, gpt-oss' experts', is moe_ffn's only)
ROPE_NORMAL, ROPE_NEOX = lib.GGML_ROPE_NORMAL, lib.GGML_ROPE_NEOX

_NUMPY_DTYPES = {F32: np.float32, F16: np.float16, I32: np.int32, lib.GGML_TYPE_I8: np.int8}


def cpu_features() -> dict[str, bool]:
    """The kernels this CPU runs, by llama.cpp's system_info names: AVX2 (with FMA and F16C), AVX512 (F),
    AMX_INT8 (the prompt GEMMs' tiles, usable by this process)."""
    return {"AVX2": bool(lib.ggml_cpu_has_avx2()), "AVX512": bool(lib.ggml_cpu_has_avx512()),
            "AMX_INT8": bool(lib.ggml_cpu_has_amx())}


def cuda_available() -> bool:
    """True when this build has CUDA and a GPU is present."""
    return lib.ggml_cuda_device_count() > 0


def cuda_device_name() -> str:
    return ffi.string(lib.ggml_cuda_device_name()).decode(errors="replace")


def cuda_memory() -> tuple[int, int, int]:
    """(bytes this process's engine holds on the GPU, the GPU's free bytes, its total bytes)."""
    free, total = ffi.new("size_t *"), ffi.new("size_t *")
    check(lib.ggml_cuda_mem_info(free, total))
    return lib.ggml_cuda_allocated(), free[0], total[0]


def type_name(type_: int) -> str:
    return ffi.string(lib.ggml_type_name(type_)).decode()


def block_size(type_: int) -> int:
    return lib.ggml_blck_size(type_)


def row_size(type_: int, n: int) -> int:
    """Bytes of n values of type_."""
    return lib.ggml_row_size(type_, n)


def quantize(type_: int, values: np.ndarray) -> np.ndarray:
    """Rows of float values (last axis a multiple of the block) -> raw bytes [..., row_size]."""
    src = np.ascontiguousarray(values, dtype=np.float32)
    n = src.shape[-1]
    if n % block_size(type_):  # rows sized by row_size would be too small for what the C side writes
        raise InvalidArgumentError(f"{type_name(type_)} rows take multiples of {block_size(type_)} values, not {n}")
    out = np.empty((*src.shape[:-1], row_size(type_, n)), dtype=np.uint8)
    check(lib.ggml_quantize(type_, ffi.from_buffer("float[]", src), ffi.from_buffer(out), src.size))
    return out


def dequantize(type_: int, raw: np.ndarray, n: int) -> np.ndarray:
    """Raw bytes holding n values of type_ -> float32 [n]."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if raw.size < row_size(type_, n):
        raise InvalidArgumentError(f"{raw.size} bytes hold fewer than {n} values of {type_name(type_)}")
    out = np.empty(n, dtype=np.float32)
    check(lib.ggml_dequantize(type_, ffi.from_buffer(raw), ffi.from_buffer("float[]", out), n))
    return out


class Tensor:
    """A handle on a ggml tensor; keeps alive the Python objects its data lives in."""

    __slots__ = ("ptr", "ctx", "_keep")

    def __init__(self, ptr, ctx: Context, keep=None):
        self.ptr = check_ptr(ptr)
        self.ctx = ctx
        self._keep = keep

    @property
    def type(self) -> int:
        return lib.ggml_get_type(self.ptr)

    @property
    def shape(self) -> tuple[int, ...]:
        n = lib.ggml_n_dims(self.ptr)
        return tuple(lib.ggml_get_ne(self.ptr, d) for d in reversed(range(n)))

    @property
    def ne(self) -> tuple[int, int, int, int]:
        return tuple(lib.ggml_get_ne(self.ptr, d) for d in range(4))

    @property
    def nbytes(self) -> int:
        return lib.ggml_nbytes(self.ptr)

    @property
    def name(self) -> str:
        return ffi.string(lib.ggml_get_name(self.ptr)).decode()

    @name.setter
    def name(self, value: str) -> None:
        lib.ggml_set_name(self.ptr, value.encode())

    def set_data(self, buffer, keep=None) -> None:
        """Points a leaf tensor at external memory (an mmap'd weight); buffer must stay alive."""
        view = memoryview(buffer).cast("B")
        if view.nbytes < self.nbytes:
            raise InvalidArgumentError(f"tensor needs {self.nbytes} bytes, buffer has {view.nbytes}")
        check(lib.ggml_set_data(self.ptr, ffi.from_buffer(view)))
        self._keep = keep if keep is not None else buffer

    @property
    def on_device(self) -> bool:
        return lib.ggml_get_backend(self.ptr) != lib.GGML_BACKEND_CPU

    @property
    def contiguous(self) -> bool:
        return bool(lib.ggml_is_contiguous(self.ptr))

    def raw(self) -> np.ndarray:
        """The tensor's bytes (contiguous tensors): a view in host memory, a copy from a device."""
        data = lib.ggml_get_data(self.ptr)
        if data == ffi.NULL:
            raise InvalidArgumentError(f"tensor '{self.name}' has no data yet (plan its graph first)")
        if not lib.ggml_is_contiguous(self.ptr):
            raise InvalidArgumentError("raw() needs a contiguous tensor")
        if self.on_device:
            out = np.empty(self.nbytes, dtype=np.uint8)
            self.read_into(out)
            return out
        return np.frombuffer(ffi.buffer(data, self.nbytes), dtype=np.uint8)

    def read_into(self, out: np.ndarray) -> None:
        """Copies the tensor's bytes (a contiguous tensor's, wherever it lives) into out, an array of as many."""
        if out.nbytes != self.nbytes or not out.flags.c_contiguous:
            raise InvalidArgumentError(f"read_into takes a contiguous array of {self.nbytes} bytes")
        check(lib.ggml_tensor_read(self.ptr, ffi.from_buffer(out), 0, self.nbytes))

    def numpy(self) -> np.ndarray:
        """F32/F16/I32/I8 data in numpy order: a writable view in host memory (strided for a strided
        ggml view), a copy from a device."""
        dtype = _NUMPY_DTYPES.get(self.type)
        if dtype is None:
            raise InvalidArgumentError(f"no numpy view of {type_name(self.type)}: use raw()")
        if lib.ggml_is_contiguous(self.ptr) or self.on_device:
            return self.raw().view(dtype).reshape(self.shape)
        data = lib.ggml_get_data(self.ptr)
        if data == ffi.NULL:
            raise InvalidArgumentError(f"tensor '{self.name}' has no data yet (plan its graph first)")
        strides = tuple(lib.ggml_get_nb(self.ptr, d) for d in reversed(range(len(self.shape))))
        flat = np.frombuffer(ffi.buffer(data, self.nbytes), dtype=dtype)
        return np.lib.stride_tricks.as_strided(flat, self.shape, strides)

    def set(self, values) -> None:
        """Copies values into the tensor (converting F32 input to the tensor's type)."""
        dtype = _NUMPY_DTYPES.get(self.type)
        if dtype is not None:
            arr = np.asarray(values, dtype)
            arr = arr.reshape(self.shape) if arr.size == np.prod(self.shape) else np.broadcast_to(arr, self.shape)
            raw = np.ascontiguousarray(arr).view(np.uint8)
        else:
            raw = quantize(self.type, np.asarray(values, np.float32)).reshape(-1)
        if raw.size != self.nbytes:
            raise InvalidArgumentError(f"{raw.size} bytes for a tensor of {self.nbytes}")
        check(lib.ggml_tensor_write(self.ptr, ffi.from_buffer(raw.reshape(-1)), 0, raw.size))

    def write(self, data, offset: int = 0) -> None:
        """Copies data's bytes into the tensor at byte offset (in host or device memory), before the next compute."""
        view = memoryview(data).cast("B")
        if offset < 0 or offset + view.nbytes > self.nbytes:
            raise InvalidArgumentError(f"{view.nbytes} bytes at {offset} do not fit the tensor's {self.nbytes}")
        check(lib.ggml_tensor_write(self.ptr, ffi.from_buffer(view), offset, view.nbytes))

    def to_device(self) -> Tensor:
        """Moves a leaf's data to the GPU and lets go of the host buffer it was read from."""
        check(lib.ggml_tensor_to_backend(self.ptr, lib.GGML_BACKEND_CUDA))
        self._keep = None
        return self


def _ne(shape) -> list[int]:
    """A numpy-order shape as ggml's ne; each size an int64 (cffi would overflow on a larger one)."""
    if isinstance(shape, int):
        shape = (shape,)
    return list(reversed([arguments.integer("tensor size", s, 0, 2**63 - 1) for s in shape]))


class Context:
    """Owns tensor headers (and leaf data unless no_alloc) in one arena; ops are methods."""

    def __init__(self, mem_bytes: int = 16 << 20, no_alloc: bool = False):
        self.ptr = ffi.gc(check_ptr(lib.ggml_init(mem_bytes, no_alloc)), lib.ggml_free)

    @property
    def used_bytes(self) -> int:
        return lib.ggml_used_mem(self.ptr)

    def set_gemm_scratch(self, nbytes: int) -> None:
        """The most bytes of weight rows a prompt GEMM of the matmuls made from now on dequantizes at once (a
        CUDA GEMM's scratch; 0: the backend's default)."""
        lib.ggml_set_gemm_scratch(self.ptr, nbytes)

    def _t(self, ptr, keep=None) -> Tensor:
        return Tensor(ptr, self, keep)

    # --- leaves ---
    def new_tensor(self, type_: int, shape) -> Tensor:
        ne = _ne(shape)
        return self._t(lib.ggml_new_tensor(self.ptr, type_, len(ne), ne))

    def tensor_from_numpy(self, arr: np.ndarray, type_: int | None = None) -> Tensor:
        """A tensor holding a copy of arr; float input is converted/quantized to type_ (default F32)."""
        arr = np.asarray(arr)
        if type_ is None:
            type_ = {np.dtype(np.int32): I32, np.dtype(np.float16): F16}.get(arr.dtype, F32)
        t = self.new_tensor(type_, arr.shape)
        t.set(arr)
        return t

    # --- views ---
    def reshape(self, a: Tensor, shape) -> Tensor:
        ne = _ne(shape)
        if len(ne) == 2:
            return self._t(lib.ggml_reshape_2d(self.ptr, a.ptr, *ne))
        if len(ne) == 3:
            return self._t(lib.ggml_reshape_3d(self.ptr, a.ptr, *ne))
        raise InvalidArgumentError("reshape to 2 or 3 dimensions")

    def view(self, a: Tensor, shape, strides=None, offset: int = 0) -> Tensor:
        """A window on a: shape and byte strides in numpy order, byte offset."""
        ne = _ne(shape)
        nb = ffi.NULL if strides is None else [0, *reversed([int(s) for s in strides[:-1]])]
        return self._t(lib.ggml_view(self.ptr, a.ptr, len(ne), ne, nb, offset))

    # --- ops ---
    def cpy(self, a: Tensor, type_: int) -> Tensor:
        return self._t(lib.ggml_cpy(self.ptr, a.ptr, type_))

    def get_rows(self, a: Tensor, ids: Tensor) -> Tensor:
        return self._t(lib.ggml_get_rows(self.ptr, a.ptr, ids.ptr))

    def add(self, a: Tensor, b: Tensor) -> Tensor:
        return self._t(lib.ggml_add(self.ptr, a.ptr, b.ptr))

    def mul(self, a: Tensor, b: Tensor) -> Tensor:
        return self._t(lib.ggml_mul(self.ptr, a.ptr, b.ptr))

    def scale(self, a: Tensor, s: float) -> Tensor:
        return self._t(lib.ggml_scale(self.ptr, a.ptr, s))

    def silu(self, a: Tensor) -> Tensor:
        return self._t(lib.ggml_silu(self.ptr, a.ptr))

    def gelu(self, a: Tensor) -> Tensor:
        return self._t(lib.ggml_gelu(self.ptr, a.ptr))

    def gelu_erf(self, a: Tensor) -> Tensor:
        return self._t(lib.ggml_gelu_erf(self.ptr, a.ptr))

    def tanh(self, a: Tensor) -> Tensor:
        return self._t(lib.ggml_tanh(self.ptr, a.ptr))

    def abs(self, a: Tensor) -> Tensor:
        return self._t(lib.ggml_abs(self.ptr, a.ptr))

    def relu(self, a: Tensor) -> Tensor:
        return self._t(lib.ggml_relu(self.ptr, a.ptr))

    def sigmoid(self, a: Tensor) -> Tensor:
        return self._t(lib.ggml_sigmoid(self.ptr, a.ptr))

    def softplus(self, a: Tensor) -> Tensor:
        return self._t(lib.ggml_softplus(self.ptr, a.ptr))

    def step(self, a: Tensor) -> Tensor:
        """1 where a > 0, else 0."""
        return self._t(lib.ggml_step(self.ptr, a.ptr))

    def rms_norm(self, a: Tensor, eps: float) -> Tensor:
        return self._t(lib.ggml_rms_norm(self.ptr, a.ptr, eps))

    def layer_norm(self, a: Tensor, eps: float) -> Tensor:
        return self._t(lib.ggml_layer_norm(self.ptr, a.ptr, eps))

    def mul_mat(self, w: Tensor, x: Tensor, precise: bool = False) -> Tensor:
        """x @ w.T; precise: without the activations' rounding (on the CPU, see ggml_mul_mat_precise)."""
        return self._t((lib.ggml_mul_mat_precise if precise else lib.ggml_mul_mat)(self.ptr, w.ptr, x.ptr))

    def rope(self, x: Tensor, pos: Tensor, n_dims: int, mode: int, freq_base: float, freq_scale: float = 1.0,
             freq_factors: Tensor | None = None, n_ctx_orig: int = 0, ext_factor: float = 0.0,
             attn_factor: float = 1.0, beta_fast: float = 32.0, beta_slow: float = 1.0):
        """Rotary embedding; freq_factors (F32, n_dims/2): each pair's frequency divided by its factor;
        ext_factor > 0: YaRN (see ggml_rope_ext in ggml.h)."""
        factors = freq_factors.ptr if freq_factors is not None else ffi.NULL
        return self._t(lib.ggml_rope_ext(self.ptr, x.ptr, pos.ptr, n_dims, mode, freq_base, freq_scale, factors,
                                         n_ctx_orig, ext_factor, attn_factor, beta_fast, beta_slow))

    def soft_max(self, a: Tensor, pos: Tensor | None = None, scale: float = 1.0) -> Tensor:
        return self._t(lib.ggml_soft_max(self.ptr, a.ptr, pos.ptr if pos else ffi.NULL, scale))

    def kv_store(self, cache: Tensor, src: Tensor, pos: Tensor) -> Tensor:
        return self._t(lib.ggml_kv_store(self.ptr, cache.ptr, src.ptr, pos.ptr))

    def attention(self, q: Tensor, k: Tensor, v: Tensor, pos: Tensor, scale: float, window: int = 0,
                  sinks: Tensor | None = None) -> Tensor:
        """Causal attention over the cache; window > 0: keys at positions (p - window, p] only; sinks (n_head,)
        F32: a logit per head that each softmax counts beside the keys' (gpt-oss)."""
        return self._t(lib.ggml_attention(self.ptr, q.ptr, k.ptr, v.ptr, pos.ptr, sinks.ptr if sinks else ffi.NULL,
                                          scale, window))

    def ssm_conv(self, state: Tensor, x: Tensor, w: Tensor, pos: Tensor) -> Tensor:
        """(n, C) -> (n, C): the causal depthwise convolution of x, taps w (C, K), continuing from state (K-1, C),
        which it overwrites with the last K-1 inputs (zeros taken for it when pos[0] == 0; see ggml_ssm_conv)."""
        return self._t(lib.ggml_ssm_conv(self.ptr, state.ptr, x.ptr, w.ptr, pos.ptr))

    def delta_net(self, state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, pos: Tensor,
                  scale: float, l2_eps: float = 0.0) -> Tensor:
        """The gated delta rule over n tokens: q, k (n, H_k, D_k), v (n, H, D_v), g and beta (n, H); state (H, D_v,
        D_k), overwritten (zeros taken for it when pos[0] == 0) -> (n, H, D_v); l2_eps > 0: q and k L2-normed per
        head first; see ggml_delta_net."""
        return self._t(lib.ggml_delta_net(self.ptr, state.ptr, q.ptr, k.ptr, v.ptr, g.ptr, beta.ptr, pos.ptr, scale,
                                          l2_eps))

    def mul_mat_rows(self, w: Tensor, x: Tensor, sel: Tensor | None = None, begin: int = 0, end: int = -1):
        return self._t(lib.ggml_mul_mat_rows(self.ptr, w.ptr, x.ptr, sel.ptr if sel else ffi.NULL, begin, end))

    def axpy_rows(self, wt: Tensor, h: Tensor, sel: Tensor | None = None, begin: int = 0, end: int = -1,
                  precise: bool = False):
        """sum of h[i] * wt[i] over the selected rows; precise: without rounding the CPU's coefficients to 8 bits
        (see ggml_axpy_rows_precise)."""
        fn = lib.ggml_axpy_rows_precise if precise else lib.ggml_axpy_rows
        return self._t(fn(self.ptr, wt.ptr, h.ptr, sel.ptr if sel else ffi.NULL, begin, end))

    def sparse_ffn(self, bundle: Tensor, x: Tensor, sel: Tensor | None, kind: str, threshold: float = 0.0):
        """(m, d) -> (m, d + n_ff): the FFN output, then 1 for each neuron summed; kind one of SPARSE_FFN_KINDS."""
        if kind not in SPARSE_FFN_KINDS:
            raise InvalidArgumentError(f"unknown FFN kind {kind!r}; known: {', '.join(SPARSE_FFN_KINDS)}")
        return self._t(lib.ggml_sparse_ffn(self.ptr, bundle.ptr, x.ptr, sel.ptr if sel else ffi.NULL,
                                           FFN_KINDS.index(kind), threshold))

    def top_k(self, a: Tensor, k: int) -> Tensor:
        """(m, n) F32 -> (m, k) I32: each row's k largest values' indices, largest first, ties to the lower."""
        return self._t(lib.ggml_top_k(self.ptr, a.ptr, k))

    def moe_ffn(self, gate: Tensor, up: Tensor, down: Tensor, x: Tensor, ids: Tensor, logits: Tensor,
                slots: Tensor | None, kind: str, norm: bool, biases: Tensor | None = None,
                scales: Tensor | None = None) -> Tensor:
        """(m, d) -> (m, d): each token's routed experts (ids (m, k) of the router's logits (m, n_expert)),
        weighted by the logits' softmax over the k (norm) or over all experts, summed; gate and up
        (n_local, n_ff, d), down (n_local, d, n_ff); slots (n_expert,) I32: expert e's matrix here or -1
        (None: matrix e). kind "swiglu", "geglu" or "swiglu_oai". biases (n_expert, 2 n_ff + d) F32: each expert's
        gate, up and down biases (gpt-oss); scales (n_expert,) F32: each expert's weight multiplied by its own
        (Gemma 4)."""
        if kind not in FFN_KINDS:
            raise InvalidArgumentError(f"unknown FFN kind {kind!r}; known: {', '.join(FFN_KINDS)}")
        return self._t(lib.ggml_moe_ffn(self.ptr, gate.ptr, up.ptr, down.ptr, x.ptr, ids.ptr, logits.ptr,
                                        slots.ptr if slots else ffi.NULL, biases.ptr if biases else ffi.NULL,
                                        scales.ptr if scales else ffi.NULL, FFN_KINDS.index(kind), norm))


class ThreadPool:
    """Persistent CPU workers (`-t N`)."""

    def __init__(self, n_threads: int):
        self.ptr = ffi.gc(check_ptr(lib.ggml_threadpool_new(n_threads)), lib.ggml_threadpool_free)
        self.n_threads = n_threads


class Graph:
    """The nodes that outputs need, planned once (memory for intermediates) and computed many times."""

    def __init__(self, ctx: Context, outputs: list[Tensor], backend: str = "cpu", stream_min_cols: int = 0):
        """backend "cuda" moves every leaf the graph reads to the GPU, so every node runs there.
        stream_min_cols: weight ops of at least this many columns run on the GPU, host weights copied in."""
        self.ctx = ctx
        self.ptr = ffi.gc(check_ptr(lib.ggml_graph_new(ctx.ptr)), lib.ggml_graph_free)
        self.outputs = list(outputs)
        for t in self.outputs:
            check(lib.ggml_graph_add_output(self.ptr, t.ptr))
        if backend == "cuda":
            check(lib.ggml_graph_to_backend(self.ptr, lib.GGML_BACKEND_CUDA))
        elif backend != "cpu":
            raise InvalidArgumentError(f"backend must be cpu or cuda, not {backend!r}")
        if stream_min_cols:
            check(lib.ggml_graph_stream_weights(self.ptr, stream_min_cols))
        self.planned = False

    @property
    def n_nodes(self) -> int:
        return lib.ggml_graph_n_nodes(self.ptr)

    @property
    def mem_bytes(self) -> int:
        return lib.ggml_graph_mem_size(self.ptr)

    @property
    def device_mem_bytes(self) -> int:
        """The planned buffer of its GPU nodes (0 on the CPU)."""
        return lib.ggml_graph_device_mem_size(self.ptr)

    def stats(self) -> dict:
        """What the last compute did (pyinfer_step_stats): wall, CPU busy, GPU busy and overlapped ms (the
        GPU's only after set_timed(True)), GPU runs and how many were replayed CUDA graphs."""
        out = ffi.new("struct pyinfer_step_stats *")
        check(lib.pyinfer_graph_stats(self.ptr, out))
        return {name: getattr(out, name) for name in dir(out)}

    @property
    def replayed(self) -> bool:
        """True once every GPU run of a compute is replayed from a captured CUDA graph."""
        s = self.stats()
        return s["n_gpu_runs"] > 0 and s["n_replayed"] == s["n_gpu_runs"]

    def set_timed(self, timed: bool) -> None:
        """Events around the GPU runs, so stats() has GPU busy and overlap times."""
        if not self.planned:
            self.plan()
        check(lib.pyinfer_graph_set_timed(self.ptr, timed))

    @property
    def n_fused(self) -> int:
        """Nodes the CUDA backend runs inside a fused kernel that an earlier node starts."""
        return lib.ggml_graph_n_fused(self.ptr)

    def median_ms(self, pool: ThreadPool, reps: int) -> float:
        """Median milliseconds of one compute over reps computes, after a warm-up compute."""
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            self.compute(pool)
            times.append(1e3 * (time.perf_counter() - t0))
        return float(np.median(times[1:]))

    def plan(self) -> Graph:
        check(lib.ggml_graph_plan(self.ptr))
        self.planned = True
        return self

    def compute(self, pool: ThreadPool) -> None:
        if not self.planned:
            self.plan()
        check(lib.pyinfer_graph_compute(self.ptr, pool.ptr))
