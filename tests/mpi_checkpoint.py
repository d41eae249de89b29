"""mpiexec -n P python tests/mpi_checkpoint.py --tmpdir DIR: checkpoints under real MPI.

The model is the tensor-parallel pair of scripts/train_hybrid.py (a ColumnParallelLinear, a
ReLU, a RowParallelLinear, over mesh.tp) plus SGD with momentum, so every rank writes its own
shard file and reads its own blocks; the row layer's bias is whole (every rank reads rank 0's
copy). Checks, P = 1..4:

  load    every failure (missing, truncated, corrupt, not a checkpoint, newer version, name /
          shape / dtype mismatch, and a truncated, corrupt or missing piece that only the
          last rank reads) raises CheckpointError on every rank with the same .problem and
          .path (and .rank: the lowest rank that found it), within 2 s, the parameters and
          optimizer state untouched, and the communicator works afterwards (an allreduce)
  save    the parent directory missing, something else at the path, ENOSPC on the last
          rank's shard (ringcoll.checkpoint.files.write_shard replaced here) or on the
          manifest: the same error everywhere, the previous checkpoint intact, no temporary
          directory left
  loop    several bad checkpoints (and good ones) in a row: each rank's error is about its
          own call (the old bug: rank 1 got rank 0's error for the next file)
  dist    a DistributedOptimizer (top-k, 2 backward passes, saved half-accumulated) passed
          to save/load: the resumed run is bitwise the uninterrupted one
  reshard saved at tp = P (dp 2 x tp 2 at P = 4), loaded at tp = 1 by the same job and by
          rank 0 alone (a Communicator over MPI.COMM_SELF), and back: bitwise the full
          parameters and momentum buffers of a single-process SGD

Prints 'OK <check>' (rank 0) when a check holds on every rank, else 'FAIL <check>: rank R:
why' per failing rank; every rank's verdict is gathered, and every rank exits 1 if any check
failed anywhere.
"""

import argparse
import errno
import glob
import json
import os
import shutil
import sys
import time
import traceback

import numpy as np
from mpi4py import MPI

import ringcoll
from ringcoll.checkpoint import files, shard
from ringcoll.parallel import Activation, ColumnParallelLinear, RowParallelLinear, Sequential

WORLD = MPI.COMM_WORLD
RANK, P = WORLD.rank, WORLD.size
LAST = P - 1
DEADLINE = 2.0  # seconds a failing call may take
FAILURES = []


def check(label, ok, detail=""):
    """Gather every rank's verdict; rank 0 prints OK when all hold, else one FAIL per rank."""
    verdicts = WORLD.allgather((bool(ok), str(detail)))
    bad = [(r, d) for r, (o, d) in enumerate(verdicts) if not o]
    if bad:
        FAILURES.append(label)
    if RANK == 0:
        for r, d in bad:
            print(f"FAIL {label}: rank {r}: {d}", flush=True)
        if not bad:
            print(f"OK {label} {verdicts[0][1]}".rstrip(), flush=True)


# -- the model --------------------------------------------------------------------------------
SHAPES = {"W0": (6, 10), "b0": (10,), "W1": (10, 5), "b1": (5,)}


def full_arrays(seed, dtype=np.float32, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()}


def tp_model(tp, full, names=("W0", "b0", "W1", "b1")):
    """Column-parallel (W0, b0), ReLU, row-parallel (W1, b1) over tp, from whole arrays."""
    return Sequential([
        ColumnParallelLinear.from_full(tp, full["W0"], full["b0"], names=names[:2]),
        Activation("relu"),
        RowParallelLinear.from_full(tp, full["W1"], full["b1"], names=names[2:])])


def block(full, spec, local):
    """This rank's block of the whole array `full`, for a parameter of shape `local` at spec."""
    if spec is None:
        return full
    return full[tuple(slice(s, s + n) for s, n in zip(spec.start, local))]


def sgd(params):
    return ringcoll.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)


def step_with(opt, shards, grads_full):
    """One SGD step with this rank's blocks of the whole gradients (rank independent)."""
    opt.step({k: block(grads_full[k], shards.get(k), p.shape) for k, p in opt.params.items()})


def fingerprint(params, opt=None):
    """The bytes of every parameter and every optimizer state array (to see any change)."""
    out = [(k, v.tobytes()) for k, v in sorted(params.items())]
    if opt is not None:
        for k, st in sorted(opt.state_dict()["state"].items()):
            out += [(k, j, repr(v) if not isinstance(v, np.ndarray) else v.tobytes())
                    for j, v in sorted(st.items())]
    return out


def comm_works(comm):
    try:
        got = comm.allreduce(np.array([comm.rank + 1.0]))
        return float(got[0]) == comm.size * (comm.size + 1) / 2
    except Exception as exc:  # noqa: BLE001 - reported as the verdict
        return f"{type(exc).__name__}: {exc}"


def outcome(fn):
    """(problem, path, rank, message, seconds) of fn() on this rank; ('ok', ...) if it
    returned, ('unexpected ...', ...) for an exception other than CheckpointError."""
    start = time.perf_counter()
    try:
        fn()
        got = ("ok", None, None, "")
    except ringcoll.CheckpointError as exc:
        got = (exc.problem, exc.path, exc.rank, str(exc))
    except Exception as exc:  # noqa: BLE001 - reported as the verdict
        got = (f"unexpected {type(exc).__name__}", None, None, str(exc)[:300])
    return (*got, time.perf_counter() - start)


def expect_failure(label, fn, problem, comm, params, opt=None, path=None, rank=None):
    """fn() must raise CheckpointError(problem) on every rank alike, in time, changing
    nothing, the communicator working afterwards."""
    before = fingerprint(params, opt)
    got_problem, got_path, got_rank, message, secs = outcome(fn)
    untouched = fingerprint(params, opt) == before
    works = comm_works(comm)
    everyone = WORLD.allgather((got_problem, got_path))  # .rank: checked where given
    slowest = max(WORLD.allgather(secs))
    why = []
    if got_problem != problem:
        why.append(f"problem {got_problem!r}, expected {problem!r}: {message[:300]}")
    if len(set(everyone)) != 1:
        why.append(f"the ranks disagree: {everyone}")
    if path is not None and got_path != path:
        why.append(f"path {got_path!r}, expected {path!r}")
    if rank is not None and got_rank != rank:
        why.append(f"rank {got_rank!r}, expected {rank}")
    if slowest > DEADLINE:
        why.append(f"the slowest rank took {slowest:.2f} s (> {DEADLINE} s)")
    if not untouched:
        why.append("the parameters or the optimizer state changed")
    if works is not True:
        why.append(f"the communicator no longer works: {works}")
    check(label, not why, "; ".join(why) or f"({problem}, slowest rank {slowest:.2f} s)")


# -- files on disk (rank 0 edits them, the others wait) ---------------------------------------
def on_rank0(fn):
    err = None
    if RANK == 0:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - every rank must learn it
            err = f"{type(exc).__name__}: {exc}"
    err = WORLD.bcast(err, root=0)
    if err is not None:
        raise RuntimeError(f"preparing a test checkpoint failed on rank 0: {err}")


def manifest_of(path):
    with open(os.path.join(path, files.MANIFEST)) as f:
        return json.load(f)


def rewrite_manifest(path, edit):
    m = manifest_of(path)
    edit(m)
    with open(os.path.join(path, files.MANIFEST), "w") as f:
        json.dump(m, f)


def piece(path, key, shard_name):
    """The manifest's record of the piece of tensor `key` in shard file shard_name."""
    return next(p for p in manifest_of(path)["tensors"][key]["pieces"]
                if p["shard"] == shard_name)


def flip_byte(path, shard_name, at):
    name = os.path.join(path, shard_name)
    with open(name, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x5A]))


def truncate(path, shard_name, keep=None):
    name = os.path.join(path, shard_name)
    size = os.path.getsize(name)
    os.truncate(name, size // 2 if keep is None else keep)


# -- the checks ---------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tmpdir", required=True)
    tmp = ap.parse_args().tmpdir
    comm = ringcoll.Communicator()
    mesh = ringcoll.Mesh(comm, dp=1, tp=P)  # every rank its own columns / rows: its own file
    try:
        checks(tmp, comm, mesh)
    except Exception:  # noqa: BLE001 - the others may wait for this rank: end the job
        print(f"FAIL rank {RANK}: the checks broke off:\n{traceback.format_exc()}", flush=True)
        MPI.COMM_WORLD.Abort(1)
    everywhere = WORLD.gather(FAILURES, root=0)
    if RANK == 0:
        failed = sorted({f for fs in everywhere for f in fs})
        print(f"{'FAILED' if failed else 'PASSED'}: {len(failed)} check(s) failed at P={P}"
              + (f": {failed}" if failed else ""), flush=True)
    sys.exit(1 if WORLD.allreduce(len(FAILURES)) else 0)


def checks(tmp, comm, mesh):
    last = files.shard_file(LAST)
    first = files.shard_file(0)
    # the checkpoint every failure is about: model A after one SGD step, "step": 1
    saved = tp_model(mesh.tp, full_arrays(1))
    saved_opt = sgd(saved.params)
    step_with(saved_opt, saved.shards(), full_arrays(5))
    good = os.path.join(tmp, "good")
    ringcoll.save_checkpoint(good, saved.params, saved_opt, mesh=mesh, shards=saved.shards(),
                             extra={"step": 1})
    # model B, also with momentum, different values: what the failing loads must not touch
    model = tp_model(mesh.tp, full_arrays(2))
    opt = sgd(model.params)
    step_with(opt, model.shards(), full_arrays(6))

    def load_into(path, params=None, shards=None, optimizer=None):
        return lambda: ringcoll.load_checkpoint(
            path, model.params if params is None else params,
            opt if optimizer is None and params is None else optimizer, mesh=mesh,
            shards=model.shards() if shards is None else shards)

    def bad(name, edit):
        path = os.path.join(tmp, name)
        on_rank0(lambda: (shutil.copytree(good, path), edit(path)))
        return path

    # (a) load failures
    nothing = os.path.join(tmp, "nothing")
    expect_failure("load: missing directory", load_into(nothing), "missing", comm, model.params,
                   opt, path=nothing)
    expect_failure("load: what every rank finds names the lowest rank (.rank 0) everywhere",
                   load_into(nothing), "missing", comm, model.params, opt, path=nothing, rank=0)
    path = bad("truncated", lambda p: truncate(p, first))
    expect_failure("load: truncated shard", load_into(path), "corrupt", comm, model.params, opt,
                   path=os.path.join(path, first))
    path = bad("flipped", lambda p: flip_byte(p, first, piece(p, "param/b1", first)["offset"]))
    expect_failure("load: corrupt shard bytes", load_into(path), "corrupt", comm, model.params,
                   opt, path=os.path.join(path, first))
    path = os.path.join(tmp, "results")
    on_rank0(lambda: (os.mkdir(path), open(os.path.join(path, "notes.txt"), "w").close()))
    expect_failure("load: a directory that is not a checkpoint", load_into(path),
                   "not-a-checkpoint", comm, model.params, opt, path=path)
    path = os.path.join(tmp, "a-file.bin")
    on_rank0(lambda: open(path, "wb").write(b"\0" * 100))
    expect_failure("load: a file that is not a checkpoint", load_into(path),
                   "not-a-checkpoint", comm, model.params, opt, path=path)
    path = bad("garbled", lambda p: open(os.path.join(p, files.MANIFEST), "w").write("{ nope"))
    expect_failure("load: manifest not JSON", load_into(path), "corrupt", comm, model.params,
                   opt, path=os.path.join(path, files.MANIFEST))
    path = bad("newer", lambda p: rewrite_manifest(
        p, lambda m: m.update(version=files.VERSION + 1)))
    expect_failure("load: newer format version", load_into(path), "newer-version", comm,
                   model.params, opt, path=os.path.join(path, files.MANIFEST))
    renamed = tp_model(mesh.tp, full_arrays(2), names=("W0", "b0", "W9", "b1"))
    expect_failure("load: a parameter name the checkpoint lacks",
                   load_into(good, renamed.params, renamed.shards()), "mismatch", comm,
                   renamed.params)
    wider = tp_model(mesh.tp, full_arrays(2, shapes={**SHAPES, "W0": (6, 11), "b0": (11,),
                                                     "W1": (11, 5)}))
    expect_failure("load: shape mismatch", load_into(good, wider.params, wider.shards()),
                   "mismatch", comm, wider.params)
    doubles = tp_model(mesh.tp, full_arrays(2, np.float64))
    expect_failure("load: dtype mismatch", load_into(good, doubles.params, doubles.shards()),
                   "mismatch", comm, doubles.params)
    # pieces only the last rank reads: its columns of W0 and its rows of W1, in its own file
    path = bad("last-flipped", lambda p: flip_byte(p, last, piece(p, "param/W0", last)["offset"]
                                                   + 3))
    expect_failure("load: corrupt piece only the last rank reads", load_into(path), "corrupt",
                   comm, model.params, opt, path=os.path.join(path, last), rank=LAST)
    path = bad("last-truncated", lambda p: truncate(p, last))
    expect_failure("load: truncated shard only the last rank reads", load_into(path),
                   "corrupt", comm, model.params, opt, path=os.path.join(path, last), rank=LAST)
    path = bad("last-missing", lambda p: os.remove(os.path.join(p, last)))
    expect_failure("load: missing shard only the last rank reads", load_into(path), "corrupt",
                   comm, model.params, opt, path=os.path.join(path, last), rank=LAST)

    # (b) save failures
    nowhere = os.path.join(tmp, "no", "such", "ckpt")
    expect_failure("save: parent directory missing", lambda: ringcoll.save_checkpoint(
        nowhere, model.params, opt, mesh=mesh, shards=model.shards()), "write-failed", comm,
        model.params, opt)
    check("save: parent directory missing: nothing created",
          not os.path.exists(os.path.join(tmp, "no")))
    results = os.path.join(tmp, "results")
    expect_failure("save: refuses to replace what is not a checkpoint",
                   lambda: ringcoll.save_checkpoint(results, model.params, opt, mesh=mesh,
                                                    shards=model.shards()),
                   "not-a-checkpoint", comm, model.params, opt, path=results)
    check("save: the directory that is not a checkpoint is intact",
          os.listdir(results) == ["notes.txt"], str(os.listdir(results)))

    def no_space(filename, arrays):
        with open(filename, "xb") as f:
            f.write(b"\0" * 10)  # a part was written, then the disk filled up
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    def no_space_manifest(folder, manifest):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC),
                      os.path.join(folder, files.MANIFEST))

    for label, attr, who, fake in (("ENOSPC on the last rank's shard", "write_shard", LAST,
                                    no_space),
                                   ("ENOSPC on the manifest", "write_manifest", 0,
                                    no_space_manifest)):
        real = getattr(files, attr)
        if RANK == who:
            setattr(files, attr, fake)
        try:
            expect_failure(f"save: {label}", lambda: ringcoll.save_checkpoint(
                good, model.params, opt, mesh=mesh, shards=model.shards(), extra={"step": 2}),
                "write-failed", comm, model.params, opt, rank=who)
        finally:
            setattr(files, attr, real)
        intact = load_back(good, mesh, saved, saved_opt)
        left = glob.glob(glob.escape(good) + ".*")
        check(f"save: {label}: the previous checkpoint intact, nothing left",
              intact is True and not left, f"{intact}; left behind: {left}")
    ringcoll.save_checkpoint(good, model.params, opt, mesh=mesh, shards=model.shards(),
                             extra={"step": 2})
    intact = load_back(good, mesh, model, opt, step=2)
    ringcoll.save_checkpoint(good, saved.params, saved_opt, mesh=mesh, shards=saved.shards(),
                             extra={"step": 1})
    check("save: after the failures a save replaces the checkpoint", intact is True, intact)

    # (c) one bad checkpoint after another: every rank's error is about its own call
    series = [(os.path.join(tmp, "last-flipped"), "corrupt", last),
              (os.path.join(tmp, "truncated"), "corrupt", first),
              (good, "ok", None),
              (os.path.join(tmp, "nothing"), "missing", None),
              (os.path.join(tmp, "last-missing"), "corrupt", last),
              (os.path.join(tmp, "newer"), "newer-version", files.MANIFEST),
              (os.path.join(tmp, "results"), "not-a-checkpoint", None),
              (good, "ok", None),
              (os.path.join(tmp, "last-truncated"), "corrupt", last)]
    mine, why = [], []
    for path, problem, name in series:
        got = outcome(load_into(path))
        mine.append(got[:2])
        expected_path = None if problem == "ok" else path if name is None else \
            os.path.join(path, name)
        if (got[0], got[1]) != (problem, expected_path) or (
                problem != "ok" and path not in got[3]):
            why.append(f"{path}: got {got[0]!r} {got[1]!r} ({got[3][:200]}), expected "
                       f"{problem!r} {expected_path!r}")
    everyone = WORLD.allgather(mine)
    if any(e != everyone[0] for e in everyone):
        why.append(f"the ranks' outcomes differ: {everyone}")
    check(f"loop: {len(series)} loads in a row, each rank's error its own", not why,
          "; ".join(why))

    # (d) the DistributedOptimizer itself, saved half-way through an accumulated step
    dist_checks(tmp, comm)

    # (e) resharding
    reshard_checks(tmp, comm, mesh)


def load_back(path, mesh, like, like_opt, step=1):
    """True if the checkpoint at path holds exactly like's parameters and optimizer state
    (loaded into a fresh model of the same layout), with extra {"step": step}; else why."""
    fresh = tp_model(mesh.tp, full_arrays(3))
    fresh_opt = sgd(fresh.params)
    try:
        extra = ringcoll.load_checkpoint(path, fresh.params, fresh_opt, mesh=mesh,
                                         shards=fresh.shards())
    except ringcoll.CheckpointError as exc:
        return f"it does not load: {exc.problem}: {exc}"
    if extra != {"step": step}:
        return f"extra {extra}, expected step {step}"
    if fingerprint(fresh.params, fresh_opt) != fingerprint(like.params, like_opt):
        return "it loads other values"
    return True


def dist_checks(tmp, comm):
    def grads(params, step, k):
        rng = np.random.default_rng(1000 * RANK + 10 * step + k)  # every rank its own
        return {n: rng.standard_normal(p.shape).astype(p.dtype) for n, p in params.items()}

    def build(seed):
        params = full_arrays(seed)
        if P > 1:
            ringcoll.broadcast_parameters(params, comm=comm)
        inner = ringcoll.optim.Adam(params, lr=1e-2)
        return params, ringcoll.DistributedOptimizer(
            inner, comm, bucket_bytes=128, compression=ringcoll.Compression.topk(0.3),
            backward_passes_per_step=2)

    def run(params, opt, steps, first_pass=True):
        for s in range(steps):
            for k in range(2):
                if k == 0 and not first_pass:
                    first_pass = True
                    continue
                g = grads(params, s, k)
                for n in reversed(list(g)):
                    opt.grad_ready(n, g[n])
            opt.step()

    params, opt = build(1)
    run(params, opt, 2)
    g = grads(params, 0, 0)  # the first of the 2 passes of the next step
    for n in reversed(list(g)):
        opt.grad_ready(n, g[n])
    path = os.path.join(tmp, "dist")
    ringcoll.save_checkpoint(path, params, opt, comm=comm, extra={"step": 2.5})
    state, at_save = opt.wrapper_state_dict(), fingerprint(params, opt.optimizer)
    run(params, opt, 3, first_pass=False)
    fresh, fresh_opt = build(7)
    extra = ringcoll.load_checkpoint(path, fresh, fresh_opt, comm=comm)
    run(fresh, fresh_opt, 3, first_pass=False)
    same = fingerprint(params, opt.optimizer) == fingerprint(fresh, fresh_opt.optimizer)
    check("dist: DistributedOptimizer (top-k, half-accumulated) resumes bitwise",
          same and extra == {"step": 2.5} and state["passes"] == 1 and state["arrays"],
          f"bitwise {same}, extra {extra}, saved {state['passes']} pass(es), "
          f"{len(state['arrays'])} wrapper arrays")
    # its per-rank state resumes only on as many ranks: rank 0 alone refuses (P > 1), unless
    # it is handed the inner optimizer
    why = ""
    if RANK == 0:
        alone = ringcoll.Communicator(MPI.COMM_SELF)
        solo = full_arrays(8)
        inner = ringcoll.optim.Adam(solo, lr=1e-2)
        solo_opt = ringcoll.DistributedOptimizer(
            inner, alone, bucket_bytes=128, compression=ringcoll.Compression.topk(0.3),
            backward_passes_per_step=2)
        got = outcome(lambda: ringcoll.load_checkpoint(path, solo, solo_opt, comm=alone))
        if got[0] != ("ok" if P == 1 else "mismatch"):
            why += f"with the wrapper at 1 of {P} ranks: {got[0]} {got[3][:200]}; "
        got = outcome(lambda: ringcoll.load_checkpoint(path, solo, inner, comm=alone))
        if got[0] != "ok" or fingerprint(solo, inner) != at_save:
            why += f"the inner optimizer alone: {got[0]} {got[3][:200]}"
        alone.close()
    check("dist: the wrapper's state only at the same world size; the inner optimizer anywhere",
          not why, why)


def reshard_checks(tmp, comm, mesh):
    tp = P if P < 4 else 2
    save_mesh = ringcoll.Mesh(comm, dp=P // tp, tp=tp)
    rows = 2304  # E: 2304 x 1024 float32 (9.4 MB), sharded by rows; whole it is 2 chunks
    start0 = rows * save_mesh.tp.rank // tp
    stop0 = rows * (save_mesh.tp.rank + 1) // tp
    init, grads = full_arrays(11), full_arrays(12)
    init["E"] = np.random.default_rng(13).standard_normal((rows, 1024)).astype(np.float32)
    grads["E"] = np.random.default_rng(14).standard_normal((rows, 1024)).astype(np.float32)

    # the single-process truth: SGD on the whole arrays (elementwise: bitwise as the blocks)
    ref = {k: v.copy() for k, v in init.items()}
    ref_opt = sgd(ref)
    for _ in range(2):
        ref_opt.step(grads)
    truth = fingerprint(ref, ref_opt)

    def sharded(at, lo, hi, values):
        model = tp_model(at.tp, values)
        params = {**model.params, "E": values["E"][lo:hi].copy()}
        shards = {**model.shards(), "E": shard((rows, 1024), (slice(lo, hi),))}
        return params, shards, sgd(params)

    params, shards, opt = sharded(save_mesh, start0, stop0, init)
    for _ in range(2):
        step_with(opt, shards, grads)
    path = os.path.join(tmp, "resharded")
    ringcoll.save_checkpoint(path, params, opt, mesh=save_mesh, shards=shards,
                             extra={"mesh": save_mesh.shape})
    where = f"saved at dp {save_mesh.dp.size} x tp {tp}"

    # the same job at tp = 1: every rank the whole model
    whole_mesh = ringcoll.Mesh(comm, dp=P, tp=1)
    zeros = {k: np.zeros_like(v) for k, v in init.items()}
    got, got_shards, got_opt = sharded(whole_mesh, 0, rows, zeros)
    extra = ringcoll.load_checkpoint(path, got, got_opt, mesh=whole_mesh, shards=got_shards)
    check(f"reshard: {where}, loaded at dp {P} x tp 1: bitwise the single-process run",
          fingerprint(got, got_opt) == truth and extra == {"mesh": save_mesh.shape},
          f"extra {extra}")

    # rank 0 alone, a plain dict of whole arrays (no mesh, no layers)
    why = ""
    if RANK == 0:
        alone = ringcoll.Communicator(MPI.COMM_SELF)
        solo = {k: np.zeros_like(v) for k, v in init.items()}
        solo_opt = sgd(solo)
        got1 = outcome(lambda: ringcoll.load_checkpoint(path, solo, solo_opt, comm=alone))
        if got1[0] != "ok":
            why = f"load on rank 0 alone: {got1[0]} {got1[3][:300]}"
        elif fingerprint(solo, solo_opt) != truth:
            why = "rank 0 alone loaded other values"
        else:  # and back: a single-process checkpoint, for the whole job to load sharded
            ringcoll.save_checkpoint(os.path.join(tmp, "single"), solo, solo_opt, comm=alone)
        alone.close()
    check(f"reshard: {where}, loaded by rank 0 alone (COMM_SELF): bitwise", not why, why)
    WORLD.Barrier()

    back, back_shards, back_opt = sharded(save_mesh, start0, stop0, zeros)
    ringcoll.load_checkpoint(os.path.join(tmp, "single"), back, back_opt, mesh=save_mesh,
                             shards=back_shards)
    check(f"reshard: single-process checkpoint loaded at dp {save_mesh.dp.size} x tp {tp}: "
          "bitwise the blocks", fingerprint(back, back_opt) == fingerprint(params, opt))
    for m in (save_mesh, whole_mesh):
        m.close()


if __name__ == "__main__":
    main()
