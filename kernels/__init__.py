"""Reduction kernels, installed as ringcoll.kernels.

On the CPU every kernel is a NumPy ufunc applied in place into a view:
`reduce_into(ufunc, a, b, out, acc)` computes out = a (op) b elementwise, where out may alias a
or b, accumulating in `acc` (float32 for float16/bfloat16) without a temporary array.
The GPU kernels (CuPy) will live beside these.
"""

import numpy as np

UFUNCS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


def reduce_into(ufunc, a, b, out, acc=None):
    """out = ufunc(a, b), elementwise, with `acc` as the computation dtype when given."""
    if acc is None:
        ufunc(a, b, out=out)
    else:
        ufunc(a, b, out=out, dtype=acc, casting="unsafe")


def scale_into(buf, divisor, acc=None):
    """buf /= divisor in place (the 'avg' finish), in `acc` precision when given."""
    if buf.dtype.kind in "fc" or acc is not None:
        np.divide(buf, divisor, out=buf, dtype=acc, casting="unsafe")
    else:  # pragma: no cover - avg on integers is rejected before we get here
        raise TypeError("avg needs a float or complex dtype")
