"""The repeat fast path of every collective but allreduce (runner.Repeat): a call with the very
same arrays and equal other arguments as the last call of that collective runs the plan built
then. These tests hold every repeated call to the answer a fresh call gives, on every rank,
while the values change every call and the arguments change between some calls (root, counts
mutated in place, another out, a dtype or shape changed in place, another collective in
between), and check that a repeat does skip the planning (else the fast path is gone)."""

import numpy as np
import pytest

import ringcoll
from ringcoll.runner import Runner

TIMEOUT = 30
PS = [1, 2, 3, 5]


def run(p, fn):
    return ringcoll.run_threads(p, fn, timeout=TIMEOUT)


def data(rank, call, n, dtype=np.int64):
    """Rank `rank`'s rows at call number `call` (exact in every dtype used here)."""
    return ((np.arange(n) * (rank + 2) + 5 * call + 3 * rank) % 29).astype(dtype)


def rows(p, n):
    """Uneven row counts for an uneven collective: rank r has rows(p, n)[r]."""
    return [n + (r % 3) for r in range(p)]


def calls(comm, n, k, roots):
    """Every collective once, at call number k, on arrays made once per (comm, n) and kept in
    comm's cache: (name, result copy, expected)."""
    p, r = comm.size, comm.rank
    a = comm._test_arrays.setdefault(n, {})  # the very same arrays every call
    def buf(name, shape, dtype=np.int64):
        if name not in a:
            a[name] = np.zeros(shape, dtype)
        return a[name]
    every = [data(q, k, n) for q in range(p)]
    total = sum(every)
    root = roots[k % len(roots)] % p
    out = []

    x = buf("x", n)
    x[...] = every[r]
    b = buf("bcast", n)
    b[...] = every[root] if r == root else -1
    out.append(("broadcast", comm.broadcast(b, root=root).copy(), every[root]))
    y = buf("reduce_out", n)
    got = comm.reduce(x, root=root, out=y)
    out.append(("reduce", None if got is None else got.copy(), total if r == root else None))
    out.append(("scan", comm.scan(x, out=buf("scan_out", n)).copy(), sum(every[:r + 1])))
    got = comm.exscan(x, out=buf("exscan_out", n))
    out.append(("exscan", None if got is None else got.copy(),
                sum(every[:r]) if r > 0 else None))
    big = buf("big", n * p)
    big[...] = np.concatenate([every[r] + 100 * q for q in range(p)])
    want = np.concatenate([every[q] + 100 * r for q in range(p)])
    out.append(("alltoall", comm.alltoall(big, out=buf("a2a_out", n * p)).copy(), want))
    full = np.concatenate(every)
    out.append(("allgather", comm.allgather(x, out=buf("ag_out", n * p)).copy(), full))
    got = comm.gather(x, root=root, out=buf("g_out", n * p))
    out.append(("gather", None if got is None else got.copy(), full if r == root else None))
    src = buf("sc_in", n * p)
    src[...] = full
    got = comm.scatter(src, root=root, out=buf("sc_out", n))
    out.append(("scatter", got.copy(), every[r]))
    rs_in = buf("rs_in", n * p)
    rs_in[...] = np.concatenate([every[r] * (q + 1) for q in range(p)])
    rs_want = sum(every) * (r + 1)
    out.append(("reduce_scatter", comm.reduce_scatter(rs_in, out=buf("rs_out", n)).copy(),
                rs_want))
    # uneven: each rank's own count, mutated in place between calls (see the test)
    counts = a.setdefault("counts", rows(p, n))
    mine = buf(("v", counts[r]), counts[r])
    mine[...] = (np.arange(counts[r]) + 10 * r + k)
    gathered = comm.allgather(mine, out=buf(("agv", sum(counts)), sum(counts)), counts=counts)
    want = np.concatenate([np.arange(c) + 10 * q + k for q, c in enumerate(counts)])
    out.append(("allgather counts=", gathered.copy(), want))
    comm.barrier()
    return out


def check(results):
    for rank, per_call in enumerate(results):
        for k, made in enumerate(per_call):
            for name, got, want in made:
                if want is None:
                    assert got is None, f"rank {rank} call {k} {name}: {got}"
                else:
                    np.testing.assert_array_equal(got, want,
                                                  err_msg=f"rank {rank} call {k} {name}")


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("n", [0, 1, 4])
def test_repeated_calls_give_fresh_answers_as_values_and_roots_change(p, n):
    """Ten rounds of every collective on the same arrays: new values every round, the root
    changing every third round, the uneven counts list mutated in place at round 5 (the same
    list object, other values: a repeat must see it)."""
    def body(comm):
        comm._test_arrays = {}
        made = []
        for k in range(10):
            if k == 5:
                counts = comm._test_arrays.setdefault(n, {}).setdefault("counts", rows(p, n))
                counts[-1] += 1  # in place: the same list, a new call
            made.append(calls(comm, n, k, roots=[0, 0, 0, p - 1, p - 1, p - 1, 1, 1, 1, 0]))
        return made

    check(run(p, body))


@pytest.mark.parametrize("p", [2, 3])
def test_a_repeat_skips_the_planning_and_a_changed_call_plans_anew(p, monkeypatch):
    """Counted through Runner.plan: identical calls plan once per collective; a changed root,
    another out, an array reshaped or retyped in place, plan again."""
    planned = []
    original = Runner.plan

    def counting(self, collective, *args, call=None):
        if self.g.rank == 0:
            planned.append(collective.NAME)
        return original(self, collective, *args, call=call)

    monkeypatch.setattr(Runner, "plan", counting)

    def body(comm):
        x, y, z = np.arange(6.0), np.empty(6), np.empty(6)
        for _ in range(4):
            comm.broadcast(x, root=0)
            comm.reduce(x, root=1, out=y)
            comm.barrier()
        comm.broadcast(x, root=1)  # another root: plans
        comm.reduce(x, root=1, out=z)  # another out: plans
        x.shape = (2, 3)  # the same object, reshaped in place: plans
        comm.broadcast(x, root=1)
        x.dtype = np.int64  # the same object, retyped in place: plans
        comm.broadcast(x, root=1)
        return True

    assert all(run(p, body))
    assert planned.count("barrier") == 1, planned
    assert planned.count("reduce") == 2, planned
    assert planned.count("broadcast") == 4, planned


def test_repeat_matching_of_every_kind_of_argument():
    """Repeat.matches alone (its one C comparison of the whole tuple): equal values match,
    whatever their type's spelling (numpy ints), counts given as an array too; another
    value, another container type, an array where a value or None was, another array, or an
    array changed in place do not (and nothing raises: an array's == has no truth value)."""
    from ringcoll.runner import Plan, Repeat

    x, out = np.zeros(4), np.zeros(4)
    made = Repeat((x, 0, out, None, [2, 2], True), (0, 2), Plan("t", None, None, None))
    assert made.matches((x, 0, out, None, [2, 2], True))
    assert made.matches((x, np.int64(0), out, None, [np.int64(2), 2], True))
    for other in [(x, 1, out, None, [2, 2], True), (x, 0, out, "ring", [2, 2], True),
                  (x, 0, out, None, [2, 3], True), (x, 0, out, None, (2, 2), True),
                  (x, 0, out, None, np.array([2, 2]), True), (x, 0, out, np.zeros(3), [2, 2],
                  True), (x, 0, np.zeros(4), None, [2, 2], True), (x, 0, out, None, [2, 2]),
                  (np.zeros(4), 0, out, None, [2, 2], True)]:
        assert not made.matches(other), other
    counted = Repeat((x, np.array([2, 3])), (0,), Plan("t", None, None, None))
    assert counted.matches((x, np.array([2, 3])))  # counts as an array: compared frozen
    assert not counted.matches((x, np.array([2, 4])))
    assert not counted.matches((x, [2, 3]))  # a list where an array (kept as a tuple) was
    left_out = Repeat((x, 0, None), (0, 2), Plan("t", None, None, None))
    assert left_out.matches((x, 0, None))
    assert not left_out.matches((x, 0, out))
    assert not left_out.matches((x, 0, np.zeros(1)))
    x.shape = (2, 2)  # the same object, reshaped in place
    assert not made.matches((x, 0, out, None, [2, 2], True))


def test_no_repeat_without_out_or_for_a_copied_input():
    """A call that allocates its result, or works on a copy of a non-contiguous x, is never
    repeated: every call returns a new array, and a strided x's new values are read."""
    def body(comm):
        x = np.zeros(8)
        results = []
        for k in range(3):
            x[...] = k + comm.rank
            results.append(comm.allgather(x))  # no out=: a new array each call
        assert results[0] is not results[1]
        strided = np.zeros(16)[::2]
        got = []
        for k in range(3):
            strided[...] = k
            got.append(comm.scan(strided, out=np.empty(8)).copy())
        return [r.copy() for r in results], got

    for rank, (results, got) in enumerate(run(3, body)):
        for k, r in enumerate(results):
            np.testing.assert_array_equal(r, np.repeat([k, k + 1, k + 2], 8))
        for k, g in enumerate(got):
            np.testing.assert_array_equal(g, np.full(8, k * (rank + 1)))


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_rows_that_ride_with_the_counts_as_sizes_grow_and_shrink(p):
    """allgather and gather with row counts that change call to call (growing past the slot,
    shrinking, zero, one rank only, past SLOT_MAX), uneven across ranks, a structured dtype
    among them: every result equals NumPy's concatenation, on every rank, whether the rows
    came in the count exchange or after it."""
    from ringcoll.collectives.allgather import SLOT_MAX

    rec = np.dtype([("a", np.int8), ("b", np.float64)])  # padded: its bytes must all arrive
    plans = [[3] * p, [3] * p, [5] * p, [5] * p, [1] * p, [0] * p, [0] * p,
             [r % 2 for r in range(p)], [4 + r for r in range(p)], [4 + r for r in range(p)],
             [SLOT_MAX // 8 + 1] * p, [2] * p, [2] * p]

    def rows_of(q, k, n, dtype):
        x = np.zeros(n, dtype)
        if dtype == rec:
            x["a"], x["b"] = q + k, np.arange(n) + 0.5 * q
        else:
            x[...] = np.arange(n) + 100 * q + k
        return x

    def body(comm):
        made = []
        for k, counts in enumerate(plans):
            for dtype in (np.float64, rec):
                x = rows_of(comm.rank, k, counts[comm.rank], dtype)
                out = np.empty(sum(counts), dtype)
                got = comm.allgather(x, out=out)
                root = k % p
                g = comm.gather(x, root=root)
                want = np.concatenate([rows_of(q, k, c, dtype) for q, c in enumerate(counts)])
                made.append((k, dtype, got.tobytes() == want.tobytes(),
                             g is None if comm.rank != root else g.tobytes() == want.tobytes()))
        return made

    for rank, made in enumerate(run(p, body)):
        for k, dtype, ag, ga in made:
            assert ag and ga, f"rank {rank} call {k} {dtype}: allgather ok {ag}, gather ok {ga}"


@pytest.mark.parametrize("p", [2, 3])
def test_a_repeated_small_allgather_is_one_exchange(p):
    """The traced messages: the first call exchanges the counts, then the rows; a repeat
    carries the rows in its count exchange, so it sends p-1 messages per rank, not 2(p-1)."""
    from ringcoll.collectives.allgather import META

    def body(comm):
        x, out = np.full(3, float(comm.rank)), np.empty(3 * comm.size)
        comm.allgather(x, out=out)
        with comm.trace() as trace:
            comm.allgather(x, out=out)
        assert (out == np.repeat(np.arange(comm.size), 3)).all()
        return [m.nbytes for m in trace.messages if m.src == comm.rank]

    for rank, sent in enumerate(run(p, body)):
        assert sent == [META * 8 + 24] * (p - 1), f"rank {rank}: {sent}"


def test_two_plans_of_one_collective_share_the_slot_size():
    """Two allgathers on different arrays alternate (two plans), one with bigger rows: the slot
    size the communicator keeps changes under each plan between its calls; every result must
    still be right (each plan's buffers follow the slot size it finds)."""
    def body(comm):
        small, big = np.full(2, comm.rank, np.int64), np.full(40, comm.rank, np.int64)
        out_s, out_b = np.empty(2 * comm.size, np.int64), np.empty(40 * comm.size, np.int64)
        ok = []
        for k in range(6):
            small[...], big[...] = comm.rank + k, comm.rank - k
            a = comm.allgather(small, out=out_s).copy()
            b = comm.allgather(big, out=out_b).copy()
            ok.append((a == np.repeat(np.arange(comm.size) + k, 2)).all()
                      and (b == np.repeat(np.arange(comm.size) - k, 40)).all())
        return ok

    assert all(all(ok) for ok in run(3, body))


@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_scatter_blocks_that_ride_in_the_header_as_sizes_change(p):
    """Scatter with block sizes changing call to call (growing past the slot, shrinking, zero,
    uneven, past CARRY_MAX), roots changing, a padded structured dtype, out given and not: each
    rank's block equals root's rows, whether it came in the header or down the tree; then a
    bad out= after small repeated calls is still refused on every rank alike."""
    from ringcoll.collectives.scatter import CARRY_MAX

    rec = np.dtype([("a", np.int8), ("b", np.float64)])
    plans = [[2] * p, [2] * p, [3] * p, [3] * p, [0] * p, [1] * p, [r for r in range(p)],
             [r for r in range(p)], [CARRY_MAX // 8] * p, [1] * p, [1] * p]

    def rows(k, n, dtype):
        x = np.zeros(n, dtype)
        if dtype == rec:
            x["a"], x["b"] = k, np.arange(n) + 0.25
        else:
            x[...] = np.arange(n) * 3 + k
        return x

    def body(comm):
        ok = []
        for k, counts in enumerate(plans):
            root = (k // 2) % p
            for dtype in (np.int64, rec):
                full = rows(k, sum(counts), dtype)
                x = full if comm.rank == root else None
                out = np.empty(counts[comm.rank], dtype) if (k + comm.rank) % 3 else None
                if dtype == rec and out is None and comm.rank != root:
                    out = np.empty(counts[comm.rank], dtype)  # structured: out= needed
                for _ in range(2):  # the same call twice: the second may carry
                    got = comm.scatter(x, root=root, counts=counts, out=out)
                    lo = sum(counts[:comm.rank])
                    ok.append(got.tobytes() == full[lo:lo + counts[comm.rank]].tobytes())
        # a wrong out on the last rank after small repeated calls: every rank raises
        errors = []
        for _ in range(2):
            n = 3 if comm.rank == comm.size - 1 and comm.size > 1 else 2
            try:
                comm.scatter(np.arange(2.0 * comm.size) if comm.rank == 0 else None,
                             out=np.empty(n))
                errors.append(None)
            except ringcoll.RingcollError as e:
                errors.append(type(e).__name__)
        got = comm.scatter(np.arange(2.0 * comm.size) if comm.rank == 0 else None,
                           out=np.empty(2))  # and a right call after the refusals works
        ok.append((got == [2.0 * comm.rank, 2.0 * comm.rank + 1]).all())
        return ok, errors

    for rank, (ok, errors) in enumerate(run(p, body)):
        assert all(ok), f"rank {rank}: {ok}"
        if p > 1:
            want = "InvalidArgumentError" if rank == p - 1 else "PeerFailedError"
            assert errors == [want, want], f"rank {rank}: {errors}"


@pytest.mark.parametrize("p", [2, 3])
def test_a_repeated_small_scatter_sends_no_third_step(p):
    """Traced: a repeated small scatter is the records up and the header (with the blocks)
    down; no message of the data tree (tag 'scatter')."""
    def body(comm):
        x = np.arange(4.0 * comm.size) if comm.rank == 0 else None
        out = np.empty(4)
        comm.scatter(x, out=out)
        with comm.trace() as trace:
            comm.scatter(x, out=out)
        assert (out == np.arange(4.0) + 4 * comm.rank).all()
        return sorted({m.tag for m in trace.messages})

    for rank, tags in enumerate(run(p, body)):
        assert "scatter" not in tags and tags, f"rank {rank}: {tags}"


@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_alltoallv_repeats_with_counts_changing_and_a_refusal_after(p):
    """alltoallv on the same arrays, with out=, called repeatedly while the counts change every
    few calls (the counts list changed in place), every result against the blocks the senders
    sent; then one rank's wrong recv_counts after repeated calls is refused on every rank."""
    def body(comm):
        r = comm.rank
        x = np.arange(4 * p, dtype=np.int64) + 100 * r
        counts = [(r + q) % 3 for q in range(p)]
        results = []
        for k in range(6):
            if k == 3:
                counts[:] = [1 + (r * q) % 2 for q in range(p)]  # in place: a new call
            sent = sum(counts)
            x[:sent] = np.arange(sent) + 100 * r + k
            incoming = comm.allgather(np.array(counts))  # what every rank sends whom
            rows = [int(incoming[q * p + r]) for q in range(p)]
            out = comm._test_out = getattr(comm, "_test_out", {})
            buf = out.setdefault(sum(rows), np.empty(sum(rows), np.int64))
            got = comm.alltoallv(x[:sent], counts, out=buf)
            want = []
            for q in range(p):
                theirs = [int(incoming[q * p + j]) for j in range(p)]
                lo = sum(theirs[:r])
                want += (np.arange(lo, lo + theirs[r]) + 100 * q + k).tolist()
            results.append(got.tolist() == want)
        errors = []
        for _ in range(2):
            bad = [0] * p if r == p - 1 and p > 1 else None
            try:
                comm.alltoallv(x[:sum(counts)], counts, out=buf, recv_counts=bad)
                errors.append(None)
            except ringcoll.RingcollError as e:
                errors.append(type(e).__name__)
        return results, errors

    for rank, (results, errors) in enumerate(run(p, body)):
        assert all(results), f"rank {rank}: {results}"
        if p > 1:
            want = "CollectiveMismatchError" if rank == p - 1 else "PeerFailedError"
            assert errors == [want, want], f"rank {rank}: {errors}"
