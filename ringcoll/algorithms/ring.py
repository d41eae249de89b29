"""Ring reduce-scatter, ring all-gather, and ring all-reduce = the two in sequence.

The p ranks form a ring: each sends only to its right neighbour (rank + 1) and receives only
from its left (rank - 1). The buffer is cut into p blocks (np.array_split sizes).

Reduce-scatter, p - 1 steps. At step s rank r
    sends block (r - s - 1) % p   (at s = 0 its own input, later the block it reduced at s - 1)
    receives block (r - s - 2) % p from the left and reduces its own input into it,
so after the last step (s = p - 2) rank r holds block r reduced over all ranks.

All-gather, p - 1 steps. At step s rank r sends block (r - s) % p (its own at s = 0, then the
one it just received) and receives block (r - s - 1) % p straight into the output.

Pipelining: every block travels in segments of `segment_bytes`; a segment is reduced (or, in
the all-gather, forwarded) as soon as it arrives, so the reduction of segment k overlaps the
transfer of segment k + 1, and step s + 1 starts sending before step s has finished.

Cost (alpha = latency, beta = time per byte, gamma = reduction time per byte, n bytes):
    reduce-scatter  (p-1) a + (p-1)/p n b + (p-1)/p n g
    all-gather      (p-1) a + (p-1)/p n b
    all-reduce     2(p-1) a + 2(p-1)/p n b + (p-1)/p n g
Each rank sends and receives 2(p-1)/p of the buffer: bandwidth-optimal. Every block is reduced
by exactly one rank and then copied, so all ranks end with bitwise identical results.
"""

from ..arrays import segments
from ..transport import Tag


def reduce_scatter(t, src, work, part, combine, ws):
    """Reduce block `t.rank` of `part` into work[part.slices[t.rank]].

    src is this rank's contribution; work is a flat buffer of the same size that the other
    blocks' partial reductions pass through. work may be src itself (in place); then a scratch
    block receives each incoming segment before it is reduced.
    """
    p, r = t.size, t.rank
    if p == 1:
        if work is not src:
            work[...] = src
        return
    right, left = (r + 1) % p, (r - 1) % p
    seg = ws.segment_elems(work.dtype)
    in_place = work is src
    sends = []

    first = part.slices[(r - 1) % p]
    for k in segments(first.stop - first.start, seg):
        sends.append(t.isend(src[first][k], right, Tag.RING_REDUCE_SCATTER))

    for step in range(p - 1):
        block = part.slices[(r - step - 2) % p]
        count = block.stop - block.start
        mine, acc = src[block], work[block]
        incoming = ws.scratch("ring.incoming", count, work.dtype) if in_place else acc
        pieces = segments(count, seg)
        recvs = [t.irecv(incoming[k], left, Tag.RING_REDUCE_SCATTER) for k in pieces]
        forward = step < p - 2  # the block reduced now is the one sent at the next step
        for k, req in zip(pieces, recvs):
            t.wait(req)
            combine(incoming[k], mine[k], acc[k])
            if forward:
                sends.append(t.isend(acc[k], right, Tag.RING_REDUCE_SCATTER))
    t.waitall(sends)


def allgather(t, buf, part, ws):
    """Fill every block of buf from its owner; block t.rank must already hold this rank's."""
    p, r = t.size, t.rank
    if p == 1:
        return
    right, left = (r + 1) % p, (r - 1) % p
    seg = ws.segment_elems(buf.dtype)

    own = buf[part.slices[r]]
    sends = [t.isend(own[k], right, Tag.RING_ALLGATHER) for k in segments(own.size, seg)]
    for step in range(p - 1):
        block = buf[part.slices[(r - step - 1) % p]]
        pieces = segments(block.size, seg)
        recvs = [t.irecv(block[k], left, Tag.RING_ALLGATHER) for k in pieces]
        forward = step < p - 2
        for k, req in zip(pieces, recvs):
            t.wait(req)
            if forward:
                sends.append(t.isend(block[k], right, Tag.RING_ALLGATHER))
    t.waitall(sends)


def allreduce(t, src, dst, combine, ws):
    """dst = reduction of every rank's src. dst may be src (in place)."""
    part = ws.partition(dst.size, t.size)
    reduce_scatter(t, src, dst, part, combine, ws)
    allgather(t, dst, part, ws)
