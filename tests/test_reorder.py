"""Hot-first reorder is a model-preserving permutation: logits equal before/after on tiny checkpoints of
every architecture, through the engine and through the numpy reference."""
from __future__ import annotations

import numpy as np
import pytest
from hf_tiny import DENSE_VARIANTS, MOE_VARIANTS, build
from reference import reference_logits

import pyinfer.converters.convert_hf_to_powergguf as conv
from pyinfer.engine.driver import Model
from pyinfer.errors import UnsupportedError
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.sparsity.reorder import hot_first_order, reorder_file

TOKENS = [1, 5, 77, 200, 3, 9, 250, 11, 299, 42]


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_a_mixture_of_experts_is_refused_in_one_line(tmp_path, variant):
    build(variant, str(tmp_path / "hf"))
    src = str(tmp_path / "m.gguf")
    assert conv.main([str(tmp_path / "hf"), "-o", src, "--outtype", "f32"]) == 0
    with pytest.raises(UnsupportedError, match="no neurons to reorder"):
        reorder_file(src, str(tmp_path / "r.gguf"), [np.arange(48)] * 2)
    assert not (tmp_path / "r.gguf").exists()


@pytest.mark.parametrize("variant", DENSE_VARIANTS)
def test_reorder_keeps_logits(tmp_path, variant):
    build(variant, str(tmp_path / "hf"))
    src, out = str(tmp_path / "m.gguf"), str(tmp_path / "r.gguf")
    # q8_0: rows are quant blocks, which must move whole
    assert conv.main([str(tmp_path / "hf"), "-o", src, "--outtype", "q8_0"]) == 0
    g = GGUFFile(src)
    rng = np.random.default_rng(7)
    perms = [rng.permutation(g.config.n_ff) for _ in range(g.config.n_layer)]
    reorder_file(src, out, perms)
    r = GGUFFile(out)
    assert r.metadata["pyinfer.neuron_order"] == "hot_first"
    up = "blk.1.ffn_up.weight"
    np.testing.assert_array_equal(r.dequantize(up), g.dequantize(up)[perms[1]])
    assert not np.array_equal(r.tensors[up].data, g.tensors[up].data)  # the file did change
    assert rel_err(reference_logits(r, TOKENS), reference_logits(g, TOKENS)) < 1e-12
    before = Model(src, n_ctx=32, n_threads=2, precise=False).logits(TOKENS)
    after = Model(out, n_ctx=32, n_threads=2, precise=False).logits(TOKENS)
    assert rel_err(after, before) < 1e-5  # only the summation order of the down projection changed


def test_hot_first_order():
    freq = np.array([0.1, 0.5, 0.5, 0.0, 0.9])
    mass = np.array([1.0, 2.0, 3.0, 0.0, 0.1])
    assert hot_first_order(freq, mass).tolist() == [4, 2, 1, 0, 3]
    assert hot_first_order(np.zeros(4), np.zeros(4)).tolist() == [0, 1, 2, 3]  # ties keep the file order
