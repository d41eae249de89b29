"""Checkpoints of data-parallel training: saved by one rank, atomically, without pickle.

    ringcoll.save_checkpoint("ckpt.npz", params, optimizer, comm=comm, extra={"epoch": 3})
    extra = ringcoll.load_checkpoint("ckpt.npz", params, optimizer, comm=comm)

The file is one .npz (NumPy's zip of .npy arrays) holding every parameter, every array of the
optimizer's state, and a JSON record of the rest (names, hyper-parameters, step counts, your
`extra`). It is read with allow_pickle=False, so a checkpoint from elsewhere cannot run code.
Saving writes a temporary file in the same directory and renames it over the target, so a job
killed mid-save leaves the previous checkpoint intact. Loading reads on root and broadcasts,
so every rank resumes with identical parameters and optimizer state, and the run continues
exactly as if it had not stopped.
"""

import json
import os
import tempfile

import numpy as np

from .distributed import (_check_same_layout, _comm, _join_state, _split_state, broadcast_bytes,
                          broadcast_optimizer_state, broadcast_parameters)
from .errors import InvalidArgumentError, PeerFailedError

FORMAT = "ringcoll-checkpoint"
VERSION = 1


def save_checkpoint(path, params, optimizer=None, comm=None, extra=None, root=0):
    """Write params (and the optimizer's state, and `extra`, any JSON-able dict) to path, on
    rank root only; collective: every rank returns once the file is complete."""
    comm = _comm(comm)
    _check_same_layout(comm, params, f"ringcoll rank {comm.rank}, save_checkpoint: ")
    if comm.rank == root:
        arrays = {f"param_{i}": np.ascontiguousarray(p) for i, p in enumerate(params.values())}
        meta = {"format": FORMAT, "version": VERSION, "params": list(params),
                "optimizer": None, "extra": extra}
        if optimizer is not None:
            opt_meta, opt_arrays = _split_state(optimizer.state_dict())
            meta["optimizer"] = opt_meta
            arrays.update({f"opt_{i}": a for i, a in enumerate(opt_arrays)})
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        folder = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=".ckpt-", suffix=".npz.tmp", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    comm.barrier()


def load_checkpoint(path, params, optimizer=None, comm=None, root=0):
    """Read path on rank root into params (in place) and the optimizer, broadcast both to
    every rank, and return the checkpoint's `extra` dict (the same on every rank).

    If root cannot read it (missing, not a checkpoint, another model), every rank raises:
    root its own error, the others PeerFailedError quoting it; nothing is modified."""
    comm = _comm(comm)
    ctx = f"ringcoll rank {comm.rank}, load_checkpoint: "
    payload, failure = None, None
    if comm.rank == root:
        try:
            saved, opt_state, extra = _read(path, params, optimizer is not None, ctx)
            if opt_state is not None:
                optimizer.load_state_dict(opt_state)  # checks it first: may raise, changes none
            payload = {"extra": extra}
        except (OSError, ValueError, KeyError) as exc:
            failure = exc
            payload = {"error": f"{type(exc).__name__}: {exc}"}
    got = json.loads(broadcast_bytes(comm, json.dumps(payload).encode() if payload else None,
                                     root))
    if "error" in got:
        if failure is not None:
            raise failure
        raise PeerFailedError(f"{ctx}rank {root} could not load {path}: {got['error']}")
    if comm.rank == root:  # everything was read and checked: now overwrite
        for p, value in zip(params.values(), saved):
            p[...] = value
    broadcast_parameters(params, root=root, comm=comm)
    if optimizer is not None:
        broadcast_optimizer_state(optimizer, root=root, comm=comm)
    return got["extra"]


def _read(path, params, with_optimizer, ctx):
    """(parameter arrays in model order, optimizer state dict or None, extra), all checked."""
    with np.load(path, allow_pickle=False) as data:
        if "meta" not in data.files:
            raise InvalidArgumentError(f"{ctx}{path} is not a {FORMAT} file (no record)")
        meta = json.loads(data["meta"].tobytes())
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise InvalidArgumentError(f"{ctx}{path} is not a {FORMAT} version {VERSION} "
                                       "file (written by ringcoll.save_checkpoint)")
        if meta["params"] != list(params):
            raise InvalidArgumentError(f"{ctx}{path} holds parameters {meta['params']}, the "
                                       f"model has {list(params)}")
        saved = []
        for i, (name, p) in enumerate(params.items()):
            value = data[f"param_{i}"]
            if value.shape != p.shape or value.dtype != p.dtype:
                raise InvalidArgumentError(f"{ctx}parameter {name!r} is {value.shape} "
                                           f"{value.dtype} in {path}, {p.shape} {p.dtype} in "
                                           "the model")
            saved.append(value)
        opt_state = None
        if with_optimizer and meta["optimizer"] is not None:
            opt = meta["optimizer"]
            opt_state = _join_state(opt, [data[f"opt_{i}"] for i in range(len(opt["arrays"]))])
        return saved, opt_state, meta.get("extra")
