"""ringcoll's exceptions: one small hierarchy so callers can catch what they expect.

Every message names the rank that raised, the collective, and what to do about it.
"""


class RingcollError(RuntimeError):
    """Base class of every error ringcoll raises on purpose."""


class CollectiveMismatchError(RingcollError):
    """Ranks called the same collective with arguments that cannot work together
    (different element counts, dtypes, trailing shapes, roots...)."""


class CollectiveTimeoutError(RingcollError):
    """A peer did not answer within the configured timeout (RINGCOLL_TIMEOUT)."""


class PeerFailedError(RingcollError):
    """Another rank failed, so this rank's collective cannot complete."""


def where(rank, collective):
    """The 'rank R, allreduce: ' prefix every error message starts with."""
    return f"ringcoll rank {rank}, {collective}: "
