"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) in NumPy: each weight matrix split
over the t ranks of a tensor-parallel communicator (a Mesh's mesh.tp).

A linear layer is y = x W + b, x of shape (n, d_in) (n rows of a batch), W (d_in, d_out).
Splits follow np.array_split (the first d % t shards one wider), so any width works.

ColumnParallelLinear: W = [W_0 | W_1 | ... | W_t-1] split by output columns; rank i holds
    W_i (d_in, d_out_i) and b_i. Every rank needs all of x.
        forward:  y_i = f(x) W_i + b_i             [gather_output: y = all-gather of the y_i]
        backward: dW_i = x^T dy_i,  db_i = sum_rows dy_i,  dx = f'(dy_i W_i^T)
    f is the identity forward and an all-reduce backward: each rank's dy_i W_i^T is only its
    columns' share of dx.

RowParallelLinear: W = [W_0; W_1; ...; W_t-1] split by input rows; rank i holds W_i
    (d_in_i, d_out) and takes x_i, its columns of x (the y_i of a column-parallel layer).
    The bias is whole on every rank and added once, after the sum.
        forward:  y = g(x_i W_i) + b
        backward: dW_i = x_i^T dy,  db = sum_rows dy,  dx_i = dy W_i^T
    g is an all-reduce forward and the identity backward.

f and g are conjugate: one's forward is the other's backward (CopyToTP and ReduceFromTP
below, Megatron's copy_to_tensor_model_parallel_region and
reduce_from_tensor_model_parallel_region).

ParallelMLP = ColumnParallelLinear -> activation -> RowParallelLinear: the activation is
elementwise, so it applies to each rank's columns with no communication, and the block needs
exactly one all-reduce forward (g, n x d_out) and one backward (f, n x d_in).

Sequence parallel (Korthikanti et al. 2022): outside the block the activations are split by
rows, x_i = rows block i (n/t rows each). f becomes an all-gather of rows forward and a
reduce-scatter of rows backward (GatherRows); g a reduce-scatter forward and an all-gather
backward (ReduceScatterRows). An all-reduce is a reduce-scatter plus an all-gather, so the
bytes on the wire are the same; what shrinks is the activation memory (and the elementwise
work) outside the block, 1/t per rank.

Cost per rank of each operator on an (n, d) array of B-byte elements, over ringcoll's ring:
    all-reduce      2(t-1) a + 2 (t-1)/t n d B b + (t-1)/t n d B g
    all-gather      (t-1) a + (t-1)/t n d B b      (reduce-scatter: the same, plus the sums)

Every layer follows the protocol of ringcoll/parallel/layers.py (forward returns a cache,
backward takes it and returns (dx, grads)), so the unsplit Linear and these are
interchangeable in a Sequential.
"""

import numpy as np

from ..arrays import Partition
from ..checkpoint.layout import Shard
from ..errors import InvalidArgumentError, where
from .layers import activation


def shard(n, comm):
    """The slice of range(n) that this rank of comm holds (np.array_split's blocks)."""
    return Partition.even(n, comm.size).slices[comm.rank]


# -- the conjugate operators ---------------------------------------------------------------------
class CopyToTP:
    """Megatron's f: identity forward, all-reduce (sum) backward."""

    @staticmethod
    def forward(comm, x):
        return x

    @staticmethod
    def backward(comm, dx):
        return comm.allreduce(dx) if comm.size > 1 else dx


class ReduceFromTP:
    """Megatron's g: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(comm, y):
        return comm.allreduce(y) if comm.size > 1 else y

    @staticmethod
    def backward(comm, dy):
        return dy


class GatherRows:
    """Sequence-parallel f: all-gather of row blocks forward, reduce-scatter backward."""

    @staticmethod
    def forward(comm, x):
        return comm.allgather(x) if comm.size > 1 else x

    @staticmethod
    def backward(comm, dx):
        return comm.reduce_scatter(dx) if comm.size > 1 else dx


class ReduceScatterRows:
    """Sequence-parallel g: reduce-scatter into row blocks forward, all-gather backward."""

    @staticmethod
    def forward(comm, y):
        return comm.reduce_scatter(y) if comm.size > 1 else y

    @staticmethod
    def backward(comm, dy):
        return comm.allgather(dy) if comm.size > 1 else dy


class GatherColumns:
    """All-gather of column blocks forward (ColumnParallelLinear's gather_output), this
    rank's columns backward (no communication)."""

    @staticmethod
    def forward(comm, y):
        if comm.size == 1:
            return y
        # ringcoll's all-gather concatenates along axis 0: gather the transposes
        return np.ascontiguousarray(comm.allgather(np.ascontiguousarray(y.T)).T)

    @staticmethod
    def backward(comm, dy, columns):
        return np.ascontiguousarray(dy[:, columns])


class ScatterColumns:
    """This rank's columns forward (no communication), all-gather of columns backward:
    RowParallelLinear's input when it is not already split (input_is_parallel=False)."""

    @staticmethod
    def forward(comm, x, columns):
        return np.ascontiguousarray(x[:, columns])

    @staticmethod
    def backward(comm, dx):
        return GatherColumns.forward(comm, dx)


def _check_2d(x, layer, comm):
    if np.ndim(x) != 2:
        raise InvalidArgumentError(f"{where(comm.rank, layer)}x must be 2-D (rows, features), "
                                   f"got shape {np.shape(x)}")


# -- the layers ------------------------------------------------------------------------------------
class ColumnParallelLinear:
    """y = x W + b with W split by output columns over comm (see the module docstring).

    Args:
        comm: the tensor-parallel Communicator (mesh.tp).
        weight: this rank's columns, (in_features, out_features_i); from_full slices them.
        bias: this rank's (out_features_i,), or None.
        out_features: the whole layer's output width (default: the sum of the shards,
            assuming np.array_split's widths).
        gather_output: all-gather the columns so every rank returns the whole y (n, d_out);
            otherwise each returns its y_i (n, d_out_i), the input a RowParallelLinear takes.
        sequence_parallel: x arrives as this rank's block of rows and is all-gathered
            (GatherRows) instead of copied (CopyToTP).
        names: the parameter names (default ("weight", "bias")).

    Communication: forward none (gather_output: one all-gather of n x d_out; sequence
    parallel: one all-gather of n x d_in); backward one all-reduce of n x d_in (sequence
    parallel: one reduce-scatter), none when input_grad=False.
    """

    def __init__(self, comm, weight, bias=None, *, out_features=None, gather_output=False,
                 sequence_parallel=False, names=("weight", "bias")):
        if gather_output and sequence_parallel:
            raise InvalidArgumentError(f"{where(comm.rank, 'ColumnParallelLinear')}"
                                       "gather_output and sequence_parallel do not combine: a "
                                       "sequence-parallel block ends with a RowParallelLinear")
        self.comm, self.weight, self.bias = comm, weight, bias
        self.names = tuple(names)
        self.params = {names[0]: weight} if bias is None else {names[0]: weight, names[1]: bias}
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.full_out = _whole(comm, weight.shape[1], out_features, "ColumnParallelLinear",
                               "columns")
        self.columns = shard(self.full_out, comm)
        self.in_features = weight.shape[0]
        self.out_features = self.full_out if gather_output else weight.shape[1]
        self.dtype = weight.dtype
        self._f = GatherRows if sequence_parallel else CopyToTP

    @classmethod
    def from_full(cls, comm, weight, bias=None, **options):
        """The layer built from the whole (in, out) weight and (out,) bias: this rank keeps
        copies of its columns."""
        cols = shard(weight.shape[1], comm)
        return cls(comm, np.ascontiguousarray(weight[:, cols]),
                   None if bias is None else bias[cols].copy(), out_features=weight.shape[1],
                   **options)

    def forward(self, x):
        _check_2d(x, "ColumnParallelLinear", self.comm)
        x = self._f.forward(self.comm, x)
        y = x @ self.weight
        if self.bias is not None:
            y += self.bias
        if self.gather_output:
            y = GatherColumns.forward(self.comm, y)
        return y, x

    def backward(self, dy, x, input_grad=True):
        if self.gather_output:
            dy = GatherColumns.backward(self.comm, dy, self.columns)
        grads = {self.names[0]: x.T @ dy}
        if self.bias is not None:
            grads[self.names[1]] = dy.sum(axis=0)
        dx = self._f.backward(self.comm, dy @ self.weight.T) if input_grad else None
        return dx, grads

    def shards(self):
        """{name: Shard}: this rank's columns of the (in, out) weight and the (out,) bias,
        for save_checkpoint / load_checkpoint (no communication)."""
        first = self.columns.start
        out = {self.names[0]: Shard((self.weight.shape[0], self.full_out), (0, first))}
        if self.bias is not None:
            out[self.names[1]] = Shard((self.full_out,), (first,))
        return out

    def full_params(self):
        """{name: the whole parameter}, gathered from every rank (collective over comm)."""
        out = {self.names[0]: GatherColumns.forward(self.comm, self.weight)}
        if self.bias is not None:
            out[self.names[1]] = self.comm.allgather(self.bias) if self.comm.size > 1 \
                else self.bias.copy()
        return out


class RowParallelLinear:
    """y = x W + b with W split by input rows over comm (see the module docstring).

    Args:
        comm: the tensor-parallel Communicator (mesh.tp).
        weight: this rank's rows, (in_features_i, out_features); from_full slices them.
        bias: the whole (out_features,) bias (the same on every rank), or None.
        in_features: the whole layer's input width (default: the sum of the shards).
        input_is_parallel: x is already this rank's columns x_i (a ColumnParallelLinear's
            output); False: x is whole and this rank takes its columns (ScatterColumns).
        sequence_parallel: reduce-scatter the output into row blocks instead of all-reducing
            it (ReduceScatterRows): each rank returns its block of rows of y.
        names: the parameter names (default ("weight", "bias")).

    Communication: forward one all-reduce of n x d_out (sequence parallel: one
    reduce-scatter); backward none (sequence parallel: one all-gather of n x d_out;
    input_is_parallel=False: one all-gather of n x d_in for dx).
    """

    def __init__(self, comm, weight, bias=None, *, in_features=None, input_is_parallel=True,
                 sequence_parallel=False, names=("weight", "bias")):
        self.comm, self.weight, self.bias = comm, weight, bias
        self.names = tuple(names)
        self.params = {names[0]: weight} if bias is None else {names[0]: weight, names[1]: bias}
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.full_in = _whole(comm, weight.shape[0], in_features, "RowParallelLinear", "rows")
        self.rows = shard(self.full_in, comm)
        self.in_features = weight.shape[0] if input_is_parallel else self.full_in
        self.out_features = weight.shape[1]
        self.dtype = weight.dtype
        self._g = ReduceScatterRows if sequence_parallel else ReduceFromTP

    @classmethod
    def from_full(cls, comm, weight, bias=None, **options):
        """The layer built from the whole (in, out) weight and (out,) bias: this rank keeps a
        copy of its rows of the weight and of the whole bias."""
        rows = shard(weight.shape[0], comm)
        return cls(comm, np.ascontiguousarray(weight[rows]),
                   None if bias is None else bias.copy(), in_features=weight.shape[0],
                   **options)

    def forward(self, x):
        _check_2d(x, "RowParallelLinear", self.comm)
        if not self.input_is_parallel:
            x = ScatterColumns.forward(self.comm, x, self.rows)
        y = self._g.forward(self.comm, x @ self.weight)
        if self.bias is not None:
            y += self.bias
        return y, x

    def backward(self, dy, x, input_grad=True):
        dy = self._g.backward(self.comm, dy)  # sequence parallel: all rows of dy, gathered
        grads = {self.names[0]: x.T @ dy}
        if self.bias is not None:  # whole on every rank; its gradient, from all of dy, too
            grads[self.names[1]] = dy.sum(axis=0)
        if not input_grad:
            return None, grads
        dx = dy @ self.weight.T
        if not self.input_is_parallel:
            dx = ScatterColumns.backward(self.comm, dx)
        return dx, grads

    def shards(self):
        """{name: Shard}: this rank's rows of the (in, out) weight (the bias is whole), for
        save_checkpoint / load_checkpoint (no communication)."""
        return {self.names[0]: Shard((self.full_in, self.out_features), (self.rows.start, 0))}

    def full_params(self):
        """{name: the whole parameter}, gathered from every rank (collective over comm)."""
        out = {self.names[0]: self.comm.allgather(self.weight) if self.comm.size > 1
               else self.weight.copy()}
        if self.bias is not None:
            out[self.names[1]] = self.bias.copy()
        return out


class ParallelMLP:
    """Megatron's MLP block: ColumnParallelLinear (d -> h, split over comm), an elementwise
    activation on each rank's columns, RowParallelLinear (h -> d_out).

    Communication: one all-reduce of n x d_out forward (in the row layer) and one of n x d
    backward (in the column layer; none with input_grad=False). With sequence_parallel=True,
    x and y are this rank's blocks of rows, and the two all-reduces become an all-gather
    plus a reduce-scatter each way (the same bytes).

    Args:
        comm: the tensor-parallel Communicator (mesh.tp).
        w1, b1: this rank's columns of the first layer ((d, h_i), (h_i,)); w2, b2: its rows
            of the second ((h_i, d_out)) and the whole second bias; from_full slices them.
        activation: "gelu" (default, as Megatron) or "relu".
        names: the four parameter names (default ("w1", "b1", "w2", "b2")).
    """

    def __init__(self, comm, w1, b1, w2, b2, *, hidden=None, activation_name="gelu",
                 sequence_parallel=False, names=("w1", "b1", "w2", "b2")):
        self.comm = comm
        self.fc1 = ColumnParallelLinear(comm, w1, b1, out_features=hidden,
                                        sequence_parallel=sequence_parallel, names=names[:2])
        self.fc2 = RowParallelLinear(comm, w2, b2, in_features=hidden,
                                     sequence_parallel=sequence_parallel, names=names[2:])
        self.act, self.act_grad = activation(activation_name, "ringcoll ParallelMLP")
        self.params = {**self.fc1.params, **self.fc2.params}
        self.in_features, self.out_features = self.fc1.in_features, self.fc2.out_features
        self.dtype = w1.dtype

    @classmethod
    def from_full(cls, comm, w1, b1, w2, b2, **options):
        cols = shard(w1.shape[1], comm)
        return cls(comm, np.ascontiguousarray(w1[:, cols]), b1[cols].copy(),
                   np.ascontiguousarray(w2[cols]), b2.copy(), hidden=w1.shape[1], **options)

    def forward(self, x):
        z, c1 = self.fc1.forward(x)  # (n, h_i): this rank's columns, no communication
        y, c2 = self.fc2.forward(self.act(z))  # one all-reduce (g)
        return y, (c1, z, c2)

    def backward(self, dy, cache, input_grad=True):
        c1, z, c2 = cache
        dh, g2 = self.fc2.backward(dy, c2)  # no communication (sequence parallel: all-gather)
        dx, g1 = self.fc1.backward(self.act_grad(z, dh), c1, input_grad)  # one all-reduce (f)
        return dx, {**g1, **g2}

    def shards(self):
        return {**self.fc1.shards(), **self.fc2.shards()}

    def full_params(self):
        return {**self.fc1.full_params(), **self.fc2.full_params()}


def _whole(comm, mine, given, layer, what):
    """The whole width of a split dimension: `given`, or the sum of every rank's `mine` (one
    small all-gather); either way checked against np.array_split's widths."""
    ctx = where(comm.rank, layer)
    if given is None:
        widths = ([int(w) for w in comm.allgather(np.array([mine], np.int64))]
                  if comm.size > 1 else [mine])
        given = sum(widths)
        if widths != Partition.even(given, comm.size).counts:
            raise InvalidArgumentError(
                f"{ctx}the ranks hold {what} of widths {widths}; shard {given} like "
                f"np.array_split ({Partition.even(given, comm.size).counts}): use from_full")
    elif Partition.even(given, comm.size).counts[comm.rank] != mine:
        raise InvalidArgumentError(
            f"{ctx}this rank holds {mine} {what} of {given}; np.array_split gives it "
            f"{Partition.even(given, comm.size).counts[comm.rank]}: use from_full")
    return given
