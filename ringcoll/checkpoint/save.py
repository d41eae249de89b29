"""save_checkpoint: every rank writes what only it holds, rank 0 commits; three steps.

    plan    every rank lists what it holds (key, global shape, dtype, block); rank 0 makes the
            temporary directory. Exchanged: each rank's list.
    write   from the lists (the same on every rank), each block of each tensor gets one
            writer, the lowest rank holding it (so of p replicas only the first writes, and a
            bias every tensor-parallel rank holds is written once); blocks are cut into chunks
            of at most layout.CHUNK_BYTES. Writers write their shard file and fsync it; ranks
            holding a copy they do not write checksum it. Exchanged: each rank's pieces
            (offset, size, crc32) and its copies' checksums.
    commit  rank 0 checks the copies match what was written (two ranks holding different
            values under one name is an error, not a silent choice), writes the manifest
            and renames the directory into place (files.commit). Exchanged: the outcome.

Each step is agree.step: a failure anywhere raises the same CheckpointError on every rank,
after which rank 0 deletes the temporary directory; an existing checkpoint at the path is
never touched before the final rename.

Cost: 3 steps x 2 small all-gathers, plus the bytes: each tensor's bytes are written once in
all (by the writers, in parallel) and checksummed once per holder.
"""

import json
import os
import shutil
import uuid
import zlib

import numpy as np

from . import agree, files
from .holdings import holdings, invalid, world
from .layout import chunks, dtype_name, overlapping, volume
from ..errors import CheckpointError


def save_checkpoint(path, params, optimizer=None, comm=None, extra=None, *, shards=None,
                    mesh=None):
    """Save a model's parameters and optimizer state to the directory `path`; collective.

    Every rank calls it with what it holds (see ringcoll/checkpoint/__init__.py).

    Args:
        path: the checkpoint directory (created; an existing ringcoll checkpoint there is
            replaced atomically; anything else there is refused). Every rank must see the
            same filesystem.
        params: dict name -> np.ndarray, this rank's parameters (its blocks, with shards).
        optimizer: a ringcoll.optim optimizer over params, or the DistributedOptimizer
            wrapping one (its own state, accumulated gradients and compression residuals, is
            saved per rank), or None.
        comm: the Communicator of every rank of the job (default: mesh.comm, else a new one
            over MPI.COMM_WORLD). Not a DistributedOptimizer's mesh.dp.
        extra: a JSON-able dict saved beside (rank 0's); load_checkpoint returns it.
        shards: dict name -> Shard(global shape, start) for each parameter that is a block
            of a bigger tensor (model.shards() of ringcoll.parallel layers); the others are
            whole.
        mesh: the ringcoll.Mesh, recorded in the manifest (and the default comm).

    Raises:
        CheckpointError on every rank alike (problem "invalid", "mismatch", "write-failed",
        "not-a-checkpoint", ...); the previous checkpoint at path, if any, is then intact.
    """
    with world(comm, mesh) as comm:
        _save(comm, os.fspath(path), params, optimizer, extra, shards, mesh)


def _save(comm, path, params, optimizer, extra, shards, mesh):
    what = f"save_checkpoint({path})"
    where = f"ringcoll rank {comm.rank}, {what}: "
    mine = {}  # this rank's holdings, and on rank 0 the temporary directory

    def plan():
        mine["held"], meta = holdings(comm.rank, params, shards, optimizer, where)
        record = {"held": [[key, list(spec.shape), dtype_name(a.dtype), list(spec.start),
                            list(a.shape)] for key, a, spec in mine["held"]], "meta": meta}
        if comm.rank == 0:
            try:
                json.dumps(extra)
            except (TypeError, ValueError) as exc:
                raise invalid(where, f"extra must be JSON-able (dict, list, str, int, float, "
                                     f"bool, None): {exc}") from None
            files.replaceable(path, where)
            token = uuid.uuid4().hex[:12]
            mine["tmp"] = f"{path}.tmp-{token}"
            _os_call(os.mkdir, mine["tmp"], where=where, path=path)
            record["tmp"], record["token"] = mine["tmp"], token
        return record

    def write():
        layout = _decide(plans, where)
        tmp = plans[0]["tmp"]
        writes, copies = [], []
        for key, a, spec in mine["held"]:
            block = (tuple(spec.start), tuple(a.shape))
            writer = layout[key]["writers"][block]
            for region in chunks(block, a.itemsize):
                piece = a[tuple(slice(s - b, s - b + n) for s, n, b
                                in zip(region[0], region[1], block[0]))]
                if writer == comm.rank:
                    writes.append((key, region, piece))
                else:
                    copies.append([key, list(region[0]), list(region[1]),
                                   zlib.crc32(np.ascontiguousarray(piece).reshape(-1)
                                              .view(np.uint8))])
        out = {"pieces": [], "file": None, "copies": copies}
        if writes:
            if not os.path.isdir(tmp):
                raise CheckpointError(
                    f"{where}rank 0's temporary directory {tmp} is not visible here: the ranks "
                    "do not share a filesystem; save to a directory every rank sees",
                    path=path, problem="write-failed")
            name = files.shard_file(comm.rank)
            pieces, out["file"] = _os_call(files.write_shard, os.path.join(tmp, name),
                                           [p for _, _, p in writes], where=where, path=path)
            out["pieces"] = [[key, list(region[0]), list(region[1]), off, nbytes, crc]
                             for (key, region, _), (off, nbytes, crc) in zip(writes, pieces)]
        return out

    def commit():
        if comm.rank != 0:
            return None
        manifest = _manifest(comm, mesh, extra, plans, written, where)
        _os_call(files.write_manifest, mine["tmp"], manifest, where=where, path=path)
        _os_call(files.commit, mine["tmp"], path, plans[0]["token"], where=where, path=path)
        return None

    try:
        plans = agree.step(comm, what, plan, path)
        written = agree.step(comm, what, write, path)
        agree.step(comm, what, commit, path)
    except CheckpointError:
        if "tmp" in mine:
            shutil.rmtree(mine["tmp"], ignore_errors=True)
        raise


def _decide(plans, where):
    """Per tensor key: its global shape and dtype, and the writer of each block (the lowest
    rank holding it); the same on every rank (computed from the same plans). Raises if two
    ranks disagree on a tensor's shape or dtype, or if its blocks overlap or leave a hole."""
    layout = {}
    for rank, plan in enumerate(plans):
        for key, shape, dtype, start, local in plan["held"]:
            t = layout.setdefault(key, {"shape": shape, "dtype": dtype, "first": rank,
                                        "writers": {}})
            if (t["shape"], t["dtype"]) != (shape, dtype):
                raise CheckpointError(
                    f"{where}rank {t['first']} saves {key} as {tuple(t['shape'])} "
                    f"{t['dtype']}, rank {rank} as {tuple(shape)} {dtype}; one name must mean "
                    "one tensor on every rank (give different tensors different names)",
                    problem="mismatch")
            t["writers"].setdefault((tuple(start), tuple(local)), rank)
    for key, t in layout.items():
        blocks = list(t["writers"])
        pair = overlapping(blocks)
        if pair is not None:
            raise invalid(where, f"{key}: rank {t['writers'][pair[0]]} holds the block at "
                                 f"{pair[0][0]} of shape {pair[0][1]}, rank "
                                 f"{t['writers'][pair[1]]} an overlapping other one at "
                                 f"{pair[1][0]} of shape {pair[1][1]}; shards must be equal "
                                 "or disjoint")
        covered = sum(volume(shape) for _, shape in blocks)
        if covered != volume(t["shape"]):
            raise invalid(where, f"{key}: the ranks' blocks cover {covered} of its "
                                 f"{volume(t['shape'])} elements; every block of a sharded "
                                 "tensor must be held by some rank")
    return layout


def _manifest(comm, mesh, extra, plans, written, where):
    """The manifest (files.py) from every rank's plan and written pieces; raises if a copy
    differs from the block written or if the ranks' optimizers differ."""
    tensors = {}
    for plan in plans:
        for key, shape, dtype, _, _ in plan["held"]:
            tensors.setdefault(key, {"shape": shape, "dtype": dtype, "pieces": []})
    crcs, shard_files = {}, {}
    for rank, out in enumerate(written):
        if out["file"] is not None:
            name = files.shard_file(rank)
            shard_files[name] = {**out["file"], "rank": rank}
        for key, start, shape, offset, nbytes, crc in out["pieces"]:
            tensors[key]["pieces"].append({"shard": files.shard_file(rank), "start": start,
                                           "shape": shape, "offset": offset, "nbytes": nbytes,
                                           "crc32": crc})
            crcs[(key, tuple(start), tuple(shape))] = (rank, crc)
    for rank, out in enumerate(written):
        for key, start, shape, crc in out["copies"]:
            writer, expected = crcs[(key, tuple(start), tuple(shape))]
            if crc != expected:
                raise CheckpointError(
                    f"{where}ranks {writer} and {rank} hold different values for the same "
                    f"block of {key} (at {tuple(start)}, shape {tuple(shape)}); replicas must "
                    "be identical (were they broadcast?), and different tensors need "
                    "different names", problem="mismatch")
    optimizers = {}
    for rank, plan in enumerate(plans):
        opt = plan["meta"]["optimizer"]
        key = None if opt is None else (opt["type"], json.dumps(opt["hyper"], sort_keys=True))
        optimizers.setdefault(key, rank)
    if len(optimizers) > 1:
        (a, ra), (b, rb) = list(optimizers.items())[:2]
        raise CheckpointError(f"{where}rank {ra} has optimizer {a and a[0]} {a and a[1]}, rank "
                              f"{rb} {b and b[0]} {b and b[1]}; every rank must pass the same "
                              "kind of optimizer with the same hyper-parameters (or none)",
                              problem="mismatch")
    optimizer = None
    if plans[0]["meta"]["optimizer"] is not None:
        optimizer = {k: plans[0]["meta"]["optimizer"][k] for k in ("type", "hyper")}
        optimizer["params"] = {}
        for plan in plans:
            for name, rec in plan["meta"]["optimizer"]["params"].items():
                optimizer["params"].setdefault(name, rec)
    wrappers = {str(r): plan["meta"]["wrapper"] for r, plan in enumerate(plans)
                if plan["meta"]["wrapper"] is not None}
    return {"format": files.FORMAT, "version": files.VERSION, "world": comm.size,
            "mesh": None if mesh is None else {"shape": mesh.shape, "order": list(mesh.order)},
            "extra": extra, "optimizer": optimizer, "wrappers": wrappers or None,
            "tensors": tensors, "shards": shard_files}


def _os_call(fn, *args, where, path):
    """fn(*args), an OSError (no space, no permission, ...) turned into CheckpointError."""
    try:
        return fn(*args)
    except OSError as exc:
        name = exc.filename or path
        raise CheckpointError(f"{where}cannot write {name}: {exc.strerror or exc}", path=name,
                              problem="write-failed") from exc
