"""Recursive-doubling prefix reduction: inclusive scan and exclusive scan (MPICH's MPIR_Scan).

Each rank keeps two values: `partial`, the reduction of every rank in its aligned block of
2^k ranks (its own x at the start), and `result`, the reduction of the ranks of that block up
to itself (inclusive: its own x; exclusive: nothing yet).

For mask = 1, 2, 4, ... < p, with partner = rank ^ mask (a step without a partner, partner >= p,
is skipped: that is all it takes for p not a power of two):
    exchange partial with the partner (one sendrecv: never a deadlock);
    partner < rank: the received data is the reduction of the lower half of the new block,
        every rank of it below this one, so
            partial = op(recv, partial)
            result  = op(recv, result)      (exclusive, the first time: result = recv)
    partner > rank: partial = op(partial, recv).
Every op has the lower ranks' data first, so the result is the reduction in rank order,
bracketed as MPICH brackets it: float results are deterministic, and an op need not commute.
The partial of a rank's last exchange is never sent on, so it is not computed.

Inclusive rank 0 has no lower partner (its result is its own x); exclusive rank 0 gets
nothing. Every other rank has a lower partner at its lowest set bit.

Cost: ceil(log2 p) (a + n b + 2 n g) at most (n: x's bytes; the rank with the most partners
pays it); each rank sends one message of n bytes per partner. Exclusive scan costs the same
(its first lower step copies instead of reducing).

Buffers: src is only read (except by dst's writes when dst is src: in place); the partial
lives in a scratch buffer after the first exchange and the receives go to a second one.
"""

from ..transport import Tag


def partners(rank, p):
    """This rank's partners, in step order: rank ^ mask for mask = 1, 2, 4, ... < p, where < p."""
    found, mask = [], 1
    while mask < p:
        if rank ^ mask < p:
            found.append(rank ^ mask)
        mask <<= 1
    return found


def scan(t, src, dst, combine, ws, exclusive=False):
    """dst = op(src of ranks 0 .. rank) (exclusive: 0 .. rank - 1); dst may be src (in place).

    Exclusive, rank 0: dst is not written (it may be None). Returns nothing.
    """
    rank = t.rank
    steps = partners(rank, t.size)
    recv = ws.scratch("scan.recv", src.size, src.dtype) if steps else None
    acc = ws.scratch("scan.partial", src.size, src.dtype) if len(steps) > 1 else None
    partial = src  # this block's reduction so far: x itself until the first exchange
    result = None if exclusive else src  # the ranks of the block up to this one (see doc)
    for i, partner in enumerate(steps):
        t.sendrecv(partial, partner, recv, partner, Tag.SCAN)
        more = i + 1 < len(steps)  # is partial sent again? (else it is not needed)
        if partner < rank:  # recv: ranks below this one's block
            if more:  # before result: with dst as src (in place) result's write clobbers src
                combine(recv, partial, acc)
                partial = acc
            if result is None:  # exclusive, the first lower data: it is the result so far
                dst[...] = recv
            else:
                combine(recv, result, dst)
            result = dst
        elif more:  # recv: ranks above this one's block
            combine(partial, recv, acc)
            partial = acc
    if result is src and dst is not src:  # inclusive rank 0 (and p = 1): its own x
        dst[...] = src
