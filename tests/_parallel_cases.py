"""Model-parallel checks shared by both tiers: each runs on every rank of a communicator and
asserts against an oracle it computes itself.

tests/test_mesh.py, test_tensor_parallel.py and test_pipeline.py run them on thread ranks;
tests/mpi_parallel.py runs a selection under `mpiexec -n 4`. Oracles: for a mesh, the grid
enumerated independently of ringcoll.Mesh (and the groups' members found by an all-gather);
for layers, the unsplit model (ringcoll.parallel.layers) run in NumPy on the whole batch, in
float64, on every rank.
"""

import itertools

import numpy as np

import ringcoll
from ringcoll.parallel import (Activation, ColumnParallelLinear, Linear, ParallelMLP, Pipeline,
                               RowParallelLinear, Sequential, micro_batches, mlp, partition)

RTOL = 1e-12  # float64: the parallel sums regroup the same products


def close(label, comm, got, want, rtol=RTOL):
    """got == want within rtol of want's largest entry (float64: regrouped sums only)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{label} rank {comm.rank}: shape {got.shape} != {want.shape}"
    scale = max(1.0, float(np.abs(want).max())) if want.size else 1.0
    err = float(np.abs(got - want).max()) if want.size else 0.0
    assert err <= rtol * scale, f"{label} rank {comm.rank}: max abs diff {err:.3e} (scale {scale})"


# -- meshes ---------------------------------------------------------------------------------
def grid(shape, order):
    """{global rank: coords}, enumerating the grid with the last axis of `order` fastest."""
    out = {}
    for rank, idx in enumerate(itertools.product(*(range(shape[a]) for a in order))):
        out[rank] = dict(zip(order, idx))
    return out


def check_mesh(comm, dp, tp, pp, order=("pp", "dp", "tp")):
    mesh = ringcoll.Mesh(comm, dp=dp, tp=tp, pp=pp, order=order)
    shape = {"pp": pp, "dp": dp if dp is not None else comm.size // (tp * pp), "tp": tp}
    coords = grid(shape, order)
    assert mesh.shape == shape and mesh.coords == coords[comm.rank], (mesh.shape, mesh.coords)
    for axis in ("pp", "dp", "tp"):
        sub = getattr(mesh, axis)
        assert (sub.rank, sub.size) == (coords[comm.rank][axis], shape[axis]), axis
        # the oracle group: every rank that differs from this one only along `axis`
        want = sorted((r for r, c in coords.items()
                       if all(c[a] == coords[comm.rank][a] for a in shape if a != axis)),
                      key=lambda r: coords[r][axis])
        members = [int(v) for v in sub.allgather(np.array([comm.rank]))]
        assert members == want, f"{axis} group of rank {comm.rank}: {members} != {want}"
        assert want in mesh.groups(axis)
        everyone = sorted(r for g in mesh.groups(axis) for r in g)
        assert everyone == list(range(comm.size)), (axis, mesh.groups(axis))
    for r, c in coords.items():
        assert mesh.rank_of(**c) == r and mesh.coords_of(r) == c
    text = mesh.describe()
    mine = comm.allgather(np.frombuffer(text.encode().ljust(4096), np.uint8).reshape(1, -1))
    assert all(np.array_equal(row, mine[0]) for row in mine), "describe() differs by rank"
    return text


# -- tensor parallel ------------------------------------------------------------------------
def data(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape)


def oracle(model, x, dy):
    y, cache = model.forward(x)
    dx, grads = model.backward(dy, cache)
    return y, dx, grads


def check_column(comm, n=6, d_in=5, d_out=7, gather_output=False, bias=True, dtype=np.float64,
                 rtol=RTOL):
    w, b = data(1, d_in, d_out).astype(dtype), data(2, d_out).astype(dtype) if bias else None
    x, dy = data(3, n, d_in).astype(dtype), data(4, n, d_out).astype(dtype)
    y_ref, dx_ref, g_ref = oracle(Linear(w, b), x, dy)
    layer = ColumnParallelLinear.from_full(comm, w, b, gather_output=gather_output)
    cols = layer.columns
    y, cache = layer.forward(x)
    close("column y", comm, y, y_ref if gather_output else y_ref[:, cols], rtol)
    dx, grads = layer.backward(dy if gather_output else dy[:, cols], cache)
    close("column dx", comm, dx, dx_ref, rtol)
    close("column dW", comm, grads["weight"], g_ref["weight"][:, cols], rtol)
    if bias:
        close("column db", comm, grads["bias"], g_ref["bias"][cols], rtol)
    full = layer.full_params()
    assert np.array_equal(full["weight"], w) and (not bias or np.array_equal(full["bias"], b))
    none, _ = layer.backward(dy if gather_output else dy[:, cols], cache, input_grad=False)
    assert none is None


def check_row(comm, n=6, d_in=7, d_out=5, input_is_parallel=True, bias=True, dtype=np.float64,
              rtol=RTOL):
    w, b = data(5, d_in, d_out).astype(dtype), data(6, d_out).astype(dtype) if bias else None
    x, dy = data(7, n, d_in).astype(dtype), data(8, n, d_out).astype(dtype)
    y_ref, dx_ref, g_ref = oracle(Linear(w, b), x, dy)
    layer = RowParallelLinear.from_full(comm, w, b, input_is_parallel=input_is_parallel)
    rows = layer.rows
    y, cache = layer.forward(x[:, rows] if input_is_parallel else x)
    close("row y", comm, y, y_ref, rtol)
    dx, grads = layer.backward(dy, cache)
    close("row dx", comm, dx, dx_ref[:, rows] if input_is_parallel else dx_ref, rtol)
    close("row dW", comm, grads["weight"], g_ref["weight"][rows], rtol)
    if bias:
        close("row db", comm, grads["bias"], g_ref["bias"], rtol)
    full = layer.full_params()
    assert np.array_equal(full["weight"], w) and (not bias or np.array_equal(full["bias"], b))


def check_mlp(comm, activation="gelu", sequence_parallel=False, n=9, d=6, h=10, d_out=4,
              dtype=np.float64, rtol=RTOL):
    w1, b1 = data(11, d, h).astype(dtype), data(12, h).astype(dtype)
    w2, b2 = data(13, h, d_out).astype(dtype), data(14, d_out).astype(dtype)
    x, dy = data(15, n, d).astype(dtype), data(16, n, d_out).astype(dtype)
    ref = Sequential([Linear(w1, b1, ("w1", "b1")), Activation(activation),
                      Linear(w2, b2, ("w2", "b2"))])
    y_ref, dx_ref, g_ref = oracle(ref, x, dy)
    block = ParallelMLP.from_full(comm, w1, b1, w2, b2, activation_name=activation,
                                  sequence_parallel=sequence_parallel)
    # sequence parallel: x, y, dy and dx are this rank's block of rows
    rows = (np.array_split(np.arange(n), comm.size)[comm.rank] if sequence_parallel
            else np.arange(n))
    y, cache = block.forward(x[rows])
    close("mlp y", comm, y, y_ref[rows], rtol)
    dx, grads = block.backward(dy[rows], cache)
    close("mlp dx", comm, dx, dx_ref[rows], rtol)
    cols = block.fc1.columns
    close("mlp dW1", comm, grads["w1"], g_ref["w1"][:, cols], rtol)
    close("mlp db1", comm, grads["b1"], g_ref["b1"][cols], rtol)
    close("mlp dW2", comm, grads["w2"], g_ref["w2"][cols], rtol)
    close("mlp db2", comm, grads["b2"], g_ref["b2"], rtol)
    full = block.full_params()
    for name, want in (("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2)):
        assert np.array_equal(full[name], want), name
    return sorted(grads)


# -- pipelines ------------------------------------------------------------------------------
SIZES = [6, 9, 8, 7, 9, 5, 8, 6, 3]  # 8 layers: 4, 2 or 1 (or 3, 3, 2) per stage


def model_params(sizes=SIZES, seed=21):
    rng = np.random.default_rng(seed)
    params = {}
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        params[f"W{i}"] = rng.standard_normal((a, b)) / np.sqrt(a)
        params[f"b{i}"] = rng.standard_normal(b) * 0.1
    return params


def mse(y, target):
    d = y - target
    return 0.5 * float((d * d).sum()), d


def check_pipeline(comm, schedule, m, n=16, sizes=SIZES, activation="gelu"):
    """The pipeline's gradients (summed over m micro-batches) equal the unsplit model's on
    the whole batch; its losses add up to the whole batch's loss; peak memory as promised."""
    params = model_params(sizes)
    x = data(31, n, sizes[0])
    target = data(32, n, sizes[-1])
    ref = mlp(params, activation)
    y_ref, cache = ref.forward(x)
    loss_ref, dy = mse(y_ref, target)
    _, g_ref = ref.backward(dy, cache)

    p, s = comm.size, comm.rank
    layers = partition(len(sizes) - 1, p)[s]
    mine = {k: v.copy() for k, v in params.items()}
    stage = mlp(mine, activation, layers.start, layers.stop)
    slices = micro_batches(n, m)
    rows = [sl.stop - sl.start for sl in slices]
    pipe = Pipeline(comm, stage, schedule)
    res = pipe.run(rows, inputs=[x[sl] for sl in slices] if s == 0 else None,
                   loss=(lambda j, y: mse(y, target[slices[j]])) if s == p - 1 else None)
    assert sorted(res.grads) == sorted(stage.params), (sorted(res.grads), sorted(stage.params))
    for name, g in res.grads.items():
        close(f"{schedule} p={p} m={m} d{name}", comm, g, g_ref[name], rtol=1e-11)
    if s == p - 1:
        close("loss", comm, sum(res.losses), loss_ref, rtol=1e-12)
    assert [a[0] for a in res.timeline].count("F") == m and len(res.timeline) == 2 * m
    expect = m if schedule == "gpipe" else min(p - s, m)
    assert res.peak_in_flight == expect, (schedule, p, s, m, res.peak_in_flight)
    out = pipe.forward_only(rows, inputs=[x[sl] for sl in slices] if s == 0 else None)
    if s == p - 1:
        close("forward_only", comm, np.concatenate(out.outputs), y_ref, rtol=1e-12)
    return True
