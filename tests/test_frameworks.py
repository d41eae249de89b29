"""Frameworks on the ringcoll backend, each run against the same run on gloo in one test:

- PyTorch Lightning (tests/lightning_run.py): DDPStrategy(process_group_backend="ringcoll",
  cluster_environment=MPIEnvironment()), sync_dist logging of a float and an int64 metric,
  validation, ModelCheckpoint; at -n 2 and -n 3.
- Hugging Face Accelerate (tests/accelerate_run.py): the "ringcoll" group created before the
  Accelerator, which then uses it; prepare, backward, gather_for_metrics, reduce; at -n 2.

Each run checks its replicas and its own results on every rank (exit 1 otherwise); here the
final float32 parameters must equal gloo's run within 1e-6. The frameworks come with the
`frameworks` extra (pip install -e ".[mpich,test,torch,frameworks]"); without them these
tests are skipped, and say so.
"""

import json

import numpy as np
import pytest

import _mpirun as mpirun

pytest.importorskip("torch", reason="the frameworks run on the torch backend")
pytestmark = mpirun.needs_mpi

RUNS = [("lightning", "tests/lightning_run.py", 2), ("lightning", "tests/lightning_run.py", 3),
        ("accelerate", "tests/accelerate_run.py", 2)]


@pytest.mark.parametrize("framework, script, nprocs", RUNS,
                         ids=[f"{f}-n{n}" for f, _, n in RUNS])
def test_framework_trains_on_ringcoll_as_on_gloo(framework, script, nprocs, tmp_path,
                                                 mpi_timings):
    pytest.importorskip(framework, reason=f"{framework} is in the frameworks extra: pip "
                        "install -e '.[mpich,test,torch,frameworks]'")
    results = {}
    for backend in ("gloo", "ringcoll"):
        out = tmp_path / f"{backend}.json"
        rc, output, secs = mpirun.launch(nprocs, [script, "--backend", backend, "--out", out],
                                         timeout=240)
        mpi_timings[f"{framework} -n {nprocs} {backend}"] = secs
        assert rc == 0, f"{framework} on {backend} at -n {nprocs}: rc {rc}\n{output[-4000:]}"
        results[backend] = json.loads(out.read_text())
        assert results[backend]["failures"] == []
    gloo, ours = (np.array(results[b]["params"], np.float32) for b in ("gloo", "ringcoll"))
    assert gloo.shape == ours.shape and gloo.size > 0
    diff = float(np.abs(gloo - ours).max())
    assert diff <= 1e-6, f"{framework} -n {nprocs}: parameters differ from gloo's by {diff}"
    if framework == "lightning":  # the synced float metrics, as gloo's
        for name in ("train_loss", "val_loss"):
            assert abs(results["gloo"]["metrics"][name]
                       - results["ringcoll"]["metrics"][name]) <= 1e-6, name
