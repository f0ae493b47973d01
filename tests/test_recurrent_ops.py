"""Linear attention's recurrent ops (ssm_conv, delta_net) against reference_ops (float64), on the CPU and, where there
is one, the GPU: a sequence in one graph equals the same sequence cut into pieces (the state carries it), a first
position of 0 starts from zeros whatever the state holds, strided q and k views read right, bad shapes are refused."""

from __future__ import annotations

import numpy as np
import pytest
import reference_ops as ref
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from op_harness import pool

from pyinfer.errors import InvalidArgumentError
from pyinfer.native import ggml
from pyinfer.native.binding import lib

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(lib.ggml_cuda_device_count() == 0,
                                                                 reason="no CUDA device"))]


def pieces(draw, n: int) -> list[int]:
    """n tokens cut into consecutive runs: where each run starts."""
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []
    return [0, *cuts, n]


def run_pieces(backend: str, bounds: list[int], state: ggml.Tensor, build, first_pos: int) -> list[np.ndarray]:
    """Computes build(ctx, t0, t1, pos) for each run [t0, t1) of tokens in turn, a graph each, on `backend`; the
    state leaf (in its own context) carries the sequence from one to the next. -> the runs' outputs."""
    outs = []
    for t0, t1 in zip(bounds, bounds[1:], strict=False):
        ctx = ggml.Context(16 << 20)
        pos = ctx.tensor_from_numpy(np.arange(first_pos + t0, first_pos + t1, dtype=np.int32))
        y = build(ctx, t0, t1, pos)
        graph = ggml.Graph(ctx, [y], backend=backend).plan()
        graph.compute(pool(2))
        outs.append(y.numpy().copy())
    return outs


@SETTINGS
@given(data=st.data(), channels=st.integers(1, 70), taps=st.integers(2, 16), n=st.integers(1, 40),
       fresh=st.booleans(), seed=st.integers(0, 2**31))
@pytest.mark.parametrize("backend", BACKENDS)
def test_ssm_conv(backend, data, channels, taps, n, fresh, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, channels)).astype(np.float32)
    w = rng.standard_normal((channels, taps)).astype(np.float32)
    before = rng.standard_normal((taps - 1, channels)).astype(np.float32)  # ignored when the sequence starts
    state_ctx = ggml.Context(1 << 20)
    state = state_ctx.tensor_from_numpy(before)
    wt = state_ctx.tensor_from_numpy(w)

    def build(ctx, t0, t1, pos):
        return ctx.ssm_conv(state, ctx.tensor_from_numpy(x[t0:t1]), wt, pos)

    bounds = pieces(data.draw, n)
    outs = run_pieces(backend, bounds, state, build, 0 if fresh else 5)
    got = np.concatenate([o.reshape(-1, channels) for o in outs])
    want, want_state = ref.ssm_conv(before, x, w, fresh)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state.numpy().reshape(want_state.shape), want_state, rtol=1e-6, atol=1e-6)


@SETTINGS
@given(data=st.data(), dk=st.sampled_from([1, 8, 32, 128, 129]), dv=st.sampled_from([1, 16, 128]),
       hk=st.integers(1, 3), group=st.integers(1, 3), n=st.integers(1, 20), fresh=st.booleans(),
       strided=st.booleans(), normed=st.booleans(), seed=st.integers(0, 2**31))
@pytest.mark.parametrize("backend", BACKENDS)
def test_delta_net(backend, data, dk, dv, hk, group, n, fresh, strided, normed, seed):
    """q and k of unit length, or of any length and normed by the op (l2_eps > 0, as the model runs it)."""
    rng = np.random.default_rng(seed)
    h = hk * group
    unit = (lambda a: a) if normed else (lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True))  # noqa: E731
    l2_eps = 1e-6 if normed else 0.0
    q = unit(rng.standard_normal((n, hk, dk)) * 3).astype(np.float32)
    k = unit(rng.standard_normal((n, hk, dk)) * 3).astype(np.float32)
    v = rng.standard_normal((n, h, dv)).astype(np.float32)
    g = -rng.uniform(0.0, 2.0, (n, h)).astype(np.float32)  # log decays: -A softplus(a) <= 0
    beta = rng.uniform(0.0, 1.0, (n, h)).astype(np.float32)
    before = rng.standard_normal((h, dv, dk)).astype(np.float32)
    scale = float(dk) ** -0.5
    state_ctx = ggml.Context(8 << 20)
    state = state_ctx.tensor_from_numpy(before)

    def heads(ctx, a, t0, t1):
        """a[t0:t1] as a tensor, or as a view into a wider one (rows of a fused projection, strided)."""
        if not strided:
            return ctx.tensor_from_numpy(a[t0:t1])
        wide = ctx.tensor_from_numpy(np.concatenate([a[t0:t1], a[t0:t1]], axis=-1))  # (m, heads, 2 d)
        m, nh, d = a[t0:t1].shape
        return ctx.view(wide, (m, nh, d), (8 * nh * d, 8 * d, 4), offset=4 * d)

    def build(ctx, t0, t1, pos):
        return ctx.delta_net(state, heads(ctx, q, t0, t1), heads(ctx, k, t0, t1), ctx.tensor_from_numpy(v[t0:t1]),
                             ctx.tensor_from_numpy(g[t0:t1]), ctx.tensor_from_numpy(beta[t0:t1]), pos, scale, l2_eps)

    bounds = pieces(data.draw, n)
    got = np.concatenate([o.reshape(-1, h, dv) for o in run_pieces(backend, bounds, state, build, 0 if fresh else 3)])
    want, want_state = ref.delta_net(before, q, k, v, g, beta, scale, fresh, l2_eps)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(want).max()))
    np.testing.assert_allclose(state.numpy().reshape(want_state.shape), want_state, rtol=1e-4,
                               atol=1e-4 * max(1.0, np.abs(want_state).max()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["sigmoid", "softplus"])
def test_gates(backend, op):
    x = np.concatenate([np.linspace(-40, 40, 301), [-1e30, 1e30, 0.0, 19.99, 20.01]]).astype(np.float32)
    ctx = ggml.Context(1 << 20)
    y = getattr(ctx, op)(ctx.tensor_from_numpy(x))
    graph = ggml.Graph(ctx, [y], backend=backend).plan()
    graph.compute(pool(2))
    with np.errstate(over="ignore"):
        want = getattr(ref, op)(x)
    np.testing.assert_allclose(y.numpy(), want, rtol=2e-6, atol=1e-30)


def test_recurrent_ops_refuse_bad_shapes():
    ctx = ggml.Context(1 << 20)
    f = lambda *shape: ctx.new_tensor(ggml.F32, shape)  # noqa: E731
    pos = ctx.new_tensor(ggml.I32, (4,))
    with pytest.raises(InvalidArgumentError, match="state must be"):
        ctx.ssm_conv(f(2, 8), f(4, 8), f(8, 4), pos)  # K-1 = 3 rows, not 2
    with pytest.raises(InvalidArgumentError, match="taps"):
        ctx.ssm_conv(f(3, 8), f(4, 8), f(9, 4), pos)
    with pytest.raises(InvalidArgumentError, match="positions"):
        ctx.ssm_conv(f(3, 8), f(4, 8), f(8, 4), ctx.new_tensor(ggml.I32, (3,)))
    with pytest.raises(InvalidArgumentError, match="share"):
        ctx.delta_net(f(3, 8, 16), f(4, 2, 16), f(4, 2, 16), f(4, 3, 8), f(4, 3), f(4, 3), pos, 1.0)
    with pytest.raises(InvalidArgumentError, match="state must be"):  # D_k and D_v swapped
        ctx.delta_net(f(4, 16, 8), f(4, 2, 16), f(4, 2, 16), f(4, 4, 8), f(4, 4), f(4, 4), pos, 1.0)
    with pytest.raises(InvalidArgumentError, match="g and beta"):
        ctx.delta_net(f(4, 8, 16), f(4, 2, 16), f(4, 2, 16), f(4, 4, 8), f(4, 3), f(4, 4), pos, 1.0)
