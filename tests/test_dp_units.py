"""Unit tests of data-parallel training (ringcoll.distributed, .compression) on the thread
transport: buckets, start order, averaged results, accumulation, compression and broadcasts,
asserted on every rank (checkpoints: tests/test_checkpoint.py).

tests/mpi_dp.py checks end-to-end training equivalence under mpiexec; these check the pieces,
fast, in one process. Gradients are small integers, so sums over ranks and steps are exact in
float32 and float64 and most results can be compared bitwise.
"""

import importlib.util
import time

import numpy as np
import pytest

import ringcoll
from ringcoll import (CollectiveMismatchError, InvalidArgumentError, RingcollError)
from ringcoll.compression import Cast, Compression, TopK
from ringcoll.optim import SGD, Adam

TIMEOUT = 10  # seconds a thread rank may wait: a deadlock fails fast

#: name, shape, dtype, in registration order (forward order: first layer first)
MODEL = [("w1", (4, 3), np.float32), ("b1", (3,), np.float32), ("w2", (3, 5), np.float64),
         ("b2", (5,), np.float64), ("w3", (5, 2), np.float32), ("b3", (2,), np.float32)]
#: the same model, every parameter float32
FLOAT32_MODEL = [(n, s, np.float32) for n, s, _ in MODEL]


def run(p, fn, timeout=TIMEOUT, **options):
    """fn(comm) on p thread ranks; an exception on any rank fails the test."""
    return ringcoll.run_threads(p, fn, timeout=timeout, **options)


def outcomes(p, fn, timeout=TIMEOUT, **options):
    """fn(comm) on p thread ranks: [each rank's result, or the exception it raised].

    The exception is returned, not raised, so one rank's error does not fail the world: a
    rank's own error and the errors its peers report are all seen as raised."""

    def body(comm):
        try:
            return fn(comm)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return exc

    return ringcoll.run_threads(p, body, timeout=timeout, **options)


def make_params(seed=0, model=MODEL):
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(dtype) for name, shape, dtype in model}


def grads_for(params, rank, step=0, seed=0, scale=8):
    """Integer-valued gradients, different per rank and step (exact sums)."""
    rng = np.random.default_rng([seed, rank, step])
    return {n: rng.integers(-scale, scale + 1, p.shape).astype(p.dtype)
            for n, p in params.items()}


def snapshot(params):
    return {n: p.copy() for n, p in params.items()}


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_same_params(a, b):
    assert list(a) == list(b)
    for n in a:
        assert same_bits(a[n], b[n]), n


def assert_same_state(a, b):
    """Two state_dicts bitwise equal (arrays by bytes, everything else by ==)."""
    assert a["type"] == b["type"] and a["hyper"] == b["hyper"]
    assert list(a["state"]) == list(b["state"])
    for name in a["state"]:
        sa, sb = a["state"][name], b["state"][name]
        assert set(sa) == set(sb), name
        for k in sa:
            if isinstance(sa[k], np.ndarray):
                assert same_bits(sa[k], sb[k]), (name, k)
            else:
                assert sa[k] == sb[k], (name, k)


def record_starts(opt, check_complete=True):
    """Wrap opt._start: returns the list of bucket indices in the order they start.

    check_complete: assert that every gradient of the bucket was handed over in this pass
    (not so for buckets synchronize() starts: the pass is over and its bookkeeping reset)."""
    starts, original = [], opt._start

    def spy(bucket):
        if check_complete:
            assert not bucket.waiting, f"bucket {bucket.index} started, {bucket.waiting} missing"
        starts.append(bucket.index)
        return original(bucket)

    opt._start = spy
    return starts


def expected_reduce(p, params, op, step=0, seed=0, passes=1):
    """Every rank's gradient (summed over `passes` passes), reduced over ranks as ringcoll
    should: the exact sum, or the sum divided by p (one rounding)."""
    out = {}
    for n, x in params.items():
        total = sum(grads_for(params, r, step * passes + k, seed)[n].astype(np.float64)
                    for r in range(p) for k in range(passes))
        total = total.astype(x.dtype)  # exact: small integers
        out[n] = total if op == "sum" else total / x.dtype.type(p)
    return out


# ---------------------------------------------------------------------------------------------
# 1. buckets
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bucket_bytes", [1, 40, 64, 200, 1 << 20])
def test_bucket_layout(bucket_bytes):
    def fn(comm):
        params = make_params()
        opt = ringcoll.DistributedOptimizer(SGD(params, lr=0.1), comm, bucket_bytes=bucket_bytes)
        names = list(params)
        assert list(opt.grads) == names  # registration order, not bucket order
        seen = []
        for i, b in enumerate(opt.buckets):
            assert b.index == i
            assert b.names, "empty bucket"
            dtypes = {params[n].dtype for n in b.names}
            assert dtypes == {b.buf.dtype}, (b.names, dtypes)  # one dtype per bucket
            assert b.buf.size == sum(params[n].size for n in b.names)
            # bucket_bytes respected, except a parameter alone in its bucket
            assert b.buf.nbytes <= bucket_bytes or len(b.names) == 1, (b.names, b.buf.nbytes)
            offset = 0
            for n in b.names:
                g, p = opt.grads[n], params[n]
                assert g.shape == p.shape and g.dtype == p.dtype
                assert np.shares_memory(g, b.buf)
                # the view sits at its offset in the bucket: writes land there
                g[...] = np.arange(p.size, dtype=p.dtype).reshape(p.shape) + 1
                assert np.array_equal(b.buf[offset:offset + p.size], g.reshape(-1))
                offset += p.size
            seen += b.names
        assert sorted(seen) == sorted(names) and len(seen) == len(names)
        for n, p in params.items():  # a parameter larger than bucket_bytes is alone
            if p.nbytes > bucket_bytes:
                (b,) = [b for b in opt.buckets if n in b.names]
                assert b.names == [n]
        # buckets hold the parameters in strict reverse registration order, greedily: a
        # bucket closes only when the next parameter does not fit or has another dtype
        assert [n for b in opt.buckets for n in b.names] == list(reversed(names))
        for b, nxt in zip(opt.buckets, opt.buckets[1:]):
            first = params[nxt.names[0]]
            assert (b.buf.nbytes + first.nbytes > bucket_bytes
                    or first.dtype != b.buf.dtype), (b.names, nxt.names)
        # views are disjoint: the bucket buffers do not overlap each other either
        for a in names:
            for b in names:
                if a != b:
                    assert not np.shares_memory(opt.grads[a], opt.grads[b])
        return [b.names for b in opt.buckets]

    layouts = run(3, fn)
    assert all(layout == layouts[0] for layout in layouts)


def test_bucket_layout_single_dtype_is_reverse_registration_order():
    model = [(f"p{i}", (i + 1,), np.float32) for i in range(7)]

    def fn(comm):
        params = make_params(model=model)
        opt = ringcoll.DistributedOptimizer(SGD(params, lr=0.1), comm, bucket_bytes=24)
        order = [n for b in opt.buckets for n in b.names]
        assert order == list(reversed(list(params)))
        # p6 (28 B) > 24 B: alone; p5 (24 B) fills one; p4 (20 B) + p3 (16 B) > 24 B;
        # p3 + p2 (16 + 12) > 24 B; p2 + p1 + p0 = 12 + 8 + 4 = 24 B fits exactly
        assert [b.names for b in opt.buckets] == [["p6"], ["p5"], ["p4"], ["p3"],
                                                  ["p2", "p1", "p0"]]
        return True

    assert run(2, fn) == [True, True]


# ---------------------------------------------------------------------------------------------
# 2. start order
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [2, 3])
def test_buckets_start_in_order_whatever_order_gradients_arrive(p):
    def fn(comm):
        rng = np.random.default_rng(100 + comm.rank)
        results = {}
        for mode in ("in_order", "random"):
            params = make_params(seed=1)
            opt = ringcoll.DistributedOptimizer(Adam(params, lr=0.01), comm, bucket_bytes=40)
            starts = record_starts(opt)
            bucket_names = [n for b in opt.buckets for n in b.names]
            for step in range(3):
                g = grads_for(params, comm.rank, step)
                order = (bucket_names if mode == "in_order"
                         else list(rng.permutation(bucket_names)))
                starts.clear()
                handed = set()
                for n in order:
                    opt.grad_ready(n, g[n])
                    handed.add(str(n))
                    # started: exactly the longest prefix of buckets all of whose gradients
                    # are in (as early as possible, never out of order)
                    prefix = 0
                    while (prefix < len(opt.buckets)
                           and set(opt.buckets[prefix].names) <= handed):
                        prefix += 1
                    assert starts == list(range(prefix)), (order, starts)
                assert starts == list(range(len(opt.buckets)))
                opt.step()
                assert starts == list(range(len(opt.buckets)))  # step started nothing more
            results[mode] = (snapshot(params), snapshot(opt.grads))
        assert_same_params(results["in_order"][0], results["random"][0])
        assert_same_params(results["in_order"][1], results["random"][1])
        return results["random"][0]

    out = run(p, fn)
    for r in range(1, p):
        assert_same_params(out[0], out[r])


# ---------------------------------------------------------------------------------------------
# 3. results
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["step_grads", "grad_ready"])
@pytest.mark.parametrize("op", ["avg", "sum"])
@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_reduced_gradients_and_update(p, op, path):
    def fn(comm):
        params = make_params(seed=2)
        ref_params = snapshot(params)
        opt = ringcoll.DistributedOptimizer(Adam(params, lr=0.01), comm, op=op, bucket_bytes=40)
        ref = Adam(ref_params, lr=0.01)
        for step in range(2):
            g = grads_for(params, comm.rank, step)
            sent = snapshot(g)
            if path == "step_grads":
                opt.step(g)
            else:
                for n in reversed(list(g)):
                    opt.grad_ready(n, g[n])
                opt.step()
            assert_same_params(g, sent)  # the caller's gradients are not modified
            want = expected_reduce(p, params, op, step)
            for n in params:
                got = opt.grads[n]
                assert got.dtype == params[n].dtype
                if op == "sum" or p in (1, 2):  # exact sums; /1 and /2 are exact too
                    assert same_bits(got, want[n]), (n, got, want[n])
                else:
                    rtol = 1e-6 if got.dtype == np.float32 else 1e-14
                    np.testing.assert_allclose(got, want[n], rtol=rtol, atol=0, err_msg=n)
            # the update applied is the optimizer's step on the reduced gradients
            ref.step({n: opt.grads[n].copy() for n in params})
            assert_same_params(params, ref_params)
        return snapshot(params), snapshot(opt.grads)

    out = run(p, fn)
    for r in range(1, p):  # every rank bitwise identical
        assert_same_params(out[0][0], out[r][0])
        assert_same_params(out[0][1], out[r][1])


# ---------------------------------------------------------------------------------------------
# 4. errors
# ---------------------------------------------------------------------------------------------
def _opt(comm, passes=1, **kw):
    params = make_params()
    return params, ringcoll.DistributedOptimizer(SGD(params, lr=0.1), comm, bucket_bytes=40,
                                                 backward_passes_per_step=passes, **kw)


def _all_raise(results, cls, *needles, per_rank=None):
    for r, exc in enumerate(results):
        assert isinstance(exc, cls), (r, exc)
        msg = str(exc)
        for needle in needles + tuple(per_rank(r) if per_rank else ()):
            assert needle in msg, (r, needle, msg)


def test_unknown_name_in_grad_ready():
    def fn(comm):
        params, opt = _opt(comm)
        opt.grad_ready("nope", np.zeros(3))

    _all_raise(outcomes(2, fn), InvalidArgumentError, "'nope'", "w1",
               per_rank=lambda r: [f"rank {r}"])


def test_gradient_handed_over_twice():
    def fn(comm):
        params, opt = _opt(comm)
        g = grads_for(params, comm.rank)
        opt.grad_ready("b3", g["b3"])
        opt.grad_ready("w2", g["w2"])
        opt.grad_ready("b3", g["b3"])

    _all_raise(outcomes(2, fn), RingcollError, "'b3'", "already",
               per_rank=lambda r: [f"rank {r}"])


@pytest.mark.parametrize("call", ["step", "synchronize"])
def test_incomplete_pass(call):
    def fn(comm):
        params, opt = _opt(comm)
        g = grads_for(params, comm.rank)
        for n in ("b3", "w3", "w1"):
            opt.grad_ready(n, g[n])
        getattr(opt, call)()

    _all_raise(outcomes(2, fn), RingcollError, "'b2'", "'w2'", "'b1'", "incomplete",
               per_rank=lambda r: [f"rank {r}"])
    for exc in outcomes(2, fn):  # names handed over are not listed as missing
        assert "'b3'" not in str(exc) and "'w1'" not in str(exc)


@pytest.mark.parametrize("call", ["step", "synchronize"])
def test_synchronize_before_all_accumulation_passes(call):
    def fn(comm):
        params, opt = _opt(comm, passes=3)
        g = grads_for(params, comm.rank)
        for _ in range(2):
            for n in reversed(list(g)):
                opt.grad_ready(n, g[n])
        getattr(opt, call)()

    _all_raise(outcomes(2, fn), RingcollError, "2 of 3", "backward_passes_per_step",
               per_rank=lambda r: [f"rank {r}"])


@pytest.mark.parametrize("op", ["max", "min", "prod", "mean"])
def test_bad_op(op):
    def fn(comm):
        _opt(comm, op=op)

    _all_raise(outcomes(2, fn), InvalidArgumentError, repr(op))


@pytest.mark.parametrize("kw", [{"bucket_bytes": 0}, {"backward_passes_per_step": 0}])
def test_bad_sizes(kw):
    def fn(comm):
        ringcoll.DistributedOptimizer(SGD(make_params(), lr=0.1), comm, **kw)

    _all_raise(outcomes(2, fn), InvalidArgumentError, ">= 1")


class _StubOptimizer:
    """Duck-typed optimizer: .params and .step (DistributedOptimizer's documented contract)."""

    def __init__(self, params):
        self.params = params

    def step(self, grads):
        pass


@pytest.mark.parametrize("bad", [np.arange(3, dtype=np.int32), np.zeros(3, np.complex128),
                                 [1.0, 2.0]], ids=["int32", "complex", "list"])
def test_non_float_parameter(bad):
    def fn(comm):
        params = {"w": np.zeros(3, np.float32), "bad": bad}
        ringcoll.DistributedOptimizer(_StubOptimizer(params), comm)

    _all_raise(outcomes(2, fn), InvalidArgumentError, "'bad'", "float")


@pytest.mark.skipif(Compression.bf16 is None, reason="ml_dtypes not installed")
def test_bfloat16_parameter_accepted():
    bf16 = Compression.bf16.dtype

    def fn(comm):
        params = {"w": np.ones(4, bf16)}
        opt = ringcoll.DistributedOptimizer(SGD(params, lr=0.5), comm)
        opt.step({"w": np.full(4, comm.rank + 1, bf16)})
        return params["w"].astype(np.float32)

    for w in run(2, fn):
        assert np.array_equal(w, np.full(4, 1 - 0.5 * 1.5, np.float32))


@pytest.mark.parametrize("change", ["extra", "shape", "dtype", "name"])
def test_ranks_registering_different_parameters(change):
    p, odd = 3, 1

    def fn(comm):
        params = make_params()
        if comm.rank == odd:
            if change == "extra":
                params["extra"] = np.zeros(2, np.float32)
            elif change == "shape":
                params["b3"] = np.zeros(3, np.float32)
            elif change == "dtype":
                params["b3"] = params["b3"].astype(np.float64)
            else:
                params["b3x"] = params.pop("b3")
        return ringcoll.DistributedOptimizer(SGD(params, lr=0.1), comm, bucket_bytes=40)

    t0 = time.monotonic()
    results = outcomes(p, fn, timeout=5)
    assert time.monotonic() - t0 < 4, "the mismatch was not detected promptly"
    _all_raise(results, CollectiveMismatchError, "same model",
               per_rank=lambda r: [f"rank {r}", "[1]" if r != odd else "[0, 2]"])


def test_step_grads_missing_a_name():
    def fn(comm):
        params, opt = _opt(comm)
        g = grads_for(params, comm.rank)
        del g["w2"]
        opt.step(g)

    _all_raise(outcomes(2, fn), InvalidArgumentError, "'w2'", "step",
               per_rank=lambda r: [f"rank {r}"])


def test_step_grads_missing_a_name_leaves_the_optimizer_usable():
    def fn(comm):
        params, opt = _opt(comm)
        g = grads_for(params, comm.rank)
        partial = {n: v for n, v in g.items() if n != "w1"}  # w1: last in bucket order
        with pytest.raises(InvalidArgumentError):
            opt.step(partial)
        opt.step(g)
        want = expected_reduce(comm.size, params, "avg")
        return all(same_bits(opt.grads[n], want[n]) for n in params)

    assert run(2, fn) == [True, True]


# ---------------------------------------------------------------------------------------------
# 5. accumulation
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [1, 3])
def test_accumulation_sums_passes(p):
    passes = 3

    def fn(comm):
        params, opt = _opt(comm, passes=passes)
        starts = record_starts(opt)
        for step in range(2):
            for b in opt.buckets:  # stale values: the first pass must overwrite them
                b.buf[...] = 1e6
            for k in range(passes):
                g = grads_for(params, comm.rank, step * passes + k)
                for n in reversed(list(g)):
                    if k == 1:  # the other way: add into opt.grads, then grad_ready(name)
                        opt.grads[n] += g[n]
                        opt.grad_ready(n)
                    else:
                        opt.grad_ready(n, g[n])
                want_starts = len(opt.buckets) if k == passes - 1 else 0
                assert len(starts) == want_starts, (k, starts)
            assert starts == list(range(len(opt.buckets)))
            opt.step()
            want = expected_reduce(comm.size, params, "avg", step, passes=passes)
            for n in params:
                if comm.size == 1:
                    assert same_bits(opt.grads[n], want[n]), n
                else:
                    np.testing.assert_allclose(opt.grads[n], want[n], rtol=1e-6, err_msg=n)
            starts.clear()
        return snapshot(params)

    out = run(p, fn)
    for r in range(1, p):
        assert_same_params(out[0], out[r])


def test_no_sync_passes_start_nothing():
    def fn(comm):
        params, opt = _opt(comm)  # backward_passes_per_step=1
        starts = record_starts(opt)
        for step in range(2):
            total = {n: np.zeros_like(v) for n, v in params.items()}
            for k in range(3):
                g = grads_for(params, comm.rank, 10 * step + k)
                for n in g:
                    total[n] += g[n]
                if k < 2:
                    with opt.no_sync():
                        for n in reversed(list(g)):
                            opt.grad_ready(n, g[n])
                    assert starts == [], k
                else:
                    for n in reversed(list(g)):
                        opt.grad_ready(n, g[n])
                    assert starts == list(range(len(opt.buckets)))
            opt.step()
            starts.clear()
            mine = {n: total[n] for n in params}
            got = snapshot(opt.grads)
        return mine, got

    out = run(3, fn)
    for r in range(3):
        for n in out[0][0]:
            total = sum(out[q][0][n].astype(np.float64) for q in range(3))
            np.testing.assert_allclose(out[r][1][n], total / 3, rtol=1e-6, err_msg=n)
            assert same_bits(out[r][1][n], out[0][1][n])


def test_step_after_only_no_sync_passes_starts_the_buckets():
    def fn(comm):
        params, opt = _opt(comm)
        starts = record_starts(opt, check_complete=False)
        g = grads_for(params, comm.rank)
        with opt.no_sync():
            for n in reversed(list(g)):
                opt.grad_ready(n, g[n])
        assert starts == []
        opt.step()
        assert starts == list(range(len(opt.buckets)))
        want = expected_reduce(comm.size, params, "avg")
        return all(same_bits(opt.grads[n], want[n]) for n in params)

    assert run(2, fn) == [True, True]


# ---------------------------------------------------------------------------------------------
# 6. compression
# ---------------------------------------------------------------------------------------------
def _record_topk(comp):
    """Wrap comp.start: list of (bucket state, dense copy of what this rank sent) per call."""
    sent, original = [], comp.start

    def spy(comm, buf, state):
        handle = original(comm, buf, state)
        _, _, index, values = handle
        assert index.dtype == np.int32 and values.dtype == buf.dtype
        dense = np.zeros_like(buf)
        dense[index] = values  # indices are distinct (argpartition)
        assert len(np.unique(index)) == len(index)
        sent.append((state, dense))
        return handle

    comp.start = spy
    return sent


@pytest.mark.parametrize("density", [0.1, 0.25, 0.5])
def test_topk_bytes_sent(density):
    steps = 3

    def fn(comm):
        params = make_params()
        opt = ringcoll.DistributedOptimizer(SGD(params, lr=0.1), comm, bucket_bytes=64,
                                            compression=TopK(density))
        for step in range(steps):
            opt.step(grads_for(params, comm.rank, step))
        per_step = sum(max(1, int(round(density * b.buf.size))) * (4 + b.buf.itemsize)
                       for b in opt.buckets)
        assert opt.bytes_sent == steps * per_step
        assert opt.bytes_sent < steps * sum(b.buf.nbytes for b in opt.buckets)
        return opt.bytes_sent

    run(2, fn)


@pytest.mark.parametrize("p", [1, 2, 3])
def test_topk_error_feedback(p):
    steps, density = 5, 0.3

    def fn(comm):
        params = make_params()
        comp = TopK(density)
        sent = _record_topk(comp)
        opt = ringcoll.DistributedOptimizer(SGD(params, lr=0.1), comm, bucket_bytes=64,
                                            compression=comp)
        true_total = {b.index: np.zeros_like(b.buf) for b in opt.buckets}
        sent_total = {b.index: np.zeros_like(b.buf) for b in opt.buckets}
        per_step = []
        for step in range(steps):
            g = grads_for(params, comm.rank, step, scale=50)
            sent.clear()
            opt.step(g)
            assert len(sent) == len(opt.buckets)
            step_sent = {}
            for state, dense in sent:
                (b,) = [b for b in opt.buckets if b.state is state]
                k = max(1, int(round(density * b.buf.size)))
                assert np.count_nonzero(dense) <= k
                sent_total[b.index] += dense
                step_sent[b.index] = dense
            for b in opt.buckets:
                true_total[b.index] += np.concatenate([g[n].reshape(-1) for n in b.names])
            per_step.append((step_sent, {b.index: b.buf.copy() for b in opt.buckets}))
        for b in opt.buckets:  # nothing dropped: sent + residual == every gradient, exactly
            assert same_bits(sent_total[b.index] + b.state["residual"], true_total[b.index]), \
                b.names
        return per_step

    out = run(p, fn)
    for step in range(steps):  # each step's average is the ranks' sparse contributions / p
        for idx in out[0][step][0]:
            contrib = sum(out[r][step][0][idx] for r in range(p))
            want = contrib / contrib.dtype.type(p)
            for r in range(p):
                assert same_bits(out[r][step][1][idx], want), (step, idx, r)


def test_topk_density_one_is_the_exact_average():
    p = 3

    def fn(comm):
        params = make_params()
        comp = Compression.topk(1.0)
        opt = ringcoll.DistributedOptimizer(SGD(params, lr=0.1), comm, bucket_bytes=64,
                                            compression=comp)
        for step in range(3):
            opt.step(grads_for(params, comm.rank, step))
            want = expected_reduce(p, params, "avg", step)
            for n in params:
                assert same_bits(opt.grads[n], want[n]), n
            for b in opt.buckets:
                assert not b.state["residual"].any()
        assert opt.bytes_sent == 3 * sum(b.buf.size * (4 + b.buf.itemsize)
                                         for b in opt.buckets)
        return True

    assert run(p, fn) == [True] * p


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_cast_compression_halves_the_bytes(name):
    comp = getattr(Compression, name)
    if comp is None:
        pytest.skip("ml_dtypes not installed")
    model = FLOAT32_MODEL
    steps, p = 3, 3

    def fn(comm):
        params = make_params(model=model)
        opt = ringcoll.DistributedOptimizer(SGD(params, lr=0.1), comm, bucket_bytes=64,
                                            compression=comp)
        for step in range(steps):
            opt.step(grads_for(params, comm.rank, step))
            want = expected_reduce(p, params, "avg", step)
            for n in params:  # |g| <= 8: 16-bit floats hold these averages closely
                np.testing.assert_allclose(opt.grads[n], want[n],
                                           atol=8 * (2e-3 if name == "fp16" else 1e-2))
        assert opt.bytes_sent * 2 == steps * sum(v.nbytes for v in params.values())
        return snapshot(params)

    out = run(p, fn)
    for r in range(1, p):
        assert_same_params(out[0], out[r])


def test_cast_wire_bytes_follow_the_payload_dtype():
    buf64, buf32 = np.zeros(10, np.float64), np.zeros(10, np.float32)
    assert Compression.fp16.wire_bytes(buf64) == 20 == buf64.nbytes // 4
    assert Compression.fp16.wire_bytes(buf32) == 20 == buf32.nbytes // 2
    assert isinstance(Compression.fp16, Cast) and Compression.fp16.name == "fp16"


def test_bf16_present_iff_ml_dtypes():
    has = importlib.util.find_spec("ml_dtypes") is not None
    assert (Compression.bf16 is not None) == has
    if has:
        assert Compression.bf16.dtype.itemsize == 2 and Compression.bf16.name == "bf16"


@pytest.mark.parametrize("density", [0, 0.0, -0.5, 1.5, 2])
def test_topk_bad_density(density):
    with pytest.raises(InvalidArgumentError, match="density"):
        TopK(density)
    with pytest.raises(InvalidArgumentError, match="density"):
        Compression.topk(density)


# ---------------------------------------------------------------------------------------------
# 7. broadcasts
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("root", ["first", "last"])
def test_broadcast_parameters(p, root):
    root = 0 if root == "first" else p - 1

    def fn(comm):
        params = make_params(seed=10 + comm.rank)
        arrays = dict(params)
        ringcoll.broadcast_parameters(params, root=root, comm=comm)
        assert all(params[n] is arrays[n] for n in params)  # in place
        assert_same_params(params, make_params(seed=10 + root))
        return True

    assert run(p, fn) == [True] * p


def _make_opt(kind, params, rank):
    if kind == "sgd":
        return SGD(params, lr=0.1 * (rank + 1), momentum=0.9)
    return Adam(params, lr=0.01 * (rank + 1), weight_decay=1e-3 * rank)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("when", [
    "fresh", "root_fresh_others_stepped", "stepped",
    "root_stepped_others_fresh"])
@pytest.mark.parametrize("root", [0, 2])
def test_broadcast_optimizer_state(kind, when, root):
    p = 3

    def fn(comm):
        params = make_params(seed=20 + comm.rank)
        inner = _make_opt(kind, params, comm.rank)
        def local_steps(rank):  # different state (and step counts) per rank
            return {"fresh": 0, "stepped": rank + 1,
                    "root_fresh_others_stepped": 0 if rank == root else 2,
                    "root_stepped_others_fresh": 2 if rank == root else 0}[when]

        for s in range(local_steps(comm.rank)):
            inner.step(grads_for(params, comm.rank, s))
        root_state = _make_opt(kind, make_params(seed=20 + root), root)  # root's, rebuilt
        for s in range(local_steps(root)):
            root_state.step(grads_for(root_state.params, root, s))
        ringcoll.broadcast_optimizer_state(inner, root=root, comm=comm)
        assert_same_state(inner.state_dict(), root_state.state_dict())
        if when in ("fresh", "root_fresh_others_stepped"):
            assert all(st == {} for st in inner.state.values())
        ringcoll.broadcast_parameters(params, root=root, comm=comm)
        opt = ringcoll.DistributedOptimizer(inner, comm, bucket_bytes=40)
        for s in range(2):  # identical steps from here: all ranks stay bitwise identical
            opt.step(grads_for(params, comm.rank, 100 + s))
        return snapshot(params), inner.state_dict()

    out = run(p, fn)
    for r in range(1, p):
        assert_same_params(out[0][0], out[r][0])
        assert_same_state(out[0][1], out[r][1])


# 8. checkpoints: tests/test_checkpoint.py
