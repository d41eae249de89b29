"""`native`: the MPI library's own collectives, for A/B comparison.

These call the transport's native_* methods (MPI_Allreduce and friends on ringcoll's duplicated
communicator); they exist only on the MPI transport. MPI has no datatype for float16 or
bfloat16, so those cannot use `native` for a reduction; the data-movement collectives
(broadcast, allgather, alltoall) send bytes and take any fixed-size dtype.
"""

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
