"""load_checkpoint: every rank reads the blocks it needs, checks everything, and only when
every rank has succeeded does any rank change its arrays; two steps.

    read    every rank reads the manifest (files.read_manifest: missing, not ours, newer,
            corrupt), checks its parameters' names, global shapes and dtypes against it, and
            reads into fresh arrays the pieces that overlap its blocks (each piece's size and
            crc32 checked: a truncated or corrupt shard is named). The optimizer's state is
            assembled the same way and checked by the optimizer (check_state_dict), and the
            DistributedOptimizer's by check_wrapper_state_dict. Exchanged: the outcome, and
            the parameter names each rank loaded.
    apply   nothing can fail any more: copy into the parameters, load the optimizers.

Resharding is the read step's index arithmetic: a rank's block of a tensor is filled from
whichever saved pieces overlap it (layout.intersect), so a checkpoint saved at one mesh loads
at any other, or into one process, and each rank reads only the chunks that overlap its
blocks. Every tensor of the checkpoint must be loaded by some rank (strict=True), so a model
that lost a layer does not resume silently.
"""

import os

import numpy as np

from . import agree, files
from .holdings import split_optimizer, targets, world
from .layout import dtype_of, intersect, local_index, volume
from ..arrays import array_module, to_module
from ..errors import CheckpointError, InvalidArgumentError


def load_checkpoint(path, params, optimizer=None, comm=None, *, shards=None, mesh=None,
                    strict=True):
    """Load the checkpoint directory `path` into params (in place) and the optimizer;
    collective. Returns the `extra` dict it was saved with (the same on every rank).

    Args: as save_checkpoint's; the blocks (shards) and the number of ranks may differ from
    the ones it was saved with: each rank gets its blocks of the global tensors. With a
    DistributedOptimizer its own per-rank state (accumulated gradients, top-k residuals)
    resumes only on the same number of ranks and buckets; pass opt.optimizer to load
    without it.
        strict: every tensor in the checkpoint must be loaded by some rank.

    Raises:
        CheckpointError on every rank alike, with nothing changed on any rank.
    """
    with world(comm, mesh) as comm:
        return _load(comm, os.fspath(path), params, optimizer, shards, strict)


def _load(comm, path, params, optimizer, shards, strict):
    what = f"load_checkpoint({path})"
    where = f"ringcoll rank {comm.rank}, {what}: "
    staged = {}

    def read():
        folder = files.resolve(path)
        manifest = files.read_manifest(folder, where)
        reader = files.ShardReader(folder, manifest, where)
        try:
            _read(reader, manifest, folder, comm, params, shards, optimizer, staged, where)
        except (KeyError, TypeError, IndexError, AttributeError) as exc:
            name = os.path.join(folder, files.MANIFEST)
            raise CheckpointError(f"{where}{name} is corrupt (it does not describe a "
                                  f"checkpoint: {type(exc).__name__} {exc})", path=name,
                                  problem="corrupt") from exc
        finally:
            reader.close()
        staged["manifest"] = manifest
        return sorted(params)

    loaded = agree.step(comm, what, read, path)
    manifest = staged["manifest"]
    if strict:  # the same manifest and lists on every rank: the same verdict
        saved = {key[len("param/"):] for key in manifest["tensors"] if key.startswith("param/")}
        left = sorted(saved - {name for names in loaded for name in names})
        if left:
            raise CheckpointError(f"{where}no rank loads the parameters {left} that {path} "
                                  "holds; build the whole model (or pass strict=False)",
                                  path=path, problem="mismatch", rank=0)
    for name, p in params.items():  # (onto the GPU for CuPy parameters)
        p[...] = to_module(array_module(p), staged["param/" + name])
    inner, wrapper = split_optimizer(optimizer)
    if "optimizer" in staged:
        inner.load_state_dict(staged["optimizer"])
    if "wrapper" in staged:
        wrapper.load_wrapper_state_dict(staged["wrapper"])
    return manifest.get("extra")


def _read(reader, manifest, folder, comm, params, shards, optimizer, staged, where):
    tensors = manifest["tensors"]
    manifest_name = os.path.join(folder, files.MANIFEST)

    def mismatch(message):
        return CheckpointError(f"{where}{message}", path=folder, problem="mismatch")

    def fill(key, shape, start, local, dtype):
        """This rank's block (start, local) of tensor key, from the pieces overlapping it."""
        t = tensors[key]
        saved = dtype_of(t["dtype"], manifest_name, where)
        if list(t["shape"]) != list(shape) or saved != dtype:
            raise mismatch(f"{key} is {tuple(t['shape'])} {saved} in {folder}, "
                           f"{tuple(shape)} {dtype} here")
        block = (tuple(start), tuple(local))
        out = np.empty(local, dtype)
        covered = 0
        for piece in t["pieces"]:
            region = (tuple(piece["start"]), tuple(piece["shape"]))
            overlap = intersect(region, block)
            if overlap is None or not volume(overlap[1]) or not volume(local):
                continue
            dest = out[local_index(overlap, block)] if out.ndim else out  # a 0-d view
            if overlap == region and dest.flags.c_contiguous:  # all of it, in place: no copy
                reader.read(piece, dtype, key, into=dest)
            else:
                dest[...] = reader.read(piece, dtype, key)[local_index(overlap, region)]
            covered += volume(overlap[1])
        if covered != volume(local):
            name = os.path.join(folder, files.MANIFEST)
            raise CheckpointError(f"{where}{name} is corrupt: its pieces of {key} cover "
                                  f"{covered} of the {volume(local)} elements this rank "
                                  "needs", path=name, problem="corrupt")
        return out

    mine = targets(params, shards, where)
    for name, p, spec in mine:
        if "param/" + name not in tensors:
            saved = sorted(k[len("param/"):] for k in tensors if k.startswith("param/"))
            raise mismatch(f"{folder} holds no parameter {name!r}; it holds {saved}")
        staged["param/" + name] = fill("param/" + name, spec.shape, spec.start, p.shape,
                                       p.dtype)
    inner, wrapper = split_optimizer(optimizer)
    saved_opt = manifest.get("optimizer")
    if inner is not None and saved_opt is not None:
        if saved_opt["type"] != type(inner).__name__:
            raise mismatch(f"{folder} holds the state of a {saved_opt['type']} optimizer, "
                           f"this is a {type(inner).__name__}; build a {saved_opt['type']} "
                           "(or load without the optimizer)")
        state = {}
        for name, p, spec in mine:
            rec = saved_opt["params"].get(name, {"scalars": {}, "arrays": []})
            st = dict(rec["scalars"])
            for k in rec["arrays"]:
                key = f"state/{name}/{k}"
                st[k] = fill(key, spec.shape, spec.start, p.shape,
                             dtype_of(tensors[key]["dtype"], manifest_name, where))
            state[name] = st
        staged["optimizer"] = {"type": saved_opt["type"], "hyper": saved_opt["hyper"],
                               "state": state}
        try:
            inner.check_state_dict(staged["optimizer"])
        except InvalidArgumentError as exc:
            raise mismatch(f"the optimizer state in {folder} does not fit: {exc}") from None
    saved_wrappers = manifest.get("wrappers")
    if wrapper is not None and saved_wrappers:
        private = any(w["arrays"] for w in saved_wrappers.values())
        mine_saved = saved_wrappers.get(str(comm.rank))
        if manifest["world"] != comm.size or mine_saved is None or not private:
            if private:  # (with nothing private there is nothing of the wrapper's to restore)
                raise mismatch(
                    f"{folder} holds each rank's DistributedOptimizer state (accumulated "
                    f"gradients or compression residuals) of a {manifest['world']}-rank job; "
                    f"it resumes exactly only on {manifest['world']} ranks. Load it without "
                    "that state: pass opt.optimizer instead of opt")
            return
        state = {k: v for k, v in mine_saved.items() if k != "arrays"}
        state["arrays"] = {}
        for k in mine_saved["arrays"]:
            key = f"rank/{comm.rank}/{k}"
            t = tensors[key]
            state["arrays"][k] = fill(key, t["shape"], (0,) * len(t["shape"]), t["shape"],
                                      dtype_of(t["dtype"], manifest_name, where))
        try:
            wrapper.check_wrapper_state_dict(state)
        except InvalidArgumentError as exc:
            raise mismatch(f"the DistributedOptimizer state in {folder} does not fit: "
                           f"{exc}") from None
        staged["wrapper"] = state
