"""Bounded caches: BoundedCache itself, and every per-size cache of a communicator stays
within its bound however many sizes a job runs (bench/soak.py shows the RSS side of it)."""

import numpy as np
import pytest

import ringcoll
from ringcoll.cache import DEFAULT_LIMIT, BoundedCache


def test_bounded_cache_forgets_the_oldest_entry():
    c = BoundedCache(3)
    for k in "abcd":
        c[k] = k.upper()
    assert list(c) == ["b", "c", "d"] and c.get("a") is None
    c["b"] = "again"  # an existing key is updated in place: nothing is evicted
    assert list(c) == ["b", "c", "d"] and c["b"] == "again"
    assert c.put("e", 5) == 5 and list(c) == ["c", "d", "e"]
    assert c.put("f", 6) == 6 and list(c) == ["d", "e", "f"] and len(c) == 3
    with pytest.raises(ValueError):
        BoundedCache(0)


@pytest.mark.parametrize("algorithm", [None, "ring", "recursive_doubling", "hierarchical"])
def test_a_communicator_holds_at_most_the_bound_per_cache(algorithm):
    sizes = range(1, 2 * DEFAULT_LIMIT + 200)

    def body(comm):
        src = np.ones(sizes[-1], np.float32)
        dst = np.empty_like(src)
        for n in sizes:  # every call a new size
            comm.allreduce(src[:n], out=dst[:n], algorithm=algorithm)
            assert dst[0] == dst[n - 1] == comm.size
        comm.reduce_scatter(src[:7])
        comm.allgather(src[:5])
        return (len(comm._g.choices), len(comm._g.host.ws._plans), len(comm._g.host.reductions))

    for choices, plans, reductions in ringcoll.run_threads(3, body, local_size=2, timeout=60):
        assert choices <= DEFAULT_LIMIT and plans <= DEFAULT_LIMIT and reductions == 1
        if algorithm in (None, "hierarchical"):
            assert choices == DEFAULT_LIMIT  # it did fill up: the bound, not the sizes, limits it
        if algorithm in ("ring", "hierarchical"):  # they cache partitions and segment lists
            assert plans == DEFAULT_LIMIT


def test_debug_mode_prints_each_call_once_and_remembers_a_bounded_number(capfd):
    def body(comm):
        for n in range(1, DEFAULT_LIMIT + 50):
            comm.allreduce(np.ones(n), algorithm="ring")
        comm.allreduce(np.ones(DEFAULT_LIMIT + 10), algorithm="ring")  # printed before: not again
        return len(comm._runner._printed)

    printed = ringcoll.run_threads(2, body, debug=True, timeout=60)
    assert printed[0] == DEFAULT_LIMIT and printed[1] == 0
    err = capfd.readouterr().err
    assert err.count("-> ring") == DEFAULT_LIMIT + 49
