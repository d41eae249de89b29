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

`final`, if given, replaces combine in the last reduce-scatter step, where each block is
finished: 'avg' passes a combine that also divides by p there (one pass over n/p elements per
rank, one kernel launch per segment on a GPU, instead of a later pass over all n).
"""

from ..transport import Tag


# In place, a block up to this size is reduced into the scratch it arrived in and then copied
# over, instead of being reduced in place: the neighbour read these bytes of the buffer moments
# ago (in the last call's all-gather) and may still hold them in its cache, and rewriting lines
# another core holds costs an invalidation each. Measured at p=2 on 2 cores with MPICH's
# single-copy path: 1 MiB in place 250 us reduced in place, 200 us reduced and copied; from
# 4 MiB on, the lines have left the other core's cache and the copy only costs.
STILL_CACHED = 1 << 20


def reduce_scatter(t, src, work, part, combine, ws, result=None, final=None):
    """Reduce block `t.rank` of `part` into work[part.slices[t.rank]] (or into `result`).

    src is this rank's contribution; work is a flat buffer of the same size that the other
    blocks' partial reductions pass through. work may be src itself (in place); then a scratch
    block receives each incoming segment before it is reduced. result, if given, is where the
    last step reduces this rank's block instead (a reduce-scatter's output: no copy after).
    final, if given, is the combine of the last step (see the module docstring); at p = 1
    there is no step, and the caller finishes the block itself.
    """
    p, r = t.size, t.rank
    if p == 1:
        target = work if result is None else result
        if target is not src:
            target[...] = src
        return
    right, left = (r + 1) % p, (r - 1) % p
    seg = ws.segment_elems(src.dtype)
    in_place = work is src
    sends = []

    first = part.slices[(r - 1) % p]
    for k in ws.segments(first.stop - first.start, seg):
        sends.append(t.isend(src[first][k], right, Tag.RING_REDUCE_SCATTER))

    for step in range(p - 1):
        block = part.slices[(r - step - 2) % p]
        count = block.stop - block.start
        last = step == p - 2
        mine, acc = src[block], (result if last and result is not None else work[block])
        incoming = ws.scratch("ring.incoming", count, src.dtype) if in_place else acc
        pieces = ws.segments(count, seg)
        recvs = [t.irecv(incoming[k], left, Tag.RING_REDUCE_SCATTER) for k in pieces]
        forward = not last  # the block reduced now is the one sent at the next step
        copy_over = in_place and count * src.itemsize <= STILL_CACHED
        reduce = final if last and final is not None else combine
        for k, req in zip(pieces, recvs):
            t.wait(req)
            if copy_over:
                reduce(incoming[k], mine[k], incoming[k])
                acc[k] = incoming[k]
            else:
                reduce(incoming[k], mine[k], acc[k])
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
    sends = [t.isend(own[k], right, Tag.RING_ALLGATHER) for k in ws.segments(own.size, seg)]
    for step in range(p - 1):
        block = buf[part.slices[(r - step - 1) % p]]
        pieces = ws.segments(block.size, seg)
        recvs = [t.irecv(block[k], left, Tag.RING_ALLGATHER) for k in pieces]
        forward = step < p - 2
        for k, req in zip(pieces, recvs):
            t.wait(req)
            if forward:
                sends.append(t.isend(block[k], right, Tag.RING_ALLGATHER))
    t.waitall(sends)


def allreduce(t, src, dst, combine, ws, final=None):
    """dst = reduction of every rank's src. dst may be src (in place)."""
    part = ws.partition(dst.size, t.size)
    reduce_scatter(t, src, dst, part, combine, ws, final=final)
    allgather(t, dst, part, ws)
