"""CPU tensors through the torch backend's GPU path, for testing that path without a GPU.

    from _fake_torch_cuda import install
    install()        # before dist.init_process_group("ringcoll"): every group made after it

routes every CPU tensor of a "ringcoll" group through the code CUDA tensors take
(ringcoll/torch/process_group.py: its _Call with a memory whose ``host`` is False): views are
tests/_fake_cupy.py arrays of the tensors' own memory (so a NumPy function on them raises, as
CuPy does), bfloat16 reductions widen to float32 as on CuPy, sends and receives go through host
copies, and every call is made in the memory's ``run`` with the stream its ``stream`` gave and
finished by ``settle`` on that same stream, which the fake checks (a wrong or missing stream is
an AssertionError, so the Work fails and the suite reports it).

The collective itself runs on host copies of the fake arrays, through the group's real
Communicator (as ringcoll's staged device path would), and its outputs are copied back. What
this tests is the backend's logic on device memory; what it cannot is CUDA itself (CuPy's
views of torch's memory, the streams): scripts/gpu_check.sh runs tests/mpi_torch_cuda.py on a
GPU for that.
"""

import itertools
import threading

import _fake_cupy as fake

#: collectives whose first argument is also their output (in place)
_IN_PLACE = {"broadcast", "ibroadcast"}


class FakeStream:
    """A torch stream stand-in: which call made it, and whether it was settled."""

    _ids = itertools.count()

    def __init__(self):
        self.id, self.ran, self.settled = next(self._ids), 0, 0


class FakeCudaMemory:
    """The torch backend's memory interface (HostMemory/CudaMemory) over CPU tensors, with
    fake device arrays. Counts what it did, for the tests to check (totals over every
    instance, as each group makes its own)."""

    host = False
    bfloat16 = False
    counts = {"arrays": 0, "runs": 0, "settles": 0}
    _lock = threading.Lock()

    def __init__(self, ctx=None):
        self.streams = set()

    def _count(self, what):
        with self._lock:
            self.counts[what] += 1

    def array(self, t):
        assert str(t.dtype) != "torch.bfloat16", "a bfloat16 view where the GPU has none"
        self._count("arrays")
        return t.numpy().view(fake.ndarray)  # the tensor's own memory: results land in it

    def stream(self, t):
        s = FakeStream()
        self.streams.add(s.id)
        return s

    def run(self, stream, comm, name, *args, **kwargs):
        assert isinstance(stream, FakeStream) and stream.id in self.streams, \
            f"{name}: run on a stream this memory did not hand out ({stream!r})"
        self._count("runs")
        stream.ran += 1
        staged = {}  # id(fake array) -> (its host copy, the fake array)

        def host(a):
            if not isinstance(a, fake.ndarray):
                return a
            if id(a) not in staged:
                staged[id(a)] = (a.get(), a)
            return staged[id(a)][0]

        outputs = [kwargs.get("out")] + ([args[0]] if name in _IN_PLACE else [])
        result = getattr(comm, name)(*[host(a) for a in args],
                                     **{k: host(v) for k, v in kwargs.items()})
        back = [staged[id(o)] for o in outputs if isinstance(o, fake.ndarray)]
        if name.startswith("i"):  # a non-blocking call: its Request
            return _Staged(result, back)
        _copy_back(back)
        return result

    def settle(self, stream, later):
        assert isinstance(stream, FakeStream) and stream.id in self.streams, \
            f"settle on a stream this memory did not hand out ({stream!r})"
        stream.settled += 1
        self._count("settles")
        for fn in later:
            fn()


def _copy_back(pairs):
    for h, a in pairs:
        fake.copyto(a, fake.asarray(h))


class _Staged:
    """A ringcoll Request whose outputs are copied back to the fake device when it completes
    (before anything waiting on it is told)."""

    def __init__(self, request, back):
        self.request, self.back, self._copied = request, back, threading.Lock()
        self._done = False

    def _finish(self):
        self.request.wait()
        with self._copied:
            if not self._done:
                _copy_back(self.back)
                self._done = True

    def wait(self):
        self._finish()
        return self.request.wait()

    def add_done_callback(self, fn):
        def then(_):
            try:
                self._finish()
            except BaseException:  # noqa: B036,S110 - fn's wait() raises it again
                pass
            fn(self)
        self.request.add_done_callback(then)


def install():
    """Route every "ringcoll" group's CPU tensors through FakeCudaMemory (this process)."""
    from ringcoll.torch import process_group

    process_group.MEMORIES["cpu"] = FakeCudaMemory
