"""The torch backend's CudaMemory (ringcoll/torch/process_group.py) on a recording stand-in for
torch.cuda and CuPy: the order of what it asks CUDA to do, which a CPU cannot run.

What each test pins down is a rule the GPU depends on and no CPU run can show:
- a collective runs on the group's own stream of the tensor's GPU, made once per GPU, which
  first waits for the caller's current stream (its inputs), and CuPy is handed exactly that
  stream (ExternalStream of its pointer, on its device) while the call is made;
- the finishing copies run on that same stream and the host then synchronises it, in that
  order, so the Work's results are in memory when it completes;
- an empty tensor never reaches cupy.asarray (it may have no pointer).
The whole path on real CUDA tensors is tests/mpi_torch.py --device cuda (scripts/gpu_check.sh);
its logic on fake device arrays under mpiexec is the --fake-device launch in test_torch.py.
"""

import contextlib
import importlib
import sys
import types
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed")



def _process_group():
    """ringcoll.torch.process_group, imported without running ringcoll/torch/__init__.py
    (whose rendezvous calls MPI, which this pytest process does not initialise)."""
    name = "ringcoll.torch.process_group"
    if name not in sys.modules:
        import ringcoll

        package = types.ModuleType("ringcoll.torch")
        package.__path__ = [str(Path(ringcoll.__file__).parent / "torch")]
        saved = sys.modules.get("ringcoll.torch")
        sys.modules["ringcoll.torch"] = package
        try:
            return importlib.import_module(name)
        finally:
            del sys.modules[name]  # forget the stand-in's child: a real import starts fresh
            if saved is None:
                del sys.modules["ringcoll.torch"]
            else:
                sys.modules["ringcoll.torch"] = saved
    return sys.modules[name]


pg = _process_group()


class Recorder:
    def __init__(self):
        self.log = []


class FakeStream:
    def __init__(self, rec, device, ptr):
        self.rec, self.device, self.cuda_stream = rec, device, ptr

    def wait_stream(self, other):
        self.rec.log.append(("wait_stream", self.cuda_stream, other.cuda_stream))

    def synchronize(self):
        self.rec.log.append(("synchronize", self.cuda_stream))


def fake_torch_cuda(rec, monkeypatch):
    made = []

    def stream(device):
        s = FakeStream(rec, torch.device(device), 1000 + len(made))
        made.append(s)
        rec.log.append(("new stream", s.cuda_stream, s.device.index))
        return s

    @contextlib.contextmanager
    def use(s):
        rec.log.append(("enter torch stream", s.cuda_stream))
        yield
        rec.log.append(("exit torch stream", s.cuda_stream))

    current = {}

    def current_stream(device):
        return current.setdefault(device.index, FakeStream(rec, device, 7 + device.index))

    monkeypatch.setattr(torch.cuda, "Stream", stream)
    monkeypatch.setattr(torch.cuda, "stream", use)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    return made


def fake_cupy(rec):
    @contextlib.contextmanager
    def device(index):
        rec.log.append(("enter cupy device", index))
        yield
        rec.log.append(("exit cupy device", index))

    @contextlib.contextmanager
    def external(ptr, device_id):
        rec.log.append(("enter cupy stream", ptr, device_id))
        yield
        rec.log.append(("exit cupy stream", ptr))

    def asarray(t):
        rec.log.append(("asarray", tuple(t.shape)))
        return t.numpy()

    def empty(shape, dtype):
        rec.log.append(("empty", shape, np.dtype(dtype).name))
        return np.empty(shape, dtype)

    cuda = types.SimpleNamespace(Device=device, ExternalStream=external)
    return types.SimpleNamespace(cuda=cuda, asarray=asarray, empty=empty)


class OnDevice:
    """A CPU tensor standing in for one on cuda:<index> (CudaMemory reads .device.index)."""

    def __init__(self, t, index):
        self.t, self.device = t, torch.device("cuda", index)
        self.shape, self.dtype = t.shape, t.dtype

    def numel(self):
        return self.t.numel()

    def numpy(self):
        return self.t.numpy()


class Comm:
    def __init__(self, rec):
        self.rec = rec

    def iallreduce(self, x, op, out=None):
        self.rec.log.append(("iallreduce", op))
        return "request"


def test_a_collective_runs_on_the_groups_stream_after_the_callers(monkeypatch):
    rec = Recorder()
    made = fake_torch_cuda(rec, monkeypatch)
    memory = pg.CudaMemory(fake_cupy(rec))
    t = OnDevice(torch.ones(3), 1)
    s = memory.stream(t)
    assert memory.stream(OnDevice(torch.ones(2), 1)) is s  # one stream per GPU, kept
    other = memory.stream(OnDevice(torch.ones(2), 0))
    assert other is not s and len(made) == 2
    x = memory.array(t)
    assert memory.run(s, Comm(rec), "iallreduce", x, "sum", out=x) == "request"
    log = rec.log[rec.log.index(("asarray", (3,))) + 1:]
    assert log == [("wait_stream", s.cuda_stream, 8),  # the caller's current stream on GPU 1
                   ("enter cupy device", 1), ("enter cupy stream", s.cuda_stream, 1),
                   ("iallreduce", "sum"),
                   ("exit cupy stream", s.cuda_stream), ("exit cupy device", 1)]


def test_settle_copies_on_the_collectives_stream_then_synchronises_it(monkeypatch):
    rec = Recorder()
    fake_torch_cuda(rec, monkeypatch)
    memory = pg.CudaMemory(fake_cupy(rec))
    s = memory.stream(OnDevice(torch.ones(1), 0))
    memory.settle(s, [lambda: rec.log.append(("copy", 1)), lambda: rec.log.append(("copy", 2))])
    assert rec.log[1:] == [("enter torch stream", s.cuda_stream), ("copy", 1), ("copy", 2),
                           ("exit torch stream", s.cuda_stream), ("synchronize", s.cuda_stream)]


def test_an_empty_tensor_is_allocated_not_viewed(monkeypatch):
    rec = Recorder()
    fake_torch_cuda(rec, monkeypatch)
    memory = pg.CudaMemory(fake_cupy(rec))
    x = memory.array(OnDevice(torch.ones(0, dtype=torch.int16), 2))
    assert x.shape == (0,) and x.dtype == np.int16
    assert rec.log == [("enter cupy device", 2), ("empty", (0,), "int16"),
                       ("exit cupy device", 2)]


def test_cuda_tensors_without_cupy_name_the_install(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_cupy(name, *args, **kwargs):
        if name == "cupy":
            raise ImportError("No module named 'cupy'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_cupy)
    with pytest.raises(pg.InvalidTypeError, match="pip install cupy-cuda12x"):
        pg.MEMORIES["cuda"]("ringcoll rank 0, allreduce: ")
