"""Both sides of the size thresholds inside the algorithms, at every small p.

recursive_doubling reduces straight into dst up to SMALL bytes and ping-pongs between dst and a
scratch buffer above; ring reduces an in-place block into its scratch and copies it over up to
STILL_CACHED bytes, and in place above. The grid tests hit whichever side their sizes fall on;
these tests move the thresholds so that every path runs on small, exactly checkable data.
"""

import numpy as np
import pytest

import ringcoll
from ringcoll.algorithms import recursive_doubling, ring

import _oracle as O


@pytest.mark.parametrize("threshold", [0, 1 << 30], ids=["above", "below"])
@pytest.mark.parametrize("algorithm",
                         ["ring", "recursive_doubling", "rabenseifner", "bruck", "hierarchical"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 6])
def test_both_sides_of_the_size_thresholds(monkeypatch, threshold, algorithm, p):
    monkeypatch.setattr(recursive_doubling, "SMALL", threshold)
    monkeypatch.setattr(ring, "STILL_CACHED", threshold)
    cases = [(count, in_place, dtype, op)
             for count in (0, 1, p - 1, p + 1, 257)
             for in_place in (False, True)
             for dtype, op in (("float64", "sum"), ("int32", "max"), ("float32", "avg"))]

    def body(comm):
        got = []
        for k, (count, in_place, dtype, op) in enumerate(cases):
            x = O.make_input(k, comm.rank, (count,), dtype, op)
            src, out = (x.copy(), None) if in_place else (x, np.empty_like(x))
            out = src if in_place else out
            for _ in range(2):  # the second call replays the first's schedule
                src[...] = x
                comm.allreduce(src, op=op, algorithm=algorithm, out=out)
            got.append(out.copy())
        return got

    results = ringcoll.run_threads(p, body, timeout=20, local_size=2, segment_bytes=64)
    for k, (count, in_place, dtype, op) in enumerate(cases):
        want = O.reduce_oracle([O.make_input(k, r, (count,), dtype, op) for r in range(p)],
                               op, dtype)
        for r in range(p):
            bad = O.compare(results[r][k], want, op, dtype, nranks=p)
            assert not bad, f"{algorithm} p={p} {cases[k]} rank {r}: {bad}"
