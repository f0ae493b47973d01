"""Training-free input sparsity of a gated FFN (SwiGLU, GeGLU) on TEAL's axes: per layer, gate and up read only
the input channels whose |x| passes t_x, down only the neurons whose |h| = |act(gate) up| passes t_h.

Skipping an input channel saves bytes only where a channel is a row, so the file gains channel-major copies of
gate and up (`blk.N.ffn_gate_t`, `blk.N.ffn_up_t`, ne [n_ff, n_embd]: one row of n_ff values per input
channel), quantized by the engine's own quantizer in the source's type where its blocks divide n_ff, else Q8_0.
Prompt batches run under the same masks: on the GPU over the copies too, on the CPU as a GEMM over the row-major
originals with the unread channels zeroed (sparse_ffn.reads_row_major); the originals serve `--sparse off` too and
never reach the GPU. Down is `ffn_down_t` already; the converter
stores it as Q8_0 for sources below 8 bits, and it is requantized to the copies' type where that is narrower
(Qwen2.5-Coder-1.5B Q4_K_M: 1.50 GB instead of 1.69 GB, +0.7 % held-out perplexity at 30 %, decode 10 % faster;
`--keep-down-type` keeps it).

Thresholds come from calibration text: per layer the s_x-quantile of |x| and the s_h-quantile of |h|, with more
of the skip on h, whose magnitudes are far more skewed than x's (docs/BENCHMARKS.md, "Training-free sparsity of
a SwiGLU FFN"): for a target b of the FFN's weight bytes, s_h = min(MAX_H, SPLIT_H b), s_x = (3 b - s_h) / 2.
SPLIT_H = 1.4 measured best of 1.0 (even), 1.4 and 1.8 in the engine on Qwen2.5-Coder-0.5B, SmolLM2-135M and
Gemma-3-270M from 30 to 50 % ("Which split"); `--down-skip` chooses s_h for one model.

Neurons are stored hot-first by how often their |h| passes t_h on the calibration text (`blk.N.ffn_act_freq`),
and the share of input channels read per layer is `pyinfer.sparsity.input_density`: the placement charges a
layer's host bytes at those rates and gives the GPU the neurons down reads most often. A split layer's GPU
holds columns [0, k) of both channel-major copies and rows [0, k) of ffn_down_t (engine.offload).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGUFValueType

from pyinfer.engine.driver import PRECISE_MAX_BYTES
from pyinfer.errors import InvalidArgumentError, UnsupportedError
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.formats.gguf_writer import FLOAT_TYPES, OutFile, OutTensor, Q, encode, write_atomically
from pyinfer.models.sparse_attention import PROJECTIONS
from pyinfer.native import ggml
from pyinfer.sparsity.reorder import carried_metadata, hot_first_order, reordered_tensors

KIND = "input"
SPLIT_H = 1.4  # s_h per b of bytes skipped: the best of 1.0, 1.4 and 1.8 on three models (BENCHMARKS)
MAX_H = 0.95
GATED_KINDS = ("swiglu", "geglu")  # the activations whose FFN this method skips (ReLU ones have predictors)


def split(target: float, down_skip: float | None = None) -> tuple[float, float]:
    """(s_x, s_h): the shares of gate's and up's input channels and of down's neurons skipped for a target
    share of the FFN's weight bytes (gate, up and down of equal size); s_h is down_skip when given."""
    if not 0.0 < target < 1.0:
        raise InvalidArgumentError(f"--target must be in (0, 1), not {target}")
    s_h = min(MAX_H, SPLIT_H * target) if down_skip is None else down_skip
    if not 0.0 <= s_h < 1.0:
        raise InvalidArgumentError(f"--down-skip must be in [0, 1), not {s_h}")
    s_x = (3 * target - s_h) / 2
    if s_x >= 1.0:
        raise InvalidArgumentError(f"--target {target} would skip every input channel with down skipping {s_h:.2f} "
                                   f"of its neurons: at most {(2 + s_h) / 3:.2f}")
    if s_x < 0.0:
        raise InvalidArgumentError(f"--down-skip {s_h} skips more than --target {target} asks "
                                   f"(at most {3 * target:.2f})")
    return s_x, s_h


@dataclass(frozen=True)
class LayerCalibration:
    """One layer's thresholds and what they read on the calibration text, neurons in the source's order."""

    t_x: float
    t_h: float
    x_density: float  # share of input channels whose |x - centre_x| passes t_x
    freq: np.ndarray  # (n_ff,) per neuron, the share of tokens whose |h - centre_h| passes t_h
    mass: np.ndarray  # (n_ff,) per neuron, mean |h| (breaks ties of freq in the hot-first order)
    centre_x: np.ndarray | None = None  # (n_embd,) method "centred": the calibration text's mean of x
    centre_h: np.ndarray | None = None  # (n_ff,) and of h

    @property
    def order(self) -> np.ndarray:
        """(n_ff,) the hot-first permutation of the neurons."""
        return hot_first_order(self.freq, self.mass)


def calibrate(layers, target: float, down_skip: float | None = None, centred: bool = False) -> list[LayerCalibration]:
    """Per layer the thresholds from calibration samples: layers yields (x (n, n_embd), h (n, n_ff)) per layer;
    down_skip as in split; centred: thresholds on the distance from each channel's and neuron's mean."""
    s_x, s_h = split(target, down_skip)
    out = []
    for x, h in layers:
        cx = np.mean(x, axis=0, dtype=np.float64).astype(np.float32) if centred else None
        ch = np.mean(h, axis=0, dtype=np.float64).astype(np.float32) if centred else None
        ax, ah = np.abs(x - cx if centred else x), np.abs(h - ch if centred else h)
        t_x, t_h = float(np.quantile(ax, s_x)), float(np.quantile(ah, s_h))
        mass = np.mean(np.abs(h) if centred else ah, axis=0, dtype=np.float64)
        out.append(LayerCalibration(t_x, t_h, float(np.mean(ax > t_x)), np.mean(ah > t_h, axis=0), mass, cx, ch))
    return out


@dataclass(frozen=True)
class AttentionCalibration:
    """One layer's thresholds on the inputs of its attention projections (models.sparse_attention) and the shares
    of channels they read on the calibration text."""

    t_in: float  # on |x|, the input of q, k and v
    t_out: float  # on |a|, the attention's output, the output projection's input
    in_density: float
    out_density: float


def calibrate_attention(layers, skip: float) -> list[AttentionCalibration | None]:
    """Per layer the skip-quantiles of |x| and |a| over the calibration samples: layers yields (x (n, n_embd),
    a (n, n_head * head_dim)) per layer, or None for a layer without such projections (linear attention), which
    keeps None."""
    if not 0.0 < skip < 1.0:
        raise InvalidArgumentError(f"--attn-skip must be in (0, 1), not {skip}")
    out = []
    for pair in layers:
        if pair is None:
            out.append(None)
            continue
        ax, aa = np.abs(pair[0]), np.abs(pair[1])
        t_in, t_out = float(np.quantile(ax, skip)), float(np.quantile(aa, skip))
        out.append(AttentionCalibration(t_in, t_out, float(np.mean(ax > t_in)), float(np.mean(aa > t_out))))
    return out


def transposed_type(qtype: Q, n_ff: int) -> Q:
    """The type of a channel-major copy: the source's where the engine quantizes it and its block divides n_ff
    (a second rounding in that type, see the module's docstring), else Q8_0, else F16."""
    if qtype in FLOAT_TYPES:
        return qtype
    if int(qtype) in ggml.WEIGHT_TYPES and n_ff % ggml.block_size(int(qtype)) == 0:
        return qtype
    return Q.Q8_0 if n_ff % 32 == 0 else Q.F16


def _stored(values: np.ndarray, qtype: Q) -> np.ndarray:
    """values (rows, row length) as the bytes of qtype: float types encoded, the rest by the engine's quantizer."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    return encode(values, qtype) if qtype in FLOAT_TYPES else ggml.quantize(int(qtype), values)


def channel_major(g: GGUFFile, name: str, order: np.ndarray | None = None) -> OutTensor:
    """A matrix of g (blk.N.ffn_gate, ffn_up, or an attention projection) as its channel-major copy (name with _t),
    its rows (the FFN's neurons) in order."""
    info = g.tensors[f"{name}.weight"]
    n_embd, n_ff = info.ne
    qtype = transposed_type(Q(info.type), n_ff)

    def produce() -> np.ndarray:
        rows = g.dequantize(f"{name}.weight")  # (n_ff, n_embd)
        return _stored((rows if order is None else rows[order]).T, qtype)  # (n_embd, n_ff)

    return OutTensor(f"{name}_t.weight", (n_embd, n_ff), qtype, produce)


def narrows_down_by_default(g: GGUFFile) -> bool:
    """Whether `sparsify` narrows ffn_down_t (narrowed_down_t) unless told: not for the small models that get
    precise matmuls (driver.PRECISE_MAX_BYTES), whose loss a second 4-bit rounding of down doubled at 30 %
    (SmolLM2-135M +15.0 % against +7.8 % kept in Q8_0, Gemma-3-270M +15.1 % against +8.4 %; the 1.5B model paid
    +0.7 % for 11 % fewer bytes a token: docs/BENCHMARKS.md)."""
    return g.tensor_bytes > PRECISE_MAX_BYTES


def narrowed_down_t(g: GGUFFile, il: int, order: np.ndarray) -> OutTensor | None:
    """Layer il's ffn_down_t (neurons in order) in the type of its channel-major copies (transposed_type of gate's
    type along rows of n_embd) where that takes fewer bytes than the stored type, else None."""
    name, gate = f"blk.{il}.ffn_down_t.weight", g.tensors[f"blk.{il}.ffn_gate.weight"]
    stored = g.tensors[name]
    n_embd, n_ff = stored.ne
    qtype = transposed_type(Q(gate.type), n_embd)
    if ggml.row_size(int(qtype), n_embd) >= ggml.row_size(int(stored.type), n_embd):
        return None

    def produce() -> np.ndarray:
        return _stored(g.dequantize(name)[order], qtype)  # (n_ff, n_embd)

    return OutTensor(name, (n_ff, n_embd), qtype, produce)


def centring_tensors(g: GGUFFile, il: int, c: LayerCalibration, order: np.ndarray) -> list[OutTensor]:
    """Method "centred": layer il's shifts (minus the centres, added to x and h before their thresholds) and the
    biases that give back what the shifts take away (W centre: gate's and up's per neuron, down's per channel),
    from the source's weights, neurons in order."""
    p = f"blk.{il}."

    def bias(name: str, centre: np.ndarray, rows: np.ndarray | slice) -> np.ndarray:
        w = g.dequantize(p + name + ".weight")[rows].astype(np.float64)  # gate, up (n_ff, n_embd); down_t likewise
        return (w @ centre if name != "ffn_down_t" else centre @ w).astype(np.float32)

    cx, ch = c.centre_x.astype(np.float64), c.centre_h.astype(np.float64)
    n_embd, n_ff = len(cx), len(ch)
    return [OutTensor(p + "ffn_inp.shift", (n_embd,), Q.F32, lambda: -c.centre_x),
            OutTensor(p + "ffn_down_t.shift", (n_ff,), Q.F32, lambda: np.ascontiguousarray(-c.centre_h[order])),
            OutTensor(p + "ffn_gate_t.bias", (n_ff,), Q.F32, lambda: bias("ffn_gate", cx, order)),
            OutTensor(p + "ffn_up_t.bias", (n_ff,), Q.F32, lambda: bias("ffn_up", cx, order)),
            OutTensor(p + "ffn_down_t.bias", (n_embd,), Q.F32, lambda: bias("ffn_down_t", ch, slice(None)))]


def check_source(g: GGUFFile) -> None:
    """A PowerGGUF of a gated FFN without biases and with no sparsity of its own."""
    cfg = g.config
    if cfg.ffn_kind not in GATED_KINDS:
        raise UnsupportedError(f"{g.path}: input sparsity is for SwiGLU/GeGLU FFNs; this one is {cfg.ffn_kind} "
                               "(ReLU-family models get predictors: pyinfer sparsify --method predictors)")
    if g.ffn_layout != "down_t":
        raise InvalidArgumentError(f"{g.path}: not a PowerGGUF (no ffn_down_t): convert it first")
    if cfg.ffn_bias:
        raise UnsupportedError(f"{g.path}: FFN biases are not supported by input sparsity")
    if "pyinfer.sparsity.kind" in g.metadata:
        raise InvalidArgumentError(f"{g.path}: already sparsified ({g.metadata['pyinfer.sparsity.kind']}): "
                                   "sparsify the model it was made from")


def attention_kv(attention: list[AttentionCalibration | None]) -> list[tuple]:
    """The metadata of sparse attention projections: per layer both thresholds and both densities (-1 for a layer
    without them)."""
    arr, f32 = GGUFValueType.ARRAY, GGUFValueType.FLOAT32
    fields = {"attn_input_thresholds": "t_in", "attn_output_thresholds": "t_out", "attn_input_density": "in_density",
              "attn_output_density": "out_density"}
    return [(f"pyinfer.sparsity.{key}", [-1.0 if c is None else getattr(c, field) for c in attention], arr, f32)
            for key, field in fields.items()]


def write(src: str, out: str, layers: list[LayerCalibration], target: float, calibration: str,
          narrow_down: bool = True, attention: list[AttentionCalibration | None] | None = None) -> None:
    """src's tensors (neurons hot-first; ffn_down_t narrowed where narrow_down, see narrowed_down_t) and metadata,
    the channel-major gate and up, the neurons' frequencies and the thresholds, and where attention is given the
    channel-major copies of the attention projections of its layers and their thresholds, written to out
    atomically."""
    g = GGUFFile(src)
    check_source(g)
    n_layer = g.config.n_layer
    if len(layers) != n_layer:
        raise InvalidArgumentError(f"need the calibration of {n_layer} layers, got {len(layers)}")
    orders = [c.order for c in layers]
    tensors = reordered_tensors(g, orders)
    if narrow_down:
        narrowed = {t.name: t for il, order in enumerate(orders) if (t := narrowed_down_t(g, il, order))}
        tensors = [narrowed.get(t.name, t) for t in tensors]
    for il, (c, order) in enumerate(zip(layers, orders, strict=True)):
        freq = np.ascontiguousarray(c.freq[order], dtype=np.float32)
        tensors += [channel_major(g, f"blk.{il}.ffn_gate", order), channel_major(g, f"blk.{il}.ffn_up", order),
                    OutTensor(f"blk.{il}.ffn_act_freq", freq.shape, Q.F32, lambda f=freq: f)]
        if c.centre_x is not None:
            tensors += centring_tensors(g, il, c, order)
        if attention is not None and attention[il] is not None:
            tensors += [channel_major(g, f"blk.{il}.{name}") for name in PROJECTIONS]
    arr, f32, s = GGUFValueType.ARRAY, GGUFValueType.FLOAT32, GGUFValueType.STRING
    kv = carried_metadata(g) + [("pyinfer.neuron_order", "hot_first", s, None),
                                ("pyinfer.sparsity.kind", KIND, s, None),
                                ("pyinfer.sparsity.input_thresholds", [c.t_x for c in layers], arr, f32),
                                ("pyinfer.sparsity.thresholds", [c.t_h for c in layers], arr, f32),
                                ("pyinfer.sparsity.input_density", [c.x_density for c in layers], arr, f32),
                                ("pyinfer.sparsity.target", float(target), f32, None),
                                ("pyinfer.sparsity.calibration", calibration, s, None)]
    if attention is not None:
        if len(attention) != n_layer:
            raise InvalidArgumentError(f"need the attention calibration of {n_layer} layers, got {len(attention)}")
        kv += attention_kv(attention)
    write_atomically([OutFile(out, g.config.arch, kv, tensors)])
