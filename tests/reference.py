"""Whole-model forward pass in numpy float64: the oracle every engine path is tested against.

Reads weights straight from a GGUFFile (PowerGGUF `ffn_down_t` or plain `ffn_down`), dequantized
to float64, one layer at a time. Positions start at 0; there is no KV cache.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from reference_ops import rope_freqs
from scipy.special import erf

from pyinfer.formats.gguf_file import GGUFFile
from pyinfer.formats.model_config import ModelConfig

# ----------------------------------------------------------------------------
# building blocks


def _norm(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, cfg: ModelConfig) -> np.ndarray:
    """RMSNorm or LayerNorm over the last axis of x (n_tokens, n_embd)."""
    if cfg.norm_kind == "rms":
        y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg.norm_eps)
    else:
        xc = x - x.mean(axis=-1, keepdims=True)
        y = xc / np.sqrt(np.mean(xc * xc, axis=-1, keepdims=True) + cfg.norm_eps)
    y = y * w
    return y + b if b is not None else y


def _rope(x: np.ndarray, pos: np.ndarray, cfg: ModelConfig, il: int, factors: np.ndarray | None) -> np.ndarray:
    """Rotate the first n_rot dims of every head of x (n_tokens, n_heads, head_dim) as layer il does; factors:
    Llama 3's per-frequency divisors (rope_freqs), or None."""
    half = cfg.n_rot // 2
    args = cfg.rope_args(il)
    freq, mscale = rope_freqs(cfg.n_rot, args.pop("freq_base"), args.pop("freq_scale"), factors, **args)  # (half,)
    theta = pos[:, None] * freq[None, :]  # (n_tokens, half)
    cos, sin = mscale * np.cos(theta)[:, None, :], mscale * np.sin(theta)[:, None, :]  # (n_tokens, 1, half)
    out = x.copy()
    if cfg.rope_mode == "normal":
        # llama.cpp "normal": adjacent pairs (2j, 2j+1)
        a, b = x[..., 0:cfg.n_rot:2], x[..., 1:cfg.n_rot:2]
        out[..., 0:cfg.n_rot:2] = a * cos - b * sin
        out[..., 1:cfg.n_rot:2] = a * sin + b * cos
    else:
        # "neox": pairs (j, j + n_rot/2), HF's rotate_half
        a, b = x[..., :half], x[..., half:cfg.n_rot]
        out[..., :half] = a * cos - b * sin
        out[..., half:cfg.n_rot] = a * sin + b * cos
    return out


def _ffn_act(gate: np.ndarray | None, up: np.ndarray, kind: str) -> np.ndarray:
    """h = act(gate) * up (or act(up) alone for OPT); all (n_tokens, n_ff)."""
    relu = np.maximum
    if kind == "swiglu":
        return gate / (1.0 + np.exp(-gate)) * up
    if kind == "swiglu_oai":  # gpt-oss: clamped, sigmoid(1.702 g), up + 1
        gate, up = np.minimum(gate, 7.0), np.clip(up, -7.0, 7.0)
        return gate / (1.0 + np.exp(-1.702 * gate)) * (up + 1.0)
    if kind == "reglu":
        return relu(gate, 0.0) * up
    if kind == "drelu":
        return relu(gate, 0.0) * relu(up, 0.0)
    if kind == "geglu":
        return _gelu(gate) * up
    if kind == "gelu":
        return _gelu(up)
    if kind == "gelu_erf":
        return 0.5 * up * (1.0 + erf(up / np.sqrt(2.0)))  # x * Phi(x)
    return relu(up, 0.0)


def _experts(h: np.ndarray, blk: str, cfg: ModelConfig, w, opt_w) -> np.ndarray:
    """A mixture of experts' FFN (T, n_embd): each token's top n_expert_used experts by router logit (ties to the
    lower index), weighted by the router's softmax over all experts, renormalised over the chosen ones when
    the model says so; gpt-oss' router and experts add their biases."""
    logits = h @ w(blk + "ffn_gate_inp.weight").T  # (T, n_expert)
    if cfg.expert_bias:
        logits = logits + w(blk + "ffn_gate_inp.bias")
    bias = {m: opt_w(blk + f"ffn_{m}_exps.bias") for m in ("gate", "up", "down")}  # (E, n_ff) / (E, d) or None
    zero = {m: 0.0 if b is None else b for m, b in bias.items()}
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    gate, up, down = (w(blk + f"ffn_{m}_exps.weight") for m in ("gate", "up", "down"))  # (E, n_ff, d), (E, d, n_ff)
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        chosen = np.argsort(-logits[t], kind="stable")[:cfg.n_expert_used]
        weights = probs[t, chosen] / (probs[t, chosen].sum() if cfg.expert_norm else 1.0)
        for e, wt in zip(chosen, weights, strict=True):
            act = _ffn_act(gate[e] @ h[t] + _row(zero["gate"], e), up[e] @ h[t] + _row(zero["up"], e), cfg.ffn_kind)
            out[t] += wt * (down[e] @ act + _row(zero["down"], e))
    return out


def _row(b, e: int):
    """Expert e's bias row, or 0.0 where there is none."""
    return b if np.isscalar(b) else b[e]


def _gelu(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (as ggml and llama.cpp compute it)."""
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, cfg: ModelConfig, window: int,
               sinks: np.ndarray | None = None) -> np.ndarray:
    """Causal softmax attention with grouped KV heads; q (T, n_head, hd), k/v (T, n_head_kv, hd); window > 0:
    a query sees the last `window` positions only; sinks (n_head,): a logit per head in the softmax's sum, with
    no value (gpt-oss)."""
    n_tok = q.shape[0]
    group = cfg.n_head // cfg.n_head_kv
    k = np.repeat(k, group, axis=1)  # (T, n_head, hd)
    v = np.repeat(v, group, axis=1)  # (T, n_head, hd)
    scores = np.einsum("qhd,khd->hqk", q, k) * cfg.softmax_scale  # (n_head, T, T)
    future = np.triu(np.ones((n_tok, n_tok), dtype=bool), k=1)  # (T, T)
    if window:
        future |= np.tril(np.ones((n_tok, n_tok), dtype=bool), k=-window)  # (T, T) keys too far back
    scores[:, future] = -np.inf
    top = scores.max(axis=-1, keepdims=True)  # (n_head, T, 1)
    if sinks is not None:
        top = np.maximum(top, sinks[:, None, None])
    p = np.exp(scores - top)
    z = p.sum(axis=-1, keepdims=True) + (np.exp(sinks[:, None, None] - top) if sinks is not None else 0.0)
    p /= z  # (n_head, T, T)
    out = np.einsum("hqk,khd->qhd", p, v)  # (T, n_head, hd)
    return out.reshape(n_tok, cfg.n_head * cfg.head_dim)


# ----------------------------------------------------------------------------
# forward pass


def reference_logits(gguf_file: GGUFFile, tokens: list[int],
                     capture: dict[str, list[np.ndarray]] | None = None,
                     input_sparsity: tuple[list[float], list[float]] | None = None,
                     attn_sparsity: tuple[list[float], list[float]] | None = None) -> np.ndarray:
    """Logits (n_tokens, n_vocab) for `tokens` at positions 0..n-1.

    capture, when given, gets per-layer lists: capture["ffn_in"][il] (n_tokens, n_embd) is the
    normalized FFN input, capture["ffn_h"][il] (n_tokens, n_ff) the activation act(gate)*up.
    input_sparsity, when given, is per layer (t_x, t_h): the FFN input's entries with |x| <= t_x and the
    activations with |h| <= t_h are zeroed, and gate and up are read from the channel-major ffn_gate_t and
    ffn_up_t (what `sparsity kind "input"` runs); in a centred file, entries with |x - c_x| <= t_x and
    |h - c_h| <= t_h are set to their centres c (the file's shifts negated) instead, and its biases unread.
    attn_sparsity, when given, is per layer (t_in, t_out), -1 for none: the entries of q's, k's and v's input with
    |x| <= t_in and of the output projection's with |a| <= t_out are zeroed, and the projections are read from their
    channel-major copies (blk.N.attn_*_t, what models.sparse_attention decodes with).
    """
    cfg = gguf_file.config
    if cfg.arch == "gemma4":  # its layers differ from those below; tests/test_gemma4.py checks it against transformers
        raise ValueError("the numpy reference does not compute Gemma 4")
    tok = np.asarray(tokens, dtype=np.int64)  # (T,)
    if tok.ndim != 1 or tok.size == 0 or tok.min() < 0 or tok.max() >= cfg.n_vocab:
        raise ValueError(f"tokens must be a non-empty list of ids in [0, {cfg.n_vocab})")
    if tok.size > cfg.n_ctx_train and cfg.rope_mode is None:
        raise ValueError(f"{tok.size} tokens exceed the learned position table ({cfg.n_ctx_train})")
    n_tok = tok.size
    pos = np.arange(n_tok, dtype=np.float64)  # (T,)

    def w(name: str) -> np.ndarray:
        return gguf_file.dequantize(name)

    def opt_w(name: str) -> np.ndarray | None:
        return w(name) if name in gguf_file.tensors else None

    def linear(x: np.ndarray, name: str, t: float = -1.0) -> np.ndarray:
        """x @ W^T (+ b); W is (out, in) in numpy order; with t >= 0 over x's entries |x| > t only, W read from
        its channel-major copy (in, out)."""
        y = x @ w(f"{name}.weight").T if t < 0 else np.where(np.abs(x) > t, x, 0.0) @ w(f"{name}_t.weight")
        b = opt_w(f"{name}.bias")
        return y + b if b is not None else y

    factors = opt_w("rope_freqs.weight")  # (n_rot/2,) Llama 3's RoPE scaling, or None
    # token embedding (+ learned positions for OPT; Gemma scales it)
    x = w("token_embd.weight")[tok] * cfg.embed_scale  # (T, n_embd)
    if cfg.rope_mode is None:
        x = x + w("position_embd.weight")[np.arange(n_tok) + cfg.pos_offset]

    for il in range(cfg.n_layer):
        blk = f"blk.{il}."
        # attention: norm, projections, rope, causal attention, output projection, residual
        h = _norm(x, w(blk + "attn_norm.weight"), opt_w(blk + "attn_norm.bias"), cfg)  # (T, n_embd)
        t_in, t_out = (attn_sparsity[0][il], attn_sparsity[1][il]) if attn_sparsity else (-1.0, -1.0)
        if cfg.arch == "falcon":  # fused q, k, v; the FFN reads the same residual, through attn_norm_2 if any
            q_dim, kv_dim = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
            qkv = linear(h, blk + "attn_qkv")  # (T, q_dim + 2 kv_dim)
            q, k, v = qkv[:, :q_dim], qkv[:, q_dim:q_dim + kv_dim], qkv[:, q_dim + kv_dim:]
            ffn_in = (_norm(x, w(blk + "attn_norm_2.weight"), opt_w(blk + "attn_norm_2.bias"), cfg)
                      if blk + "attn_norm_2.weight" in gguf_file.tensors else h)
        else:
            q, k, v = (linear(h, blk + name, t_in) for name in ("attn_q", "attn_k", "attn_v"))
            if cfg.qk_norm_whole:  # OLMoE: over all of q and of k
                q = _norm(q, w(blk + "attn_q_norm.weight"), None, cfg)
                k = _norm(k, w(blk + "attn_k_norm.weight"), None, cfg)
        q = q.reshape(n_tok, cfg.n_head, cfg.head_dim)  # (T, n_head, hd)
        k = k.reshape(n_tok, cfg.n_head_kv, cfg.head_dim)  # (T, n_head_kv, hd)
        v = v.reshape(n_tok, cfg.n_head_kv, cfg.head_dim)  # (T, n_head_kv, hd)
        if cfg.qk_norm and not cfg.qk_norm_whole:  # per head
            q = _norm(q, w(blk + "attn_q_norm.weight"), None, cfg)
            k = _norm(k, w(blk + "attn_k_norm.weight"), None, cfg)
        if cfg.rope_mode:
            q, k = _rope(q, pos, cfg, il, factors), _rope(k, pos, cfg, il, factors)
        a = linear(_attention(q, k, v, cfg, cfg.layer_window(il), opt_w(blk + "attn_sinks.weight")),
                   blk + "attn_output", t_out)  # (T, n_embd)
        if cfg.post_norms:
            a = _norm(a, w(blk + "post_attention_norm.weight"), None, cfg)
        if cfg.arch == "falcon":  # parallel: the residual gets both at the end
            h = ffn_in
        else:
            x = x + a
            a = 0.0
            # FFN: norm, up (and gate), activation, down, residual
            norm = blk + cfg.ffn_norm_name
            h = _norm(x, w(norm + ".weight"), opt_w(norm + ".bias"), cfg)  # (T, n_embd)
        if cfg.is_moe:
            x = x + _experts(h, blk, cfg, w, opt_w)
            continue
        centred = input_sparsity is not None and opt_w(blk + "ffn_inp.shift") is not None
        if input_sparsity is not None:
            # a centred file's skipped entries sit at their centre (minus the file's shift), others' at zero
            c_x, c_h = (-w(blk + "ffn_inp.shift"), -w(blk + "ffn_down_t.shift")) if centred else (0.0, 0.0)
            t_x, t_h = input_sparsity[0][il], input_sparsity[1][il]
            h = np.where(np.abs(h - c_x) > t_x, h, c_x)
            up = h @ w(blk + "ffn_up_t.weight")  # (T, n_embd) @ (n_embd, n_ff)
            gate = h @ w(blk + "ffn_gate_t.weight")  # (T, n_ff)
            act = _ffn_act(gate, up, cfg.ffn_kind)
            act = np.where(np.abs(act - c_h) > t_h, act, c_h)  # (T, n_ff)
        else:
            up = linear(h, blk + "ffn_up")  # (T, n_ff)
            gate = linear(h, blk + "ffn_gate") if cfg.gated else None  # (T, n_ff)
            act = _ffn_act(gate, up, cfg.ffn_kind)  # (T, n_ff)
        if capture is not None:
            capture.setdefault("ffn_in", []).append(h)
            capture.setdefault("ffn_h", []).append(act)
        if gguf_file.ffn_layout == "down_t":
            down = act @ w(blk + "ffn_down_t.weight")  # (T, n_ff) @ (n_ff, n_embd)
            bias = None if centred else opt_w(blk + "ffn_down_t.bias")  # (a centred file's: act's centre's share)
        else:
            down = act @ w(blk + "ffn_down.weight").T  # (T, n_ff) @ (n_ff, n_embd)
            bias = opt_w(blk + "ffn_down.bias")
        down = down + bias if bias is not None else down  # (T, n_embd)
        if cfg.post_norms:
            down = _norm(down, w(blk + "post_ffw_norm.weight"), None, cfg)
        x = x + a + down

    # final norm and vocabulary projection (tied embeddings reuse token_embd)
    x = _norm(x, w("output_norm.weight"), opt_w("output_norm.bias"), cfg)  # (T, n_embd)
    out_name = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
    logits = x @ w(out_name).T  # (T, n_vocab)
    cap = cfg.final_logit_softcap  # Gemma's final softcap
    return cap * np.tanh(logits / cap) if cap else logits


def reference_ffn_activations(gguf_file: GGUFFile, tokens: list[int]) -> dict[str, list[Any]]:
    """Per-layer FFN inputs and activations for `tokens` (see reference_logits' capture)."""
    capture: dict[str, list[Any]] = {}
    reference_logits(gguf_file, tokens, capture)
    return capture
