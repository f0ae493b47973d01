"""Graph planning: intermediates share one buffer; no two tensors alive at once overlap, every tensor lies
inside the buffer, and results equal numpy's. Random graphs mix sizes so freed space gets reused."""
from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from pyinfer.native import ggml
from pyinfer.native.binding import ffi, lib


def _spans(graph: ggml.Graph) -> list[tuple[int, int, object]]:
    """(start, end, tensor ptr) of every node that owns planned memory, in execution order."""
    out = []
    for i in range(graph.n_nodes):
        t = lib.ggml_graph_node(graph.ptr, i)
        if lib.ggml_get_op(t) in (lib.GGML_OP_VIEW, lib.GGML_OP_KV_STORE):
            continue
        start = int(ffi.cast("uintptr_t", lib.ggml_get_data(t)))
        out.append((start, start + lib.ggml_nbytes(t), t))
    return out


@given(st.data())
def test_random_graphs_plan_without_overlap(data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    ctx = ggml.Context(8 << 20)
    width = data.draw(st.integers(1, 40))
    x = rng.standard_normal((3, width)).astype(np.float32)
    values = [x]  # numpy value of each op output
    nodes = [ctx.tensor_from_numpy(x)]
    consumers: dict[int, int] = {}  # node index -> last op index that reads it
    for _ in range(data.draw(st.integers(1, 12))):
        kind = data.draw(st.sampled_from(["matmul", "silu", "add", "scale"]))
        a = data.draw(st.integers(0, len(nodes) - 1)) if kind == "add" else len(nodes) - 1
        prev = values[-1]
        if kind == "matmul":
            w = rng.standard_normal((data.draw(st.integers(1, 64)), prev.shape[1])).astype(np.float32)
            node, val = ctx.mul_mat(ctx.tensor_from_numpy(w), nodes[-1]), prev @ w.T
        elif kind == "silu":
            node, val = ctx.silu(nodes[-1]), prev / (1 + np.exp(-prev.astype(np.float64)))
        elif kind == "scale":
            node, val = ctx.scale(nodes[-1], 0.5), prev * 0.5
        else:
            if values[a].shape != prev.shape:
                continue
            node, val = ctx.add(nodes[-1], nodes[a]), prev + values[a]
            consumers[a] = len(nodes)
        consumers[len(nodes) - 1] = len(nodes)
        nodes.append(node)
        values.append(val)
    graph = ggml.Graph(ctx, [nodes[-1]]).plan()
    graph.compute(ggml.ThreadPool(2))
    np.testing.assert_allclose(nodes[-1].numpy().reshape(values[-1].shape), values[-1], rtol=1e-4, atol=1e-4)

    spans = _spans(graph)
    base = min(start for start, _, _ in spans)
    assert all(end - base <= graph.mem_bytes for _, end, _ in spans), "a tensor reaches past the graph buffer"
    addr = [int(ffi.cast("uintptr_t", p)) for _, _, p in spans]
    # span k is alive from its own step to the last step that reads it; the output to the end
    last_read = list(range(len(spans)))
    last_read[-1] = len(spans)
    for k, (_, _, p) in enumerate(spans):
        for i in range(lib.GGML_MAX_SRC):
            src = lib.ggml_get_src(p, i)
            if src != ffi.NULL and int(ffi.cast("uintptr_t", src)) in addr:
                j = addr.index(int(ffi.cast("uintptr_t", src)))
                last_read[j] = max(last_read[j], k)
    for k, (start_k, end_k, _) in enumerate(spans):
        for j in range(k):
            if last_read[j] >= k:  # j still alive when k is written
                start_j, end_j, _ = spans[j]
                assert end_k <= start_j or start_k >= end_j, "tensors alive at the same time share memory"


@given(pauses=st.lists(st.sampled_from([0.0, 0.0005, 0.003]), min_size=1, max_size=6), threads=st.integers(2, 4))
def test_pool_runs_while_its_workers_poll_and_after_they_sleep(pauses, threads):
    """Between runs the workers poll for the next one about a millisecond, then sleep: runs that follow at once,
    within the poll and after it all compute every thread's share (a worker that missed a run would leave its
    rows of the GEMV unwritten: poisoned), and the pool frees while its workers still poll."""
    import time

    rng = np.random.default_rng(len(pauses))
    ctx = ggml.Context(8 << 20)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    x = ctx.tensor_from_numpy(rng.standard_normal(32).astype(np.float32))
    y = ctx.mul_mat(ctx.tensor_from_numpy(w), x)
    graph = ggml.Graph(ctx, [y]).plan()
    pool = ggml.ThreadPool(threads)
    for pause in pauses:
        time.sleep(pause)
        y.numpy()[:] = np.nan
        values = rng.standard_normal(32).astype(np.float32)
        x.numpy()[:] = values
        graph.compute(pool)
        np.testing.assert_allclose(y.numpy(), w @ values, rtol=1e-5, atol=1e-5)
    del pool  # right after a run: its workers are polling
