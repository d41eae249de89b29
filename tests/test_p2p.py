"""Point-to-point messages (Communicator.send/recv/isend/irecv/sendrecv), in both tiers.

- Thread tier: every case of tests/_p2p_cases.py at p = 1..6 (each receiver checks bitwise
  against the payload rebuilt from (sender, receiver, tag)), then the argument checks and the
  failures: a size mismatch is an error naming both ranks, a missing message a timeout, never
  a hang.
- MPI tier: the same cases under `mpiexec -n 1..4` (tests/mpi_p2p.py), the wildcard ones
  (ringcoll.ANY_SOURCE) also at -n 5, and the failures under mpiexec: the job ends with exit
  code 70 and the error text, within the deadline.
- Wildcards: besides the shared cases (the right data and sender on every rank, every message
  exactly once, in order per sender, specific and wildcard receives mixed), a wildcard beside
  a trace, its bad arguments, and the simulator's refusal.
"""

import numpy as np
import pytest

import ringcoll
from ringcoll.transport.base import MAX_USER_TAG, Tag, describe_tag, p2p_tag

import _mpirun as mpirun
import _p2p_cases

TIMEOUT = 20


def run(p, fn, **options):
    options.setdefault("timeout", TIMEOUT)
    return ringcoll.run_threads(p, fn, **options)


@pytest.mark.parametrize("p", range(1, 7))
def test_every_case_on_thread_ranks(p):
    names = run(p, _p2p_cases.run_all)
    assert names == [[c.__name__ for c in _p2p_cases.CASES]] * p


def test_wire_tags_never_match_a_collective():
    """User tag u travels as u * 32 + 16: never a collective's tag modulo the view stride."""
    collective = {int(t) for t in Tag if t not in (Tag.P2P, Tag.VIEW_STRIDE)}
    for u in (0, 1, 7, MAX_USER_TAG):
        wire = p2p_tag(u)
        assert wire % Tag.VIEW_STRIDE not in collective and wire <= 32767
        assert describe_tag(wire) == f"point-to-point tag {u}"
    assert len({p2p_tag(u) for u in range(MAX_USER_TAG + 1)}) == MAX_USER_TAG + 1


# -- arguments: refused on the calling rank before anything is sent ----------------------------
BAD = [
    (lambda c: c.send(np.ones(2), 2), ringcoll.InvalidArgumentError, "dest=2 is not a rank"),
    (lambda c: c.send(np.ones(2), -1), ringcoll.InvalidArgumentError, "dest=-1 is not a rank"),
    (lambda c: c.isend(np.ones(2), True), ringcoll.InvalidArgumentError, "dest=True"),
    (lambda c: c.recv(np.empty(2), 1.0), ringcoll.InvalidArgumentError, "source=1.0"),
    (lambda c: c.send(np.ones(2), 1, tag=MAX_USER_TAG + 1), ringcoll.InvalidArgumentError,
     "tag=1024 must be an integer in 0..1023"),
    (lambda c: c.irecv(np.empty(2), 1, tag=-1), ringcoll.InvalidArgumentError, "tag=-1"),
    (lambda c: c.send(np.ones(2), c.rank), ringcoll.InvalidArgumentError,
     "blocking send to this rank itself"),
    (lambda c: c.recv([0.0, 0.0], 1), ringcoll.InvalidTypeError, "out must be a NumPy array"),
    (lambda c: c.recv(np.empty((4, 4))[:, ::2], 1), ringcoll.InvalidArgumentError,
     "out is not contiguous"),
    (lambda c: c.recv(np.broadcast_to(np.empty(1), (3,)), 1), ringcoll.InvalidArgumentError,
     "read-only"),
    (lambda c: c.send(np.array(["a"]), 1), ringcoll.InvalidTypeError, "is not supported"),
    (lambda c: c.sendrecv(np.ones(2), 1, np.empty(2), source=5), ringcoll.InvalidArgumentError,
     "source=5"),
    (lambda c: c.recv(np.empty(2), 2), ringcoll.InvalidArgumentError,
     r"recv: source=2 is not a rank of this communicator \(0..1\) nor ringcoll.ANY_SOURCE "
     r"\(-1\); pass the sending rank, or ringcoll.ANY_SOURCE"),
    (lambda c: c.irecv(np.empty(2), -2), ringcoll.InvalidArgumentError,
     r"irecv: source=-2 .* nor ringcoll.ANY_SOURCE .*not mpi4py's MPI.ANY_SOURCE"),
    (lambda c: c.send(np.ones(2), ringcoll.ANY_SOURCE), ringcoll.InvalidArgumentError,
     "dest=-1 is not a rank"),
    (lambda c: c.sendrecv(np.ones(2), 1, np.empty(2), source=ringcoll.ANY_SOURCE),
     ringcoll.InvalidArgumentError, "sendrecv names its source"),
    (lambda c: c.recv(np.empty(2), ringcoll.ANY_SOURCE, status={}), ringcoll.InvalidTypeError,
     "status must be a ringcoll.Status"),
]


@pytest.mark.parametrize("call,error,text", BAD)
def test_bad_arguments_are_refused_before_sending(call, error, text):
    def body(comm):
        with pytest.raises(error, match=text) as info:
            call(comm)
        assert str(info.value).startswith(f"ringcoll rank {comm.rank}, ")
        return True

    assert run(2, body) == [True, True]


def test_closed_communicator_refuses_messages():
    def body(comm):
        comm.close()
        with pytest.raises(ringcoll.CommunicatorClosedError, match="recv: this Communicator"):
            comm.recv(np.empty(1), 0)
        return True

    assert run(2, body) == [True, True]


# -- failures: a clear error on the receiver, the others released, never a hang ----------------
@pytest.mark.parametrize("sent,expected,nonblocking", [(3, 2, False), (1, 2, True),
                                                       (0, 1, False)])
def test_size_mismatch_names_both_ranks_and_the_fix(sent, expected, nonblocking):
    outcome = {}

    def body(comm):
        try:
            if comm.rank == 0:
                comm.send(np.ones(sent), 1, tag=4)
                comm.barrier()  # waits for rank 1, which fails: released, not stuck
            else:
                out = np.empty(expected)
                if nonblocking:
                    comm.irecv(out, 0, tag=4).wait()
                else:
                    comm.recv(out, 0, tag=4)
        except ringcoll.RingcollError as exc:
            outcome[comm.rank] = exc
            raise

    with pytest.raises(ringcoll.CollectiveMismatchError):
        run(2, body)
    msg = str(outcome[1])
    assert isinstance(outcome[1], ringcoll.CollectiveMismatchError)
    assert msg.startswith("ringcoll rank 1, ") and "from 0" in msg
    assert (f"rank 0 sent {8 * sent} bytes (point-to-point tag 4) to rank 1, whose receive "
            f"buffer holds {8 * expected} bytes") in msg
    assert "buffer of exactly the size and dtype rank 0 sends" in msg
    assert isinstance(outcome[0], ringcoll.PeerFailedError)


def test_a_message_never_sent_times_out():
    def body(comm):
        if comm.rank == 1:
            comm.recv(np.empty(2), 0, tag=3)

    with pytest.raises(ringcoll.CollectiveTimeoutError,
                       match=r"recv from 0 #1: no message from rank 0 \(point-to-point tag 3\)"):
        run(2, body, timeout=0.5)


def test_a_polled_wait_for_a_message_never_sent_times_out():
    def body(comm):
        if comm.rank == 1:
            comm.irecv(np.empty(2), 0, tag=3).wait(poll=1e-3)

    with pytest.raises(ringcoll.CollectiveTimeoutError,
                       match=r"wait for irecv from 0 #2: no message from rank 0"):
        run(2, body, timeout=0.3)


def test_a_polled_wait_stops_when_a_peer_fails():
    def body(comm):
        if comm.rank == 0:
            raise RuntimeError("rank 0 broke")
        comm.irecv(np.empty(2), 0).wait(poll=1e-3)

    outcome = []

    def wrapped(comm):
        try:
            body(comm)
        except Exception as exc:  # noqa: BLE001 - inspected below
            outcome.append((comm.rank, exc))
            raise

    with pytest.raises(RuntimeError, match="rank 0 broke"):
        run(2, wrapped)
    failed = dict(outcome)
    assert isinstance(failed[1], ringcoll.PeerFailedError) and "rank 0 failed" in str(failed[1])


# -- wildcards beyond the shared cases ---------------------------------------------------------
def test_any_source_is_public_and_minus_one():
    assert ringcoll.ANY_SOURCE == -1 and "ANY_SOURCE" in ringcoll.__all__
    assert "Status" in ringcoll.__all__ and ringcoll.Status().source is None


def test_a_wildcard_receive_never_matched_times_out_naming_any_rank():
    def body(comm):
        if comm.rank == 1:
            comm.recv(np.empty(2), ringcoll.ANY_SOURCE, tag=3)

    with pytest.raises(ringcoll.CollectiveTimeoutError,
                       match=r"recv from any rank #1: no message from any rank "
                             r"\(point-to-point tag 3\)"):
        run(2, body, timeout=0.5)


def test_a_wildcard_size_mismatch_names_the_sender():
    outcome = {}

    def body(comm):
        try:
            if comm.rank == 2:
                comm.send(np.ones(3), 0, tag=1)
            comm.barrier()
            if comm.rank == 0:
                comm.recv(np.empty(2), ringcoll.ANY_SOURCE, tag=1)
        except ringcoll.RingcollError as exc:
            outcome[comm.rank] = exc
            raise

    with pytest.raises(ringcoll.CollectiveMismatchError):
        run(3, body)
    assert "rank 2 sent 24 bytes (point-to-point tag 1) to rank 0" in str(outcome[0])


def test_a_trace_records_a_wildcards_sender():
    """A wildcard's Receive is posted with src -1; once it completes, src is the sender."""
    def body(comm):
        senders = []
        with comm.trace() as t:
            if comm.rank == 0:
                for _ in range(comm.size - 1):
                    req = comm.irecv(np.empty(1), ringcoll.ANY_SOURCE)
                    req.wait()
                    senders.append(req.source)
                st = ringcoll.Status()
                comm.recv(np.empty(1), ringcoll.ANY_SOURCE, tag=2, status=st)
                senders.append(st.source)
            else:
                comm.send(np.ones(1), 0)
                if comm.rank == 1:
                    comm.send(np.ones(1), 0, tag=2)
        comm.barrier()
        return senders, sorted((r.src, r.tag, r.order) for r in t.receives)

    senders, receives = run(4, body)[0]
    assert sorted(senders[:3]) == [1, 2, 3] and senders[3] == 1
    assert receives == [(1, "point-to-point tag 0", 0), (1, "point-to-point tag 2", 0),
                        (2, "point-to-point tag 0", 0), (3, "point-to-point tag 0", 0)]


def test_the_simulator_refuses_a_wildcard_receive():
    from ringcoll import netsim
    from ringcoll.transport.simulated import RECV, WAIT, RecordingTransport

    t = RecordingTransport(0, 2)
    with pytest.raises(ringcoll.InvalidArgumentError,
                       match=r"ringcoll rank 0, after collective #0: a receive from any source "
                             r"\(ANY_SOURCE\) cannot be simulated: the network simulator "
                             r"records each rank's schedule and replays it deterministically.*"
                             r"Name the source"):
        t.irecv(np.empty(1), ringcoll.ANY_SOURCE, 16)
    assert t.ops == []  # nothing recorded
    comm = ringcoll.Communicator(transport=RecordingTransport(1, 2))
    with pytest.raises(ringcoll.InvalidArgumentError, match="recv from any rank #1: a receive "
                       "from any source"):
        comm.recv(np.empty(1), ringcoll.ANY_SOURCE)
    logs = [[(RECV, -1, 16, 8), (WAIT, 0)], []]
    with pytest.raises(ringcoll.InvalidArgumentError, match="rank 0, replay of op 0: a receive "
                       "from any source .*cannot be simulated"):
        netsim.replay(netsim.Cluster(nodes=1, devices_per_node=2), logs)


# -- MPI tier -------------------------------------------------------------------------------------
@mpirun.needs_mpi
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_every_case_under_mpiexec(p, mpi_timings):
    rc, out, secs = mpirun.launch(p, ["tests/mpi_p2p.py"], env={"RINGCOLL_TIMEOUT": "30"},
                                  timeout=120)
    mpi_timings[f"mpi_p2p -n {p}"] = secs
    assert rc == 0, out[-4000:]
    assert "FAIL" not in out and out.count("OK p2p ") == len(_p2p_cases.CASES), out[-4000:]


@mpirun.needs_mpi
@pytest.mark.parametrize("p", [2, 3, 5])
def test_wildcard_cases_under_mpiexec(p, mpi_timings):
    rc, out, secs = mpirun.launch(p, ["tests/mpi_p2p.py", "wildcards"],
                                  env={"RINGCOLL_TIMEOUT": "30"}, timeout=120)
    mpi_timings[f"mpi_p2p -n {p} wildcards"] = secs
    assert rc == 0, out[-4000:]
    assert "FAIL" not in out and out.count("OK p2p wildcard") == len(
        _p2p_cases.WILDCARD_CASES), out[-4000:]


@mpirun.needs_mpi
@pytest.mark.parametrize("scenario,texts", [
    ("any", ["CollectiveTimeoutError: ringcoll rank 1, recv from any rank #1: no progress for",
             "waiting at step 1: any rank (point-to-point tag 0)"]),
    ("any_long", ["CollectiveMismatchError: ringcoll rank 1, recv from any rank #1: rank 0 "
                  "sent 24 bytes (point-to-point tag 0) to rank 1, whose receive buffer "
                  "holds 16 bytes"]),
    ("long", ["CollectiveMismatchError: ringcoll rank 1, recv from 0 #1: rank 0 sent 24 bytes "
              "(point-to-point tag 0) to rank 1, whose receive buffer holds 16 bytes"]),
    ("short", ["CollectiveMismatchError: ringcoll rank 1, wait for irecv from 0 #2: rank 0 "
               "sent 8 bytes", "buffer of exactly the size and dtype rank 0 sends"]),
    ("never", ["CollectiveTimeoutError: ringcoll rank 1, recv from 0 #1: no progress for",
               "waiting at step 1: rank 0 (point-to-point tag 0)"]),
    ("polled", ["CollectiveTimeoutError: ringcoll rank 1, wait for irecv from 0 #2: no "
                "progress for", "waiting at step 1: rank 0 (point-to-point tag 0)"]),
])
def test_failures_under_mpiexec_end_the_job(scenario, texts, mpi_timings):
    rc, out, secs = mpirun.launch(2, ["tests/mpi_p2p.py", scenario],
                                  env={"RINGCOLL_TIMEOUT": "3"}, timeout=60)
    mpi_timings[f"mpi_p2p -n 2 {scenario}"] = secs
    assert rc is not None, f"{scenario}: hung past the deadline:\n{out[-3000:]}"
    assert rc in (70, 9), out[-3000:]  # ringcoll's ABORT_CODE (9: hydra killed it mid-abort)
    for text in texts:
        assert text in out, f"{text!r} not in:\n{out[-3000:]}"
    assert "finished" not in out
