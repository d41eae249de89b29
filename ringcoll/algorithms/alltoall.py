"""All-to-all by pairwise exchange.

Block b of every rank's input goes to rank b. p - 1 steps: at step s (1 .. p-1) rank r sends
its block (r + s) % p to rank r + s and receives rank (r - s)'s block for it from rank r - s,
so every pair exchanges exactly once and no rank is ever waited on by two others.

Cost: (p-1) a + (p-1)/p n b, with n the bytes of one rank's input.
"""

from ..transport import Tag


def alltoall(t, src, dst, part):
    p, r = t.size, t.rank
    dst[part.slices[r]] = src[part.slices[r]]
    for s in range(1, p):
        to, frm = (r + s) % p, (r - s) % p
        t.sendrecv(src[part.slices[to]], to, dst[part.slices[frm]], frm, Tag.ALLTOALL)
