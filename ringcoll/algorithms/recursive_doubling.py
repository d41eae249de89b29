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

Cost: log2(p') (a + n b + n g), plus 2 a + 2 n b + n g for the fold when p is not a power of
two. Every rank sends the whole buffer log2(p') times: use it for small n only.
"""

from ..transport import Tag


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


def fold_in(t, src, dst, tmp, combine, rem):
    """Even ranks below 2*rem hand their data to the odd rank above them.

    Returns the buffer that now holds this rank's data: dst once something was reduced into
    it, else still src (so an out-of-place call never copies src to dst first).
    """
    r = t.rank
    if r < 2 * rem:
        if r % 2 == 0:
            t.send(src, r + 1, Tag.RD_FOLD)
        else:
            t.recv(tmp, r - 1, Tag.RD_FOLD)
            combine(tmp, src, dst)
            return dst
    return src


def fold_out(t, buf, rem):
    """The odd ranks give the finished result back to the even rank below them."""
    r = t.rank
    if r < 2 * rem:
        if r % 2 == 0:
            t.recv(buf, r + 1, Tag.RD_UNFOLD)
        else:
            t.send(buf, r - 1, Tag.RD_UNFOLD)


def allreduce(t, src, dst, combine, ws):
    """dst = reduction of every rank's src. dst may be src (in place)."""
    p, n = t.size, dst.size
    if p == 1 or n == 0:
        if dst is not src:
            dst[...] = src
        return
    tmp = ws.scratch("rd.tmp", n, dst.dtype)
    core, rem = fold(p)
    cur = fold_in(t, src, dst, tmp, combine, rem)  # this rank's data: src until first reduce
    me = core_rank(t.rank, rem)
    if me >= 0:
        mask = 1
        while mask < core:
            partner = me ^ mask
            peer = real_rank(partner, rem)
            t.sendrecv(cur, peer, tmp, peer, Tag.RD_EXCHANGE)
            if partner < me:
                combine(tmp, cur, dst)
            else:
                combine(cur, tmp, dst)
            cur = dst
            mask <<= 1
    fold_out(t, dst, rem)
