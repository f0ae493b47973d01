"""The valid inputs the fuzzer mutates ("seeds"): tiny HF checkpoints (llama with a trained byte-level BPE,
qwen2 in BF16, OPT in F16, one of them sharded) written here without torch, the GGUFs our converter makes
of them, a GGUF with a sentencepiece-style vocabulary, a PowerGGUF with synthetic predictors, and the
default model when it has been pulled. Everything is derived from a seed, so a case can be replayed."""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from pyinfer.converters import synthetic
from pyinfer.converters.convert_hf_to_powergguf import convert
from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.formats.gguf_writer import OutFile, OutTensor, write_atomically


@dataclass(frozen=True)
class Dims:
    d: int = 64
    ff: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ctx: int = 64
    vocab: int = 300  # embedding rows; the trained vocabulary is smaller and padded by the converter


TINY = Dims()
LARGE = Dims(d=512, ff=1536, layers=4, heads=8, kv_heads=4, ctx=256, vocab=2048)  # converts in ~a second
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Sphinx of black quartz, judge my vow!",
          "A tiny model with a tiny vocabulary: 12345 67890.", "Hello world, this is a test of the fuzzer.",
          "Pack my box with five dozen liquor jugs; how vexingly quick daft zebras jump."] * 4
# HF architecture -> (config.json extras, safetensors dtype)
HF_ARCHS = {
    "llama": ({"architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "tie_word_embeddings": False}, "F32"),
    "qwen2": ({"architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "tie_word_embeddings": True}, "BF16"),
    "opt": ({"architectures": ["OPTForCausalLM"], "do_layer_norm_before": True, "activation_function": "relu"},
            "F16"),
}


# ---------------------------------------------------------------------------------------------------
# HF checkpoints


def hf_config(arch: str, dims: Dims) -> dict:
    extra, _ = HF_ARCHS[arch]
    config = {"hidden_size": dims.d, "num_hidden_layers": dims.layers, "num_attention_heads": dims.heads,
              "vocab_size": dims.vocab, "max_position_embeddings": dims.ctx, "bos_token_id": 1, "eos_token_id": 2}
    if arch == "opt":
        config |= {"ffn_dim": dims.ff, "word_embed_proj_dim": dims.d}
    else:
        config |= {"intermediate_size": dims.ff, "num_key_value_heads": dims.kv_heads, "rms_norm_eps": 1e-5,
                   "rope_theta": 10000.0}
    return config | extra


def hf_shapes(arch: str, dims: Dims) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> numpy shape of a checkpoint of these dimensions."""
    d, ff, v = dims.d, dims.ff, dims.vocab
    q, kv = dims.d, dims.d // dims.heads * dims.kv_heads
    if arch == "opt":
        p = "model.decoder."
        out = {p + "embed_tokens.weight": (v, d), p + "embed_positions.weight": (dims.ctx + 2, d)}
        for il in range(dims.layers):
            b = f"{p}layers.{il}."
            for name, rows, cols in (("self_attn.q_proj", d, d), ("self_attn.k_proj", d, d),
                                     ("self_attn.v_proj", d, d), ("self_attn.out_proj", d, d), ("fc1", ff, d),
                                     ("fc2", d, ff)):
                out |= {b + name + ".weight": (rows, cols), b + name + ".bias": (rows,)}
            for norm in ("self_attn_layer_norm", "final_layer_norm"):
                out |= {b + norm + ".weight": (d,), b + norm + ".bias": (d,)}
        return out | {p + "final_layer_norm.weight": (d,), p + "final_layer_norm.bias": (d,)}
    out = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for il in range(dims.layers):
        b = f"model.layers.{il}."
        out |= {b + "input_layernorm.weight": (d,), b + "post_attention_layernorm.weight": (d,),
                b + "self_attn.q_proj.weight": (q, d), b + "self_attn.k_proj.weight": (kv, d),
                b + "self_attn.v_proj.weight": (kv, d), b + "self_attn.o_proj.weight": (d, q),
                b + "mlp.gate_proj.weight": (ff, d), b + "mlp.up_proj.weight": (ff, d),
                b + "mlp.down_proj.weight": (d, ff)}
        if arch == "qwen2":
            out |= {b + "self_attn.q_proj.bias": (q,), b + "self_attn.k_proj.bias": (kv,),
                    b + "self_attn.v_proj.bias": (kv,)}
    if not HF_ARCHS[arch][0].get("tie_word_embeddings", True):
        out["lm_head.weight"] = (v, d)
    return out


def safetensors_bytes(tensors: dict[str, np.ndarray], dtype: str) -> bytes:
    """A safetensors file of float tensors stored as dtype (F32, F16 or BF16)."""
    blobs, header, offset = [], {}, 0
    for name, values in tensors.items():
        x = values.astype(np.float32)
        raw = (x.astype(np.float16) if dtype == "F16" else (x.view(np.uint32) >> 16).astype(np.uint16)
               if dtype == "BF16" else x).tobytes()
        header[name] = {"dtype": dtype, "shape": list(values.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def train_bpe(texts: list[str], specials: list[str], vocab_size: int = 280):
    """A byte-level BPE (tokenizers.Tokenizer) trained on texts, GPT-2 style, specials first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def write_tokenizer(folder: str) -> None:
    """A trained ~280-token byte-level BPE (tokenizer.json) and its tokenizer_config.json."""
    train_bpe(CORPUS, SPECIALS).save(os.path.join(folder, "tokenizer.json"))
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "chat_template": CHAT_TEMPLATE, "add_bos_token": False}
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)


def write_checkpoint(folder: str, arch: str, dims: Dims = TINY, seed: int = 0, shards: int = 1) -> None:
    """A random HF checkpoint of arch; shards > 1 splits it with a model.safetensors.index.json."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {name: (np.ones(shape) if len(shape) == 1 and "norm" in name else
                      0.05 * rng.standard_normal(shape, dtype=np.float32))
               for name, shape in hf_shapes(arch, dims).items()}
    dtype = HF_ARCHS[arch][1]
    names = list(tensors)
    parts = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for i, part in enumerate(parts):
        file = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        with open(os.path.join(folder, file), "wb") as f:
            f.write(safetensors_bytes({n: tensors[n] for n in part}, dtype))
        weight_map |= dict.fromkeys(part, file)
    if shards > 1:
        with open(os.path.join(folder, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config(arch, dims), f)
    write_tokenizer(folder)


# ---------------------------------------------------------------------------------------------------
# GGUF seeds


def _spm_vocab(n_vocab: int) -> list:
    """A sentencepiece-style ("llama") vocabulary: unk, bos, eos, the 256 byte tokens, pieces with
    scores, then unused padding, as metadata entries."""
    words = sorted({w.strip(".,!?;:") for line in CORPUS for w in line.split()} - {""})
    pieces = ["\u2581", *"abcdefghijklmnopqrstuvwxyzTHSAP", *(f"\u2581{w}" for w in words)]
    pieces = list(dict.fromkeys(pieces))[:n_vocab - 259]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    for i in range(len(tokens), n_vocab):
        tokens.append(f"<pad{i}>")
        types.append(5)
        scores.append(-1e9)
    return [("tokenizer.ggml.model", "llama", V.STRING, None), ("tokenizer.ggml.tokens", tokens, V.ARRAY, V.STRING),
            ("tokenizer.ggml.scores", scores, V.ARRAY, V.FLOAT32),
            ("tokenizer.ggml.token_type", types, V.ARRAY, V.INT32),
            ("tokenizer.ggml.bos_token_id", 1, V.UINT32, None), ("tokenizer.ggml.eos_token_id", 2, V.UINT32, None),
            ("tokenizer.ggml.unknown_token_id", 0, V.UINT32, None),
            ("tokenizer.ggml.add_bos_token", True, V.BOOL, None)]


def with_spm_vocab(src: str, out: str) -> None:
    """src's tensors and non-tokenizer metadata with a sentencepiece-style vocabulary instead."""
    g = GGUFFile(src)
    kv = [t for t in g.typed_metadata() if not t[0].startswith("tokenizer.") and t[0] != "general.architecture"]
    kv += _spm_vocab(g.config.n_vocab)
    tensors = [OutTensor.as_stored(info) for info in g.tensors.values()]
    write_atomically([OutFile(out, g.config.arch, kv, tensors)])


def make_seeds(folder: str, default_model: str | None) -> dict[str, str]:
    """Writes every seed into folder; returns name -> path (HF seeds are folders, named hf-*)."""
    os.makedirs(folder, exist_ok=True)
    seeds: dict[str, str] = {}
    for arch, shards in (("llama", 1), ("qwen2", 2), ("opt", 1)):
        seeds[f"hf-{arch}"] = path = os.path.join(folder, f"hf-{arch}")
        write_checkpoint(path, arch, shards=shards)
    seeds["hf-llama-large"] = os.path.join(folder, "hf-llama-large")
    write_checkpoint(seeds["hf-llama-large"], "llama", LARGE)
    seeds["llama-bpe"] = os.path.join(folder, "llama-bpe.gguf")
    convert(seeds["hf-llama"], os.path.join(folder, "llama-power.gguf"), "q8_0", dense_gguf=seeds["llama-bpe"])
    seeds["qwen2-power"] = convert(seeds["hf-qwen2"], os.path.join(folder, "qwen2-power.gguf"), "f16")[0]
    seeds["opt-power"] = convert(seeds["hf-opt"], os.path.join(folder, "opt-power.gguf"), "f32")[0]
    seeds["llama-spm"] = os.path.join(folder, "llama-spm.gguf")
    with_spm_vocab(seeds["llama-bpe"], seeds["llama-spm"])
    seeds["sparse"] = os.path.join(folder, "sparse.gguf")
    synthetic.make_llama(seeds["sparse"], "tiny", Q.Q4_0, rank=32)
    if default_model and os.path.isfile(default_model):
        seeds["default"] = default_model
    return seeds


def copy_seed(src: str, dst: str) -> str:
    """A private copy of a seed (a file or a checkpoint folder) that a mutation may change."""
    if os.path.isdir(src):
        shutil.copytree(src, dst)
    else:
        shutil.copyfile(src, dst)
    return dst
