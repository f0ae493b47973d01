"""Expert popularity of a mixture of experts: each layer's routings counted over calibration text and stored in
the file as `pyinfer.experts.freq` (per layer and expert, the expected routings a token), which the placement
reads to put the most often routed experts on the GPU. Only a metadata key is added: the weights and tensors
stay as they were, so llama.cpp runs the profiled file as it ran the original."""
from __future__ import annotations

import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType
from tqdm import tqdm

from pyinfer.engine.driver import Model
from pyinfer.errors import InvalidArgumentError
from pyinfer.formats.gguf_file import EXPERT_FREQ_KEY as FREQ_KEY
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.formats.gguf_writer import OutFile, OutTensor, write_atomically


def routing_freq(path: str, chunks: list[np.ndarray], n_threads: int | None = None,
                 progress: bool = True) -> np.ndarray:
    """(n_layer, n_expert): how often each expert is chosen a token, over the chunks (each one batch)."""
    if not chunks or not all(len(c) for c in chunks):
        raise InvalidArgumentError("no calibration text to count the experts' routings on")
    longest = max(len(c) for c in chunks)
    model = Model(path, n_ctx=longest, n_batch=longest, n_threads=n_threads)
    cfg = model.config
    counts = np.zeros((cfg.n_layer, cfg.n_expert), np.int64)
    for chunk in tqdm(chunks, desc="routings", unit="chunk", file=sys.stderr, disable=None if progress else True):
        _, captured = model.ffn_activations(chunk)
        for il in range(cfg.n_layer):
            counts[il] += np.bincount(captured[f"moe_ids.{il}"].ravel(), minlength=cfg.n_expert)
    return counts / sum(len(c) for c in chunks)


def top_share(freq: np.ndarray, fraction: float = 0.2) -> float:
    """The share of a layer's routings that its most often routed `fraction` of experts take."""
    ranked = np.sort(freq)[::-1]
    return float(ranked[:max(1, round(fraction * len(ranked)))].sum() / max(ranked.sum(), 1e-30))


def write_profiled(src: str, out: str, freq: np.ndarray) -> None:
    """src's metadata and tensors, byte for byte, with FREQ_KEY set to freq (layer after layer)."""
    g = GGUFFile(src)
    kv = [item for item in g.typed_metadata() if item[0] not in ("general.architecture", "general.alignment", FREQ_KEY)]
    kv.append((FREQ_KEY, [float(f) for f in freq.ravel()], GGUFValueType.ARRAY, GGUFValueType.FLOAT32))
    tensors = [OutTensor(info.name, tuple(reversed(info.ne)), GGMLQuantizationType(info.type),
                         lambda info=info: info.data) for info in g.tensors.values()]
    write_atomically([OutFile(out, g.config.arch, kv, tensors)])

