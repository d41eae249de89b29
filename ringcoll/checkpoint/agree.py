"""The checkpoint protocol's one rule: after every step, every rank learns every outcome.

A checkpoint is saved and loaded in a few steps (plan, write, commit; read, apply). Each step
runs on every rank as

    values = step(comm, what, fn)

fn runs locally (file I/O, checks); whatever it returns or raises, the rank then takes part in
one exchange (an all-gather of a small JSON record: two all-gathers, the lengths and then the
bytes), so no rank can leave the step while another waits in a collective, and no rank's
error can be read as the answer to a later step (the bug this replaces: a root-only
exception left its peers in a broadcast that the next call's broadcast then completed).

If fn failed anywhere, every rank raises a CheckpointError with the problem and path of the
lowest failing rank: a rank that found the same raises its own exception (with its
traceback), the others a copy naming that rank, so `except CheckpointError as e: e.problem`
branches alike on every rank.
Otherwise every rank gets the list of every rank's value, in rank order.

Cost per step: 2 all-gathers of p * (8 + record bytes); a failure adds nothing (it rides in
the record). The communicator is left exactly as usable as before: every rank made the same
collective calls.
"""

import json

import numpy as np

from ..errors import CheckpointError


def step(comm, what, fn, path):
    """Run fn() on this rank and exchange the outcome; see the module docstring. path: the
    checkpoint, the .path of an error that names no file of its own (a bad argument)."""
    failure = None
    try:
        record = {"ok": fn()}
    except CheckpointError as exc:
        failure = exc
    except Exception as exc:  # noqa: BLE001 - any failure must reach the other ranks
        failure = CheckpointError(
            f"ringcoll rank {comm.rank}, {what}: {type(exc).__name__}: {exc}",
            problem="error", rank=comm.rank)
        failure.__cause__ = exc
    if failure is not None:
        if failure.rank is None:
            failure.rank = comm.rank
        if failure.path is None:
            failure.path = path
        message = str(failure)
        prefix = f"ringcoll rank {comm.rank}, {what}: "
        record = {"error": {"message": message[len(prefix):] if message.startswith(prefix)
                            else message, "path": failure.path,
                            "problem": failure.problem, "rank": failure.rank}}
    records = exchange(comm, record)
    failed = [r for r in records if "error" in r]
    if not failed:
        return [r["ok"] for r in records]
    first = failed[0]["error"]
    if failure is not None and (failure.problem, failure.path) == (first["problem"],
                                                                   first["path"]):
        failure.rank = first["rank"]  # the lowest finder, as on every rank
        raise failure  # this rank found the same: its own error, with its traceback
    more = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
    raise CheckpointError(f"ringcoll rank {comm.rank}, {what}: rank {first['rank']} "
                          f"found{more}: {first['message']}", path=first["path"],
                          problem=first["problem"], rank=first["rank"])


def exchange(comm, value):
    """Every rank's JSON-able value, in rank order, on every rank."""
    data = np.frombuffer(json.dumps(value).encode(), dtype=np.uint8)
    if comm.size == 1:
        return [json.loads(data.tobytes())]
    sizes = comm.allgather(np.array([data.size], dtype=np.int64))
    everything = comm.allgather(data).tobytes()
    out, at = [], 0
    for n in sizes.tolist():
        out.append(json.loads(everything[at:at + n]))
        at += n
    return out
