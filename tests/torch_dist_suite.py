"""torch's own backend suite, DistributedTest._DistTestBase, on ringcoll and on gloo.

    python tests/torch_dist_suite.py -n 2 [-n 3 ...] [--backend ringcoll|gloo]
                                     [--only REGEX] [--exclude REGEX] [--timeout 120]
                                     [--json FILE]

PyTorch holds its backends (gloo, nccl, mpi, ucc) to the 285 tests (parametrized ones
expanded) of
`torch.testing._internal.distributed.distributed_test.DistributedTest._DistTestBase`, shipped
in the torch wheel. torch runs them by spawning one process per rank with multiprocessing;
ringcoll's ranks are MPI's, so this runs them under `mpiexec` instead: the launch is adapted,
the tests are torch's, unchanged.

Each rank of one `mpiexec -n P python tests/torch_dist_suite.py --worker ...` job does for
every test what torch's spawned child does (`TestDistBackend._run`): build the test case,
`dist.init_process_group(backend, init_method=file://<a new file>, rank, world_size)`, the
suite's file barrier, the test method, the barrier, `destroy_process_group`. A test's outcome
on a rank is passed, skipped (unittest.SkipTest, or the `sys.exit(TEST_SKIPS[...])` the suite's
decorators use) or failed (anything else, its traceback kept); rank 0 gathers them over
MPI_COMM_WORLD and appends one JSON line per test to the report.

A test that hangs (a rank failed while the others wait in a collective) or kills a rank ends
the job: the driver (this file without --worker) then records it as failed ("the job ended
inside this test") and starts a new job at the next test, so one bad test costs one test. A
job also ends after any failed test, as torch's own harness starts every test in new
processes: a failure can leave state behind (a message sent that nobody received).

The backend's feature sets: torch's decorators skip a test unless BACKEND is in
`DistTestCases.backend_feature[...]` (the "plugin" slot is for backends like this one). The
worker adds "ringcoll" to the sets of what it implements (ddp, subgroup, gpu, cuda, plugin)
before the suite is imported (and to no `skip_collective` set: it receives from any source
too). Tests that torch gates on the names "gloo"/"nccl" stay skipped there; the
driver runs each test gloo passes and ringcoll does not again, past the gate (--force: a
unittest skip decorator set aside), then, if it still fails, with its body on gloo's branch
(--as-gloo: the suite's BACKEND reads "gloo", every group the test makes is ringcoll's).

The driver (run_and_compare) prints per world size each backend's passed / failed / skipped
counts and what ringcoll did with each test gloo passed: passed, passed past the gate, passed
as gloo, known (KNOWN, with the reason: docs/torch.md lists them), or regressed; it exits 1
on a regression (with its traceback) or when a job runs none of its tests.
"""

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path


# Tests that pass on gloo and cannot pass on ringcoll, each with the reason (docs/torch.md has
# the same list, with what a user does instead).
_MONITORED = ("torch implements dist.monitored_barrier for gloo alone: it raises ValueError "
              "for any other backend before the backend is called. Use dist.barrier(): "
              "ringcoll's watchdog (RINGCOLL_TIMEOUT) names the rank that did not arrive")
_TIMEOUT = ("the test expects a barrier that times out to raise and the job to go on; "
            "ringcoll's watchdog aborts the job instead (MPI_Abort, naming the collective and "
            "the rank it waits for), as an MPI collective cannot be cancelled. Set the timeout "
            "with init_process_group(timeout=...) or RINGCOLL_TIMEOUT")
KNOWN = {
    "test_monitored_barrier_gloo": _MONITORED,
    "test_monitored_barrier_gloo_subgroup": _MONITORED,
    "test_monitored_barrier_gloo_rank_0_timeout": _MONITORED,
    "test_barrier_timeout_global": _TIMEOUT,
    "test_barrier_timeout_group": _TIMEOUT,
    "test_barrier_timeout_full_group": _TIMEOUT,
}


# ---------------------------------------------------------------- the worker (under mpiexec)

def worker(args):
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    temp = world.bcast(tempfile.mkdtemp(prefix="torchsuite-") if rank == 0 else None)
    if rank == 0:
        for sub in ("barrier", "test_dir"):
            os.mkdir(os.path.join(temp, sub))
    os.environ.update(BACKEND=args.backend, WORLD_SIZE=str(size), TEMP_DIR=temp,
                      INIT_METHOD="env://")
    import torch.distributed as dist
    from torch.testing._internal import common_distributed, common_utils
    # RANK, WORLD_SIZE, MASTER_ADDR/PORT from MPI: ringcoll's backend and gloo's env:// (a
    # test that reinitialises the group with INIT_METHOD) read them alike
    from ringcoll.torch.rendezvous import fill_env
    fill_env()
    if args.backend == "ringcoll":
        import ringcoll.torch  # noqa: F401  (registers the backend)
        cases = common_distributed.DistTestCases
        for feature in ("ddp", "subgroup", "gpu", "cuda", "plugin"):
            cases.backend_feature[feature].add("ringcoll")
    from torch.testing._internal.distributed import distributed_test as suite
    if args.as_gloo:  # the test's body takes gloo's code path; every group it makes is ours
        suite.BACKEND = "gloo"
        c10d = dist.distributed_c10d
        make = c10d._new_process_group_helper

        def ours_for_gloo(size, rank, ranks, backend, *rest, **kwargs):
            return make(size, rank, ranks, "ringcoll" if str(backend) == "gloo" else backend,
                        *rest, **kwargs)
        c10d._new_process_group_helper = ours_for_gloo

    class Suite(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
        pass

    common_utils.instantiate_parametrized_tests(Suite)  # as torch's spawn runner does
    if args.list:
        shutil.rmtree(temp, ignore_errors=True)
        print("\n".join(sorted(n for n in dir(Suite) if n.startswith("test_"))))
        return
    skip_codes = {s.exit_code: s.message for s in common_distributed.TEST_SKIPS.values()}
    names = [line.strip() for line in open(args.tests) if line.strip()]
    report = open(args.report, "a") if rank == 0 else None
    for name in names:
        store = world.bcast(tempfile.mktemp(prefix="store-", dir=temp) if rank == 0 else None)
        if rank == 0:
            suite.Barrier.init()
        suite.Barrier.barrier_id = 0
        world.Barrier()
        # a test stuck past the timeout (here or on another rank, this one then waiting in
        # the gather) ends the job; the driver records it and goes on from the next test
        watchdog = threading.Timer(args.timeout, os._exit, (124,))
        watchdog.daemon = True
        watchdog.start()
        start = time.perf_counter()
        outcome = _run_one(Suite, name, rank, size, store, dist, common_utils, suite,
                           skip_codes, args.force)
        outcome["seconds"] = round(time.perf_counter() - start, 3)
        outcomes = world.gather(outcome, root=0)
        watchdog.cancel()
        failed = False
        if rank == 0:
            record = _combine(outcomes)
            failed = record["outcome"] == "failed"
            report.write(json.dumps({"test": name, **record}) + "\n")
            report.flush()
            if os.path.exists(store):
                os.unlink(store)
        # a failed test may leave messages in flight (a send nobody received), state torch's
        # spawned processes would take with them: the driver starts the next test in a new job
        if world.bcast(failed):
            break
    world.Barrier()
    if rank == 0:
        shutil.rmtree(temp, ignore_errors=True)


def _run_one(Suite, name, rank, size, store, dist, common_utils, suite, skip_codes, force):
    """One test on this rank, as torch's spawned child runs it: {"outcome", "detail"}."""
    import traceback
    import unittest
    from datetime import timedelta
    try:
        case = Suite(name)
        method = getattr(case, name)
        # a unittest.skip decorator: unittest's run() honours it, a plain call does not
        if getattr(method, "__unittest_skip__", False) and not force:
            raise unittest.SkipTest(method.__unittest_skip_why__)
        case.rank, case.file_name = rank, store
        timeout = suite.CUSTOM_PG_TIMEOUT.get(name, suite.default_pg_timeout)
        dist.init_process_group(init_method=case.init_method, backend=os.environ["BACKEND"],
                                world_size=size, rank=rank, timeout=timedelta(seconds=timeout))
        try:
            case._barrier()
            common_utils.set_rng_seed()
            method()
            case._barrier()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        return {"outcome": "passed", "detail": ""}
    except unittest.SkipTest as skip:
        return {"outcome": "skipped", "detail": str(skip)}
    except SystemExit as exit_:
        if exit_.code in skip_codes:
            return {"outcome": "skipped", "detail": skip_codes[exit_.code]}
        return {"outcome": "failed", "detail": f"sys.exit({exit_.code!r})"}
    except BaseException:  # noqa: B902  (KeyboardInterrupt included: record, go on)
        return {"outcome": "failed", "detail": traceback.format_exc()[-3000:]}


def _combine(outcomes):
    """One test's outcome over all ranks: failed if any rank failed, else skipped if any
    skipped, else passed; the details per rank that did not pass."""
    kinds = [o["outcome"] for o in outcomes]
    kind = "failed" if "failed" in kinds else "skipped" if "skipped" in kinds else "passed"
    details = {r: o["detail"] for r, o in enumerate(outcomes) if o["outcome"] != "passed"}
    first = next(iter(details.values()), "")
    return {"outcome": kind, "detail": first, "ranks": details if kind == "failed" else {},
            "seconds": max(o["seconds"] for o in outcomes)}


# ---------------------------------------------------------------- the driver

def all_tests():
    """Every test of _DistTestBase, parametrized ones by their instantiated names (a worker
    with --list, as one MPI process, prints them)."""
    import subprocess
    out = subprocess.run([sys.executable, __file__, "--worker", "--list", "--backend", "gloo"],
                         capture_output=True, text=True, check=True, timeout=300).stdout
    return out.split()


def run_backend(backend, nprocs, names, timeout, force=False, as_gloo=False, log=print):
    """Runs names under mpiexec -n nprocs on backend; {name: record}. A job that ends before
    its last test (a hang past the deadline, a rank killed) records the test it was in as
    failed and goes on from the next one."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _mpirun import launch
    results, todo = {}, list(names)
    with tempfile.TemporaryDirectory(prefix="torchsuite-driver-") as tmp:
        report, listing = Path(tmp, "report.jsonl"), Path(tmp, "tests.txt")
        while todo:
            listing.write_text("\n".join(todo) + "\n")
            report.write_text("")
            deadline = (timeout + 5) * len(todo) + 120  # (the worker's watchdog acts first)
            rc, output, _ = launch(nprocs, [Path(__file__), "--worker", "--backend", backend,
                                            "--tests", listing, "--report", report]
                                   + ["--force"] * force + ["--as-gloo"] * as_gloo,
                                   env={"RINGCOLL_TIMEOUT": str(timeout)}, timeout=deadline)
            for line in report.read_text().splitlines():
                record = json.loads(line)
                results[record["test"]] = record
            ran = len(todo)
            todo = [n for n in todo if n not in results]
            if rc == 0 and len(todo) == ran:
                raise RuntimeError(f"{backend} -n {nprocs}: the job ran none of its "
                                   f"{ran} tests:\n{output[-3000:]}")
            if todo and rc != 0:
                stuck = todo.pop(0)
                results[stuck] = {"test": stuck, "outcome": "failed", "seconds": None,
                                  "detail": f"the job ended inside this test (rc {rc}):\n"
                                            + output[-3000:], "ranks": {}}
                log(f"  {backend} -n {nprocs}: {stuck} ended the job (rc {rc}); "
                    f"{len(todo)} to go")
    return results


def compare(gloo, ours, forced, as_gloo, known=KNOWN):
    """Every test gloo passed, by what ringcoll did with it -> {verdict: names}:
    "passed"; "gated": torch skips it for a backend of another name, run anyway it passes;
    "as gloo": its body branches on the name, and given gloo's branch it passes on ringcoll;
    "known": in KNOWN (with the reason); "regressed": none of these."""
    verdict = {"passed": [], "gated": [], "as gloo": [], "known": [], "regressed": []}
    for name, record in gloo.items():
        if record["outcome"] != "passed":
            continue
        if ours[name]["outcome"] == "passed":
            verdict["passed"].append(name)
        elif forced.get(name, {}).get("outcome") == "passed":
            verdict["gated"].append(name)
        elif as_gloo.get(name, {}).get("outcome") == "passed":
            verdict["as gloo"].append(name)
        else:
            verdict["known" if name in known else "regressed"].append(name)
    return verdict


def counts(results):
    return {k: sum(r["outcome"] == k for r in results.values())
            for k in ("passed", "failed", "skipped")}


def run_and_compare(nprocs, names, timeout=120, log=print):
    """names on gloo, then on ringcoll, at nprocs ranks; then the tests ringcoll does not pass
    that gloo does, run again past torch's name gates, then (those still failing) with their
    bodies on gloo's branch. Returns {"results": {pass: records}, "counts", "seconds",
    "verdict": compare()'s, "regressed": {name: record}, "lines": a summary}."""
    results, seconds = {}, {}
    for backend in ("gloo", "ringcoll"):
        start = time.time()
        results[backend] = run_backend(backend, nprocs, names, timeout, log=log)
        seconds[backend] = time.time() - start
    gloo, ours = results["gloo"], results["ringcoll"]
    again = [n for n in names if gloo[n]["outcome"] == "passed"
             and ours[n]["outcome"] != "passed" and n not in KNOWN]  # (those fail: a job each)
    start = time.time()
    forced = results["ringcoll, run anyway"] = run_backend(
        "ringcoll", nprocs, again, timeout, force=True, log=log) if again else {}
    again = [n for n in again if forced[n]["outcome"] != "passed"]
    as_gloo = results["ringcoll, as gloo"] = run_backend(
        "ringcoll", nprocs, again, timeout, force=True, as_gloo=True, log=log) if again else {}
    seconds["ringcoll, the reruns"] = time.time() - start
    verdict = compare(gloo, ours, forced, as_gloo)
    tally = {b: counts(results[b]) for b in ("gloo", "ringcoll")}
    lines = [f"{b}: {len(names)} tests, " + ", ".join(f"{v} {k}" for k, v in c.items())
             for b, c in tally.items()]
    lines.append(f"of the {sum(map(len, verdict.values()))} tests gloo passes, ringcoll "
                 f"passes {len(verdict['passed'])}; {len(verdict['gated'])} more past torch's "
                 f"name gates, {len(verdict['as gloo'])} more on gloo's branch; "
                 f"{len(verdict['known'])} known (KNOWN), {len(verdict['regressed'])} regressed")
    lines += [f"gated: {n}" for n in verdict["gated"]]
    lines += [f"as gloo: {n}" for n in verdict["as gloo"]]
    lines += [f"known: {n} (KNOWN has the reason)" for n in verdict["known"]]
    regressed = {n: as_gloo.get(n) or forced.get(n) or ours[n] for n in verdict["regressed"]}
    return {"results": results, "counts": tally, "seconds": seconds, "verdict": verdict,
            "regressed": regressed, "lines": lines}


def why(detail):
    """The lines of a traceback that say what went wrong (torch appends a repro hint)."""
    lines = detail.strip().split("\nTo execute this test")[0].strip().splitlines()
    return lines[-8:]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tests", help=argparse.SUPPRESS)
    ap.add_argument("--report", help=argparse.SUPPRESS)
    ap.add_argument("--list", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--force", action="store_true",
                    help="run tests that torch's decorators skip (the worker's; see compare)")
    ap.add_argument("--as-gloo", action="store_true",
                    help="with --force: BACKEND reads 'gloo' in the tests' bodies, every group "
                         "they make is ringcoll's (the worker's; see compare)")
    ap.add_argument("-n", type=int, action="append", help="world size (repeatable; default 2)")
    ap.add_argument("--backend", choices=("ringcoll", "gloo"),
                    help="one backend alone (default: both, compared)")
    ap.add_argument("--only", default="", help="regex: the tests whose names it matches")
    ap.add_argument("--exclude", default="", help="regex: leave these tests out")
    ap.add_argument("--timeout", type=int, default=120, help="seconds a test may take")
    ap.add_argument("--json", help="write every record here")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    names = [n for n in all_tests() if re.search(args.only, n)
             and not (args.exclude and re.search(args.exclude, n))]
    everything, failed = {}, False
    for p in args.n or [2]:
        if args.backend:
            results = run_backend(args.backend, p, names, args.timeout)
            everything[p] = {args.backend: results}
            print(f"-n {p} {args.backend}: " + ", ".join(
                f"{v} {k}" for k, v in counts(results).items()), flush=True)
            failed |= counts(results)["failed"] > 0
            continue
        summary = run_and_compare(p, names, args.timeout)
        everything[p] = summary["results"]
        for line in summary["lines"]:
            print(f"-n {p} {line}")
        for name, record in summary["regressed"].items():
            failed = True
            print(f"-n {p} REGRESSION {name}: passed on gloo, {record['outcome']} on "
                  "ringcoll\n" + "\n".join("    " + line for line in why(record["detail"])))
        print(f"-n {p} seconds: " + ", ".join(f"{k} {v:.0f}"
                                               for k, v in summary["seconds"].items()),
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
