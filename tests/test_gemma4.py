"""Gemma 4's text model: tiny random gemma4_text checkpoints (tests/hf_tiny.py GEMMA4_VARIANTS) and what they
exercise, the converter's names and keys against llama.cpp's (gguf-py's tables, which its convert_hf_to_gguf.py
writes with), refusals. Their logits, greedy decoding, batches, 2000 tokens through the cache and llama.cpp's layout
of the file against transformers in float64 are test_engine.py's tests, which take these variants too."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import MODEL_ARCH, get_tensor_name_map
from gguf.constants import Keys
from hf_tiny import GEMMA4_VARIANTS, N_VOCAB

import pyinfer.converters.convert_hf_to_powergguf as conv
from pyinfer.errors import UnsupportedError
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.formats.model_config import ModelConfig

RNG = np.random.default_rng(11)
PROMPTS = [[5], RNG.integers(0, N_VOCAB, 9).tolist(), RNG.integers(0, N_VOCAB, 23).tolist()]
VARIANTS = sorted(GEMMA4_VARIANTS)


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def test_variants_exercise_the_features(tiny):
    """What each tiny checkpoint exercises, as the converted file tells it."""
    cfgs = {v: GGUFFile(tiny(v)[1]).config for v in VARIANTS}
    for variant, cfg in cfgs.items():  # windowed layers of head size 16, global ones of 32 (attention_k_eq_v: with
        # num_global_key_value_heads, as transformers reads it only then)
        global_kv = 1 if variant == "gemma4_k_eq_v" else 2
        sizes = (cfg.head_dim, cfg.head_dim_swa, cfg.layer_n_head_kv(0), cfg.layer_n_head_kv(4))
        assert sizes == (32, 16, 2, global_kv)
    ple = cfgs["gemma4_ple"]
    assert ple.n_embd_per_layer == 8 and ple.final_logit_softcap == 3.0
    assert [ple.kv_layer(il) for il in range(5)] == [0, 1, 2, 1, 2]
    assert [ple.layer_n_ff(il) for il in range(5)] == [128, 128, 128, 256, 256]  # double-wide on the shared layers
    assert cfgs["gemma4_k_eq_v"].v_from_k and not cfgs["gemma4"].v_from_k
    assert cfgs["gemma4"].final_logit_softcap == 0.0 and not cfgs["gemma4"].tied_embeddings
    for variant in ("gemma4_moe", "gemma4_mm"):  # the 26B-A4B's experts, beside a dense FFN of 128
        cfg = cfgs[variant]
        assert (cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, cfg.expert_norm, cfg.n_ff) == (4, 2, 48, True, 128)


# what llama.cpp's Gemma4Model.modify_tensors names itself, past gguf-py's map
RENAMED = {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale"}


@pytest.mark.parametrize("variant", VARIANTS)
def test_names_and_keys_are_llama_cpps(tiny, variant):
    """Every tensor of the dense file is the name gguf-py's map (llama.cpp's convert_hf_to_gguf.py) gives its HF
    tensor, rope_freqs (llama.cpp's proportional-RoPE factors) aside, and the experts' gate and up one tensor as
    llama.cpp writes them (the PowerGGUF holds the two halves); every gemma4 key is one of gguf-py's."""
    from pyinfer.formats.gguf_reader import open_gguf

    oracle, _, dense = tiny(variant)
    g = GGUFFile(dense)
    names = get_tensor_name_map(MODEL_ARCH.GEMMA4, g.config.n_layer)
    hp = conv._hparams(conv.read_config(oracle.folder), "gemma4")
    for ours, hf_name, transform in conv.tensor_map("gemma4", hp):
        short = hf_name.split(".", 3)[-1]  # past model.layers.N.
        theirs = (f"blk.{hf_name.split('.')[2]}.{RENAMED[short]}" if short in RENAMED else
                  names.get_name(hf_name.removesuffix(".weight")) + ".weight")
        if transform in ("gate_half", "up_half"):
            assert theirs.endswith(".ffn_gate_up_exps.weight") and ours == theirs.replace("gate_up", transform[:-5])
            continue
        assert theirs == ours, (hf_name, theirs, ours)
    assert set(g.tensors) - {t for t, *_ in conv.tensor_map("gemma4", hp)} == {"rope_freqs.weight"}
    written = {t.name for t in open_gguf(dense)[1].tensors}
    assert ("blk.0.ffn_gate_up_exps.weight" in written) == g.config.is_moe
    assert "blk.0.ffn_gate_exps.weight" not in written
    factors = np.frombuffer(g.tensors["rope_freqs.weight"].data, np.float32)
    if variant == "gemma4_k_eq_v":  # default RoPE on the global layers: every pair rotated
        assert (factors == 1.0).all()
    else:  # a quarter of the global head (32): 4 of its 16 pairs rotated
        assert factors.tolist() == [1.0] * 4 + [float(np.float32(1e30))] * 12
    known = {v.replace("{arch}", "gemma4") for group in (Keys.LLM, Keys.Attention, Keys.Rope)
             for v in vars(group).values() if isinstance(v, str) and v.startswith("{arch}.")}
    assert {k for k in g.metadata if k.startswith("gemma4.")} <= known


def test_refusals():
    """What the converter does not convert is refused by name; an architecture pyinfer does not run is refused as
    unsupported, not as malformed metadata."""
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 300}
    for extra, words in [({"use_bidirectional_attention": "all"}, "bidirectional"),
                         ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}}, "yarn")]:
        with pytest.raises(UnsupportedError, match=words):
            conv._hparams({**base, **extra}, "gemma4")
    meta = {"general.architecture": "gemma4-assistant", "gemma4-assistant.block_count": "not a number"}
    with pytest.raises(UnsupportedError, match="^unsupported architecture 'gemma4-assistant'"):
        ModelConfig.from_metadata(meta)


def test_shared_kv_needs_a_source_of_each_kind(tiny):
    """A file whose shared layers include a kind no earlier layer computes a cache for is malformed."""
    from pyinfer.errors import ModelFormatError

    meta = dict(GGUFFile(tiny("gemma4_ple")[1]).metadata)
    meta["gemma4.attention.sliding_window_pattern"] = [True, True, True, False, False]
    with pytest.raises(ModelFormatError, match="no earlier layer of that kind"):
        ModelConfig.from_metadata(meta)
