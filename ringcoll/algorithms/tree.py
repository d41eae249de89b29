"""Binomial-tree broadcast, reduce, gather and scatter.

Ranks are renumbered relative to the root, v = (rank - root) % p. In the binomial tree rank v's
parent is v with its lowest set bit cleared, and its children are v + 2^j for every 2^j below
that bit (all 2^j for the root).

Broadcast: receive from the parent, then send to the children, largest subtree first.
    log2(p) rounds; cost ceil(log2 p) (a + n b).
Reduce: the mirror image. For mask = 1, 2, 4, ...: if v has the mask bit, send the partial
result to v - mask and stop; otherwise receive from v + mask (if it exists) and reduce, always
as op(lower v's data, higher v's data).
    cost ceil(log2 p) (a + n b + n g).
Gather: broadcast's tree with the data flowing up. Rank v's subtree is the relative ranks
v .. v + low - 1 (low = v's lowest set bit, all p for the root), whose blocks lie next to each
other in relative order; v receives each child's subtree, smallest first, behind its own
block, then sends the whole subtree to its parent v - low in one message. Blocks may differ
in size (part gives every rank's).
    ceil(log2 p) rounds; cost ceil(log2 p) a + (p-1)/p n b at the root (n: the gathered
    bytes), which receives each block exactly once.
Scatter: gather's mirror image, broadcast's schedule. Rank v receives its whole subtree's
blocks (relative ranks v .. v + low - 1, in relative order, its own first) from its parent
v - low in one message, then sends each child v + 2^j the part of that message that is the
child's subtree, largest subtree first (it has the most rounds ahead of it), and keeps its own
block. The root sends straight from src, packing only the one child subtree whose ranks wrap
past p - 1. Blocks may differ in size (part gives every rank's).
    ceil(log2 p) rounds; cost ceil(log2 p) a + (n - c_root) b at the root (n: the scattered
    bytes, c_root its own block; (p-1)/p n b for even blocks), which sends each other rank's
    block exactly once; an inner rank forwards its subtree's blocks but its own, which it
    copies out of the message (a leaf receives straight into dst).
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


def _subtrees(t, part, root):
    """(v, start, low): this rank relative to root, where relative rank u's block starts in
    the relative order (start[u]:start[u + 1], start[p] the total), and v's lowest set bit
    (all p for the root): v's subtree is the relative ranks v .. v + low - 1 (below p)."""
    p = t.size
    v = (t.rank - root) % p
    start = [0]
    for u in range(p):
        start.append(start[-1] + part.counts[(u + root) % p])
    return v, start, (v & -v if v else p)


def gather(t, src, dst, part, root, ws):
    """dst[part.slices[q]] = rank q's src for every q, on root (dst is None elsewhere)."""
    p = t.size
    v, start, low = _subtrees(t, part, root)
    if v == 0:
        dst[part.slices[root]] = src
    buf = None
    if v and min(low, p - v) > 1:  # an inner node: its subtree, in relative order, own first
        buf = ws.scratch("gather.subtree", start[min(v + low, p)] - start[v], src.dtype)
        buf[:src.size] = src
    recvs, wrapped = [], []
    mask = 1
    while mask < low and v + mask < p:
        child, end = v + mask, min(v + 2 * mask, p)  # the child's subtree: child .. end - 1
        peer = (child + root) % p
        if v:
            recvs.append(t.irecv(buf[start[child] - start[v]:start[end] - start[v]], peer,
                                 Tag.GATHER))
        elif (child + root) // p == (end - 1 + root) // p:  # the root: straight into dst when
            first = part.starts[peer]                      # its ranks do not wrap past p - 1
            recvs.append(t.irecv(dst[first:first + start[end] - start[child]], peer,
                                 Tag.GATHER))
        else:
            piece = ws.scratch("gather.wrapped", start[end] - start[child], src.dtype)
            recvs.append(t.irecv(piece, peer, Tag.GATHER))
            wrapped.append((piece, child, end))
        mask <<= 1
    t.waitall(recvs)
    for piece, child, end in wrapped:  # relative ranks child .. p - root - 1, then 0 ..
        split = start[p - root] - start[child]
        dst[part.starts[child + root]:] = piece[:split]
        dst[:start[end] - start[p - root]] = piece[split:]
    if v:
        t.send(buf if buf is not None else src, (v - low + root) % p, Tag.GATHER)


def scatter(t, src, dst, part, root, ws, tag=Tag.SCATTER):
    """dst = root's src[part.slices[rank]] on every rank (src matters on root only).

    dst may be root's own block of src itself (in place): that copy is then a no-op. tag:
    the messages' (scatter's agreement sends its header rows as Tag.VERDICT).
    """
    p = t.size
    v, start, low = _subtrees(t, part, root)  # v's subtree is v .. top - 1
    top = min(v + low, p)
    if v == 0:
        dst[...] = src[part.slices[root]]
    elif top - v == 1:  # a leaf: the subtree is its own block, received where it belongs
        t.recv(dst, (v - low + root) % p, tag)
        return
    else:  # an inner rank: its subtree, in relative order, own block first
        held = ws.scratch("scatter.subtree", start[top] - start[v], dst.dtype)
        t.recv(held, (v - low + root) % p, tag)
    children = []  # (child, end): the child's subtree is child .. end - 1
    mask = 1
    while mask < low and v + mask < p:
        children.append((v + mask, min(v + 2 * mask, p)))
        mask <<= 1
    sends = []
    for child, end in reversed(children):  # the largest subtree first: it has most to forward
        peer = (child + root) % p
        if v:
            piece = held[start[child] - start[v]:start[end] - start[v]]
        elif (child + root) // p == (end - 1 + root) // p:  # the root: straight from src when
            first = part.starts[peer]                      # its ranks do not wrap past p - 1
            piece = src[first:first + start[end] - start[child]]
        else:  # relative ranks child .. p - root - 1 (the last ranks), then 0 .. (rank 0 on)
            piece = ws.scratch("scatter.wrapped", start[end] - start[child], src.dtype)
            split = start[p - root] - start[child]
            piece[:split] = src[part.starts[child + root]:]
            piece[split:] = src[:start[end] - start[p - root]]
        sends.append(t.isend(piece, peer, tag))
    if v:
        dst[...] = held[:dst.size]  # one local copy: the parent's message held the subtree
    t.waitall(sends)
