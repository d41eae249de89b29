"""mpiexec -n P python scripts/mpi4py_suite.py [--files test_cco_buf.py,test_cco_vec.py] [-v]

mpi4py's own collective tests, run against ringcoll.wrap(comm): the judge of the drop-in.

It takes the test files from the pinned mpi4py sdist (MPI4PY_VERSION and its SHA256 below;
downloaded from PyPI's simple index, or with `pip download --no-binary :all: --no-deps` if that
fails, into --cache, default .mpi4py-sdist/ in the repository, when missing, and says so),
imports each file, and for every
TestCase class with a COMM (Self, World, their Dup and Inplace variants) puts
`ringcoll.wrap(<that comm>)` in its place: the class attribute for the plain classes, after
setUp for the Dup ones (whose setUp makes `MPI.COMM_*.Dup()`). Then it runs the tests with
unittest on every rank and prints, on rank 0, per class: run, failures, errors, skips, and per
collective method whether ringcoll runs it or it passes through to mpi4py (MPICompat's own
method, or the wrapped communicator's).

RINGCOLL_TIMEOUT defaults to 60 s here, so a rank left waiting by a peer that failed a check
ends the job instead of sitting for 600 s. Before any test runs it checks that every buffer
collective of mpi4py's Comm (METHODS: Barrier ... Exscan and each one's I-form) is ringcoll's
own method, and stops with status 3 if one is not (--allow-through runs anyway). Exit status:
0 when no test failed or errored on any rank, 1 otherwise, 2 when the sdist could not be had,
3 as just said. --files test_cco_nb_buf.py,test_cco_nb_vec.py runs mpi4py's tests of the
non-blocking forms the same way.
"""

import argparse
import hashlib
import importlib
import os
import re
import subprocess
import sys
import tarfile
import unittest
import urllib.parse
import urllib.request
from pathlib import Path

MPI4PY_VERSION = "4.1.2"
SHA256 = "56860286dc45f20e8821e93cb06669e30462348bf866f685553fa4b712d58d02"  # its sdist's
INDEX = "https://pypi.org/simple/mpi4py/"
ROOT = Path(__file__).resolve().parent.parent
BLOCKING = ["Barrier", "Bcast", "Gather", "Gatherv", "Scatter", "Scatterv", "Allgather",
            "Allgatherv", "Alltoall", "Alltoallv", "Reduce", "Allreduce",
            "Reduce_scatter_block", "Reduce_scatter", "Scan", "Exscan"]
#: every buffer collective of mpi4py's Comm and its non-blocking form: each must be
#: ringcoll's own (an MPICompat method), checked before any test runs
METHODS = BLOCKING + ["I" + m[0].lower() + m[1:] for m in BLOCKING]


def sdist_tests(cache, rank):
    """The test/ folder of the pinned sdist, downloaded (by rank 0) if missing."""
    folder = Path(cache) / f"mpi4py-{MPI4PY_VERSION}" / "test"
    if folder.is_dir() or rank != 0:
        return folder
    Path(cache).mkdir(parents=True, exist_ok=True)
    archive = Path(cache) / f"mpi4py-{MPI4PY_VERSION}.tar.gz"
    print(f"mpi4py_suite: {folder} missing; downloading the mpi4py {MPI4PY_VERSION} sdist",
          flush=True)
    if not archive.exists():
        try:
            fetch(archive)
        except OSError as exc:  # no index: pip, which knows this machine's index settings
            print(f"mpi4py_suite: {INDEX} failed ({exc}); trying pip download", flush=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-binary",
                            ":all:", "--no-deps", f"mpi4py=={MPI4PY_VERSION}", "-d", str(cache)],
                           check=False)
    if archive.exists():
        if hashlib.sha256(archive.read_bytes()).hexdigest() != SHA256:
            archive.unlink()
            raise SystemExit(f"mpi4py_suite: {archive.name} is not the pinned sdist (sha256)")
        with tarfile.open(archive) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(cache, filter="data")
            else:  # Python before 3.11.4 (Debian 12's 3.11.2): plain files and folders only
                tar.extractall(cache, members=[
                    m for m in tar.getmembers() if (m.isfile() or m.isdir())
                    and not m.name.startswith("/") and ".." not in Path(m.name).parts])
    return folder


def fetch(archive):
    """The sdist from the package index's simple page (seconds; `pip download` of an sdist
    builds its metadata first, minutes in a fresh venv)."""
    page = urllib.request.urlopen(INDEX, timeout=60).read().decode()
    link = re.search(rf'href="([^"]*/{re.escape(archive.name)})(#[^"]*)?"', page)
    if link is None:
        raise OSError(f"no {archive.name} on {INDEX}")
    url = urllib.parse.urljoin(INDEX, link.group(1))
    archive.write_bytes(urllib.request.urlopen(url, timeout=120).read())


def wrap_classes(module, ringcoll, MPI):
    """Every TestCase class of module with a COMM gets ringcoll.wrap(COMM) instead."""
    classes = []
    for name in dir(module):
        cls = getattr(module, name)
        if not (isinstance(cls, type) and issubclass(cls, unittest.TestCase)
                and getattr(cls, "COMM", None) is not None):
            continue
        classes.append(cls)
        if "setUp" in cls.__dict__:  # the Dup variants make their communicator here
            made = cls.__dict__["setUp"]

            def setUp(self, made=made):
                made(self)
                self.COMM = ringcoll.wrap(self.COMM)
            cls.setUp = setUp
        elif isinstance(cls.__dict__.get("COMM"), MPI.Comm) or isinstance(cls.COMM, MPI.Comm):
            cls.COMM = ringcoll.wrap(cls.COMM)
    return classes


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", default="test_cco_buf.py,test_cco_vec.py")
    ap.add_argument("--cache", default=str(ROOT / ".mpi4py-sdist"))
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--allow-through", action="store_true",
                    help="run even if some collective method passes through to mpi4py")
    args = ap.parse_args()
    os.environ.setdefault("RINGCOLL_TIMEOUT", "60")

    from mpi4py import MPI

    import ringcoll
    from ringcoll.compat import MPICompat

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    folder = world.bcast(str(sdist_tests(args.cache, rank)) if rank == 0 else None)
    if not Path(folder).is_dir():
        if rank == 0:
            print(f"mpi4py_suite: no mpi4py {MPI4PY_VERSION} sdist at {folder} and the download "
                  "failed; pip download it there by hand", flush=True)
        sys.exit(2)
    sys.path.insert(0, folder)
    own = [m for m in METHODS if m in MPICompat.__dict__]
    through = [m for m in METHODS if m not in own]
    if through and not args.allow_through:
        if rank == 0:
            print(f"mpi4py_suite: not run by ringcoll but by mpi4py: {', '.join(through)} "
                  "(each must be a ringcoll.compat.MPICompat method)", flush=True)
        sys.exit(3)
    rows, bad = [], 0
    for filename in args.files.split(","):
        module = importlib.import_module(Path(filename).stem)
        for cls in sorted(wrap_classes(module, ringcoll, MPI), key=lambda c: c.__name__):
            suite = unittest.defaultTestLoader.loadTestsFromTestCase(cls)
            result = unittest.TestResult()
            suite.run(result)
            problems = [(str(t), tb) for t, tb in result.failures + result.errors]
            bad += len(problems)
            rows.append((f"{Path(filename).stem}.{cls.__name__}", result.testsRun,
                         len(result.failures), len(result.errors), len(result.skipped),
                         problems))
    everyone = world.gather(rows)
    bad = world.allreduce(bad)
    if rank == 0:
        p = world.Get_size()
        print(f"# mpi4py {MPI4PY_VERSION} tests against ringcoll.wrap at -n {p} "
              f"(RINGCOLL_ALGO={os.environ.get('RINGCOLL_ALGO', 'auto')})")
        print(f"# ringcoll runs: {', '.join(own)}")
        print(f"# passed through to mpi4py: {', '.join(through) or 'none'}")
        print(f"{'class':48s} {'run':>4} {'fail':>5} {'error':>6} {'skip':>5}  (max over ranks)")
        for i, row in enumerate(rows):
            col = [r[i] for r in everyone]
            print(f"{row[0]:48s} {max(c[1] for c in col):4d} {max(c[2] for c in col):5d} "
                  f"{max(c[3] for c in col):6d} {max(c[4] for c in col):5d}")
            if args.verbose:
                seen = set()
                for r, c in enumerate(col):
                    for test, tb in c[5]:
                        if test not in seen:
                            seen.add(test)
                            print(f"    rank {r}: {test}\n      "
                                  + tb.strip().splitlines()[-1][:300])
        print(f"failures and errors over all ranks: {bad}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
