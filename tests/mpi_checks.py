"""MPI tier worker: mpiexec -n 4 python tests/mpi_checks.py [--light] [--report FILE]

Runs ringcoll's collectives under real MPI (every algorithm, native included; hierarchical on
several "nodes" via local_size=2 and RINGCOLL_LOCAL_SIZE=3) and checks them on every rank against
oracles that do not use ringcoll: MPI's own collectives (MPI.COMM_WORLD.Allreduce, ...), and NumPy
on the inputs (each rank can rebuild every rank's input from its seed, tests/_oracle.py, or gathers
them with mpi4py's pickle-based lower-case collectives). Every result is also checked to be bitwise
identical on all ranks.

Exit status: 0 only if every check passed on every rank. A failed check is recorded and the run
goes on (the ranks stay in step); at the end the failure count is summed over MPI.COMM_WORLD and
every rank exits 1 if it is non-zero. An unexpected exception on one rank calls
MPI.COMM_WORLD.Abort(1), and a rank that reaches the end of a group of checks waits at most
--sync-timeout seconds for the others (a rank stuck in a collective) before aborting, so a failure
can never become a hang.

Options: --light (fewer sizes and roots: for 8 ranks on a small machine), --report FILE (rank 0
writes {group: {"checks": n, "failures": [...]}} as JSON), --only GROUP[,GROUP] (run some groups),
--inject check|raise|stuck (make rank 1 fail on purpose: tests/test_mpi.py proves that failures
propagate to mpiexec's exit status).
"""

import argparse
import hashlib
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
import traceback

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _oracle as O  # noqa: E402

import ringcoll  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK, P = WORLD.Get_rank(), WORLD.Get_size()
NATIVE_OK = [d for d in O.ALL_DTYPES if d not in O.HALF_DTYPES]  # MPI has no half types

GROUPS = ["allreduce", "allreduce_floats", "reduce_scatter", "allgather", "gather", "scatter",
          "broadcast", "reduce", "alltoall", "barrier", "iallreduce", "split", "layouts",
          "fortran_out", "errors", "compat", "compat_buffers", "compat_collectives", "trace",
          "alltoallv", "scan", "dtypes", "compat_repeat", "declared",
          "allgather_in_place"]


class Checker:
    def __init__(self):
        self.group = None
        self.checks = {}
        self.failures = {}

    def start(self, group):
        self.group = group
        self.checks.setdefault(group, 0)
        self.failures.setdefault(group, [])

    def check(self, ok, msg):
        self.checks[self.group] += 1
        if not ok:
            self.failures[self.group].append(f"rank {RANK}/{P} [{self.group}] {msg}")
        return bool(ok)

    def attempt(self, label, fn):
        """Run one call that should succeed; an exception is a failed check (then the run goes
        on: ringcoll validates arguments before any message, so a rejected call leaves every
        rank in step; if not, the end-of-group sync aborts)."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - recorded as a failure
            self.check(False, f"{label}: raised {type(exc).__name__}: {exc}")
            return None

    def raises(self, label, exc_types, fn, match=None):
        try:
            fn()
        except exc_types as exc:
            self.check(f"ringcoll rank {RANK}," in str(exc) or "ringcoll.wrap" in str(exc),
                       f"{label}: message does not name this rank: {exc}")
            self.check(match is None or match in str(exc), f"{label}: {match!r} not in {exc}")
            return exc
        except Exception as exc:  # noqa: BLE001
            self.check(False, f"{label}: raised {type(exc).__name__} ({exc}), expected {exc_types}")
            return exc
        self.check(False, f"{label}: no exception, expected {exc_types}")
        return None

    def result(self, label, got, expected, op, dtype):
        bad = O.compare(got, expected, op, dtype, nranks=P) if got is not None else "no result"
        return self.check(bad is None, f"{label}: {bad}")

    def identical(self, label, y):
        """Bitwise identity of y across all ranks (MPI's own allgather of a digest)."""
        y = np.asarray(y)
        digest = (y.dtype.str, y.shape, hashlib.sha1(y.tobytes()).hexdigest())
        every = WORLD.allgather(digest)
        bad = [r for r, d in enumerate(every) if d != every[0]]
        return self.check(not bad, f"{label}: ranks {bad} differ bitwise from rank 0")


CK = Checker()


def sync(group, timeout):
    """Wait (at most timeout s) until every rank has finished `group`; abort if one is stuck."""
    req = WORLD.Ibarrier()
    deadline = time.time() + timeout
    while not req.Test():
        if time.time() > deadline:
            print(f"rank {RANK}: other ranks did not finish group {group!r} within {timeout} s "
                  "(a rank is stuck in a collective, or raised where the others did not); "
                  f"failures so far: {CK.failures.get(group)}; aborting", file=sys.stderr,
                  flush=True)
            WORLD.Abort(1)
        time.sleep(0.0005)


def mpi_reference(x, op):
    """MPI_Allreduce of x, in x's dtype (float32 for the half types, float64 for avg)."""
    dtype = x.dtype
    if op == "avg":
        wide = np.complex128 if dtype.kind == "c" else np.float64
        src = x.astype(wide)
        ref = np.empty_like(src)
        WORLD.Allreduce(src, ref, op=MPI.SUM)
        return (ref / P).astype(dtype)
    src = x.astype(np.float32) if dtype in O.HALF_DTYPES else x.copy()
    ref = np.empty_like(src)
    mpi_op = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}[op]
    WORLD.Allreduce(src, ref, op=mpi_op)
    return ref.astype(dtype)


# ---------------------------------------------------------------------------------------------
def make_comms():
    comms = {"world": ringcoll.Communicator(),
             "ls2_seg64": ringcoll.Communicator(local_size=2, segment_bytes=64),
             # every blocking wait tested with sleeps in between (PollingMPITransport)
             "polling": ringcoll.Communicator(segment_bytes=256, poll=50e-6)}
    os.environ["RINGCOLL_LOCAL_SIZE"] = "3"
    try:
        comms["env_ls3"] = ringcoll.Communicator()
    finally:
        del os.environ["RINGCOLL_LOCAL_SIZE"]
    CK.start("allreduce")
    for name, k in (("ls2_seg64", 2), ("env_ls3", 3)):
        expected = [list(range(i, min(i + k, P))) for i in range(0, P, k)]
        CK.check(comms[name].nodes == expected, f"{name}: nodes {comms[name].nodes} != {expected}")
        node = next(m for m in expected if RANK in m)
        CK.check(comms[name].local_rank == node.index(RANK)
                 and comms[name].local_size == len(node), f"{name}: local rank/size")
    # one machine: MPI's shared-memory split puts every rank on one node
    CK.check(comms["world"].nodes == [list(range(P))], f"world nodes {comms['world'].nodes}")
    CK.check((comms["world"].rank, comms["world"].size) == (RANK, P), "rank/size")
    return comms


def check_allreduce(comms, light):
    counts = sorted({0, P + 1, 10007} if light else {0, 1, max(P - 1, 0), P, P + 1, 10007})
    slot = 0
    mpi_wrong = []  # integer cases where MPI's own Allreduce differs from the exact result
    for cname, comm in comms.items():
        for algo in ringcoll.ALLREDUCE_NAMES:
            for count in counts:
                for in_place in (False, True):
                    dtype, op = O.COMBOS[(7 * slot + 3 * P) % len(O.COMBOS)]
                    slot += 1
                    if algo == "native" and dtype in O.HALF_DTYPES:
                        dtype = np.dtype(np.float32)
                    seed = 10_000 + slot
                    x = O.make_input(seed, RANK, (count,), dtype, op)
                    before = x.copy()
                    label = f"{cname} {algo} count={count} {dtype} {op} in_place={in_place}"
                    if in_place:
                        y = CK.attempt(label, lambda: comm.allreduce(x, op=op, algorithm=algo,
                                                                     out=x))
                        CK.check(y is x, f"{label}: did not return x")
                    else:
                        y = CK.attempt(label, lambda: comm.allreduce(x, op=op, algorithm=algo))
                        CK.check(x.tobytes() == before.tobytes(), f"{label}: input modified")
                    expected = O.reduce_oracle([O.make_input(seed, r, (count,), dtype, op)
                                                for r in range(P)], op, dtype)
                    ref = mpi_reference(before, op)
                    if dtype.kind in "iu" and ref.tobytes() != expected.tobytes():
                        # integers are exact: MPI itself is wrong here (Open MPI 5.0.11
                        # saturates 8- and 16-bit sums); its own native must match it still
                        mpi_wrong.append(label)
                        if algo == "native":
                            expected = ref
                    else:
                        CK.result(label + " vs MPI_Allreduce", y, ref, op, dtype)
                    CK.result(label + " vs NumPy", y, expected, op, dtype)
                    CK.identical(label, y if y is not None else np.zeros(0))
    if mpi_wrong:
        print(f"mpi_checks rank {RANK}: MPI's own Allreduce differed from the exact integer "
              f"results in {len(mpi_wrong)} case(s), e.g. {mpi_wrong[0]}; ringcoll checked "
              "against NumPy there, its 'native' against MPI", flush=True)


def check_allreduce_floats(comms, light):
    """Random (non-exact) floats: bitwise identical everywhere, close to MPI's float64 sum."""
    n = 3001 if light else 20011
    dtypes = [np.float16, np.float32, np.float64, np.complex64] + (
        [O.BFLOAT16] if O.BFLOAT16 is not None else [])
    for cname, comm in comms.items():
        for algo in ringcoll.ALLREDUCE_NAMES:
            for i, dt in enumerate(dtypes):
                dt = np.dtype(dt)
                if algo == "native" and dt in O.HALF_DTYPES:
                    continue
                seed = 20_000 + i
                x = O.random_floats(seed, RANK, (n,), dt)
                label = f"{cname} {algo} random {dt}"
                y = CK.attempt(label, lambda: comm.allreduce(x, algorithm=algo))
                if y is None:
                    continue
                CK.identical(label, y)
                exact = np.empty(n, O.wide(dt))
                WORLD.Allreduce(O._cmp_view(x).astype(O.wide(dt)), exact, op=MPI.SUM)
                inputs = [O.random_floats(seed, r, (n,), dt) for r in range(P)]
                err = np.abs(O._cmp_view(y).astype(O.wide(dt)) - exact)
                CK.check(np.all(err <= O.float_tolerance(inputs, dt)),
                         f"{label}: max error {err.max()} over the rounding bound")


def check_reduce_scatter(comms, light):
    rows_list = sorted({0, P + 1, 2 * P + 3} if light else {0, 1, max(P - 1, 0), P, P + 1,
                                                           2 * P + 3})
    slot = 0
    for cname in ("world", "ls2_seg64"):
        comm = comms[cname]
        for algo in (None, "node", "native"):
            for rows in rows_list:
                for trail in ((), (3,)):
                    dtype, op = O.COMBOS[(5 * slot + P) % len(O.COMBOS)]
                    slot += 1
                    if algo == "native" and dtype in O.HALF_DTYPES:
                        dtype = np.dtype(np.float64)
                    seed, shape = 30_000 + slot, (rows,) + trail
                    x = O.make_input(seed, RANK, shape, dtype, op)
                    label = f"{cname} {algo} shape={shape} {dtype} {op}"
                    y = CK.attempt(label, lambda: comm.reduce_scatter(x, op=op, algorithm=algo))
                    full = O.reduce_oracle([O.make_input(seed, r, shape, dtype, op)
                                            for r in range(P)], op, dtype)
                    CK.result(label, y, np.array_split(full, P)[RANK], op, dtype)
    # and MPI's own MPI_Reduce_scatter as the oracle
    x = O.make_input(31_000, RANK, (2 * P + 1, 2), np.float64)
    counts = [len(b) * 2 for b in np.array_split(np.empty(2 * P + 1), P)]
    ref = np.empty(counts[RANK])
    WORLD.Reduce_scatter(x, ref, counts, op=MPI.SUM)
    y = CK.attempt("vs MPI_Reduce_scatter", lambda: comms["world"].reduce_scatter(x))
    CK.check(y is not None and np.array_equal(y.reshape(-1), ref), "vs MPI_Reduce_scatter")


def check_allgather(comms, light):
    for cname in ("world", "ls2_seg64"):
        comm = comms[cname]
        for algo in (None, "node", "native"):
            cases = [((RANK * 7 + 3) % 4, (), np.dtype(np.int32)),
                     ((RANK * 5 + 1) % 3, (2, 3), np.dtype(np.complex64)),
                     (1001 if RANK == P // 2 else 2, (), np.dtype(np.float64)),
                     (0, (2,), np.dtype(np.uint8))]
            if algo is None and O.BFLOAT16 is not None:
                cases.append((RANK % 2 + 1, (3,), O.BFLOAT16))
            for i, (rows, trail, dtype) in enumerate(cases):
                x = O.make_input(40_000 + i, RANK, (rows,) + trail, dtype)
                label = f"{cname} {algo} rows={rows} trail={trail} {dtype}"
                y = CK.attempt(label, lambda: comm.allgather(x, algorithm=algo))
                expected = np.concatenate(WORLD.allgather(x))  # NumPy on the gathered inputs
                CK.check(y is not None and y.shape == expected.shape and y.dtype == dtype
                         and y.tobytes() == expected.tobytes(), f"{label}: wrong result")
    y = CK.attempt("0-d", lambda: comms["world"].allgather(np.float32(RANK)))
    CK.check(y is not None and y.tolist() == list(range(P)), f"0-d allgather: {y}")


#: gather's and scatter's algorithms, each checked (None: auto, which picks MPI's call or the
#: tree by the tuning table)
GATHER_ALGORITHMS = (None, "tree", "native")


def check_gather(comms, light):
    roots = sorted({0, P - 1, P // 2}) if light else range(P)
    for cname in ("world", "ls2_seg64"):
        comm = comms[cname]
        for root in roots:
            cases = [((RANK * 7 + 3) % 4, (), np.dtype(np.int32)),
                     ((RANK * 5 + 1) % 3, (2, 3), np.dtype(np.complex64)),
                     (1001 if RANK == P // 2 else 2, (), np.dtype(np.float64)),
                     (0, (2,), np.dtype(np.uint8)),
                     (3000 + 500 * RANK, (), np.dtype(np.float64))]  # too big to ride along
            for (i, (rows, trail, dtype)), alg in itertools.product(enumerate(cases),
                                                                    GATHER_ALGORITHMS):
                x = O.make_input(45_000 + i, RANK, (rows,) + trail, dtype)
                label = f"{cname} root={root} rows={rows} trail={trail} {dtype} {alg}"
                y = CK.attempt(label, lambda: comm.gather(x, root=root, algorithm=alg))
                parts = WORLD.gather(x, root=root)  # mpi4py's own gather of the same arrays
                if RANK == root:
                    expected = np.concatenate(parts)
                    CK.check(y is not None and y.shape == expected.shape and y.dtype == dtype
                             and y.tobytes() == expected.tobytes(), f"{label}: wrong result")
                else:
                    CK.check(y is None, f"{label}: a non-root got {y!r}, not None")
    # root's x inside its out: its own block (MPI_IN_PLACE for MPI's call) or elsewhere
    comm = comms["world"]
    for root, alg, where, rows in itertools.product(roots, GATHER_ALGORITHMS, ("own", "else"),
                                                    (2, 3000)):
        counts = [rows + r for r in range(P)]
        lo, mine = sum(counts[:RANK]), counts[RANK]
        out = np.zeros(sum(counts)) if RANK == root else None
        for k in range(2):
            x = O.make_input(45_500 + k, RANK, (mine,), np.float64)
            whole = np.concatenate(WORLD.allgather(x))
            if RANK == root:
                at = lo if where == "own" or P == 1 else (0 if lo else sum(counts) - mine)
                out[at:at + mine] = x
                x = out[at:at + mine]
            label = f"gather root={root} x in out ({where}) rows={counts} {alg} call {k}"
            y = CK.attempt(label, lambda: comm.gather(x, root=root, out=out, algorithm=alg))
            CK.check(y is None if RANK != root else (y is out and np.array_equal(y, whole)),
                     f"{label}: wrong result")
    y = CK.attempt("0-d", lambda: comms["world"].gather(np.float32(RANK), root=P - 1))
    CK.check((y is None) if RANK != P - 1 else (y is not None and y.tolist() == list(range(P))),
             f"0-d gather: {y}")


def check_scatter(comms, light):
    """comm.scatter against mpi4py's own Scatterv of the same bytes, on every rank, by every
    algorithm: every root, array_split's sizes and uneven counts with zeros, out= given or
    not, root in place."""
    roots = sorted({0, P - 1, P // 2}) if light else range(P)
    uneven = [(r * 7 + 3) % 4 for r in range(P)]
    big = [1001 if r == P // 2 else 0 for r in range(P)]
    wide = [3000 + 500 * r for r in range(P)]
    cases = [(None, 2 * P + 1, (), np.dtype(np.int32), "none"),
             (uneven, sum(uneven), (2, 3), np.dtype(np.complex64), "out"),
             (big, 1001, (), np.dtype(np.float64), "in place"),
             ([0] * P, 0, (2,), np.dtype(np.uint8), "out"),
             (None, P - 1, (3,), O.HALF_DTYPES[-1], "odd ranks' out"),
             (uneven, sum(uneven), (), np.dtype(np.int64), "in place, out"),
             (wide, sum(wide), (), np.dtype(np.float64), "in place, out")]  # past the header
    for cname in ("world", "ls2_seg64"):
        comm = comms[cname]
        for root in roots:
            for (i, (counts, nrows, trail, dtype, who)), alg in itertools.product(
                    enumerate(cases), GATHER_ALGORITHMS):
                rows = counts or [len(b) for b in np.array_split(np.empty(nrows), P)]
                mine = (rows[RANK],) + trail
                x = before = None
                if RANK == root:
                    x = O.make_input(46_000 + i, root, (nrows,) + trail, dtype)
                    before = x.tobytes()
                lo = sum(rows[:RANK])
                if RANK == root and who.startswith("in place"):
                    out = x[lo:lo + rows[RANK]]  # MPI's IN_PLACE, as our adapter spells it
                elif who.endswith("out") and (who != "odd ranks' out" or RANK % 2):
                    out = np.full(mine, 7, dtype)
                else:
                    out = None
                label = (f"{cname} root={root} counts={counts} trail={trail} {dtype} {who} "
                         f"{alg}")
                y = CK.attempt(label, lambda: comm.scatter(x, root=root, counts=counts, out=out,
                                                           algorithm=alg))
                ref = np.empty(mine, dtype)  # mpi4py's own Scatterv, of the bytes
                item = int(np.prod(trail, dtype=np.int64)) * dtype.itemsize
                send = None
                if RANK == root:
                    send = [x.reshape(-1).view(np.uint8), [c * item for c in rows],
                            [sum(rows[:q]) * item for q in range(P)], MPI.BYTE]
                WORLD.Scatterv(send, [ref.reshape(-1).view(np.uint8), MPI.BYTE], root=root)
                CK.check(y is not None and y.shape == mine and y.dtype == dtype
                         and y.tobytes() == ref.tobytes(), f"{label}: wrong result")
                CK.check(out is None or y is out, f"{label}: out not returned")
                CK.check(x is None or x.tobytes() == before, f"{label}: x changed on root")
    # mismatches raise on every rank alike (none aborts, none hangs), then the ranks go on
    comm = comms["world"]
    x = np.arange(2.0 * P) if RANK == 0 else None
    exc = (ringcoll.InvalidArgumentError if RANK == 0 else ringcoll.PeerFailedError)
    CK.raises("bad counts", exc, lambda: comm.scatter(x, counts=[3] * P if RANK == 0 else None),
              "invalid counts" if RANK else "adds up to")
    if P > 1:
        bad = P - 1
        exc = ringcoll.CollectiveMismatchError if RANK == bad else ringcoll.PeerFailedError
        CK.raises("out dtype", exc, lambda: comm.scatter(
            x, out=np.empty(2, np.float32) if RANK == bad else None), f"rank(s) [{bad}]"
            if RANK != bad else "root 0 scatters float64 rows")
    y = CK.attempt("after the errors", lambda: comm.scatter(x))
    CK.check(y is not None and y.tolist() == [2.0 * RANK, 2.0 * RANK + 1], f"after: {y}")


def check_broadcast(comms, light):
    roots = sorted({0, P - 1, P // 2}) if light else range(P)
    comm = comms["world"]
    for algo in (None, "node", "native"):
        for root in roots:
            for i, shape in enumerate([(0,), (1,), (10007,), (3, 4), ()]):
                dtype = NATIVE_OK[(root + 3 * i) % len(NATIVE_OK)]
                seed = 50_000 + 100 * root + i
                if RANK == root:
                    x = O.make_input(seed, root, shape, dtype)
                else:
                    x = np.full(shape, 7, dtype)
                label = f"{algo} root={root} shape={shape} {dtype}"
                y = CK.attempt(label, lambda: comm.broadcast(x, root=root, algorithm=algo))
                CK.check(y is x, f"{label}: did not return x")
                expected = O.make_input(seed, root, shape, dtype)
                CK.check(x.tobytes() == expected.tobytes(), f"{label}: wrong data")


def check_reduce(comms, light):
    roots = sorted({0, P - 1}) if light else range(P)
    comm = comms["world"]
    slot = 0
    for algo in (None, "native"):
        for root in roots:
            for i, shape in enumerate([(7,), (0,), (), (4, 3), (10007,)]):
                dtype, op = O.COMBOS[(3 * slot + P) % len(O.COMBOS)]
                slot += 1
                if algo == "native" and dtype in O.HALF_DTYPES:
                    dtype = np.dtype(np.float32)
                seed = 60_000 + slot
                x = O.make_input(seed, RANK, shape, dtype, op)
                before = x.copy()
                label = f"{algo} root={root} shape={shape} {dtype} {op}"
                in_place = RANK == root and slot % 2 == 0
                y = CK.attempt(label, lambda: comm.reduce(x, op=op, root=root, algorithm=algo,
                                                          out=x if in_place else None))
                if RANK == root:
                    expected = O.reduce_oracle([O.make_input(seed, r, shape, dtype, op)
                                                for r in range(P)], op, dtype)
                    CK.result(label, y, expected, op, dtype)
                    CK.check(not in_place or y is x, f"{label}: in place did not return x")
                else:
                    CK.check(y is None, f"{label}: non-root got {y!r}")
                    CK.check(x.tobytes() == before.tobytes(), f"{label}: non-root input modified")
    # MPI_Reduce as the oracle
    x = O.make_input(61_000, RANK, (33,), np.int64)
    ref = np.empty_like(x) if RANK == P - 1 else None
    WORLD.Reduce(x, ref, op=MPI.SUM, root=P - 1)
    y = CK.attempt("vs MPI_Reduce", lambda: comm.reduce(x, root=P - 1))
    CK.check(RANK != P - 1 or (y is not None and np.array_equal(y, ref)), "vs MPI_Reduce")


def check_alltoall(comms, light):
    for cname in ("world", "ls2_seg64"):
        comm = comms[cname]
        for algo in (None, "native"):
            for i, (per, trail) in enumerate([(1, ()), (3, (2,)), (0, (4,)), (2, (2, 2))]):
                dtype = NATIVE_OK[(i + P) % len(NATIVE_OK)]
                x = O.make_input(70_000 + i, RANK, (per * P,) + trail, dtype)
                label = f"{cname} {algo} per={per} trail={trail} {dtype}"
                y = CK.attempt(label, lambda: comm.alltoall(x, algorithm=algo))
                blocks = WORLD.alltoall([x[j * per:(j + 1) * per] for j in range(P)])
                expected = np.concatenate(blocks)
                CK.check(y is not None and y.shape == expected.shape
                         and y.tobytes() == expected.tobytes(), f"{label}: wrong blocks")


def check_alltoallv(comms, light):
    """alltoallv against mpi4py's own Alltoallv; reduce_scatter(counts=) against the exact
    reduction of the gathered inputs (native: against MPI_Reduce_scatter with recvcounts,
    which it is), on WORLD: uneven and zero counts, several dtypes."""
    rng = np.random.default_rng([P, 0xA11])
    sends = [rng.integers(0, 4, (P, P)), np.zeros((P, P), int),
             np.array([[5 * (j == 0) for j in range(P)] for _ in range(P)])]  # all to rank 0
    for cname in ("world", "ls2_seg64"):
        comm = comms[cname]
        for algo in (None, "native"):
            for i, C in enumerate(sends):
                for trail, dtype in (((), NATIVE_OK[(i + P) % len(NATIVE_OK)]),
                                     ((2, 3), NATIVE_OK[(3 * i + P + 5) % len(NATIVE_OK)]),
                                     ((), O.BFLOAT16 or np.dtype(np.float16))):
                    counts, got = [int(c) for c in C[RANK]], [int(c) for c in C[:, RANK]]
                    x = O.make_input(75_000 + i, RANK, (sum(counts),) + trail, dtype)
                    label = f"{cname} {algo} case {i} trail={trail} {dtype}"
                    y = CK.attempt(label, lambda: comm.alltoallv(
                        x, counts, algorithm=algo, recv_counts=got if i % 2 else None))
                    row = int(np.prod(trail, dtype=np.int64))
                    ref = np.empty((sum(got),) + trail, dtype)
                    # mpi4py's own, as bytes (MPI has no datatype for the half types)
                    WORLD.Alltoallv([x.view(np.uint8), [c * row * dtype.itemsize
                                                        for c in counts], MPI.BYTE],
                                    [ref.view(np.uint8), [c * row * dtype.itemsize
                                                          for c in got], MPI.BYTE])
                    CK.check(y is not None and y.shape == ref.shape and y.dtype == dtype
                             and y.tobytes() == ref.tobytes(), f"{label}: wrong blocks")
    # a wrong recv_counts on rank 0 raises on every rank, and the next call still works
    comm = comms["world"]
    if P > 1:
        bad = [1] * P if RANK == 0 else None
        CK.raises("recv_counts mismatch", (ringcoll.CollectiveMismatchError,
                                           ringcoll.PeerFailedError),
                  lambda: comm.alltoallv(np.ones(2 * P), [2] * P, recv_counts=bad),
                  "recv_counts")
    y = CK.attempt("after the mismatch", lambda: comm.alltoallv(np.full(P, RANK), [1] * P))
    CK.check(y is not None and y.tolist() == list(range(P)), f"after the mismatch: {y}")
    # reduce_scatter with counts, against MPI_Reduce_scatter's recvcounts
    slot = 0
    for algo in (None, "native"):
        for total, trail in ((3 * P + 1, ()), (2 * P, (3,)), (0, ())):
            for k in range(2):
                dtype, op = O.COMBOS[(7 * slot + P) % len(O.COMBOS)]
                slot += 1
                if op == "avg" or dtype in O.HALF_DTYPES:  # MPI has neither
                    dtype, op = NATIVE_OK[slot % len(NATIVE_OK)], "sum"
                cuts = np.sort(np.random.default_rng([P, slot]).integers(0, total + 1, P - 1))
                counts = np.diff(np.concatenate([[0], cuts, [total]])).tolist()
                if k:  # everything to the last rank
                    counts = [0] * (P - 1) + [total]
                x = O.make_input(76_000 + slot, RANK, (total,) + trail, dtype, op)
                label = f"reduce_scatter {algo} counts={counts} trail={trail} {dtype} {op}"
                y = CK.attempt(label, lambda: comm.reduce_scatter(x, op=op, algorithm=algo,
                                                                  counts=counts))
                row = int(np.prod(trail, dtype=np.int64))
                if algo == "native":  # MPI's own answer, whatever it is (see below)
                    ref = np.empty((counts[RANK],) + trail, dtype)
                    mpi_op = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX,
                              "min": MPI.MIN}[op]
                    WORLD.Reduce_scatter(x, ref, [c * row for c in counts], op=mpi_op)
                else:  # the exact reduction: Open MPI 5.0.11's MPI_Reduce_scatter is wrong
                    # for some (uint16 sums that wrap at 5 ranks, int8 sums that all go to one
                    # rank at 4 and 5), so MPI's answer is no oracle for ringcoll's own
                    lo = sum(counts[:RANK])
                    ref = O.reduce_oracle(WORLD.allgather(x), op, dtype)[lo:lo + counts[RANK]]
                CK.result(label, y, ref, op, dtype)
                if dtype.kind in "iu":
                    CK.check(y is not None and y.tobytes() == ref.tobytes(),
                             f"{label}: integers not exact")


def _raw_bytes(a):
    """a's bytes in C order, a struct's padding included (see tests/test_dtypes.py)."""
    return (a if a.dtype.fields is None else a.view(f"V{a.dtype.itemsize}")).tobytes()


def check_dtypes(comms, light):
    """broadcast, gather, allgather, alltoall with the non-numeric dtypes (and complex), ringcoll's
    algorithm and native, on random bytes: every rank rebuilds every input from its seed and
    checks its result byte for byte against NumPy (tests/_oracle.py make_bytes)."""
    dtypes = O.MOVABLE_DTYPES + ([O.BFLOAT16] if O.BFLOAT16 is not None else [])
    rows_shapes = [()] if light else [(), (2, 3)]
    roots = sorted({0, P - 1})

    def same(label, y, want):
        CK.check(y is not None and (y.dtype, y.shape) == (want.dtype, want.shape)
                 and _raw_bytes(y) == _raw_bytes(want), f"{label}: wrong result")

    for cname in ("world",) if light else ("world", "ls2_seg64"):
        comm = comms[cname]
        for algo in (None, "native"):
            for i, (dtype, row) in enumerate((d, s) for d in dtypes for s in rows_shapes):
                for k in range(2):  # k = 0: uneven rows; k = 1: zero rows on every rank
                    seed = 80_000 + 10 * i + k
                    label = f"{cname} {algo} {dtype} row={row} case {k}"
                    counts = [0 if k else (q * 7 + 3) % 4 for q in range(P)]
                    xs = [O.make_bytes(seed, q, (counts[q],) + row, dtype) for q in range(P)]
                    y = CK.attempt(label, lambda: comm.allgather(xs[RANK], algorithm=algo))
                    same(f"{label} allgather", y, O.concat_bytes(xs, dtype, row))
                    if y is not None:
                        CK.identical(f"{label} allgather", y)
                    per = 1 - k + 1  # rows per block: 2, then 1
                    a = [O.make_bytes(seed + 1, q, (per * P,) + row, dtype) for q in range(P)]
                    y = CK.attempt(label, lambda: comm.alltoall(a[RANK], algorithm=algo))
                    same(f"{label} alltoall", y, O.concat_bytes(
                        [aq[RANK * per:(RANK + 1) * per] for aq in a], dtype, row))
                    for root in roots:
                        want = O.make_bytes(seed + 2 + root, root, (k + 2,) + row, dtype)
                        # a fresh input, not want.copy(): NumPy copies a struct field by
                        # field, and the padding bytes the copy leaves would not be want's
                        b = (O.make_bytes(seed + 2 + root, root, want.shape, dtype)
                             if RANK == root else np.zeros_like(want))
                        y = CK.attempt(label, lambda: comm.broadcast(b, root=root,
                                                                     algorithm=algo))
                        CK.check(y is b, f"{label} broadcast root={root}: did not return x")
                        same(f"{label} broadcast root={root}", b, want)
                        if algo is None:  # gather has ringcoll's tree only
                            y = CK.attempt(label, lambda: comm.gather(xs[RANK], root=root))
                            if RANK == root:
                                same(f"{label} gather root={root}", y,
                                     O.concat_bytes(xs, dtype, row))
                            else:
                                CK.check(y is None, f"{label} gather: a non-root got {y!r}")
                            # scatter (a struct needs out= off the root) and alltoallv
                            whole = O.concat_bytes(xs, dtype, row)
                            y = CK.attempt(label, lambda: comm.scatter(
                                whole if RANK == root else None, root=root, counts=counts,
                                out=np.empty((counts[RANK],) + row, dtype)
                                if dtype.fields is not None else None))
                            start = sum(counts[:RANK])
                            same(f"{label} scatter root={root}", y, O.concat_bytes(
                                [whole[start:start + counts[RANK]]], dtype, row))
                sends = [[(q + j + k) % 3 for j in range(P)] for q in range(P)]
                vs = [O.make_bytes(seed + 9, q, (sum(sends[q]),) + row, dtype)
                      for q in range(P)]
                y = CK.attempt(label, lambda: comm.alltoallv(vs[RANK], sends[RANK],
                                                             algorithm=algo))
                same(f"{label} alltoallv", y, O.concat_bytes(
                    [vs[q][sum(sends[q][:RANK]):][:sends[q][RANK]] for q in range(P)],
                    dtype, row))
            if P > 1:  # two structs of one size (the same dtype.str): every rank raises
                struct = (np.dtype([("x", "<f8"), ("y", "<i4")]) if RANK == P - 1
                          else np.dtype([("a", "<i4"), ("b", "<f8")]))
                CK.raises(f"{cname} {algo} structs differ", ringcoll.CollectiveMismatchError,
                          lambda: comm.allgather(np.zeros(2, struct), algorithm=algo),
                          "different dtype")
            CK.raises(f"{cname} {algo} object", ringcoll.InvalidTypeError,
                      lambda: comm.allgather(np.array([None, 1]), algorithm=algo),
                      "fixed-size dtype")
    y = CK.attempt("after dtypes", lambda: comms["world"].allgather(np.array([RANK])))
    CK.check(y is not None and y.tolist() == list(range(P)), "communicator usable after")


def check_barrier(comms, light, tmpdir):
    """Files as witnesses: after barrier() no rank may see a missing arrival file."""
    comm = comms["world"]
    for k, algo in enumerate((None, "native", None)):
        if RANK == k % P:
            time.sleep(0.05)  # a late rank
        with open(os.path.join(tmpdir, f"arrived.{k}.{RANK}"), "w"):
            pass
        CK.attempt(f"barrier {algo}", lambda: comm.barrier(algorithm=algo))
        missing = [r for r in range(P)
                   if not os.path.exists(os.path.join(tmpdir, f"arrived.{k}.{r}"))]
        CK.check(not missing, f"round {k} ({algo}): left the barrier before ranks {missing} "
                 "arrived")


def check_iallreduce(comms, light):
    comm = comms["ls2_seg64"]
    specs = [  # (algorithm, dtype, op, count, in place)
        ("ring", np.float64, "sum", 1001, False),
        ("recursive_doubling", np.int32, "max", 5, True),
        ("rabenseifner", np.float32, "prod", 64, False),
        ("hierarchical", np.int64, "sum", 3, True),
        ("native", np.float64, "min", 100, False),
        ("auto", np.complex128, "sum", 0, False),
    ]
    xs, reqs = [], []
    for i, (algo, dt, op, n, in_place) in enumerate(specs):
        x = O.make_input(80_000 + i, RANK, (n,), dt, op)
        xs.append(x)
        reqs.append(CK.attempt(f"iallreduce {algo}", lambda: comm.iallreduce(
            x, op=op, algorithm=algo, out=x if in_place else None)))
    g = CK.attempt("allgather after iallreduce", lambda: comm.allgather(np.array([RANK * 10])))
    CK.check(g is not None and g.tolist() == [10 * r for r in range(P)], f"allgather: {g}")
    for i, ((algo, dt, op, n, in_place), req) in enumerate(zip(specs, reqs)):
        if req is None:
            continue
        y = CK.attempt(f"wait {algo}", req.wait)
        CK.check(req.test(), f"{algo}: test() False after wait()")
        CK.check(not in_place or y is xs[i], f"{algo}: in place did not return x")
        expected = O.reduce_oracle([O.make_input(80_000 + i, r, (n,), dt, op)
                                    for r in range(P)], op, dt)
        CK.result(f"iallreduce {algo}", y, expected, op, dt)
        CK.identical(f"iallreduce {algo}", y if y is not None else np.zeros(0))


def check_split(comms, light):
    comm = comms["ls2_seg64"]
    color, key = RANK % 2, -RANK
    sub = CK.attempt("split", lambda: comm.split(color, key=key))
    ref = WORLD.Split(color, key)
    try:
        CK.check(sub is not None and (sub.rank, sub.size) == (ref.Get_rank(), ref.Get_size()),
                 "sub rank/size differ from MPI_Comm_split's")
        if sub is not None:
            for algo in ringcoll.ALLREDUCE_NAMES:
                x = O.make_input(90_000, RANK, (257,), np.int64)
                y = CK.attempt(f"sub {algo}", lambda: sub.allreduce(x, algorithm=algo))
                expected = np.empty_like(x)
                ref.Allreduce(x, expected, op=MPI.SUM)
                CK.check(y is not None and np.array_equal(y, expected), f"sub allreduce {algo}")
            g = CK.attempt("sub allgather", lambda: sub.allgather(np.array([RANK])))
            CK.check(g is not None and g.tolist() == ref.allgather(RANK), f"sub allgather {g}")
            sub.close()
    finally:
        ref.Free()
    none = CK.attempt("split None", lambda: comm.split(None if RANK == 0 else 1))
    CK.check((none is None) == (RANK == 0), "color=None must give None, and only there")
    if none is not None:
        y = CK.attempt("split None allreduce", lambda: none.allreduce(np.array([RANK])))
        CK.check(y is not None and y.tolist() == [sum(range(1, P))], f"group without 0: {y}")
        none.close()
    y = CK.attempt("parent after split", lambda: comm.allreduce(np.array([1])))
    CK.check(y is not None and y.tolist() == [P], "parent after split")


def check_layouts(comms, light):
    comm = comms["ls2_seg64"]
    for algo in ringcoll.ALLREDUCE_NAMES:
        base = O.make_input(95_000, RANK, (6, 20), np.float64)
        full = sum(O.make_input(95_000, r, (6, 20), np.float64) for r in range(P))
        for kind, x, exp in [("F", np.asfortranarray(base), full),
                             ("strided", base[:, ::3], full[:, ::3]),
                             ("transposed", base.T, full.T)]:
            y = CK.attempt(f"{algo} {kind}", lambda: comm.allreduce(x, algorithm=algo))
            CK.check(y is not None and np.array_equal(y, exp), f"{algo} {kind}: wrong values")
            CK.identical(f"{algo} {kind}", y if y is not None else np.zeros(0))
        z = np.asfortranarray(base)
        y = CK.attempt(f"{algo} F in place", lambda: comm.allreduce(z, algorithm=algo, out=z))
        CK.check(y is z and np.array_equal(z, full), f"{algo} F in place")
        s = CK.attempt(f"{algo} 0-d", lambda: comm.allreduce(np.array(RANK + 0.5), algorithm=algo))
        CK.check(s is not None and s.shape == () and s == sum(r + 0.5 for r in range(P)),
                 f"{algo} 0-d: {s!r}")
    y = CK.attempt("reduce strided", lambda: comm.reduce(base[:, ::3], root=0))
    CK.check(RANK != 0 or (y is not None and np.array_equal(y, full[:, ::3])), "reduce strided")


def check_fortran_out(comms, light):
    """out= may be F-contiguous (it is accepted): it must then hold the right values."""
    comm = comms["world"]
    x = O.make_input(96_000, RANK, (2 * P, 3), np.float64)
    full = sum(O.make_input(96_000, r, (2 * P, 3), np.float64) for r in range(P))
    everyone = [O.make_input(96_000, r, (2 * P, 3), np.float64) for r in range(P)]
    for algo in (None, "native"):
        y = CK.attempt(f"reduce_scatter {algo}", lambda: comm.reduce_scatter(
            x, out=np.empty((2, 3), order="F"), algorithm=algo))
        CK.check(y is not None and np.array_equal(y, full[2 * RANK:2 * RANK + 2]),
                 f"reduce_scatter {algo} into an F-ordered out: wrong values")
        y = CK.attempt(f"allgather {algo}", lambda: comm.allgather(
            x, out=np.empty((2 * P * P, 3), order="F"), algorithm=algo))
        CK.check(y is not None and np.array_equal(y, np.concatenate(everyone)),
                 f"allgather {algo} into an F-ordered out: wrong values")
        y = CK.attempt(f"alltoall {algo}", lambda: comm.alltoall(
            x, out=np.empty((2 * P, 3), order="F"), algorithm=algo))
        expected = np.concatenate([e[2 * RANK:2 * RANK + 2] for e in everyone])
        CK.check(y is not None and np.array_equal(y, expected),
                 f"alltoall {algo} into an F-ordered out: wrong values")


def check_errors(comms, light):
    comm = comms["world"]
    CK.raises("bad op", ValueError, lambda: comm.allreduce(np.ones(3), op="xor"), "op")
    CK.raises("avg int", TypeError, lambda: comm.allreduce(np.ones(3, np.int32), op="avg"))
    CK.raises("max complex", TypeError, lambda: comm.allreduce(np.ones(3, np.complex64), op="max"))
    CK.raises("bool dtype", TypeError, lambda: comm.allreduce(np.ones(3, bool)))
    CK.raises("object dtype", TypeError, lambda: comm.allgather(np.array([None, 1])))
    CK.raises("native float16", TypeError,
              lambda: comm.allreduce(np.ones(3, np.float16), algorithm="native"), "float32")
    CK.raises("unknown algorithm", ValueError, lambda: comm.allreduce(np.ones(3), algorithm="x"))
    CK.raises("bad root", ValueError, lambda: comm.broadcast(np.ones(3), root=P), "root")
    CK.raises("bad root reduce", ValueError, lambda: comm.reduce(np.ones(3), root=-1), "root")
    CK.raises("out shape", ValueError, lambda: comm.allreduce(np.ones(3), out=np.empty(4)))
    ro = np.empty(3)
    ro.flags.writeable = False
    CK.raises("read-only out", ValueError, lambda: comm.allreduce(np.ones(3), out=ro))
    if P > 1:
        CK.raises("alltoall rows", ValueError, lambda: comm.alltoall(np.ones((P + 1, 2))))
        # allgather's exchange finds it on every rank (no early release under MPI)
        CK.raises("allgather trailing", ringcoll.CollectiveMismatchError,
                  lambda: comm.allgather(np.ones((2, 3 if RANK != P - 1 else 4))), "trailing")
    # the classes are ringcoll's own, and NumPy-style at once
    CK.raises("bad op class", ringcoll.InvalidArgumentError,
              lambda: comm.allreduce(np.ones(3), op="xor"), "ringcoll rank")
    CK.raises("avg int class", ringcoll.InvalidTypeError,
              lambda: comm.allreduce(np.ones(3, np.int32), op="avg"), "op='sum'")
    CK.raises("COMM_NULL", ringcoll.InvalidArgumentError,
              lambda: ringcoll.Communicator(MPI.COMM_NULL), "COMM_NULL")
    closed = ringcoll.Communicator()
    closed.close()
    closed.close()  # twice is harmless
    CK.raises("closed", ringcoll.CommunicatorClosedError,
              lambda: closed.allreduce(np.ones(3)), "closed")
    CK.raises("closed barrier", ringcoll.CommunicatorClosedError, closed.barrier, "barrier")
    y = CK.attempt("after errors", lambda: comm.allreduce(np.array([RANK])))
    CK.check(y is not None and y.tolist() == [P * (P - 1) // 2], "communicator usable after errors")


def check_compat(comms, light):
    """ringcoll.wrap(COMM_WORLD)'s upper-case methods against COMM_WORLD's own."""
    c = CK.attempt("wrap", lambda: ringcoll.wrap(WORLD))
    if c is None:
        return
    CK.check(c.Get_rank() == RANK and c.Get_size() == P, "pass-through Get_rank/Get_size")
    x = O.make_input(99_000, RANK, (1001,), np.float64)

    def same(label, fn_ours, fn_ref, make):
        a, b = make(), make()
        CK.attempt(label, lambda: fn_ours(a))
        fn_ref(b)
        CK.check(all(np.array_equal(u, v) for u, v in zip(a, b)), f"{label}: differs from MPI")

    same("Allreduce", lambda bufs: c.Allreduce(x, bufs[0]),
         lambda bufs: WORLD.Allreduce(x, bufs[0]), lambda: [np.empty_like(x)])
    same("Allreduce MAX spec", lambda bufs: c.Allreduce([x, MPI.DOUBLE], [bufs[0], MPI.DOUBLE],
                                                        op=MPI.MAX),
         lambda bufs: WORLD.Allreduce(x, bufs[0], op=MPI.MAX), lambda: [np.empty_like(x)])
    same("Allreduce IN_PLACE", lambda bufs: c.Allreduce(MPI.IN_PLACE, bufs[0]),
         lambda bufs: WORLD.Allreduce(MPI.IN_PLACE, bufs[0]), lambda: [x.copy()])
    xi = O.make_input(99_001, RANK, (P * 5,), np.int32, "prod")
    same("Reduce_scatter_block", lambda bufs: c.Reduce_scatter_block(xi, bufs[0]),
         lambda bufs: WORLD.Reduce_scatter_block(xi, bufs[0]), lambda: [np.empty(5, np.int32)])
    same("Reduce_scatter_block PROD", lambda bufs: c.Reduce_scatter_block(xi, bufs[0],
                                                                          op=MPI.PROD),
         lambda bufs: WORLD.Reduce_scatter_block(xi, bufs[0], op=MPI.PROD),
         lambda: [np.empty(5, np.int32)])
    ours, ref = xi.copy(), xi.copy()  # IN_PLACE: all p blocks in recvbuf, result in block 0
    CK.attempt("Reduce_scatter_block IN_PLACE",
               lambda: c.Reduce_scatter_block(MPI.IN_PLACE, ours))
    WORLD.Reduce_scatter_block(MPI.IN_PLACE, ref)
    CK.check(np.array_equal(ours[:5], ref[:5]), "Reduce_scatter_block IN_PLACE: differs from MPI")
    strided = np.zeros((2, 6))[:, :3]  # mpi4py refuses it; a copy would lose the result
    CK.raises("Allreduce non-contiguous", BufferError, lambda: c.Allreduce(MPI.IN_PLACE, strided))
    s = O.make_input(99_002, RANK, (3, 2), np.float32)
    same("Allgather", lambda bufs: c.Allgather(s, bufs[0]),
         lambda bufs: WORLD.Allgather(s, bufs[0]), lambda: [np.empty((3 * P, 2), np.float32)])

    def inplace_gather():
        buf = np.zeros((P, 3), np.int64)
        buf[RANK] = RANK + 100
        return [buf]

    same("Allgather IN_PLACE", lambda bufs: c.Allgather(MPI.IN_PLACE, bufs[0]),
         lambda bufs: WORLD.Allgather(MPI.IN_PLACE, bufs[0]), inplace_gather)
    for root in sorted({0, P - 1}):
        same(f"Bcast root={root}", lambda bufs: c.Bcast(bufs[0], root=root),
             lambda bufs: WORLD.Bcast(bufs[0], root=root),
             lambda: [x.copy() if RANK == root else np.zeros_like(x)])
        same(f"Reduce root={root}",
             lambda bufs: c.Reduce(x, bufs[0] if RANK == root else None, root=root),
             lambda bufs: WORLD.Reduce(x, bufs[0] if RANK == root else None, root=root),
             lambda: [np.zeros_like(x)])
        same(f"Reduce IN_PLACE root={root}",
             lambda bufs: c.Reduce(MPI.IN_PLACE if RANK == root else bufs[0],
                                   bufs[0] if RANK == root else None, op=MPI.MIN, root=root),
             lambda bufs: WORLD.Reduce(MPI.IN_PLACE if RANK == root else bufs[0],
                                       bufs[0] if RANK == root else None, op=MPI.MIN, root=root),
             lambda: [x.copy()])
    a = O.make_input(99_003, RANK, (P, 4), np.int16)
    same("Alltoall", lambda bufs: c.Alltoall(a, bufs[0]),
         lambda bufs: WORLD.Alltoall(a, bufs[0]), lambda: [np.empty_like(a)])
    CK.attempt("Barrier", c.Barrier)
    d = CK.attempt("Dup pass-through", c.Dup)
    CK.check(d is not None and d.Get_size() == P, "Dup pass-through")
    if d is not None:
        d.Free()
    CK.attempt("Free", c.Free)


def twins(make, ours, ref, label):
    """ours(a) and ref(b) on twin buffers a and b from make(): a's bytes must be b's (ours is
    a wrap() call, ref WORLD's own)."""
    a, b = make(), make()
    CK.attempt(label, lambda: ours(a))
    ref(b)
    CK.check(bytes(memoryview(a)) == bytes(memoryview(b)),
             f"{label}: differs from MPI: {np.asarray(a)} vs {np.asarray(b)}")


def check_compat_repeat(comms, light):
    """wrap()'s remembered calls: every blocking method called again and again with the very
    same buffers, their values changed in place between calls (and a spec list made anew each
    call), against WORLD's own call on twin buffers every time; a call wrap cannot simply
    repeat (v-blocks at gaps, a derived datatype) is read again and right each time; a
    buffer reshaped in place, or another root, is a new call."""
    c = CK.attempt("wrap", lambda: ringcoll.wrap(WORLD))
    if c is None:
        return
    n, root = 5, P - 1
    send, big = np.zeros(n), np.zeros(n * P)
    ours = {k: np.zeros(n * P) for k in ("ag", "g", "a2a", "sc", "rs", "r", "scan", "ex", "bc")}
    ref = {k: np.zeros(n * P) for k in ours}
    vec_counts = [(r % 2) + 1 for r in range(P)]
    vec_displs = [3 * r + 1 for r in range(P)]  # gaps: staged, never simply repeated
    cases = [
        ("Allgather", lambda o: c.Allgather(send, o["ag"]), lambda o: WORLD.Allgather(send, o["ag"])),
        ("Gather", lambda o: c.Gather(send, o["g"], root=root),
         lambda o: WORLD.Gather(send, o["g"], root=root)),
        ("Scatter", lambda o: c.Scatter(big, o["sc"][:n], root=root),
         lambda o: WORLD.Scatter(big, o["sc"][:n], root=root)),
        ("Alltoall", lambda o: c.Alltoall(big, o["a2a"]), lambda o: WORLD.Alltoall(big, o["a2a"])),
        ("Reduce_scatter_block", lambda o: c.Reduce_scatter_block(big, o["rs"][:n]),
         lambda o: WORLD.Reduce_scatter_block(big, o["rs"][:n])),
        ("Reduce", lambda o: c.Reduce([send, MPI.DOUBLE], [o["r"][:n], MPI.DOUBLE], root=root),
         lambda o: WORLD.Reduce(send, o["r"][:n], root=root)),
        ("Scan", lambda o: c.Scan(send, o["scan"][:n]), lambda o: WORLD.Scan(send, o["scan"][:n])),
        ("Bcast", lambda o: (o["bc"].__setitem__(slice(None), big), c.Bcast(o["bc"], root=root)),
         lambda o: (o["bc"].__setitem__(slice(None), big), WORLD.Bcast(o["bc"], root=root))),
        ("Allgatherv gaps", lambda o: c.Allgatherv(send[:vec_counts[RANK]],
                                                   [o["ag"], vec_counts, vec_displs, MPI.DOUBLE]),
         lambda o: WORLD.Allgatherv(send[:vec_counts[RANK]],
                                    [o["ag"], vec_counts, vec_displs, MPI.DOUBLE])),
    ]
    for k in range(4):
        send[...] = np.arange(n) + 10 * RANK + k
        big[...] = np.arange(n * P) * (RANK + 1) + k
        for label, mine, theirs in cases:
            for o in (ours, ref):
                o["ag"][...] = -1  # the gaps must stay as they were, on both
            CK.attempt(f"{label} #{k}", lambda: mine(ours))
            theirs(ref)
            key = {"Allgather": "ag", "Gather": "g", "Scatter": "sc", "Alltoall": "a2a",
                   "Reduce_scatter_block": "rs", "Reduce": "r", "Scan": "scan", "Bcast": "bc",
                   "Allgatherv gaps": "ag"}[label]
            if label == "Gather" and RANK != root or label == "Reduce" and RANK != root:
                continue
            CK.check(ours[key].tobytes() == ref[key].tobytes(),
                     f"wrap {label} call {k}: {ours[key]} vs MPI's {ref[key]}")
    CK.check("Allgather" in c._remembered and "Reduce" in c._remembered,
             f"plain calls are remembered: {sorted(c._remembered)}")
    CK.check("Allgatherv" not in c._remembered, "a staged v-call is read again every time")
    # the very same spec list again (the OSU demos' msg), then changed in place: its new
    # count and buffer are read, not the remembered ones
    spec_buf, other = np.zeros(n * P), np.zeros(n * P)
    msg = [spec_buf, 2, MPI.DOUBLE]
    for k, change in enumerate([None, None, (1, n), (0, other), None]):
        if change is not None:
            msg[change[0]] = change[1]
        target = msg[0]
        target[...] = np.arange(n * P) + 100 * k if RANK == root else -1
        CK.attempt(f"Bcast spec list #{k}", lambda: c.Bcast(msg, root=root))
        want = np.where(np.arange(n * P) < msg[1], np.arange(n * P) + 100 * k, -1) \
            if RANK != root else np.arange(n * P) + 100 * k
        CK.check((target == want).all(), f"wrap Bcast of a reused spec list, call {k}: "
                 f"{target} vs {want}")
    # IN_PLACE forms repeated with new values: a remembered call copies the own block anew
    inplace, twin = np.zeros(n * P), np.zeros(n * P)
    for k in range(3):
        for label, mine, theirs in [
                ("Allgather IN_PLACE", lambda b: c.Allgather(MPI.IN_PLACE, b),
                 lambda b: WORLD.Allgather(MPI.IN_PLACE, b)),
                ("Gather IN_PLACE", lambda b: c.Gather(MPI.IN_PLACE if RANK == root else
                                                        b[RANK * n:(RANK + 1) * n], b,
                                                        root=root),
                 lambda b: WORLD.Gather(MPI.IN_PLACE if RANK == root else
                                        b[RANK * n:(RANK + 1) * n], b, root=root)),
                ("Reduce_scatter_block IN_PLACE",
                 lambda b: c.Reduce_scatter_block(MPI.IN_PLACE, b),
                 lambda b: WORLD.Reduce_scatter_block(MPI.IN_PLACE, b))]:
            for b in (inplace, twin):
                b[...] = np.arange(n * P) * (RANK + 1) + k
            CK.attempt(f"{label} #{k}", lambda: mine(inplace))
            theirs(twin)
            part = slice(0, n) if label.startswith("Reduce") else slice(None)
            if label.startswith("Gather") and RANK != root:
                continue
            CK.check(inplace[part].tobytes() == twin[part].tobytes(),
                     f"wrap {label} call {k}: {inplace[part]} vs MPI's {twin[part]}")
    # Reduce_scatter without recvcounts reads them with a message every call: never
    # remembered, so a rank whose call changed (here the last) cannot leave the others behind
    kept = {}  # the same arrays whenever this rank's call is the same
    for k in range(3):
        mine_n = 2 + (k if RANK == P - 1 else 0)
        total = WORLD.allreduce(mine_n)
        out_rs, ref_rs, src_rs = kept.setdefault(total, (
            np.zeros(mine_n), np.zeros(mine_n), np.arange(total, dtype=np.float64) + RANK))
        CK.attempt(f"Reduce_scatter #{k}", lambda: c.Reduce_scatter(src_rs, out_rs))
        WORLD.Reduce_scatter(src_rs, ref_rs)
        CK.check(out_rs.tobytes() == ref_rs.tobytes(), f"Reduce_scatter #{k}: {out_rs}")
    CK.check("Reduce_scatter" not in c._remembered, "Reduce_scatter without counts remembered")
    # a new buffer equal in value to the remembered one is another call, whose result lands in
    # the new buffer: size-1 arrays compare equal elementwise, and a bytearray compares equal
    # to an array holding the same bytes. Each rank's new buffers hold what its kept ones
    # hold after the last call, while another rank's value (root's, the others') changes.
    fresh = (np.zeros, np.zeros, lambda m: bytearray(8 * m), np.zeros)
    for k, kind in enumerate(fresh):
        buf = kind(1)
        np.frombuffer(buf)[0] = 7 + k if RANK == root else 7 + k - 1
        CK.attempt(f"Bcast into a new equal buffer #{k}", lambda: c.Bcast(buf, root=root))
        CK.check(np.frombuffer(buf).tolist() == [7 + k], f"Bcast #{k} into a new {type(buf)}: "
                 f"{np.frombuffer(buf)}, want [{7 + k}]")
        one, got = np.full(1, 1.0 if RANK == root else float(k)), np.zeros(1)
        got[0] = 1 + (P - 1) * (k - 1)  # last call's sum
        CK.attempt(f"Reduce into a new equal buffer #{k}",
                   lambda: c.Reduce(one, got, op=MPI.SUM, root=root))
        if RANK == root:
            CK.check(got.tolist() == [1 + (P - 1) * k],
                     f"Reduce #{k} into a new array: {got}, want [{1 + (P - 1) * k}]")
    # a receive buffer reshaped in place between calls is a new call, read again
    out = np.zeros(n * P)
    for shape in ((n * P,), (P, n), (n * P,)):
        out.shape = shape
        CK.attempt(f"Allgather reshaped {shape}", lambda: c.Allgather(send, out))
        CK.check(out.reshape(-1).tolist() == [v for r in range(P)
                                              for v in (np.arange(n) + 10 * r + 3).tolist()],
                 f"Allgather into out of shape {shape}")
    # a remembered call runs the core's plan with no matching of its own (Communicator.again):
    # a send buffer retyped in place must be read again (MPI reduces it as the new type), and
    # a Communicator call of the same collective in between must not leave a stale plan
    # (tuning=False: ringcoll's own tree, whose plan is bound to a dtype; MPI's own call
    # reads the buffer's format anew each time)
    own = CK.attempt("wrap tuning=False", lambda: ringcoll.wrap(WORLD, tuning=False))
    x8, got, want = np.zeros(n), np.zeros(n), np.zeros(n)
    for k, retype in enumerate((None, None, None, np.int64, np.int64, np.float64)):
        x8.dtype, got.dtype, want.dtype = (np.float64,) * 3  # (an itemsize-8 view, in place)
        if retype is not None:
            for a in (x8, got, want):
                a.dtype = retype
        x8[...] = np.arange(n) + RANK + k + 2
        # (a product: small ints read as float64 are denormals, whose sums add as ints do)
        CK.attempt(f"Reduce retyped #{k}",
                   lambda: own.Reduce(x8, got, op=MPI.PROD, root=root))
        WORLD.Reduce(x8, want, op=MPI.PROD, root=root)
        if RANK == root:
            CK.check(got.tobytes() == want.tobytes(), f"Reduce retyped to {retype} #{k}: "
                     f"{got} vs MPI's {want}")
        if k == 1:  # (not before a retype: the core's own call notices that itself)
            own.ringcoll.reduce(np.ones(3), root=root, out=np.zeros(3) if RANK == root else None)
    CK.check("Reduce" in own._remembered, "Reduce remembered after the retyped calls")
    own.Free()


def check_compat_buffers(comms, light):
    """wrap() takes buffers as mpi4py does (every result against WORLD's own call on a twin
    buffer of the same kind): array.array, bytearray and memoryview receive buffers (viewed,
    never copied), bool data, [buf, count, type] and [buf, (count, displ), type] specs, None
    as IN_PLACE, and the calls ringcoll passes through (derived datatype, user-defined op,
    MAXLOC on a pair type)."""
    import array

    c = CK.attempt("wrap", lambda: ringcoll.wrap(WORLD))
    if c is None:
        return

    twins(lambda: array.array("i", [0] * 4),
          lambda r: c.Reduce(np.arange(4, dtype=np.int32) + RANK, r, root=0),
          lambda r: WORLD.Reduce(np.arange(4, dtype=np.int32) + RANK, r, root=0),
          "Reduce into array.array")
    twins(lambda: array.array("d", [0.0] * 3),
          lambda r: c.Reduce_scatter_block(np.arange(3.0 * P) + RANK, r),
          lambda r: WORLD.Reduce_scatter_block(np.arange(3.0 * P) + RANK, r),
          "Reduce_scatter_block into array.array")
    twins(lambda: bytearray(b"ringcoll" if RANK == P - 1 else bytes(8)),
          lambda b: c.Bcast(b, root=P - 1), lambda b: WORLD.Bcast(b, root=P - 1),
          "Bcast of a bytearray")
    twins(lambda: memoryview(bytearray(6 * P)),
          lambda m: c.Allgather(bytes([RANK] * 6), m), lambda m: WORLD.Allgather(
              bytes([RANK] * 6), m), "Allgather of bytes into a memoryview")
    flags = np.array([RANK % 2 == 0, True, False])
    twins(lambda: np.zeros(3 * P, bool), lambda r: c.Allgather(flags, r),
          lambda r: WORLD.Allgather(flags, r), "Allgather of bool")
    twins(lambda: np.zeros(2 * P, bool),
          lambda r: c.Alltoall(np.arange(2 * P) % (RANK + 2) == 0, r),
          lambda r: WORLD.Alltoall(np.arange(2 * P) % (RANK + 2) == 0, r), "Alltoall of bool")
    x = np.arange(10, dtype=np.int32) * (RANK + 1)
    twins(lambda: np.full(10, -1, np.int32),
          lambda r: c.Allreduce([x, 4, MPI.INT], [r, 4, MPI.INT]),
          lambda r: WORLD.Allreduce([x, 4, MPI.INT], [r, 4, MPI.INT]),
          "Allreduce [buf, count, MPI.INT]: the rest untouched")
    twins(lambda: np.full(10, -1, np.int32),
          lambda r: c.Allreduce([x, (3, 5), MPI.INT], [r, (3, 2), MPI.INT], op=MPI.MAX),
          lambda r: WORLD.Allreduce([x, (3, 5), MPI.INT], [r, (3, 2), MPI.INT], op=MPI.MAX),
          "Allreduce [buf, (count, displ), MPI.INT]")
    twins(lambda: np.full(4 * P, -1, np.int64),
          lambda r: c.Alltoall([np.arange(2 * P) + 10 * RANK, 2, MPI.INT64_T],
                               [r, 2, MPI.INT64_T]),
          lambda r: WORLD.Alltoall([np.arange(2 * P) + 10 * RANK, 2, MPI.INT64_T],
                                   [r, 2, MPI.INT64_T]),
          "Alltoall count per process: the rest untouched")

    def placed():
        buf = np.zeros((P, 2), np.float32)
        buf[RANK] = RANK + 0.5
        return buf

    twins(placed, lambda b: c.Allgather(None, b), lambda b: WORLD.Allgather(MPI.IN_PLACE, b),
          "Allgather(None, buf): in place")
    twins(lambda: np.zeros((P, 3), np.int16) if RANK == 0 else np.zeros(0, np.int16),
          lambda r: c.Gather(np.full(3, RANK, np.int16), r if RANK == 0 else None, root=0),
          lambda r: WORLD.Gather(np.full(3, RANK, np.int16), r if RANK == 0 else None, root=0),
          "Gather")
    vector = MPI.INT.Create_vector(2, 1, 2).Commit()
    try:
        twins(lambda: np.arange(4, dtype=np.int32) * (RANK == 0),
              lambda b: c.Bcast([b, 1, vector], root=0),
              lambda b: WORLD.Bcast([b, 1, vector], root=0),
              "Bcast of a derived datatype (packed)")
    finally:
        vector.Free()
    maximum = MPI.Op.Create(lambda a, b, dt: np.maximum(np.frombuffer(a, np.float64),
                                                        np.frombuffer(b, np.float64),
                                                        out=np.frombuffer(b, np.float64)),
                            commute=True)
    try:
        twins(lambda: np.zeros(3), lambda r: c.Allreduce(np.arange(3.0) * RANK, r, op=maximum),
              lambda r: WORLD.Allreduce(np.arange(3.0) * RANK, r, op=maximum),
              "Allreduce with a user-defined op (passed through)")
    finally:
        maximum.Free()
    pair = np.dtype([("v", np.float64), ("i", np.int32)], align=True)  # MPI.DOUBLE_INT
    twins(lambda: np.zeros(2, pair),
          lambda r: c.Allreduce([np.array([(RANK % 3, RANK)] * 2, pair), MPI.DOUBLE_INT],
                                [r, MPI.DOUBLE_INT], op=MPI.MAXLOC),
          lambda r: WORLD.Allreduce([np.array([(RANK % 3, RANK)] * 2, pair), MPI.DOUBLE_INT],
                                    [r, MPI.DOUBLE_INT], op=MPI.MAXLOC),
          "Allreduce MAXLOC on DOUBLE_INT (passed through)")
    # the repeated-call fast path: the same arrays again, new values, another op, in place
    xs, ys, ref = np.zeros(5), np.zeros(5), np.zeros(5)
    for k, op in enumerate([MPI.SUM, MPI.SUM, MPI.MAX, MPI.MAX, MPI.SUM]):
        xs[:] = np.arange(5) * (RANK + k)
        CK.attempt(f"repeated Allreduce {k}", lambda: c.Allreduce(xs, ys, op=op))
        WORLD.Allreduce(xs, ref, op=op)
        CK.check(np.array_equal(ys, ref), f"repeated Allreduce {k}: differs from MPI")
    buf = np.zeros(4)
    for k in range(3):  # the same buffer in place, call after call
        buf[:] = np.arange(4.0) + RANK + k
        theirs = buf.copy()
        CK.attempt(f"repeated IN_PLACE {k}", lambda: c.Allreduce(MPI.IN_PLACE, buf))
        WORLD.Allreduce(MPI.IN_PLACE, theirs)
        CK.check(np.array_equal(buf, theirs), f"repeated IN_PLACE {k}: differs from MPI")
    CK.raises("read-only recvbuf", ValueError, lambda: c.Allreduce(np.ones(2), bytes(16)))
    c.Free()


def check_compat_collectives(comms, light):
    """wrap()'s v-variants, scans and I-forms against WORLD's own call on twin buffers:
    Gatherv/Scatterv/Allgatherv/Alltoallv with uneven counts at displacements that are not
    back to back (gaps left untouched), every root, IN_PLACE forms, Reduce_scatter with and
    without recvcounts, Scan/Exscan (Exscan's rank 0 buffer untouched), and each I-form through
    its Request (Wait, Test, wait, test, Request.Waitall)."""
    from ringcoll.compat import Request

    c = CK.attempt("wrap", lambda: ringcoll.wrap(WORLD))
    if c is None:
        return

    counts = [(r * 3 + 1) % 4 for r in range(P)]  # uneven, with zeros from P = 4
    displs = [sum(counts[:r]) + 2 * r + 1 for r in range(P)]  # gaps between the blocks
    span = displs[-1] + counts[-1] + 2
    mine = counts[RANK]
    send = np.arange(mine, dtype=np.int32) + 100 * RANK
    for root in sorted({0, P // 2, P - 1}):
        twins(lambda: np.full(span, -1, np.int32),
              lambda r: c.Gatherv(send, [r, counts, displs, MPI.INT] if RANK == root else None,
                                  root=root),
              lambda r: WORLD.Gatherv(send, [r, counts, displs, MPI.INT]
                                      if RANK == root else None, root=root),
              f"Gatherv root {root}, gaps")
        source = np.arange(span, dtype=np.float64) * (root + 1)
        twins(lambda: np.full(mine, -1.0),
              lambda r: c.Scatterv([source, counts, displs, MPI.DOUBLE], r, root=root),
              lambda r: WORLD.Scatterv([source, counts, displs, MPI.DOUBLE], r, root=root),
              f"Scatterv root {root}, gaps")
        twins(lambda: np.full(2, -1, np.int64),
              lambda r: c.Scatter(np.arange(2 * P, dtype=np.int64) if RANK == root else None,
                                  r, root=root),
              lambda r: WORLD.Scatter(np.arange(2 * P, dtype=np.int64) if RANK == root
                                      else None, r, root=root), f"Scatter root {root}")
        twins(lambda: np.arange(3 * P, dtype=np.int16) * (RANK + 1),
              lambda b: c.Scatter(b if RANK == root else None,
                                  MPI.IN_PLACE if RANK == root else b[:3], root=root),
              lambda b: WORLD.Scatter(b if RANK == root else None,
                                      MPI.IN_PLACE if RANK == root else b[:3], root=root),
              f"Scatter root {root}, IN_PLACE on root")
    twins(lambda: np.full(span, -1, np.int32),
          lambda r: c.Allgatherv(send, [r, counts, displs, MPI.INT]),
          lambda r: WORLD.Allgatherv(send, [r, counts, displs, MPI.INT]), "Allgatherv, gaps")

    def placed():
        buf = np.full(span, -1, np.int32)
        buf[displs[RANK]:displs[RANK] + mine] = send
        return buf

    twins(placed, lambda b: c.Allgatherv(MPI.IN_PLACE, [b, counts, displs, MPI.INT]),
          lambda b: WORLD.Allgatherv(MPI.IN_PLACE, [b, counts, displs, MPI.INT]),
          "Allgatherv IN_PLACE, gaps")
    # Alltoallv: rank r sends (r + j) % 3 elements to rank j, at gapped displacements
    scounts = [(RANK + j) % 3 for j in range(P)]
    rcounts = [(i + RANK) % 3 for i in range(P)]
    sdispls = [sum(scounts[:j]) + j for j in range(P)]
    rdispls = [sum(rcounts[:i]) + 2 * i for i in range(P)]
    sbuf = np.arange(sdispls[-1] + scounts[-1] + 1, dtype=np.int64) + 1000 * RANK
    twins(lambda: np.full(rdispls[-1] + rcounts[-1] + 1, -1, np.int64),
          lambda r: c.Alltoallv([sbuf, scounts, sdispls, MPI.INT64_T],
                                [r, rcounts, rdispls, MPI.INT64_T]),
          lambda r: WORLD.Alltoallv([sbuf, scounts, sdispls, MPI.INT64_T],
                                    [r, rcounts, rdispls, MPI.INT64_T]), "Alltoallv, gaps")
    even = [2] * P
    twins(lambda: np.arange(2 * P, dtype=np.float32) + RANK,
          lambda b: c.Alltoallv(MPI.IN_PLACE, [b, even, None, MPI.FLOAT]),
          lambda b: WORLD.Alltoallv(MPI.IN_PLACE, [b, even, None, MPI.FLOAT]),
          "Alltoallv IN_PLACE")
    # reductions
    total = sum(counts)
    x = np.arange(total, dtype=np.int64) * (RANK + 1)
    twins(lambda: np.full(mine, -1, np.int64),
          lambda r: c.Reduce_scatter(x, r, counts), lambda r: WORLD.Reduce_scatter(x, r, counts),
          "Reduce_scatter with recvcounts")
    twins(lambda: np.full(mine, -1, np.int64), lambda r: c.Reduce_scatter(x, r),
          lambda r: WORLD.Reduce_scatter(x, r), "Reduce_scatter, recvcounts from recvbuf")
    twins(lambda: x.copy(), lambda b: c.Reduce_scatter(MPI.IN_PLACE, b, counts, op=MPI.MAX),
          lambda b: WORLD.Reduce_scatter(MPI.IN_PLACE, b, counts, op=MPI.MAX),
          "Reduce_scatter IN_PLACE")
    for name, op in [("SUM", MPI.SUM), ("PROD", MPI.PROD), ("MAX", MPI.MAX), ("MIN", MPI.MIN)]:
        y = (np.arange(5, dtype=np.int32) + RANK) % 4 + 1
        twins(lambda: np.full(5, -7, np.int32), lambda r: c.Scan(y, r, op=op),
              lambda r: WORLD.Scan(y, r, op=op), f"Scan {name}")
        twins(lambda: np.full(5, -7, np.int32), lambda r: c.Exscan(y, r, op=op),
              lambda r: WORLD.Exscan(y, r, op=op), f"Exscan {name} (rank 0's buffer untouched)")
    twins(lambda: np.arange(4.0) + RANK, lambda b: c.Scan(MPI.IN_PLACE, b),
          lambda b: WORLD.Scan(MPI.IN_PLACE, b), "Scan IN_PLACE")
    twins(lambda: np.arange(4.0) + RANK, lambda b: c.Exscan(None, b),
          lambda b: WORLD.Exscan(MPI.IN_PLACE, b), "Exscan(None, buf): in place")
    # I-forms: several in flight, finished by each of the Request methods
    bufs = {k: (np.zeros(P * 3, np.int32), np.zeros(P * 3, np.int32)) for k in range(4)}
    part = np.full(3, RANK, np.int32)
    reqs = [CK.attempt(f"Iallgather {k}", lambda k=k: c.Iallgather(part + k, bufs[k][0]))
            for k in range(4)]
    for k in range(4):
        WORLD.Allgather(part + k, bufs[k][1])
    if all(isinstance(q, Request) for q in reqs):
        CK.check(reqs[0].Wait() is True, "Request.Wait returns True")
        reqs[1].wait()
        while not reqs[2].Test():
            pass
        flag = False
        while not flag:
            flag, value = reqs[3].test()
        CK.check(value is None, "Request.test gives (True, None)")
        CK.check(not reqs[0] and reqs[0] == MPI.REQUEST_NULL and reqs[0] == reqs[0],
                 "a completed Request is false and equals MPI.REQUEST_NULL")
        fresh = c.Ibarrier()
        CK.check(fresh != MPI.REQUEST_NULL or fresh.Test(), "a pending Request is not null")
        fresh.Wait()
        for k in range(4):
            CK.check(np.array_equal(*bufs[k]), f"Iallgather {k}: differs from MPI")
    more = [(lambda b: c.Ibcast(b, root=P - 1), lambda b: WORLD.Bcast(b, root=P - 1),
             lambda: np.arange(3.0) * (RANK == P - 1), "Ibcast"),
            (lambda r: c.Iallreduce(np.arange(4) + RANK, r), lambda r: WORLD.Allreduce(
                np.arange(4) + RANK, r), lambda: np.zeros(4, int), "Iallreduce"),
            (lambda r: c.Igatherv(send, [r, counts, displs, MPI.INT] if RANK == 0 else None),
             lambda r: WORLD.Gatherv(send, [r, counts, displs, MPI.INT] if RANK == 0 else None),
             lambda: np.full(span, -1, np.int32), "Igatherv, gaps"),
            (lambda r: c.Iscan(np.arange(3) + RANK, r),
             lambda r: WORLD.Scan(np.arange(3) + RANK, r), lambda: np.zeros(3, int), "Iscan"),
            (lambda r: c.Iexscan(np.arange(3) + RANK, r),
             lambda r: WORLD.Exscan(np.arange(3) + RANK, r), lambda: np.full(3, -1), "Iexscan"),
            (lambda r: c.Ireduce_scatter(x, r, counts), lambda r: WORLD.Reduce_scatter(
                x, r, counts), lambda: np.zeros(mine, np.int64), "Ireduce_scatter"),
            (lambda r: c.Ialltoallv([sbuf, scounts, sdispls, MPI.INT64_T],
                                    [r, rcounts, rdispls, MPI.INT64_T]),
             lambda r: WORLD.Alltoallv([sbuf, scounts, sdispls, MPI.INT64_T],
                                       [r, rcounts, rdispls, MPI.INT64_T]),
             lambda: np.full(rdispls[-1] + rcounts[-1] + 1, -1, np.int64), "Ialltoallv"),
            (lambda r: c.Iscatterv([np.arange(span, dtype=np.int32), counts, displs, MPI.INT],
                                   r, root=0),
             lambda r: WORLD.Scatterv([np.arange(span, dtype=np.int32), counts, displs, MPI.INT],
                                      r, root=0), lambda: np.full(mine, -1, np.int32),
             "Iscatterv")]
    pending = []
    for ours, ref, make, label in more:
        a, b = make(), make()
        pending.append((CK.attempt(label, lambda: ours(a)), a, b, label))
        ref(b)
    CK.attempt("Request.Waitall", lambda: Request.Waitall([q for q, *_ in pending if q]))
    for _, a, b, label in pending:
        CK.check(np.array_equal(a, b), f"{label}: differs from MPI: {a} vs {b}")
    CK.attempt("Ibarrier", lambda: c.Ibarrier().Wait())
    cart = CK.attempt("Create_cart", lambda: c.Create_cart([P], periods=[True]))
    if cart is not None:  # wrapped, with the Cartcomm's own methods
        src, dst = cart.Shift(0, 1)
        got = np.zeros(P, np.int64)
        cart.Allgather(np.array([RANK]), got)
        CK.check(isinstance(cart, type(c)) and dst == (RANK + 1) % P
                 and got.tolist() == list(range(P)), "Create_cart: wrapped, Shift, Allgather")
        cart.Free()
    # a review's findings, each against WORLD: a tuple of counts in a 4-item v-spec is the
    # counts (the displacements are the next item)
    tcounts, tdispls = tuple([2] * P), [5 * r for r in range(P)]
    twins(lambda: np.full(5 * P, -1, np.int32),
          lambda r: c.Allgatherv(np.full(2, RANK, np.int32), [r, tcounts, tdispls, MPI.INT]),
          lambda r: WORLD.Allgatherv(np.full(2, RANK, np.int32), [r, tcounts, tdispls, MPI.INT]),
          "Allgatherv [buf, (counts...), displs, type]")
    # Reduce_scatter_block's count is per block, in place too
    twins(lambda: np.arange(3 * P, dtype=np.int32) + 100 * RANK,
          lambda b: c.Reduce_scatter_block(MPI.IN_PLACE, [b, 3, MPI.INT]),
          lambda b: WORLD.Reduce_scatter_block(MPI.IN_PLACE, [b, 3, MPI.INT]),
          "Reduce_scatter_block IN_PLACE [buf, count per block, type]")
    twins(lambda: np.zeros(2, np.int32),
          lambda r: c.Reduce_scatter_block([np.arange(2 * P, dtype=np.int32), 2, MPI.INT], r),
          lambda r: WORLD.Reduce_scatter_block([np.arange(2 * P, dtype=np.int32), 2, MPI.INT],
                                               r), "Reduce_scatter_block [sendbuf, count, type]")
    # Scatter in place from a read-only (bytes) root buffer
    source = bytes(range(2 * P))
    twins(lambda: bytearray(2), lambda r: c.Scatter(source, MPI.IN_PLACE if RANK == 0 else r,
                                                    root=0),
          lambda r: WORLD.Scatter(source, MPI.IN_PLACE if RANK == 0 else r, root=0),
          "Scatter(bytes, IN_PLACE) on root")
    # the repeated-call path notices a reshape and a read-only recvbuf
    sa, ra, rb = np.arange(6.0) + RANK, np.zeros(6), np.zeros(6)
    for k in range(3):
        if k == 2:
            sa.shape = ra.shape = rb.shape = (2, 3)
        CK.attempt(f"repeated Allreduce, reshaped at 2: {k}", lambda: c.Allreduce(sa, ra))
        WORLD.Allreduce(sa, rb)
        CK.check(np.array_equal(ra, rb), f"repeated Allreduce, reshaped: {k}: differs from MPI")
    ra.flags.writeable = False
    CK.raises("repeated Allreduce into a now read-only recvbuf", ValueError,
              lambda: c.Allreduce(sa, ra))
    # predefined ops ringcoll has no kernel for pass through; so do typecode strings and
    # pair types with a gap
    for name, op in [("BAND", MPI.BAND), ("BXOR", MPI.BXOR), ("LOR", MPI.LOR)]:
        twins(lambda: np.zeros(4, np.int32),
              lambda r: c.Allreduce(np.arange(4, dtype=np.int32) * (RANK + 1), r, op=op),
              lambda r: WORLD.Allreduce(np.arange(4, dtype=np.int32) * (RANK + 1), r, op=op),
              f"Allreduce {name} (passed through)")
    twins(lambda: np.zeros(3, np.int32),
          lambda r: c.Allreduce([np.arange(3, dtype=np.int32) + RANK, "i"], [r, "i"]),
          lambda r: WORLD.Allreduce([np.arange(3, dtype=np.int32) + RANK, "i"], [r, "i"]),
          "Allreduce with typecode 'i'")
    pair = np.dtype([("v", np.float64), ("i", np.int32)], align=True)
    # a derived datatype on some ranks only (MPI requires only the type signatures to
    # match): packed where it is, so every rank runs ringcoll's collective
    two = MPI.INT.Create_contiguous(2).Commit()
    strided = MPI.INT.Create_vector(2, 1, 3).Commit()  # ints 0 and 3 of 4: gaps at 1 and 2
    try:
        twins(lambda: np.full(2 * P, -1, np.int32),
              lambda r: c.Gather([np.full(2, RANK, np.int32), 2, MPI.INT],
                                 [r, 1, two] if RANK == 0 else None, root=0),
              lambda r: WORLD.Gather([np.full(2, RANK, np.int32), 2, MPI.INT],
                                     [r, 1, two] if RANK == 0 else None, root=0),
              "Gather into a contiguous derived type on root only")
        twins(lambda: np.full(2, -1, np.int32),
              lambda r: c.Scatter([np.arange(2 * P, dtype=np.int32), 1, two]
                                  if RANK == P - 1 else None, [r, 2, MPI.INT], root=P - 1),
              lambda r: WORLD.Scatter([np.arange(2 * P, dtype=np.int32), 1, two]
                                      if RANK == P - 1 else None, [r, 2, MPI.INT], root=P - 1),
              "Scatter from a derived type on root only")
        twins(lambda: np.arange(8, dtype=np.int32) if RANK == 0 else np.full(8, -1, np.int32),
              lambda b: c.Bcast([b, 2, strided] if RANK == 0 else [b, 4, MPI.INT], root=0),
              lambda b: WORLD.Bcast([b, 2, strided] if RANK == 0 else [b, 4, MPI.INT], root=0),
              "Bcast of a strided derived type on root, 4 ints elsewhere (gaps untouched)")
        twins(lambda: np.full(8 * P, -1, np.int32),
              lambda r: c.Allgatherv(np.full(2, RANK, np.int32),
                                     [r, [1] * P, [2 * q for q in range(P)], strided]),
              lambda r: WORLD.Allgatherv(np.full(2, RANK, np.int32),
                                         [r, [1] * P, [2 * q for q in range(P)], strided]),
              "Allgatherv into strided blocks at displacements")
    finally:
        two.Free()
        strided.Free()

    def pairs():  # zeros first: the padding bytes are zero in both twins
        b = np.zeros(2, pair)
        if RANK == 0:
            b[:] = (1.5, 7)
        return b

    twins(pairs,
          lambda b: c.Bcast([b, MPI.DOUBLE_INT], root=0),
          lambda b: WORLD.Bcast([b, MPI.DOUBLE_INT], root=0),
          "Bcast of DOUBLE_INT (a gap in its extent: passed through)")
    # debug mode: a bad buffer found by wrap() itself on one rank raises on every rank
    d = CK.attempt("wrap(debug=True)", lambda: ringcoll.wrap(WORLD, debug=True))
    if d is not None:
        short = np.zeros(3 * P - (RANK == P - 1), np.int32)
        CK.raises("debug mode: a short Allgather recvbuf on the last rank",
                  ValueError if RANK == P - 1 else ringcoll.PeerFailedError,
                  lambda: d.Allgather(np.zeros(3, np.int32), short))
        CK.raises("debug mode: a non-contiguous Bcast buffer on rank 0",
                  BufferError if RANK == 0 else ringcoll.PeerFailedError,
                  lambda: d.Bcast(np.zeros((4, 4))[:, 1] if RANK == 0 else np.zeros(4)))
        d.Free()
    # a root whose recvcounts differ from what the ranks send: every rank raises, the root
    # the InvalidArgumentError (a ValueError, as mpi4py's), the others PeerFailedError
    blame = ValueError if RANK == 0 else ringcoll.PeerFailedError
    CK.raises("Gatherv recvbuf larger than what the ranks send", blame,
              lambda: c.Gatherv(send, [np.zeros(total + P, np.int32),
                                       [n + 1 for n in counts], MPI.INT]
                                if RANK == 0 else None, root=0))
    if P > 1:  # the same total, split otherwise
        shifted = [2] + [1] * (P - 2) + [0]
        CK.raises("Gatherv recvcounts split otherwise than the ranks send", blame,
                  lambda: c.Gatherv(np.ones(1, np.int32), [np.zeros(P, np.int32), shifted,
                                                           MPI.INT] if RANK == 0 else None,
                                    root=0), match="counts")
        CK.raises("Allgatherv recvcounts split otherwise than the ranks send on rank 0",
                  blame, lambda: c.Allgatherv(np.ones(1, np.int32), [
                      np.zeros(P, np.int32), shifted if RANK == 0 else [1] * P, MPI.INT]),
                  match="counts")
    c.Free()


def check_declared(comms, light):
    """allgather, gather and scatter with declared=True (the count exchange once per distinct
    call, then the data alone: MPI_Gather / MPI_Scatter for equal small blocks) against
    mpi4py's own calls of the same bytes, on every rank, each call made three times with new
    values: equal blocks below and above the native limit, uneven counts with zeros, a
    padded struct, every root (light: three), root's out in place (scatter) and x viewed in
    root's out (gather)."""
    from ringcoll.collectives import gather as gather_mod

    comm = comms["world"]
    roots = sorted({0, P - 1, P // 2}) if light else range(P)
    rec = np.dtype([("a", np.int8), ("b", np.float64)])
    big_rows = gather_mod.NATIVE_MAX // 8 + 3  # float64 rows past the native limit
    cases = [([3] * P, np.dtype(np.float64), "equal"),
             ([big_rows] * P, np.dtype(np.float64), "equal, past NATIVE_MAX"),
             ([(r * 7 + 3) % 4 for r in range(P)], np.dtype(np.int32), "uneven"),
             ([2] * P, rec, "struct")]
    for counts, dtype, what in cases:
        total, lo = sum(counts), sum(counts[:RANK])
        for root in roots:
            y, blk = np.zeros(total, dtype), np.zeros(counts[RANK], dtype)
            whole_root = np.zeros(total, dtype)  # gather: x viewed in root's out
            for k in range(3):
                label = f"declared {what} root={root} call {k}"
                x = O.make_input(47_000 + k, RANK, (counts[RANK],), dtype) if dtype != rec \
                    else np.zeros(counts[RANK], rec)
                if dtype == rec:
                    x["a"], x["b"] = RANK + k, np.arange(counts[RANK]) + 0.5 * k
                parts = WORLD.allgather(x)
                whole = np.concatenate(parts)
                got = CK.attempt(label + " allgather", lambda: comm.allgather(
                    x, out=y, counts=counts, declared=True))
                CK.check(got is y and _raw_bytes(y) == _raw_bytes(whole),
                         f"{label}: allgather wrong")
                if RANK == root and k == 2:  # root's x inside its out (aliased)
                    whole_root[lo:lo + counts[RANK]] = x
                    send, out = whole_root[lo:lo + counts[RANK]], whole_root
                else:
                    send, out = x, (y if RANK == root else None)
                got = CK.attempt(label + " gather", lambda: comm.gather(
                    send, root=root, out=out, counts=counts, declared=True))
                CK.check((got is None) if RANK != root else
                         (got is out and _raw_bytes(got) == _raw_bytes(whole)),
                         f"{label}: gather wrong")
                src = whole.copy() if RANK == root else None
                mine = src[lo:lo + counts[RANK]] if RANK == root and k == 1 else blk  # in place
                got = CK.attempt(label + " scatter", lambda: comm.scatter(
                    src, root=root, counts=counts, out=mine, declared=True))
                CK.check(got is mine and _raw_bytes(got) == _raw_bytes(parts[RANK]),
                         f"{label}: scatter wrong")


def check_declared_repeats(comms, light):
    """The repeats of declared allgather, gather, scatter and alltoallv, where the call's plan
    runs MPI's bound call alone once agreed (their hot path): the very same arrays every call, new
    values written into them in place, against mpi4py's calls; between calls, another
    declared call of each collective (another agreed signature), and once more than
    group.DECLARED_LIMIT distinct declared calls, so that every rank forgets the agreement
    and must agree again (a rank still taking its hot path would then deadlock or mix
    messages with the others' exchange)."""
    from ringcoll.group import DECLARED_LIMIT

    comm = comms["world"]
    for root in sorted({0, P - 1}):
        counts = [3] * P
        x, y = np.zeros(3), np.zeros(3 * P)
        src, blk = np.zeros(3 * P), np.zeros(3)
        a2a_x = np.zeros(sum((RANK + 2 * j) % 3 + 1 for j in range(P)))
        a2a_y = np.zeros(sum((i + 2 * RANK) % 3 + 1 for i in range(P)))
        for k in range(6):
            label = f"declared repeat root={root} call {k}"
            x[...] = O.make_input(48_000 + k, RANK, (3,), np.float64)
            whole = np.concatenate(WORLD.allgather(x))
            src[...] = whole if RANK == root else 0
            # after the forgetting, rank 0 alone passes new arrays (a new plan, no repeat):
            # it must find the agreement gone, as the repeating ranks must
            mine, out = (x.copy(), blk.copy()) if k == 5 and RANK == 0 else (x, blk)
            ok = comm.allgather(mine, out=y, counts=counts, declared=True) is y and \
                np.array_equal(y, whole)
            CK.check(ok, f"{label}: allgather wrong")
            got = comm.gather(mine, root=root, out=y if RANK == root else None, counts=counts,
                              declared=True)
            CK.check(got is None if RANK != root else np.array_equal(got, whole),
                     f"{label}: gather wrong")
            CK.check(comm.scatter(src if RANK == root else None, root=root, counts=counts,
                                  out=out, declared=True) is out
                     and np.array_equal(out, whole[3 * RANK:3 * RANK + 3]),
                     f"{label}: scatter wrong")
            if k == 2:  # another signature of each: agreed, and the first one still holds
                one = np.full(1, RANK, np.float64)
                every = np.arange(P, dtype=np.float64)
                comm.allgather(one, out=np.zeros(P), counts=[1] * P, declared=True)
                comm.gather(one, root=root, out=np.zeros(P) if RANK == root else None,
                            counts=[1] * P, declared=True)
                comm.scatter(every if RANK == root else None, root=root, counts=[1] * P,
                             out=np.zeros(1), declared=True)
            # alltoallv: rank i sends rank j (i + 2 j) % 3 + 1 rows, against mpi4py's
            m = [[(i + 2 * j) % 3 + 1 for j in range(P)] for i in range(P)]
            sc, rc = m[RANK], [m[q][RANK] for q in range(P)]
            a2a_x[...] = O.make_input(48_500 + k, RANK, (sum(sc),), np.float64)
            want = np.empty(sum(rc))
            WORLD.Alltoallv([a2a_x, sc], [want, rc])
            send = a2a_x.copy() if k == 5 and RANK == 0 else a2a_x
            got = comm.alltoallv(send, sc, out=a2a_y, recv_counts=rc, declared=True)
            CK.check(got is a2a_y and np.array_equal(a2a_y, want), f"{label}: alltoallv wrong")
            if k == 2:
                ones = [1] * P
                comm.alltoallv(np.zeros(P), ones, out=np.zeros(P), recv_counts=ones,
                               declared=True)
            if k == 4:  # more distinct declared calls than the cache keeps: all forgotten
                for n in range(1, DECLARED_LIMIT + 2):
                    comm.allgather(np.zeros(n), out=np.zeros(n * P), counts=[n] * P,
                                   declared=True)
                CK.check(len(comm._g.declared) == DECLARED_LIMIT,
                         f"{label}: the declared calls were not bounded")


def check_allgather_in_place(comms, light):
    """allgather whose x lives in out, against mpi4py's allgather of the same rows: x exactly
    this rank's block of out (an in-place call, as wrap()'s Allgather(IN_PLACE) makes), x at
    another place in out, or apart, mixed between ranks (MPI's call gets MPI_IN_PLACE on
    every rank, each rank's rows copied into its block first unless they are there); small
    and large rows; auto, native and ring; declared or not; three calls each."""
    comm = comms["world"]
    shapes = {"own block": lambda r: True, "even ranks' block": lambda r: r % 2 == 0,
              "elsewhere on odd ranks": lambda r: r % 2 == 0}
    for each, (what, in_place), alg, declared in itertools.product(
            (3, 5000), shapes.items(), (None, "native", "ring"),
            (False, True)):
        counts = [each + (r % 3) for r in range(P)]
        lo, mine = sum(counts[:RANK]), counts[RANK]
        out = np.zeros(sum(counts))
        for k in range(3):
            rows = O.make_input(49_000 + k, RANK, (mine,), np.float64)
            whole = np.concatenate(WORLD.allgather(rows))
            if in_place(RANK):
                out[lo:lo + mine] = rows
                x = out[lo:lo + mine]
            elif what.startswith("elsewhere"):
                at = 0 if lo else sum(counts) - mine  # inside out, not at this rank's block
                out[at:at + mine] = rows
                x = out[at:at + mine]
            else:
                x = rows
            label = (f"allgather x in out ({what}) rows={counts} {alg} declared={declared} "
                     f"call {k}")
            got = CK.attempt(label, lambda: comm.allgather(
                x, out=out, algorithm=alg, counts=counts if declared else None,
                declared=declared))
            CK.check(got is out and np.array_equal(out, whole), f"{label}: wrong result")


def check_trace(comms, light):
    """comm.trace() over MPI: results unchanged, each rank records only its own traffic, and
    Trace.gather matches every message with its receive (tests/test_trace.py checks the byte
    formulas of every algorithm on threads; here the ring's, and conservation for the rest)."""
    comm = comms["ls2_seg64"]
    n = 103
    x = O.make_input(95_000, RANK, (n,), np.float64)
    for algo in ("ring", "recursive_doubling", "rabenseifner", "bruck", "hierarchical",
                 "native"):
        y = np.empty_like(x)
        ref = CK.attempt(f"untraced {algo}", lambda: comm.allreduce(x, algorithm=algo, out=y))
        ref = None if ref is None else ref.copy()
        with comm.trace() as t:
            for _ in range(2):  # built, then replayed: both traced
                got = CK.attempt(f"traced {algo}", lambda: comm.allreduce(x, algorithm=algo,
                                                                           out=y))
                CK.check(ref is not None and got is not None and got.tobytes() == ref.tobytes(),
                         f"trace {algo}: traced result differs from untraced")
        after = len(t)
        CK.attempt(f"after trace {algo}", lambda: comm.allreduce(x, algorithm=algo, out=y))
        CK.check(len(t) == after and ref is not None and y.tobytes() == ref.tobytes(),
                 f"trace {algo}: the call after the with-block was traced or wrong")
        CK.check(all(m.src == RANK for m in t.messages) and all(r.dst == RANK
                                                                for r in t.receives),
                 f"trace {algo}: recorded another rank's traffic")
        g = CK.attempt(f"gather {algo}", lambda: t.gather(comm))
        if g is None:
            continue
        CK.check(len(g.messages) == len(g.receives)
                 and all(m.t_end is not None for m in g.messages)
                 and sum(m.nbytes for m in g.messages) == sum(r.nbytes for r in g.receives),
                 f"trace {algo}: gathered messages and receives do not match")
        CK.check([c[1:] for c in g.collectives()] == ([] if algo == "native" or P == 1
                                                      else [("allreduce", algo)] * 2),
                 f"trace {algo}: collectives {g.collectives()}")
        if algo == "ring" and P > 1:  # 2n - c_r - c_{r+1} elements and the 48-byte header
            c = [n // P + (1 if b < n % P else 0) for b in range(P)]
            want = 2 * (8 * (2 * n - c[RANK] - c[(RANK + 1) % P]) + 48)
            CK.check(g.bytes_sent(RANK) == want, f"trace ring: sent {g.bytes_sent(RANK)} != "
                     f"{want}")


def check_scan(comms, light):
    """scan and exscan against mpi4py's own Scan / Exscan on WORLD of the same arrays (every
    dtype MPI has, exactly), integers also against NumPy on the inputs (exact: where MPI's
    own result differs from it, MPI is wrong and NumPy is the oracle; said on stdout); the
    half types against NumPy. exscan's rank 0 gets None and its out stays as it was."""
    mpi_ops = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}
    combos = [(d, op) for d, op in O.COMBOS if op != "avg"]
    counts = [0, 1, P + 1] if light else [0, 1, P + 1, 1001]
    slot, mpi_wrong = 0, []
    for cname in ("world",) if light else ("world", "ls2_seg64"):
        comm = comms[cname]
        for dtype, op in combos:
            for n in counts:
                slot += 1
                shape = (n,) if slot % 5 else (n, 2)
                seed = 70_000 + slot
                x = O.make_input(seed, RANK, shape, dtype, op)
                before = x.copy()
                for name in ("scan", "exscan"):
                    native = dtype not in O.HALF_DTYPES
                    mode = (slot + (name == "exscan")) % 3  # 0: none, 1: out=, 2: in place
                    label = f"{cname} {name} {shape} {dtype} {op} mode {mode}"
                    mine = x.copy() if mode == 2 else x
                    out = {0: None, 1: np.full(shape, 7, dtype), 2: mine}[mode]
                    kept = None if out is None else out.copy()
                    # every other case through MPI's own call (algorithm='native')
                    algorithm = "native" if native and slot % 4 < 2 else None
                    label += f" {algorithm or 'auto'}"
                    y = CK.attempt(label, lambda: getattr(comm, name)(
                        mine, op=mpi_ops[op] if slot % 2 else op, out=out,
                        algorithm=algorithm))
                    if native:  # MPI's own call on the same input
                        ref = np.zeros_like(x)
                        getattr(WORLD, "Scan" if name == "scan" else "Exscan")(
                            x, ref, op=mpi_ops[op])
                    upto = RANK + 1 if name == "scan" else RANK
                    if upto == 0:  # exscan's rank 0
                        CK.check(y is None, f"{label}: rank 0 got {y!r}, not None")
                        CK.check(out is None or out.tobytes() == kept.tobytes(),
                                 f"{label}: rank 0's out was written")
                        continue
                    if not native or np.dtype(dtype).kind in "iu":
                        exact = O.reduce_oracle([O.make_input(seed, r, shape, dtype, op)
                                                 for r in range(upto)], op, dtype)
                        if native and ref.tobytes() != exact.tobytes():
                            mpi_wrong.append(label)  # integers are exact: MPI is wrong here
                            native = False
                        ref = exact
                    CK.check(y is not None and y.dtype == dtype and y.shape == x.shape
                             and y.tobytes() == ref.tobytes(), f"{label}: differs from "
                             f"{'MPI_' + name.capitalize() if native else 'NumPy'}")
                    CK.check(out is None or y is out, f"{label}: out not returned")
                CK.check(x.tobytes() == before.tobytes(), f"{cname} {shape} {dtype}: x modified")
    if mpi_wrong:  # seen with Open MPI 5.0.11's MPI_Scan of 8-bit sums (saturated values)
        print(f"mpi_checks rank {RANK}: MPI's own Scan/Exscan differed from the exact integer "
              f"results in {len(mpi_wrong)} case(s), e.g. {mpi_wrong[0]}; checked against "
              "NumPy on the inputs there", flush=True)
    # op='avg' is refused on every rank, before any message
    CK.raises("scan avg", ringcoll.InvalidArgumentError,
              lambda: comms["world"].scan(np.ones(3), op="avg"), "no prefix meaning")
    y = CK.attempt("exscan 0-d", lambda: comms["world"].exscan(np.int64(RANK + 1)))
    CK.check(y is None if RANK == 0 else (y is not None and int(y) == RANK * (RANK + 1) // 2),
             f"exscan 0-d: {y!r}")


# ---------------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--light", action="store_true")
    ap.add_argument("--report")
    ap.add_argument("--only")
    ap.add_argument("--tmpdir")
    ap.add_argument("--sync-timeout", type=float, default=60.0)
    ap.add_argument("--inject", choices=["check", "raise", "stuck"])
    args = ap.parse_args()
    start = time.time()

    if args.inject:
        inject(args)
    groups = args.only.split(",") if args.only else GROUPS
    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise SystemExit(f"unknown groups {sorted(unknown)}; choose from {GROUPS}")

    tmpdir = args.tmpdir
    if tmpdir is None:
        tmpdir = WORLD.bcast(tempfile.mkdtemp(prefix="ringcoll-barrier-") if RANK == 0 else None)
    comms = make_comms()
    sync("setup", args.sync_timeout)
    runners = {
        "allreduce": lambda: check_allreduce(comms, args.light),
        "allreduce_floats": lambda: check_allreduce_floats(comms, args.light),
        "reduce_scatter": lambda: check_reduce_scatter(comms, args.light),
        "allgather": lambda: check_allgather(comms, args.light),
        "gather": lambda: check_gather(comms, args.light),
        "scatter": lambda: check_scatter(comms, args.light),
        "broadcast": lambda: check_broadcast(comms, args.light),
        "reduce": lambda: check_reduce(comms, args.light),
        "alltoall": lambda: check_alltoall(comms, args.light),
        "barrier": lambda: check_barrier(comms, args.light, tmpdir),
        "iallreduce": lambda: check_iallreduce(comms, args.light),
        "split": lambda: check_split(comms, args.light),
        "layouts": lambda: check_layouts(comms, args.light),
        "fortran_out": lambda: check_fortran_out(comms, args.light),
        "errors": lambda: check_errors(comms, args.light),
        "compat": lambda: check_compat(comms, args.light),
        "compat_buffers": lambda: check_compat_buffers(comms, args.light),
        "compat_collectives": lambda: check_compat_collectives(comms, args.light),
        "trace": lambda: check_trace(comms, args.light),
        "alltoallv": lambda: check_alltoallv(comms, args.light),
        "scan": lambda: check_scan(comms, args.light),
        "dtypes": lambda: check_dtypes(comms, args.light),
        "compat_repeat": lambda: check_compat_repeat(comms, args.light),
        "declared": lambda: (check_declared(comms, args.light),
                             check_declared_repeats(comms, args.light)),
        "allgather_in_place": lambda: check_allgather_in_place(comms, args.light),
    }
    times = {}
    for group in groups:
        t0 = time.time()
        CK.start(group)
        try:
            runners[group]()
        except Exception as exc:  # noqa: BLE001 - a bug in a check, or an unexpected raise
            CK.check(False, f"unexpected {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        sync(group, args.sync_timeout)
        times[group] = round(time.time() - t0, 3)
    for comm in comms.values():
        comm.close()
    if args.tmpdir is None and RANK == 0:
        shutil.rmtree(tmpdir, ignore_errors=True)
    finish(args, times, time.time() - start)


def finish(args, times, elapsed):
    mine = [f for group in CK.failures for f in CK.failures[group]]
    total = WORLD.allreduce(len(mine), op=MPI.SUM)
    checks = WORLD.allreduce(sum(CK.checks.values()), op=MPI.SUM)
    every = WORLD.gather(CK.failures, root=0)
    counts = WORLD.gather(CK.checks, root=0)
    if RANK == 0:
        report = {g: {"checks": sum(c.get(g, 0) for c in counts),
                      "failures": [f for fl in every for f in fl.get(g, [])],
                      "seconds": times.get(g)} for g in CK.checks}
        for group, rep in report.items():
            print(f"mpi_checks P={P} {group:16s} {rep['checks']:6d} checks "
                  f"{len(rep['failures']):4d} failures  {rep['seconds']} s", flush=True)
        for rep in report.values():
            for f in rep["failures"][:25]:
                print("FAIL " + f, flush=True)
        print(f"mpi_checks P={P}: {checks} checks, {total} failures, {elapsed:.1f} s", flush=True)
        if args.report:
            with open(args.report, "w") as fh:
                json.dump(report, fh, indent=1)
    sys.stdout.flush()
    if total:
        sys.exit(1)


def inject(args):
    """Deliberate failures on rank 1 (rank 0 when alone), to prove they reach the exit status."""
    bad = min(1, P - 1)
    comm = ringcoll.Communicator()
    if args.inject == "check":
        CK.start("inject")
        y = comm.allreduce(np.array([1]))
        CK.check(y.tolist() == [P] and RANK != bad, "injected failure: this check fails on purpose")
        finish(args, {}, 0.0)
        sys.exit(0)
    if args.inject == "raise":
        if RANK == bad:  # the others wait for it inside a ringcoll collective
            raise RuntimeError("injected exception on purpose")
        comm.allreduce(np.ones(10), algorithm="ring")
        comm.barrier()
    if args.inject == "stuck":  # an exception inside a group, where the others still wait
        CK.start("inject")
        try:
            if RANK == bad:
                raise RuntimeError("injected exception inside a group")
            comm.allreduce(np.ones(10), algorithm="ring")
        except RuntimeError as exc:
            CK.check(False, str(exc))
        sync("inject", args.sync_timeout)
    finish(args, {}, 0.0)
    sys.exit(0)


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - never leave the other ranks hanging
        print(f"rank {RANK}/{P}: unexpected exception, aborting the job:\n"
              f"{traceback.format_exc()}", file=sys.stderr, flush=True)
        WORLD.Abort(1)
