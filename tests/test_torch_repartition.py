"""ringcoll.torch's re-partitioning (ringcoll/torch/repartition.py): RepartitionSampler on thread
ranks in this process, and the argument checks of allreduce_gradients; tests/
mpi_torch_repartition.py trains a torch MLP with the sampler, allreduce_gradients and DDP's
sum_hook under mpiexec at -n 1..4 (launched at the end of this file) against one process.

The oracle for the rows is the order drawn here, independently of the sampler: torch.randperm
with a torch.Generator seeded by seed + epoch (checked equal to DistributedSampler's order), cut
into global batches; over the ranks, the blocks of each batch must be exactly that batch, in
rank order, with the sizes of the split that was current when the batch was asked for.

This process must not initialise MPI (tests/conftest.py), and ringcoll/torch/__init__.py does
(torch's rendezvous, filled from MPI at import); so the module is imported under a stand-in
package that skips that __init__.
"""

import importlib
import sys
import types
from pathlib import Path

import pytest

import _mpirun as mpirun
import ringcoll
from ringcoll import InvalidArgumentError

torch = pytest.importorskip("torch", reason="ringcoll.torch needs PyTorch (pip install -e "
                            "'.[torch]'); ringcoll itself does not")

TIMEOUT = 20
PACKAGE = Path(__file__).resolve().parent.parent / "ringcoll" / "torch"


@pytest.fixture(scope="module")
def rt():
    """ringcoll.torch.repartition, imported without running ringcoll/torch/__init__.py."""
    names = ("ringcoll.torch", "ringcoll.torch.repartition")
    saved = {n: sys.modules.get(n) for n in names}
    if saved["ringcoll.torch"] is None:
        stand_in = types.ModuleType("ringcoll.torch")
        stand_in.__path__ = [str(PACKAGE)]
        sys.modules["ringcoll.torch"] = stand_in
    module = importlib.import_module("ringcoll.torch.repartition")
    yield module
    for name, old in saved.items():
        if old is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = old


def outcomes(p, fn):
    """fn(comm) on p thread ranks: each rank's result or the exception it raised."""
    def body(comm):
        try:
            return fn(comm)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return exc
    return ringcoll.run_threads(p, body, timeout=TIMEOUT)


def expected_order(n, seed, epoch, shuffle=True):
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def check_partition(per_rank, order, batch, counts_per_step):
    """per_rank[r][b]: rank r's rows of batch b; they tile order's batches in rank order."""
    steps = len(per_rank[0])
    assert all(len(rows) == steps for rows in per_rank)
    for b in range(steps):
        together = sum((per_rank[r][b] for r in range(len(per_rank))), [])
        assert together == order[b * batch:(b + 1) * batch], f"batch {b}"
        assert tuple(len(per_rank[r][b]) for r in range(len(per_rank))) == counts_per_step[b]


# -- the rows ---------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_rank_gets_its_block_of_every_global_batch(rt, p, shuffle):
    n, batch, seed = 100, 30, 11  # 3 full batches, 10 rows dropped
    speeds = [1.0, 3.0, 2.0, 0.5][:p]  # an uneven split

    def body(comm):
        rp = ringcoll.Repartitioner(comm, batch, speeds=speeds)
        sampler = rt.RepartitionSampler(rp, n, shuffle=shuffle, seed=seed)
        sampler.set_epoch(2)
        return rp.counts, len(sampler), list(sampler)

    results = ringcoll.run_threads(p, body, timeout=TIMEOUT)
    counts = results[0][0]
    assert sum(counts) == batch and (p == 1 or len(set(counts)) > 1)
    assert all(r[1] == 3 for r in results)
    check_partition([r[2] for r in results], expected_order(n, seed, 2, shuffle), batch,
                    [counts] * 3)


def test_the_order_is_distributed_samplers(rt):
    """One rank, shuffle: the epoch's order is DistributedSampler's (num_replicas=1)."""
    from torch.utils.data import DistributedSampler

    n, batch = 60, 20

    def body(comm):
        rp = ringcoll.Repartitioner(comm, batch)
        sampler = rt.RepartitionSampler(rp, range(n), seed=5)  # a Sized dataset
        got = []
        for epoch in (0, 1, 3):
            sampler.set_epoch(epoch)
            got.append(sum(list(sampler), []))
        return got

    (got,) = ringcoll.run_threads(1, body, timeout=TIMEOUT)
    for epoch, rows in zip((0, 1, 3), got):
        ds = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=5)
        ds.set_epoch(epoch)
        assert rows == list(ds) == expected_order(n, 5, epoch)


def test_set_epoch_reproduces_and_changes_the_order(rt):
    def body(comm):
        rp = ringcoll.Repartitioner(comm, 10, speeds=[2.0, 1.0])
        a = rt.RepartitionSampler(rp, 40, seed=3)
        b = rt.RepartitionSampler(rp, 40, seed=3)
        c = rt.RepartitionSampler(rp, 40, seed=4)
        first = list(a)
        a.set_epoch(1)
        b.set_epoch(1)
        second, again = list(a), list(b)
        a.set_epoch(0)
        return first, second, again, list(a), list(c), a.epoch

    for first, second, again, back, other_seed, epoch in ringcoll.run_threads(
            2, body, timeout=TIMEOUT):
        assert second == again and back == first and epoch == 0
        assert second != first and other_seed != first


def test_drop_last_false_pads_with_the_orders_first_rows(rt):
    n, batch = 10, 4  # 2 full batches + 2 rows: padded to 3 batches with order[:2]

    def body(comm):
        rp = ringcoll.Repartitioner(comm, batch, speeds=[1.0, 3.0])
        keep = rt.RepartitionSampler(rp, n, seed=1, drop_last=False)
        drop = rt.RepartitionSampler(rp, n, seed=1)
        return rp.counts, len(keep), list(keep), len(drop), list(drop)

    results = ringcoll.run_threads(2, body, timeout=TIMEOUT)
    counts = results[0][0]
    order = expected_order(n, 1, 0)
    assert [r[1] for r in results] == [3, 3] and [r[3] for r in results] == [2, 2]
    check_partition([r[2] for r in results], order + order[:2], batch, [counts] * 3)
    check_partition([r[4] for r in results], order, batch, [counts] * 2)


def test_padding_a_dataset_smaller_than_the_batch(rt):
    def body(comm):
        rp = ringcoll.Repartitioner(comm, 7)
        sampler = rt.RepartitionSampler(rp, 3, shuffle=False, drop_last=False)
        return len(sampler), list(sampler)

    (length, rows), = ringcoll.run_threads(1, body, timeout=TIMEOUT)
    assert length == 1 and rows == [[0, 1, 2, 0, 1, 2, 0]]


# -- the split is read at every batch ------------------------------------------------------------
class FakeRepartitioner:
    """start/stop set by the test, on a real one-rank communicator (for the agreement check)."""

    def __init__(self, comm, global_batch, start, stop):
        self.comm, self.global_batch, self.start, self.stop = comm, global_batch, start, stop


def test_the_split_is_read_when_each_batch_is_asked_for(rt):
    def body(comm):
        rp = FakeRepartitioner(comm, 10, 0, 10)
        sampler = rt.RepartitionSampler(rp, 30, shuffle=False)
        it = iter(sampler)
        rp.start, rp.stop = 2, 5  # after iter(), before the first batch: already applies
        first = next(it)
        rp.start, rp.stop = 0, 1
        second = next(it)
        rp.start, rp.stop = 9, 10
        return first, second, next(it)

    assert ringcoll.run_threads(1, body, timeout=TIMEOUT) == [([2, 3, 4], [10], [29])]


@pytest.mark.parametrize("p", [2, 3, 4])
def test_a_resplit_in_the_middle_of_an_epoch_changes_the_next_batch(rt, p):
    """A DataLoader over the sampler; rank 1 records 2x the compute time; rp re-splits after
    every step (every=1, hysteresis 0): the next batch already has the new shares."""
    n, batch, seed = 96, 24, 2
    x = torch.arange(n, dtype=torch.float64).reshape(n, 1)

    def body(comm):
        rp = ringcoll.Repartitioner(comm, batch, every=1, hysteresis=0.0)
        sampler = rt.RepartitionSampler(rp, n, seed=seed)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x),
                                             batch_sampler=sampler)
        rows, counts, changed = [], [], []
        for (xb,) in loader:
            rows.append(xb[:, 0].long().tolist())
            counts.append(rp.counts)
            rp.record((2.0 if comm.rank == 1 else 1.0) * 1e-3 * len(xb))
            changed.append(rp.step())
        return rows, counts, changed

    results = ringcoll.run_threads(p, body, timeout=TIMEOUT)
    rows, counts, changed = zip(*results)
    assert all(c == counts[0] and ch == changed[0] for c, ch in zip(counts, changed))
    counts, changed = counts[0], changed[0]
    assert len(counts) == 4 and changed[0], changed  # the first exchange moves the equal split
    assert counts[1] != counts[0] and counts[1][1] < counts[1][0]  # rank 1 got fewer rows
    check_partition(list(rows), expected_order(n, seed, 0), batch, counts)


# -- bad input ------------------------------------------------------------------------------------
def assert_every_rank_raises(got, *words, cls=InvalidArgumentError):
    for rank, exc in enumerate(got):
        assert isinstance(exc, cls), f"rank {rank}: {exc!r}"
        assert str(exc).startswith(f"ringcoll rank {rank}, RepartitionSampler: "), str(exc)
        for word in words:
            assert word in str(exc), str(exc)


@pytest.mark.parametrize("kwargs,words", [
    ({"dataset": 20}, ["a dataset of 20 rows has no full global batch of 30",
                       "drop_last=False"]),
    ({"dataset": 0, "drop_last": False}, ["the dataset is empty"]),
    ({"dataset": 100, "seed": -1}, ["seed must be an integer"]),
    ({"dataset": 100, "seed": 1.5}, ["seed must be an integer"]),
    ({"dataset": object()}, ["dataset must be a dataset with len() or its length"]),
])
def test_bad_arguments_raise_on_every_rank(rt, kwargs, words):
    got = outcomes(3, lambda comm: rt.RepartitionSampler(ringcoll.Repartitioner(comm, 30),
                                                         **kwargs))
    assert_every_rank_raises(got, *words)


def test_ranks_that_disagree_raise_on_every_rank(rt):
    def body(comm):
        rp = ringcoll.Repartitioner(comm, 10)
        return rt.RepartitionSampler(rp, 100 + (comm.rank == 1), seed=comm.rank % 2)

    assert_every_rank_raises(outcomes(3, body), "the ranks disagree on",
                             "'dataset length': [100, 101, 100]", "'seed': [0, 1, 0]",
                             "give every rank the same dataset")


def test_one_ranks_bad_argument_raises_everywhere_naming_it(rt):
    def body(comm):
        rp = ringcoll.Repartitioner(comm, 10)
        return rt.RepartitionSampler(rp, 100, seed=-5 if comm.rank == 2 else 0)

    got = outcomes(3, body)
    assert "seed must be an integer in [0, 2**62), got -5" in str(got[2])
    assert_every_rank_raises(got[:2], "rank(s) [2] refused their arguments")


def test_not_a_repartitioner(rt):
    with pytest.raises(InvalidArgumentError, match="rp must be a ringcoll.Repartitioner"):
        rt.RepartitionSampler(object(), 10)


def test_set_epoch_and_a_broken_split_are_refused(rt):
    def body(comm):
        rp = FakeRepartitioner(comm, 10, 0, 10)
        sampler = rt.RepartitionSampler(rp, 30)
        for bad in (-1, 1.0, True):
            with pytest.raises(InvalidArgumentError, match="set_epoch needs an integer >= 0"):
                sampler.set_epoch(bad)
        rp.start, rp.stop = 4, 4
        with pytest.raises(InvalidArgumentError, match=r"rows \[4, 4\) of a global batch of 10"):
            next(iter(sampler))
        return True

    assert ringcoll.run_threads(1, body, timeout=TIMEOUT) == [True]


def test_allreduce_gradients_checks_before_any_collective(rt):
    """Without a process group it says to initialise one (this process has none)."""
    model = torch.nn.Linear(2, 2)
    with pytest.raises(InvalidArgumentError, match="init_process_group"):
        rt.allreduce_gradients(model, 1.0)
    with pytest.raises(InvalidArgumentError, match="init_process_group"):
        rt.communicator()


# -- the mpiexec tier ------------------------------------------------------------------------
@mpirun.needs_mpi
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_torch_repartitioned_training_under_mpiexec(p, mpi_timings, mpi_notes):
    rc, out, secs = mpirun.launch(p, ["tests/mpi_torch_repartition.py"],
                                  env={"RINGCOLL_TIMEOUT": "60"}, timeout=120)
    mpi_timings[f"mpi_torch_repartition -n {p}"] = secs
    assert rc == 0, out[-4000:]
    oks = [line for line in out.splitlines() if line.startswith("OK ")]
    assert "FAIL" not in out and len(oks) == 4, out[-4000:]
    mpi_notes.extend(f"P={p} {line[3:]}" for line in oks)
