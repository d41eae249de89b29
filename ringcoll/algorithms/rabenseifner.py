"""Rabenseifner all-reduce: recursive-halving reduce-scatter + recursive-doubling all-gather.

Bandwidth like the ring, latency like recursive doubling: 2 log2(p) steps instead of 2(p-1).
Non-powers of two use the same fold as recursive_doubling (p' = largest power of two <= p).

The buffer is cut into p' blocks. Reduce-scatter, mask = p'/2, p'/4, ..., 1: rank r (core
numbering) and partner r XOR mask split their current range of blocks in half; the rank whose
`mask` bit is set keeps the upper half, the other the lower; each sends the half it gives up
and reduces the half it keeps. Bit by bit from the top, rank r ends owning block r.

All-gather, mask = 1, 2, ..., p'/2: rank r and r XOR mask swap their ranges (each 'mask'
blocks long, adjacent), doubling what each holds until everyone has all p' blocks.

Cost: 2 log2(p') a + 2 (p'-1)/p' n b + (p'-1)/p' n g, plus the fold (2 a + 2 n b + n g)
when p is not a power of two. Each block is reduced by one rank only, so results are bitwise
identical everywhere.
"""

from ..transport import Tag
from .recursive_doubling import core_rank, fold, fold_in, fold_out, real_rank


def allreduce(t, src, dst, combine, ws):
    """dst = reduction of every rank's src. dst may be src (in place)."""
    p, n = t.size, dst.size
    if p == 1 or n == 0:
        if dst is not src:
            dst[...] = src
        return
    core, rem = fold(p)
    tmp = ws.scratch("rab.tmp", n, dst.dtype)
    cur = fold_in(t, src, dst, tmp, combine, rem)  # this rank's data: src until first reduce
    me = core_rank(t.rank, rem)
    if me >= 0:
        start = ws.partition(n, core).starts  # block b is dst[start[b]:start[b + 1]]
        lo, hi = 0, core  # the blocks this rank is responsible for

        mask = core >> 1
        while mask:
            partner = me ^ mask
            peer = real_rank(partner, rem)
            mid = (lo + hi) // 2
            (keep_lo, keep_hi), (give_lo, give_hi) = (
                ((mid, hi), (lo, mid)) if me & mask else ((lo, mid), (mid, hi))
            )
            keep = slice(start[keep_lo], start[keep_hi])
            incoming = tmp[:keep.stop - keep.start]
            t.sendrecv(cur[start[give_lo]:start[give_hi]], peer, incoming, peer, Tag.RAB_HALVING)
            if partner < me:
                combine(incoming, cur[keep], dst[keep])
            else:
                combine(cur[keep], incoming, dst[keep])
            cur = dst  # only the kept half of dst is current now, and only it is read again
            lo, hi = keep_lo, keep_hi
            mask >>= 1

        mask = 1
        while mask < core:
            peer = real_rank(me ^ mask, rem)
            other_lo, other_hi = (lo - mask, lo) if me & mask else (hi, hi + mask)
            t.sendrecv(dst[start[lo]:start[hi]], peer,
                       dst[start[other_lo]:start[other_hi]], peer, Tag.RAB_DOUBLING)
            lo, hi = min(lo, other_lo), max(hi, other_hi)
            mask <<= 1
    fold_out(t, dst, rem)
