"""Reduction kernels, installed as ringcoll.kernels.

On the CPU every kernel is a NumPy ufunc applied in place into a view:
`reduce_into(ufunc, a, b, out, acc)` computes out = a (op) b elementwise, where out may alias a
or b, accumulating in `acc` (float32 for float16/bfloat16) without a temporary array.
`bind_reduce` returns the same call with its arguments bound, for schedules replayed many times.
The GPU kernels for CuPy arrays are in kernels/cuda.py (ringcoll.kernels.cuda), imported only
when a CuPy array is reduced; ringcoll.ops picks between the two once per call.
"""

from functools import partial

import numpy as np

UFUNCS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum,
          "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}


def reduce_into(ufunc, a, b, out, acc=None):
    """out = ufunc(a, b), elementwise, with `acc` as the computation dtype when given."""
    if acc is None:
        ufunc(a, b, out=out)
    else:
        ufunc(a, b, out=out, dtype=acc, casting="unsafe")


def bind_reduce(ufunc, a, b, out, acc=None):
    """reduce_into(ufunc, a, b, out, acc) as a zero-argument callable: the ufunc itself with
    its arguments bound, so a replay costs one C call and no Python frame."""
    if acc is None:
        return partial(ufunc, a, b, out=out)
    return partial(ufunc, a, b, out=out, dtype=acc, casting="unsafe")


def scale_into(src, divisor, out, acc=None):
    """out = src / divisor (the 'avg' step), in `acc` precision when given; out may be src."""
    np.divide(src, divisor, out=out, dtype=acc, casting="unsafe")
