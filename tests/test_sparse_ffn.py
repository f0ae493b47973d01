"""The sparse FFN (models/sparse_ffn.py) and its runtime hooks.

Oracles: the numpy float64 reference forward (an oracle mask keeps every active neuron, so the sparse
model is the dense model), a numpy float64 sparse FFN block (predictor, threshold), and numpy recounts
of the predictor's masks.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from reference import reference_logits
from split_harness import decode_steps

from pyinfer.engine.driver import Model
from pyinfer.errors import InvalidArgumentError
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.models.common import Builder
from pyinfer.models.sparse_ffn import SparseSpec, ffn_block
from pyinfer.native import ggml
from pyinfer.sparsity.synthetic_predictors import add_predictors

TOKENS = [1, 5, 77, 200, 3, 9, 250, 11, 299]


@pytest.fixture(scope="module")
def synthetic(tiny_files, tmp_path_factory):
    """variant -> the PowerGGUF plus synthetic predictors (30% density, rank 16)."""
    paths = {}

    def get(variant: str, threshold: float = 0.0) -> str:
        key = (variant, threshold)
        if key not in paths:
            paths[key] = str(tmp_path_factory.mktemp("syn") / "m.gguf")
            add_predictors(tiny_files(variant, False), paths[key], density=0.3, rank=16, threshold=threshold,
                           n_calib=64)
        return paths[key]
    return get


@pytest.mark.parametrize("variant", ["llama_relu", "llama_drelu", "opt"])
def test_oracle_mask_equals_dense(tiny_files, variant):
    """With the true active set as the mask, the sparse FFN is the dense FFN: batched (selected rows and
    dense up/gate) and token by token, against the float64 reference."""
    ref = reference_logits(GGUFFile(tiny_files(variant, False)), TOKENS)
    model = Model(tiny_files(variant, False), n_ctx=64, n_threads=2, oracle=True)
    tol = 1e-3 * np.abs(ref).max()
    np.testing.assert_allclose(decode_steps(model, TOKENS), ref, atol=tol)
    np.testing.assert_allclose(model.logits(TOKENS), ref, atol=tol)  # mul_mat_rows with a mask per token
    model.sparse_spec.dense_above = 0
    model._graphs.clear()
    np.testing.assert_allclose(model.logits(TOKENS), ref, atol=tol)  # dense up/gate under the mask
    density = model.timings.extra["ffn_rows_active"] / model.timings.extra["ffn_rows_total"]
    assert 0.05 < density < 0.95  # the mask really skips neurons


def _np_predictor_masks(path: str, acts: dict, threshold: float, kind: str) -> list[np.ndarray]:
    """Per layer (n, n_ff) bool: predicted (numpy float64 predictor) and active beyond the threshold."""
    f = GGUFFile(path)
    out = []
    for il in range(f.config.n_layer):
        # F16 weights take their activations rounded to F16, as the engine's dot products do
        x = acts[f"ffn_inp.{il}"].astype(np.float16).astype(np.float64)
        fc1, fc2 = f.dequantize(f"blk.{il}.fc1.weight"), f.dequantize(f"blk.{il}.fc2.weight")
        z = np.maximum(x @ fc1.T, 0).astype(np.float32).astype(np.float16).astype(np.float64)
        logit = z @ fc2.T + f.dequantize(f"blk.{il}.fc2.bias")
        act = acts[f"ffn_act.{il}"]
        out.append((logit > 0) & (np.abs(act) > threshold))
    return out


@pytest.mark.parametrize("variant,threshold", [("llama_relu", 0.0), ("llama_silu", 0.05), ("opt", 0.0),
                                               ("falcon_relu", 0.0), ("falcon_40b", 0.05), ("falcon_7b", 0.05),
                                               ("gemma3", 0.05)])
def test_predictor_path_density(synthetic, variant, threshold):
    """The realised density the runtime reports is the density of the predictor's mask recomputed in
    numpy from the captured FFN inputs, and batched prompts give the token-by-token logits."""
    path = synthetic(variant, threshold)
    model = Model(path, n_ctx=64, n_threads=2)
    assert model.sparse_spec is not None and model.sparse_spec.kind == ("relu" if threshold == 0 else "threshold")
    step = decode_steps(model, TOKENS)
    extra = model.timings.extra
    _, acts = model.ffn_activations(TOKENS)
    masks = _np_predictor_masks(path, acts, threshold, model.sparse_spec.kind)
    expected = sum(int(m.sum()) for m in masks)
    assert abs(extra["ffn_rows_active"] - expected) <= 2  # F16 predictor: logits at 0 may round either way
    assert extra["ffn_rows_total"] == len(TOKENS) * model.config.n_layer * model.config.n_ff
    assert 0.0 < expected / extra["ffn_rows_total"] < 0.5
    np.testing.assert_allclose(model.logits(TOKENS), step, atol=1e-3 * np.abs(step).max())
    assert "sparse FFN density" in model.timings.report()


@pytest.mark.parametrize("variant,threshold", [("llama_relu", 0.0), ("llama_silu", 0.05), ("gemma3", 0.05),
                                               ("falcon_relu", 0.0), ("opt", 0.0)])
def test_bundled_ffn_equals_separate_row_ops(synthetic, variant, threshold):
    """The fused sparse_ffn op over the rows bundled at load computes what the three row ops compute, token
    by token and batched, with the same realised density; OPT's FFN biases keep it on the row ops."""
    path = synthetic(variant, threshold)
    fused, separate = Model(path, n_ctx=64, n_threads=2), Model(path, n_ctx=64, n_threads=2)
    bundles = [name for name in fused.weights if ".ffn_bundle." in name]
    assert len(bundles) == (0 if variant == "opt" else fused.config.n_layer)
    for name in bundles:
        del separate.weights[name]
    want = decode_steps(separate, TOKENS)
    tol = 1e-4 * np.abs(want).max()
    np.testing.assert_allclose(decode_steps(fused, TOKENS), want, atol=tol)
    np.testing.assert_allclose(fused.logits(TOKENS), separate.logits(TOKENS), atol=tol)
    assert abs(fused.timings.extra["ffn_rows_active"] - separate.timings.extra["ffn_rows_active"]) <= 2


def test_sparsity_threshold_lowers_density(synthetic):
    path = synthetic("llama_silu")
    dens = []
    for t in (-1.0, 0.0, 1.0):
        model = Model(path, n_ctx=64, n_threads=2, sparsity_threshold=t)
        model.logits(TOKENS)
        dens.append(model.timings.extra["ffn_rows_active"] / model.timings.extra["ffn_rows_total"])
    assert dens[0] > dens[1] > dens[2]


def test_sparse_off_equals_dense(tiny_files, synthetic):
    base = Model(tiny_files("llama_silu", False), n_ctx=64, n_threads=2)
    assert base.sparse_spec is None and not base.file.has_predictors
    off = Model(synthetic("llama_silu"), n_ctx=64, n_threads=2, sparse=False)
    assert off.sparse_spec is None and "ffn_rows_total" not in off.timings.extra
    np.testing.assert_array_equal(off.logits(TOKENS), base.logits(TOKENS))
    with pytest.raises(InvalidArgumentError, match="no predictors"):
        Model(tiny_files("llama_silu", False), n_ctx=64, sparse=True)


# --- the block alone against numpy float64 ---------------------------------------------------------

def _np_block(kind, x, w, t, bias_up):
    """numpy float64 sparse FFN: predictor mask, activation, threshold zeroing, down projection."""
    logit = np.maximum(x @ w["fc1"].T, 0) @ w["fc2"].T + w["pbias"]  # (n, n_ff)
    up = x @ w["up"].T + (w["up_b"] if bias_up else 0)
    gate = x @ w["gate"].T if kind != "relu" else None
    relu = np.maximum
    act = {"relu": lambda: relu(up, 0), "reglu": lambda: relu(gate, 0) * up,
           "drelu": lambda: relu(gate, 0) * relu(up, 0), "swiglu": lambda: gate / (1 + np.exp(-gate)) * up,
           "geglu": lambda: 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3))) * up}[kind]()
    keep = (logit > 0) & (np.abs(act) > t)
    return (act * keep) @ w["down_t"], logit, act


@pytest.mark.parametrize("kind,bias_up", [("swiglu", False), ("geglu", False), ("reglu", False),
                                          ("drelu", False), ("relu", True)])
@pytest.mark.parametrize("n", [1, 3, 7])
@pytest.mark.parametrize("t", [0.0, 0.15])
def test_block_threshold_matches_numpy(kind, bias_up, n, t):
    """Predictor mask + |h| <= t zeroing; n = 7 takes the dense up/gate path, 1 and 3 selected rows."""
    rng = np.random.default_rng(7)
    d, n_ff, r = 32, 96, 8
    w = {"fc1": rng.standard_normal((r, d)) / np.sqrt(d), "fc2": rng.standard_normal((n_ff, r)),
         "pbias": rng.standard_normal(n_ff) - 0.5, "up": rng.standard_normal((n_ff, d)) / np.sqrt(d),
         "gate": rng.standard_normal((n_ff, d)) / np.sqrt(d), "down_t": rng.standard_normal((n_ff, d)),
         "up_b": rng.standard_normal(n_ff) * 0.3}
    x = rng.standard_normal((n, d))
    want, logit, act = _np_block(kind, x, w, t, bias_up)
    # the test means something only if some neurons sit on each side of both cuts
    assert 0 < (logit > 0).mean() < 1 and (t == 0 or 0 < (np.abs(act) > t).mean() < 1)
    ctx = ggml.Context(4 << 20)
    weights = {"blk.0.fc1.weight": w["fc1"], "blk.0.fc2.weight": w["fc2"], "blk.0.ffn_up.weight": w["up"],
               "blk.0.ffn_gate.weight": w["gate"], "blk.0.ffn_down_t.weight": w["down_t"]}
    if bias_up:
        weights["blk.0.ffn_up.bias"] = w["up_b"]
    weights = {k: ctx.tensor_from_numpy(v.astype(np.float32)) for k, v in weights.items()}
    cfg = SimpleNamespace(ffn_kind=kind, ffn_bias=bias_up, n_ff=n_ff)
    neg_t = {0: ctx.tensor_from_numpy(np.full(n_ff, -t, np.float32))} if t > 0 else {}
    spec = SparseSpec("threshold", [t], {0: ctx.tensor_from_numpy(w["pbias"].astype(np.float32))}, neg_t,
                      dense_above=4)
    b = Builder(ctx, cfg, weights, None, sparse=spec)
    xt = ctx.tensor_from_numpy(x.astype(np.float32).reshape(n, d) if n > 1 else x[0].astype(np.float32))
    y = ffn_block(b, 0, xt)
    graph = ggml.Graph(ctx, [y, spec.masks[0]]).plan()
    y.numpy()[...] = np.nan  # poison: the kernels must write every output
    graph.compute(ggml.ThreadPool(2))
    np.testing.assert_allclose(y.numpy().reshape(n, d), want, atol=1e-4 * np.abs(want).max())
    keep = (logit > 0) & (np.abs(act) > t)
    mask = spec.masks[0].numpy().reshape(n, n_ff) > 0
    # the down mask holds every kept neuron, only predicted ones, and beyond the kept ones only zeros
    assert np.all(mask[keep]) and not np.any(mask[logit <= 0]) and np.all(act[mask & ~keep] == 0)


def test_density_line_says_whose_neurons_it_counts():
    # a model wholly on the GPU counts no neurons (its masks stay on the device): its density line had read 0 %
    from pyinfer.engine.driver import Timings

    t = Timings(eval_ms=10.0, eval_tokens=5, extra={"ffn_rows_active": 0, "ffn_rows_total": 0, "predictor_ms": 0.1})
    assert "sparse FFN density = not counted (every neuron on the GPU)" in t.report()
    t.extra.update(ffn_rows_active=25, ffn_rows_total=100)
    assert "sparse FFN density =  25.00 % of the CPU's neurons, predictors" in t.report()
    t.extra.update(ffn_channels_active=3, ffn_channels_total=4)  # an input file's
    assert "sparse FFN density =  25.00 % of the CPU's neurons, 75.00 % of gate's and up's channels" in t.report()
