"""Converter + GGUFFile + numpy reference against transformers on tiny random checkpoints."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize, quantize
from hf_tiny import CHAT_TEMPLATE, N_VOCAB, SPECIALS, VARIANTS, build, roundtrip_weights
from reference import reference_ffn_activations, reference_logits

import pyinfer.converters.convert_hf_to_powergguf as conv
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.formats.gguf_writer import pick_type

TOKENS = [1, 5, 77, 200, 3, 9, 250, 11, 299]
EXACT = 1e-8  # float64 vs float64: only the float32-stored eps / rope base differ
# Gemma's norms scale by 1 + w, which the file stores (as llama.cpp's do) as one float32: w's last bits go;
# Llama 3's RoPE factors are float32 in the file, and transformers computes its scaled frequencies (Llama 3's,
# YaRN's) in float32; Mixtral's router takes the softmax of its logits in float32
EXACT_FLOAT32_STORED = {"gemma3": 1e-6, "llama3_rope": 1e-6, "llama_yarn": 1e-6, "mixtral": 1e-6}


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def convert(folder: str, out: str, *extra: str) -> int:
    return conv.main([folder, "-o", out, *extra])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """variant -> TinyModel, built on first use (the oracle is shared: copy() before changing weights)."""
    built = {}

    def get(variant: str):
        if variant not in built:
            built[variant] = build(variant, str(tmp_path_factory.mktemp(variant)))
        return built[variant]
    return get


@pytest.fixture(scope="module")
def power_silu(models, tmp_path_factory):
    """llama_silu converted to F32 PowerGGUF plus its dense GGUF."""
    out = tmp_path_factory.mktemp("power")
    power, dense = str(out / "m.gguf"), str(out / "dense.gguf")
    assert convert(models("llama_silu").folder, power, "--outtype", "f32", "--dense-gguf", dense) == 0
    return power, dense


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_f32_matches_transformers(models, tmp_path, variant):
    tiny = models(variant)
    out = str(tmp_path / "m.gguf")
    assert convert(tiny.folder, out, "--outtype", "f32") == 0
    g = GGUFFile(out)
    assert g.ffn_layout == ("down" if g.config.is_moe else "down_t")  # experts stay as llama.cpp stores them
    assert rel_err(reference_logits(g, TOKENS), tiny.logits(TOKENS)) < EXACT_FLOAT32_STORED.get(variant, EXACT)


def test_powergguf_layout(power_silu, models):
    r = GGUFReader(power_silu[0])  # the standard reader opens it
    meta = {k: f.contents() for k, f in r.fields.items()}
    assert meta["general.architecture"] == "llama"
    assert meta["pyinfer.format_version"] == 1
    assert meta["pyinfer.ffn_layout"] == "down_t"
    assert meta["pyinfer.neuron_order"] == "original"
    assert meta["pyinfer.ffn_kind"] == "swiglu"
    assert meta["llama.feed_forward_length"] == 128 and meta["llama.attention.head_count_kv"] == 2
    tensors = {t.name: t for t in r.tensors}
    assert "blk.0.ffn_down.weight" not in tensors
    assert list(tensors["blk.1.ffn_down_t.weight"].shape) == [64, 128]  # ne: one row of n_embd per neuron
    assert tensors["blk.0.attn_norm.weight"].tensor_type == Q.F32
    g = GGUFFile(power_silu[0])
    cfg = g.config
    assert (cfg.n_vocab, cfg.n_embd, cfg.n_layer, cfg.n_ff, cfg.n_head, cfg.n_head_kv, cfg.head_dim) == \
        (N_VOCAB, 64, 2, 128, 4, 2, 16)
    assert cfg.rope_mode == "normal" and not cfg.tied_embeddings and not cfg.qkv_bias
    # ffn_down_t rows are the columns of HF's down_proj
    hf_down = models("llama_silu").model.model.layers[1].mlp.down_proj.weight.detach().numpy()  # (n_embd, n_ff)
    np.testing.assert_array_equal(g.dequantize("blk.1.ffn_down_t.weight"), hf_down.T)


def test_tokenizer_metadata(power_silu, models):
    meta = GGUFFile(power_silu[0]).metadata
    with open(os.path.join(models("llama_silu").folder, "tokenizer.json")) as f:
        tj = json.load(f)
    vocab = tj["model"]["vocab"]
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == N_VOCAB
    for tok, tid in vocab.items():
        assert tokens[tid] == tok
    n_real = max(vocab.values()) + 1
    assert tokens[n_real:] == [f"[PAD{i}]" for i in range(n_real, N_VOCAB)] and set(types[n_real:]) == {5}
    ids = {s: vocab[s] for s in SPECIALS}
    assert all(types[i] == 3 for i in ids.values())  # control
    assert meta["tokenizer.ggml.bos_token_id"] == ids["<|im_start|>"]
    assert meta["tokenizer.ggml.eos_token_id"] == ids["<|im_end|>"]
    assert meta["tokenizer.ggml.padding_token_id"] == ids["<|endoftext|>"]
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "gpt-2"
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    assert meta["tokenizer.ggml.merges"] == merges
    assert meta["tokenizer.chat_template"] == CHAT_TEMPLATE
    assert meta["tokenizer.ggml.add_bos_token"] is False


@pytest.mark.parametrize("variant,outtype,bound", [
    ("llama_silu", "f16", 5e-3), ("llama_silu", "bf16", 3e-2), ("llama_silu", "q8_0", 0.1),
    ("llama_silu", "q4_0", 1.0), ("llama_silu", "q4_1", 1.0), ("opt", "q8_0", 0.1), ("qwen2", "q4_0", 1.0)])
def test_quantized(tmp_path, variant, outtype, bound):
    tiny = build(variant, str(tmp_path / "hf"))
    out = str(tmp_path / "m.gguf")
    assert convert(tiny.folder, out, "--outtype", outtype) == 0
    g = GGUFFile(out)
    assert g.tensors["blk.0.ffn_up.weight"].type == Q[outtype.upper()]
    assert g.tensors["blk.0.ffn_down_t.weight"].type == Q[outtype.upper()]
    assert g.tensors["output_norm.weight"].type == Q.F32
    got = reference_logits(g, TOKENS)
    assert rel_err(got, tiny.logits(TOKENS)) < bound
    # exact: transformers with each weight quantized along the same rows
    assert rel_err(got, roundtrip_weights(tiny, Q[outtype.upper()]).logits(TOKENS)) < EXACT


def test_bf16_sharded_checkpoint(tmp_path):
    tiny = build("qwen2", str(tmp_path / "hf"), seed=3, dtype=torch.bfloat16, max_shard_size="40KB")
    shards = [n for n in os.listdir(tiny.folder) if n.endswith(".safetensors")]
    assert len(shards) > 1 and os.path.exists(os.path.join(tiny.folder, "model.safetensors.index.json"))
    out = str(tmp_path / "m.gguf")
    assert convert(tiny.folder, out, "--outtype", "f32") == 0
    g = GGUFFile(out)
    assert g.config.tied_embeddings and g.config.qkv_bias and g.config.rope_mode == "neox"
    assert rel_err(reference_logits(g, TOKENS), tiny.logits(TOKENS)) < EXACT


def test_dense_gguf_export(power_silu):
    power, dense = power_silu
    r = GGUFReader(dense)
    assert not [k for k in r.fields if k.startswith("pyinfer.")]
    tensors = {t.name: t for t in r.tensors}
    assert "blk.0.ffn_down_t.weight" not in tensors
    assert list(tensors["blk.0.ffn_down.weight"].shape) == [128, 64]
    g = GGUFFile(dense)
    assert g.ffn_layout == "down"
    np.testing.assert_allclose(reference_logits(g, TOKENS), reference_logits(GGUFFile(power), TOKENS),
                               rtol=0, atol=1e-12)


def test_gguf_input_f32_keeps_bytes(power_silu, tmp_path):
    power, dense = power_silu
    out = str(tmp_path / "from_gguf.gguf")
    assert convert(dense, out) == 0
    src, got = GGUFFile(dense), GGUFFile(out)
    assert got.ffn_layout == "down_t" and got.metadata["pyinfer.ffn_kind"] == "swiglu"
    for name, info in src.tensors.items():
        if "ffn_down" not in name:
            assert got.tensors[name].type == info.type
            np.testing.assert_array_equal(got.tensors[name].data, info.data)
    assert got.metadata["tokenizer.ggml.tokens"] == src.metadata["tokenizer.ggml.tokens"]
    np.testing.assert_array_equal(reference_logits(got, TOKENS), reference_logits(GGUFFile(power), TOKENS))


@pytest.mark.parametrize("outtype,down_type,want", [("q4_1", "same", "Q4_1"), ("q8_0", "same", "Q8_0"),
                                                    ("q4_0", "q8_0", "Q8_0"), ("q4_0", "f16", "F16"),
                                                    ("q4_1", "auto", "Q8_0"), ("q8_0", "auto", "Q8_0"),
                                                    ("f16", "auto", "F16")])
def test_gguf_input_requantizes_down(models, tmp_path, outtype, down_type, want):
    dense, out = str(tmp_path / "dense.gguf"), str(tmp_path / "power.gguf")
    assert convert(models("llama_relu").folder, str(tmp_path / "p0.gguf"), "--outtype", outtype,
                   "--dense-gguf", dense) == 0
    assert convert(dense, out, "--down-type", down_type) == 0
    src, got = GGUFFile(dense), GGUFFile(out)
    qtype = Q[want]
    assert got.tensors["blk.0.ffn_down_t.weight"].type == qtype
    assert got.tensors["blk.0.ffn_up.weight"].type == Q[outtype.upper()]
    # ffn_down_t = requantized transpose of the dequantized ffn_down
    down = src.dequantize("blk.0.ffn_down.weight").astype(np.float32)  # (n_embd, n_ff)
    want = dequantize(quantize(np.ascontiguousarray(down.T), qtype), qtype)
    np.testing.assert_array_equal(got.dequantize("blk.0.ffn_down_t.weight"), want)
    assert rel_err(reference_logits(got, TOKENS), reference_logits(src, TOKENS)) < 0.5


def test_reference_capture(models, tmp_path):
    tiny = models("llama_relu")
    out = str(tmp_path / "m.gguf")
    assert convert(tiny.folder, out, "--outtype", "f32") == 0
    seen: dict[str, list[np.ndarray]] = {"ffn_in": [], "ffn_h": []}
    hooks = []
    for layer in tiny.model.model.layers:
        hooks.append(layer.mlp.register_forward_pre_hook(lambda m, a: seen["ffn_in"].append(a[0][0].numpy())))
        hooks.append(layer.mlp.down_proj.register_forward_pre_hook(
            lambda m, a: seen["ffn_h"].append(a[0][0].numpy())))
    try:
        tiny.logits(TOKENS)
    finally:
        for h in hooks:
            h.remove()
    cap = reference_ffn_activations(GGUFFile(out), TOKENS)
    for key in ("ffn_in", "ffn_h"):
        assert len(cap[key]) == 2
        for a, b in zip(cap[key], seen[key], strict=True):
            assert rel_err(a, b) < EXACT
    assert (cap["ffn_h"][0] == 0).mean() > 0.3  # ReGLU: relu(gate) zeroes many neurons


def test_down_t_type_for_unquantizable_sources():
    notes: list[str] = []
    assert conv._down_t_type(Q.Q4_K, 576, "d", notes, "same") == Q.Q8_0  # gguf-py cannot quantize K-quants
    assert conv._down_t_type(Q.Q4_0, 48, "d", notes, "same") == Q.F16  # 48 is not a whole Q8_0 block
    assert conv._down_t_type(Q.Q4_0, 64, "d", notes, "same") == Q.Q4_0
    assert conv._down_t_type(Q.BF16, 48, "d", notes, "same") == Q.BF16
    assert len(notes) == 2


def test_pick_type_falls_back_to_f16():
    notes: list[str] = []
    assert pick_type("blk.0.ffn_down.weight", (64, 80), Q.Q8_0, notes) == Q.F16 and len(notes) == 1
    assert pick_type("blk.0.attn_norm.weight", (64,), Q.Q8_0, notes) == Q.F32
    assert pick_type("blk.0.ffn_up.weight", (128, 64), Q.Q4_0, notes) == Q.Q4_0 and len(notes) == 1


# ----------------------------------------------------------------------------
# bad inputs: exit 1, one line on stderr, nothing written


def _truncate_shard(folder: str) -> None:
    path = os.path.join(folder, "model.safetensors")
    os.truncate(path, os.path.getsize(path) - 100)


def _set_config(key: str, value):
    def edit(folder: str) -> None:
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            config = json.load(f)
        config[key] = value
        with open(path, "w") as f:
            json.dump(config, f)
    return edit


def _int_dtype(folder: str) -> None:
    """Relabel one F32 tensor as I32 (same size, so the header stays valid)."""
    path = os.path.join(folder, "model.safetensors")
    with open(path, "r+b") as f:
        head = f.read(4096)
        at = head.index(b'"F32"')
        f.seek(at)
        f.write(b'"I32"')


def _write(name: str, raw: bytes):
    def edit(folder: str) -> None:
        with open(os.path.join(folder, name), "wb") as f:
            f.write(raw)
    return edit


def _edit_safetensors_header(change):
    """Rewrites model.safetensors with change(header) applied to its JSON header."""
    def edit(folder: str) -> None:
        path = os.path.join(folder, "model.safetensors")
        with open(path, "rb") as f:
            raw = f.read()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        text = change(header)
        text = text if isinstance(text, bytes) else json.dumps(header).encode()
        with open(path, "wb") as f:
            f.write(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    return edit


def _overlap(header: dict) -> None:
    first, second = sorted((v for k, v in header.items() if k != "__metadata__"), key=lambda e: e["data_offsets"])[:2]
    size = second["data_offsets"][1] - second["data_offsets"][0]
    second["data_offsets"] = [first["data_offsets"][0], first["data_offsets"][0] + size]


def _shard_index(weight_map):
    """Writes model.safetensors.index.json with weight_map (a function of the tensor names)."""
    def edit(folder: str) -> None:
        with open(os.path.join(folder, "model.safetensors"), "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            names = [k for k in json.loads(f.read(n)) if k != "__metadata__"]
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"weight_map": weight_map(names)}, f)
    return edit


def _set_vocab_id(value: int):
    def edit(folder: str) -> None:
        path = os.path.join(folder, "tokenizer.json")
        with open(path) as f:
            tj = json.load(f)
        tj["model"]["vocab"]["!"] = value
        with open(path, "w") as f:
            json.dump(tj, f)
    return edit


BAD_INPUTS = {
    "truncated safetensors": (_truncate_shard, "truncated"),
    "unknown arch": (_set_config("architectures", ["GPT2LMHeadModel"]), "unsupported architecture"),
    "shape mismatch": (_set_config("intermediate_size", 96), "expected"),
    "unknown dtype": (_int_dtype, "dtype"),
    "no tokenizer": (lambda d: os.remove(os.path.join(d, "tokenizer.json")), "tokenizer"),
    "bad activation": (_set_config("hidden_act", "tanh"), "hidden_act"),
    "longrope": (_set_config("rope_parameters", {"rope_type": "longrope", "factor": 4.0, "rope_theta": 5e5}),
                 "unsupported rope type 'longrope'; supported: default, linear, llama3, yarn"),
    "yarn untruncated": (_set_config("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "truncate": False}),
                         "YaRN with truncate false is not supported"),
    "yarn factor below 1": (_set_config("rope_parameters", {"rope_type": "yarn", "factor": 0.5}), "below 1"),
    "llama3 rope incomplete": (_set_config("rope_parameters", {"rope_type": "llama3", "rope_theta": 5e5}),
                               "lacks factor"),
    # issue 14: each of these was a raw exception, a RecursionError or a MemoryError after 35-40 s
    "config nested deep": (_write("config.json", b"[" * 100_000 + b"]" * 100_000), "nested too deeply"),
    "config repeated key": (_write("config.json", b'{"hidden_size": 64, "hidden_size": 65}'), "appears twice"),
    "config not utf-8": (_write("config.json", b'{"a": "\xff"}'), "unreadable JSON"),
    "hidden_size string": (_set_config("hidden_size", "abc"), "hidden_size = 'abc': expected an integer"),
    "hidden_size null": (_set_config("hidden_size", None), "lacks hidden_size"),
    "hidden_size 1e400": (_set_config("hidden_size", float("inf")), "hidden_size = inf"),
    "zero heads": (_set_config("num_attention_heads", 0), "num_attention_heads = 0"),
    "rope_scaling string": (_set_config("rope_scaling", "linear"), "rope_scaling = 'linear': expected a JSON object"),
    "rope factor zero": (_set_config("rope_scaling", {"type": "linear", "factor": 0}), "rope_scaling.factor = 0"),
    "layers 10^9": (_set_config("num_hidden_layers", 10**9), "num_hidden_layers = 1000000000"),
    "one layer too many": (_set_config("num_hidden_layers", 3), "the 2 layers the tensors hold"),
    "vocab 2^40": (_set_config("vocab_size", 2**40), "vocab_size = 1099511627776"),
    "vocab one short": (_set_config("vocab_size", N_VOCAB - 1), f"vocab_size {N_VOCAB - 1}"),
    "tie as string": (_set_config("tie_word_embeddings", "false"), "tie_word_embeddings = 'false'"),
    "header nested deep": (_edit_safetensors_header(lambda h: b"[" * 100_000 + b"]" * 100_000), "nested too deeply"),
    "overlapping tensors": (_edit_safetensors_header(_overlap), "without gaps or overlaps"),
    "name with a newline": (_edit_safetensors_header(lambda h: h.__setitem__("a\nb", h.pop(max(h)))),
                            "tensor name 'a\\nb' is not printable"),
    "negative shape": (_edit_safetensors_header(lambda h: h[max(h)].update(shape=[-1])), "shape[0] = -1"),
    "weight_map list": (_shard_index(lambda names: names), "weight_map = ["),
    "shard outside": (_shard_index(lambda names: dict.fromkeys(names, "../model.safetensors")), "not a file name"),
    "vocab id 2^40": (_set_vocab_id(2**40), "model.vocab['!'] = 1099511627776: expected an integer"),
    "vocab id n_vocab": (_set_vocab_id(N_VOCAB), f"token id {N_VOCAB} is not below vocab_size {N_VOCAB}"),
}


def _check_failed(rc: int, capsys, words: str) -> None:
    err = capsys.readouterr().err.strip()
    assert rc == 1
    assert len(err.splitlines()) == 1 and err.startswith("convert-hf-to-powergguf: error:"), err
    assert words in err, err


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_fails_cleanly(models, tmp_path, capsys, case):
    folder = str(tmp_path / "hf")
    shutil.copytree(models("llama_silu").folder, folder)
    edit, words = BAD_INPUTS[case]
    edit(folder)
    before = sorted(os.listdir(folder))
    capsys.readouterr()  # what building the checkpoint printed
    t0 = time.perf_counter()
    rc = convert(folder, os.path.join(folder, "m.gguf"), "--dense-gguf", os.path.join(folder, "d.gguf"))
    assert time.perf_counter() - t0 < 10  # no size is looped over or allocated before it is checked
    _check_failed(rc, capsys, words)
    assert sorted(os.listdir(folder)) == before


@pytest.mark.parametrize("key,value,words", [
    ("alibi", True, "Falcon with alibi = True is not supported (only False)"),
    ("parallel_attn", False, "Falcon with parallel_attn = False is not supported"),
    ("multi_query", False, "multi_query false) is not supported"),
    ("activation", "silu", "Falcon with activation 'silu' is not supported; supported: gelu, gelu_pytorch_tanh"),
])
def test_unsupported_falcon_fails_in_one_line(models, tmp_path, capsys, key, value, words):
    folder = str(tmp_path / "hf")
    shutil.copytree(models("falcon_7b").folder, folder)
    _set_config(key, value)(folder)
    capsys.readouterr()
    _check_failed(convert(folder, os.path.join(folder, "m.gguf")), capsys, words)


def test_missing_dir(tmp_path, capsys):
    _check_failed(convert(str(tmp_path / "nope"), str(tmp_path / "m.gguf")), capsys, "no such file or directory")
    assert os.listdir(tmp_path) == []


def test_unwritable_output(models, tmp_path, capsys):
    rc = convert(models("opt").folder, str(tmp_path / "missing_dir" / "m.gguf"))
    _check_failed(rc, capsys, "No such file or directory")
    assert os.listdir(tmp_path) == []


def test_opt_has_no_dense_gguf(models, tmp_path, capsys):
    rc = convert(models("opt").folder, str(tmp_path / "m.gguf"), "--dense-gguf", str(tmp_path / "d.gguf"))
    _check_failed(rc, capsys, "OPT")
    assert os.listdir(tmp_path) == []


def test_interrupt_leaves_nothing(models, tmp_path, capsys, monkeypatch):
    calls = []

    def interrupted(values, qtype):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return quantize(np.asarray(values, dtype=np.float32), qtype)

    monkeypatch.setattr(conv, "encode", interrupted)
    rc = convert(models("llama_silu").folder, str(tmp_path / "m.gguf"), "--dense-gguf", str(tmp_path / "d.gguf"))
    assert rc == 130 and "interrupted" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_sigterm_while_writing_leaves_nothing(models, tmp_path, capsys, monkeypatch):
    """SIGTERM (a closed session, `kill`) during the write cleans up as Ctrl-C does; exit 128 + 15."""
    calls = []

    def terminated(values, qtype):
        calls.append(1)
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return quantize(np.asarray(values, dtype=np.float32), qtype)

    folder = models("llama_silu").folder
    capsys.readouterr()
    monkeypatch.setattr(conv, "encode", terminated)
    rc = convert(folder, str(tmp_path / "m.gguf"), "--dense-gguf", str(tmp_path / "d.gguf"))
    assert rc == 143 and capsys.readouterr().err.strip() == "convert-hf-to-powergguf: terminated"
    assert os.listdir(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handler lives only as long as the write


@pytest.mark.parametrize("kind", ["fifo", "folder", "link to fifo"])
def test_output_that_is_not_a_regular_file_is_refused(models, tmp_path, capsys, kind):
    """`-o /dev/full` as root renamed the temp file over the device node; a FIFO stands in for it here."""
    out = tmp_path / "out.gguf"
    if kind == "folder":
        out.mkdir()
    else:
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        if kind == "fifo":
            fifo.rename(out)
        else:
            out.symlink_to(fifo)
    folder = models("opt").folder
    capsys.readouterr()
    _check_failed(convert(folder, str(out)), capsys, "not a regular file")
    assert out.exists() and not out.is_file()
    assert not list(tmp_path.glob(".*.part"))


def test_output_link_to_a_file_is_written_through(models, tmp_path):
    target = tmp_path / "real.gguf"
    target.write_bytes(b"old")
    (tmp_path / "link.gguf").symlink_to(target)
    assert convert(models("opt").folder, str(tmp_path / "link.gguf")) == 0
    assert (tmp_path / "link.gguf").is_symlink() and GGUFFile(str(target)).config.arch == "opt"


def test_same_output_twice_is_refused(models, tmp_path, capsys):
    out, folder = str(tmp_path / "m.gguf"), models("llama_silu").folder
    capsys.readouterr()
    _check_failed(convert(folder, out, "--dense-gguf", out), capsys, "the same file")
    assert os.listdir(tmp_path) == []


def test_help_runs_as_script():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-m", "pyinfer.converters.convert_hf_to_powergguf", "--help"],
                         cwd=root, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "--dense-gguf" in res.stdout and "--outtype" in res.stdout


def test_sentencepiece_vocab(tmp_path):
    import sentencepiece as spm
    from hf_tiny import TEXT

    from pyinfer.converters.hf_vocab import vocab_metadata

    prefix = str(tmp_path / "tokenizer")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT * 8), model_prefix=prefix, vocab_size=340,
                                   model_type="bpe", byte_fallback=True, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
    with open(tmp_path / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)
    meta = {k: v for k, v, *_ in vocab_metadata(str(tmp_path), "llama", 352, {})}
    n = sp.get_piece_size()
    assert meta["tokenizer.ggml.model"] == "llama" and meta["tokenizer.ggml.add_bos_token"] is True
    assert meta["tokenizer.ggml.tokens"][:n] == [sp.id_to_piece(i) for i in range(n)]
    assert len(meta["tokenizer.ggml.tokens"]) == len(meta["tokenizer.ggml.scores"]) == 352
    np.testing.assert_allclose(meta["tokenizer.ggml.scores"][:n], [sp.get_score(i) for i in range(n)])
    types = meta["tokenizer.ggml.token_type"]
    assert types[sp.unk_id()] == 2 and types[sp.bos_id()] == 3 and types[sp.piece_to_id("<0x41>")] == 6
    assert meta["tokenizer.ggml.bos_token_id"] == sp.bos_id() and meta["tokenizer.ggml.eos_token_id"] == sp.eos_id()


GEMMA_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "vocab_size": 300,
               "max_position_embeddings": 64, "rms_norm_eps": 1e-6}


@pytest.mark.parametrize("config", [
    {"num_hidden_layers": 7},  # nothing said: transformers' defaults (every 6th layer global, window 4096, ...)
    {"num_hidden_layers": 5, "sliding_window_pattern": 2, "sliding_window": 16},  # older configs: no layer_types
    {"num_hidden_layers": 4, "sliding_window_pattern": 1},  # every layer global
    {"num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention", "full_attention",
                                             "sliding_attention"]},  # no every-n-th rule: one flag per layer
    {"num_hidden_layers": 4, "head_dim": 16, "query_pre_attn_scalar": 32, "sliding_window": 100,
     "rope_local_base_freq": 5000.0, "rope_theta": 20000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
     "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]},
], ids=["defaults", "pattern", "all-global", "flags", "explicit"])
def test_gemma3_config_read_as_transformers_reads_it(config):
    """A Gemma 3 config.json, through the converter's metadata into ModelConfig, against what transformers'
    Gemma3TextConfig makes of the same file: which layers are windowed, the window, each layer's RoPE base
    and linear scale, the softmax scale, the head size."""
    import transformers as T

    from pyinfer.formats.model_config import ModelConfig

    config = {**GEMMA_SIZES, **config}
    theirs = T.Gemma3TextConfig(**json.loads(json.dumps(config)))
    hp = conv._hparams(config, "gemma3")
    meta = {k: v for k, v, *_ in conv._arch_kv("gemma3", hp, "t", Q.F32)}
    ours = ModelConfig.from_metadata({**meta, "general.architecture": "gemma3"})
    assert ours.head_dim == theirs.head_dim
    assert [ours.windowed(i) for i in range(ours.n_layer)] == [t == "sliding_attention" for t in theirs.layer_types]
    if any(ours.windowed(i) for i in range(ours.n_layer)):
        assert ours.sliding_window == theirs.sliding_window
    for il, kind in enumerate(theirs.layer_types):
        params = theirs.rope_parameters[kind]
        want = (params["rope_theta"], params.get("factor", 1.0) if params["rope_type"] == "linear" else 1.0)
        assert ours.layer_rope(il) == pytest.approx(want, rel=1e-7), il
    assert ours.softmax_scale == pytest.approx(theirs.query_pre_attn_scalar ** -0.5, rel=1e-7)


def test_gemma3_config_refusals(capsys):
    for extra, words in [({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
                         ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
                          "sliding-window layers")]:
        with pytest.raises(conv.UnsupportedError, match=words):
            conv._hparams({**GEMMA_SIZES, "num_hidden_layers": 3, **extra}, "gemma3")


@pytest.mark.parametrize("n_layer", [18, 62])
def test_gemma3_gguf_scale_and_softcap_as_llama_cpp(n_layer):
    """llama.cpp's Gemma 3 files carry no attention.scale: it is 1/sqrt(head_dim), but 1/sqrt(n_embd / n_head)
    for the 27B (62 layers), as llama.cpp computes it; a final logit softcap is read as llama.cpp reads it (0:
    none), and the converter writes config.json's."""
    from pyinfer.formats.model_config import ModelConfig

    hp = conv._hparams({**GEMMA_SIZES, "num_hidden_layers": n_layer, "head_dim": 32}, "gemma3")
    meta = {k: v for k, v, *_ in conv._arch_kv("gemma3", hp, "t", Q.F32) if k != "gemma3.attention.scale"}
    meta["general.architecture"] = "gemma3"
    want = 1 / np.sqrt(64 / 4) if n_layer == 62 else 1 / np.sqrt(32)
    assert ModelConfig.from_metadata(meta).softmax_scale == pytest.approx(want)
    assert ModelConfig.from_metadata({**meta, "gemma3.attention.scale": 0.5}).softmax_scale == 0.5
    assert ModelConfig.from_metadata({**meta, "gemma3.final_logit_softcapping": 30.0}).final_logit_softcap == 30.0
    assert ModelConfig.from_metadata({**meta, "gemma3.final_logit_softcapping": 0.0}).final_logit_softcap == 0.0
    assert ModelConfig.from_metadata(meta).final_logit_softcap == 0.0
    capped = conv._hparams({**GEMMA_SIZES, "num_hidden_layers": n_layer, "final_logit_softcapping": 30.0}, "gemma3")
    assert ("gemma3.final_logit_softcapping", 30.0) in [(k, v) for k, v, *_ in conv._arch_kv("gemma3", capped, "t",
                                                                                            Q.F32)]


def test_gemma3_window_flags_are_checked():
    """llama.cpp's per-layer form of attention.sliding_window_pattern: booleans, one per layer."""
    from pyinfer.errors import ModelFormatError
    from pyinfer.formats.model_config import ModelConfig

    hp = conv._hparams({**GEMMA_SIZES, "num_hidden_layers": 3}, "gemma3")
    meta = {k: v for k, v, *_ in conv._arch_kv("gemma3", hp, "t", Q.F32)}
    meta["general.architecture"] = "gemma3"
    key = "gemma3.attention.sliding_window_pattern"
    cfg = ModelConfig.from_metadata({**meta, key: [False, True, False]})
    assert [cfg.windowed(i) for i in range(3)] == [False, True, False]
    with pytest.raises(ModelFormatError, match="has 2 flags for 3 layers"):
        ModelConfig.from_metadata({**meta, key: [True, False]})
    with pytest.raises(ModelFormatError, match="expected an integer .* or an array"):
        ModelConfig.from_metadata({**meta, key: [1, 0, 1]})


@pytest.mark.parametrize("rope", [
    {"factor": 4.0, "original_max_position_embeddings": 1024},
    {"factor": 8.0, "original_max_position_embeddings": 4096, "beta_fast": 16.0, "beta_slow": 2.0, "rope_theta": 5e5},
    {"factor": 2.0, "original_max_position_embeddings": 256, "attention_factor": 0.8},
    {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.707},
    {"factor": 3.0, "original_max_position_embeddings": 2048, "rope_theta": 1e6},
])
def test_yarn_metadata_gives_transformers_frequencies(rope):
    """The converter's YaRN keys, read back by ModelConfig, give transformers' scaled frequencies and cos/sin
    multiplier (through the float64 rope reference, which the rope op is tested against)."""
    import transformers as T
    from reference_ops import rope_freqs
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pyinfer.formats.model_config import ModelConfig

    params = {"rope_type": "yarn", "rope_theta": 10000.0, **rope}
    config = {"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 256,
              "num_hidden_layers": 1, "vocab_size": 300, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
              "rope_parameters": params}
    hp = conv._hparams(config, "llama")
    meta = {"general.architecture": "llama", **{k: v for k, v, *_ in conv._arch_kv("llama", hp, "t", Q.F32)}}
    cfg = ModelConfig.from_metadata(meta)
    args = cfg.rope_args(0)
    got, mscale = rope_freqs(cfg.n_rot, args.pop("freq_base"), args.pop("freq_scale"), None, **args)
    hf_config = T.LlamaConfig(**{k: v for k, v in config.items() if k != "rope_parameters"}, rope_parameters=params)
    want, want_mscale = ROPE_INIT_FUNCTIONS["yarn"](hf_config, "cpu")
    np.testing.assert_allclose(got, want.double().numpy(), rtol=2e-7)  # transformers': float32
    assert mscale == pytest.approx(want_mscale, rel=1e-6)
    if set(rope) <= {"factor", "original_max_position_embeddings", "rope_theta"}:
        # llama.cpp's converter writes the yarn_* keys only when config.json has them: the defaults are the same
        plain = ModelConfig.from_metadata({k: v for k, v in meta.items() if ".yarn_" not in k})
        assert plain.rope_args(0) == pytest.approx(cfg.rope_args(0), rel=1e-6)


def test_gpt_oss_yarn_without_truncation_converts_with_a_note(models, tmp_path, capsys):
    """gpt-oss' config says truncate false; llama.cpp runs its YaRN ramp truncated, and so does pyinfer: the
    conversion says so (other models with it are refused), and the file keeps the YaRN keys."""
    folder = tmp_path / "hf"
    shutil.copytree(models("gpt_oss").folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"]["truncate"] = False
    (folder / "config.json").write_text(json.dumps(config))
    out = str(tmp_path / "m.gguf")
    assert convert(str(folder), out, "--outtype", "f32") == 0
    assert "truncate false" in capsys.readouterr().err
    meta = GGUFFile(out).metadata
    assert meta["gpt-oss.rope.scaling.type"] == "yarn" and meta["gpt-oss.rope.scaling.factor"] == 4.0
    assert meta["gpt-oss.attention.sliding_window"] == 8 and "gpt-oss.attention.sliding_window_pattern" not in meta
    config["model_type"], config["architectures"] = "llama", ["LlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    assert convert(str(folder), str(tmp_path / "l.gguf"), "--outtype", "f32") == 1
    assert "truncate false is not supported" in capsys.readouterr().err


def test_gpt_oss_mxfp4_blocks_are_refused_in_one_line(models, tmp_path, capsys):
    """OpenAI's published gpt-oss checkpoints keep the experts as MXFP4 blocks and scales: one line says what to do
    (the converter had failed on the missing gate_up_proj)."""
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "hf"
    shutil.copytree(models("gpt_oss").folder, folder)
    weights = load_file(str(folder / "model.safetensors"))
    for name in [n for n in weights if n.endswith("experts.gate_up_proj")]:
        del weights[name]
        weights[name + "_blocks"] = np.zeros((4, 96, 2, 16), np.uint8)
        weights[name + "_scales"] = np.zeros((4, 96, 2), np.uint8)
    save_file(weights, str(folder / "model.safetensors"))
    out = tmp_path / "m.gguf"
    capsys.readouterr()
    assert convert(str(folder), str(out), "--outtype", "f32") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "MXFP4 blocks" in err[0] and not out.exists()
