"""The runner: how every checked call (a Plan) runs, in one place.

- plan(): check a call's arguments by building its Plan; a bad argument is raised on this
  rank, and in debug mode the other ranks are told first, so they raise PeerFailedError
  instead of waiting for it.
- run(): inline on the caller's thread, or, while non-blocking calls are pending, queued
  behind them on the background thread, so everything runs in call order.
- submit(): a non-blocking call: queued on the background thread, a Request returned.
- replay(): a repeated identical all-reduce (the very same arrays, op and algorithm) runs its
  checked steps again, skipping every check and every allocation: the small-message hot path
  (outside debug mode, where every call is checked and agreed on anew).
- call(): the same for every other collective (its repeat): a call whose arguments are those of the last
  call of that collective (its arrays the very same objects, unchanged in dtype and shape; its
  other arguments equal) runs that call's checked plan again instead of building a new one.
  Whatever a plan exchanges between ranks at run time (row counts, agreements) still runs:
  only this rank's own checks and set-up are skipped.
- every run sits between Progress.begin and .end (the watchdog and error messages read them);
  in debug mode the ranks first agree on the call (checks.exchange_fingerprints); an error
  that every rank raised alike propagates, any other goes to the transport's fail() (MPI:
  print it and abort the job, since the peers may wait for this rank forever).

Collectives never reimplement any of this: they build Plans.
"""

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import numpy as np

from . import checks
from .cache import BoundedCache
from .errors import InvalidArgumentError, RingcollError, where


#: Plan.result when run() returns the result itself
RETURNED = object()


class Plan:
    """One checked call, ready to run: run() does it and returns its result.

    collective and algorithm name it (Progress, errors, debug mode); fields is debug mode's
    description of this rank's call (None outside debug mode); schedule lists the (peer, tag)
    of its bound steps, in order (see Progress). replay, if set, is the Replay a repeated
    identical call may run instead of building a new plan. result, if given, is the call's
    result, fixed when planning: run() is then a bound MPI call (see native.bind) whose own
    return value is not it.
    """

    __slots__ = ("collective", "algorithm", "fields", "run", "schedule", "replay", "repeatable",
                 "result")

    def __init__(self, collective, algorithm, fields, run, schedule=(), replay=None,
                 repeatable=False, result=RETURNED):
        self.collective, self.algorithm, self.fields = collective, algorithm, fields
        self.run, self.schedule, self.replay, self.result = run, schedule, replay, result
        # repeatable: run() may run again for the very same arguments (see Repeat): it reads
        # the caller's arrays themselves (no copy of them made while planning) and writes
        # into the caller's out= (no result allocated while planning)
        self.repeatable = repeatable


class Replay:
    """A call's arguments and its checked steps. It holds x and out, so their ids cannot be
    reused while it lives: `replay.x is x` proves the very same arrays come back."""

    __slots__ = ("x", "out", "op", "algorithm", "dtype", "shapes", "current", "steps")

    def __init__(self, x, out, op, algorithm, steps, plan):
        self.x, self.out, self.op, self.algorithm = x, out, op, algorithm
        self.dtype, self.steps = x.dtype, steps
        # an array reshaped in place (x.shape = ...) is the same object with other strides:
        # the steps bound to its old layout must not run again
        self.shapes = (x.shape, getattr(out, "shape", None))
        self.current = (plan.collective, plan.algorithm, plan.schedule)  # for Progress


def freeze(value):
    """A value argument (root, counts, op, algorithm) as Repeat keeps it: a list or tuple as a
    new one of its ints (so a list changed in place after the call is seen as changed), an
    array as a tuple of its ints, anything else as it is (ints, strings, None, MPI.Op
    objects); None for what cannot be kept."""
    if isinstance(value, (list, tuple, np.ndarray)):
        try:
            ints = [int(v) for v in value]
        except (TypeError, ValueError):
            return None
        return ints if type(value) is list else tuple(ints)
    return value


class Repeat:
    """The last call of one collective, for Runner.repeat: its arguments, its plan.

    buffers are the positions of the arguments that are arrays the call reads or writes: they
    match only the very same objects (kept here, so their ids cannot be reused) with the
    dtype and shape they had. Every other argument matches an equal value (see freeze).
    """

    __slots__ = ("args", "layouts", "plan", "run", "result", "current")

    def __init__(self, args, buffers, plan):
        # arrays as themselves (or None where left out), every other argument frozen
        self.args = tuple(a if i in buffers else freeze(a) for i, a in enumerate(args))
        # (position, dtype, shape) of every array argument
        self.layouts = tuple((i, args[i].dtype, args[i].shape) for i in buffers
                             if hasattr(args[i], "dtype"))
        self.plan, self.run, self.result = plan, plan.run, plan.result
        self.current = (plan.collective, plan.algorithm, plan.schedule)  # for Progress

    def matches(self, args):
        """The same call again? This runs on every repeat of every collective: the arrays
        first (the very same objects, unchanged), then the whole tuple in one C comparison,
        which takes an identical item as equal without calling its __eq__ (so the arrays,
        found identical, are not compared elementwise) and compares the rest by value: a
        list of counts with the kept list, root with root, None with None. Counts given as
        an array are compared as freeze keeps them."""
        kept = self.args
        for i, dtype, shape in self.layouts:
            given = args[i]
            if given is not kept[i] or given.dtype is not dtype or given.shape != shape:
                return False
        try:
            return args == kept
        except Exception:  # an array among the values (counts): its == is elementwise,
            # without one truth value, so each value is compared frozen, as it was kept
            return len(args) == len(kept) and all(
                given is mine or freeze(given) == mine for given, mine in zip(args, kept))


#: the runner's Replay when there is none: its x is no caller's array, so nothing matches
#: (one `is` test on the hot path instead of two)
NO_REPLAY = Replay(np.empty(0), None, None, None, (), Plan(None, None, None, None))


def freeze_all(args, buffers):
    """Can every value argument be kept (see freeze)?"""
    return all(freeze(a) is not None or a is None for i, a in enumerate(args) if i not in buffers)


def run_steps(steps, result):
    for step in steps:
        step()
    return result


class Again:
    """A front-end's remembered call of collective `name` (wrap() checks that its own
    arguments are the very same as then), run with no second matching: the Repeat the
    runner made of it runs again while it is still the last call of `name` and nothing is
    pending. Otherwise call(), the full call (a call in between replaced that Repeat, or
    non-blocking calls are queued ahead), whose Repeat is then held instead."""

    __slots__ = ("runner", "name", "call", "r")

    def __init__(self, runner, name, call):
        self.runner, self.name, self.call = runner, name, call
        self.r = runner._repeats.get(name)

    def __call__(self):
        runner, r = self.runner, self.r
        if r is not None and runner._repeats.get(self.name) is r and runner._tail is None:
            return runner.repeat(r)
        result = self.call()
        self.r = runner._repeats.get(self.name)
        return result


class Request:
    """A non-blocking collective (iallreduce, ibroadcast, ...) or message (isend, irecv) in
    flight: wait() returns its result, test() polls.

    Once a collective has finished, `seconds` is how long it ran on the background thread (not
    counting its wait in the queue): the communication time that overlap can hide.
    """

    def __init__(self, future=None):
        self._future = future
        self.seconds = None

    def wait(self):
        """Block until the collective has finished and return its result (or raise its error)."""
        return self._future.result()

    def test(self):
        """True once the collective has finished; never blocks."""
        return self._future.done()

    def add_done_callback(self, fn):
        """Call fn(request) once the collective has finished (or failed): on the background
        thread as it finishes, or here at once if it already has. For front-ends that chain
        their own completion on it (ringcoll.torch's futures); fn must not block."""
        self._future.add_done_callback(lambda _: fn(self))


class Runner:
    """Runs one communicator's plans (see the module doc); g is its Group."""

    def __init__(self, g):
        self.g = g
        self._progress = g.progress  # (read on the replay's hot path: one lookup, not two)
        self._executor = None  # the thread that runs non-blocking collectives, once needed
        self._tail = None  # the last non-blocking collective submitted, while it may be pending
        self._replay = NO_REPLAY  # the last replayable call (an allreduce with out=)
        self._parked = NO_REPLAY  # ... set aside while non-blocking calls may be pending
        self._repeats = {}  # collective name -> the Repeat of its last repeatable call
        self._printed = BoundedCache()  # debug mode: the calls whose algorithm rank 0 printed

    # -- checking -------------------------------------------------------------------------
    def plan(self, collective, *args, call=None):
        """collective.plan(g, ctx, *args): the checked call's Plan. `collective` is the
        collective's module (ringcoll.collectives.*); `call` names the method in error
        messages where it differs (iallreduce)."""
        g = self.g
        name = collective.NAME
        g.check_open(name)
        try:
            return collective.plan(g, where(g.rank, call or name), *args)
        except InvalidArgumentError as exc:
            self.invalid(exc, name)
            raise

    def invalid(self, exc, collective):
        """This rank's arguments are invalid (exc is about to be raised). In debug mode the
        other ranks are told first, so they raise PeerFailedError instead of waiting."""
        exc.ringcoll_told = True  # (a front-end's refuse() must not tell them twice)
        if self.g.options.debug and not self.g.closed:
            self.run(Plan(collective, None, {"error": f"{type(exc).__name__}: {exc}"},
                          lambda: None))

    # -- running --------------------------------------------------------------------------
    def call(self, collective, *args):
        """A blocking collective: the last call of it again (repeat), else plan and run.
        collective.BUFFERS names the positions of args that are arrays (see Repeat)."""
        r = self._repeats.get(collective.NAME)
        if r is not None and self._tail is None and r.matches(args):
            return self.repeat(r)
        plan = self.plan(collective, *args)
        if plan.repeatable and plan.fields is None and freeze_all(args, collective.BUFFERS):
            self._repeats[collective.NAME] = Repeat(args, collective.BUFFERS, plan)
        else:
            self._repeats.pop(collective.NAME, None)
        return self.run(plan)

    def repeat(self, r):
        """Run Repeat r again: the last call of its collective, whose arguments were found
        the same, with nothing pending (see call and again). The progress record is inlined:
        this is the small-message hot path."""
        progress = self._progress
        progress.seq += 1  # progress.begin
        progress.current, progress.step, progress.at = r.current, 0, None
        try:
            result = r.run()  # (a bound MPI call returns None: r.result is the result)
        except BaseException as exc:
            if not getattr(exc, "ringcoll_agreed", False):
                self.g.t.fail(exc)  # MPI: print it and abort the job (it needs current)
            progress.current = None  # every rank raised it alike: this call is over
            raise
        progress.current = None  # progress.end()
        return result if r.result is RETURNED else r.result

    def again(self, name, call):
        """For a front-end that remembers its own arguments (wrap()): see Again."""
        return Again(self, name, call)

    def run(self, plan):
        """Run plan (see execute), after any pending non-blocking calls; return its result.
        A plan with a Replay becomes the one replay() runs again (never in debug mode, where
        every call goes through execute and its agreement). While non-blocking calls may be
        pending there is no replay (it would overtake them): it waits in _parked."""
        replay = plan.replay if plan.fields is None else None
        job = partial(self.execute, plan)
        if self._tail is not None:
            if not self._tail.done():
                if replay is not None:
                    self._parked = replay
                self._tail = self._executor.submit(job)  # keep call order: run after them
                return self._tail.result()
            self._tail = None  # nothing pending: the replay fast path may run again
            self._replay, self._parked = self._parked, NO_REPLAY
        if replay is not None:
            self._replay = replay
        return job()

    def execute(self, plan):
        """plan.run() between progress.begin and .end, after debug mode's agreement. An error
        every rank raises alike (a failed check) simply propagates. Any other error means this
        rank stopped part-way while its peers may wait for it forever: the transport's fail()
        handles it (MPI: abort the job)."""
        g = self.g
        progress = g.progress
        progress.begin(plan.collective, plan.algorithm, plan.schedule)
        try:
            if g.options.debug:
                self.agree(plan.collective, plan.algorithm, plan.fields)
            result = plan.run()
            if plan.result is not RETURNED:
                result = plan.result
        except BaseException as exc:
            if not getattr(exc, "ringcoll_agreed", False):
                g.t.fail(exc)
            raise
        finally:
            progress.end()
        return result

    def replay(self, x, out, op, algorithm):
        """Run the last replayable call again if this is the very same call (same x, out, op
        and algorithm objects, x's dtype and both shapes unchanged) and return its result;
        None if it is not (then the caller builds a plan). Nothing is pending when there is a
        replay (run and submit park it meanwhile), so it cannot overtake a queued call."""
        r = self._replay
        if (r.x is not x or r.out is not out or r.op is not op or r.algorithm is not algorithm
                or r.dtype is not x.dtype or r.shapes != (x.shape, out.shape)):
            return None
        progress = self._progress
        progress.seq += 1  # progress.begin, inlined: this is the small-message hot path
        progress.current, progress.at = r.current, None
        try:
            for step in r.steps:
                step()
        except BaseException as exc:
            self.g.t.fail(exc)  # MPI: print it and abort the job; threads: stop the others
            raise
        progress.current = None  # progress.end(), inlined; fail() needs it still set
        return out

    def forget(self):
        """Drop the replays (their steps are bound to a transport that is going away)."""
        self._replay = self._parked = NO_REPLAY
        self._repeats.clear()

    def agree(self, collective, algorithm, fields):
        g = self.g
        record = checks.fingerprint(g.progress.seq, collective,
                                    {"algorithm": algorithm, **(fields or {})})
        checks.compare(g.t, checks.exchange_fingerprints(g.t, record))
        if g.rank == 0 and algorithm is not None:  # each distinct call once, not per call
            key = (collective, algorithm, repr(fields))
            if key not in self._printed:
                self._printed[key] = True
                call = ", ".join(f"{k}={v}" for k, v in (fields or {}).items())
                print(f"ringcoll: {collective} #{g.progress.seq} ({call}) on {g.size} "
                      f"ranks -> {algorithm}", file=sys.stderr, flush=True)

    # -- non-blocking ---------------------------------------------------------------------
    def submit(self, plan):
        """Queue plan on the background thread (after everything submitted before it) and
        return its Request."""
        if self._executor is None:
            if not getattr(self.g.t, "thread_multiple", True):
                raise RingcollError(
                    f"{where(self.g.rank, 'i' + plan.collective)}non-blocking collectives run "
                    "on a background thread and need MPI_THREAD_MULTIPLE; initialise MPI with "
                    f"it (mpi4py's default) or use the blocking {plan.collective}")
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="ringcoll-progress")
        request = Request()
        job = partial(self.execute, plan)
        if self._tail is None:  # from now on something may be pending: no replay until run()
            self._parked, self._replay = self._replay, NO_REPLAY  # finds the queue drained

        def timed():
            start = time.perf_counter()
            try:
                return job()
            finally:
                request.seconds = time.perf_counter() - start

        self._tail = request._future = self._executor.submit(timed)
        return request

    def wait_all(self):
        """Wait for every outstanding non-blocking call."""
        if self._tail is not None:
            self._tail.result()

    def shutdown(self, wait=True):
        """Stop the background thread (after its queue, if wait) and forget the replay."""
        if self._executor is not None:
            self._executor.shutdown(wait=wait)
            self._executor = None
        self._replay = self._parked = NO_REPLAY
        self._repeats.clear()
