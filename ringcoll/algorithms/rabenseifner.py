"""Rabenseifner all-reduce: recursive-halving reduce-scatter + recursive-doubling all-gather.

Bandwidth like the ring, latency like recursive doubling: 2 log2(p) steps instead of 2(p-1).
Non-powers of two use the same fold as recursive_doubling (p' = largest power of two <= p).

The buffer is cut into p' blocks. Reduce-scatter, mask = p'/2, p'/4, ..., 1: rank r (core
numbering) and partner r XOR mask split their current range of blocks in half; the rank whose
`mask` bit is set keeps the upper half, the other the lower; each sends the half it gives up
and reduces the half it keeps. Bit by bit from the top, rank r ends owning block r.

All-gather, mask = 1, 2, ..., p'/2: rank r and r XOR mask swap their ranges (each 'mask'
blocks long, adjacent), doubling what each holds until everyone has all p' blocks.

Each halving step reduces into the buffer it has just received into (two scratch buffers of
n/2 and n/4 take turns), never into the half it has just sent: see recursive_doubling for why
that matters on shared memory. The finished block is copied into dst, where the all-gather
then receives every other block directly. Like recursive_doubling, the steps are built as a
list once (schedule) and then run, so a caller can replay them.

Cost: 2 log2(p') a + 2 (p'-1)/p' n b + (p'-1)/p' n g, plus the fold (2 a + 2 n b + n g)
when p is not a power of two. Each block is reduced by one rank only, so results are bitwise
identical everywhere.
"""

from functools import partial

import numpy as np

from ..transport import Tag
from .recursive_doubling import core_rank, fold, fold_in, fold_out, real_rank


def schedule(t, src, dst, combine, ws):
    """The steps that set dst = reduction of every rank's src (dst may be src: in place)."""
    p, n = t.size, dst.size
    if p == 1:  # (n == 0 still exchanges its empty messages: a rank passing more sees them)
        return [] if dst is src else [partial(np.copyto, dst, src)]
    core, rem = fold(p)
    folds_in = t.rank < 2 * rem and t.rank % 2 == 1
    fold_buf = ws.scratch("rab.fold", n, dst.dtype) if folds_in else None
    steps, cur = fold_in(t, src, fold_buf, combine, rem)  # cur: this rank's data so far
    me = core_rank(t.rank, rem)
    if me >= 0:
        start = ws.partition(n, core).starts  # block b is dst[start[b]:start[b + 1]]
        lo, hi = 0, core  # the blocks this rank is responsible for
        base = 0  # cur[i] holds element base + i of the buffer

        mask, turn = core >> 1, 0
        while mask:
            partner = me ^ mask
            peer = real_rank(partner, rem)
            mid = (lo + hi) // 2
            (keep_lo, keep_hi), (give_lo, give_hi) = (
                ((mid, hi), (lo, mid)) if me & mask else ((lo, mid), (mid, hi))
            )
            into = ws.scratch(("rab.a", "rab.b")[turn], start[keep_hi] - start[keep_lo],
                              dst.dtype)
            give = cur[start[give_lo] - base:start[give_hi] - base]
            mine = cur[start[keep_lo] - base:start[keep_hi] - base]
            steps.append(t.bind_sendrecv(give, peer, into, peer, Tag.RAB_HALVING))
            lower, higher = (into, mine) if partner < me else (mine, into)
            steps.append(combine.bind(lower, higher, into))
            cur, base, turn = into, start[keep_lo], 1 - turn
            lo, hi = keep_lo, keep_hi
            mask >>= 1
        steps.append(partial(np.copyto, dst[start[lo]:start[hi]], cur))

        mask = 1
        while mask < core:
            peer = real_rank(me ^ mask, rem)
            other_lo, other_hi = (lo - mask, lo) if me & mask else (hi, hi + mask)
            steps.append(t.bind_sendrecv(dst[start[lo]:start[hi]], peer,
                                         dst[start[other_lo]:start[other_hi]], peer,
                                         Tag.RAB_DOUBLING))
            lo, hi = min(lo, other_lo), max(hi, other_hi)
            mask <<= 1
    return steps + fold_out(t, dst, rem)


def allreduce(t, src, dst, combine, ws):
    """dst = reduction of every rank's src. dst may be src (in place)."""
    for step in schedule(t, src, dst, combine, ws):
        step()
