"""Reliability on the thread transport: validation, closed communicators, debug mode,
mismatched calls, data safety on error, timeouts, failing peers and the context manager.

Every test looks at what EVERY rank raised or returned (per_rank from test_threads), and the
tests of a failing program also check that it failed promptly (well under the timeout):
a program that is wrong must fail loudly and fast, never hang or return garbage.
(Found along the way and fixed: zero counts that skipped their messages, the with-block that
left the communicator open, and agreed debug-mode errors that failed the thread world.)
"""

import re
import time

import numpy as np
import pytest

import ringcoll
from ringcoll.errors import (CollectiveMismatchError, CollectiveTimeoutError,
                             CommunicatorClosedError, InvalidArgumentError, InvalidTypeError,
                             PeerFailedError, RingcollError)

from test_threads import per_rank

TIMEOUT = 5.0  # the thread ranks' receive timeout in these tests
FAST = 2.0  # a detected error (not a timeout) must end the whole run within this
ALLREDUCE_ALGOS = ("ring", "recursive_doubling", "rabenseifner", "bruck", "hierarchical")


def timed(p, fn, **options):
    """per_rank(p, fn) with the test timeout: (every rank's result or exception, seconds)."""
    options.setdefault("timeout", TIMEOUT)
    start = time.perf_counter()
    outcome = per_rank(p, fn, **options)
    return outcome, time.perf_counter() - start


def names_rank(e, r, call):
    """e's message starts like 'ringcoll rank R, <call>' (call may carry ' #seq (algo)')."""
    return f"ringcoll rank {r}, {call}" in str(e)


def differ(e):
    """The fields a debug-mode CollectiveMismatchError says differ: '(op, shape differ)'."""
    m = re.search(r"\(([^()]*) differ\)", str(e))
    assert m, f"no '(... differ)' in {e}"
    return m.group(1).split(", ")


# ---------------------------------------------------------------------------------------------
# 1. validation: a bad argument raises the specific class, names rank and call, says the fix,
#    and leaves the caller's arrays untouched; all ranks passing it never hangs (debug or not)
# ---------------------------------------------------------------------------------------------
def _ro(a):
    a.flags.writeable = False
    return a


# name: (collective in the message, exact class, fix in the message ({last}: p - 1), call).
# call(c, keep): keep(a) registers an array whose bytes must be unchanged after the error.
VALIDATION = {
    "object_dtype": ("allreduce", InvalidTypeError, "use a numeric dtype",
                     lambda c, k: c.allreduce(k(np.array([1, "a", None], dtype=object)))),
    # the data-movement collectives take any fixed-size dtype (test_fixed_size_dtypes_move
    # below), but not object pointers, nor a dtype without bytes
    "object_dtype_allgather": ("allgather", InvalidTypeError, "pass a fixed-size dtype",
                               lambda c, k: c.allgather(k(np.array([1, None], dtype=object)))),
    "object_dtype_broadcast": ("broadcast", InvalidTypeError, "pass a fixed-size dtype",
                               lambda c, k: c.broadcast(k(np.array([1, None], dtype=object)))),
    "object_dtype_gather": ("gather", InvalidTypeError, "Python object pointers",
                            lambda c, k: c.gather(k(np.array([1, None], dtype=object)))),
    "object_field_alltoall": ("alltoall", InvalidTypeError, "pass a fixed-size dtype",
                              lambda c, k: c.alltoall(k(np.zeros(c.size, [("a", "i4"),
                                                                          ("b", "O")])))),
    "zero_itemsize_allgather": ("allgather", InvalidTypeError, "itemsize 0",
                                lambda c, k: c.allgather(k(np.zeros(3, "V0")))),
    # the reductions still refuse what they cannot add up
    "str_dtype": ("reduce_scatter", InvalidTypeError, "use a numeric dtype",
                  lambda c, k: c.reduce_scatter(k(np.array(["ab", "cd", "ef"])))),
    "str_dtype_allreduce": ("allreduce", InvalidTypeError, "use a numeric dtype",
                            lambda c, k: c.allreduce(k(np.array(["a", "b", "c"])))),
    "structured_dtype_allreduce": ("allreduce", InvalidTypeError, "use a numeric dtype",
                                   lambda c, k: c.allreduce(k(np.zeros(3, [("a", "i4"),
                                                                           ("b", "f8")])))),
    "structured_dtype_reduce": ("reduce", InvalidTypeError, "use a numeric dtype",
                                lambda c, k: c.reduce(k(np.zeros(2, [("a", "i4")])))),
    "bool_iallreduce": ("iallreduce", InvalidTypeError, "use a numeric dtype",
                        lambda c, k: c.iallreduce(k(np.ones(3, bool)))),
    "avg_int": ("allreduce", InvalidTypeError, "use op='sum' and divide yourself",
                lambda c, k: c.allreduce(k(np.arange(6, dtype=np.int32)), op="avg")),
    "avg_int_in_place": ("allreduce", InvalidTypeError, "convert to a float dtype",
                         lambda c, k: c.allreduce(x := k(np.arange(6)), op="avg", out=x)),
    "avg_int_iallreduce": ("iallreduce", InvalidTypeError, "use op='sum'",
                           lambda c, k: c.iallreduce(k(np.arange(6, dtype=np.uint8)), op="avg")),
    "avg_int_reduce": ("reduce", InvalidTypeError, "use op='sum'",
                       lambda c, k: c.reduce(k(np.arange(6, dtype=np.int64)), op="avg")),
    "max_complex": ("allreduce", InvalidTypeError, "use",
                    lambda c, k: c.allreduce(k(np.ones(3, np.complex128)), op="max")),
    "out_shape": ("allreduce", InvalidArgumentError, "it must be shape (4,)",
                  lambda c, k: c.allreduce(k(np.arange(4.0)), out=k(np.zeros(5)))),
    "out_dtype": ("allreduce", InvalidArgumentError, "dtype float64",
                  lambda c, k: c.allreduce(k(np.arange(4.0)), out=k(np.zeros(4, np.float32)))),
    "out_readonly": ("allreduce", InvalidArgumentError, "pass a writeable array",
                     lambda c, k: c.allreduce(k(np.arange(4.0)), out=_ro(k(np.zeros(4))))),
    "out_non_contiguous": ("allreduce", InvalidArgumentError, "pass a C- or F-contiguous array",
                           lambda c, k: c.allreduce(k(np.arange(4.0)),
                                                    out=k(np.zeros(8))[::2])),
    "out_not_an_array": ("allreduce", InvalidTypeError, "must be a NumPy array",
                         lambda c, k: c.allreduce(k(np.arange(4.0)), out=[0.0] * 4)),
    "root_negative_broadcast": ("broadcast", InvalidArgumentError, "(0..{last})",
                                lambda c, k: c.broadcast(k(np.arange(3.0)), root=-1)),
    "root_size_broadcast": ("broadcast", InvalidArgumentError, "(0..{last})",
                            lambda c, k: c.broadcast(k(np.arange(3.0)), root=c.size)),
    "root_float_broadcast": ("broadcast", InvalidArgumentError, "(0..{last})",
                             lambda c, k: c.broadcast(k(np.arange(3.0)), root=1.5)),
    "root_negative_reduce": ("reduce", InvalidArgumentError, "(0..{last})",
                             lambda c, k: c.reduce(k(np.arange(3.0)), root=-1)),
    "root_size_reduce": ("reduce", InvalidArgumentError, "(0..{last})",
                         lambda c, k: c.reduce(k(np.arange(3.0)), root=c.size)),
    "root_float_reduce_in_place": ("reduce", InvalidArgumentError, "(0..{last})",
                                   lambda c, k: c.reduce(x := k(np.arange(3.0)), root=1.5,
                                                         out=x)),
    "op_foo": ("allreduce", InvalidArgumentError, "use one of 'sum'",
               lambda c, k: c.allreduce(k(np.arange(3.0)), op="foo")),
    "op_foo_in_place": ("allreduce", InvalidArgumentError, "use one of 'sum'",
                        lambda c, k: c.allreduce(x := k(np.arange(3.0)), op="foo", out=x)),
    "op_foo_reduce_scatter": ("reduce_scatter", InvalidArgumentError, "use one of 'sum'",
                              lambda c, k: c.reduce_scatter(k(np.arange(3.0)), op="foo")),
    "algorithm_unknown": ("allreduce", InvalidArgumentError, "choose one of",
                          lambda c, k: c.allreduce(k(np.arange(3.0)), algorithm="bogus")),
    "algorithm_unknown_in_place": ("allreduce", InvalidArgumentError, "choose one of",
                                   lambda c, k: c.allreduce(x := k(np.arange(3.0)),
                                                            algorithm="bogus", out=x)),
    "algorithm_unknown_broadcast": ("broadcast", InvalidArgumentError, "use 'auto'",
                                    lambda c, k: c.broadcast(k(np.arange(3.0)),
                                                             algorithm="bogus")),
    "in_place_non_contiguous_x": ("allreduce", InvalidArgumentError, "np.ascontiguousarray",
                                  lambda c, k: c.allreduce(x := k(np.arange(8.0))[::2], out=x)),
    "alltoall_rows_not_multiple": ("alltoall", InvalidArgumentError,
                                   "must be a multiple of the communicator size",
                                   lambda c, k: c.alltoall(k(np.arange(2.0 * c.size + 2)
                                                             .reshape(-1, 2)[:c.size + 1]))),
}


def _validation_params():
    return [pytest.param(*case, id=name) for name, case in VALIDATION.items()]


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
@pytest.mark.parametrize("collective,exc,fix,call", _validation_params())
def test_invalid_argument_on_every_rank(collective, exc, fix, call, debug):
    p = 3

    def body(c):
        kept = []

        def keep(a):
            kept.append((a, a.tobytes()))
            return a

        try:
            call(c, keep)
        except Exception as e:  # noqa: BLE001 - inspected below
            error = e
        else:
            error = None
        return error, [i for i, (a, before) in enumerate(kept) if a.tobytes() != before]

    outcome, elapsed = timed(p, body, debug=debug)
    assert elapsed < FAST, f"took {elapsed:.2f} s"
    for r, result in enumerate(outcome):
        assert isinstance(result, tuple), f"rank {r}: the run itself failed: {result!r}"
        e, changed = result
        assert type(e) is exc, f"rank {r}: expected {exc.__name__}, got {e!r}"
        assert isinstance(e, TypeError if exc is InvalidTypeError else ValueError)
        assert names_rank(e, r, collective), f"rank {r}: {e}"
        assert fix.format(last=p - 1) in str(e), f"rank {r}: no fix {fix!r} in: {e}"
        assert not changed, f"rank {r}: arrays {changed} were modified by a rejected call"


STRUCT = np.dtype([("a", "i4"), ("b", "f8")])


def _struct_rows(rank, n):
    x = np.zeros(n, STRUCT)
    x["a"], x["b"] = np.arange(n) + 10 * rank, np.arange(n) / 4 - rank
    return x


# Once refused like the reductions' cases above, these data-movement calls now work:
# name: (this rank's input from (rank, p), the call, the oracle from every rank's input).
MOVED = {
    "str_dtype_alltoall": (
        lambda r, p: np.array([f"{r}>{j}" for j in range(p)]),
        lambda c, x: c.alltoall(x),
        lambda xs, r: np.array([xs[j][r] for j in range(len(xs))])),
    "structured_dtype": (
        lambda r, p: _struct_rows(r, 3),
        lambda c, x: c.broadcast(x, root=c.size - 1),
        lambda xs, r: xs[-1]),
    "structured_dtype_allgather": (
        lambda r, p: _struct_rows(r, r + 1),
        lambda c, x: c.allgather(x),
        lambda xs, r: np.concatenate(xs)),
    "bytes_dtype_gather": (
        lambda r, p: np.array([b"r%d" % r] * (r % 2 + 1), "S7"),
        lambda c, x: c.gather(x, root=1),
        lambda xs, r: np.concatenate(xs) if r == 1 else None),
}


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
@pytest.mark.parametrize("name", list(MOVED))
def test_fixed_size_dtypes_move(name, debug):
    make, call, oracle = MOVED[name]
    p = 3
    inputs = [make(r, p) for r in range(p)]
    outcome, elapsed = timed(p, lambda c: call(c, make(c.rank, p)), debug=debug)
    assert elapsed < FAST, f"took {elapsed:.2f} s"
    for r, got in enumerate(outcome):
        expected = oracle(inputs, r)
        if expected is None:
            assert got is None, f"rank {r}: expected None, got {got!r}"
            continue
        assert isinstance(got, np.ndarray), f"rank {r}: {got!r}"
        assert (got.dtype, got.shape) == (expected.dtype, expected.shape), f"rank {r}: {got!r}"
        assert got.tobytes() == expected.tobytes(), f"rank {r}: {got!r} != {expected!r}"


# ---------------------------------------------------------------------------------------------
# 2. closed communicator
# ---------------------------------------------------------------------------------------------
CLOSED_CALLS = {
    "allreduce": lambda c: c.allreduce(np.ones(3)),
    "iallreduce": lambda c: c.iallreduce(np.ones(3)).wait(),
    "reduce_scatter": lambda c: c.reduce_scatter(np.ones(3)),
    "allgather": lambda c: c.allgather(np.ones(3)),
    "broadcast": lambda c: c.broadcast(np.ones(3)),
    "reduce": lambda c: c.reduce(np.ones(3)),
    "alltoall": lambda c: c.alltoall(np.ones(c.size)),
    "barrier": lambda c: c.barrier(),
    "split": lambda c: c.split(0),
}


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_collectives_after_close_raise(debug):
    def body(c):
        assert c.allreduce(np.ones(2))[0] == c.size  # a working communicator first
        c.close()
        c.close()  # twice is harmless
        with c:  # and so is leaving a with-block on a closed communicator
            pass
        errors = {}
        for name, call in CLOSED_CALLS.items():
            try:
                call(c)
            except Exception as e:  # noqa: BLE001 - inspected below
                errors[name] = e
            else:
                errors[name] = None
        return errors

    outcome, elapsed = timed(3, body, debug=debug)
    assert elapsed < FAST
    for r, errors in enumerate(outcome):
        assert isinstance(errors, dict), f"rank {r}: {errors!r}"
        for name, e in errors.items():
            assert isinstance(e, CommunicatorClosedError), f"rank {r}, {name}: got {e!r}"
            # iallreduce's message names 'allreduce' (the check is shared with it)
            call = "allreduce" if name == "iallreduce" else name
            assert names_rank(e, r, call) and "was closed" in str(e), f"rank {r}: {e}"
            assert "create a new one" in str(e)


# ---------------------------------------------------------------------------------------------
# 3. debug mode: every rank compares every call before any data moves
# ---------------------------------------------------------------------------------------------
def catching(fn):
    """fn, returning its exception instead of raising it.

    Debug mode's errors are raised on every rank alike, after the exchange of fingerprints;
    but a rank that lets one escape from run_threads fails the thread world, and a peer
    still receiving its last fingerprints (p >= 3) then stops with PeerFailedError instead.
    So these tests catch the error on each rank, as a program that goes on would."""
    def body(c):
        try:
            return fn(c)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            return e

    return body


def debug_run(p, fn, **options):
    outcome, elapsed = timed(p, catching(fn), debug=True, **options)
    assert elapsed < FAST, f"debug-mode check took {elapsed:.2f} s"
    return outcome


def expect_mismatch(outcome, field, call, *pieces):
    for r, e in enumerate(outcome):
        assert isinstance(e, CollectiveMismatchError), f"rank {r}: got {e!r}"
        assert names_rank(e, r, call), f"rank {r}: {e}"
        assert field in differ(e), f"rank {r}: {field!r} not among the differences: {e}"
        for piece in pieces:
            assert piece in str(e), f"rank {r}: {piece!r} not in: {e}"
        assert "Fix:" in str(e)


@pytest.mark.parametrize("algorithm", [None, "ring", "recursive_doubling"])
def test_debug_different_shape(algorithm):
    out = debug_run(3, lambda c: c.allreduce(np.ones(5 if c.rank == 1 else 4),
                                             algorithm=algorithm))
    expect_mismatch(out, "shape", "allreduce #1", "rank(s) [0, 2]: allreduce #1",
                    "rank(s) [1]: allreduce #1", "shape=[4]", "shape=[5]",
                    "pass arrays of the same shape on every rank")


def test_debug_different_dtype_same_itemsize():
    out = debug_run(3, lambda c: c.allreduce(np.ones(4, np.int32 if c.rank == 1
                                                     else np.float32)))
    expect_mismatch(out, "dtype", "allreduce #1", "dtype=float32", "dtype=int32",
                    "rank(s) [1]")
    assert "shape" not in differ(out[0])


def test_debug_different_op():
    out = debug_run(4, lambda c: c.allreduce(np.ones(4), op="max" if c.rank == 1 else "sum"))
    expect_mismatch(out, "op", "allreduce #1", "op=max", "op=sum", "rank(s) [0, 2, 3]",
                    "pass the same op on every rank")
    assert differ(out[0]) == ["op"]


@pytest.mark.parametrize("collective", ["broadcast", "reduce"])
def test_debug_different_root(collective):
    out = debug_run(3, lambda c: getattr(c, collective)(np.ones(3), root=1 if c.rank == 1
                                                         else 0))
    expect_mismatch(out, "root", f"{collective} #1", "root=0", "root=1",
                    "pass the same root on every rank")
    assert differ(out[0]) == ["root"]


def test_debug_different_collective():
    out = debug_run(3, lambda c: c.broadcast(np.ones(4)) if c.rank == 1
                    else c.allreduce(np.ones(4)))
    for r, e in enumerate(out):
        call = "broadcast #1" if r == 1 else "allreduce #1"
        assert isinstance(e, CollectiveMismatchError) and names_rank(e, r, call), (r, e)
        assert "collective" in differ(e)
        assert "rank(s) [1]: broadcast #1" in str(e) and "rank(s) [0, 2]: allreduce #1" in str(e)
        assert "called different collectives" in str(e)


def test_debug_extra_call_on_one_rank():
    """Rank 1 makes an extra barrier first: the fingerprints differ at call #1 already."""
    def body(c):
        if c.rank == 1:
            c.barrier()
        return c.allreduce(np.ones(3))

    out = debug_run(3, body)
    for r, e in enumerate(out):
        assert isinstance(e, CollectiveMismatchError), (r, e)
        assert "collective" in differ(e) and "barrier #1" in str(e), e


def test_debug_in_place_on_some_ranks_only():
    def body(c):
        x = np.ones(4)
        return c.allreduce(x, algorithm="ring", out=x if c.rank == 0 else None)

    out = debug_run(3, body)
    expect_mismatch(out, "in_place", "allreduce #1", "in_place=True", "in_place=False",
                    "MPI_IN_PLACE")
    assert differ(out[0]) == ["in_place"]


def test_debug_invalid_argument_on_one_rank_only():
    def body(c):
        x = np.arange(4, dtype=np.int64)
        return c.allreduce(x, op="avg" if c.rank == 1 else "sum")

    out = debug_run(4, body)
    assert type(out[1]) is InvalidTypeError and names_rank(out[1], 1, "allreduce"), out[1]
    for r in (0, 2, 3):
        e = out[r]
        assert isinstance(e, PeerFailedError), (r, e)
        assert names_rank(e, r, "allreduce #1"), e
        assert "rank(s) [1]" in str(e) and "rank 1: InvalidTypeError" in str(e), e
        assert "avg" in str(e)


def _recovers(mistake):
    """The mistake (an agreed error in debug mode), then correct collectives on the same
    communicator: return (the mistake's error, the results of the correct calls)."""
    def body(c):
        try:
            mistake(c)
        except RingcollError as e:
            error = e
        else:
            error = None
        y = c.allreduce(np.full(3, c.rank + 1.0))
        z = c.broadcast(np.full(2, c.rank), root=c.size - 1)
        g = c.allgather(np.array([c.rank]))
        return error, y, z, g

    return body


MISTAKES = {
    "shape": lambda c: c.allreduce(np.ones(5 if c.rank == 1 else 4)),
    "dtype": lambda c: c.allreduce(np.ones(4, np.int32 if c.rank == 1 else np.float32)),
    "root": lambda c: c.reduce(np.ones(3), root=c.rank % 2),
    "collective": lambda c: c.broadcast(np.ones(4)) if c.rank == 1 else c.allreduce(np.ones(4)),
    "in_place": lambda c: c.allreduce(x := np.ones(4), out=x if c.rank else None),
    "invalid_on_one_rank": lambda c: c.allreduce(np.arange(4), op="avg" if c.rank == 1
                                                  else "sum"),
    "allgather_row_shape": lambda c: c.allgather(np.ones((2, 3 if c.rank == 1 else 2))),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_debug_errors_are_recoverable(mistake):
    p = 4
    out = debug_run(p, _recovers(MISTAKES[mistake]))
    for r, result in enumerate(out):
        assert isinstance(result, tuple), f"rank {r} could not go on: {result!r}"
        error, y, z, g = result
        assert isinstance(error, RingcollError), (r, error)
        np.testing.assert_array_equal(y, np.full(3, p * (p + 1) / 2))
        np.testing.assert_array_equal(z, np.full(2, p - 1))
        np.testing.assert_array_equal(g, np.arange(p))


def _program(c):
    """A correct program using every collective; returns everything it computed."""
    r, p = c.rank, c.size
    rng = np.random.default_rng(r)
    x = rng.standard_normal(37)
    res = [c.allreduce(x), c.allreduce(x, op="max", algorithm="ring"),
           c.allreduce(x.astype(np.float32), op="avg", algorithm="rabenseifner")]
    inplace = np.arange(5, dtype=np.int64) * (r + 1)
    c.allreduce(inplace, op="prod", out=inplace)
    res.append(inplace)
    res.append(c.reduce_scatter(rng.standard_normal((2 * p + 1, 3))))
    res.append(c.allgather(np.full((r + 1, 2), r, dtype=np.int16)))
    res.append(c.broadcast(np.full(4, r, dtype=np.complex64), root=p - 1))
    res.append(c.reduce(x, op="min", root=min(1, p - 1)))
    res.append(c.alltoall(np.arange(3 * p) + 100 * r))
    c.barrier()
    req = c.iallreduce(x)
    res.append(req.wait())
    return [None if a is None else (a.dtype.str, a.shape, a.tobytes()) for a in res]


@pytest.mark.parametrize("p", [1, 3, 4])
def test_debug_mode_gives_the_same_results(p):
    plain = ringcoll.run_threads(p, _program, timeout=TIMEOUT)
    start = time.perf_counter()
    debug = ringcoll.run_threads(p, _program, timeout=TIMEOUT, debug=True)
    assert time.perf_counter() - start < FAST
    assert debug == plain


def test_debug_allgather_with_different_row_counts():
    def body(c):
        return c.allgather(np.full((c.rank, 2), c.rank, dtype=np.float32))

    out = debug_run(4, body)
    expected = np.concatenate([np.full((r, 2), r, dtype=np.float32) for r in range(4)])
    for r, y in enumerate(out):
        assert isinstance(y, np.ndarray), (r, y)
        np.testing.assert_array_equal(y, expected)


def test_debug_allgather_different_trailing_shape():
    out = debug_run(3, lambda c: c.allgather(np.ones((2, 3 if c.rank == 1 else 2))))
    expect_mismatch(out, "row_shape", "allgather #1", "row_shape=[3]", "row_shape=[2]")


# ---------------------------------------------------------------------------------------------
# 4. without debug mode: mismatched counts fail promptly, and no rank returns a wrong result
# ---------------------------------------------------------------------------------------------
def expect_prompt_error(outcome, elapsed, own_result):
    """Without debug mode the checks are local: at least one rank sees the mismatch and raises
    (over MPI it then aborts the job; here the world fails and the waiting ranks stop), while
    a rank that finished its part first (a zero count beside another, a sender of an eager
    message) may return. It must return the right answer for its own input, own_result(r)."""
    assert elapsed < FAST, f"took {elapsed:.2f} s: only the timeout caught it"
    raised = [r for r, e in enumerate(outcome) if isinstance(e, BaseException)]
    assert raised, f"no rank raised: {outcome}"
    for r, e in enumerate(outcome):
        if r in raised:
            assert isinstance(e, RingcollError), f"rank {r} raised {e!r}"
            assert not isinstance(e, CollectiveTimeoutError), f"rank {r}: caught by a timeout: {e}"
            assert f"ringcoll rank {r}," in str(e), e
        else:
            want = own_result(r)
            assert (e is None and want is None) or (
                e is not None and want is not None and np.array_equal(e, want)), (
                f"rank {r} returned {e!r}, not {want!r}")




def _mismatch_params():
    params = []
    for algorithm in ALLREDUCE_ALGOS:
        for p in (2, 3, 4):
            for counts in ((4, 5), (0, 5)):
                for seg in (None, 8):
                    params.append(pytest.param(algorithm, p, counts, seg,
                                               id=f"{algorithm}-p{p}-{counts[0]}v{counts[1]}"
                                                  f"-seg{seg}"))
    return params


@pytest.mark.parametrize("algorithm,p,counts,seg", _mismatch_params())
def test_allreduce_mismatched_counts_fail_promptly(algorithm, p, counts, seg):
    # the last rank passes counts[1] elements, the others counts[0]
    outcome, elapsed = timed(
        p, lambda c: c.allreduce(np.ones(counts[c.rank == p - 1]), algorithm=algorithm),
        segment_bytes=seg, local_size=2)
    # a rank may return only if its count is 0 (its neighbours' too): an empty result
    expect_prompt_error(outcome, elapsed, lambda r: np.ones(0) if counts[r == p - 1] == 0
                        else "raise")




def _other_params():
    params = []
    for collective in ("reduce_scatter", "broadcast", "reduce", "alltoall"):
        for p in (2, 3, 4):
            for counts in ((0, 3), (3, 0), (2 * p, 2 * p + 1)):
                if collective == "alltoall":
                    counts = (counts[0] * p, counts[1] * p)  # both multiples of p
                params.append(pytest.param(collective, p, counts,
                                           id=f"{collective}-p{p}-{counts[0]}v{counts[1]}"))
    return params


@pytest.mark.parametrize("collective,p,counts", _other_params())
def test_other_collectives_mismatched_counts_fail_promptly(collective, p, counts):
    def body(c):
        return getattr(c, collective)(np.ones(counts[c.rank == p - 1]))

    def own_result(r):  # what a rank that returns may hold: its correct part, nothing wrong
        n = counts[r == p - 1]
        if collective == "broadcast":
            return np.ones(n)  # the root (and senders that got the root's n) keep their data
        if collective == "reduce":
            return None if r != 0 else "raise"  # non-roots return None; the root receives
        if collective == "reduce_scatter" and n == 0:
            return np.ones(0)
        return "raise"

    expect_prompt_error(*timed(p, body), own_result)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("collective", ["broadcast", "reduce"])
@pytest.mark.parametrize("counts", [(0, 3), (3, 0), (4, 5)])
def test_rooted_mismatch_never_returns_a_wrong_result(collective, counts, p):
    """What does hold for broadcast/reduce: no hang, no timeout, the receivers of a wrong
    size raise, and a rank that returns holds the right answer (root's x; None off-root)."""
    def body(c):
        x = np.full(counts[c.rank == p - 1], 7.0 if c.rank == 0 else -1.0)
        return getattr(c, collective)(x, root=0)

    outcome, elapsed = timed(p, body)
    assert elapsed < FAST
    assert any(isinstance(e, RingcollError) for e in outcome), outcome
    for r, e in enumerate(outcome):
        if isinstance(e, Exception):
            assert isinstance(e, RingcollError) and not isinstance(e, CollectiveTimeoutError)
            assert f"ringcoll rank {r}," in str(e), e
        elif collective == "reduce":
            assert r != 0 and e is None, (r, e)
        else:
            np.testing.assert_array_equal(e, np.full(counts[r == p - 1], 7.0))


# ---------------------------------------------------------------------------------------------
# 5. data safety: a failed out-of-place call leaves x alone on every rank
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seg", [None, 8])
@pytest.mark.parametrize("counts", [(4, 5), (9, 3)])
@pytest.mark.parametrize("algorithm", ALLREDUCE_ALGOS)
def test_failed_out_of_place_allreduce_leaves_x_untouched(algorithm, counts, seg):
    p = 3

    def body(c):
        x = np.random.default_rng(c.rank).standard_normal(counts[c.rank == 2])
        before = x.tobytes()
        try:
            c.allreduce(x, algorithm=algorithm)
        except RingcollError as e:
            return e, x.tobytes() == before
        return None, x.tobytes() == before

    outcome, elapsed = timed(p, body, segment_bytes=seg, local_size=2)
    assert elapsed < FAST
    for r, result in enumerate(outcome):
        assert isinstance(result, tuple), (r, result)
        e, same = result
        assert isinstance(e, RingcollError), f"rank {r}: no error ({e!r})"
        assert same, f"rank {r}: x was modified by a failed out-of-place allreduce"


# ---------------------------------------------------------------------------------------------
# 6. timeouts and failing peers
# ---------------------------------------------------------------------------------------------
SKIPPED = {
    "allreduce": lambda c: c.allreduce(np.ones(10), algorithm="ring"),
    "allreduce_rd": lambda c: c.allreduce(np.ones(10), algorithm="recursive_doubling"),
    "broadcast": lambda c: c.broadcast(np.ones(10), root=1),
    "barrier": lambda c: c.barrier(),
    "reduce_scatter": lambda c: c.reduce_scatter(np.ones(10)),
}


@pytest.mark.parametrize("what", list(SKIPPED))
def test_rank_that_skips_a_collective_times_out_naming_call_and_peer(what):
    call = SKIPPED[what]
    name = what.split("_rd")[0]

    def body(c):
        call(c)
        if c.rank == 0:
            call(c)  # rank 1 skips this second call

    outcome, elapsed = timed(2, body, timeout=0.5)
    assert elapsed < 0.5 + 1, f"took {elapsed:.2f} s"
    assert outcome[1] is None
    e = outcome[0]
    assert isinstance(e, CollectiveTimeoutError), e
    assert names_rank(e, 0, f"{name} #2"), e
    assert "no message from rank 1" in str(e) and "within 0.5 s" in str(e), e


def test_skipped_collective_at_three_ranks():
    def body(c):
        c.allreduce(np.ones(10), algorithm="ring")
        if c.rank != 2:
            c.allreduce(np.ones(10), algorithm="ring")

    outcome, elapsed = timed(3, body, timeout=0.5)
    assert elapsed < 0.5 + 1
    assert outcome[2] is None
    timeouts = [e for e in outcome[:2] if isinstance(e, CollectiveTimeoutError)]
    assert timeouts, outcome
    for r, e in enumerate(outcome[:2]):
        assert isinstance(e, (CollectiveTimeoutError, PeerFailedError)), (r, e)
        assert names_rank(e, r, "allreduce #2 (ring)"), e
        if isinstance(e, CollectiveTimeoutError):  # in the ring, rank r waits for rank r - 1
            assert f"no message from rank {(r - 1) % 3}" in str(e), e
        else:
            assert "CollectiveTimeoutError" in str(e), e


def test_rank_that_raises_in_user_code_releases_the_others_promptly():
    def body(c):
        c.allreduce(np.ones(4))
        if c.rank == 1:
            raise KeyError("user bug 42")
        return c.allreduce(np.ones(4))

    outcome, elapsed = timed(3, body)
    assert elapsed < 1.0, f"took {elapsed:.2f} s: the peers waited for a timeout"
    assert isinstance(outcome[1], KeyError)
    for r in (0, 2):
        e = outcome[r]
        assert isinstance(e, PeerFailedError), (r, e)
        assert names_rank(e, r, "allreduce #2"), e
        assert "rank 1 failed: KeyError: 'user bug 42'" in str(e), e

    with pytest.raises(KeyError) as info:  # run_threads re-raises the genuine error
        ringcoll.run_threads(3, body, timeout=TIMEOUT)
    assert "raised on rank 1 of 3" in "".join(getattr(info.value, "__notes__", []))


# ---------------------------------------------------------------------------------------------
# 7. the context manager
# ---------------------------------------------------------------------------------------------
def test_exception_escaping_with_block_stops_the_others():
    def body(c):
        with c:
            c.barrier()
            if c.rank == 1:
                raise ValueError("broken on one rank")
            return c.allreduce(np.ones(3))

    outcome, elapsed = timed(3, body)
    assert elapsed < 1.0
    assert isinstance(outcome[1], ValueError) and not isinstance(outcome[1], RingcollError)
    for r in (0, 2):
        assert isinstance(outcome[r], PeerFailedError), (r, outcome[r])
        assert "rank 1 failed: ValueError: broken on one rank" in str(outcome[r])


def test_with_block_releases_the_others_even_if_the_exception_is_caught_outside():
    """__exit__ itself fails the world: run_threads never sees rank 1's exception."""
    def body(c):
        try:
            with c:
                if c.rank == 1:
                    raise ValueError("caught later")
                return c.allreduce(np.ones(3))
        except ValueError:
            return "caught"

    outcome, elapsed = timed(3, body)
    assert elapsed < 1.0, f"took {elapsed:.2f} s: the others waited for the timeout"
    assert outcome[1] == "caught"
    for r in (0, 2):
        assert isinstance(outcome[r], PeerFailedError), (r, outcome[r])
        assert "ValueError: caught later" in str(outcome[r])


def test_with_block_closes_the_communicator_even_on_error():
    def body(c):
        try:
            with c:
                if c.rank == 1:
                    raise ValueError("x")
        except ValueError:
            pass
        try:
            c.barrier()
        except RingcollError as e:
            return e
        return None

    outcome, _ = timed(2, body)
    assert isinstance(outcome[1], CommunicatorClosedError), outcome[1]


def test_agreed_error_escaping_with_block_fails_no_other_rank():
    """A debug-mode mismatch is raised on every rank alike: leaving the with-block with it
    must not turn the other ranks' errors into PeerFailedError."""
    def body(c):
        with c:
            c.allreduce(np.ones(4), op="max" if c.rank == 2 else "sum")
        return "unreachable"

    outcome = debug_run(3, body)
    for r, e in enumerate(outcome):
        assert isinstance(e, CollectiveMismatchError), (r, e)
