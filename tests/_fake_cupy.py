"""A CPU stand-in for CuPy's array API, for testing code written once over the array module
(`xp = ringcoll.arrays.array_module(x)`) without a GPU. It is not a GPU and says nothing
about kernels, streams or CUDA; tests/test_gpu.py and scripts/gpu_check.sh do that on one.

What it checks is the discipline that CuPy enforces and NumPy does not:

- its arrays are a type of their own (`fake.ndarray`, a NumPy subclass underneath, so every
  result is computed by NumPy and must equal the NumPy path bit for bit);
- a ufunc mixing them with NumPy arrays raises TypeError, as CuPy's do;
- NumPy functions on them (`np.copyto`, `np.zeros_like`, ...) raise TypeError: code must call
  the array module's own; `x.get()` and `fake.asnumpy(x)` copy to the host,
  `fake.asarray(np_array)` to the "device".

One hole: `np.asarray(x)` and `np.array(x)` pass a NumPy subclass through without asking it
(CuPy raises "Implicit conversion to a NumPy array is not allowed"). What such a conversion
makes is a plain NumPy array, so the tests catch it where it is used next (a ufunc with the
fake's arrays raises) or kept (they check the types of what the code returns and stores).

Install it for one test with `monkeypatch.setitem(sys.modules, "cupy", fake_cupy.module())`:
ringcoll.arrays.is_device then sees its arrays as device arrays, as it would CuPy's.
"""

import itertools
import threading
import types

import numpy as np


class ndarray(np.ndarray):  # noqa: N801 - CuPy's name
    """A "device" array: NumPy's memory and kernels, CuPy's manners."""

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        for x in inputs + (out or ()):
            if isinstance(x, np.ndarray) and not isinstance(x, ndarray):
                raise TypeError(f"Unsupported type {type(x)} (a NumPy array in a ufunc on "
                                "device arrays)")
        args = [_host(x) for x in inputs]
        if out is not None:
            kwargs["out"] = tuple(_host(o) for o in out)
        result = getattr(ufunc, method)(*args, **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _device(result)

    def __array_function__(self, func, types_, args, kwargs):
        raise TypeError(f"numpy.{func.__name__} on a device array: use the array module's "
                        "own function (xp = array_module(x))")

    def get(self):
        return np.array(self.view(np.ndarray), copy=True)


def _host(x):
    return x.view(np.ndarray) if isinstance(x, ndarray) else x


def _device(x):
    return x.view(ndarray) if isinstance(x, np.ndarray) else x


def _on_device(*arrays):
    for x in arrays:
        if isinstance(x, np.ndarray) and not isinstance(x, ndarray):
            raise TypeError(f"Unsupported type {type(x)} (a NumPy array where a device array "
                            "belongs)")


def empty(shape, dtype=float):
    return np.empty(shape, dtype).view(ndarray)


def zeros(shape, dtype=float):
    return np.zeros(shape, dtype).view(ndarray)


def empty_like(x, dtype=None):
    _on_device(x)
    return np.empty_like(_host(x), dtype=dtype).view(ndarray)


def zeros_like(x, dtype=None):
    _on_device(x)
    return np.zeros_like(_host(x), dtype=dtype).view(ndarray)


def array(x, dtype=None, copy=True):
    """A new device array from a device array or host data (a host-to-device copy)."""
    return np.array(_host(x), dtype=dtype, copy=True).view(ndarray)


def asarray(x, dtype=None):
    if isinstance(x, ndarray) and (dtype is None or x.dtype == dtype):
        return x
    return array(x, dtype=dtype)


def asnumpy(x):
    return x.get() if isinstance(x, ndarray) else np.asarray(x)


def copyto(dst, src, casting="same_kind"):
    _on_device(dst, src)
    np.copyto(_host(dst), _host(src), casting=casting)


def concatenate(arrays):
    _on_device(*arrays)
    return np.concatenate([_host(a) for a in arrays]).view(ndarray)


def argpartition(a, kth):
    _on_device(a)
    return np.argpartition(_host(a), kth).view(ndarray)


class StagedComm:
    """A ringcoll Communicator (thread ranks) that takes the fake's arrays: each collective
    on them copies to the host, runs the real collective there and copies the result back,
    as the real Communicator's staged device path does with CuPy arrays (minus the GPU).
    Host arrays pass straight through. What it lets the tests check is the code above it
    (DistributedOptimizer, compression) keeping every buffer on the "device"."""

    def __init__(self, comm, cuda=None):
        self.comm, self.rank, self.size = comm, comm.rank, comm.size
        self.cuda = cuda  # the fake's cuda namespace: each collective logs its current stream

    def _log(self, name):
        if self.cuda is not None:
            self.cuda.log.append(("call", name, self.cuda.get_current_stream().name))

    def shared_array(self, shape, dtype=np.float32, xp=np):
        return xp.zeros(shape, dtype)  # registered memory is the real path's business

    def allreduce(self, x, op="sum", out=None, **kw):
        if not isinstance(x, ndarray):
            return self.comm.allreduce(x, op=op, out=out, **kw)
        result = asarray(self.comm.allreduce(x.get(), op=op, **kw))
        if out is None:
            return result
        copyto(out, result)
        return out

    def iallreduce(self, x, op="sum", out=None, **kw):
        self._log("iallreduce")
        if not isinstance(x, ndarray):
            return self.comm.iallreduce(x, op=op, out=out, **kw)
        host = x.get()
        return _Staged(self.comm.iallreduce(host, op=op, out=host, **kw), host,
                       x if out is None else out)

    def allgather(self, x, **kw):
        if not isinstance(x, ndarray):
            return self.comm.allgather(x, **kw)
        return asarray(self.comm.allgather(x.get(), **kw))

    def broadcast(self, x, root=0, **kw):
        if not isinstance(x, ndarray):
            return self.comm.broadcast(x, root=root, **kw)
        host = x.get()
        self.comm.broadcast(host, root=root, **kw)
        copyto(x, asarray(host))
        return x


class _Staged:
    """A Request whose result is copied back to the device when it completes."""

    def __init__(self, request, host, out):
        self.request, self.host, self.out = request, host, out

    @property
    def seconds(self):
        return self.request.seconds

    def wait(self):
        self.request.wait()
        copyto(self.out, asarray(self.host))
        return self.out


class Cuda:
    """CuPy's stream API (cupy.cuda.Stream, get_current_stream, record, wait_event), keeping
    a log instead of a GPU: which stream was current for each thread, what waited for what.
    Log entries: ("wait", waiting stream, stream of the event), ("call", collective, current
    stream) (from StagedComm). The null stream is every thread's until a `with stream:`."""

    def __init__(self):
        self.log, self._local, self._ids = [], threading.local(), itertools.count(1)
        self.null = FakeStream(self, "null")

    def get_current_stream(self):
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else self.null

    def Stream(self, non_blocking=False):  # noqa: N802 - CuPy's name
        return FakeStream(self, f"stream{next(self._ids)}")


class FakeStream:
    def __init__(self, cuda, name):
        self.cuda, self.name = cuda, name

    def __enter__(self):
        stack = self.cuda._local.__dict__.setdefault("stack", [])
        stack.append(self)
        return self

    def __exit__(self, *exc):
        self.cuda._local.stack.pop()

    def record(self):
        return types.SimpleNamespace(stream=self)

    def wait_event(self, event):
        self.cuda.log.append(("wait", self.name, event.stream.name))


def module():
    """A fresh module object named 'cupy' with the functions above and NumPy's ufuncs."""
    m = types.ModuleType("cupy")
    m.__file__ = __file__
    for name in ("ndarray", "empty", "zeros", "empty_like", "zeros_like", "array", "asarray",
                 "asnumpy", "copyto", "argpartition", "concatenate"):
        setattr(m, name, globals()[name])
    for name in ("add", "subtract", "multiply", "divide", "sqrt", "maximum", "minimum", "abs",
                 "float16", "float32", "float64", "dtype"):
        setattr(m, name, getattr(np, name))  # ufuncs dispatch to ndarray.__array_ufunc__
    m.cuda = Cuda()
    m.FAKE = True
    return m
