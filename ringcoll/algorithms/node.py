"""Node-tier all-reduce, reduce-scatter and all-gather: the ranks of one node read each other's
memory instead of sending messages (NCCL's P2P and SHM transports do the same).

Memory (a Tier, made at a transport's first node-tier call and kept for its life): every rank
owns SLOTS staging slots of `chunk` bytes (t.shared: an MPI-3 shared window on the host, the
threads' own arrays, CUDA IPC on a GPU) and a row of counters (t.flags, host memory). A call
is cut into chunks, and chunk s of the tier's life (s counts over every call) uses slot
s % SLOTS of every rank. The call's partition gives block q to rank q; each block is cut into
as many pieces as the call has chunks, and chunk k carries piece k of every block, back to
back in the slot.

All-reduce, chunk s on rank r (the counters only grow, so a wait is `peer's counter >= s+1`):
  0. slot s % SLOTS is free once every peer has finished chunk s - SLOTS   wait DONE
  1. copy in: the pieces of every block but r into my slot                 post READY
  2. reduce: block r = my own input's piece (op) block r of every peer's slot, in one pass
     (NumPy: p - 1 ufunc calls over n/p; CuPy: one kernel reading p inputs), into block r
     of the output, then copied into my slot for the peers                wait READY, post REDUCED
  3. gather: block q of peer q's slot into the output, for every peer q    wait REDUCED, post DONE
Reduce-scatter is steps 0-2 with the result written to the caller's block only (DONE after 2);
all-gather copies only block r in at step 1 and every other block out at step 3 (wait READY).
Broadcast moves bytes (any dtype, padding included), cut into c chunks of at most a slot
(256 KiB on the host: HOST_BCAST_PIECE): the root copies chunk s into its slot and posts
READY; every other rank waits for the root's READY, copies the chunk out of the root's slot and
posts DONE (steps 0, 1 and 3 with one block, the root's). Double buffering lets the root copy
chunk s + 1 in while the peers copy chunk s out.
Every write is fenced (t.shared's fence: a memory barrier, or the stream synchronised on a
GPU) before the counter that announces it, and every read follows the wait for it.

Registered buffers (Tier.register: arrays in the tier's shared memory): an in-place all-reduce
of one skips step 1, the peers read its blocks where they lie, and its result is copied into
its own block r, where the peers read it at step 3; the rank then waits for every peer's DONE
before it returns, since its array is the caller's again. Each rank says where its chunk lies
(slot, or registration and offset) in its descriptor words, so ranks with and without
registered buffers meet in one call. Before its first READY every rank also writes a header
(collective, count, dtype, op, chunks): every rank compares all of them at the first chunk,
and on a difference all raise CollectiveMismatchError alike, leaving the tier consistent.

Cost (n bytes, p ranks, c = ceil(n / chunk) chunks; b = s per byte copied, g = s per byte
reduced, f = one counter handoff between ranks):
    all-reduce      3c f + 2 (p-1)/p n b + n/p b + (p-1)/p n g
    reduce-scatter   c f +   (p-1)/p n b         + (p-1)/p n g
    all-gather      2c f +   (p-1)/p n b + n/p b
    broadcast       2c f + n b + n/c b              (the root's first chunk, then pipelined)
against the ring's 2(p-1) a + 2(p-1)/p n b + (p-1)/p n g: the same bytes, but each moved by one
copy of the rank that needs it (a message through MPI's shared memory is copied twice, and pays
an MPI latency a per step) and 3 handoffs per chunk instead of 2(p-1) messages. Every block is
reduced by one rank and then copied, so every rank ends bitwise identical. The binomial
tree's broadcast pays ceil(log2 p)(a + n b') with b' a message's two copies per byte, whole
messages one round after another; the tier's peers copy the root's bytes once, all at once.

Where the tier cannot run (ranks on several nodes, an MPI without shared windows, GPUs without
peer access: NoSharedMemory when the tier is made), every call runs the ring instead (the
binomial tree for broadcast).
"""

import zlib

import numpy as np

from ..errors import CollectiveMismatchError
from ..transport.base import NoSharedMemory
from . import ring, tree

SLOTS = 2  # double buffering: chunk s + 1 copies in while peers still gather chunk s
HOST_CHUNK = 1 << 20  # measured on 2 cores (MPICH): 256 KiB and 4 MiB were both slower
# broadcast's piece on the host: with 1 MiB pieces the root's writes into lines the peer has
# just read (2 slots x 1 MiB fill a 2 MiB L2) ran 3x slower than with 256 KiB (p = 2, 4 MiB:
# 484 against 176 us); the device path uses the whole slot
HOST_BCAST_PIECE = 256 << 10
DEVICE_CHUNK = 16 << 20
MAX_REGISTERED = 64  # live registered buffers per tier (each an MPI window or IPC mapping);
# more are ordinary arrays: MPI libraries run out of windows (context ids) in the thousands

# counters of each rank's Flags row; then, per slot, DESCRIBE words
READY, REDUCED, DONE = 0, 1, 2
DESC, DESCRIBE = 3, 3  # per slot: header, where (0: slot, i + 1: registration i), byte offset
WORDS = DESC + SLOTS * DESCRIBE

ALLREDUCE, REDUCE_SCATTER, ALLGATHER = "allreduce", "reduce_scatter", "allgather"
BROADCAST = "broadcast"


class Tier:
    """One group's node-tier memory: slots, counters, registered buffers and the chunk count.

    Made collectively (every rank of t at the same call); raises NoSharedMemory where the
    ranks cannot share memory. chunk: the slot size in bytes.
    """

    def __init__(self, t, chunk):
        self.rank, self.size, self.chunk = t.rank, t.size, int(chunk)
        self.slot_bytes = self.chunk + 64 * self.size  # pieces round up: room for p more items
        self.flags = t.flags(WORDS)
        try:
            self.memory = t.shared(SLOTS * self.slot_bytes)
        except BaseException:
            self.flags.close()
            raise
        self.fence = self.memory.fence
        sb = self.slot_bytes
        self.slots = [[seg[i * sb:(i + 1) * sb] for i in range(SLOTS)]
                      for seg in self.memory.segments]
        self._t = t
        self.seq = 0  # chunks run so far: the same on every rank
        self.registered = []  # one Shared per registered buffer, in registration order

    # -- registered buffers -------------------------------------------------------------------
    def register(self, nbytes):
        """Collective: a new registered buffer of nbytes on every rank; returns this rank's
        segment (a uint8 array the caller views as its array), or None once MAX_REGISTERED
        are live (the same on every rank: they register in the same order)."""
        if sum(s is not None for s in self.registered) >= MAX_REGISTERED:
            return None
        shared = self._t.shared(nbytes)
        self.registered.append(shared)
        return shared.segments[self.rank]

    def release(self, index):
        """Collective: free registered buffer `index` (its slot in the list stays empty)."""
        shared, self.registered[index] = self.registered[index], None
        shared.close()

    def locate(self, x):
        """(where, byte offset): 0 if x is not in a registered buffer of this rank, else the
        registration's index + 1 and x's offset in it."""
        if not self.registered:
            return 0, 0
        address, nbytes = _address(x), x.nbytes
        for i, shared in enumerate(self.registered):
            if shared is None:
                continue
            seg = shared.segments[self.rank]
            start = _address(seg)
            if start <= address and address + nbytes <= start + seg.nbytes:
                return i + 1, address - start
        return 0, 0

    def close(self):
        for shared in self.registered:
            if shared is not None:
                shared.close()
        self.registered = []
        self.memory.close()
        self.flags.close()


def tier_of(t, ws):
    """The Tier of transport t (made on first use, collectively), or None where the ranks
    cannot share memory, or the tier is switched off (RINGCOLL_NODE_TIER=0): the callers then
    run the ring."""
    if not ws.node_tier:
        return None

    def build():
        try:
            return Tier(t, ws.node_chunk if ws.node_chunk else
                        (DEVICE_CHUNK if ws.device else HOST_CHUNK))
        except NoSharedMemory:
            return False  # (cached: never asked again)
    return ws.resident(_key(t), build) or None


def existing(t, ws):
    """The Tier of t if one was made already, else None (never makes one)."""
    return ws.resident_get(_key(t)) or None


def _key(t):
    # a view (hierarchical's node group) is named by its parent and members: views are
    # rebuilt when plans are evicted, and must find the same memory again
    return ("node", id(getattr(t, "parent", t)), tuple(getattr(t, "members", ())))


def available(t, ws):
    """May transport t run the node tier (before any tier is made)? Its ranks must also be on
    one node, which the Communicator knows from its node list."""
    return ws.node_tier and hasattr(t, "shared")


# -- the collectives --------------------------------------------------------------------------
def allreduce(t, src, dst, combine, ws):
    """dst = reduction of every rank's src (dst may be src: in place)."""
    if t.size == 1:
        if dst is not src:
            dst[...] = src
        return
    tier = tier_of(t, ws)
    if tier is None:
        return ring.allreduce(t, src, dst, combine, ws)
    _run(tier, ALLREDUCE, src, dst, ws.partition(dst.size, t.size), combine, ws)


def reduce_scatter(t, src, result, part, combine, ws):
    """result = block t.rank (of part) of the reduction of every rank's src."""
    tier = tier_of(t, ws) if t.size > 1 else None
    if tier is None:
        work = ws.scratch("node.work", src.size, src.dtype)
        return ring.reduce_scatter(t, src, work, part, combine, ws, result=result)
    _run(tier, REDUCE_SCATTER, src, result, part, combine, ws)


def allgather(t, buf, part, ws):
    """Fill every block of buf from its owner; block t.rank must already hold this rank's."""
    tier = tier_of(t, ws) if t.size > 1 else None
    if tier is None:
        return ring.allgather(t, buf, part, ws)
    _run(tier, ALLGATHER, buf, buf, part, None, ws)


def broadcast(t, buf, root, ws):
    """buf on every rank = root's buf (in place; buf flat and contiguous, any dtype)."""
    if t.size == 1:
        return
    tier = tier_of(t, ws)
    if tier is None:
        return tree.broadcast(t, buf, root, ws)
    piece = tier.chunk if ws.device else min(tier.chunk, HOST_BCAST_PIECE)
    _broadcast(tier, buf.view(np.uint8), root, piece)


# -- the schedule ------------------------------------------------------------------------------
def chunks(part, itemsize, chunk, p):
    """[[(start, count, slot offset) of block q's piece, for each q] for each chunk]: every
    block cut into the same number of pieces, so that a chunk's pieces fill at most `chunk`
    bytes (plus p items of rounding); at least one chunk, so that even an empty call meets."""
    biggest = max(part.counts) if len(part.counts) else 0
    k = max(1, -(-biggest * itemsize * p // chunk))
    pieces = [[(part.starts[q] + (c * i) // k, (c * (i + 1)) // k - (c * i) // k)
               for i in range(k)] for q, c in enumerate(part.counts)]
    out = []
    for i in range(k):
        offset, row = 0, []
        for q in range(p):
            start, count = pieces[q][i]
            row.append((start, count, offset))
            offset += count
        out.append(row)
    return out


def _header(kind, n, dtype, op, nchunks, split=()):
    """A call's fingerprint; op: the reduction (broadcast: the root); split: the block counts
    where they are the caller's choice (reduce-scatter, all-gather)."""
    text = f"{kind}|{n}|{np.dtype(dtype).str}|{op}|{nchunks}|{list(split)}"
    return zlib.crc32(text.encode()) + 1  # never 0: a peer that wrote nothing yet differs


def _describe(flags, i, header, where=0, offset=0):
    """Post this rank's descriptor words of slot i: the call's header, where its chunk lies."""
    base = DESC + i * DESCRIBE
    flags.post(base, header)
    flags.post(base + 1, where)
    flags.post(base + 2, offset)


def _run(tier, kind, src, dst, part, combine, ws):
    """One call of `kind` through the tier (see the module docstring)."""
    p, r = tier.size, tier.rank
    flags, fence, slots = tier.flags, tier.fence, tier.slots
    dtype, item = dst.dtype, dst.itemsize
    plan = ws.cached(("node", kind, tuple(part.counts), item, tier.chunk),
                     lambda: chunks(part, item, tier.chunk, p))
    op = getattr(combine, "op", None) or getattr(getattr(combine, "ufunc", None), "__name__", "")
    header = _header(kind, dst.size if kind != REDUCE_SCATTER else src.size, dtype, op,
                     len(plan), part.counts if kind != ALLREDUCE else ())
    # where my input lies: registered (in place only: the result goes where the input was)
    where, offset = tier.locate(src) if kind == ALLREDUCE and src is dst else (0, 0)
    many = getattr(combine, "many", None)
    s = tier.seq
    for k, row in enumerate(plan):
        i = s % SLOTS
        if s >= SLOTS:  # 0. my slot i is free once every peer is done with chunk s - SLOTS
            flags.wait_all(DONE, s - SLOTS + 1)
        _describe(flags, i, header, where, offset)
        mine = slots[r][i]
        start_r, count_r, off_r = row[r]
        if kind == ALLGATHER:  # 1. copy in: my own block only
            _view(mine, off_r, count_r, dtype)[...] = src[start_r:start_r + count_r]
        elif where == 0:  # 1. copy in: every block but mine
            for q, (start, count, off) in enumerate(row):
                if q != r and count:
                    _view(mine, off, count, dtype)[...] = src[start:start + count]
        fence()
        flags.post(READY, s + 1)
        flags.wait_all(READY, s + 1)
        fence()
        if k == 0:
            _check_headers(tier, i, header, kind)
        if kind != ALLGATHER:  # 2. reduce my block from every rank's input
            inputs = [src[start_r:start_r + count_r]]
            for q in range(p):
                if q != r:
                    inputs.append(_input(tier, q, i, off_r, start_r, count_r, dtype))
            if kind == REDUCE_SCATTER:
                target = dst[start_r - part.starts[r]:][:count_r]
            elif where:  # registered: the result goes where the peers read it, inputs[0]
                target = ws.scratch("node.block", count_r, dtype)
            else:
                target = dst[start_r:start_r + count_r]
            if count_r:
                # into memory of this rank's own, then copied to where the peers read it:
                # the kernel's stores into lines a peer has just read each wait for that
                # core (3x slower than the copy on 2 vCPUs that share no cache)
                _reduce(combine, many, inputs, target)
                if kind == ALLREDUCE:
                    (inputs[0] if where else _view(mine, off_r, count_r, dtype))[...] = target
            fence()
        if kind == REDUCE_SCATTER:
            flags.post(DONE, s + 1)
            s += 1
            continue
        if kind == ALLREDUCE:
            flags.post(REDUCED, s + 1)
        stage = READY if kind == ALLGATHER else REDUCED
        for q in range(p):  # 3. gather every peer's block
            if q == r:
                continue
            start, count, off = row[q]
            flags.wait(q, stage, s + 1)
            fence()
            if count:
                dst[start:start + count] = _input(tier, q, i, off, start, count, dtype)
        fence()
        flags.post(DONE, s + 1)
        s += 1
    tier.seq = s
    if where:  # the peers read my registered array until their DONE: it is the caller's next
        flags.wait_all(DONE, s)


def _broadcast(tier, data, root, piece):
    """One broadcast of the bytes `data` through the tier, `piece` bytes (<= the slot) a
    chunk (see the module docstring)."""
    p, r = tier.size, tier.rank
    flags, fence = tier.flags, tier.fence
    n = data.size
    k = max(1, -(-n // piece))  # at least one chunk, so that even 0 bytes meet
    header = _header(BROADCAST, n, np.uint8, f"root {root}", k)
    where, offset = tier.locate(data) if r == root else (0, 0)
    s = tier.seq
    for c in range(k):
        i = s % SLOTS
        lo, hi = n * c // k, n * (c + 1) // k
        if s >= SLOTS:  # 0. slot i is free (and so are the descriptors every peer reads)
            flags.wait_all(DONE, s - SLOTS + 1)
        _describe(flags, i, header, where, offset)
        if r == root and where == 0:  # 1. copy in
            tier.slots[r][i][:hi - lo] = data[lo:hi]
        fence()
        flags.post(READY, s + 1)
        if c == 0:  # every rank's header, so that a mismatch raises on every rank alike
            flags.wait_all(READY, s + 1)
            fence()
            _check_headers(tier, i, header, BROADCAST)
        if r != root:  # 3. copy out of the root's slot (or its registered array)
            flags.wait(root, READY, s + 1)
            fence()
            data[lo:hi] = _input(tier, root, i, 0, lo, hi - lo, np.uint8)
            fence()
        flags.post(DONE, s + 1)
        s += 1
    tier.seq = s
    if where:  # the peers read my registered array until their DONE
        flags.wait_all(DONE, s)


def _view(segment, offset, count, dtype):
    """count items of dtype at item offset `offset` of a byte segment."""
    size = np.dtype(dtype).itemsize
    return segment[offset * size:(offset + count) * size].view(dtype)


def _input(tier, q, i, slot_offset, start, count, dtype):
    """Peer q's piece [start, start + count) of this chunk: in its slot i at slot_offset, or,
    if its descriptor says so, in its registered buffer at the same place as in its array."""
    base = DESC + i * DESCRIBE
    where = tier.flags.value(q, base + 1)
    if where == 0:
        return _view(tier.slots[q][i], slot_offset, count, dtype)
    size = np.dtype(dtype).itemsize
    segment = tier.registered[where - 1].segments[q]
    first = tier.flags.value(q, base + 2) + start * size
    return segment[first:first + count * size].view(dtype)


def _reduce(combine, many, inputs, out):
    """out = inputs[0] (op) inputs[1] (op) ... in one pass where the combine has a p-input
    kernel (CuPy), else as p - 1 combines. out may be inputs[0], never a later one."""
    if many is not None:
        many(inputs, out)
        return
    combine(inputs[0], inputs[1], out)
    for x in inputs[2:]:
        combine(out, x, out)


def _check_headers(tier, i, header, kind):
    """Raise on every rank alike if a peer runs another call. Every rank has posted READY of
    this chunk and nothing else; posting its REDUCED and DONE too leaves the counters where a
    finished chunk leaves them, so the next call starts from a consistent tier."""
    base = DESC + i * DESCRIBE
    theirs = [tier.flags.value(q, base) for q in range(tier.size)]
    if all(h == header for h in theirs):
        return
    differ = [q for q, h in enumerate(theirs) if h != theirs[0]]
    s = tier.seq + 1
    tier.flags.post(REDUCED, s)
    tier.flags.post(DONE, s)
    tier.seq = s
    from ..checks import agreed  # (checks imports the algorithms: import it only here)

    raise agreed(CollectiveMismatchError(
        f"ringcoll rank {tier.rank}, {kind} (node tier): the ranks disagree on this call: "
        f"rank(s) {differ} passed another element count, dtype, op or block split than rank "
        "0. Pass the same count, dtype and op on every rank (RINGCOLL_DEBUG=1 names the "
        "argument that differs)."))


def _address(x):
    """The address of x's first byte (NumPy or CuPy)."""
    if isinstance(x, np.ndarray):
        return x.ctypes.data  # (not __array_interface__: it refuses dtypes like bfloat16)
    return x.data.ptr


__all__ = ["Tier", "allgather", "allreduce", "available", "broadcast", "chunks", "existing",
           "reduce_scatter", "tier_of"]
