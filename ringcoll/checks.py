"""Cross-rank checks: do all ranks agree on the call they are making?

A collective whose ranks disagree (a different count, dtype, op, root or collective on one
rank) either hangs or returns garbage. Two checks turn that into a clear error:

- neighbour_check (always on, for the segmented ring collectives): each rank sends its
  (collective, element count, op, dtype) to its right neighbour and compares it with its left
  neighbour's. If any two ranks differ, some rank's left neighbour differs, so at least one
  rank raises. One 48-byte sendrecv: a few microseconds, under 1% of a ring all-reduce at the
  sizes `auto` runs it (the other algorithms exchange whole buffers, whose sizes the
  transport already checks on every receive).

- exchange_fingerprints (debug mode: RINGCOLL_DEBUG=1 or Communicator(debug=True)): before
  every collective, all ranks all-gather a 256-byte record of their call (sequence number,
  collective, op, dtype, shape, layout, root, algorithm, in place) and compare them. Every rank
  raises CollectiveMismatchError naming which ranks made which call, before any data moves;
  a rank whose own arguments were invalid sends its error instead, so the others raise
  PeerFailedError rather than wait for it. Cost: ceil(log2 p) sendrecv steps per collective
  (Bruck's all-gather of the records), and a byte comparison when they all agree.

Errors a check raises after a complete exchange are raised on every rank alike; they are
marked with agreed() so the communicator knows no rank is left waiting (nothing to abort).
"""

import json
import zlib

import numpy as np

from .algorithms import bruck
from .errors import CollectiveMismatchError, PeerFailedError
from .transport import Tag

OPS = ("sum", "prod", "max", "min", "avg", "band", "bor", "bxor")
HEADER_COLLECTIVES = ("allreduce", "reduce_scatter")
FINGERPRINT_BYTES = 256

# what to tell the user when a field of the fingerprint differs between ranks
_FIXES = {
    "seq": "the ranks are not calling collectives in the same order: one skipped a call or "
           "made an extra one",
    "collective": "the ranks called different collectives at this point of the program",
    "op": "pass the same op on every rank",
    "dtype": "pass arrays of the same dtype on every rank",
    "shape": "pass arrays of the same shape on every rank",
    "row_shape": "pass arrays with the same dtype and trailing shape (all but axis 0)",
    "root": "pass the same root on every rank",
    "algorithm": "pass the same algorithm on every rank (and the same RINGCOLL_ALGO, "
                 "RINGCOLL_TUNING and RINGCOLL_SEGMENT_BYTES)",
    "layout": "pass x in the same memory layout (C or F order) on every rank",
    "in_place": "call in place (out=x) on every rank or on none, as with MPI_IN_PLACE",
}


def agreed(exc):
    """Mark exc as raised on every rank alike: no rank waits for this one (see module doc)."""
    exc.ringcoll_agreed = True
    return exc


def _context(t):
    return f"ringcoll rank {t.rank}, {t.progress.call()}: "


# -- the always-on neighbour check ---------------------------------------------------------
def _header(collective, count, dtype, op_name, blocks=None):
    """(collective, count, op, dtype name as 2 int64, itemsize): blocks, uneven block sizes
    the ranks chose (reduce_scatter's counts=), go into the last field as a crc above the
    itemsize, so ranks that split differently are caught too."""
    name = np.frombuffer(np.dtype(dtype).name.encode()[:16].ljust(16, b"\0"), np.int64)
    last = np.dtype(dtype).itemsize
    if blocks is not None:
        last += zlib.crc32(np.asarray(blocks, dtype=np.int64).tobytes()) << 8
    return np.array([HEADER_COLLECTIVES.index(collective), count, OPS.index(op_name),
                     *name, last], dtype=np.int64)


def _describe_header(h):
    name = h[3:5].tobytes().rstrip(b"\0").decode(errors="replace")
    collective = HEADER_COLLECTIVES[h[0]] if 0 <= h[0] < len(HEADER_COLLECTIVES) else "?"
    op = OPS[h[2]] if 0 <= h[2] < len(OPS) else "?"
    return f"{collective} of {h[1]} elements of {name} with op {op!r}"


def neighbour_check(t, collective, count, dtype, op_name, blocks=None):
    """Raise CollectiveMismatchError if the left neighbour's call differs from this rank's
    (blocks: the block sizes, where the caller chose them)."""
    bind_neighbour_check(t, collective, count, dtype, op_name, blocks)()


def bind_neighbour_check(t, collective, count, dtype, op_name, blocks=None):
    """neighbour_check as a zero-argument step, its header and buffers made once (a plan's
    repeated calls then only exchange and compare)."""
    p, r = t.size, t.rank
    if p == 1:
        return _nothing
    mine = _header(collective, count, dtype, op_name, blocks)
    theirs = np.empty_like(mine)
    expected = mine.tobytes()

    def step():
        t.sendrecv(mine, (r + 1) % p, theirs, (r - 1) % p, Tag.HEADER)
        if theirs.tobytes() != expected:
            _mismatch(t, mine, theirs, blocks)
    return step


def _nothing():
    pass


def _mismatch(t, mine, theirs, blocks):
    p, r = t.size, t.rank
    if np.array_equal(mine[:5], theirs[:5]) and mine[5] & 255 == theirs[5] & 255:
        raise CollectiveMismatchError(
            f"{_context(t)}rank {(r - 1) % p} split the result into other blocks than this "
            f"rank ({blocks if blocks is not None else 'the default split'}); pass the same "
            "counts= on every rank")
    raise CollectiveMismatchError(
        f"{_context(t)}rank {(r - 1) % p} called {_describe_header(theirs)}, this rank "
        f"{_describe_header(mine)}. Pass the same count, dtype and op on every rank "
        "(RINGCOLL_DEBUG=1 compares every argument of every call on all ranks).")


# -- debug mode's fingerprints ---------------------------------------------------------------
def fingerprint(seq, collective, fields):
    """The fixed-size record of a call: JSON of its fields, padded to FINGERPRINT_BYTES."""
    record = {"seq": seq, "collective": collective, **fields}
    text = json.dumps(record)
    if len(text) > FINGERPRINT_BYTES and "shape" in record:  # a very long shape: summarise
        shape = record["shape"]
        record["shape"] = f"{len(shape)}-d, crc {zlib.crc32(repr(shape).encode())}"
        text = json.dumps(record)
    if len(text) > FINGERPRINT_BYTES and "error" in record:
        record["error"] = record["error"][:FINGERPRINT_BYTES - len(text) - 4] + "..."
        text = json.dumps(record)
    buf = np.zeros(FINGERPRINT_BYTES, dtype=np.uint8)
    raw = text.encode()[:FINGERPRINT_BYTES]
    buf[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return buf


def exchange_fingerprints(t, record):
    """All-gather every rank's fingerprint: a (p, FINGERPRINT_BYTES) table whose row r is rank
    r's record (Bruck's all-gather, algorithms/bruck.py: ceil(log2 p) sendrecv steps)."""
    return bruck.allgather(t, record, Tag.FINGERPRINT)


def _decode(row):
    text = row.tobytes().rstrip(b"\0").decode(errors="replace")
    try:
        return json.loads(text)
    except ValueError:  # not a fingerprint: the peer is running something else entirely
        return {"collective": f"something that is not a ringcoll fingerprint ({text[:40]!r})"}


def compare(t, slots):
    """Raise on every rank alike if the records disagree (or a rank reported an error)."""
    if (slots == slots[0]).all():  # the usual case: every byte agrees, nothing to decode
        return
    records = [_decode(row) for row in slots]  # in rank order
    failed = [r for r, rec in enumerate(records) if "error" in rec]
    if failed:
        if t.rank in failed:
            return  # the caller raises this rank's own error
        r = failed[0]
        raise agreed(PeerFailedError(
            f"{_context(t)}rank(s) {failed} could not start this collective, so no rank runs "
            f"it; rank {r}: {records[r]['error']}"))
    calls = {}  # the distinct calls, each with the ranks that made it
    for r, rec in enumerate(records):
        calls.setdefault(json.dumps(rec, sort_keys=True), []).append(r)
    fields = dict.fromkeys(k for rec in records for k in rec)
    differ = [k for k in fields if len({json.dumps(rec.get(k)) for rec in records}) > 1]
    if "seq" in differ or "collective" in differ:  # then the rest differ as a consequence
        differ = [k for k in differ if k in ("seq", "collective")]
    lines = [f"  rank(s) {ranks}: {_describe(records[ranks[0]])}" for ranks in calls.values()]
    fixes = "; ".join(_FIXES.get(k, f"pass the same {k} on every rank") for k in differ)
    raise agreed(CollectiveMismatchError(
        f"{_context(t)}the ranks disagree on this call ({', '.join(differ)} differ):\n"
        + "\n".join(lines) + f"\nFix: {fixes}."))


def _describe(rec):
    head = f"{rec.get('collective')} #{rec.get('seq')}"
    rest = ", ".join(f"{k}={v}" for k, v in rec.items() if k not in ("seq", "collective"))
    return f"{head} ({rest})"
