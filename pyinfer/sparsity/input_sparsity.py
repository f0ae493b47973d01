"""Training-free input sparsity of a gated FFN (SwiGLU, GeGLU) on TEAL's axes: per layer, gate and up read only
the input channels whose |x| passes t_x, down only the neurons whose |h| = |act(gate) up| passes t_h.

Skipping an input channel saves bytes only where a channel is a row, so the file gains channel-major copies of
gate and up (`blk.N.ffn_gate_t`, `blk.N.ffn_up_t`, ne [n_ff, n_embd]: one row of n_ff values per input
channel), quantized by the engine's own quantizer in the source's type where its blocks divide n_ff, else Q8_0;
prompt batches keep reading the row-major originals. Down is `ffn_down_t` already.

Thresholds come from calibration text: per layer the s_x-quantile of |x| and the s_h-quantile of |h|, with more
of the skip on h, whose magnitudes are far more skewed than x's (docs/BENCHMARKS.md, "Training-free sparsity of
a SwiGLU FFN"): for a target b of the FFN's weight bytes, s_h = min(MAX_H, SPLIT_H b), s_x = (3 b - s_h) / 2.
Measured best on Qwen2.5-Coder-0.5B; on the 1.5B model it beats an even split only near 25 %.
"""
from __future__ import annotations

import numpy as np
from gguf import GGUFValueType

from pyinfer.errors import InvalidArgumentError, UnsupportedError
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.formats.gguf_writer import FLOAT_TYPES, OutFile, OutTensor, Q, encode, write_atomically
from pyinfer.native import ggml
from pyinfer.sparsity.reorder import carried_metadata

KIND = "input"
SPLIT_H = 1.8  # s_h per b of bytes skipped
MAX_H = 0.95
GATED_KINDS = ("swiglu", "geglu")  # the activations whose FFN this method skips (ReLU ones have predictors)


def split(target: float) -> tuple[float, float]:
    """(s_x, s_h): the shares of gate's and up's input channels and of down's neurons skipped for a target
    share of the FFN's weight bytes (gate, up and down of equal size)."""
    if not 0.0 < target < 1.0:
        raise InvalidArgumentError(f"--target must be in (0, 1), not {target}")
    s_h = min(MAX_H, SPLIT_H * target)
    s_x = (3 * target - s_h) / 2
    if s_x >= 1.0:
        raise InvalidArgumentError(f"--target {target} would skip every input channel: at most {(2 + MAX_H) / 3:.2f}")
    return s_x, s_h


def thresholds(layers, target: float) -> tuple[list[float], list[float]]:
    """Per layer (t_x, t_h) from calibration samples: layers yields (x (n, n_embd), h (n, n_ff)) per layer."""
    s_x, s_h = split(target)
    t_x, t_h = [], []
    for x, h in layers:
        t_x.append(float(np.quantile(np.abs(x), s_x)))
        t_h.append(float(np.quantile(np.abs(h), s_h)))
    return t_x, t_h


def transposed_type(qtype: Q, n_ff: int) -> Q:
    """The type of a channel-major copy: the source's where the engine quantizes it and its block divides n_ff
    (a second rounding in that type, see the module's docstring), else Q8_0, else F16."""
    if qtype in FLOAT_TYPES:
        return qtype
    if int(qtype) in ggml.WEIGHT_TYPES and n_ff % ggml.block_size(int(qtype)) == 0:
        return qtype
    return Q.Q8_0 if n_ff % 32 == 0 else Q.F16


def channel_major(g: GGUFFile, name: str) -> OutTensor:
    """blk.N.ffn_gate or blk.N.ffn_up of g as its channel-major copy (name with _t)."""
    info = g.tensors[f"{name}.weight"]
    n_embd, n_ff = info.ne
    qtype = transposed_type(Q(info.type), n_ff)

    def produce() -> np.ndarray:
        values = np.ascontiguousarray(g.dequantize(f"{name}.weight").T, dtype=np.float32)  # (n_embd, n_ff)
        return encode(values, qtype) if qtype in FLOAT_TYPES else ggml.quantize(int(qtype), values)

    return OutTensor(f"{name}_t.weight", (n_embd, n_ff), qtype, produce)


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


def write(src: str, out: str, t_x: list[float], t_h: list[float], target: float, calibration: str) -> None:
    """src's tensors and metadata, the channel-major gate and up, and the thresholds, written to out atomically."""
    g = GGUFFile(src)
    check_source(g)
    n_layer = g.config.n_layer
    if len(t_x) != n_layer or len(t_h) != n_layer:
        raise InvalidArgumentError(f"need {n_layer} thresholds of each kind, got {len(t_x)} and {len(t_h)}")
    tensors = [OutTensor.as_stored(info) for info in g.tensors.values()]
    for il in range(n_layer):
        tensors += [channel_major(g, f"blk.{il}.ffn_gate"), channel_major(g, f"blk.{il}.ffn_up")]
    arr, f32, s = GGUFValueType.ARRAY, GGUFValueType.FLOAT32, GGUFValueType.STRING
    kv = carried_metadata(g) + [("pyinfer.sparsity.kind", KIND, s, None),
                                ("pyinfer.sparsity.input_thresholds", [float(t) for t in t_x], arr, f32),
                                ("pyinfer.sparsity.thresholds", [float(t) for t in t_h], arr, f32),
                                ("pyinfer.sparsity.target", float(target), f32, None),
                                ("pyinfer.sparsity.calibration", calibration, s, None)]
    write_atomically([OutFile(out, g.config.arch, kv, tensors)])
