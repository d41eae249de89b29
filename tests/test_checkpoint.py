"""Checkpoints (ringcoll.checkpoint) on the thread transport, asserted on every rank.

    1. failures      every bad checkpoint, every bad save: the same CheckpointError (.problem,
                     .path, .rank) on every rank, naming the file, fast, with the model, the
                     optimizer, the previous checkpoint and the communicator left as they were
    2. shifted       the reported bug: in a loop over bad checkpoints each call's error is
                     about that call's own file, on every rank
    3. round trips   SGD / Adam, dtypes, 0-d and empty arrays, extra, the inner optimizer or
                     the DistributedOptimizer, overwrite, a save killed between its renames
    4. exact resume  a DistributedOptimizer's residuals and accumulated gradients
    5. resharding    tensor-, data- and pipeline-parallel layouts and a dp x tp Mesh, saved
                     at one shape and loaded at another
    6. chunks        a reader of a few rows reads only the chunks holding them

tests/mpi_checkpoint.py and tests/test_checkpoint_mpi.py run checkpoints under mpiexec (and a
rank SIGKILLed mid-save); these check the semantics, fast, in one process. Gradients are small
integers and training is elementwise (SGD, Adam), so a block of a tensor trained on its own is
bitwise the block of the tensor trained whole, and most comparisons are bitwise.
"""

import errno
import json
import os
import pickle
import time
import zlib

import numpy as np
import pytest

import ringcoll
import ringcoll.checkpoint.files as ckfiles
import ringcoll.checkpoint.layout as cklayout
from ringcoll import CheckpointError, RingcollError
from ringcoll.checkpoint import Shard, shard
from ringcoll.compression import Compression
from ringcoll.optim import SGD, Adam
from ringcoll.parallel import ColumnParallelLinear, ParallelMLP, RowParallelLinear, Sequential
from test_dp_units import MODEL, grads_for, make_params, run, same_bits, snapshot

#: a failed call on a small checkpoint must end on every rank well within this (seconds)
FAST = 1.0


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def same(a, b):
    """a and b equal all the way down, arrays bitwise (dtype, shape and bytes)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) and same_bits(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(same(x, y) for x, y in zip(a, b)))
    return a == b


def split(optimizer):
    if isinstance(optimizer, ringcoll.DistributedOptimizer):
        return optimizer.optimizer, optimizer
    return optimizer, None


def wrapper_state(wrapper):
    """The DistributedOptimizer's own state; mid-step (when wrapper_state_dict refuses) its
    counters and gradient buffers."""
    try:
        return wrapper.wrapper_state_dict()
    except ValueError:
        return {"mid-step": [wrapper._passes, wrapper._waiting, wrapper._next,
                             [b.buf.copy() for b in wrapper.buckets],
                             [sorted(b.waiting) for b in wrapper.buckets]]}


def capture(params, optimizer=None):
    """Everything a failed call must leave as it was: parameters, the optimizer's state
    (state_dict) and a DistributedOptimizer's own (wrapper_state_dict)."""
    inner, wrapper = split(optimizer)
    return {"params": snapshot(params),
            "state": None if inner is None else inner.state_dict(),
            "wrapper": None if wrapper is None else wrapper_state(wrapper)}


def attempt(comm, call, params, optimizer=None):
    """call() on this rank, expected to fail: what the checks need (the exception, how long
    the call took, the state before and after it, an all-reduce right after it)."""
    before = capture(params, optimizer)
    start = time.perf_counter()
    try:
        call()
        exc = None
    except Exception as e:  # noqa: BLE001 - inspected by check_failed
        exc = e
    seconds = time.perf_counter() - start
    after = capture(params, optimizer)
    total = comm.allreduce(np.array([comm.rank + 1.0]))
    return {"exc": exc, "seconds": seconds, "before": before, "after": after,
            "sum": float(total[0]), "p": comm.size}


def check_failed(results, problem, path, named=None, rank=None):
    """Every rank raised a CheckpointError with the same problem and path (and, given
    `rank`, naming that rank as the finder: test_every_rank_names_the_lowest_finder checks
    .rank where several ranks find the fault); its message starts with the rank and names
    `named` (default: the path at fault); the call ended fast; parameters and optimizer
    state are untouched; an all-reduce right after worked."""
    assert problem in CheckpointError.PROBLEMS
    named = [path] if named is None else ([named] if isinstance(named, str) else named)
    p = len(results)
    ranks = set()
    for r, res in enumerate(results):
        e = res["exc"]
        assert isinstance(e, CheckpointError), f"rank {r} raised {e!r}, not a CheckpointError"
        assert isinstance(e, RingcollError)
        msg = str(e)
        assert e.problem == problem, (r, e.problem, msg)
        assert e.path == path, (r, e.path, path, msg)
        assert isinstance(e.rank, int) and 0 <= e.rank < p, (r, e.rank, msg)
        ranks.add(e.rank)
        assert msg.startswith(f"ringcoll rank {r}, "), (r, msg)
        for needle in named:
            assert needle in msg, (r, needle, msg)
        assert res["seconds"] < FAST, (r, res["seconds"], msg)
        assert same(res["before"], res["after"]), f"rank {r}: the call changed the model"
        assert res["sum"] == p * (p + 1) / 2, (r, res["sum"])
    if rank is not None:
        assert ranks == {rank}, f"the ranks name the finders {ranks}, not {rank}"
    return results[0]["exc"]


def dp_model(comm, seed=1, kind="sgd", model=MODEL, steps=2, wrap=True, **wrapper_options):
    """A data-parallel replica (the same on every rank) trained `steps` steps: (params, the
    DistributedOptimizer, or with wrap=False the inner optimizer trained alone)."""
    params = make_params(seed=seed, model=model)
    inner = SGD(params, lr=0.1, momentum=0.9) if kind == "sgd" else Adam(params, lr=0.01)
    if not wrap:
        for s in range(steps):
            inner.step(grads_for(params, 0, s, seed))
        return params, inner
    opt = ringcoll.DistributedOptimizer(inner, comm, bucket_bytes=40, **wrapper_options)
    passes = opt.backward_passes_per_step
    for s in range(steps):
        for k in range(passes - 1):
            for n, g in grads_for(params, comm.rank, s * passes + k, seed).items():
                opt.grad_ready(n, g)
        opt.step(grads_for(params, comm.rank, s * passes + passes - 1, seed))
    return params, opt


def save_good(path, p=2, seed=1, kind="sgd", model=MODEL, extra=None, **wrapper_options):
    """Save a trained data-parallel model at p ranks; rank 0's (params, state_dict)."""

    def fn(comm):
        params, opt = dp_model(comm, seed, kind, model, **wrapper_options)
        ringcoll.save_checkpoint(path, params, opt, comm=comm, extra=extra)
        return snapshot(params), opt.optimizer.state_dict()

    return run(p, fn)[0]


def assert_loads(path, want, p=2, kind="sgd", model=MODEL):
    """The checkpoint at path loads at p ranks and gives `want` (params, state_dict)."""

    def fn(comm):
        params, opt = dp_model(comm, seed=77, kind=kind, model=model, steps=0, wrap=False)
        ringcoll.load_checkpoint(path, params, opt, comm=comm)
        return snapshot(params), opt.state_dict()

    for r, got in enumerate(run(p, fn)):
        assert same(got[0], want[0]), f"rank {r}: not the saved parameters"
        assert same(got[1], want[1]), f"rank {r}: not the saved optimizer state"


def manifest_of(path):
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)


def edit_manifest(path, change):
    m = manifest_of(path)
    change(m)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(m, f)


def piece_of(path, key, index=0):
    """(the shard file's full path, the piece record) of tensor key's index-th piece."""
    piece = manifest_of(path)["tensors"][key]["pieces"][index]
    return os.path.join(path, piece["shard"]), piece


def flip_byte(filename, offset):
    with open(filename, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def leftovers(path):
    """Temporary or set-aside directories of path still on disk."""
    parent, base = os.path.split(path)
    return sorted(n for n in os.listdir(parent)
                  if n.startswith(base + ".tmp-") or n.startswith(base + ".old-"))


# -- model parallel: a Megatron MLP, a column-parallel head, and whole parameters --------------
def full_model(seed=3):
    """The global tensors: an MLP 4 -> 7 -> 5 (hidden 7: every tp > 1 splits it unevenly), a
    column-parallel 5 -> 9 and a row-parallel 9 -> 3, a whole vector and a 0-d scalar;
    float64 and float32."""
    rng = np.random.default_rng(seed)
    shapes = {"w1": ((4, 7), np.float64), "b1": ((7,), np.float64),
              "w2": ((7, 5), np.float64), "b2": ((5,), np.float64),
              "hw": ((5, 9), np.float32), "hb": ((9,), np.float32),
              "rw": ((9, 3), np.float32), "rb": ((3,), np.float32),
              "scale": ((3,), np.float32), "temp": ((), np.float64)}
    return {n: np.asarray(rng.standard_normal(s)).astype(d) for n, (s, d) in shapes.items()}


def tp_model(tp_comm, full):
    """(model, params, shards) of this rank's blocks over tp_comm, from copies of full."""
    full = {n: a.copy() for n, a in full.items()}
    model = Sequential([
        ParallelMLP.from_full(tp_comm, full["w1"], full["b1"], full["w2"], full["b2"]),
        ColumnParallelLinear.from_full(tp_comm, full["hw"], full["hb"], names=("hw", "hb")),
        RowParallelLinear.from_full(tp_comm, full["rw"], full["rb"], names=("rw", "rb"))])
    params = {**model.params, "scale": full["scale"], "temp": full["temp"]}
    return model, params, model.shards()


def full_params(model):
    """The whole parameters of the model's tensor-parallel layers (collective)."""
    return {n: a for layer in model.layers for n, a in layer.full_params().items()}


def block_of(name, a, shards):
    """The global index of the local array a of parameter `name`."""
    spec = shards.get(name, Shard(a.shape, (0,) * a.ndim))
    return spec.shape, tuple(slice(s, s + n) for s, n in zip(spec.start, a.shape)) + (...,)


def global_grads(full_shapes, step):
    """Integer gradients of the global tensors, the same whatever the layout."""
    return {n: np.asarray(np.random.default_rng([step, zlib.crc32(n.encode())]).integers(
        -8, 9, shape), np.float64) for n, shape in full_shapes.items()}


def train_blocks(params, shards, optimizer, steps, first=0):
    """Train this rank's blocks with its blocks of the global gradients (elementwise, so
    bitwise what training the whole tensors gives)."""
    shapes = {n: block_of(n, a, shards)[0] for n, a in params.items()}
    for s in range(first, first + steps):
        g = global_grads(shapes, s)
        optimizer.step({n: np.array(g[n][block_of(n, a, shards)[1]], a.dtype)
                        for n, a in params.items()})


def assemble(ranks):
    """The global tensors from every rank's (params, shards, state_dict): parameters and
    optimizer state arrays, each element set by some rank (copies must agree)."""
    out = {}
    for params, shards, state in ranks:
        arrays = {f"param/{n}": a for n, a in params.items()}
        for n, st in (state or {"state": {}})["state"].items():
            arrays.update({f"state/{n}/{k}": v for k, v in st.items()
                           if isinstance(v, np.ndarray)})
            for k, v in st.items():
                if not isinstance(v, np.ndarray):
                    assert out.setdefault(f"scalar/{n}/{k}", (v, None))[0] == v, (n, k)
        for key, a in arrays.items():
            name = key.split("/")[1]
            shape, index = block_of(name, params[name], shards)
            if key not in out:
                out[key] = (np.zeros(shape, a.dtype), np.zeros(shape, bool))
            whole, seen = out[key]
            if seen[index].any():
                assert same_bits(whole[index][seen[index]], a[seen[index]]), key
            whole[index] = a
            seen[index] = True
    for key, (whole, seen) in out.items():
        assert seen is None or seen.all(), f"no rank holds all of {key}"
    return {key: whole for key, (whole, _) in out.items()}


def assert_blocks(ranks, full):
    """Every rank's blocks (params and optimizer state) are exactly its part of `full`."""
    for r, (params, shards, state) in enumerate(ranks):
        for n, a in params.items():
            _, index = block_of(n, a, shards)
            assert same_bits(a, full[f"param/{n}"][index]), (r, n)
            for k, v in (state["state"].get(n, {}) if state else {}).items():
                if isinstance(v, np.ndarray):
                    assert same_bits(v, full[f"state/{n}/{k}"][index]), (r, n, k)
                else:
                    assert v == full[f"scalar/{n}/{k}"], (r, n, k)


# ---------------------------------------------------------------------------------------------
# 1. failures: load
# ---------------------------------------------------------------------------------------------
def load_fails(path, p, problem, bad, named=None, rank=None, model=MODEL, kind="sgd",
               wrap=True, make=None, **load_options):
    """load_checkpoint(path) into a trained model on p ranks fails alike on every rank."""

    def fn(comm):
        if make is not None:
            params, opt, shards = make(comm)
        else:
            params, opt = dp_model(comm, seed=2, kind=kind, model=model, wrap=wrap,
                                   compression=Compression.topk(0.3))
            shards = None
        return attempt(comm, lambda: ringcoll.load_checkpoint(
            path, params, opt, comm=comm, shards=shards, **load_options), params, opt)

    return check_failed(run(p, fn), problem, bad, named=named, rank=rank)


def _good_with_residuals(path, p):
    """A checkpoint of a DistributedOptimizer with top-k residuals (so loading into one
    would change its wrapper state)."""
    save_good(path, p=p, compression=Compression.topk(0.3))


@pytest.mark.parametrize("p", [1, 2, 3])
def test_load_missing_directory(tmp_path, p):
    path = str(tmp_path / "nothing")
    exc = load_fails(path, p, "missing", path)
    assert "does not exist" in str(exc)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("p", [2, 3])
def test_load_a_file_not_a_directory(tmp_path, p):
    path = tmp_path / "ckpt"
    path.write_bytes(b"some bytes")
    load_fails(str(path), p, "not-a-checkpoint", str(path))
    assert path.read_bytes() == b"some bytes"


@pytest.mark.parametrize("p", [2, 3])
def test_load_a_directory_without_manifest(tmp_path, p):
    path = tmp_path / "results"
    path.mkdir()
    (path / "notes.txt").write_text("keep")
    exc = load_fails(str(path), p, "not-a-checkpoint", str(path))
    assert "manifest.json" in str(exc)


@pytest.mark.parametrize("p", [1, 2, 3])
def test_load_manifest_not_json(tmp_path, p):
    path = str(tmp_path / "ckpt")
    _good_with_residuals(path, p)
    with open(os.path.join(path, "manifest.json"), "wb") as f:
        f.write(b'{"format": "ringcoll-checkpoint", "vers')  # a manifest cut short
    load_fails(path, p, "corrupt", os.path.join(path, "manifest.json"))


@pytest.mark.parametrize("p", [2, 3])
def test_load_manifest_of_another_format(tmp_path, p):
    path = str(tmp_path / "ckpt")
    _good_with_residuals(path, p)
    edit_manifest(path, lambda m: m.update(format="someone-elses"))
    load_fails(path, p, "not-a-checkpoint", os.path.join(path, "manifest.json"))


@pytest.mark.parametrize("p", [2, 3])
def test_load_newer_version(tmp_path, p):
    path = str(tmp_path / "ckpt")
    _good_with_residuals(path, p)
    edit_manifest(path, lambda m: m.update(version=3))
    exc = load_fails(path, p, "newer-version", os.path.join(path, "manifest.json"),
                     named=path)
    assert "3" in str(exc) and "upgrade" in str(exc)


@pytest.mark.parametrize("p", [1, 2, 3])
def test_load_truncated_shard(tmp_path, p):
    path = str(tmp_path / "ckpt")
    _good_with_residuals(path, p)
    shard_file = os.path.join(path, "shard-00000.bin")
    size = os.path.getsize(shard_file)
    os.truncate(shard_file, size // 2)
    exc = load_fails(path, p, "corrupt", shard_file)
    assert "truncated" in str(exc)


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("key", ["param/w2", "state/b3/momentum_buffer"])
def test_load_shard_with_flipped_bytes(tmp_path, p, key):
    path = str(tmp_path / "ckpt")
    _good_with_residuals(path, p)
    shard_file, piece = piece_of(path, key)
    flip_byte(shard_file, piece["offset"] + piece["nbytes"] // 2)
    exc = load_fails(path, p, "corrupt", shard_file)
    assert "checksum" in str(exc)


@pytest.mark.parametrize("p", [2, 3])
def test_load_deleted_shard(tmp_path, p):
    path = str(tmp_path / "ckpt")
    _good_with_residuals(path, p)
    shard_file = os.path.join(path, "shard-00000.bin")
    os.remove(shard_file)
    load_fails(path, p, "corrupt", shard_file)  # damaged, not absent: never "start afresh"


DETONATED = []


def _detonate():
    DETONATED.append(True)
    return np.zeros(1)


class _Bomb:
    def __reduce__(self):
        return (_detonate, ())


@pytest.mark.parametrize("p", [1, 2])
def test_load_object_dtype_is_corrupt_and_nothing_is_unpickled(tmp_path, monkeypatch, p):
    """A manifest naming dtype "object" over a shard holding a pickle (crc and sizes all
    right): corrupt, and nothing is unpickled (pickle's loaders and np.load never run)."""
    path = str(tmp_path / "ckpt")
    _good_with_residuals(path, p)
    bomb = pickle.dumps(np.array([_Bomb()], dtype=object))
    with open(os.path.join(path, "shard-00009.bin"), "wb") as f:
        f.write(bomb)

    def poison(m):
        m["shards"]["shard-00009.bin"] = {"nbytes": len(bomb), "crc32": zlib.crc32(bomb),
                                          "rank": 9}
        m["tensors"]["param/w1"] = {"shape": [1], "dtype": "object", "pieces": [
            {"shard": "shard-00009.bin", "start": [0], "shape": [1], "offset": 0,
             "nbytes": len(bomb), "crc32": zlib.crc32(bomb)}]}

    edit_manifest(path, poison)
    calls = []

    def spy(name):
        def refuse(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"load_checkpoint called {name}")
        return refuse

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, spy(f"pickle.{name}"))
    monkeypatch.setattr(np, "load", spy("np.load"))
    DETONATED.clear()
    exc = load_fails(path, p, "corrupt", os.path.join(path, "manifest.json"))
    assert "object" in str(exc)
    assert DETONATED == [] and calls == []


def _other_model(change):
    model = list(MODEL)
    if change == "names":
        model[1] = ("bias1", (3,), np.float32)
    elif change == "shape":
        model[1] = ("b1", (4,), np.float32)
    elif change == "dtype":
        model[1] = ("b1", (3,), np.float64)
    elif change == "extra-parameter":
        model.append(("w4", (2, 2), np.float32))
    elif change == "fewer-parameters":
        model = model[:-1]  # no b3
    return model


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("change", ["names", "shape", "dtype", "extra-parameter"])
def test_load_into_another_model(tmp_path, p, change):
    path = str(tmp_path / "ckpt")
    _good_with_residuals(path, p)
    exc = load_fails(path, p, "mismatch", path, model=_other_model(change))
    assert "'b1'" in str(exc) or "'w4'" in str(exc) or "b1" in str(exc)
    if change == "dtype":
        assert "float32" in str(exc) and "float64" in str(exc)
    if change == "shape":
        assert "(3,)" in str(exc) and "(4,)" in str(exc)


@pytest.mark.parametrize("p", [2, 3])
def test_load_another_optimizer_type(tmp_path, p):
    path = str(tmp_path / "ckpt")
    _good_with_residuals(path, p)  # SGD
    exc = load_fails(path, p, "mismatch", path, kind="adam")
    assert "SGD" in str(exc) and "Adam" in str(exc)


@pytest.mark.parametrize("p", [2, 3])
def test_load_strict_every_saved_parameter_must_be_loaded(tmp_path, p):
    path = str(tmp_path / "ckpt")
    want = save_good(path, p=p)
    exc = load_fails(path, p, "mismatch", path, model=_other_model("fewer-parameters"),
                     wrap=False)
    assert "b3" in str(exc) and "strict=False" in str(exc)

    def lenient(comm):  # strict=False: loads what the model has
        params, opt = dp_model(comm, seed=2, model=_other_model("fewer-parameters"),
                               wrap=False)
        ringcoll.load_checkpoint(path, params, opt, comm=comm, strict=False)
        return snapshot(params), opt.state_dict()

    for params, state in run(p, lenient):
        assert list(params) == [n for n, _, _ in MODEL[:-1]]
        for n in params:
            assert same_bits(params[n], want[0][n]), n
            assert same(state["state"][n], want[1]["state"][n]), n


@pytest.mark.parametrize("p", [2, 3, 4])
def test_load_failure_found_on_one_rank_only_corrupt_block(tmp_path, p):
    """A tp-sharded checkpoint whose only corrupt piece is the last rank's block: that rank
    alone reads it, and every rank learns of it."""
    path = str(tmp_path / "ckpt")
    full = full_model()

    def save(comm):
        model, params, shards = tp_model(comm, full)
        opt = SGD(params, lr=0.1, momentum=0.9)
        train_blocks(params, shards, opt, 2)
        ringcoll.save_checkpoint(path, params, opt, comm=comm, shards=shards)

    run(p, save)
    shard_file, piece = piece_of(path, "param/hw", index=p - 1)
    assert piece["shard"] == f"shard-{p - 1:05d}.bin"
    flip_byte(shard_file, piece["offset"] + 1)

    def make(comm):
        model, params, shards = tp_model(comm, full_model(seed=4))
        opt = SGD(params, lr=0.1, momentum=0.9)
        train_blocks(params, shards, opt, 1)
        return params, opt, shards

    exc = load_fails(path, p, "corrupt", shard_file, rank=p - 1, make=make)
    assert f"rank {p - 1}" in str(exc)


def test_load_failure_found_on_one_rank_only_wrong_shape(tmp_path):
    """Only rank 2's model has b1 of another shape: ranks 0 and 1 read fine, and learn."""
    path = str(tmp_path / "ckpt")
    _good_with_residuals(path, 3)

    def make(comm):
        model = _other_model("shape") if comm.rank == 2 else MODEL
        params, opt = dp_model(comm, seed=2, model=model, wrap=False)
        return params, opt, None

    exc = load_fails(path, 3, "mismatch", path, rank=2, make=make)
    assert "b1" in str(exc)


def test_load_ranks_finding_different_problems_all_raise_the_lowest_ranks(tmp_path):
    """Rank 0's model has a parameter the checkpoint lacks (mismatch) while rank 1's block
    is corrupt (corrupt): every rank raises rank 0's mismatch."""
    path = str(tmp_path / "ckpt")
    full = full_model()

    def save(comm):
        model, params, shards = tp_model(comm, full)
        ringcoll.save_checkpoint(path, params, comm=comm, shards=shards)

    run(2, save)
    shard_file, piece = piece_of(path, "param/hw", index=1)
    flip_byte(shard_file, piece["offset"])

    def make(comm):
        model, params, shards = tp_model(comm, full_model(seed=4))
        if comm.rank == 0:
            params["w9"] = np.zeros(2)
        opt = SGD(params, lr=0.1, momentum=0.9)
        train_blocks(params, shards, opt, 1)
        return params, opt, shards

    exc = load_fails(path, 2, "mismatch", path, rank=0, make=make)
    assert "w9" in str(exc)


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("offset", [-8, 1 << 62])
def test_load_manifest_with_a_piece_offset_out_of_range(tmp_path, p, offset):
    """A piece at a negative or impossible offset: the manifest is corrupt (not an OSError
    or ValueError escaping as problem "error")."""
    path = str(tmp_path / "ckpt")
    _good_with_residuals(path, p)
    edit_manifest(path, lambda m: m["tensors"]["param/w2"]["pieces"][0].update(offset=offset))
    load_fails(path, p, "corrupt", os.path.join(path, "manifest.json"))


@pytest.mark.parametrize("p", [1, 2])
def test_load_manifest_naming_a_shard_outside_the_checkpoint(tmp_path, p):
    path = str(tmp_path / "ckpt")
    _good_with_residuals(path, p)
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(bytes(1024))
    edit_manifest(path, lambda m: m["tensors"]["param/w2"]["pieces"][0].update(
        shard="../elsewhere.bin"))
    exc = load_fails(path, p, "corrupt", os.path.join(path, "manifest.json"))
    assert "elsewhere.bin" in str(exc)


@pytest.mark.parametrize("p", [2, 3])
def test_load_shards_naming_an_unknown_parameter(tmp_path, p):
    path = str(tmp_path / "ckpt")
    _good_with_residuals(path, p)

    def make(comm):
        params, opt = dp_model(comm, seed=2, compression=Compression.topk(0.3))
        return params, opt, {"nope": Shard((4, 3), (0, 0))}

    exc = load_fails(path, p, "invalid", path, make=make)
    assert "nope" in str(exc)


LOWEST_FINDER = {"load-missing": "missing", "load-corrupt-shard": "corrupt",
                 "load-shape": "mismatch", "save-shape": "mismatch", "save-overlap": "invalid"}


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("case", list(LOWEST_FINDER))
def test_every_rank_names_the_lowest_finder(tmp_path, p, case):
    """A fault every rank finds: .rank is the lowest finder (0) on every rank, as
    CheckpointError documents ("the rank that found it; the lowest, when several did")."""
    path = str(tmp_path / "ckpt")
    if case in ("load-corrupt-shard", "load-shape"):
        save_good(path, p=p)
    if case == "load-corrupt-shard":
        flip_byte(os.path.join(path, "shard-00000.bin"), 3)

    def fn(comm):
        if case == "save-overlap":
            params, opt, shards = _blocks_of(comm, [(0, 4), (3, 7), (3, 7)])
        else:
            shape = case == "load-shape" or (case == "save-shape" and comm.rank == p - 1)
            params, opt = dp_model(comm, seed=2, model=_other_model("shape") if shape
                                   else MODEL, wrap=False)
            shards = None
        try:
            if case.startswith("load"):
                ringcoll.load_checkpoint(path, params, opt, comm=comm)
            else:
                ringcoll.save_checkpoint(path, params, opt, comm=comm, shards=shards)
        except CheckpointError as e:
            return e.problem, e.rank
        return None

    assert run(p, fn) == [(LOWEST_FINDER[case], 0)] * p


# ---------------------------------------------------------------------------------------------
# 1. failures: save
# ---------------------------------------------------------------------------------------------
def save_fails(path, p, problem, bad=None, make=None, named=None, rank=None, extra=None,
               previous=True, then=None):
    """save_checkpoint(path) on p ranks fails alike on every rank; afterwards the previous
    checkpoint at path (saved first when previous) still loads with its values and nothing
    temporary is left. make(comm) -> (params, optimizer, shards) is what is saved (default:
    a replica with other values than the previous checkpoint's); then(comm, params, opt),
    run right after on every rank, returns what the caller checks next."""
    want = save_good(path, p=p) if previous else None
    parent = os.path.dirname(path)
    listing = sorted(os.listdir(parent)) if os.path.isdir(parent) else None

    def fn(comm):
        if make is None:
            params, opt = dp_model(comm, seed=5)
            shards = None
        else:
            params, opt, shards = make(comm)
        res = attempt(comm, lambda: ringcoll.save_checkpoint(
            path, params, opt, comm=comm, extra=extra, shards=shards), params, opt)
        res["then"] = None if then is None else then(comm, params, opt)
        return res

    results = run(p, fn)
    exc = check_failed(results, problem, path if bad is None else bad, named=named, rank=rank)
    if listing is None:
        assert not os.path.exists(parent)
    else:
        assert sorted(os.listdir(parent)) == listing
        assert leftovers(path) == []
    if want is not None:
        assert_loads(path, want, p=p)
    if then is not None:
        return exc, [res["then"] for res in results]
    return exc


@pytest.mark.parametrize("p", [1, 2, 3])
def test_save_parent_directory_missing(tmp_path, p):
    path = str(tmp_path / "no" / "such" / "ckpt")
    exc = save_fails(path, p, "write-failed", previous=False)
    assert "does not exist" in str(exc)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("what", ["directory", "file", "empty-directory"])
def test_save_refuses_to_replace_what_is_not_a_checkpoint(tmp_path, p, what):
    path = tmp_path / "results"
    if what == "file":
        path.write_text("precious")
    else:
        path.mkdir()
        if what == "directory":
            (path / "precious.txt").write_text("precious")
    save_fails(str(path), p, "not-a-checkpoint", previous=False)
    if what == "file":
        assert path.read_text() == "precious"
    elif what == "directory":
        assert os.listdir(path) == ["precious.txt"]
        assert (path / "precious.txt").read_text() == "precious"
    else:
        assert os.listdir(path) == []
    assert sorted(os.listdir(tmp_path)) == ["results"]


@pytest.mark.parametrize("p", [2, 3])
def test_save_extra_not_json(tmp_path, p):
    exc = save_fails(str(tmp_path / "ckpt"), p, "invalid", extra={"when": object()})
    assert "JSON" in str(exc)


@pytest.mark.parametrize("p", [2, 3])
def test_save_one_name_two_shapes(tmp_path, p):
    def make(comm):  # the last rank's b1 has another shape
        model = _other_model("shape") if comm.rank == p - 1 else MODEL
        params, opt = dp_model(comm, seed=5, model=model, wrap=False)
        return params, opt, None

    exc = save_fails(str(tmp_path / "ckpt"), p, "mismatch", make=make)
    assert "b1" in str(exc)


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("which", ["params", "state"])
def test_save_replicas_that_differ(tmp_path, p, which):
    def make(comm):  # the last rank's replica (or its momentum) has other values
        params, opt = dp_model(comm, seed=5, wrap=False)
        if comm.rank == p - 1:
            if which == "params":
                params["w2"][1, 1] += 1.0
            else:
                opt.state["b3"]["momentum_buffer"][0] += 1.0
        return params, opt, None

    exc = save_fails(str(tmp_path / "ckpt"), p, "mismatch", make=make)
    assert ("w2" if which == "params" else "b3") in str(exc)


def _blocks_of(comm, columns):
    """A (4, 7) tensor of which this rank holds the columns columns[rank]."""
    first, last = columns[comm.rank]
    params = {"w": np.full((4, last - first), first + 1.0),
              "b": np.arange(3.0)}
    return params, SGD(params, lr=0.1), {"w": shard((4, 7), (slice(None), slice(first, last)))}


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("layout", ["overlapping", "incomplete"])
def test_save_bad_shards(tmp_path, p, layout):
    if layout == "overlapping":
        columns = [(0, 4), (3, 7), (3, 7)][:p]
    else:
        columns = [(0, 3), (4, 7), (4, 7)][:p]
    save_fails(str(tmp_path / "ckpt"), p, "invalid", make=lambda c: _blocks_of(c, columns))


@pytest.mark.parametrize("p", [2, 3])
def test_save_shards_naming_an_unknown_parameter(tmp_path, p):
    def make(comm):
        params, opt = dp_model(comm, seed=5, wrap=False)
        return params, opt, {"nope": Shard((4, 3), (0, 0))}

    exc = save_fails(str(tmp_path / "ckpt"), p, "invalid", make=make)
    assert "nope" in str(exc)


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("passes", [1, 2])
def test_save_distributed_optimizer_mid_step(tmp_path, p, passes):
    """A backward pass half handed over: refused (invalid); afterwards the pass completes
    and the step runs as if nothing had happened, on every rank."""
    path = str(tmp_path / "ckpt")
    grads = {}

    def make(comm):
        params, opt = dp_model(comm, seed=5, backward_passes_per_step=passes)
        g = grads[comm.rank] = grads_for(params, comm.rank, 50)
        opt.grad_ready("w1", g["w1"])  # w1's bucket is the last: nothing starts
        return params, opt, None

    def finish(comm, params, opt):
        g = grads[comm.rank]
        for n in list(params)[1:]:
            opt.grad_ready(n, g[n])
        for _ in range(passes - 1):
            for n in params:
                opt.grad_ready(n, g[n])
        opt.step()
        return snapshot(params)

    exc, out = save_fails(path, p, "invalid", make=make, then=finish)
    assert "step" in str(exc)
    for r in range(1, p):
        assert same(out[r], out[0]), r


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES])
def test_save_write_fails_on_one_rank(tmp_path, monkeypatch, p, code):
    """The last rank's shard cannot be written (no space, no permission): write-failed on
    every rank, the previous checkpoint intact."""
    path = str(tmp_path / "ckpt")
    real = ckfiles.write_shard
    failing = f"shard-{p - 1:05d}.bin"

    def write_shard(filename, arrays):
        if os.path.basename(filename) == failing:
            raise OSError(code, os.strerror(code), filename)
        return real(filename, arrays)

    def make(comm):  # tensor-parallel: every rank writes its own block
        model, params, shards = tp_model(comm, full_model())
        opt = SGD(params, lr=0.1, momentum=0.9)
        train_blocks(params, shards, opt, 1)
        return params, opt, shards

    want = save_good(path, p=p)
    monkeypatch.setattr(ckfiles, "write_shard", write_shard)

    def fn(comm):
        params, opt, shards = make(comm)
        return attempt(comm, lambda: ringcoll.save_checkpoint(path, params, opt, comm=comm,
                                                              shards=shards), params, opt)

    out = run(p, fn)
    monkeypatch.undo()
    bad = out[0]["exc"].path
    check_failed(out, "write-failed", bad, named=[failing, os.strerror(code)], rank=p - 1)
    assert bad.startswith(path)
    assert leftovers(path) == [] and sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert_loads(path, want, p=p)


# ---------------------------------------------------------------------------------------------
# 2. the reported bug: errors shifted by one call
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [2, 3])
def test_each_error_is_about_its_own_file(tmp_path, p):
    """Several bad checkpoints (and good ones between them) loaded in a loop: each call's
    error, on every rank, names that call's own file and problem."""
    full = full_model()

    def save(comm):
        model, params, shards = tp_model(comm, full)
        opt = SGD(params, lr=0.1, momentum=0.9)
        train_blocks(params, shards, opt, 1)
        for name in ("good1", "truncated", "flipped-last", "not-json", "newer", "good2",
                     "deleted-last", "other-format"):
            ringcoll.save_checkpoint(str(tmp_path / name), params, opt, comm=comm,
                                     shards=shards)

    run(p, save)
    last = f"shard-{p - 1:05d}.bin"
    base = str(tmp_path)
    os.truncate(f"{base}/truncated/shard-00000.bin", 10)
    f, piece = piece_of(f"{base}/flipped-last", "param/w1", index=p - 1)
    flip_byte(f, piece["offset"])
    with open(f"{base}/not-json/manifest.json", "w") as fh:
        fh.write("not json")
    edit_manifest(f"{base}/newer", lambda m: m.update(version=3))
    os.remove(f"{base}/deleted-last/{last}")
    edit_manifest(f"{base}/other-format", lambda m: m.update(format="zip"))
    calls = [  # name, problem, the file at fault
        ("missing", "missing", f"{base}/missing"),
        ("truncated", "corrupt", f"{base}/truncated/shard-00000.bin"),
        ("good1", None, None),
        ("flipped-last", "corrupt", f"{base}/flipped-last/{last}"),
        ("not-json", "corrupt", f"{base}/not-json/manifest.json"),
        ("newer", "newer-version", f"{base}/newer/manifest.json"),
        ("deleted-last", "corrupt", f"{base}/deleted-last/{last}"),
        ("good2", None, None),
        ("other-format", "not-a-checkpoint", f"{base}/other-format/manifest.json"),
        ("missing", "missing", f"{base}/missing")]

    def fn(comm):
        model, params, shards = tp_model(comm, full_model(seed=9))
        opt = SGD(params, lr=0.1, momentum=0.9)
        out = []
        for name, _, _ in calls:
            try:
                ringcoll.load_checkpoint(f"{base}/{name}", params, opt, comm=comm,
                                         shards=shards)
                out.append(None)
            except CheckpointError as e:
                out.append((e.problem, e.path, str(e)))
        return out

    results = run(p, fn)
    for r, out in enumerate(results):
        for (name, problem, bad), got in zip(calls, out):
            if problem is None:
                assert got is None, (r, name, got)
                continue
            assert got is not None, (r, name)
            assert got[:2] == (problem, bad), (r, name, got)
            assert f"{base}/{name}" in got[2], (r, name, got[2])
            others = {n for n, _, _ in calls} - {name}
            assert not any(f"{base}/{o}/" in got[2] or got[2].endswith(f"{base}/{o}")
                           for o in others), (r, name, got[2])


# ---------------------------------------------------------------------------------------------
# 3. round trips
# ---------------------------------------------------------------------------------------------
BF16_MODEL = None
try:
    import ml_dtypes

    BF16_MODEL = [("w1", (4, 3), ml_dtypes.bfloat16), ("b1", (3,), ml_dtypes.bfloat16),
                  ("w2", (3, 2), np.float32)]
except ImportError:  # pragma: no cover - ml_dtypes is optional
    pass

MODELS = {
    "float32": [(n, s, np.float32) for n, s, _ in MODEL],
    "float64": [(n, s, np.float64) for n, s, _ in MODEL],
    "mixed": MODEL,
    "odd-shapes": [("scalar", (), np.float64), ("empty", (0, 3), np.float32),
                   ("none", (0,), np.float64), ("w", (2, 3), np.float32),
                   ("scalar32", (), np.float32)],
}
if BF16_MODEL is not None:  # bfloat16 parameters only where ml_dtypes is importable
    MODELS["bfloat16"] = BF16_MODEL
#: at p = 2 every model, optimizer and holder; at p = 1 and 3 the mixed and odd-shaped
#: models held by a DistributedOptimizer
ROUND_TRIPS = [(m, k, h, 2) for m in MODELS for k in ("sgd", "adam")
               for h in ("inner", "wrapper")] + \
    [(m, k, "wrapper", p) for m in ("mixed", "odd-shapes") for k in ("sgd", "adam")
     for p in (1, 3)]


@pytest.mark.parametrize("model, kind, holder, p", ROUND_TRIPS)
def test_round_trip(tmp_path, model, kind, holder, p):
    path = str(tmp_path / "ckpt")
    extra = {"epoch": 3, "note": "ok", "lrs": [0.1, 0.01], "nested": {"a": None, "b": True},
             "x": 1.5}

    def fn(comm):
        params, opt = dp_model(comm, seed=1, kind=kind, model=MODELS[model])
        saved = opt.optimizer if holder == "inner" else opt
        ringcoll.save_checkpoint(path, params, saved, comm=comm, extra=extra)
        fresh, fresh_opt = dp_model(comm, seed=50, kind=kind, model=MODELS[model], steps=1)
        if kind == "sgd":
            fresh_opt.optimizer.hyper["lr"] = 0.5
        got = ringcoll.load_checkpoint(path, fresh,
                                       fresh_opt.optimizer if holder == "inner" else fresh_opt,
                                       comm=comm)
        return (got, snapshot(params), opt.optimizer.state_dict(), snapshot(fresh),
                fresh_opt.optimizer.state_dict(), opt.wrapper_state_dict(),
                fresh_opt.wrapper_state_dict())

    for r, (got, params, state, fresh, fresh_state, wrapper, fresh_wrapper) in enumerate(
            run(p, fn)):
        assert got == extra, r
        assert same(fresh, params), r
        assert same(fresh_state, state), r
        assert same(fresh_wrapper, wrapper), r
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert sorted(os.listdir(path)) == ["manifest.json", "shard-00000.bin"]


@pytest.mark.parametrize("p", [1, 2, 3])
def test_round_trip_no_optimizer_no_extra(tmp_path, p):
    path = str(tmp_path / "ckpt")

    def fn(comm):
        params, opt = dp_model(comm, seed=1)
        ringcoll.save_checkpoint(path, params, comm=comm)
        fresh, fresh_opt = dp_model(comm, seed=8)
        before = fresh_opt.optimizer.state_dict()
        got = ringcoll.load_checkpoint(path, fresh, fresh_opt, comm=comm)
        return got, snapshot(params), snapshot(fresh), before, fresh_opt.optimizer.state_dict()

    for got, params, fresh, before, after in run(p, fn):
        assert got is None
        assert same(fresh, params)
        assert same(after, before)  # no state saved: the optimizer keeps its own


@pytest.mark.parametrize("p", [2, 3])
def test_overwrite_leaves_one_checkpoint(tmp_path, p):
    path = str(tmp_path / "ckpt")
    save_good(path, p=p, seed=1, extra={"v": 1})
    want = save_good(path, p=p, seed=2, extra={"v": 2})
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert manifest_of(path)["extra"] == {"v": 2}
    assert_loads(path, want, p=p)
    want = save_good(path, p=p, seed=3, kind="adam", extra={"v": 3})  # another optimizer
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert_loads(path, want, p=p, kind="adam")


@pytest.mark.parametrize("p", [1, 2, 3])
def test_save_killed_between_its_two_renames_still_loads(tmp_path, p):
    """The previous checkpoint was renamed aside (path.old-*) and the new one never arrived:
    load finds the old one; the next save puts a checkpoint at path and tidies up."""
    path = str(tmp_path / "ckpt")
    want = save_good(path, p=p, seed=1, extra={"v": 1})
    os.rename(path, path + ".old-abc")
    assert_loads(path, want, p=p)

    def extra_of(comm):
        params, opt = dp_model(comm, seed=77, steps=0, wrap=False)
        return ringcoll.load_checkpoint(path, params, opt, comm=comm)

    assert run(p, extra_of) == [{"v": 1}] * p
    want = save_good(path, p=p, seed=2, extra={"v": 2})
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert_loads(path, want, p=p)


# ---------------------------------------------------------------------------------------------
# 4. DistributedOptimizer: resuming is exact
# ---------------------------------------------------------------------------------------------
def _backward(opt, params, rank, step):
    g = grads_for(params, rank, step, scale=50)
    for n in reversed(list(params)):  # backward order
        opt.grad_ready(n, g[n])


def _train(opt, params, rank, passes, first):
    """`passes` backward passes from pass number `first`, a step after every
    backward_passes_per_step-th (counting from pass 0)."""
    k = opt.backward_passes_per_step
    for i in range(first, first + passes):
        _backward(opt, params, rank, i)
        if (i + 1) % k == 0:
            opt.step()


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("setting", ["topk", "accumulate", "topk+accumulate"])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_resume_is_bitwise_exact(tmp_path, p, setting, kind):
    path = str(tmp_path / "ckpt")
    options = {"compression": Compression.topk(0.3) if "topk" in setting else None,
               "backward_passes_per_step": 2 if "accumulate" in setting else 1}
    before = 7 if "accumulate" in setting else 3  # odd: a step half accumulated
    after = 5

    def build(comm, seed):
        params = make_params(seed=seed)
        inner = SGD(params, lr=0.1, momentum=0.9) if kind == "sgd" else Adam(params, lr=0.01)
        return params, ringcoll.DistributedOptimizer(inner, comm, bucket_bytes=40, **options)

    def fn(comm):
        params, opt = build(comm, 1)
        _train(opt, params, comm.rank, before, 0)
        saved_wrapper = opt.wrapper_state_dict()
        if "accumulate" in setting:
            assert saved_wrapper["passes"] == 1
        if "topk" in setting:
            assert any(k.endswith("/residual") for k in saved_wrapper["arrays"])
        ringcoll.save_checkpoint(path, params, opt, comm=comm, extra={"passes": before})
        _train(opt, params, comm.rank, after, before)
        a = (snapshot(params), opt.optimizer.state_dict(), opt.wrapper_state_dict())
        params2, opt2 = build(comm, 2)
        got = ringcoll.load_checkpoint(path, params2, opt2, comm=comm)
        assert same(opt2.wrapper_state_dict(), saved_wrapper)
        _train(opt2, params2, comm.rank, after, got["passes"])
        b = (snapshot(params2), opt2.optimizer.state_dict(), opt2.wrapper_state_dict())
        return a, b

    for r, (a, b) in enumerate(run(p, fn)):
        assert same(a[0], b[0]), f"rank {r}: parameters differ"
        assert same(a[1], b[1]), f"rank {r}: optimizer state differs"
        assert same(a[2], b[2]), f"rank {r}: wrapper state differs"


@pytest.mark.parametrize("setting", ["topk", "accumulate"])
@pytest.mark.parametrize("load_p", [1, 3])
def test_wrapper_state_resumes_only_at_the_same_world_size(tmp_path, setting, load_p):
    path = str(tmp_path / "ckpt")
    options = ({"compression": Compression.topk(0.3)} if setting == "topk"
               else {"backward_passes_per_step": 2})

    def save(comm):
        params, opt = dp_model(comm, seed=1, **options)
        if setting == "accumulate":
            _backward(opt, params, comm.rank, 100)  # half a step accumulated
        ringcoll.save_checkpoint(path, params, opt, comm=comm)
        return snapshot(params), opt.optimizer.state_dict()

    want = run(2, save)[0]

    def make(comm):
        params, opt = dp_model(comm, seed=2, **options)
        return params, opt, None

    exc = load_fails(path, load_p, "mismatch", path, make=make)
    assert "opt.optimizer" in str(exc) and "2" in str(exc)

    def inner_only(comm):
        params, opt = dp_model(comm, seed=2, **options)
        before = opt.wrapper_state_dict()
        ringcoll.load_checkpoint(path, params, opt.optimizer, comm=comm)
        return snapshot(params), opt.optimizer.state_dict(), before, opt.wrapper_state_dict()

    for params, state, before, after in run(load_p, inner_only):
        assert same(params, want[0]) and same(state, want[1])
        assert same(after, before)  # the wrapper's own state is not touched


@pytest.mark.parametrize("load_p", [1, 4])
def test_wrapper_without_private_state_loads_at_any_world_size(tmp_path, load_p):
    path = str(tmp_path / "ckpt")
    want = save_good(path, p=2)

    def fn(comm):
        params, opt = dp_model(comm, seed=2)
        ringcoll.load_checkpoint(path, params, opt, comm=comm)
        return snapshot(params), opt.optimizer.state_dict()

    for params, state in run(load_p, fn):
        assert same(params, want[0]) and same(state, want[1])


# ---------------------------------------------------------------------------------------------
# 5. resharding
# ---------------------------------------------------------------------------------------------
def _save_tp(path, tp, kind, full=None, steps=2):
    """Save the tp model trained `steps` steps at tp ranks; the global tensors saved."""
    full = full_model() if full is None else full

    def fn(comm):
        model, params, shards = tp_model(comm, full)
        opt = SGD(params, lr=0.1, momentum=0.9) if kind == "sgd" else Adam(params, lr=0.01)
        train_blocks(params, shards, opt, steps)
        ringcoll.save_checkpoint(path, params, opt, comm=comm, shards=shards,
                                 extra={"tp": tp})
        return snapshot(params), shards, opt.state_dict()

    return assemble(run(tp, fn))


def _load_tp(path, tp, kind, steps_after=0):
    """Load at tp ranks into a model built from other values; every rank's (params,
    shards, state_dict), the full parameters its layers gather, and what load returned."""

    def fn(comm):
        model, params, shards = tp_model(comm, full_model(seed=11))
        opt = SGD(params, lr=0.5, momentum=0.5) if kind == "sgd" else Adam(params, lr=0.5)
        train_blocks(params, shards, opt, 1, first=40)
        got = ringcoll.load_checkpoint(path, params, opt, comm=comm, shards=shards)
        gathered = full_params(model)
        train_blocks(params, shards, opt, steps_after, first=2)
        return (snapshot(params), shards, opt.state_dict()), gathered, got

    return run(tp, fn)


@pytest.mark.parametrize("save_tp, load_tp", [(2, 1), (2, 3), (2, 4), (1, 2), (3, 2),
                                              (4, 3)])
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_reshard_tensor_parallel(tmp_path, save_tp, load_tp, kind):
    path = str(tmp_path / "ckpt")
    saved = _save_tp(path, save_tp, kind)
    written = sorted(n for n in os.listdir(path) if n.startswith("shard-"))
    assert written == [f"shard-{r:05d}.bin" for r in range(save_tp)]
    out = _load_tp(path, load_tp, kind)
    assert_blocks([o[0] for o in out], saved)
    for r, (_, gathered, got) in enumerate(out):
        assert got == {"tp": save_tp}
        for n, a in gathered.items():
            assert same_bits(a, saved[f"param/{n}"]), (r, n)
    # and training on from there is what training the whole model on gives
    again = _load_tp(path, load_tp, kind, steps_after=2)
    reference = _save_tp(str(tmp_path / "reference"), 1, kind, steps=4)
    assert_blocks([o[0] for o in again], reference)


@pytest.mark.parametrize("save_p, load_p", [(2, 4), (4, 1), (1, 3)])
def test_reshard_data_parallel(tmp_path, save_p, load_p):
    """Replicas: only rank 0 writes; any number of ranks loads."""
    path = str(tmp_path / "ckpt")
    want = save_good(path, p=save_p, kind="adam")
    assert sorted(os.listdir(path)) == ["manifest.json", "shard-00000.bin"]
    assert manifest_of(path)["world"] == save_p
    assert_loads(path, want, p=load_p, kind="adam")


PIPELINE = [("W0", (4, 6), np.float64), ("b0", (6,), np.float64), ("W1", (6, 5), np.float32),
            ("b1", (5,), np.float32), ("W2", (5, 3), np.float64), ("b2", (3,), np.float64)]
STAGES = [["W0", "b0"], ["W1", "b1", "W2", "b2"]]


def _stage(params, stages, rank):
    return {n: params[n] for n in stages[rank]}


@pytest.mark.parametrize("direction", ["2->1", "1->2"])
def test_reshard_pipeline_stages(tmp_path, direction):
    """Two stages holding different whole layers, saved, loaded into one rank holding all;
    and back."""
    path = str(tmp_path / "ckpt")
    save_p, load_p = (2, 1) if direction == "2->1" else (1, 2)

    def stages(p):
        return STAGES if p == 2 else [STAGES[0] + STAGES[1]]

    def save(comm):
        params = _stage(make_params(seed=1, model=PIPELINE), stages(save_p), comm.rank)
        opt = Adam(params, lr=0.01)
        train_blocks(params, {}, opt, 2)
        ringcoll.save_checkpoint(path, params, opt, comm=comm)
        return snapshot(params), {}, opt.state_dict()

    saved = assemble(run(save_p, save))
    assert sorted(n for n in os.listdir(path) if n.startswith("shard-")) == \
        [f"shard-{r:05d}.bin" for r in range(save_p)]

    def load(comm):
        params = _stage(make_params(seed=2, model=PIPELINE), stages(load_p), comm.rank)
        opt = Adam(params, lr=0.5)
        ringcoll.load_checkpoint(path, params, opt, comm=comm)
        return snapshot(params), {}, opt.state_dict()

    out = run(load_p, load)
    assert_blocks(out, saved)
    assert sorted(k for o in out for k in o[0]) == sorted(n for n, _, _ in PIPELINE)


def _mesh_model(comm, dp, tp, full):
    mesh = ringcoll.Mesh(comm, dp=dp, tp=tp)
    model, params, shards = tp_model(mesh.tp, full)
    return mesh, model, params, shards


@pytest.mark.parametrize("load", ["dp1-tp2", "tp1", "dp2-tp2"])
def test_reshard_mesh(tmp_path, load):
    """Mesh(dp=2, tp=2) on 4 threads: tp layers over mesh.tp, replicas over mesh.dp; only
    the first replica of each block writes; loads at tp=2 dp=1, at tp=1, and as saved."""
    path = str(tmp_path / "ckpt")
    full = full_model()

    def save(comm):
        mesh, model, params, shards = _mesh_model(comm, 2, 2, full)
        opt = SGD(params, lr=0.1, momentum=0.9)
        train_blocks(params, shards, opt, 2)
        ringcoll.save_checkpoint(path, params, opt, comm=comm, mesh=mesh, shards=shards)
        return snapshot(params), shards, opt.state_dict()

    saved = assemble(run(4, save))
    assert sorted(os.listdir(path)) == ["manifest.json", "shard-00000.bin", "shard-00001.bin"]
    m = manifest_of(path)
    assert m["world"] == 4 and m["mesh"]["shape"] == {"pp": 1, "dp": 2, "tp": 2}
    dp, tp = {"dp1-tp2": (1, 2), "tp1": (1, 1), "dp2-tp2": (2, 2)}[load]

    def fn(comm):
        mesh, model, params, shards = _mesh_model(comm, dp, tp, full_model(seed=12))
        opt = SGD(params, lr=0.5)
        train_blocks(params, shards, opt, 1)
        ringcoll.load_checkpoint(path, params, opt, mesh=mesh, shards=shards)
        gathered = full_params(model)
        return (snapshot(params), shards, opt.state_dict()), gathered

    out = run(dp * tp, fn)
    assert_blocks([o[0] for o in out], saved)
    for r, (_, gathered) in enumerate(out):
        for n, a in gathered.items():
            assert same_bits(a, saved[f"param/{n}"]), (r, n)


def test_reshard_row_blocks_of_arbitrary_shards(tmp_path):
    """Hand-made shards (ringcoll.checkpoint.shard): a 2-D grid of blocks saved at 4 ranks,
    loaded as row blocks at 3 and as the whole at 1."""
    path = str(tmp_path / "ckpt")
    whole = np.arange(7 * 5, dtype=np.float64).reshape(7, 5)
    grid = [(slice(0, 4), slice(0, 2)), (slice(0, 4), slice(2, 5)),
            (slice(4, 7), slice(0, 2)), (slice(4, 7), slice(2, 5))]

    def save(comm):
        index = grid[comm.rank]
        params = {"g": whole[index].copy()}
        ringcoll.save_checkpoint(path, params, comm=comm, shards={"g": shard((7, 5), index)})

    run(4, save)

    def load(comm):
        rows = [slice(0, 3), slice(3, 5), slice(5, 7)][comm.rank] if comm.size == 3 \
            else slice(None)
        params = {"g": np.zeros_like(whole[rows])}
        ringcoll.load_checkpoint(path, params, comm=comm, shards={"g": shard((7, 5), rows)})
        return params["g"], rows

    for p in (3, 1):
        for got, rows in run(p, load):
            assert same_bits(got, whole[rows])


# ---------------------------------------------------------------------------------------------
# 6. chunks
# ---------------------------------------------------------------------------------------------
class _Readers:
    """Every ShardReader load_checkpoint makes, by rank, with the pieces each read."""

    def __init__(self, monkeypatch):
        self.made = {}
        readers = self
        real = ckfiles.ShardReader

        class Counting(real):
            def __init__(self, folder, manifest, where):
                super().__init__(folder, manifest, where)
                self.pieces = []
                rank = int(where.split("rank ")[1].split(",")[0])
                readers.made.setdefault(rank, []).append(self)

            def read(self, piece, dtype, key, into=None):
                self.pieces.append((key, tuple(piece["start"]), tuple(piece["shape"])))
                return super().read(piece, dtype, key, into)

        monkeypatch.setattr(ckfiles, "ShardReader", Counting)


@pytest.mark.parametrize("chunk_bytes, p", [(320, 4), (256, 4), (1000, 3), (64, 2)])
def test_a_reader_reads_only_the_chunks_it_needs(tmp_path, monkeypatch, chunk_bytes, p):
    """With CHUNK_BYTES small, a (64, 8) float64 tensor saved whole is cut into chunks of
    rows; loading a 1/p share of its rows reads (and checks) only the chunks overlapping it."""
    monkeypatch.setattr(cklayout, "CHUNK_BYTES", chunk_bytes)
    path = str(tmp_path / "ckpt")
    whole = np.arange(64 * 8, dtype=np.float64).reshape(64, 8)
    row_bytes = 8 * 8
    rows_per_chunk = max(1, chunk_bytes // row_bytes)

    def save(comm):
        ringcoll.save_checkpoint(path, {"big": whole.copy()}, comm=comm)

    run(1, save)
    pieces = manifest_of(path)["tensors"]["param/big"]["pieces"]
    assert len(pieces) == -(-64 // rows_per_chunk)
    assert all(pc["nbytes"] <= max(chunk_bytes, row_bytes) for pc in pieces)
    assert [pc["start"][0] for pc in pieces] == list(range(0, 64, rows_per_chunk))
    readers = _Readers(monkeypatch)
    edges = np.linspace(0, 64, p + 1).astype(int)

    def load(comm):
        first, last = int(edges[comm.rank]), int(edges[comm.rank + 1])
        params = {"big": np.zeros((last - first, 8))}
        ringcoll.load_checkpoint(path, params, comm=comm,
                                 shards={"big": shard((64, 8), slice(first, last))})
        return params["big"], first, last

    for r, (got, first, last) in enumerate(run(p, load)):
        assert same_bits(got, whole[first:last]), r
        (reader,) = readers.made[r]
        chunks_needed = {c for c in range(0, 64, rows_per_chunk)
                         if c < last and c + rows_per_chunk > first}
        assert sorted(start[0] for _, start, _ in reader.pieces) == sorted(chunks_needed), r
        want = sum(min(rows_per_chunk, 64 - c) for c in chunks_needed) * row_bytes
        assert reader.bytes_read == want, (r, reader.bytes_read, want)
        assert reader.bytes_read < whole.nbytes or p == 1


def test_default_chunks_cut_a_big_tensor(tmp_path, monkeypatch):
    """At the default CHUNK_BYTES (8 MiB): a 20 MiB tensor is three chunks, and a reader of
    its first quarter reads the first chunk only."""
    path = str(tmp_path / "ckpt")
    rows, cols = 5120, 1024  # float32: 4 KiB a row, 2048 rows a chunk
    whole = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)

    def save(comm):
        ringcoll.save_checkpoint(path, {"big": whole}, comm=comm)

    run(1, save)
    pieces = manifest_of(path)["tensors"]["param/big"]["pieces"]
    assert [pc["shape"][0] for pc in pieces] == [2048, 2048, 1024]
    readers = _Readers(monkeypatch)

    def load(comm):
        params = {"big": np.zeros((rows // 4, cols), np.float32)}
        ringcoll.load_checkpoint(path, params, comm=comm,
                                 shards={"big": shard((rows, cols), slice(0, rows // 4))})
        return params["big"]

    (got,) = run(1, load)
    assert same_bits(got, whole[:rows // 4])
    (reader,) = readers.made[0]
    assert reader.bytes_read == 2048 * cols * 4
