"""mpiexec -n P python tests/ckpt_crash.py [driver flags] <scripts/train_hybrid.py flags>

Runs train_hybrid.main() with the given flags, plus what the crash test needs (test-only: the
library has no hook for it; this script replaces two functions of ringcoll.checkpoint.files):

  --kill-rank R --kill-save N   during the Nth checkpoint save, rank R kills itself (SIGKILL:
        no cleanup, no exception, like the OOM killer or a lost node) in the middle of it:
        --kill-in shard (default): right after it has written (and fsynced) its shard file
            into the temporary directory, before the manifest and the commit; R must be a
            rank that writes (rank 0 in a pure dp run: replicas do not write);
        --kill-in commit: rank 0 in files.commit, after the previous checkpoint was renamed
            aside (DIR.old-*) and before the new one is renamed into place.
  --params-out FILE   rank 0 writes the whole final parameters, assembled from every rank's
        blocks (replicas checked bitwise equal), to FILE with np.savez.
"""

import argparse
import os
import signal
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

import ringcoll
from ringcoll.checkpoint import files

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import train_hybrid  # noqa: E402


def die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def arm(rank, save, where):
    """Make `rank` die during the `save`-th save_checkpoint call."""
    saves = [0]
    real_save, real_write, real_commit = (ringcoll.save_checkpoint, files.write_shard,
                                          files.commit)

    def counting_save(*args, **kwargs):
        saves[0] += 1
        return real_save(*args, **kwargs)

    def write_shard(filename, arrays):
        out = real_write(filename, arrays)
        if saves[0] == save and where == "shard":
            print(f"ckpt_crash: rank {rank} killed after writing {filename}", flush=True)
            die()
        return out

    def commit(tmp, path, token):
        if saves[0] == save and where == "commit":
            if os.path.lexists(path):  # the first of files.commit's two renames, then death
                os.rename(path, f"{path}.old-{token}")
            print(f"ckpt_crash: rank {rank} killed between the renames of {tmp}", flush=True)
            die()
        return real_commit(tmp, path, token)

    ringcoll.save_checkpoint = counting_save
    if MPI.COMM_WORLD.rank == rank:
        files.write_shard, files.commit = write_shard, commit


def capture(out):
    """Wrap train_hybrid.train so that rank 0 saves the whole final parameters to out."""
    real_train = train_hybrid.train

    def train(mesh, args, data, log=None):
        params, acc, history = real_train(mesh, args, data, log)
        full = train_hybrid.initial_params(args, data)
        shards = train_hybrid.build_model(mesh, full).shards()  # this rank's blocks
        pieces = MPI.COMM_WORLD.gather((params, shards), root=0)
        if MPI.COMM_WORLD.rank == 0:
            whole, seen = {k: np.zeros_like(v) for k, v in full.items()}, {}
            for rank, (held, specs) in enumerate(pieces):
                for name, a in held.items():
                    start = tuple(specs[name].start) if name in specs else (0,) * a.ndim
                    index = tuple(slice(s, s + n) for s, n in zip(start, a.shape))
                    key = (name, start, a.shape)
                    if key in seen and not np.array_equal(whole[name][index], a):
                        print(f"ckpt_crash: rank {rank}'s {name} differs from rank "
                              f"{seen[key]}'s copy", flush=True)
                        MPI.COMM_WORLD.Abort(1)
                    whole[name][index] = a
                    seen.setdefault(key, rank)
            np.savez(out, **whole)
        return params, acc, history

    train_hybrid.train = train


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kill-rank", type=int, default=None)
    ap.add_argument("--kill-save", type=int, default=1)
    ap.add_argument("--kill-in", choices=["shard", "commit"], default="shard")
    ap.add_argument("--params-out", default=None)
    ours, rest = ap.parse_known_args()
    if ours.kill_rank is not None:
        arm(ours.kill_rank, ours.kill_save, ours.kill_in)
    if ours.params_out:
        capture(ours.params_out)
    return train_hybrid.main(rest)


if __name__ == "__main__":
    sys.exit(main())
