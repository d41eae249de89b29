"""Model parallelism on ringcoll: tensor-parallel layers and pipeline schedules, in NumPy.

    mesh = ringcoll.Mesh(comm, dp=2, tp=2)                     # ringcoll/mesh.py
    mlp = ringcoll.parallel.ParallelMLP.from_full(mesh.tp, w1, b1, w2, b2)
    y, cache = mlp.forward(x)                                   # one all-reduce over mesh.tp
    dx, grads = mlp.backward(dy, cache)                         # one all-reduce over mesh.tp

    pipe = ringcoll.parallel.Pipeline(mesh.pp, stage, schedule="1f1b")
    res = pipe.run(rows, inputs=..., loss=...)                  # res.grads: this stage's

layers.py    the unsplit Linear / Activation / Sequential (the oracle, and pipeline stages)
tensor.py    ColumnParallelLinear, RowParallelLinear, ParallelMLP; Megatron's f and g
pipeline.py  Pipeline with GPipe and 1F1B schedules; simulate / draw a schedule

See docs/model_parallel.md for the pictures, the communication of each layer and the
measured pipeline bubble.
"""

from .layers import Activation, Linear, Sequential, mlp
from .pipeline import (SCHEDULES, Pipeline, PipelineResult, default_poll, draw, gpipe,
                       micro_batches, one_f_one_b, partition, simulate)
from .tensor import (ColumnParallelLinear, CopyToTP, GatherRows, ParallelMLP, ReduceFromTP,
                     ReduceScatterRows, RowParallelLinear, shard)

__all__ = [
    "Activation", "ColumnParallelLinear", "CopyToTP", "GatherRows", "Linear", "ParallelMLP",
    "Pipeline", "PipelineResult", "ReduceFromTP", "ReduceScatterRows", "RowParallelLinear",
    "SCHEDULES", "Sequential", "default_poll", "draw", "gpipe", "micro_batches", "mlp",
    "one_f_one_b", "partition", "shard", "simulate",
]
