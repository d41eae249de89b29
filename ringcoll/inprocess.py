"""Every rank a thread in this process: run_threads and simulate.

Front-ends over the Communicator on the thread transport (transport/threads.py), which follows
MPI's matching rules, so every algorithm runs exactly as under mpiexec: for tests,
experiments, traces and teaching, with no MPI at all.
"""

from .communicator import Communicator
from .config import Options
from .transport import threads
from .transport.trace import Trace


def run_threads(size, fn, timeout=None, **options):
    """Run fn(comm) on `size` in-process ranks (threads); return the results in rank order.

    The thread transport follows MPI's matching rules, so this runs every algorithm exactly as
    under mpiexec, in one process: handy for tests, experiments and teaching.

    Example::

        ringcoll.run_threads(4, lambda comm: comm.allreduce(np.array([comm.rank])))
        # -> [array([6]), array([6]), array([6]), array([6])]
    """
    seconds = Options.from_env(timeout=timeout).timeout
    wait = threads.DEFAULT_TIMEOUT if seconds is None else (seconds or None)  # 0: no limit

    def body(t):
        comm = Communicator(transport=t, **options)
        try:
            return fn(comm)
        finally:
            comm.wait_all()

    return threads.run(size, body, timeout=wait)


def simulate(size, fn, timeout=None, payloads=False, watch=None, **options):
    """Run fn(comm) on `size` thread ranks with tracing on: (results in rank order, Trace).

    The Trace holds every rank's messages and receives (see Communicator.trace).
    payloads=True keeps a copy of each message's data (`msg.payload`) and where it was sent
    from (`msg.offset_in(array)`); watch=fn(rank, buf, sending) is called before each message
    a rank sends or receives, and what it returns is kept as the record's `seen` (see
    ringcoll.transport.trace: `ringcoll explain` snapshots every rank's buffers with it).

    Example::

        results, trace = ringcoll.simulate(
            4, lambda comm: comm.allreduce(np.arange(8.0), algorithm="ring"), payloads=True)
        trace.bytes_sent(0)   # 144: 3 blocks of 2 float64 in each half, and the 48-byte header
        first = trace.select(src=0, tag="ring_reduce_scatter").messages[0]
        first.payload   # array([6., 7.]): block 3, the first rank 0 sends on the ring
    """
    trace = Trace(payloads=payloads, watch=watch)

    def body(comm):
        with comm.trace(trace):
            return fn(comm)

    return run_threads(size, body, timeout=timeout, **options), trace
