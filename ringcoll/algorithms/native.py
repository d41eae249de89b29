"""`native`: the MPI library's own collectives, for A/B comparison.

These call the transport's native_* methods (MPI_Allreduce and friends on ringcoll's duplicated
communicator); they exist only on the MPI transport. MPI has no datatype for float16 or
bfloat16, so those cannot use `native` for a reduction; the data-movement collectives
(broadcast, allgather, alltoall) send bytes and take any fixed-size dtype.
"""

from functools import partial

from ..arrays import HALF_TYPES
from ..errors import InvalidArgumentError, InvalidTypeError


def check(t, dtype, where):
    if not hasattr(t, "native_allreduce"):
        raise InvalidArgumentError(f"{where}algorithm 'native' needs the MPI transport; "
                            "pick a ringcoll algorithm such as 'ring'")
    if dtype in HALF_TYPES:
        raise InvalidTypeError(f"{where}MPI cannot reduce {dtype}; use a ringcoll algorithm "
                               "(for example algorithm='ring'), which accumulates it in float32")


def bind_allreduce(t, src, dst, op_name):
    """MPI_Allreduce of src into dst (in place when src is dst) as a zero-argument step."""
    return t.bind_native_allreduce(src, dst, op_name)


def bind(t, call, *args):
    """t's MPI collective `call` ("native_reduce", ...) with args, as a zero-argument step.

    The MPI transport binds mpi4py's own method with its arguments prepared (operation,
    in-place marker, byte specs), so a repeated small call runs no Python of ours between
    the plan and MPI: the whole of ringcoll's cost there. Other transports (a device's over
    MPI) have no bind_<call>: their method is bound as it is."""
    binder = getattr(t, "bind_" + call, None)
    return binder(*args) if binder is not None else partial(getattr(t, call), *args)
