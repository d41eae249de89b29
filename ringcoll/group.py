"""Group: the state one communicator's collectives, runner and messages share.

The Communicator (the facade) builds one Group and passes it down: who the ranks are and how
they sit on nodes, the options, the host and device sides with their transports, the
Progress record the watchdog reads, auto's inputs (tuning table, cost model) and its cache of
choices, and whether the communicator is closed. Nothing here runs a collective.
"""

from .cache import BoundedCache
from .errors import CommunicatorClosedError, where
from .sides import Sides

#: distinct declared calls (collective, counts, dtype and row shape, root) a communicator
#: keeps agreed; one more costs a count exchange again for the oldest
DECLARED_LIMIT = 64


class Group:
    """What a collective's plan may use of its communicator (see the module doc)."""

    def __init__(self, transport, options, nodes, tuning, cost_model):
        self.rank, self.size = transport.rank, transport.size
        self.options, self.nodes = options, nodes
        self.tuning, self.cost_model = tuning, cost_model
        self.sides = Sides(transport, options, self.rank)
        self.host = self.sides.host  # NumPy arrays' side: its transport is the group's own
        self.progress = transport.progress  # the running collective, for errors and watchdog
        self.choices = BoundedCache()  # auto's picks: (nbytes, inplace) or ("inner", nbytes)
        self.slots = {}  # collective -> bytes of rows that ride with its counts (allgather.Rows)
        # collective -> the count exchange whose call on this rank was its last and ended
        # fine (alltoallv.Counts): a call that repeats it may skip the verdict round
        self.last_fine = {}
        # calls whose counts every rank declared and all agreed on once (allgather.declared):
        # filled and evicted alike on every rank, since each insertion follows an exchange
        self.declared = BoundedCache(DECLARED_LIMIT)
        self.closed = False

    @property
    def t(self):
        """The host transport (a TracingTransport inside comm.trace())."""
        return self.host.t

    def check_open(self, collective):
        if self.closed:
            raise CommunicatorClosedError(
                f"{where(self.rank, collective)}this Communicator was closed; create a new "
                "one (ringcoll.Communicator(comm)) or call collectives before close()")
