"""Tensor-parallel layers on thread ranks: forward outputs and every gradient (weights, biases,
inputs) equal the unsplit layer's (float64, within 1e-12 of the largest entry) at tp = 1, 2, 4
(and 3: uneven shards), on every rank (tests/_parallel_cases.py); and each layer does exactly
the communication its docstring promises (a counting wrapper around the communicator)."""

import numpy as np
import pytest

import ringcoll
from ringcoll.parallel import ColumnParallelLinear, ParallelMLP, RowParallelLinear

import _parallel_cases as C

TIMEOUT = 20
TPS = [1, 2, 3, 4]


def run(p, fn):
    return ringcoll.run_threads(p, fn, timeout=TIMEOUT)


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("gather_output", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_column_parallel_equals_the_unsplit_layer(tp, gather_output, bias):
    run(tp, lambda comm: C.check_column(comm, gather_output=gather_output, bias=bias))


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("input_is_parallel", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_row_parallel_equals_the_unsplit_layer(tp, input_is_parallel, bias):
    run(tp, lambda comm: C.check_row(comm, input_is_parallel=input_is_parallel, bias=bias))


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_parallel_mlp_equals_the_unsplit_block(tp, activation, sequence_parallel):
    names = run(tp, lambda comm: C.check_mlp(comm, activation, sequence_parallel))
    assert names == [["b1", "b2", "w1", "w2"]] * tp


@pytest.mark.parametrize("tp", [2, 4])
def test_float32_within_float32_rounding(tp):
    run(tp, lambda comm: C.check_mlp(comm, dtype=np.float32, rtol=1e-5))


def test_more_ranks_than_columns():
    """tp=4 over a hidden width of 3: one rank holds no columns and still takes part."""
    run(4, lambda comm: C.check_mlp(comm, h=3))


# -- the communication each layer does ---------------------------------------------------
class Counting:
    """A Communicator that records each collective as (name, shape of its input)."""

    def __init__(self, comm):
        self.comm, self.calls = comm, []
        self.rank, self.size = comm.rank, comm.size

    def __getattr__(self, name):
        method = getattr(self.comm, name)
        if name not in ("allreduce", "allgather", "reduce_scatter"):
            return method

        def counted(x, *args, **kwargs):
            self.calls.append((name, np.shape(x)))
            return method(x, *args, **kwargs)

        return counted


def calls_of(tp, build, x_rows, n=8, d=6):
    """(forward calls, backward calls, backward calls with input_grad=False) of a layer."""
    def body(comm):
        spy = Counting(comm)
        layer = build(spy)
        spy.calls.clear()  # construction may agree on widths; count forward and backward
        x = C.data(3, x_rows(comm), layer.in_features)
        y, cache = layer.forward(x)
        forward = list(spy.calls)
        spy.calls.clear()
        layer.backward(np.ones_like(y), cache)
        backward = list(spy.calls)
        spy.calls.clear()
        layer.backward(np.ones_like(y), cache, input_grad=False)
        return forward, backward, list(spy.calls)

    return run(tp, body)


def test_mlp_needs_one_allreduce_forward_and_one_backward():
    w1, b1, w2, b2 = C.data(1, 6, 12), C.data(2, 12), C.data(3, 12, 5), C.data(4, 5)
    for fwd, bwd, no_dx in calls_of(4, lambda c: ParallelMLP.from_full(c, w1, b1, w2, b2),
                                    lambda c: 8):
        assert fwd == [("allreduce", (8, 5))]   # g: the row layer's partial sums
        assert bwd == [("allreduce", (8, 6))]   # f: the column layer's partial dx
        assert no_dx == []


def test_sequence_parallel_mlp_gathers_and_scatters_rows():
    w1, b1, w2, b2 = C.data(1, 6, 12), C.data(2, 12), C.data(3, 12, 5), C.data(4, 5)
    build = lambda c: ParallelMLP.from_full(c, w1, b1, w2, b2, sequence_parallel=True)  # noqa
    for fwd, bwd, no_dx in calls_of(4, build, lambda c: 2):
        assert fwd == [("allgather", (2, 6)), ("reduce_scatter", (8, 5))]
        assert bwd == [("allgather", (2, 5)), ("reduce_scatter", (8, 6))]
        assert no_dx == [("allgather", (2, 5))]


def test_column_and_row_layers_communicate_as_documented():
    w = C.data(1, 6, 8)
    col = calls_of(2, lambda c: ColumnParallelLinear.from_full(c, w), lambda c: 8)
    assert col[0] == ([], [("allreduce", (8, 6))], [])
    gathered = calls_of(2, lambda c: ColumnParallelLinear.from_full(c, w, gather_output=True),
                        lambda c: 8)
    assert gathered[0] == ([("allgather", (4, 8))], [("allreduce", (8, 6))], [])
    row = calls_of(2, lambda c: RowParallelLinear.from_full(c, w.T.copy()), lambda c: 8)
    assert row[0] == ([("allreduce", (8, 6))], [], [])
    scattered = calls_of(2, lambda c: RowParallelLinear.from_full(c, w.T.copy(),
                                                                  input_is_parallel=False),
                         lambda c: 8)
    assert scattered[0] == ([("allreduce", (8, 6))], [("allgather", (4, 8))], [])


# -- arguments ------------------------------------------------------------------------------
def test_shards_that_are_not_array_split_are_refused():
    def body(comm):
        width = 3 if comm.rank == 0 else 5  # 8 over 2 ranks is 4 + 4
        with pytest.raises(ringcoll.InvalidArgumentError, match=r"widths \[3, 5\]; shard 8 like "
                           r"np.array_split \(\[4, 4\]\): use from_full"):
            ColumnParallelLinear(comm, np.zeros((2, width)))
        with pytest.raises(ringcoll.InvalidArgumentError, match="holds 3 columns of 8"):
            ColumnParallelLinear(comm, np.zeros((2, 3)), out_features=8)
        return True

    assert run(2, body) == [True, True]


def test_bad_layer_arguments():
    def body(comm):
        with pytest.raises(ringcoll.InvalidArgumentError, match="gather_output and sequence"):
            ColumnParallelLinear.from_full(comm, np.zeros((2, 4)), gather_output=True,
                                           sequence_parallel=True)
        layer = ColumnParallelLinear.from_full(comm, np.zeros((2, 4)))
        with pytest.raises(ringcoll.InvalidArgumentError, match="x must be 2-D"):
            layer.forward(np.zeros(2))
        with pytest.raises(ringcoll.InvalidArgumentError, match="unknown activation 'tanh'"):
            ParallelMLP.from_full(comm, np.zeros((2, 4)), np.zeros(4), np.zeros((4, 2)),
                                  np.zeros(2), activation_name="tanh")
        return True

    assert run(2, body) == [True, True]
