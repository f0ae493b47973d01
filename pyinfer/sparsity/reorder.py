"""Hot-first neuron order: a per-layer permutation of FFN neurons (rows of ffn_up / ffn_gate and their
biases, rows of ffn_down_t) that changes no output, so a placement can take the first k_l rows as hot.

Rows are moved as raw bytes: each row is whole quant blocks, so every weight type permutes exactly.
"""
from __future__ import annotations

import re

import numpy as np
from gguf import GGUFValueType

from pyinfer.errors import InvalidArgumentError, ModelFormatError, UnsupportedError
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.formats.gguf_writer import OutFile, OutTensor, Q, write_atomically

# tensors with one row (or element) per FFN neuron
NEURON_TENSOR = re.compile(r"blk\.(\d+)\.(ffn_up|ffn_gate)\.(weight|bias)|blk\.(\d+)\.ffn_down_t\.weight")
# tensors a previous sparsify wrote; replaced, never carried over
SPARSITY_TENSOR = re.compile(r"blk\.\d+\.(fc1\.weight|fc2\.weight|fc2\.bias|ffn_act_freq)")
SPARSITY_KEYS = ("pyinfer.neuron_order", "pyinfer.sparsity.", "pyinfer.predictor.")


def hot_first_order(freq: np.ndarray, mass: np.ndarray) -> np.ndarray:
    """(n_ff,) permutation: descending activation frequency, ties by descending mass, then by index."""
    return np.lexsort((np.arange(len(freq)), -np.asarray(mass), -np.asarray(freq)))


def _layer_of(name: str) -> int | None:
    m = NEURON_TENSOR.fullmatch(name)
    return None if m is None else int(m.group(1) or m.group(4))


def reordered_tensors(g: GGUFFile, perms: list[np.ndarray]) -> list[OutTensor]:
    """Every tensor of g (except old predictor / frequency tensors) with neuron rows in order perms[il]."""
    cfg = g.config
    if cfg.is_moe:
        raise UnsupportedError(f"{g.path}: a mixture of experts has no neurons to reorder (its experts are placed "
                               "by their routings: pyinfer profile)")
    if g.ffn_layout != "down_t":
        raise ModelFormatError(f"{g.path}: reordering needs a PowerGGUF (ffn_down_t); convert it first")
    if len(perms) != cfg.n_layer:
        raise InvalidArgumentError(f"need {cfg.n_layer} permutations, got {len(perms)}")
    for il, p in enumerate(perms):  # Gemma 4's shared-KV layers may have FFNs twice as wide
        if not np.array_equal(np.sort(p), np.arange(cfg.layer_n_ff(il))):
            raise InvalidArgumentError(f"layer {il}: not a permutation of {cfg.layer_n_ff(il)} neurons")
    out = []
    for info in g.tensors.values():
        if SPARSITY_TENSOR.fullmatch(info.name):
            continue
        il = _layer_of(info.name)
        shape = tuple(reversed(info.ne))
        if il is None:
            out.append(OutTensor.as_stored(info))
        else:
            rows = info.data.reshape(cfg.layer_n_ff(il), -1)  # (n_ff, bytes per row)
            out.append(OutTensor(info.name, shape, Q(info.type), lambda r=rows, p=perms[il]: r[p].reshape(-1)))
    return out


def carried_metadata(g: GGUFFile) -> list[tuple]:
    """g's metadata to copy into a reordered file: all but what the writer sets and old sparsity keys."""
    skip = ("general.architecture", "general.alignment")
    return [kv for kv in g.typed_metadata() if kv[0] not in skip and not kv[0].startswith(SPARSITY_KEYS)]


def reorder_file(src: str, out: str, perms: list[np.ndarray], extra_kv: list[tuple] = (),
                 extra_tensors: list[OutTensor] = ()) -> None:
    """Write src with neurons permuted (and neuron_order hot_first) to out, atomically."""
    g = GGUFFile(src)
    kv = carried_metadata(g) + [("pyinfer.neuron_order", "hot_first", GGUFValueType.STRING, None), *extra_kv]
    write_atomically([OutFile(out, g.config.arch, kv, reordered_tensors(g, perms) + list(extra_tensors))])
