"""Bruck all-reduce: gather every rank's buffer in ceil(log2 p) steps, then reduce locally.

For tiny messages when p is not a power of two. Recursive doubling then needs its fold: two
more messages on the critical path (3 for p = 3, where log2 would say 2). Bruck's all-gather
(Bruck, Ho, Kipnis, Upfal, Weathersby, 1997) needs ceil(log2 p) steps for any p:

    rank r starts with its own buffer in slot 0 of a p-slot scratch;
    at step k (distance d = 2^k, while it has h = d slots filled) it sends slots 0 .. c-1 to
    rank r - d and receives c slots from rank r + d into slots h .. h+c-1, where
    c = min(d, p - h) is how many the receiver still lacks;
    afterwards slot i holds the buffer of rank (r + i) mod p.

Then every rank reduces the p buffers itself, in rank order 0, 1, ..., p-1, so every rank
computes the same operations on the same operands in the same order: bitwise identical
results everywhere.

Cost: ceil(log2 p) a + (p-1) n b + (p-1) n g. Every rank receives and reduces p-1 whole
buffers, so it pays only where latency is everything: a few KiB at most (MAX_BYTES).
"""

from functools import partial

import numpy as np

from ..transport import Tag

#: neither auto's cost model nor its tuner considers it above this many bytes per rank: the
#: p-slot scratch and the (p-1) n bytes moved make it lose long before, and grow without bound
MAX_BYTES = 64 << 10


def schedule(t, src, dst, combine, ws):
    """The steps that set dst = reduction of every rank's src (dst may be src: in place)."""
    p, r, n = t.size, t.rank, dst.size
    if p == 1:  # (n == 0 still exchanges its empty messages: a rank passing more sees them)
        return [] if dst is src else [partial(np.copyto, dst, src)]
    flat = ws.scratch("bruck.slots", p * n, dst.dtype)
    slots = flat.reshape(p, n)  # slots[i] is flat[i * n:(i + 1) * n]
    steps = [partial(np.copyto, slots[0], src)]
    have, d = 1, 1
    while have < p:
        c = min(d, p - have)
        steps.append(t.bind_sendrecv(flat[:c * n], (r - d) % p,
                                     flat[have * n:(have + c) * n], (r + d) % p, Tag.BRUCK))
        have, d = have + c, 2 * d

    def of_rank(j):  # the slot that holds rank j's buffer
        return slots[(j - r) % p]

    steps.append(combine.bind(of_rank(0), of_rank(1), dst))
    for j in range(2, p):
        steps.append(combine.bind(dst, of_rank(j), dst))
    return steps


def allreduce(t, src, dst, combine, ws):
    """dst = reduction of every rank's src. dst may be src (in place)."""
    for step in schedule(t, src, dst, combine, ws):
        step()


def allgather(t, mine, tag):
    """Bruck's all-gather alone: a (p, mine.size) array whose row j is rank j's `mine`.

    The schedule above without the reduction: ceil(log2 p) sendrecv steps; at the step with
    distance d, rank r sends the buffers it holds (its own and the next ones, r .. r + have
    - 1) to r - d and receives those of r + d .. from r + d, so every rank receives the other
    p - 1 ranks' buffers once. For the few numbers all ranks must see before a collective
    moves data (debug mode's fingerprints, alltoallv's verdict on its exchanged counts).
    """
    p, r, n = t.size, t.rank, mine.size
    slots = np.empty((p, n), mine.dtype)  # slots[i]: rank (r + i) % p's buffer
    flat = slots.reshape(-1)
    slots[0] = mine
    have, d = 1, 1
    while have < p:
        c = min(d, p - have)
        t.sendrecv(flat[:c * n], (r - d) % p, flat[have * n:(have + c) * n], (r + d) % p, tag)
        have, d = have + c, 2 * d
    return np.roll(slots, r, axis=0)  # row j = slots[(j - r) % p]: rank order
