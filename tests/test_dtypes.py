"""Thread tier: the data-movement collectives (broadcast, gather, allgather, alltoall) with the
dtypes they take beyond numbers (bool, 'S7', 'U3', a padded struct, datetime64, timedelta64,
complex, void), at 1..16 ranks.

Every rank's input is random bytes from a seeded RNG keyed by its rank (tests/_oracle.py
make_bytes), so the test rebuilds every input and checks each rank's result byte for byte
against NumPy (a struct's padding and a NaN's payload included). "native" needs MPI: it is
checked in tests/mpi_checks.py's dtypes group, not here.
"""

import numpy as np
import pytest

import ringcoll
from ringcoll import netsim
from ringcoll.collectives.allgather import META
from ringcoll.transport.simulated import SEND

import _oracle as O
from test_threads import PS, check_all, expect_error_after_exchange, expect_error_on_every_rank, run

DTYPES = O.MOVABLE_DTYPES
ROW_SHAPES = [(), (2, 3)]  # plain elements, and 2-D rows


def _same(label, got, want, failures):
    """got is want: the same dtype, shape and bytes."""
    if want is None:
        if got is not None:
            failures.append(f"{label}: expected None, got {type(got).__name__}")
        return
    if not isinstance(got, np.ndarray):
        failures.append(f"{label}: got {type(got).__name__}, not an array")
    elif (got.dtype, got.shape) != (want.dtype, want.shape):
        failures.append(f"{label}: got {got.dtype} {got.shape}, want {want.dtype} {want.shape}")
    elif _bytes(got) != _bytes(want):
        failures.append(f"{label}: bytes differ")


def _bytes(a):
    """a's bytes in C order, a struct's padding included (a.tobytes() of an F-ordered struct
    array copies it field by field: its padding would come from wherever the copy landed)."""
    return (a if a.dtype.fields is None else a.view(f"V{a.dtype.itemsize}")).tobytes()


def _rows(p, r, k):
    """Rank r's uneven row count in case k (zero rows on some ranks, all ranks for k = 2)."""
    return 0 if k == 2 else (r * 7 + 3 + k) % 4


@pytest.mark.parametrize("p", PS)
def test_every_dtype_moves_bit_for_bit(p):
    # (seed, dtype, row shape, case): case 0 and 1 uneven rows, case 2 zero rows everywhere
    cases = [(1000 * p + 10 * i + k, dtype, row, k)
             for i, (dtype, row) in enumerate((d, s) for d in DTYPES for s in ROW_SHAPES)
             for k in range(3)]
    root = p // 2

    def fn(comm):
        r, got = comm.rank, []
        for seed, dtype, row, k in cases:
            x = O.make_bytes(seed, r, (_rows(p, r, k),) + row, dtype)
            total = sum(_rows(p, q, k) for q in range(p))
            # case 1 gives out=, F-ordered for 2-D rows (staged, then copied into out)
            out = np.empty((total,) + row, dtype, order="F") if k == 1 else None
            got.append(comm.allgather(x, out=out))
            got.append(comm.gather(x, root=root, out=out if r == root else None))
            per = k  # rows per block: 0, 1, 2
            a = O.make_bytes(seed + 1, r, (per * p,) + row, dtype)
            got.append(comm.alltoall(a, out=np.empty_like(a) if k == 1 else None))
            b = (O.make_bytes(seed + 2, root, (k + 1,) + row, dtype) if r == root
                 else np.zeros((k + 1,) + row, dtype))
            got.append((comm.broadcast(b, root=root), b))
        return got

    failures = []
    for r, got in enumerate(run(p, fn)):
        for i, (seed, dtype, row, k) in enumerate(cases):
            label = f"p={p} rank {r} {dtype} row={row} case {k}"
            xs = [O.make_bytes(seed, q, (_rows(p, q, k),) + row, dtype) for q in range(p)]
            gathered = O.concat_bytes(xs, dtype, row)
            _same(f"{label} allgather", got[4 * i], gathered, failures)
            _same(f"{label} gather", got[4 * i + 1], gathered if r == root else None, failures)
            a = [O.make_bytes(seed + 1, q, (k * p,) + row, dtype) for q in range(p)]
            _same(f"{label} alltoall", got[4 * i + 2],
                  O.concat_bytes([aq[r * k:(r + 1) * k] for aq in a], dtype, row), failures)
            y, b = got[4 * i + 3]
            if y is not b:
                failures.append(f"{label} broadcast: did not return x")
            _same(f"{label} broadcast", b,
                  O.make_bytes(seed + 2, root, (k + 1,) + row, dtype), failures)
    check_all(failures)


@pytest.mark.parametrize("p", PS)
def test_scatter_and_alltoallv_move_bit_for_bit(p):
    """The uneven-count data movers take the same dtypes: scatter (a structured dtype needs
    out= on the non-roots, as its dtype cannot be spelled in the header) and alltoallv."""
    cases = [(5000 * p + 10 * i + k, dtype, row, k)
             for i, (dtype, row) in enumerate((d, s) for d in DTYPES for s in ROW_SHAPES)
             for k in range(3)]
    root = (p - 1) // 2

    def fn(comm):
        r, got = comm.rank, []
        for seed, dtype, row, k in cases:
            counts = [_rows(p, q, k) for q in range(p)]
            x = O.make_bytes(seed, root, (sum(counts),) + row, dtype) if r == root else None
            needs_out = k == 1 or dtype.fields is not None
            got.append(comm.scatter(x, root=root, counts=counts,
                                    out=np.empty((counts[r],) + row, dtype) if needs_out
                                    else None))
            send = [(r + j + k) % 3 for j in range(p)]
            a = O.make_bytes(seed + 1, r, (sum(send),) + row, dtype)
            got.append(comm.alltoallv(a, send))
        return got

    failures = []
    for r, got in enumerate(run(p, fn)):
        for i, (seed, dtype, row, k) in enumerate(cases):
            label = f"p={p} rank {r} {dtype} row={row} case {k}"
            counts = [_rows(p, q, k) for q in range(p)]
            x = O.make_bytes(seed, root, (sum(counts),) + row, dtype)
            start = sum(counts[:r])
            _same(f"{label} scatter", got[2 * i], O.concat_bytes(
                [x[start:start + counts[r]]], dtype, row), failures)
            blocks = []
            for q in range(p):
                send = [(q + j + k) % 3 for j in range(p)]
                a = O.make_bytes(seed + 1, q, (sum(send),) + row, dtype)
                blocks.append(a[sum(send[:r]):sum(send[:r]) + send[r]])
            _same(f"{label} alltoallv", got[2 * i + 1], O.concat_bytes(blocks, dtype, row),
                  failures)
    check_all(failures)


@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_every_root_and_debug_mode(p):
    """Every root of gather and broadcast, with debug mode's fingerprints on (they describe a
    struct by its fields: a call that agrees must still pass)."""
    dtype = O.PADDED_STRUCT

    def fn(comm):
        got = []
        for root in range(p):
            x = O.make_bytes(root, comm.rank, (comm.rank + 1, 2), dtype)
            got.append(comm.gather(x, root=root))
            b = O.make_bytes(50 + root, root, (3,), dtype) if comm.rank == root else \
                np.zeros(3, dtype)
            got.append(comm.broadcast(b, root=root))
        return got

    failures = []
    for r, got in enumerate(run(p, fn, debug=True)):
        for root in range(p):
            xs = [O.make_bytes(root, q, (q + 1, 2), dtype) for q in range(p)]
            _same(f"p={p} rank {r} root {root} gather", got[2 * root],
                  O.concat_bytes(xs, dtype, (2,)) if r == root else None, failures)
            _same(f"p={p} rank {r} root {root} broadcast", got[2 * root + 1],
                  O.make_bytes(50 + root, root, (3,), dtype), failures)
    check_all(failures)


@pytest.mark.parametrize("p", [1, 2, 4])
def test_non_contiguous_struct_input_keeps_its_padding(p):
    """A strided x is copied to C order once: as its bytes, so its padding travels too."""
    dtype = O.PADDED_STRUCT
    xs = [O.make_bytes(3, r, (2 * p + 2, 2), dtype) for r in range(p)]

    def fn(comm):
        x = xs[comm.rank][::2]  # every other row: not contiguous
        return comm.allgather(x), comm.gather(x), comm.alltoall(x[:p])

    failures = []
    for r, (allgathered, gathered, swapped) in enumerate(run(p, fn)):
        rows = [O.concat_bytes([x[2 * i:2 * i + 1] for i in range(p + 1)], dtype, (2,))
                for x in xs]
        _same(f"rank {r} allgather", allgathered, O.concat_bytes(rows, dtype, (2,)), failures)
        _same(f"rank {r} gather", gathered,
              O.concat_bytes(rows, dtype, (2,)) if r == 0 else None, failures)
        _same(f"rank {r} alltoall", swapped,
              O.concat_bytes([x[r:r + 1] for x in rows], dtype, (2,)), failures)
    check_all(failures)


# two structs of the same size (12 bytes, so the same dtype.str '|V12'), different fields
STRUCT_A = np.dtype([("a", "<i4"), ("b", "<f8")])
STRUCT_B = np.dtype([("x", "<f8"), ("y", "<i4")])


@pytest.mark.parametrize("collective", ["allgather", "gather"])
@pytest.mark.parametrize("p", [2, 3, 8])
def test_different_structs_of_one_size_raise_on_every_rank(collective, p):
    mine, last = STRUCT_A, STRUCT_B
    assert mine.str == last.str and mine != last

    def fn(comm):
        x = np.zeros(2, last if comm.rank == p - 1 else mine)
        return getattr(comm, collective)(x)

    expect_error_after_exchange(p, fn, ringcoll.CollectiveMismatchError,
                                "different dtype or trailing shape")
    # debug mode's fingerprints see it before any data moves, on every rank
    errors = expect_error_on_every_rank(p, fn, ringcoll.CollectiveMismatchError, "dtype",
                                        debug=True)
    assert all("('x', '<f8')" in str(e) for e in errors), errors[0]


def test_ml_dtypes_of_one_str_are_a_mismatch():
    """ml_dtypes' float8 kinds share dtype.str '<V1' as well: told apart by their names."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a, b = np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2fnuz)
    assert a.str == b.str and a != b

    def fn(comm):
        return comm.allgather(np.zeros(3, b if comm.rank == 2 else a))

    expect_error_after_exchange(3, fn, ringcoll.CollectiveMismatchError, "different dtype")


def test_same_struct_with_other_padding_is_a_mismatch():
    """The same fields, packed on one rank and aligned on the other: their bytes differ."""
    packed = np.dtype([("a", "u1"), ("b", "<f8")])

    def fn(comm):
        return comm.allgather(np.zeros(2, packed if comm.rank else O.PADDED_STRUCT))

    expect_error_after_exchange(2, fn, ringcoll.CollectiveMismatchError, "dtype")


@pytest.mark.parametrize("dtype", [O.PADDED_STRUCT, np.dtype("U3"), np.dtype(bool)])
def test_traced_bytes_and_payloads(dtype):
    """The TracingTransport counts bytes, whatever the dtype: the ring all-gather of n bytes
    sends (p-1)/p n from every rank (plus the META-number row exchange), and each payload is the
    bytes of a block."""
    p, rows = 4, 3
    xs = [O.make_bytes(7, r, (rows, 2), dtype) for r in range(p)]

    def fn(comm):
        return comm.allgather(xs[comm.rank])

    results, trace = ringcoll.simulate(p, fn, payloads=True)
    expected = O.concat_bytes(xs, dtype, (2,))
    failures = []
    for r in range(p):
        _same(f"rank {r}", results[r], expected, failures)
        data = trace.select(src=r, tag="ring_allgather").messages
        meta = [m for m in data if m.nbytes == META * 8]  # the row counts' ring (first call)
        blocks = [m for m in data if m not in meta]
        if sum(m.nbytes for m in blocks) != (p - 1) * rows * 2 * dtype.itemsize:
            failures.append(f"rank {r}: sent {[m.nbytes for m in blocks]} bytes of blocks")
        for m in blocks:
            if m.payload.tobytes() not in expected.tobytes():
                failures.append(f"rank {r}: a payload that is no block of the result")
    check_all(failures)


def test_simulated_transport_logs_bytes():
    """netsim's recording transport (payload mode: the real algorithm over threads) logs a
    structured all-gather in bytes, and the data arrives."""
    p, dtype = 3, O.PADDED_STRUCT
    xs = [O.make_bytes(9, r, (r + 1,), dtype) for r in range(p)]

    def fn(t):
        return ringcoll.Communicator(transport=t).allgather(xs[t.rank])

    transports, results = netsim.record(p, fn, payload=True)
    failures = []
    for r in range(p):
        _same(f"rank {r}", results[r], O.concat_bytes(xs, dtype, ()), failures)
        sent = sum(op[3] for op in transports[r].ops if op[0] == SEND)
        # p-1 ring steps of META int64 row counts, then every block but the last one to arrive
        want = (p - 1) * META * 8 + sum(xs[q].nbytes for q in range(p) if q != (r + 1) % p)
        if sent != want:
            failures.append(f"rank {r}: logged {sent} bytes sent, expected {want}")
    check_all(failures)
