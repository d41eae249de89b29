"""Point-to-point checks shared by both tiers: run_all(comm) on every rank.

tests/test_p2p.py runs it on thread ranks (ringcoll.run_threads, p = 1..6); tests/mpi_p2p.py
runs it under `mpiexec -n P`. Every payload is a function of (sender, receiver, tag), so each
receiver rebuilds what it must have got (the oracle) and compares it bitwise; a case raises
AssertionError naming itself and the rank on the first difference.
"""

import numpy as np

import ringcoll
from ringcoll.arrays import BFLOAT16

DTYPES = [np.float64, np.float32, np.float16, np.int32, np.int64, np.uint8, np.complex128]
if BFLOAT16 is not None:
    DTYPES.append(BFLOAT16)
SHAPES = [(0,), (), (1,), (7,), (3, 4), (2, 0, 3)]


def payload(src, dst, tag, shape=(5,), dtype=np.float64, order="C"):
    """The array rank src sends rank dst with this tag: distinct for every triple."""
    n = int(np.prod(shape, dtype=np.int64))
    values = (np.arange(n) % 97 + 1000 * src + 100 * dst + tag) % 251  # fits int8..bfloat16
    return np.asarray(values.reshape(shape), dtype=dtype, order=order)


def same(label, comm, got, want):
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{label} rank {comm.rank}: got {got.dtype}{got.shape}, want {want.dtype}{want.shape}")
    bits = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in (got, want)]
    assert np.array_equal(*bits), (
        f"{label} rank {comm.rank}: got {got!r}, want {want!r}")


def ring_isend_recv(comm):
    """Every dtype and shape (empty, 0-d, F-ordered) around the ring: isend right, recv left."""
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    for i, dtype in enumerate(DTYPES):
        for j, shape in enumerate(SHAPES):
            order = "F" if len(shape) > 1 and j % 2 else "C"
            tag = (i * len(SHAPES) + j) % 1024
            x = payload(r, right, tag, shape, dtype, order)
            req = comm.isend(x, right, tag)
            out = np.empty(shape, dtype, order=order)
            comm.recv(out, left, tag)
            req.wait()
            same(f"ring {np.dtype(dtype)} {shape} {order}", comm, out,
                 payload(left, r, tag, shape, dtype, order))


def sendrecv_both_ways(comm):
    """sendrecv shifts right then left, and a pairwise exchange (source defaults to dest)."""
    p, r = comm.size, comm.rank
    for step in (1, -1):
        to, frm = (r + step) % p, (r - step) % p
        got = comm.sendrecv(payload(r, to, 3), to, np.empty(5), frm, tag=3)
        same(f"sendrecv step {step}", comm, got, payload(frm, r, 3))
    partner = r ^ 1
    if partner < p:
        got = comm.sendrecv(payload(r, partner, 9, (4, 2)), partner, np.empty((4, 2)), tag=9)
        same("pairwise", comm, got, payload(partner, r, 9, (4, 2)))


def self_messages(comm):
    """To oneself: isend then recv, irecv then isend, and sendrecv with dest = source = self."""
    r = comm.rank
    req = comm.isend(payload(r, r, 1), r, 1)
    same("self isend/recv", comm, comm.recv(np.empty(5), r, 1), payload(r, r, 1))
    req.wait()
    rreq = comm.irecv(np.empty(5), r, 2)
    comm.isend(payload(r, r, 2), r, 2).wait()
    same("self irecv/isend", comm, rreq.wait(), payload(r, r, 2))
    same("self sendrecv", comm, comm.sendrecv(payload(r, r, 4), r, np.empty(5), r, tag=4),
         payload(r, r, 4))


def order_and_tags(comm):
    """Same (source, tag): in send order; tags pick messages whatever order they came in."""
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    sends = [comm.isend(payload(r, right, 5) + k, right, 5) for k in range(3)]
    sends += [comm.isend(payload(r, right, t), right, t) for t in (10, 11, 12)]
    for k in range(3):
        same(f"order {k}", comm, comm.recv(np.empty(5), left, 5), payload(left, r, 5) + k)
    for t in (12, 10, 11):
        same(f"tag {t}", comm, comm.recv(np.empty(5), left, t), payload(left, r, t))
    for req in sends:
        assert req.wait() is None


def all_to_all(comm):
    """Every rank sends to every rank (itself included), tag = sender; irecvs posted first."""
    p, r = comm.size, comm.rank
    recvs = [comm.irecv(np.empty(6, np.int64), src, tag=src) for src in range(p)]
    sends = [comm.isend(payload(r, dst, r, (6,), np.int64), dst, tag=r) for dst in range(p)]
    for src, req in enumerate(recvs):
        same(f"all-to-all from {src}", comm, req.wait(), payload(src, r, src, (6,), np.int64))
    for req in sends:
        req.wait()


def beside_collectives(comm):
    """A receive posted before a collective never takes the collective's messages, also with a
    non-blocking all-reduce running on the background thread while messages go on."""
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    rreq = comm.irecv(np.empty(5), left, 0)
    total = comm.allreduce(np.full(5, float(r)))
    same("allreduce beside p2p", comm, total, np.full(5, p * (p - 1) / 2))
    comm.isend(payload(r, right, 0), right, 0).wait()
    same("irecv across allreduce", comm, rreq.wait(), payload(left, r, 0))
    big = np.full(1 << 16, float(r))
    pending = comm.iallreduce(big)
    got = comm.sendrecv(payload(r, right, 7), right, np.empty(5), left, tag=7)
    same("sendrecv beside iallreduce", comm, got, payload(left, r, 7))
    same("iallreduce beside p2p", comm, pending.wait(), np.full(1 << 16, p * (p - 1) / 2))


def polling_and_large(comm):
    """test() until the message is there; a 1 MiB message (MPI's rendezvous path) both ways;
    a non-contiguous x is sent as its values."""
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    rreq = comm.irecv(np.empty(5), left, 6)
    sreq = comm.isend(payload(r, right, 6), right, 6)
    while not rreq.test():
        pass
    assert rreq.test(), f"test() rank {r}: a finished receive must stay finished"
    same("test()", comm, rreq.wait(), payload(left, r, 6))
    sreq.wait()
    assert sreq.test()
    big = payload(r, right, 8, (1 << 17,))
    got = comm.sendrecv(big, right, np.empty(1 << 17), left, tag=8)
    same("1 MiB sendrecv", comm, got, payload(left, r, 8, (1 << 17,)))
    wide = payload(r, right, 13, (6, 4))
    req = comm.isend(wide[:, ::2], right, 13)
    same("non-contiguous x", comm, comm.recv(np.empty((6, 2)), left, 13),
         payload(left, r, 13, (6, 4))[:, ::2])
    req.wait()


def blocking_pairs(comm):
    """Blocking send/recv in an order that cannot deadlock: even ranks send first."""
    p, r = comm.size, comm.rank
    if p == 1:
        return
    right, left = (r + 1) % p, (r - 1) % p
    if r % 2 == 0 and not (p % 2 and r == p - 1):
        comm.send(payload(r, right, 20), right, 20)
        same("blocking", comm, comm.recv(np.empty(5), left, 20), payload(left, r, 20))
    else:
        same("blocking", comm, comm.recv(np.empty(5), left, 20), payload(left, r, 20))
        comm.send(payload(r, right, 20), right, 20)


def polled_waits(comm):
    """wait(poll=...) sleeps between checks instead of blocking: the same messages arrive."""
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    for k in range(3):
        rreq = comm.irecv(np.empty(5), left, 30 + k)
        sreq = comm.isend(payload(r, right, 30 + k), right, 30 + k)
        same(f"polled {k}", comm, rreq.wait(poll=1e-4), payload(left, r, 30 + k))
        assert sreq.wait(poll=1e-4) is None and rreq.wait() is not None


# -- wildcard receives (ringcoll.ANY_SOURCE) ---------------------------------------------------
def _decode(label, comm, got, src, tag, seen):
    """got must be the next message from src with this tag (k = how many came before it:
    payload(src, r, tag) + k, non-overtaking per sender); counts it in seen."""
    assert src is not None and 0 <= src < comm.size, f"{label} rank {comm.rank}: source {src}"
    k = seen.get(src, 0)
    same(f"{label} from {src} #{k}", comm, got, payload(src, comm.rank, tag) + k)
    seen[src] = k + 1


def wildcard_from_everyone(comm):
    """Every rank sends K messages to every rank (itself too); each receives all p*K with
    wildcards, alternating recv(status=) and irecv(...).source: each exactly once, the right
    data for the sender reported, and every sender's messages in the order it sent them."""
    p, r, tag, k_each = comm.size, comm.rank, 40, 3
    sends = [comm.isend(payload(r, dst, tag) + k, dst, tag)
             for k in range(k_each) for dst in range(p)]
    seen, status = {}, ringcoll.Status()
    for i in range(p * k_each):
        if i % 2:
            req = comm.irecv(np.empty(5), ringcoll.ANY_SOURCE, tag)
            assert req.source is None, f"wildcard rank {r}: a source before wait()"
            got = req.wait()
            _decode("wildcard irecv", comm, got, req.source, tag, seen)
        else:
            got = comm.recv(np.empty(5), ringcoll.ANY_SOURCE, tag, status=status)
            assert status.tag == tag and status.nbytes == 40, f"wildcard rank {r}: {status}"
            _decode("wildcard recv", comm, got, status.source, tag, seen)
    assert seen == {s: k_each for s in range(p)}, f"wildcard rank {r}: got {seen}"
    for req in sends:
        assert req.wait() is None and req.source is None


def wildcard_posted_order(comm):
    """Receives posted before the messages match in posting order, wildcard or not: from
    the left neighbour's m0, m1, m2, a wildcard, a specific and a wildcard receive get m0, m1
    and m2. Then unexpected messages: recv(ANY), recv(left), irecv(ANY), recv(left) take
    the left's n0..n3 in send order (non-overtaking)."""
    p, r, tag = comm.size, comm.rank, 41
    right, left = (r + 1) % p, (r - 1) % p
    posted = [comm.irecv(np.empty(5), ringcoll.ANY_SOURCE, tag),
              comm.irecv(np.empty(5), left, tag),
              comm.irecv(np.empty(5), ringcoll.ANY_SOURCE, tag)]
    comm.barrier()  # every receive is posted before any message is sent
    sends = [comm.isend(payload(r, right, tag) + k, right, tag) for k in range(3)]
    for k, req in enumerate(posted):
        same(f"posted order #{k}", comm, req.wait(), payload(left, r, tag) + k)
        assert req.source == left, f"posted order rank {r}: source {req.source}, not {left}"
    tag = 42
    sends += [comm.isend(payload(r, right, tag) + k, right, tag) for k in range(4)]
    status = ringcoll.Status()
    got = [comm.recv(np.empty(5), ringcoll.ANY_SOURCE, tag, status=status)]
    assert status.source == left, f"unexpected rank {r}: source {status.source}"
    got.append(comm.recv(np.empty(5), left, tag))
    req = comm.irecv(np.empty(5), ringcoll.ANY_SOURCE, tag)
    got.append(req.wait())
    assert req.source == left, f"unexpected rank {r}: source {req.source}"
    got.append(comm.recv(np.empty(5), left, tag, status=status))
    assert status.source == left
    for k, x in enumerate(got):
        same(f"unexpected order #{k}", comm, x, payload(left, r, tag) + k)
    for req in sends:
        req.wait()


def wildcard_and_specific(comm):
    """Several senders, specific and wildcard receives mixed. Every rank sends 2 messages to
    every rank: a specific recv from each sender takes its first (non-overtaking), then p
    wildcards take each sender's second exactly once. Then the other way round: p wildcards
    posted first take the p first messages (the second ones are sent only after a barrier
    that waits for them), then a specific recv from each sender its second."""
    p, r = comm.size, comm.rank
    tag = 43
    sends = [comm.isend(payload(r, dst, tag) + k, dst, tag) for k in range(2)
             for dst in range(p)]
    seen = {}
    for src in range(p):
        _decode("specific first", comm, comm.recv(np.empty(5), src, tag), src, tag, seen)
    for _ in range(p):
        req = comm.irecv(np.empty(5), ringcoll.ANY_SOURCE, tag)
        _decode("wildcard second", comm, req.wait(), req.source, tag, seen)
    assert seen == {s: 2 for s in range(p)}, f"specific then wildcard rank {r}: {seen}"
    for req in sends:
        req.wait()
    tag = 44
    wild = [comm.irecv(np.empty(5), ringcoll.ANY_SOURCE, tag) for _ in range(p)]
    comm.barrier()
    sends = [comm.isend(payload(r, dst, tag), dst, tag) for dst in range(p)]
    seen = {}
    for req in wild:
        _decode("wildcard first", comm, req.wait(), req.source, tag, seen)
    assert seen == {s: 1 for s in range(p)}, f"wildcard then specific rank {r}: {seen}"
    for req in sends:
        req.wait()
    comm.barrier()  # every rank's wildcards are done: the second messages can only match below
    sends = [comm.isend(payload(r, dst, tag) + 1, dst, tag) for dst in range(p)]
    for src in reversed(range(p)):
        _decode("specific second", comm, comm.recv(np.empty(5), src, tag), src, tag, seen)
    assert seen == {s: 2 for s in range(p)}
    for req in sends:
        req.wait()


WILDCARD_CASES = [wildcard_from_everyone, wildcard_posted_order, wildcard_and_specific]

CASES = [ring_isend_recv, sendrecv_both_ways, self_messages, order_and_tags, all_to_all,
         beside_collectives, polling_and_large, blocking_pairs, polled_waits, *WILDCARD_CASES]


def run_all(comm):
    """Run every case; returns their names (the same on every rank)."""
    for case in CASES:
        case(comm)
    return [case.__name__ for case in CASES]
