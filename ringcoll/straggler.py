"""Stragglers on purpose: slow one rank down by a factor, without burning the shared cores.

    slow = ringcoll.straggler.Slowdown.for_rank("1:2", comm.rank)   # rank 1 runs 2x slower
    for batch in data:
        with slow:
            compute(batch)            # forward + backward
        opt.step()

Schedule. After the block, the rank sleeps (factor - 1) x the block's elapsed time, so the
block plus the sleep takes factor x as long as the block alone. Sleeping, not spinning: on a
machine whose ranks share cores (2 cores at -n 2 or -n 4), a busy-waiting straggler would take
CPU from the others and slow them too, and the experiment would measure that instead.

Cost: two clock reads per block, and the sleep itself. factor 1 never sleeps.

Guarantee: the block's own work is unchanged (the sleep comes after it, outside it), so a
slowed run computes exactly what an unslowed one does; only its timing differs. time.sleep
may overshoot by its scheduling granularity (tens of microseconds on Linux), so a factor is
exact to that.

The spec "RANK:FACTOR[,RANK:FACTOR...]" ("1:2", "0:1.5,3:4") lets a benchmark's command line
or environment choose the slowed rank(s); ranks not named run at factor 1.
"""

import time

from .errors import InvalidArgumentError


class Slowdown:
    """`with slow: work()` takes `factor` times as long as work() alone.

    Args:
        factor: >= 1; 1 is a no-op.
        clock: a function returning seconds (default time.perf_counter); tests pass a fake.
        sleep: a function sleeping that many seconds (default time.sleep); tests pass a fake.
        rank: only used in error messages.

    Attributes:
        elapsed: the last block's own time (before the sleep), seconds.
        slept: the total seconds slept so far.
    """

    def __init__(self, factor=1.0, clock=time.perf_counter, sleep=time.sleep, rank=None):
        ctx = f"ringcoll rank {rank}, Slowdown: " if rank is not None else "ringcoll, Slowdown: "
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1:
            raise InvalidArgumentError(f"{ctx}factor must be a number >= 1 (1 = not slowed), "
                                       f"got {factor!r}")
        self.factor = float(factor)
        self._clock, self._sleep = clock, sleep
        self._start = None
        self.elapsed = 0.0
        self.slept = 0.0

    @classmethod
    def for_rank(cls, spec, rank, **kwargs):
        """The Slowdown of `rank` under spec "RANK:FACTOR[,RANK:FACTOR...]" (factor 1 if the
        rank is not named; None or "" slows nobody)."""
        return cls(parse_spec(spec, rank).get(rank, 1.0), rank=rank, **kwargs)

    def __enter__(self):
        self._start = self._clock()
        return self

    def __exit__(self, *exc):
        self.elapsed = self._clock() - self._start
        if exc[0] is None and self.factor > 1 and self.elapsed > 0:
            extra = (self.factor - 1) * self.elapsed
            self._sleep(extra)
            self.slept += extra
        return False


def parse_spec(spec, rank=None):
    """"1:2,3:4" -> {1: 2.0, 3: 4.0}; None or "" -> {}. Raises InvalidArgumentError naming
    the bad entry."""
    ctx = f"ringcoll rank {rank}, Slowdown: " if rank is not None else "ringcoll, Slowdown: "
    out = {}
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        r, sep, f = item.partition(":")
        try:
            r, f = int(r), float(f)
        except ValueError:
            r = f = None
        if not sep or r is None or r < 0 or not f >= 1:
            raise InvalidArgumentError(f"{ctx}bad entry {item!r} in {spec!r}; write "
                                       "RANK:FACTOR with RANK >= 0 and FACTOR >= 1, e.g. '1:2'")
        out[r] = f
    return out
