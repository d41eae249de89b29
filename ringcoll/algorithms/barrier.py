"""Dissemination barrier.

ceil(log2 p) rounds: in round k (distance d = 2^k) rank r sends a token to r + d and waits for
one from r - d. After round k every rank has heard, directly or through others, from the 2^(k+1)
ranks before it, so after the last round nobody can leave before everybody has arrived.

Cost: ceil(log2 p) a.
"""

from ..transport import Tag


def barrier(t, ws):
    p, r = t.size, t.rank
    token = ws.scratch("barrier.token", 2, "u1")
    d = 1
    while d < p:
        t.sendrecv(token[:1], (r + d) % p, token[1:], (r - d) % p, Tag.BARRIER)
        d <<= 1
