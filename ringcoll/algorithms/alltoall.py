"""All-to-all by pairwise exchange: equal blocks (alltoall) or uneven ones (alltoallv).

Block b of every rank's input goes to rank b. p - 1 steps: at step s (1 .. p-1) rank r sends
its block (r + s) % p to rank r + s and receives rank (r - s)'s block for it from rank r - s,
so every pair exchanges exactly once and no rank is ever waited on by two others.

alltoallv cuts the input by a send Partition (block j: the elements for rank j) and the output
by a receive Partition (block i: the elements from rank i). Both sides of a pair know the size
of its message (the sender from its own counts, the receiver from the counts exchanged
before), so an empty block is skipped on both: a step sends, receives, does both (one
sendrecv) or nothing. Every step posts its receive before it waits on its send, so a step
can only wait for its partners to reach the same step: no deadlock, whichever blocks are empty.

Cost: (p-1) a + (p-1)/p n b for alltoall, with n the bytes of one rank's input; alltoallv:
at most (p-1) a (steps with neither block non-empty cost nothing) + sum over steps s of
max(bytes to r+s, bytes from r-s) b: between max(n_s, n_r) b and (n_s + n_r) b, for n_s / n_r
the bytes this rank sends to / receives from the other ranks.
"""

from ..transport import Tag


def alltoall(t, src, dst, part, tag=Tag.ALLTOALL):
    p, r = t.size, t.rank
    dst[part.slices[r]] = src[part.slices[r]]
    for s in range(1, p):
        to, frm = (r + s) % p, (r - s) % p
        t.sendrecv(src[part.slices[to]], to, dst[part.slices[frm]], frm, tag)


def alltoallv(t, src, send, dst, recv, tag=Tag.ALLTOALL):
    """dst[recv.slices[i]] = rank i's src[send.slices[t.rank]], for every rank i."""
    p, r = t.size, t.rank
    dst[recv.slices[r]] = src[send.slices[r]]
    for s in range(1, p):
        to, frm = (r + s) % p, (r - s) % p
        out, into = src[send.slices[to]], dst[recv.slices[frm]]
        if out.size and into.size:
            t.sendrecv(out, to, into, frm, tag)
        elif out.size:
            t.send(out, to, tag)
        elif into.size:
            t.recv(into, frm, tag)
