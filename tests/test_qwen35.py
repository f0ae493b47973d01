"""Qwen3.5's text model: tiny random qwen3_5_text checkpoints (tests/hf_tiny.py QWEN35_VARIANTS), the converter's
names and keys against llama.cpp's (gguf-py's tables), the recurrent states' checkpoints that let a chat reuse its
cached prefix, refusals. Logits, greedy decoding, batches, 2000 tokens through the cache and the states, and
llama.cpp's layout of the file against transformers in float64 are test_engine.py's tests, which take this variant
too."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import MODEL_ARCH, get_tensor_name_map
from gguf.constants import Keys
from hf_tiny import N_VOCAB, QWEN35_VARIANTS

import pyinfer.converters.convert_hf_to_powergguf as conv
from pyinfer.engine.driver import STATE_CHECKPOINTS, Model
from pyinfer.engine.sampling import SamplerParams
from pyinfer.errors import ModelFormatError, UnsupportedError
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.formats.model_config import ModelConfig

RNG = np.random.default_rng(5)
PROMPT = RNG.integers(0, N_VOCAB, 20).tolist()


@pytest.mark.parametrize("variant", sorted(QWEN35_VARIANTS))
def test_the_variants_exercise_the_features(tiny, variant):
    cfg = GGUFFile(tiny(variant)[1]).config
    assert cfg.recurrent_layers == (True, True, True, False, True)
    assert (cfg.ssm_n_k_heads, cfg.ssm_n_v_heads, cfg.ssm_head_dim, cfg.ssm_conv_kernel) == (2, 4, 16, 4)
    assert cfg.n_rot == 4 and cfg.head_dim == 16  # a quarter of each head rotated
    if variant == "qwen35moe":
        assert (cfg.n_expert, cfg.n_expert_used, cfg.n_ff_exp, cfg.n_ff_shexp, cfg.expert_norm) == (4, 2, 48, 64, True)


@pytest.mark.parametrize("variant", sorted(QWEN35_VARIANTS))
def test_names_and_keys_are_llama_cpps(tiny, variant):
    """Every tensor of the dense file is the name gguf-py's map (llama.cpp's convert_hf_to_gguf.py) gives its HF
    tensor (dt_bias is written as dt_proj.bias there; the experts are stacked as every mixture's); every key of the
    architecture is one of gguf-py's."""
    oracle, _, dense = tiny(variant)
    g = GGUFFile(dense)
    arch = g.config.arch
    names = get_tensor_name_map(MODEL_ARCH.QWEN35MOE if arch == "qwen35moe" else MODEL_ARCH.QWEN35, g.config.n_layer)
    hp = conv._hparams(conv.read_config(oracle.folder), arch)
    for ours, hf_name, _ in conv.tensor_map(arch, hp):
        hf_name = hf_name.replace("dt_bias", "dt_proj.bias").replace("experts.{e}.", "experts.")
        theirs = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert theirs == ours, (hf_name, theirs, ours)
    sections = conv._rope_params(conv.read_config(oracle.folder)).get("mrope_section") or [11, 11, 10]
    assert g.metadata[f"{arch}.rope.dimension_sections"] == [*sections, 0][:4]
    assert set(g.tensors) == {t for t, *_ in conv.tensor_map(arch, hp)}
    known = {v.replace("{arch}", arch) for group in (Keys.LLM, Keys.Attention, Keys.Rope, Keys.SSM)
             for v in vars(group).values() if isinstance(v, str) and v.startswith("{arch}.")}
    assert {k for k in g.metadata if k.startswith(arch + ".")} <= known


@pytest.mark.parametrize("variant", sorted(QWEN35_VARIANTS))
def test_cached_prefix_restarts_from_a_state_checkpoint(tiny, variant):
    """A recurrent state cannot step back: a prompt sharing only part of the cached sequence restarts from the
    latest checkpoint within the shared part (the end of an earlier prompt), or from nothing, and then computes the
    logits of a fresh run."""
    _, power, _ = tiny(variant)
    fresh = Model(power, n_ctx=128, kv_type="f32")
    model = Model(power, n_ctx=128, kv_type="f32")
    said = list(model.generate_tokens(PROMPT, 6, SamplerParams(temperature=0), stop_at_eos=False))
    assert model.n_past == len(PROMPT) + 5  # the last token sampled is not evaluated
    follow = RNG.integers(0, N_VOCAB, 7).tolist()
    for shared, kept in [(len(PROMPT) + 5, len(PROMPT) + 5),  # the whole cache: nothing restored
                         (len(PROMPT) + 3, len(PROMPT)),  # within the answer: back to the prompt's end
                         (len(PROMPT), len(PROMPT)), (len(PROMPT) - 1, 0)]:  # before the only checkpoint: none
        model.reset()
        list(model.generate_tokens(PROMPT, 6, SamplerParams(temperature=0), stop_at_eos=False))
        wanted = (PROMPT + said)[:shared] + follow
        assert model.reuse_prefix(wanted) == kept
        got = model.eval(wanted[kept:])
        np.testing.assert_allclose(got, fresh.logits(wanted)[-1], rtol=0, atol=1e-5 * np.abs(got).max())


def test_checkpoints_are_the_latest_prompts(tiny):
    _, power, _ = tiny("qwen35")
    model = Model(power, n_ctx=128, kv_type="f32")
    for _ in range(STATE_CHECKPOINTS + 2):
        model.eval(PROMPT[:3])
    model.truncate(4)  # between checkpoints at 3 and 6: the earlier ones are gone, this one is kept
    assert model.n_past == 0
    for _ in range(STATE_CHECKPOINTS + 2):
        model.eval(PROMPT[:3])
    model.truncate(3 * STATE_CHECKPOINTS + 4)
    assert model.n_past == 3 * STATE_CHECKPOINTS + 3


def test_chat_with_cache_equals_a_fresh_run(tiny):
    """Two turns through the chat completion API, the second reusing the cached first: the same answers as a
    model that processes each conversation from scratch."""
    _, power, _ = tiny("qwen35")
    cached, fresh = Model(power, n_ctx=256, kv_type="f32"), Model(power, n_ctx=256, kv_type="f32")
    messages = [{"role": "user", "content": "The quick brown fox"}]
    for turn in range(2):
        args = {"temperature": 0, "max_tokens": 8}
        got = cached.create_chat_completion(messages, **args)["choices"][0]["message"]["content"]
        fresh.reset()
        want = fresh.create_chat_completion(messages, cache_prompt=False, **args)["choices"][0]["message"]["content"]
        assert got == want, turn
        messages += [{"role": "assistant", "content": got}, {"role": "user", "content": "judge my vow"}]


def test_refusals(tiny):
    meta = dict(GGUFFile(tiny("qwen35")[1]).metadata)
    with pytest.raises(ModelFormatError, match="inner_size"):
        ModelConfig.from_metadata({**meta, "qwen35.ssm.inner_size": 60})
    with pytest.raises(ModelFormatError, match="time_step_rank 4 .* not a multiple of qwen35.ssm.group_count 3"):
        ModelConfig.from_metadata({**meta, "qwen35.ssm.group_count": 3})
    with pytest.raises(ModelFormatError, match="recurrent_layers has 2 flags"):
        ModelConfig.from_metadata({**meta, "qwen35.attention.recurrent_layers": [True, False]})
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 300, "rms_norm_eps": 1e-6, "max_position_embeddings": 64}
    with pytest.raises(UnsupportedError, match="key heads of 16 and value heads of 32"):
        conv._hparams({**base, "linear_key_head_dim": 16, "linear_value_head_dim": 32}, "qwen35")
    with pytest.raises(ModelFormatError, match="layer_types"):
        conv._hparams({**base, "layer_types": ["linear_attention"]}, "qwen35")
    moe = dict(GGUFFile(tiny("qwen35moe")[1]).metadata)
    assert ModelConfig.from_metadata({**moe, "qwen35moe.expert_shared_count": 1}).n_ff_shexp == 64
    with pytest.raises(UnsupportedError, match="expert_shared_count 2"):
        ModelConfig.from_metadata({**moe, "qwen35moe.expert_shared_count": 2})


def test_multimodal_config_is_read_as_its_text_model(tmp_path):
    """A Qwen3_5ForConditionalGeneration's text_config, with the head tied as the top level says (transformers'
    rule); without a text_config, one line naming it."""
    import json

    text = {"hidden_size": 64, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3_5ForConditionalGeneration"], "tie_word_embeddings": True, "text_config": text}))
    config = conv.read_config(str(tmp_path))
    assert config["hidden_size"] == 64 and config["tie_word_embeddings"] is True
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"]}))
    with pytest.raises(ModelFormatError, match="lacks text_config"):
        conv.read_config(str(tmp_path))


def test_a_convolution_of_another_shape_is_one_line(tiny, tmp_path):
    """A checkpoint whose conv1d is not (channels, 1, taps): the converter says so, naming the tensor."""
    import shutil

    from safetensors.numpy import load_file, save_file

    oracle, _, _ = tiny("qwen35")
    folder = tmp_path / "hf"
    shutil.copytree(oracle.folder, folder)
    (path,) = folder.glob("*.safetensors")
    tensors = load_file(str(path))
    name = "model.layers.0.linear_attn.conv1d.weight"
    tensors[name] = tensors[name][:, 0, :]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ModelFormatError, match=r"conv1d.weight has shape \[128, 4\], expected"):
        conv.convert(str(folder), str(tmp_path / "m.gguf"))


def test_the_ffns_take_training_free_sparsity(tiny, tmp_path):
    """`pyinfer sparsify --method input`'s thresholds on a Qwen3.5 file: with thresholds of 0 the sparse FFNs read
    every channel and neuron and equal the dense model; calibrated for 40 % of the FFN bytes, they read fewer."""
    from pyinfer.sparsity import input_sparsity

    _, power, _ = tiny("qwen35")
    dense = Model(power, n_ctx=64, kv_type="f32")
    cfg = dense.config
    tokens = PROMPT[:12]
    want = dense.logits(tokens)
    zero = [input_sparsity.LayerCalibration(0.0, 0.0, 1.0, np.ones(cfg.n_ff), np.ones(cfg.n_ff))] * cfg.n_layer
    input_sparsity.write(power, str(tmp_path / "zero.gguf"), zero, 0.0, "none")
    sparse = Model(str(tmp_path / "zero.gguf"), n_ctx=64, kv_type="f32")
    assert sparse.sparse_spec is not None and sparse.sparse_spec.kind == "input"
    np.testing.assert_allclose(sparse.logits(tokens), want, rtol=0, atol=1e-4 * np.abs(want).max())
    _, acts = dense.ffn_activations(RNG.integers(0, N_VOCAB, 48).tolist())
    layers = [(acts[f"ffn_inp.{il}"], acts[f"ffn_act.{il}"]) for il in range(cfg.n_layer)]
    input_sparsity.write(power, str(tmp_path / "40.gguf"), input_sparsity.calibrate(layers, 0.4), 0.4, "random")
    model = Model(str(tmp_path / "40.gguf"), n_ctx=64, kv_type="f32")
    model.logits(tokens)
    assert model.timings.extra["ffn_rows_active"] < 0.8 * model.timings.extra["ffn_rows_total"]


def rewritten(src: GGUFFile, path: str, change=None, extra=(), keys=None) -> str:
    """src's metadata (keys: some values replaced or added) and tensors written to path, each tensor through
    change(info) -> (name, type, bytes), then the extra (name, type, ne, bytes) ones."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFValueType as V

    from pyinfer.formats.gguf_writer import OutFile, OutTensor, write_atomically

    tensors = []
    for info in src.tensors.values():
        name, qtype, data = change(info) if change else (info.name, info.type, info.data)
        tensors.append(OutTensor(name, tuple(reversed(info.ne)), Q(qtype), lambda d=data: d))
    for name, qtype, ne, data in extra:
        tensors.append(OutTensor(name, tuple(reversed(ne)), Q(qtype), lambda d=data: d))
    keys = keys or {}
    kv = [(k, keys.pop(k), *rest) if k in keys else (k, v, *rest) for k, v, *rest in src.typed_metadata()
          if k not in ("general.architecture", "general.alignment")]
    kv += [(k, v, V.UINT32, None) for k, v in keys.items()]
    write_atomically([OutFile(path, src.config.arch, kv, tensors)])
    return path


def test_convolution_taps_of_another_float_type_are_read_as_f32(tiny, tmp_path):
    """A file whose ssm_conv1d is F16 (as a converter that rounds every matrix would write it) runs: the taps are
    widened to F32 at load, which the op takes, and the logits are the F32 file's within F16's rounding."""
    from gguf import GGMLQuantizationType as Q

    _, _, dense = tiny("qwen35")
    src = GGUFFile(dense)

    def f16_taps(info):
        if info.name.endswith("ssm_conv1d.weight"):
            return info.name, Q.F16, src.dequantize(info.name).astype(np.float16)
        return info.name, info.type, info.data

    path = rewritten(src, str(tmp_path / "f16-taps.gguf"), f16_taps)
    assert GGUFFile(path).tensors["blk.0.ssm_conv1d.weight"].type == Q.F16
    want = Model(dense, n_ctx=64, kv_type="f32").logits(PROMPT)
    got = Model(path, n_ctx=64, kv_type="f32").logits(PROMPT)
    np.testing.assert_allclose(got, want, rtol=0, atol=5e-3 * np.abs(want).max())


def fused_gate_up(src: GGUFFile, path: str, odd: bool = False) -> str:
    """src with each layer's ffn_gate_exps and ffn_up_exps as one ffn_gate_up_exps, as llama.cpp writes them with
    --fuse-gate-up-exps (and Gemma 4's always): expert by expert, its gate rows, then its up rows. odd: the first
    layer's fused tensor one row short (malformed)."""
    from gguf import GGMLQuantizationType as Q

    from pyinfer.formats.gguf_writer import OutFile, OutTensor, write_atomically

    tensors = []
    for info in src.tensors.values():
        if info.name.endswith("ffn_up_exps.weight"):
            continue
        shape, data = tuple(reversed(info.ne)), info.data
        if info.name.endswith("ffn_gate_exps.weight"):
            up = src.tensors[info.name.replace("gate", "up")]
            n_expert = info.ne[2]
            data = np.concatenate([info.data.reshape(n_expert, 1, -1), up.data.reshape(n_expert, 1, -1)], axis=1)
            shape = (n_expert, 2 * info.ne[1], info.ne[0])
            if odd and info.name.startswith("blk.0."):
                row = info.data.nbytes // (n_expert * info.ne[1])
                data, shape = data.reshape(n_expert, -1)[:, row:], (n_expert, 2 * info.ne[1] - 1, info.ne[0])
            name, data = info.name.replace("gate_exps", "gate_up_exps"), np.ascontiguousarray(data).reshape(-1)
            tensors.append(OutTensor(name, shape, Q(info.type), lambda d=data: d))
            continue
        tensors.append(OutTensor(info.name, shape, Q(info.type), lambda d=data: d))
    kv = [(k, v, *rest) for k, v, *rest in src.typed_metadata() if k not in ("general.architecture",
                                                                              "general.alignment")]
    write_atomically([OutFile(path, src.config.arch, kv, tensors)])
    return path


def test_fused_gate_and_up_experts_run_as_the_two(tiny, tmp_path):
    """A file whose experts' gate and up are one tensor a layer (ffn_gate_up_exps) opens as the two it was made of,
    byte for byte, and computes the same logits; a fused tensor of an odd row count is a one-line error."""
    from pyinfer.errors import ModelFormatError

    split = tiny("qwen35moe")[2]
    path = fused_gate_up(GGUFFile(split), str(tmp_path / "fused.gguf"))
    a, b = GGUFFile(split), GGUFFile(path)
    assert "blk.0.ffn_gate_up_exps.weight" not in b.tensors
    for il in range(a.config.n_layer):
        for half in ("gate", "up"):
            name = f"blk.{il}.ffn_{half}_exps.weight"
            assert b.tensors[name].ne == a.tensors[name].ne
            np.testing.assert_array_equal(b.tensors[name].data, a.tensors[name].data)
    want = Model(split, n_ctx=64, kv_type="f32").logits(PROMPT)
    np.testing.assert_array_equal(Model(path, n_ctx=64, kv_type="f32").logits(PROMPT), want)
    odd = fused_gate_up(a, str(tmp_path / "odd.gguf"), odd=True)
    with pytest.raises(ModelFormatError, match=r"ffn_gate_up_exps.weight has shape \[64, 95, 4\]"):
        GGUFFile(odd)


def test_multi_token_prediction_blocks_are_skipped(tiny, tmp_path):
    """A file as llama.cpp's converter writes Qwen3.5 with its MTP block: one more block (a full-attention layer and
    the nextn tensors) counted in block_count and named by nextn_predict_layers; the forward pass skips it, so the
    logits are those of the file without it."""
    _, _, dense = tiny("qwen35")
    src = GGUFFile(dense)
    n = src.config.n_layer
    mtp = [(name.replace("blk.3.", f"blk.{n}."), info.type, info.ne, info.data)
           for name, info in src.tensors.items() if name.startswith("blk.3.")]
    d = src.config.n_embd
    mtp.append((f"blk.{n}.nextn.eh_proj.weight", 0, (2 * d, d), np.ones((d, 2 * d), np.float32)))
    path = rewritten(src, str(tmp_path / "mtp.gguf"), extra=mtp,
                     keys={"qwen35.block_count": n + 1, "qwen35.nextn_predict_layers": 1})
    cfg = GGUFFile(path).config
    assert cfg.n_layer == n and len(cfg.recurrent_layers) == n
    want = Model(dense, n_ctx=64, kv_type="f32").logits(PROMPT)
    np.testing.assert_array_equal(Model(path, n_ctx=64, kv_type="f32").logits(PROMPT), want)
    meta = dict(GGUFFile(path).metadata)
    with pytest.raises(UnsupportedError, match="blocks alone"):
        ModelConfig.from_metadata({**meta, "qwen35.nextn_predict_layers": n + 1})


@pytest.mark.parametrize(("when", "n_past"), [("after the run", 12), ("before the run", 13)])
def test_a_failed_eval_leaves_states_and_tokens_together(tiny, monkeypatch, when, n_past):
    """An error or Ctrl-C after a batch has moved the recurrent states but before its tokens are counted rewinds both
    to the latest checkpoint (12 here: the states had kept the lost batch); an eval that fails before it runs (its
    graph not built) moved nothing and keeps its 13 tokens (it had gone back to the checkpoint too). Either way the
    next eval computes what a fresh model does."""
    from pyinfer.engine import driver
    from pyinfer.errors import InvalidArgumentError

    _, power, _ = tiny("qwen35")
    fresh = Model(power, n_ctx=64, kv_type="f32")
    model = Model(power, n_ctx=64, kv_type="f32")
    model.eval(PROMPT[:10])  # a checkpoint at 10
    model.eval(PROMPT[10:12])  # and at 12
    model.eval([PROMPT[12]])  # a decoded token past it
    run = driver._StepGraph.run

    def interrupted(self, pool, tokens, n_past):
        run(self, pool, tokens, n_past)
        raise KeyboardInterrupt

    def unbuildable(self, n_tokens, n_out, capture=False):
        raise InvalidArgumentError("no graph")

    if when == "after the run":
        monkeypatch.setattr(driver._StepGraph, "run", interrupted)
    else:
        monkeypatch.setattr(driver.Model, "_graph", unbuildable)
    with pytest.raises((KeyboardInterrupt, InvalidArgumentError)):
        model.eval([PROMPT[13]])
    monkeypatch.undo()
    assert model.n_past == n_past
    got = model.eval(PROMPT[n_past:])
    np.testing.assert_allclose(got, fresh.logits(PROMPT)[-1], rtol=0, atol=1e-5 * np.abs(got).max())


def test_a_failed_checkpoint_copy_leaves_no_mixed_checkpoint(tiny, monkeypatch):
    """The fifth prompt's checkpoint reuses the arrays of the first; a copy that fails halfway must not leave the first
    in the list with the fifth's bytes in part of it."""
    from pyinfer.native import ggml

    _, power, _ = tiny("qwen35")
    model = Model(power, n_ctx=64, kv_type="f32")
    for _ in range(STATE_CHECKPOINTS):
        model.eval(PROMPT[:3])  # checkpoints at 3, 6, 9, 12
    read_into, calls = ggml.Tensor.read_into, []

    def failing(self, out):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("copy failed")
        read_into(self, out)

    monkeypatch.setattr(ggml.Tensor, "read_into", failing)
    with pytest.raises(RuntimeError):
        model.eval(PROMPT[:3])
    monkeypatch.undo()
    model.truncate(4)  # the checkpoint at 3 went with its arrays: none within 4 tokens is left
    assert model.n_past == 0
