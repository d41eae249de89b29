"""ringcoll's exceptions: one small hierarchy so callers can catch what they expect.

    RingcollError                      every error ringcoll raises on purpose
      InvalidArgumentError (ValueError)  a bad argument on this rank, seen before any message
        InvalidTypeError (TypeError)     an unsupported dtype, op/dtype pair or argument type
      CommunicatorClosedError            a collective on a communicator after close()
      CollectiveMismatchError            ranks called a collective with arguments that
                                         cannot work together (counts, dtypes, roots, order)
      CollectiveTimeoutError             a peer did not answer within RINGCOLL_TIMEOUT
      PeerFailedError                    another rank failed, so this one cannot go on
      CheckpointError                    a checkpoint could not be saved or loaded; raised
                                         on every rank alike (.path, .problem, .rank)

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


class CheckpointError(RingcollError):
    """A checkpoint could not be saved or loaded, raised on every rank of the call alike.

    Attributes:
        path: the file or directory at fault (a shard, the manifest, the checkpoint).
        problem: what is wrong, one of PROBLEMS (a stable word to branch on:
            ``if exc.problem == "missing": start from scratch``).
        rank: the rank that found it (the lowest, when several did).

    The model's arrays and the optimizer's state are untouched and the communicator is
    usable afterwards (ringcoll/checkpoint/agree.py: every rank learns every outcome).
    """

    PROBLEMS = {
        "missing": "nothing at the path: no checkpoint was saved there",
        "corrupt": "damaged: a shard missing or truncated, a checksum or the manifest wrong",
        "not-a-checkpoint": "the path holds something ringcoll did not write",
        "newer-version": "written by a newer ringcoll checkpoint format",
        "mismatch": "names, shapes, dtypes or the optimizer differ from the model's",
        "write-failed": "saving failed: no space, no permission, not a shared filesystem",
        "invalid": "a bad argument (shards, extra, an optimizer mid-step)",
        "error": "anything else (a bug: the message has the traceback's last line)",
    }

    def __init__(self, message, path=None, problem="error", rank=None):
        super().__init__(message)
        self.path, self.problem, self.rank = path, problem, rank


def where(rank, collective):
    """The 'ringcoll rank R, allreduce: ' prefix every error message starts with."""
    return f"ringcoll rank {rank}, {collective}: "
