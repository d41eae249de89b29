"""Bounded caches: what a communicator remembers per message size never grows without limit.

Every per-size cache of ringcoll (auto's choices, partitions, pipeline segment lists,
schedules, debug mode's printed calls) is a BoundedCache. A lookup is a plain dict lookup, so
the hot path of a repeated size costs what it did with an unbounded dict; an insertion into a
full cache first forgets the oldest entry. That is not quite LRU (a hit does not refresh an
entry's age, which would cost a write on every hit of the hot path), but it has the property
that matters: a size used again after `limit` other sizes costs one rebuild, and a job that
walks through 100,000 sizes holds `limit` of them, not 100,000 (bench/soak.py).
"""

#: entries per cache. One all-reduce size needs about 3 (its auto choice, its partition and
#: one or two segment lists), so 512 keeps the sizes of a few hundred distinct tensors (a
#: model's buckets) warm, while a cache of small tuples and lists stays well under 1 MiB.
DEFAULT_LIMIT = 512


class BoundedCache(dict):
    """A dict of at most `limit` entries; put() evicts the oldest-inserted one when full.

    Reads are dict's own (get, `in`, [key]); writes go through cache[key] = value or put(),
    which keep the bound (dict.update and setdefault would not: do not use them).
    """

    __slots__ = ("limit",)

    def __init__(self, limit=DEFAULT_LIMIT):
        super().__init__()
        if limit < 1:
            raise ValueError(f"a BoundedCache needs limit >= 1, got {limit}")
        self.limit = limit

    def __setitem__(self, key, value):
        if key not in self and len(self) >= self.limit:
            del self[next(iter(self))]  # dicts keep insertion order: this is the oldest
        dict.__setitem__(self, key, value)

    def put(self, key, value):
        """Store value under key (forgetting the oldest entry if full); returns value."""
        self[key] = value
        return value
