"""Pipeline parallelism: a model's consecutive layers on consecutive ranks of a pipeline
communicator (a Mesh's mesh.pp), with m micro-batches streamed through them.

Stage s (rank s of comm, 0..p-1) holds a module (the protocol of ringcoll/parallel/layers.py:
forward returns a cache, backward takes it). For micro-batch j it runs two actions:

    F(j): x = recv from s-1 (stage 0: inputs[j]); y, cache_j = stage.forward(x);
          isend y to s+1 (the last stage instead: loss(j, y) -> (value, dy))
    B(j): dy = recv from s+1 (the last stage: its loss's dy); dx, grads = stage.backward(dy,
          cache_j); isend dx to s-1 (stage 0: no dx at all); grads added up over j

A schedule is the list of actions of each stage, in order. Receives block; sends never do (they
are waited for at the end), so a schedule cannot deadlock as long as every receive's message is
sent by an action that does not wait on it, which holds for both schedules here:

GPipe (Huang et al. 2019): every forward, then every backward.
1F1B (PipeDream-Flush, Narayanan et al. 2021): stage s first runs min(p-s-1, m) forwards to fill
    the pipe, then alternates one forward and one backward, then drains the last backwards.

p = 4 stages, m = 4 micro-batches, F one time unit and B two (draw(schedule, 4, 4)): digit j
is the forward of micro-batch j, a letter its backward (a = 0), a dot idle time, the bubble:

    GPipe  stage 0  0123.........aabbccdd        1F1B  stage 0  0123......aa.bb.cc.dd
           stage 1  .0123......aabbccdd..              stage 1  .012....aa3bb.cc.dd..
           stage 2  ..0123...aabbccdd....              stage 2  ..01..aa2bb3cc.dd....
           stage 3  ...0123aabbccdd......              stage 3  ...0aa1bb2cc3dd......

Bubble: if F takes t_f and B t_b on every stage, both schedules take (m + p - 1)(t_f + t_b),
of which each stage is busy m (t_f + t_b): an idle fraction of (p - 1)/(m + p - 1). 1F1B's gain
is memory: stage s holds at most min(p - s, m) micro-batches' caches at once, GPipe m.

Overlap with data parallelism (run(..., grad_ready=)): a stage's gradient of a parameter is
final once the stage has run the backward of its LAST micro-batch through that parameter's
layer. The schedule's last B action is that backward for every layer; during it a Sequential
stage is walked layer by layer, last layer first, and grad_ready(name, summed gradient) is
called for each of the layer's parameters as soon as the layer is done, before the layers in
front of it run their backward. Handed to DistributedOptimizer.grad_ready (over mesh.dp),
the later layers' buckets start their all-reduce in the background while the earlier layers'
backward still runs (in both schedules B(m-1) is a stage's last action, so what follows it is
the optimizer's wait for the rest):

    stage s, 1F1B, m = 4:  ... F3 B2 [B3: layer L-1 .. 0] step
                                          |-> bucket 0 all-reduce (over dp) ....|
                                                 |-> bucket 1 ...                |wait

Communication per micro-batch and stage boundary: one activation (rows x width) forward and one
gradient of the same shape backward, point-to-point (Communicator.isend / recv): a + n B b
each, with n B the activation's bytes. Tags: 0 forward, 1 backward; each stream is sent and
received in micro-batch order, which MPI's non-overtaking rule keeps.
"""

import os
import time

import numpy as np

from ..arrays import Partition
from ..errors import InvalidArgumentError, where
from .layers import Sequential

FORWARD, BACKWARD = 0, 1  # the message tags of activations and of gradients


def gpipe(p, s, m):
    """GPipe's actions for stage s of p: F(0..m-1), then B(0..m-1)."""
    return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]


def one_f_one_b(p, s, m):
    """1F1B's actions for stage s of p: warm-up forwards, then F/B pairs, then the drain."""
    warmup = min(p - s - 1, m)
    actions = [("F", j) for j in range(warmup)]
    for j in range(m - warmup):
        actions += [("F", warmup + j), ("B", j)]
    return actions + [("B", j) for j in range(m - warmup, m)]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def simulate(schedule, p, m, t_f=1, t_b=2):
    """When each action would run with free, instant messages: F takes t_f, B t_b on every
    stage. Returns, per stage, [(kind, j, start, end)]. No timing, no threads: the schedule's
    shape, for drawings and for checking the bubble's formula.

    An action starts when its stage has finished the previous one and its input exists:
    F(j) on s needs F(j) on s-1, B(j) on s needs B(j) on s+1 (and F(j) on s).
    """
    schedule = SCHEDULES.get(schedule, schedule)
    todo = [list(schedule(p, s, m)) for s in range(p)]
    done, free = {}, [0] * p  # (kind, j, s) -> end time; when each stage is next free
    out = [[] for _ in range(p)]
    while any(todo):
        moved = False
        for s in range(p):
            while todo[s]:
                kind, j = todo[s][0]
                need = [("F", j, s - 1)] if kind == "F" and s > 0 else (
                    [("B", j, s + 1)] if kind == "B" and s < p - 1 else [])
                if kind == "B":
                    need.append(("F", j, s))
                if any(n not in done for n in need):
                    break
                begin = max([free[s]] + [done[n] for n in need])
                end = begin + (t_f if kind == "F" else t_b)
                done[(kind, j, s)], free[s] = end, end
                out[s].append((kind, j, begin, end))
                todo[s].pop(0)
                moved = True
        if not moved:
            raise InvalidArgumentError(f"ringcoll simulate: schedule {schedule!r} deadlocks "
                                       f"at p={p}, m={m}")
    return out


def draw(schedule, p, m, t_f=1, t_b=2):
    """simulate()'s timeline as text, one line per stage, one character per time unit:
    digit j = forward of micro-batch j, letter = backward (a = micro-batch 0), '.' = idle."""
    lanes = simulate(schedule, p, m, t_f, t_b)
    width = max(end for lane in lanes for *_, end in lane)
    lines = []
    for s, lane in enumerate(lanes):
        row = ["."] * width
        for kind, j, begin, end in lane:
            row[begin:end] = (str(j % 10) if kind == "F" else chr(ord("a") + j % 26)) * (
                end - begin)
        lines.append(f"stage {s}  " + "".join(row))
    return "\n".join(lines)


def default_poll(comm, seconds=50e-6):
    """`seconds` if comm's node runs more ranks than this process may use cores (MPI's
    spinning waits then take cores from ranks that compute), else None (block)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return seconds if comm.local_size > (cores or 1) else None


def micro_batches(n, m):
    """The row slices of an n-row batch cut into m micro-batches (np.array_split's blocks)."""
    return Partition.even(n, m).slices


def partition(n, p):
    """Which of n layers each of p stages holds: a list of p ranges (np.array_split's)."""
    part = Partition.even(n, p)
    return [range(part.starts[i], part.starts[i + 1]) for i in range(p)]


class PipelineResult:
    """What one Pipeline.run did on this stage.

    Attributes:
        grads: {param name: gradient summed over the micro-batches} (empty after forward_only)
        losses: the last stage's loss value per micro-batch ([] on other stages)
        outputs: forward_only's outputs per micro-batch on the last stage ([] elsewhere)
        timeline: [(kind, j, start, end)]: each action's compute, seconds from the run's start
        busy: seconds of compute (forward, backward, loss); elapsed: from the start to the end
            of this stage's last action (its wait for sends not included)
        peak_in_flight: the most micro-batches whose caches this stage held at once
        final_at: {param name: seconds from the run's start when its gradient became final
            and was handed to grad_ready} (empty without grad_ready)
    """

    def __init__(self):
        self.grads, self.losses, self.outputs, self.timeline = {}, [], [], []
        self.final_at = {}
        self.busy = self.elapsed = 0.0
        self.peak_in_flight = 0


class Pipeline:
    """Run one pipeline stage: this rank's part of a model, in step with the other stages.

    Args:
        comm: the pipeline Communicator (mesh.pp); its rank is the stage index.
        stage: this stage's module (layers.py protocol; in_features, out_features and dtype
            give the shapes of the messages it receives).
        schedule: "1f1b" (default) or "gpipe", or a function (p, s, m) -> actions.
        poll: seconds to sleep between checks while waiting for a message, instead of
            blocking in MPI (which spins on the core): for ranks that outnumber the cores, where
            a waiting stage's spinning slows the stage that computes (see Request.wait).

    Example::

        # stage s holds layers partition(4, p)[s] of a 4-layer MLP
        pipe = Pipeline(mesh.pp, stage_module, schedule="1f1b")
        res = pipe.run(rows=[8] * m, inputs=micro_inputs,          # inputs: stage 0 only
                       loss=lambda j, y: mse(y, targets[j]))       # loss: last stage only
        opt.step(res.grads)
    """

    def __init__(self, comm, stage, schedule="1f1b", poll=None):
        self.comm, self.stage, self.poll = comm, stage, poll
        if callable(schedule):
            self.schedule = schedule
        elif schedule in SCHEDULES:
            self.schedule = SCHEDULES[schedule]
        else:
            raise InvalidArgumentError(f"{where(comm.rank, 'Pipeline')}unknown schedule "
                                       f"{schedule!r}; choose one of {sorted(SCHEDULES)}")
        self.stages, self.index = comm.size, comm.rank
        self.first, self.last = self.index == 0, self.index == self.stages - 1

    def _check(self, rows, inputs, loss, training):
        ctx = where(self.comm.rank, "Pipeline.run")
        if self.first and (inputs is None or len(inputs) != len(rows)
                           or any(len(x) != r for x, r in zip(inputs, rows))):
            raise InvalidArgumentError(f"{ctx}stage 0 needs inputs: one array per micro-batch "
                                       f"with rows[j] rows (rows = {list(rows)})")
        if training and self.last and loss is None:
            raise InvalidArgumentError(f"{ctx}the last stage needs loss(j, y) -> (value, dy)")

    def _receive(self, rows, width, source, tag):
        out = np.empty((rows, width), self.stage.dtype)
        if self.poll:
            return self.comm.irecv(out, source, tag).wait(poll=self.poll)
        return self.comm.recv(out, source, tag)

    def run(self, rows, inputs=None, loss=None, grad_ready=None):
        """One forward and backward pass of every micro-batch, in this stage's schedule order.

        Args:
            rows: the row count of each micro-batch (the same list on every stage).
            inputs: stage 0: the m micro-batch inputs; other stages: None.
            loss: the last stage: loss(j, y) -> (value, dy), dy the gradient of the loss with
                respect to micro-batch j's output y; other stages: None.

        Returns:
            PipelineResult: grads summed over micro-batches, the losses, the timeline.
        """
        rows = [int(r) for r in rows]
        self._check(rows, inputs, loss, training=True)
        stage, comm, s = self.stage, self.comm, self.index
        res, caches, dys, sends = PipelineResult(), {}, {}, []
        res.losses = [None] * len(rows) if self.last else []
        actions = list(self.schedule(self.stages, s, len(rows)))
        # the last backward action: the one after which every gradient is final
        final = max((i for i, (kind, _) in enumerate(actions) if kind == "B"), default=None)
        start = time.perf_counter()
        for i, (kind, j) in enumerate(actions):
            if kind == "F":
                x = inputs[j] if self.first else self._receive(rows[j], stage.in_features,
                                                               s - 1, FORWARD)
                t0 = time.perf_counter()
                y, caches[j] = stage.forward(x)
                if self.last:
                    res.losses[j], dys[j] = loss(j, y)
                t1 = time.perf_counter()
                if not self.last:
                    sends.append(comm.isend(y, s + 1, FORWARD))
                res.peak_in_flight = max(res.peak_in_flight, len(caches))
            else:
                dy = dys.pop(j) if self.last else self._receive(rows[j], stage.out_features,
                                                                s + 1, BACKWARD)
                t0 = time.perf_counter()
                hand = grad_ready if i == final else None
                dx = self._backward(dy, caches.pop(j), res, hand, start)
                t1 = time.perf_counter()
                if not self.first:
                    sends.append(comm.isend(dx, s - 1, BACKWARD))
            res.timeline.append((kind, j, t0 - start, t1 - start))
            res.busy += t1 - t0
            sends = [r for r in sends if not r.test()]  # let finished sends' arrays go
        res.elapsed = time.perf_counter() - start
        for r in sends:
            r.wait()
        return res

    def _backward(self, dy, cache, res, grad_ready, start):
        """The stage's backward of one micro-batch, its gradients added into res.grads;
        with grad_ready (the last micro-batch), each layer's summed gradients are handed over
        as soon as that layer is done. Returns dx (None on stage 0)."""
        stage, total = self.stage, res.grads

        def add(grads):
            for name, g in grads.items():
                if name in total:
                    total[name] += g
                else:
                    total[name] = g
            if grad_ready is not None:
                for name in grads:
                    res.final_at[name] = time.perf_counter() - start
                    grad_ready(name, total[name])

        if grad_ready is None or not isinstance(stage, Sequential):
            dx, grads = stage.backward(dy, cache, input_grad=not self.first)
            add(grads)
            return dx
        # Sequential.backward's loop, handing each layer's gradients over before the layers
        # in front of it run theirs
        for k in reversed(range(len(stage.layers))):
            dy, grads = stage.layers[k].backward(dy, cache[k],
                                                 input_grad=not self.first or k > 0)
            add(grads)
        return dy

    def forward_only(self, rows, inputs=None):
        """Forwards only (evaluation): the last stage gets each micro-batch's output in
        res.outputs; no caches are kept and nothing flows backward."""
        rows = [int(r) for r in rows]
        self._check(rows, inputs, None, training=False)
        stage, comm, s = self.stage, self.comm, self.index
        res, sends = PipelineResult(), []
        start = time.perf_counter()
        for j in range(len(rows)):
            x = inputs[j] if self.first else self._receive(rows[j], stage.in_features, s - 1,
                                                           FORWARD)
            t0 = time.perf_counter()
            y, _ = stage.forward(x)
            t1 = time.perf_counter()
            if self.last:
                res.outputs.append(y)
            else:
                sends.append(comm.isend(y, s + 1, FORWARD))
            res.timeline.append(("F", j, t0 - start, t1 - start))
            res.busy += t1 - t0
        res.elapsed = time.perf_counter() - start
        for r in sends:
            r.wait()
        return res
