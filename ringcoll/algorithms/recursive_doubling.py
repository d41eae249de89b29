"""Recursive-doubling all-reduce: latency-optimal, for small messages.

With p a power of two: log2(p) steps; at step k (mask = 2^k) rank r exchanges its whole
current buffer with partner r XOR mask and reduces. After step k every group of 2^(k+1)
ranks holds the same partial result.

Other p (the standard fold, as in MPICH): let p' be the largest power of two <= p and
rem = p - p'. Among ranks 0 .. 2*rem - 1 each even rank first sends its buffer to the odd rank
above it and sits out; the p' remaining ranks (new rank r // 2 for those, r - rem for the rest)
run the power-of-two algorithm, and at the end each odd rank sends the result back down.

Both partners compute op(lower rank's data, higher rank's data) in that order, so their
results are bitwise identical even for operations like max(-0.0, +0.0).

Where the result goes: every step reduces into the buffer it has just received into, never into
the one it has just sent, and the two swap roles each step (dst and a scratch buffer; src is
only read). Why: on shared memory the partner has just read the sent buffer, so its cache lines
are shared between two cores, and rewriting them in place costs one cross-core invalidation per
line; on a 2-core machine with MPICH's single-copy (CMA) path that made a 64 KiB in-place
all-reduce 3x slower. The receive buffer was just written by this rank, so reducing into it is
cheap. A final copy puts the result in dst when the last step landed in the scratch buffer.
Messages of at most SMALL bytes skip all that and reduce straight into dst.

Cost: log2(p') (a + n b + n g), plus 2 a + 2 n b + n g for the fold when p is not a power of
two. Every rank sends the whole buffer log2(p') times: use it for small n only.

The schedule is built once as a list of bound steps (a message, a reduction, a copy) and then
run: for small messages Python's per-call overhead is the whole cost, so a caller that reduces
the same buffers again (a training loop, a benchmark) keeps the list and replays it.
"""

from functools import partial

import numpy as np

from ..transport import Tag


# Up to this size the reduction goes straight into dst, even into the buffer just sent: MPI
# sends messages this small through its own eager buffers (MPICH: below 16 KiB), so the partner
# never reads this rank's memory, and the final copy would be the larger cost.
SMALL = 8 << 10


def fold(p):
    """(p', rem): the power-of-two core and how many ranks fold into it."""
    core = 1 << (p.bit_length() - 1)
    return core, p - core


def core_rank(r, rem):
    """This rank's number inside the power-of-two core, or -1 if it folded away."""
    if r < 2 * rem:
        return r // 2 if r % 2 else -1
    return r - rem


def real_rank(core_r, rem):
    """The inverse of core_rank."""
    return core_r * 2 + 1 if core_r < rem else core_r + rem


def fold_in(t, src, tmp, combine, rem):
    """Even ranks below 2*rem hand their data to the odd rank above them.

    Returns (steps, the buffer that holds this rank's data after them): tmp when something
    was reduced into it (the received data, reduced in place), else src, which is never written.
    """
    r = t.rank
    if r < 2 * rem:
        if r % 2 == 0:
            return [t.bind_send(src, r + 1, Tag.RD_FOLD)], src
        return [t.bind_recv(tmp, r - 1, Tag.RD_FOLD), combine.bind(tmp, src, tmp)], tmp
    return [], src


def fold_out(t, buf, rem):
    """Steps: the odd ranks give the finished result back to the even rank below them."""
    r = t.rank
    if r < 2 * rem:
        if r % 2 == 0:
            return [t.bind_recv(buf, r + 1, Tag.RD_UNFOLD)]
        return [t.bind_send(buf, r - 1, Tag.RD_UNFOLD)]
    return []


def schedule(t, src, dst, combine, ws):
    """The steps that set dst = reduction of every rank's src (dst may be src: in place)."""
    p, n = t.size, dst.size
    if p == 1:  # (n == 0 still exchanges its empty messages: a rank passing more sees them)
        return [] if dst is src else [partial(np.copyto, dst, src)]
    tmp = ws.scratch("rd.tmp", n, dst.dtype)
    small = dst.nbytes <= SMALL  # reduce straight into dst: no final copy
    core, rem = fold(p)
    steps, cur = fold_in(t, src, tmp, combine, rem)  # cur: this rank's data so far
    me = core_rank(t.rank, rem)
    if me >= 0:
        mask = 1
        while mask < core:
            partner = me ^ mask
            peer = real_rank(partner, rem)
            into = tmp if cur is dst else dst  # never the buffer being sent
            steps.append(t.bind_sendrecv(cur, peer, into, peer, Tag.RD_EXCHANGE))
            lower, higher = (into, cur) if partner < me else (cur, into)
            result = dst if small else into
            steps.append(combine.bind(lower, higher, result))
            cur = result
            mask <<= 1
        if cur is not dst:
            steps.append(partial(np.copyto, dst, cur))
    return steps + fold_out(t, dst, rem)


def allreduce(t, src, dst, combine, ws):
    """dst = reduction of every rank's src. dst may be src (in place)."""
    for step in schedule(t, src, dst, combine, ws):
        step()
