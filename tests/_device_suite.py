"""Every ringcoll collective on one rank, with arrays moved to a "device" and back by the
caller's functions, checked against NumPy oracles: the suite the GPU tests (CuPy) and the
staging-schedule tests (NumPy fake device) share, in-process over threads and under mpiexec.

    failures = run_suite(comm, to_dev, to_host, agree, ...)

to_dev(np_array) makes this rank's input a device array (cupy.asarray, or the identity);
to_host(array) brings a result back as NumPy; agree(label, np_array) records this rank's
result so the caller can check that all ranks hold bitwise identical ones. Every rank calls
run_suite with the same arguments (it is collective); inputs come from tests/_oracle.py, so each
rank computes the expected values itself. A failed check is recorded and the suite goes on
(ringcoll validates before any message, so the ranks stay in step).
"""

import numpy as np

import _oracle as O

ALGORITHMS = ("ring", "recursive_doubling", "rabenseifner", "bruck", "hierarchical", "auto")


def counts_for(p, large=1001):
    return sorted({0, 1, max(p - 1, 0), p + 1, large})


class Suite:
    def __init__(self, comm, to_dev, to_host, agree, dtypes=None):
        self.comm, self.dev, self.host, self.agree = comm, to_dev, to_host, agree
        self.combos = [(d, op) for d, op in O.COMBOS if dtypes is None or d in dtypes]
        self.failures, self.checks = [], 0

    def check(self, ok, label):
        self.checks += 1
        if not ok:
            self.failures.append(f"rank {self.comm.rank}/{self.comm.size}: {label}")
        return ok

    def attempt(self, label, fn):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - recorded, the suite goes on
            self.check(False, f"{label}: raised {type(exc).__name__}: {exc}")
            return None

    def result(self, label, got, expected, op, dtype, same=True):
        """Check got against the oracle; same=True: every rank holds it (bitwise, via agree)."""
        if got is None:
            return self.check(False, f"{label}: no result")
        host = self.host(got)
        bad = O.compare(host, expected, op, dtype, nranks=self.comm.size)
        if same:
            self.agree(label, host)
        return self.check(bad is None, f"{label}: {bad}")

    def combo(self, i):
        return self.combos[i % len(self.combos)]


def run_suite(comm, to_dev, to_host, agree, algorithms=ALGORITHMS, large=1001, dtypes=None,
              roots=None, native=False):
    """Run every collective once per case on this rank; returns (checks, failures)."""
    s = Suite(comm, to_dev, to_host, agree, dtypes)
    p, r = comm.size, comm.rank
    algorithms = tuple(algorithms) + (("native",) if native else ())
    slot = 0
    for algo in algorithms:  # -- allreduce ---------------------------------------------------
        for count in counts_for(p, large):
            for in_place in (False, True):
                dtype, op = s.combo(7 * slot + 3)
                slot += 1
                if algo == "native" and dtype in O.HALF_DTYPES:
                    dtype = np.dtype(np.float32)
                seed = 1000 + slot
                x = to_dev(O.make_input(seed, r, (count,), dtype, op))
                before = to_host(x).copy()
                label = f"allreduce {algo} count={count} {dtype} {op} in_place={in_place}"
                y = s.attempt(label, lambda: comm.allreduce(
                    x, op=op, algorithm=algo, out=x if in_place else None))
                if in_place:
                    s.check(y is x, f"{label}: did not return x")
                else:
                    s.check(np.array_equal(to_host(x).view(np.uint8), before.view(np.uint8)),
                            f"{label}: input modified")
                    s.check(y is None or type(y) is type(x), f"{label}: result {type(y)}")
                expected = O.reduce_oracle([O.make_input(seed, q, (count,), dtype, op)
                                            for q in range(p)], op, dtype)
                s.result(label, y, expected, op, dtype)
    for algo in (None, "native") if native else (None,):  # -- reduce_scatter -----------------
        for rows in sorted({0, 1, p + 1, 2 * p + 3}):
            for trail in ((), (3,)):
                dtype, op = s.combo(5 * slot + 1)
                slot += 1
                if algo == "native" and dtype in O.HALF_DTYPES:
                    dtype = np.dtype(np.float64)
                seed, shape = 2000 + slot, (rows,) + trail
                x = to_dev(O.make_input(seed, r, shape, dtype, op))
                label = f"reduce_scatter {algo} shape={shape} {dtype} {op}"
                y = s.attempt(label, lambda: comm.reduce_scatter(x, op=op, algorithm=algo))
                full = O.reduce_oracle([O.make_input(seed, q, shape, dtype, op)
                                        for q in range(p)], op, dtype)
                s.result(label, y, np.array_split(full, p)[r], op, dtype, same=False)
    for algo in (None, "native") if native else (None,):  # -- allgather ----------------------
        for i, (rows, trail) in enumerate([((r * 7 + 3) % 4, ()), ((r * 5 + 1) % 3, (2, 3)),
                                           (large if r == p // 2 else 2, ())]):
            dtype = _mpi_ok(s.combo(3 * slot + i)[0], algo)
            slot += 1
            x = to_dev(O.make_input(3000 + slot, r, (rows,) + trail, dtype))
            label = f"allgather {algo} case {i} trail={trail} {dtype}"  # rows differ by rank
            y = s.attempt(label, lambda: comm.allgather(x, algorithm=algo))
            every = [O.make_input(3000 + slot, q, (((q * 7 + 3) % 4, ((q * 5 + 1) % 3),
                                                    large if q == p // 2 else 2)[i],) + trail,
                                  dtype) for q in range(p)]
            s.result(label, y, np.concatenate(every), "sum", dtype)
    for algo in (None, "native") if native else (None,):  # -- gather and scatter -------------
        for root in sorted({0, p - 1}):
            counts = [(q * 7 + 3) % 4 if q != p // 2 else large for q in range(p)]
            dtype = _mpi_ok(s.combo(7 * slot + root)[0], algo)
            slot += 1
            every = [O.make_input(3500 + slot, q, (counts[q], 2), dtype) for q in range(p)]
            label = f"gather {algo} root={root} counts={counts} {dtype}"
            y = s.attempt(label, lambda: comm.gather(to_dev(every[r]), root=root,
                                                     algorithm=algo))
            if r == root:
                s.result(label, y, np.concatenate(every), "sum", dtype, same=False)
            else:
                s.check(y is None, f"{label}: non-root got {y!r}")
            whole = to_dev(np.concatenate(every)) if r == root else None
            label = f"scatter {algo} root={root} counts={counts} {dtype}"
            out = to_dev(np.full((counts[r], 2), 7, dtype))
            y = s.attempt(label, lambda: comm.scatter(whole, root=root, counts=counts, out=out,
                                                      algorithm=algo))
            s.check(y is out, f"{label}: did not return out")
            s.result(label, out, every[r], "sum", dtype, same=False)
    for algo in (None, "native") if native else (None,):  # -- broadcast and reduce -----------
        for root in (range(p) if roots is None else roots(p)):
            for shape in [(0,), (1,), (large,), (3, 4)]:
                dtype, op = s.combo(11 * slot + root)
                slot += 1
                if algo == "native" and dtype in O.HALF_DTYPES:
                    dtype = np.dtype(np.float32)
                seed = 4000 + slot
                mine = O.make_input(seed, root, shape, dtype)
                x = to_dev(mine if r == root else np.full(shape, 7, dtype))
                label = f"broadcast {algo} root={root} shape={shape} {dtype}"
                y = s.attempt(label, lambda: comm.broadcast(x, root=root, algorithm=algo))
                s.check(y is x, f"{label}: did not return x")
                s.result(label, x, mine, "sum", dtype)
                x = to_dev(O.make_input(seed, r, shape, dtype, op))
                label = f"reduce {algo} root={root} shape={shape} {dtype} {op}"
                y = s.attempt(label, lambda: comm.reduce(x, op=op, root=root, algorithm=algo))
                if r == root:
                    s.result(label, y, O.reduce_oracle([O.make_input(seed, q, shape, dtype, op)
                                                        for q in range(p)], op, dtype), op, dtype,
                             same=False)
                else:
                    s.check(y is None, f"{label}: non-root got {y!r}")
    for algo in (None, "native") if native else (None,):  # -- alltoall -----------------------
        for rows in (p, 3 * p):
            dtype = _mpi_ok(s.combo(13 * slot)[0], algo)
            slot += 1
            x = to_dev(O.make_input(5000 + slot, r, (rows, 2), dtype))
            label = f"alltoall {algo} rows={rows} {dtype}"
            y = s.attempt(label, lambda: comm.alltoall(x, algorithm=algo))
            b = rows // p
            expected = np.concatenate([O.make_input(5000 + slot, q, (rows, 2), dtype)
                                       [r * b:(r + 1) * b] for q in range(p)])
            s.result(label, y, expected, "sum", dtype, same=False)
    for algo in ("ring", "recursive_doubling"):  # -- iallreduce, two in flight --------------
        dtype, op = s.combo(17 * slot)
        slot += 1
        xs = [to_dev(O.make_input(6000 + slot + k, r, (large,), dtype, op)) for k in range(2)]
        label = f"iallreduce {algo} {dtype} {op}"
        reqs = [s.attempt(label, lambda x=x: comm.iallreduce(x, op=op, algorithm=algo))
                for x in xs]
        for k, req in enumerate(reqs):
            y = s.attempt(label, req.wait) if req is not None else None
            expected = O.reduce_oracle([O.make_input(6000 + slot + k, q, (large,), dtype, op)
                                        for q in range(p)], op, dtype)
            s.result(f"{label} #{k}", y, expected, op, dtype)
    return s.checks, s.failures


def _mpi_ok(dtype, algo):
    """MPI's own collectives (algorithm 'native') cannot take float16/bfloat16 buffers."""
    return np.dtype(np.float32) if algo == "native" and dtype in O.HALF_DTYPES else dtype


def cupy_bfloat16_ok(cupy):
    """Can this CuPy hold ml_dtypes' bfloat16 arrays (experimental in CuPy 14)? Where it
    cannot, the GPU tests leave bfloat16 out and say so."""
    if O.BFLOAT16 is None:
        return False
    try:
        x = cupy.asarray(np.arange(3, dtype=O.BFLOAT16))
        return np.array_equal(cupy.asnumpy(x).astype(np.float32), [0, 1, 2])
    except Exception:  # noqa: BLE001 - any refusal means: not supported here
        return False
