"""Synthetic predictors for a real model's PowerGGUF: predictor weights of pyinfer.converters.synthetic (neuron i
fires with a chosen frequency f_i), their biases calibrated on the model's own FFN inputs (quantiles over random
tokens), since the inputs' scale is not known. A stand-in for trained predictors in tests and benchmarks."""
from __future__ import annotations

import numpy as np
from gguf import GGUFValueType as V

from pyinfer.converters.synthetic import GATED_RELU, power_law_freqs, predictor, predictor_tensors, sparsity_kv
from pyinfer.engine.driver import Model
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.formats.gguf_writer import OutFile, OutTensor, write_atomically


def calibrate_bias(fc1: np.ndarray, fc2: np.ndarray, x: np.ndarray, freqs: np.ndarray) -> np.ndarray:
    """Biases putting the 1 - f_i quantile of fc2 relu(fc1 x) over the samples x (n, d) at zero."""
    u = np.maximum(x @ fc1.T, 0.0) @ fc2.T  # (n, n_ff)
    q = np.array([np.quantile(u[:, i], 1.0 - f) for i, f in enumerate(freqs)])
    return (-q).astype(np.float32)



def add_predictors(src: str, path: str, *, seed: int = 0, density: float = 0.10, hot_frac: float = 0.17,
                   hot_share: float = 0.80, rank: int = 64, threshold: float = 0.0, n_calib: int = 256) -> None:
    """src's tensors and metadata plus synthetic predictors calibrated on its own FFN inputs."""
    f = GGUFFile(src)
    if f.ffn_layout != "down_t":
        raise SystemExit(f"{src}: not a PowerGGUF (no ffn_down_t): convert it first")
    cfg = f.config
    rng = np.random.default_rng(seed)
    n_seq = min(n_calib, cfg.n_ctx_train)
    model = Model(src, n_ctx=n_seq, n_batch=n_seq, sparse=False)
    runs = [model.ffn_activations(rng.integers(0, cfg.n_vocab, size=n_seq))[1] for _ in range(-(-n_calib // n_seq))]
    del model
    freqs = power_law_freqs(cfg.n_ff, density, hot_frac, hot_share)
    replaced = {"general.name", "pyinfer.sparsity.kind", "pyinfer.sparsity.thresholds", "pyinfer.sparsity.target",
                "pyinfer.predictor.ranks", "pyinfer.predictor.recall", "pyinfer.synthetic"}
    kind = "relu" if cfg.ffn_kind in GATED_RELU else "threshold"
    kv = [t for t in f.typed_metadata() if t[0] not in replaced and t[0] != "general.architecture"]
    kv += [("general.name", f"{f.metadata.get('general.name', 'model')} + synthetic predictors", V.STRING, None),
           *sparsity_kv(kind, cfg.n_layer, density, rank, threshold)]
    tensors = [OutTensor.as_stored(info) for name, info in f.tensors.items()
               if ".fc1." not in name and ".fc2." not in name and "ffn_act_freq" not in name]
    for il in range(cfg.n_layer):
        x = np.concatenate([r[f"ffn_inp.{il}"] for r in runs]).astype(np.float64)  # (n_calib, n_embd)
        x_rms = float(np.sqrt(np.mean(x * x)))
        fc1, fc2, _ = predictor(rng, cfg.n_embd, rank, freqs, x_rms)
        bias = calibrate_bias(fc1.astype(np.float64), fc2.astype(np.float64), x, freqs)
        tensors += predictor_tensors(il, fc1, fc2, bias, freqs)
    write_atomically([OutFile(path, cfg.arch, kv, tensors)])
