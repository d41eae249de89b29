"""ringcoll's exceptions: one small hierarchy so callers can catch what they expect.

    RingcollError                      every error ringcoll raises on purpose
      InvalidArgumentError (ValueError)  a bad argument on this rank, seen before any message
        InvalidTypeError (TypeError)     an unsupported dtype, op/dtype pair or argument type
      CommunicatorClosedError            a collective on a communicator after close()
      CollectiveMismatchError            ranks called a collective with arguments that
                                         cannot work together (counts, dtypes, roots, order)
      CollectiveTimeoutError             a peer did not answer within RINGCOLL_TIMEOUT
      PeerFailedError                    another rank failed, so this one cannot go on

InvalidArgumentError and InvalidTypeError are also ValueError and TypeError, so code written
against NumPy-style errors keeps working. Every message starts with the rank and the
collective ("ringcoll rank 2, allreduce #7 (ring): ...") and says what to do about it.
"""

#: the exit code a job ends with when ringcoll aborts it (MPI_Abort) after an error that
#: leaves other ranks unable to finish a collective (70 is sysexits' EX_SOFTWARE).
ABORT_CODE = 70


class RingcollError(RuntimeError):
    """Base class of every error ringcoll raises on purpose."""


class InvalidArgumentError(RingcollError, ValueError):
    """An argument is wrong on this rank (shape of out, root, op, algorithm, layout...).

    Raised before the collective sends anything, so the caller's arrays are untouched."""


class InvalidTypeError(InvalidArgumentError, TypeError):
    """An unsupported dtype, an op the dtype cannot take ('avg' on integers), or an argument
    of the wrong type (out that is not a NumPy array)."""


class CommunicatorClosedError(RingcollError):
    """A collective was called on a Communicator after close()."""


class CollectiveMismatchError(RingcollError):
    """Ranks called the same collective with arguments that cannot work together
    (different element counts, dtypes, trailing shapes, roots...), or different collectives;
    or a point-to-point message arrived in a receive buffer of another size."""


class CollectiveTimeoutError(RingcollError):
    """A peer did not answer within the configured timeout (RINGCOLL_TIMEOUT)."""


class PeerFailedError(RingcollError):
    """Another rank failed, so this rank's collective cannot complete."""


def where(rank, collective):
    """The 'ringcoll rank R, allreduce: ' prefix every error message starts with."""
    return f"ringcoll rank {rank}, {collective}: "
