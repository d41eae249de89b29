"""torch's own backend suite (DistributedTest._DistTestBase) on ringcoll, judged by gloo in
the same test: tests/torch_dist_suite.py runs it under mpiexec on both backends and compares.

Every test gloo passes must pass on ringcoll, pass once torch's decorators that skip it by
backend name are set aside ("gated"), pass with its body on gloo's branch ("as gloo"), or be
in torch_dist_suite.KNOWN with its reason (docs/torch.md lists them); anything else fails
here, with the traceback. The counts of each world size are printed in pytest's summary.

Which tests run where (CI's budget, 2 cores): every test at world size 2; at 3 and 4
(oversubscribed) the tests in WIDER, the collectives and groups whose schedules change with
the number of ranks (DDP's models and the profiler variants run at 2 only).
"""

import re

import pytest

import _mpirun as mpirun
import torch_dist_suite as suite

pytest.importorskip("torch", reason="torch's suite needs PyTorch")
pytest.importorskip("expecttest", reason="torch.testing._internal needs expecttest (the test "
                    "extra)")
pytestmark = mpirun.needs_mpi

#: the tests run at world sizes 3 and 4 (a regex on the name)
WIDER = (r"^test_(all_reduce|reduce|all_gather|gather|scatter|broadcast|barrier|all_to_all|"
         r"reduce_scatter|send_recv|isend|irecv|batch_isend_irecv|new_subgroups|"
         r"average_parameters|get_rank|get_backend)(?!.*(profiler|cuda|_gpu|nccl))")
SIZES = [(2, ""), (3, WIDER), (4, WIDER)]


@pytest.fixture(scope="module")
def names():
    return suite.all_tests()


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("nprocs, only", SIZES, ids=[f"n{n}" for n, _ in SIZES])
def test_torch_suite_passes_on_ringcoll_what_it_passes_on_gloo(nprocs, only, names,
                                                              mpi_timings, mpi_notes):
    chosen = [n for n in names if re.search(only, n)]
    assert len(chosen) > (200 if not only else 40), f"only {len(chosen)} tests chosen"
    lines = []
    summary = suite.run_and_compare(nprocs, chosen, timeout=120, log=lines.append)
    mpi_notes.extend(f"torch suite -n {nprocs}: {line}" for line in summary["lines"])
    for backend, secs in summary["seconds"].items():
        mpi_timings[f"torch suite -n {nprocs} {backend}"] = secs
    assert summary["counts"]["gloo"]["passed"] > (60 if not only else 20), summary["counts"]
    assert not summary["regressed"], "\n".join(
        f"{name}: passed on gloo, {record['outcome']} on ringcoll\n    "
        + "\n    ".join(suite.why(record["detail"]))
        for name, record in summary["regressed"].items())
