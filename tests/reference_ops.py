"""One numpy float64 function per ggml op: the oracles the kernels are tested against.

Shapes are numpy order (outermost first), the reverse of ggml's `ne`: a ggml weight `[k, n]` is an
array `(n, k)`, activations `[k, m]` are `(m, k)`. Quantized weights are passed dequantized.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import erf

ROPE_NORMAL, ROPE_NEOX = 0, 2


def _f64(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


# --- elementwise ---

def cpy(a) -> np.ndarray:
    return _f64(a).copy()


def get_rows(w, ids) -> np.ndarray:
    """w (n, k), ids (m,) -> (m, k); an id outside [0, n) is an error."""
    w, ids = _f64(w), np.asarray(ids, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= w.shape[0]):
        raise ValueError("get_rows: id out of range")
    return w[ids]


def add(a, b) -> np.ndarray:
    return _f64(a) + _f64(b)


def mul(a, b) -> np.ndarray:
    return _f64(a) * _f64(b)


def scale(a, s: float) -> np.ndarray:
    return _f64(a) * np.float64(np.float32(s))


def silu(a) -> np.ndarray:
    a = _f64(a)
    with np.errstate(over="ignore"):
        return a / (1.0 + np.exp(-a))


def gelu_erf(a) -> np.ndarray:
    """Exact GELU, x * Phi(x)."""
    a = _f64(a)
    return 0.5 * a * (1.0 + erf(a / np.sqrt(2.0)))


def gelu(a) -> np.ndarray:
    """The tanh approximation."""
    a = _f64(a)
    with np.errstate(over="ignore", invalid="ignore"):
        return 0.5 * a * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (a + 0.044715 * a**3)))


def relu(a) -> np.ndarray:
    return np.maximum(_f64(a), 0.0)


def tanh(a) -> np.ndarray:
    return np.tanh(_f64(a))


def abs(a) -> np.ndarray:  # noqa: A001 (the op's name)
    return np.abs(_f64(a))


def sigmoid(a) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-_f64(a)))


def softplus(a) -> np.ndarray:
    """torch's: log(1 + exp(x)), x itself above 20."""
    a = _f64(a)
    return np.where(a > 20.0, a, np.log1p(np.exp(np.minimum(a, 20.0))))


def step(a) -> np.ndarray:
    """1 where a > 0, else 0 (NaN included)."""
    return (_f64(a) > 0.0).astype(np.float64)


# --- norms (over the last axis, no weight) ---

def rms_norm(a, eps: float) -> np.ndarray:
    a = _f64(a)
    return a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + np.float32(eps))


def layer_norm(a, eps: float) -> np.ndarray:
    a = _f64(a)
    d = a - a.mean(axis=-1, keepdims=True)
    return d / np.sqrt(np.mean(d * d, axis=-1, keepdims=True) + np.float32(eps))


# --- matmul ---

def mul_mat(w, x) -> np.ndarray:
    """w (n, k), x (m, k) -> (m, n)."""
    return _f64(x) @ _f64(w).T


# --- attention family ---

def rope_freqs(n_dims: int, freq_base: float, freq_scale: float = 1.0, factors=None, n_ctx_orig: int = 0,
               ext_factor: float = 0.0, attn_factor: float = 1.0, beta_fast: float = 32.0,
               beta_slow: float = 1.0) -> tuple[np.ndarray, float]:
    """(each pair's angle per position (n_dims/2,), what cos and sin are multiplied by).

    The trained angle is base^(-2i / n_dims) / factors[i]; it is interpolated (times freq_scale), except with
    YaRN (ext_factor > 0, the paper's "NTK-by-parts"): pairs that turn more than beta_fast times in n_ctx_orig
    positions keep the trained angle, pairs turning less than beta_slow times are interpolated, and a linear
    ramp over the pair index blends between; cos and sin then grow by 1 + 0.1 ln(1 / freq_scale).
    """
    half = n_dims // 2
    trained = float(freq_base) ** (-2.0 * np.arange(half) / n_dims)  # (half,)
    if factors is not None:
        trained = trained / _f64(factors)[:half]
    if not ext_factor:
        return trained * freq_scale, attn_factor

    def pair_turning(turns: float) -> float:  # the (fractional) pair whose trained angle turns `turns` times
        return n_dims * math.log(n_ctx_orig / (turns * 2 * math.pi)) / (2 * math.log(freq_base))

    lo, hi = max(math.floor(pair_turning(beta_fast)), 0), min(math.ceil(pair_turning(beta_slow)), n_dims - 1)
    ramp = np.clip((np.arange(half) - lo) / max(hi - lo, 0.001), 0.0, 1.0)  # (half,) 0: trained, 1: interpolated
    keep = (1.0 - ramp) * ext_factor
    return trained * (freq_scale * (1.0 - keep) + keep), attn_factor * (1.0 + 0.1 * math.log(1.0 / freq_scale))


def rope(x, pos, n_dims: int, mode: int, freq_base: float, freq_scale: float = 1.0, factors=None,
         **yarn: float) -> np.ndarray:
    """x (n_tokens, n_head, head_dim), pos (n_tokens,); pair i turns by pos * rope_freqs(...)[i]; yarn: the
    keywords of rope_freqs (YaRN)."""
    x = _f64(x)
    out = x.copy()
    half = n_dims // 2
    freqs, mscale = rope_freqs(n_dims, float(np.float32(freq_base)), float(np.float32(freq_scale)), factors, **yarn)
    theta = np.asarray(pos, np.float64)[:, None] * freqs  # (n_tokens, half)
    c, s = mscale * np.cos(theta)[:, None, :], mscale * np.sin(theta)[:, None, :]  # (n_tokens, 1, half)
    if mode == ROPE_NEOX:
        i0, i1 = np.arange(half), np.arange(half) + half
    else:
        i0, i1 = 2 * np.arange(half), 2 * np.arange(half) + 1
    a, b = x[..., i0], x[..., i1]
    out[..., i0] = a * c - b * s
    out[..., i1] = a * s + b * c
    return out


def soft_max(a, pos=None, scale: float = 1.0) -> np.ndarray:
    """a (n_rows, n_cols); with pos (n_rows,), columns j > pos[r] are masked (probability 0)."""
    y = _f64(a) * np.float64(np.float32(scale))
    if pos is not None:
        pos = np.asarray(pos, np.int64)
        if pos.size and pos.min() < 0:
            raise ValueError("soft_max: negative position")
        y = np.where(np.arange(y.shape[-1])[None, :] > pos[:, None], -np.inf, y)
    y = np.exp(y - y.max(axis=-1, keepdims=True))
    return y / y.sum(axis=-1, keepdims=True)


def kv_store(cache, src, pos) -> np.ndarray:
    """cache (n_ctx, n_kv_head, head_dim), src (n_tokens, n_kv_head, head_dim) -> the updated cache."""
    out = _f64(cache).copy()
    pos = np.asarray(pos, np.int64)
    if pos.size and (pos.min() < 0 or pos.max() >= out.shape[0]):
        raise ValueError("kv_store: position outside the cache")
    out[pos] = _f64(src)
    return out


def attention(q, k, v, pos, scale: float, window: int = 0, sinks=None) -> np.ndarray:
    """q (n_tokens, n_head, hd), k/v caches (n_ctx, n_kv_head, hd) -> (n_tokens, n_head * hd).

    Token t attends cache slots [0, pos[t]] (window > 0: (pos[t] - window, pos[t]]); head h reads kv head
    h // (n_head // n_kv_head); sinks (n_head,): a logit each head's softmax counts with no value (transformers'
    gpt-oss eager attention).
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    pos = np.asarray(pos, np.int64)
    n_tokens, n_head, hd = q.shape
    if pos.size and (pos.min() < 0 or pos.max() >= k.shape[0]):
        raise ValueError("attention: position outside the cache")
    group = n_head // k.shape[1]
    out = np.empty((n_tokens, n_head, hd))
    for t in range(n_tokens):
        for h in range(n_head):
            lo = max(0, pos[t] + 1 - window) if window else 0
            kk, vv = k[lo: pos[t] + 1, h // group], v[lo: pos[t] + 1, h // group]  # (pos + 1 - lo, hd)
            s = np.float64(np.float32(scale)) * (kk @ q[t, h])  # (pos + 1,)
            top = s.max() if sinks is None else max(s.max(), float(sinks[h]))
            p = np.exp(s - top)
            z = p.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - top))
            out[t, h] = (p / z) @ vv
    return out.reshape(n_tokens, n_head * hd)


# --- neuron-aware sparse ops ---

def selection(sel, n_rows: int, m: int, begin: int = 0, end: int = -1) -> np.ndarray:
    """How often each row counts for each column: (m, n_rows) integers.

    sel: None (every row), a float mask (m, n_rows) (selected where > 0), or an int index list (m, n_sel)
    whose entries < 0 end a column's list (an entry >= n_rows is an error; a repeated entry counts again).
    Only rows in [begin, end) count (end < 0: n_rows).
    """
    end = n_rows if end < 0 else end
    counts = np.zeros((m, n_rows), dtype=np.int64)
    if sel is None:
        counts[:] = 1
    elif np.issubdtype(np.asarray(sel).dtype, np.floating):
        counts[:] = np.asarray(sel, np.float64).reshape(m, n_rows) > 0
    else:
        sel = np.asarray(sel, np.int64).reshape(m, -1)
        for j in range(m):
            neg = np.flatnonzero(sel[j] < 0)
            ids = sel[j, : neg[0] if neg.size else sel.shape[1]]
            if ids.size and ids.max() >= n_rows:
                raise ValueError("index list entry >= n_rows")
            np.add.at(counts[j], ids, 1)
    counts[:, :begin] = 0
    counts[:, end:] = 0
    return counts


def mul_mat_rows(w, x, sel=None, begin: int = 0, end: int = -1) -> np.ndarray:
    """w (n_rows, k), x (m, k) -> (m, n_rows): x @ w.T where selected, 0 elsewhere."""
    x = _f64(x)
    counts = selection(sel, np.shape(w)[0], x.shape[0], begin, end)
    return np.where(counts > 0, mul_mat(w, x), 0.0)


def axpy_rows(wt, h, sel=None, begin: int = 0, end: int = -1) -> np.ndarray:
    """wt (n_rows, d), h (m, n_rows) -> (m, d) = sum over selected rows i of h[:, i] * wt[i]."""
    h, wt = _f64(h), _f64(wt)
    counts = selection(sel, wt.shape[0], h.shape[0], begin, end)
    out = np.zeros((h.shape[0], wt.shape[1]))
    for j in range(h.shape[0]):
        rows = np.flatnonzero(counts[j])  # unselected rows never touch the sum (not even as 0 * inf)
        out[j] = (h[j, rows] * counts[j, rows]) @ wt[rows]
    return out


def ffn_act(kind: str, g, u):
    """The activation of one neuron from its gate and up values (gate unused for relu)."""
    g, u = _f64(g), _f64(u)
    if kind == "relu":
        return np.maximum(u, 0.0)
    if kind == "reglu":
        return np.maximum(g, 0.0) * u
    if kind == "drelu":
        return np.maximum(g, 0.0) * np.maximum(u, 0.0)
    if kind == "swiglu":
        return silu(g) * u
    return gelu(g) * u


def sparse_ffn(bundle, x, kind: str, sel=None, threshold: float = 0.0) -> np.ndarray:
    """bundle (r * n_ff, d), neuron i's rows r*i.. : gate (gated kinds), up, down_t; x (m, d) ->
    (m, d + n_ff): the sum over selected neurons with |act| > threshold of act * down_t, then 1 for
    those neurons (0 elsewhere)."""
    x, bundle = _f64(x), _f64(bundle)
    r = 2 if kind == "relu" else 3
    rows = bundle.reshape(-1, r, bundle.shape[1])  # (n_ff, r, d)
    up, down_t = rows[:, r - 2], rows[:, r - 1]
    g = x @ rows[:, 0].T if r == 3 else 0.0
    act = ffn_act(kind, g, x @ up.T)  # (m, n_ff)
    counts = selection(sel, rows.shape[0], x.shape[0]) * (np.abs(act) > threshold)
    taken = (counts > 0).astype(np.float64)
    return np.concatenate([axpy_rows(down_t, act * counts, taken), taken], axis=1)


# --- linear attention (Qwen3.5's gated delta net) ---

def ssm_conv(state, x, w, fresh: bool) -> tuple[np.ndarray, np.ndarray]:
    """state (K-1, C), x (n, C), w (C, K) -> (y (n, C), the new state (K-1, C)); fresh: the state taken as zeros."""
    state, x, w = _f64(state), _f64(x), _f64(w)
    k = w.shape[1]
    xx = np.concatenate([np.zeros_like(state) if fresh else state, x])  # (K-1 + n, C)
    y = np.stack([(xx[t:t + k] * w.T).sum(axis=0) for t in range(x.shape[0])])
    return y, xx[-(k - 1):]


def delta_net(state, q, k, v, g, beta, scale: float, fresh: bool, l2_eps: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """state (H, D_v, D_k) (each head's S transposed), q and k (n, H_k, D_k), v (n, H, D_v), g and beta (n, H);
    value head h reads key head h % H_k; l2_eps > 0: q and k L2-normed per head first -> (out (n, H, D_v), the new
    state)."""
    s = np.zeros_like(_f64(state)) if fresh else _f64(state).copy()
    q, k, v, g, beta = (_f64(a) for a in (q, k, v, g, beta))
    if l2_eps > 0:
        q, k = (a / np.sqrt((a * a).sum(axis=-1, keepdims=True) + l2_eps) for a in (q, k))
    n, h = v.shape[:2]
    hk = k.shape[1]
    out = np.empty_like(v)
    for t in range(n):
        for head in range(h):
            st = s[head]  # (D_v, D_k): row j is S's column j
            st *= np.exp(g[t, head])
            kt, qt = k[t, head % hk], q[t, head % hk]
            delta = beta[t, head] * (v[t, head] - st @ kt)  # (D_v,)
            st += np.outer(delta, kt)
            out[t, head] = scale * (st @ qt)
    return out, s
