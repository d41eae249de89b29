"""Reduction operators: "sum"/"prod"/"max"/"min"/"avg" (or mpi4py's MPI.SUM...) and the bitwise
"band"/"bor"/"bxor" of integers (host arrays only) -> kernels.

A ReduceOp gives algorithms a combine(a, b, out) function (out = a op b, in place into views)
and knows what 'avg' adds around the sum: a division by the process count, before the
reduction for float16/bfloat16 (so it cannot overflow) and after it for the other float types.
The kernels themselves live in ringcoll.kernels: NumPy ufuncs for host arrays, CUDA kernels
(ringcoll.kernels.cuda) for CuPy arrays; bind(dtype, xp) picks them once per call, so the same
numerics hold on both (float16/bfloat16 computed in float32, the same rounding).
"""

import numpy as np

from . import kernels
from .arrays import HALF_TYPES
from .errors import InvalidArgumentError, InvalidTypeError

_NAMES = {"sum": "sum", "prod": "prod", "max": "max", "min": "min", "avg": "avg", "mean": "avg",
          "band": "band", "bor": "bor", "bxor": "bxor"}
#: the bitwise ops: integer dtypes only, and NumPy arrays only (no CUDA kernel is written)
BITWISE = ("band", "bor", "bxor")


class ReduceOp:
    __slots__ = ("name", "ufunc", "mpi_name")

    def __init__(self, name):
        self.name = name
        self.ufunc = kernels.UFUNCS["sum" if name == "avg" else name]
        self.mpi_name = "SUM" if name == "avg" else name.upper()

    def __repr__(self):
        return f"ReduceOp({self.name!r})"

    def bind(self, dtype, xp=np):
        """The combine function algorithms call: combine(a, b, out) sets out = a (op) b.

        xp is the array module of the buffers: NumPy gets a Combine over NumPy ufuncs; CuPy gets
        a kernels.cuda.CudaReduction (one kernel launch per call, compiled on first use).
        """
        if xp is np:
            return Combine(self.ufunc, accumulate_dtype(dtype))
        if self.name in BITWISE:
            raise InvalidTypeError(f"op {self.name!r} runs on host (NumPy) arrays only; ringcoll "
                                   "has no CUDA kernel for it: reduce a NumPy copy")
        from .kernels import cuda  # only the GPU path needs it (and CuPy)

        return cuda.reduction("sum" if self.name == "avg" else self.name, dtype)

    def fuses_finish(self, dtype, size):
        """True when the finishing division of 'avg' can ride on the last reduction step
        (combine.final(size)): 'avg' on p > 1 ranks of a type that does not prescale."""
        return self.name == "avg" and size > 1 and not self.prescales(dtype, size)

    def prescales(self, dtype, size):
        """float16/bfloat16 'avg' divides each contribution by p *before* the sum (in float32),
        as NCCL does, so the sum cannot overflow where the average itself would fit."""
        return self.name == "avg" and size > 1 and np.dtype(dtype) in HALF_TYPES

    def start(self, src, target, size, combine=None):
        """The buffer to reduce: src itself, or src / size written into target (prescaling).
        combine (from bind) supplies the kernel for device arrays; None: the host one."""
        if not self.prescales(src.dtype, size):
            return src
        scale = kernels.scale_into if combine is None else combine.scale_into
        scale(src, size, target, accumulate_dtype(src.dtype))
        return target

    def finish(self, buf, size, combine=None):
        """The step after the reduction: divide by the process count for 'avg'."""
        if self.name == "avg" and size > 1 and buf.size and not self.prescales(buf.dtype, size):
            scale = kernels.scale_into if combine is None else combine.scale_into
            scale(buf, size, buf, accumulate_dtype(buf.dtype))


class Combine:
    """combine(a, b, out): out = a (op) b elementwise, out may alias a or b.

    combine.bind(a, b, out) is the same reduction as a zero-argument callable, for algorithms
    that build their schedule once and replay it (see recursive_doubling.schedule).
    """

    __slots__ = ("ufunc", "acc")

    def __init__(self, ufunc, acc):
        self.ufunc, self.acc = ufunc, acc

    def __call__(self, a, b, out):
        kernels.reduce_into(self.ufunc, a, b, out, self.acc)

    def bind(self, a, b, out):
        return kernels.bind_reduce(self.ufunc, a, b, out, self.acc)

    def final(self, divisor):
        """combine, then out /= divisor: the last ring step of 'avg' (see ReduceOp.fuses_finish).
        Two ufunc calls on the CPU, the same values as dividing the whole result afterwards."""
        ufunc, acc = self.ufunc, self.acc

        def combine_and_scale(a, b, out):
            kernels.reduce_into(ufunc, a, b, out, acc)
            kernels.scale_into(out, divisor, out, acc)
        return combine_and_scale

    @staticmethod
    def scale_into(src, divisor, out, acc=None):
        kernels.scale_into(src, divisor, out, acc)


_OPS = {name: ReduceOp(name) for name in ("sum", "prod", "max", "min", "avg") + BITWISE}


def get_op(op, where=""):
    """Accept "sum", ReduceOp, or an mpi4py MPI.Op (MPI.SUM/PROD/MAX/MIN)."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        name = _NAMES.get(op.lower())
        if name is not None:
            return _OPS[name]
    else:
        name = _mpi_op_name(op)
        if name is not None:
            return _OPS[name]
    raise InvalidArgumentError(
        f"{where}unknown reduction op {op!r}; use one of 'sum', 'prod', 'max', 'min', 'avg', "
        "'band', 'bor', 'bxor' or MPI.SUM/MPI.PROD/MPI.MAX/MPI.MIN"
    )


def _mpi_op_name(op):
    try:
        from mpi4py import MPI
    except ImportError:  # pragma: no cover
        return None
    if not isinstance(op, MPI.Op):
        return None
    # mpi4py's Op objects compare with == but cannot be dict keys.
    for mpi_op, name in ((MPI.SUM, "sum"), (MPI.PROD, "prod"), (MPI.MAX, "max"), (MPI.MIN, "min")):
        if op == mpi_op:
            return name
    return None


def check_op_dtype(op, dtype, where=""):
    dtype = np.dtype(dtype)
    if op.name == "avg" and dtype.kind in "iu":
        raise InvalidTypeError(
            f"{where}op 'avg' on integer dtype {dtype} would have to round; use op='sum' "
            "and divide yourself, or convert to a float dtype"
        )
    if op.name in BITWISE and dtype.kind not in "iu":
        raise InvalidTypeError(f"{where}op '{op.name}' is bitwise: integer dtypes only, got "
                               f"{dtype}; view the bits as an integer dtype of the same size")
    if op.name in ("max", "min") and dtype.kind == "c":
        raise InvalidTypeError(f"{where}op '{op.name}' is not defined for complex dtype {dtype}; "
                               "use 'sum' or 'prod', or reduce np.abs(x) or the real and imaginary "
                               "parts separately")


def accumulate_dtype(dtype):
    """float16/bfloat16 accumulate in float32 inside each reduction step."""
    return np.dtype(np.float32) if np.dtype(dtype) in HALF_TYPES else None
