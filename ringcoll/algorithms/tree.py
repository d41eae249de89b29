"""Binomial-tree broadcast and reduce.

Ranks are renumbered relative to the root, v = (rank - root) % p. In the binomial tree rank v's
parent is v with its lowest set bit cleared, and its children are v + 2^j for every 2^j below
that bit (all 2^j for the root).

Broadcast: receive from the parent, then send to the children, largest subtree first.
    log2(p) rounds; cost ceil(log2 p) (a + n b).
Reduce: the mirror image. For mask = 1, 2, 4, ...: if v has the mask bit, send the partial
result to v - mask and stop; otherwise receive from v + mask (if it exists) and reduce, always
as op(lower v's data, higher v's data).
    cost ceil(log2 p) (a + n b + n g).
"""

from ..transport import Tag


def broadcast(t, buf, root, ws):
    p = t.size
    if p == 1:  # an empty buffer still sends its 0 bytes: a rank passing more would see it
        return
    v = (t.rank - root) % p
    mask = 1
    while mask < p:
        if v & mask:
            t.recv(buf, (v - mask + root) % p, Tag.BCAST)
            break
        mask <<= 1
    sends = []
    mask >>= 1
    while mask:
        if v + mask < p:
            sends.append(t.isend(buf, (v + mask + root) % p, Tag.BCAST))
        mask >>= 1
    t.waitall(sends)


def reduce(t, src, acc, root, combine, ws):
    """acc = reduction of every rank's src, valid on root only (acc is scratch elsewhere).

    A leaf sends src itself; a rank with children reduces the first child's data and src
    straight into acc, so src is never copied. acc may be src.
    """
    p = t.size
    if p == 1:
        if acc is not src:
            acc[...] = src
        return
    v = (t.rank - root) % p
    mine = src  # this subtree's partial result so far
    mask = 1
    while mask < p:
        if v & mask:
            t.send(mine, (v - mask + root) % p, Tag.REDUCE)
            return
        if v + mask < p:
            tmp = ws.scratch("tree.tmp", acc.size, acc.dtype)
            t.recv(tmp, (v + mask + root) % p, Tag.REDUCE)
            combine(mine, tmp, acc)
            mine = acc
        mask <<= 1
