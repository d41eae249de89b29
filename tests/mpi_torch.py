"""Torch tier worker: mpiexec -n P python tests/mpi_torch.py [--groups a,b] [--report FILE]

Checks ringcoll's torch.distributed backend ("ringcoll", registered by `import ringcoll.torch`)
under real MPI. The default process group is initialised on "ringcoll" with no environment
variables (rank and size come from MPI, MASTER_ADDR/PORT from ringcoll.torch); in the same job a
gloo group over all ranks (dist.new_group(backend="gloo")) is a second oracle where it is simpler.
The main oracle is NumPy on the inputs, gathered with mpi4py (MPI.COMM_WORLD.allgather of NumPy
copies), so nothing that checks a result goes through ringcoll. Every result is also checked to be
bitwise identical on all ranks (mpi4py allgather of a digest).

Exact data (tests/_oracle.py): integer inputs over their whole range (sums wrap, as NumPy's do),
floats that are small integers (sums exact in any order, even in float16/bfloat16), products of
+-1 and +-0.5; so integer and float results are compared for equality, except AVG (2 ulp, halves
4 p eps: ringcoll may divide before it sums) and the random-float group (a stated bound).

Options: --groups a,b (run some groups; default: every group of GROUPS, not ERROR_GROUPS),
--report FILE (rank 0 writes {group: {"checks": n, "failures": [...], "seconds": s, "notes": [...]}}
as JSON, after every group, so a later hang keeps the earlier results), --light (fewer cases,
each size, root, mode and form still covered for every dtype: for P=3, 4 on 2 cores),
--device cuda (every tensor the checks make on this rank's GPU: the backend's CUDA path under
scripts/gpu_check.sh, DDP also over gloo on the same tensors), --fake-device (every CPU tensor of the ringcoll groups takes the backend's GPU path, on
tests/_fake_torch_cuda.py's fake device arrays: the same checks, through that path's code),
--backend gloo (develop the suite against gloo: the same torch.distributed API; the cases gloo
cannot do are skipped and counted on stdout), --sync-timeout S (a rank that finishes a group waits
at most S seconds for the others, then the job aborts: a hang becomes a failure), --stall-timeout S
(a watchdog thread: no check and no new call for S seconds, as when every rank is stuck in the
same collective, prints the call and aborts the job, after rank 0 wrote what it has).

ERROR_GROUPS ("errors": mismatched shapes and dtypes across ranks) run in their own launch, with
RINGCOLL_DEBUG=1 (tests/test_torch.py sets it), since only debug mode compares calls across ranks.

Exit status: 0 only if every check passed on every rank.
"""

import argparse
import hashlib
import json
import os
import socket
import sys
import threading
import time
import traceback
import warnings

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _oracle as O  # noqa: E402

WORLD = MPI.COMM_WORLD
RANK, P = WORLD.Get_rank(), WORLD.Get_size()

GROUPS = ["init", "all_reduce", "all_reduce_floats", "all_reduce_complex", "coalesced",
          "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
          "all_to_all", "gather_scatter", "barrier", "p2p", "objects", "noncontig", "unsupported",
          "subgroups", "device_mesh", "functional", "ddp", "avg_integers", "sparse"]
ERROR_GROUPS = ["errors"]

warnings.filterwarnings("ignore")  # deprecations of torch's own functions (funcol, coalesced)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

R = dist.ReduceOp
NP = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
      torch.float16: np.dtype(np.float16), torch.bfloat16: O.BFLOAT16,
      torch.int8: np.dtype(np.int8), torch.int16: np.dtype(np.int16),
      torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64),
      torch.uint8: np.dtype(np.uint8), torch.bool: np.dtype(bool),
      torch.complex64: np.dtype(np.complex64), torch.complex128: np.dtype(np.complex128)}
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
COMPLEX = [torch.complex64, torch.complex128]
REAL = FLOATS + INTS + [torch.bool]
EVERY = REAL + COMPLEX
BITWISE = ["BAND", "BOR", "BXOR"]
ONAME = {"SUM": "sum", "AVG": "avg", "PRODUCT": "prod", "MIN": "min", "MAX": "max"}
MODES = ["sync", "wait", "future"]


def ops_for(dt):
    """Every ReduceOp torch's dist.all_reduce accepts for dt on CPU."""
    if dt in FLOATS:
        return ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]
    if dt in INTS or dt == torch.bool:
        return ["SUM", "PRODUCT", "MIN", "MAX"] + BITWISE
    return ["SUM", "AVG"]  # complex: torch itself refuses PRODUCT/MIN/MAX/bitwise


class Checker:
    def __init__(self):
        self.group = None
        self.checks = {}
        self.failures = {}
        self.skipped = {}
        self.notes = {}

    def note(self, msg):
        """A measured number worth seeing when the checks pass (rank 0's go to the report)."""
        self.notes.setdefault(self.group, []).append(msg)

    def start(self, group):
        self.group = group
        self.checks.setdefault(group, 0)
        self.failures.setdefault(group, [])

    def check(self, ok, msg):
        progress()
        self.checks[self.group] += 1
        if not ok:
            self.failures[self.group].append(f"rank {RANK}/{P} [{self.group}] {msg}")
        return bool(ok)

    def skip(self, why):
        """A case the backend under --backend gloo cannot do (never used on ringcoll)."""
        self.skipped[why] = self.skipped.get(why, 0) + 1

    def attempt(self, label, fn):
        progress(label)
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - recorded as a failure
            self.check(False, f"{label}: raised {type(exc).__name__}: {short(exc)}")
            return None

    def result(self, label, got, expected, op="SUM"):
        """got (a tensor) against the NumPy expected: exact, AVG within O.compare's ulps."""
        if got is None:
            return self.check(False, f"{label}: no result")
        g = to_np(got)
        e = np.asarray(expected)
        if g.dtype == bool or e.dtype == bool:  # equal, and every byte 0 or 1 (torch's bools)
            ok = (g.dtype == e.dtype and g.shape == e.shape and np.array_equal(g, e)
                  and (int(g.view(np.uint8).max(initial=0)) <= 1 or backend_lacks("bool bytes")))
            bad = None if ok else (f"got {g.dtype}{g.shape} {summary(g)} (bytes "
                                   f"{summary(g.view(np.uint8))}), expected {e.dtype}{e.shape} "
                                   f"{summary(e)}")
        else:
            bad = O.compare(g, e, "avg" if op == "AVG" else "sum", e.dtype, nranks=P)
        return self.check(bad is None, f"{label}: {bad}")

    def identical(self, label, t):
        """Bitwise identity of t (tensor or array) across all ranks."""
        y = to_np(t) if isinstance(t, torch.Tensor) else np.asarray(t)
        digest = (y.dtype.str, y.shape, hashlib.sha1(y.tobytes()).hexdigest())
        every = WORLD.allgather(digest)
        bad = [r for r, d in enumerate(every) if d != every[0]]
        return self.check(not bad, f"{label}: ranks {bad} differ bitwise from rank 0")


CK = Checker()
ARGS = None
LAST = {"t": time.time(), "label": "start"}


def progress(label=None):
    """The watchdog's heartbeat: a check, or the start of a call (its label)."""
    LAST["t"] = time.time()
    if label is not None:
        LAST["label"] = label


def watchdog(limit):
    """No check and no call for `limit` s (every rank stuck in one collective, where the
    end-of-group sync cannot help): print the call, write what rank 0 has, abort the job."""
    while True:
        time.sleep(0.5)
        idle = time.time() - LAST["t"]
        if idle > limit:
            msg = (f"[{CK.group}] no progress for {idle:.0f} s: stuck in {LAST['label']} "
                   "(a hang)")
            print(f"rank {RANK}/{P}: {msg}; aborting", file=sys.stderr, flush=True)
            if RANK == 0 and CK.group is not None:
                REPORT[CK.group] = {"checks": CK.checks.get(CK.group, 0), "seconds": None,
                                    "failures": CK.failures.get(CK.group, []) + [
                                        f"rank {RANK}/{P} {msg}"]}
                write_report()
            if RANK != 0:
                time.sleep(3)  # rank 0 writes the report first
            WORLD.Abort(1)


def short(exc, n=300):
    s = str(exc).strip().replace("\n", " | ")
    return s if len(s) <= n else s[:n] + "..."


def summary(a, n=6):
    flat = np.asarray(a).reshape(-1)
    return f"[{', '.join(repr(v) for v in flat[:n].tolist())}{', ...' if flat.size > n else ''}]"


# ---------------------------------------------------------------------------------------------
# tensors <-> NumPy, inputs and oracles
# ---------------------------------------------------------------------------------------------
def to_np(t):
    """A NumPy copy of tensor t (bfloat16 as ml_dtypes.bfloat16), whatever its strides and
    device."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().copy().view(O.BFLOAT16)
    return t.numpy().copy()


def from_np(a):
    a = np.ascontiguousarray(a)
    if a.dtype == O.BFLOAT16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(DEVICE)
    return torch.from_numpy(a.copy()).to(DEVICE)


def make(seed, rank, shape, dt, op="SUM"):
    """Rank `rank`'s input (a tensor) of case `seed`: exact to reduce with op in any order."""
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    nd = NP[dt]
    if dt == torch.bool:
        rng = O.rng_for(seed, rank)
        return torch.from_numpy(rng.random(shape) < 0.7).to(DEVICE)
    return from_np(O.make_input(seed, rank, shape, nd, ONAME.get(op, "sum")))


def gathered(t):
    """Every rank's copy of tensor t, in rank order, through mpi4py (not the backend)."""
    return WORLD.allgather(to_np(t))


def reduce_np(inputs, op, dt):
    """The exact reduction of the per-rank NumPy inputs with a torch ReduceOp name."""
    stack = np.stack(inputs) if inputs else None
    if dt == torch.bool:
        if op in ("SUM", "MAX", "BOR"):
            return np.logical_or.reduce(stack, axis=0)
        if op in ("PRODUCT", "MIN", "BAND"):
            return np.logical_and.reduce(stack, axis=0)
        if op == "BXOR":
            return np.logical_xor.reduce(stack, axis=0)
    if op in BITWISE:
        fn = {"BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[op]
        return fn.reduce(stack, axis=0)
    return O.reduce_oracle(list(inputs), ONAME[op], NP[dt])


def some(seq, k, count):
    """All of seq; with --light, `count` of them from index k on (k varies between the calls,
    so that every item still comes up across the cases of a group)."""
    seq = list(seq)
    if not ARGS.light or count >= len(seq):
        return seq
    return [seq[(k + i) % len(seq)] for i in range(count)]


def sizes(light=False):
    s = {0, 1, max(P - 1, 0), P + 1, 3001}
    return sorted(s)


# gloo's gaps, for --backend gloo only (and for the gloo oracle: it is used where it can be)
def gloo_can_reduce(dt, op):
    return dt != torch.int16 and dt not in COMPLEX and not (op == "AVG" and dt not in FLOATS)


#: what torch 2.13's gloo cannot do (seen with --backend gloo; "strided": it reduces a [::2]
#: view as if it were the first n contiguous elements; "bool bytes": its bool SUM leaves bytes
#: of 2, 3..., not torch's 0/1)
GLOO_LACKS = {"all_gather uneven", "int16", "complex gather/scatter", "all_to_all list uneven",
              "stacked", "reduce_scatter async", "strided", "complex direct", "raise at the call",
              "bool bytes", "premul", "all_to_all_single non-contiguous", "int avg"}


def backend_lacks(what):
    """True (and counted) when running --backend gloo and gloo cannot do `what`; never on
    ringcoll."""
    if ARGS.backend == "gloo" and what in GLOO_LACKS:
        CK.skip(what)
        return True
    return False


def dtypes(lst):
    return [dt for dt in lst if not (dt == torch.int16 and backend_lacks("int16"))]


# ---------------------------------------------------------------------------------------------
# running one call in each mode
# ---------------------------------------------------------------------------------------------
def run(label, mode, fn):
    """fn(async_op) -> Work or None. sync: returns None; wait: work.wait(); future:
    work.get_future().wait(). Returns (ok, future value or None); an exception is a failure."""
    progress(f"{label} [{mode}]")
    try:
        if mode == "sync":
            w = fn(False)
            CK.check(w is None, f"{label} [sync]: returned {w!r}, not None")
            return True, None
        w = fn(True)
        if not CK.check(w is not None, f"{label} [{mode}]: async_op=True returned None"):
            return False, None
        value = None
        if mode == "wait":
            done = w.wait()
            CK.check(done is True or done is None, f"{label} [wait]: wait() returned {done!r}")
            CK.check(w.is_completed(), f"{label} [wait]: is_completed() False after wait()")
        else:
            fut = w.get_future()
            value = fut.wait()
            CK.check(fut.done(), f"{label} [future]: future not done() after its wait()")
        return True, value
    except Exception as exc:  # noqa: BLE001
        CK.check(False, f"{label} [{mode}]: raised {type(exc).__name__}: {short(exc)}")
        return False, None


def future_tensor(label, value, t):
    """A collective's future holds its output tensors: value[0] has t's values."""
    ok = isinstance(value, (list, tuple)) and len(value) >= 1 and isinstance(value[0], torch.Tensor)
    if CK.check(ok, f"{label} [future]: future value {type(value).__name__} is not a list of "
                    "tensors"):
        # bytes, not shapes: torch hands a complex tensor to the backend as its real view
        CK.check(to_np(value[0]).tobytes() == to_np(t).tobytes(),
                 f"{label} [future]: future value differs from the output tensor")


# ---------------------------------------------------------------------------------------------
# groups of checks
# ---------------------------------------------------------------------------------------------
def check_init(env_before):
    CK.check(dist.is_initialized(), "default group not initialised")
    CK.check(dist.get_backend() == ARGS.backend,
             f"dist.get_backend() is {dist.get_backend()!r}, expected {ARGS.backend!r}")
    CK.check((dist.get_rank(), dist.get_world_size()) == (RANK, P),
             f"rank/size {(dist.get_rank(), dist.get_world_size())}, MPI says {(RANK, P)}")
    pg = dist.distributed_c10d._get_default_group()
    CK.check(isinstance(pg, dist.ProcessGroup), f"default group is a {type(pg)}")
    CK.check((pg.rank(), pg.size()) == (RANK, P), f"pg rank/size {(pg.rank(), pg.size())}")
    if ARGS.backend == "ringcoll":
        CK.check(not env_before, f"the launch had torch env vars set: {env_before}")
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            CK.check(bool(os.environ.get(var)), f"{var} not set by `import ringcoll.torch`")
        ports = WORLD.allgather(os.environ.get("MASTER_PORT"))
        CK.check(len(set(ports)) == 1, f"MASTER_PORT differs across ranks: {ports}")
    CK.check(dist.get_backend(GLOO) == "gloo", f"oracle group backend {dist.get_backend(GLOO)}")
    t = torch.tensor([RANK + 1], dtype=torch.int64)
    dist.all_reduce(t, group=GLOO)
    CK.check(t.item() == P * (P + 1) // 2, f"gloo oracle group all_reduce gave {t.item()}")


def check_all_reduce():
    all_reduce_extras()
    slot = 0
    every_size = sizes(ARGS.light)
    k = 0
    for dt in dtypes(REAL):
        for op in ops_for(dt):  # 3 (light: 2) sizes per op, every size for each dtype
            k += 1
            picks = 2 if ARGS.light else 3
            for n in [every_size[(k + 2 * i) % len(every_size)] for i in range(picks)]:
                slot += 1
                mode = MODES[slot % 3]
                seed = 1000 + slot
                shape = (n,) if slot % 4 else (n, 2) if n < 100 else (n // 3, 3)
                t = make(seed, RANK, shape, dt, op)
                inputs = gathered(t)
                keep = t.clone()
                label = f"all_reduce {dt} {op} shape={tuple(shape)}"
                ok, value = run(label, mode, lambda a: dist.all_reduce(t, op=getattr(R, op),
                                                                        async_op=a))
                expected = reduce_np(inputs, op, dt)
                CK.result(label + f" [{mode}] vs NumPy", t, expected, op)
                CK.identical(label, t)
                if ok and mode == "future":
                    future_tensor(label, value, t)
                if gloo_can_reduce(dt, op) and (n == P + 1 or not ARGS.light):
                    ref = keep.clone()
                    dist.all_reduce(ref, op=getattr(R, op), group=GLOO)
                    if dt == torch.bool:  # gloo's bool SUM leaves bytes of 2: as truth values
                        CK.check(torch.equal(ref.view(torch.uint8) != 0, t.view(torch.uint8) != 0),
                                 f"{label}: differs from gloo's result {summary(to_np(ref))}, "
                                 f"got {summary(to_np(t))}")
                    elif op == "AVG":  # both within O.compare's ulps of the exact mean
                        CK.result(label + " vs gloo", t, to_np(ref), op)
                    else:
                        CK.check(ref.shape == t.shape
                                 and to_np(ref).tobytes() == to_np(t).tobytes(),
                                 f"{label}: differs from gloo's result {summary(to_np(ref))}, "
                                 f"got {summary(to_np(t))}")


def all_reduce_extras():
    """0-d tensors, one large tensor, many collectives in flight at once (waited in reverse
    order), PREMUL_SUM (torch's scaled sum: factor 0.5, exact on these inputs)."""
    for dt, op in ((torch.float64, "MAX"), (torch.int32, "SUM"), (torch.bool, "MIN")):
        t = make(1900, RANK, (), dt, op) if dt != torch.bool else torch.tensor(RANK % 2 == 0)
        inputs = gathered(t)
        CK.attempt(f"all_reduce 0-d {dt}", lambda: dist.all_reduce(t, op=getattr(R, op)))
        CK.result(f"all_reduce 0-d {dt} {op}", t, reduce_np(inputs, op, dt), op)
    n = (1 << 18) if ARGS.light else (1 << 20)
    t = make(1901, RANK, (n,), torch.float32)
    inputs = gathered(t)
    CK.attempt(f"all_reduce float32 n={n}", lambda: dist.all_reduce(t, async_op=True).wait())
    CK.result(f"all_reduce float32 n={n} SUM", t, reduce_np(inputs, "SUM", torch.float32))
    CK.identical(f"all_reduce float32 n={n}", t)
    # in flight together: all_reduces of several dtypes and sizes, and broadcasts
    cases = [(torch.float32, 1001, "SUM"), (torch.int64, 3, "MAX"), (torch.bfloat16, 17, "SUM"),
             (torch.uint8, P + 1, "BXOR"), (torch.float64, 5000, "MIN"), (torch.int8, 1, "SUM")]
    ts = [make(1910 + i, RANK, (m,), dt, op) for i, (dt, m, op) in enumerate(cases)]
    bs = [make(1930 + i, RANK, (i + 2,), torch.float32) for i in range(P)]
    ins = [gathered(t) for t in ts]
    bins = [gathered(b) for b in bs]

    def many():
        works = []
        for i, (t, (dt, m, op)) in enumerate(zip(ts, cases)):
            works.append(dist.all_reduce(t, op=getattr(R, op), async_op=True))
            if i < P:
                works.append(dist.broadcast(bs[i], src=i, async_op=True))
        for w in reversed(works):
            w.wait()
    CK.attempt("all_reduce/broadcast, many in flight", many)
    for i, (t, (dt, m, op)) in enumerate(zip(ts, cases)):
        CK.result(f"in flight: all_reduce {dt} n={m} {op}", t, reduce_np(ins[i], op, dt), op)
    for i, b in enumerate(bs[:len(cases)]):
        CK.result(f"in flight: broadcast src={i}", b, bins[i][i])
    if backend_lacks("premul"):
        return
    for dt in (torch.float32, torch.float64, torch.bfloat16):
        for mode in MODES:
            t = make(1950, RANK, (P + 3,), dt)
            inputs = gathered(t)
            label = f"all_reduce PREMUL_SUM(0.5) {dt}"
            run(label, mode, lambda a: dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5),
                                                       async_op=a))
            CK.result(f"{label} [{mode}]", t, (reduce_np(inputs, "SUM", dt).astype(np.float64)
                                               * 0.5).astype(NP[dt]))
        x = make(1960, RANK, (2 * P,), dt)
        every = gathered(x)
        out = torch.zeros(2, dtype=dt)
        label = f"reduce_scatter_tensor PREMUL_SUM(0.5) {dt}"
        CK.attempt(label, lambda: dist.reduce_scatter_tensor(out, x,
                                                             op=dist._make_nccl_premul_sum(0.5)))
        want = reduce_np(every, "SUM", dt).astype(np.float64)[2 * RANK:2 * RANK + 2] * 0.5
        CK.result(label, out, want.astype(NP[dt]))
        CK.check(to_np(x).tobytes() == every[RANK].tobytes(), f"{label}: input modified")


def check_all_reduce_floats():
    """Random floats of varied magnitudes: |got - exact| <= 2 p eps sum|x_i| + eps |exact|
    (any summation order, then the rounding to dtype; AVG the same over p), computed in
    float64 from the inputs; and bitwise identical on every rank."""
    n = 2000 if ARGS.light else 5003
    slot = 0
    for dt in FLOATS:
        for op in ("SUM", "AVG"):
            slot += 1
            x = O.random_floats(2000 + slot, RANK, (n,), NP[dt])
            t = from_np(x)
            inputs = WORLD.allgather(x)
            mode = MODES[slot % 3]
            label = f"all_reduce random {dt} {op} n={n}"
            run(label, mode, lambda a: dist.all_reduce(t, op=getattr(R, op), async_op=a))
            w = np.stack([np.asarray(a, np.float32).astype(np.float64) if a.dtype == O.BFLOAT16
                          else a.astype(np.float64) for a in inputs])
            exact = w.sum(axis=0)
            mag = np.abs(w).sum(axis=0)
            eps = O._eps(NP[dt])
            tol = 2 * P * eps * mag + eps * np.abs(exact) + 1e-300
            if op == "AVG":
                exact, tol = exact / P, tol / P
            got = to_np(t)
            g = got.astype(np.float32).astype(np.float64) if dt == torch.bfloat16 \
                else got.astype(np.float64)
            err = np.abs(g - exact)
            worst = float((err / tol).max()) if n else 0.0
            CK.check(got.dtype == NP[dt] and got.shape == (n,) and bool(np.all(err <= tol)),
                     f"{label} [{mode}]: error up to {worst:.3g} x the bound 2 p eps sum|x| + "
                     f"eps|sum| (max abs error {float(err.max()):.3g})")
            CK.identical(label, t)


def check_avg_integers():
    """ReduceOp.AVG on integer tensors, as NCCL computes it (ncclAvg): the sum in the dtype,
    wrapping as it does, then divided by P truncated toward zero; by all_reduce, reduce (dst's
    tensor), reduce_scatter_tensor and reduce_scatter, contiguous and not. Values span the
    dtype's range (int8/uint8 sums wrap at P >= 2), negatives included."""
    slot = 0
    for dt in dtypes(INTS):
        if backend_lacks("int avg"):
            continue
        nd = NP[dt]
        info = np.iinfo(nd)
        for form in ("all_reduce", "all_reduce strided", "reduce", "reduce_scatter_tensor",
                     "reduce_scatter"):
            slot += 1
            n = 3 * P + 1
            rng = np.random.default_rng(7000 + slot * 31 + RANK)
            # (no int64 minimum: the expected value's truncation negates the sum)
            low, high = max(int(info.min) + 1, -10 ** 6), min(int(info.max), 10 ** 6)
            x = rng.integers(low, high, size=P * n, endpoint=True).astype(nd)
            every = WORLD.allgather(x)
            label = f"{form} AVG {dt} n={n}"
            mode = MODES[slot % 3]
            if form == "all_reduce strided":
                base = from_np(np.repeat(x, 2))
                t = base[::2]
                run(label, mode, lambda a: dist.all_reduce(t, op=R.AVG, async_op=a))
                CK.check(to_np(base[1::2]).tobytes() == x.tobytes(), f"{label}: gaps written")
                got, want = t, int_avg(every, P)
            elif form == "all_reduce":
                t = from_np(x)
                run(label, mode, lambda a: dist.all_reduce(t, op=R.AVG, async_op=a))
                got, want = t, int_avg(every, P)
            elif form == "reduce":
                root = slot % P
                t = from_np(x)
                run(label, mode, lambda a: dist.reduce(t, dst=root, op=R.AVG, async_op=a))
                got, want = t, int_avg(every, P) if RANK == root else x
            elif form == "reduce_scatter_tensor":
                t, got = from_np(x), torch.zeros(n, dtype=dt)
                run(label, mode, lambda a: dist.reduce_scatter_tensor(got, t, op=R.AVG,
                                                                      async_op=a))
                want = int_avg(every, P).reshape(P, n)[RANK]
            else:
                ins, got = [from_np(b) for b in x.reshape(P, n)], torch.zeros(n, dtype=dt)
                run(label, "sync", lambda a: dist.reduce_scatter(got, ins, op=R.AVG,
                                                                 async_op=a))
                want = int_avg(every, P).reshape(P, n)[RANK]
            CK.check(to_np(got).tobytes() == np.asarray(want, nd).tobytes(),
                     f"{label} [{mode}]: got {to_np(got)[:6]}, want {np.asarray(want)[:6]}")


def check_sparse():
    """all_reduce (SUM) of sparse COO tensors, as gloo's: the result is the sum of every rank's
    tensor (checked dense against the inputs gathered with mpi4py), still sparse and coalesced,
    in the caller's tensor; ranks with no entries, a dense part per entry; then DDP over an
    nn.Embedding(sparse=True), whose replicas must stay identical."""
    for dense in ((), (3,)):
        for nnz in (0, 1, 4):
            n = nnz if RANK % 2 == 0 else 2
            index = torch.tensor([[(RANK + 2 * k) % 7 for k in range(n)],
                                  [k % 3 for k in range(n)]], dtype=torch.int64).reshape(2, n)
            value = (torch.arange(n * int(np.prod(dense, dtype=np.int64)), dtype=torch.float64)
                     .reshape((n,) + dense) + RANK)
            shape = (7, 3) + dense
            t = torch.sparse_coo_tensor(index, value, shape)
            every = WORLD.allgather((index.numpy(), value.numpy()))
            want = sum(torch.sparse_coo_tensor(torch.from_numpy(i), torch.from_numpy(v),
                                               shape).to_dense() for i, v in every)
            label = f"sparse all_reduce nnz={nnz} dense={dense}"
            CK.attempt(label, lambda: dist.all_reduce(t))
            CK.check(t.layout == torch.sparse_coo and t.is_coalesced()
                     and torch.equal(t.to_dense(), want), f"{label}: got {t}")
    CK.attempt("sparse all_reduce MAX", lambda: CK.check(
        raises(lambda: dist.all_reduce(torch.sparse_coo_tensor([[0]], [1.0], (2,)),
                                       op=R.MAX)), "sparse MAX must be refused (SUM only)"))
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    ddp = CK.attempt("DDP over a sparse Embedding",
                     lambda: torch.nn.parallel.DistributedDataParallel(emb))
    if ddp is not None:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        before = emb.weight.detach().clone()
        CK.attempt("DDP sparse backward", lambda: ddp(torch.tensor([RANK % 10, 5])).sum()
                   .backward())
        opt.step()
        w = WORLD.allgather(emb.weight.detach().numpy())
        CK.check(all(np.array_equal(x, w[0]) for x in w), "DDP sparse: replicas differ")
        # row 5: every rank's gradient of 1 each, averaged: a step of exactly lr
        CK.check(torch.allclose(emb.weight.detach()[5], before[5] - 0.1),
                 f"DDP sparse: row 5 moved by {emb.weight.detach()[5] - before[5]}, not -0.1")


def raises(fn):
    try:
        fn()
    except Exception:  # noqa: BLE001 - any refusal counts
        return True
    return False


def int_avg(inputs, p):
    """NCCL's integer AVG of the arrays inputs: their sum wrapped to the dtype, then each
    element divided by p, truncated toward zero (in Python ints: exact)."""
    total = np.sum(np.stack(inputs), axis=0, dtype=inputs[0].dtype)  # wraps, as NCCL's sum
    return np.array([abs(s) // p * (1 if s >= 0 else -1) for s in total.tolist()],
                    inputs[0].dtype)


def check_all_reduce_complex():
    """Complex tensors: dist.all_reduce (SUM, AVG: torch passes a real view to the backend),
    and the group's own allreduce called directly with the complex tensor, SUM and PRODUCT
    (torch's dist.all_reduce refuses complex PRODUCT before the backend sees it)."""
    pg = dist.distributed_c10d._get_default_group()
    slot = 0
    for dt in COMPLEX:
        for n in sizes(ARGS.light):
            for op in ("SUM", "AVG"):
                slot += 1
                mode = MODES[slot % 3]
                t = make(3000 + slot, RANK, (n,), dt, op)
                inputs = gathered(t)
                label = f"all_reduce {dt} {op} n={n}"
                run(label, mode, lambda a: dist.all_reduce(t, op=getattr(R, op), async_op=a))
                CK.result(label + f" [{mode}]", t, reduce_np(inputs, op, dt), op)
                CK.identical(label, t)
            for op in ("SUM", "PRODUCT"):
                if backend_lacks("complex direct"):
                    continue
                slot += 1
                t = make(3000 + slot, RANK, (n,), dt, op)
                inputs = gathered(t)
                label = f"pg.allreduce([{dt}]) {op} n={n} (direct)"
                opts = dist.AllreduceOptions()
                opts.reduceOp = getattr(R, op)
                CK.attempt(label, lambda: pg.allreduce([t], opts).wait())
                CK.result(label, t, reduce_np(inputs, op, dt), op)
                CK.identical(label, t)


def check_coalesced():
    pg = dist.distributed_c10d._get_default_group()
    lens = [0, 1, 5, P + 1, 1001]
    slot = 0
    for dt in (torch.float32, torch.int64, torch.bfloat16, torch.uint8):
        for op in ("SUM", "MAX") if dt != torch.uint8 else ("BXOR",):
            for how in some(("pg.allreduce_coalesced", "dist.all_reduce_coalesced",
                             "_coalescing_manager sync", "_coalescing_manager async"), slot, 2):
                slot += 1
                ts = [make(4000 + 10 * slot + i, RANK, (m,), dt, op) for i, m in enumerate(lens)]
                inputs = [gathered(t) for t in ts]
                label = f"{how} {dt} {op} lens={lens}"
                if how == "pg.allreduce_coalesced":
                    opts = dist.AllreduceCoalescedOptions()
                    opts.reduceOp = getattr(R, op)
                    CK.attempt(label, lambda: pg.allreduce_coalesced(ts, opts).wait())
                elif how == "dist.all_reduce_coalesced":  # async_op=True returns a Future
                    def call():
                        fut = dist.all_reduce_coalesced(ts, op=getattr(R, op), async_op=slot % 2)
                        if slot % 2:
                            fut.wait()
                            CK.check(fut.done(), f"{label}: future not done() after wait()")
                        else:
                            CK.check(fut is None, f"{label}: sync call returned {fut!r}")
                    CK.attempt(label, call)
                else:
                    def body():
                        with dist._coalescing_manager(async_ops=how.endswith("async")) as cm:
                            for t in ts:
                                dist.all_reduce(t, op=getattr(R, op))
                        if how.endswith("async"):
                            cm.wait()
                    CK.attempt(label, body)
                for i, t in enumerate(ts):
                    CK.result(f"{label} tensor {i}", t, reduce_np(inputs[i], op, dt), op)
                CK.identical(label, torch.cat([t.reshape(-1) for t in ts]))
    # coalesced all_gather_into_tensor and reduce_scatter_tensor (the other two fast paths)
    for dt in (torch.float32, torch.int32):
        ins = [make(4500 + i, RANK, (m,), dt) for i, m in enumerate(lens)]
        outs = [torch.zeros(P * m, dtype=dt) for m in lens]
        every = [gathered(t) for t in ins]

        def ag():
            with dist._coalescing_manager(async_ops=True) as cm:
                for o, i in zip(outs, ins):
                    dist.all_gather_into_tensor(o, i)
            cm.wait()
        CK.attempt(f"_coalescing_manager all_gather_into_tensor {dt}", ag)
        for k, o in enumerate(outs):
            CK.result(f"coalesced all_gather_into_tensor {dt} tensor {k}", o,
                      np.concatenate(every[k]))
        rins = [make(4600 + i, RANK, (P * m,), dt) for i, m in enumerate(lens)]
        routs = [torch.zeros(m, dtype=dt) for m in lens]
        every = [gathered(t) for t in rins]

        def rs():
            with dist._coalescing_manager(async_ops=False):
                for o, i in zip(routs, rins):
                    dist.reduce_scatter_tensor(o, i)
        CK.attempt(f"_coalescing_manager reduce_scatter_tensor {dt}", rs)
        for k, o in enumerate(routs):
            m = lens[k]
            CK.result(f"coalesced reduce_scatter_tensor {dt} tensor {k}", o,
                      reduce_np(every[k], "SUM", dt)[RANK * m:(RANK + 1) * m])


def check_broadcast():
    slot = 0
    for dt in dtypes(EVERY):
        for n in sizes(ARGS.light):
            for root in some(range(P), slot, 1):  # light: one root per size, rotating
                slot += 1
                if (slot + root) % 2 and n > 1 and not ARGS.light:  # half the pairs
                    continue
                mode = MODES[slot % 3]
                t = make(5000 + slot, RANK, (n,), dt)
                inputs = gathered(t)
                label = f"broadcast {dt} n={n} src={root}"
                ok, value = run(label, mode, lambda a: dist.broadcast(t, src=root, async_op=a))
                CK.result(label + f" [{mode}]", t, inputs[root])
                CK.identical(label, t)
                if ok and mode == "future":
                    future_tensor(label, value, t)
    # a 2-d tensor and a 0-d tensor
    for root in range(P):
        t = make(5900 + root, RANK, (3, 4), torch.float64)
        inputs = gathered(t)
        CK.attempt("broadcast (3, 4)", lambda: dist.broadcast(t, src=root))
        CK.result(f"broadcast (3, 4) float64 src={root}", t, inputs[root])
        t = torch.tensor(float(RANK + 10))
        CK.attempt("broadcast 0-d", lambda: dist.broadcast(t, src=root))
        CK.check(t.shape == () and t.item() == root + 10, f"broadcast 0-d src={root}: {t}")


def check_reduce():
    slot = k = 0
    for dt in dtypes(REAL):
        for op in ops_for(dt):  # light: one root per op, every root for each dtype (5+ ops)
            k += 1
            for root in some(range(P), k, 1):
                slot += 1
                n = sizes(ARGS.light)[slot % len(sizes(ARGS.light))]
                mode = MODES[slot % 3]
                t = make(6000 + slot, RANK, (n,), dt, op)
                inputs = gathered(t)
                label = f"reduce {dt} {op} n={n} dst={root}"
                ok, _ = run(label, mode, lambda a: dist.reduce(t, dst=root, op=getattr(R, op),
                                                               async_op=a))
                if RANK == root:  # only dst's tensor is defined afterwards
                    CK.result(label + f" [{mode}]", t, reduce_np(inputs, op, dt), op)


def check_all_gather():
    slot = 0
    for i, dt in enumerate(dtypes(EVERY)):
        for n in some(sizes(ARGS.light), 2 * i, 3):
            slot += 1
            mode = MODES[slot % 3]
            t = make(7000 + slot, RANK, (n, 2) if slot % 3 == 0 else (n,), dt)
            inputs = gathered(t)
            outs = [torch.full_like(t, 1) for _ in range(P)]
            label = f"all_gather {dt} shape={tuple(t.shape)}"
            run(label, mode, lambda a: dist.all_gather(outs, t, async_op=a))
            for j in range(P):
                CK.result(f"{label} [{mode}] from rank {j}", outs[j], inputs[j])
            CK.identical(label, torch.cat([o.reshape(-1) for o in outs]))
            CK.check(to_np(t).tobytes() == inputs[RANK].tobytes(), f"{label}: input modified")
    # uneven sizes: rank j contributes j + 1 rows
    if not backend_lacks("all_gather uneven"):
        for dt in (torch.float32, torch.int64, torch.bool):
            t = make(7900, RANK, (RANK + 1, 3), dt)
            inputs = gathered(t)
            outs = [torch.zeros((j + 1, 3), dtype=dt) for j in range(P)]
            label = f"all_gather uneven {dt} rows=rank+1"
            CK.attempt(label, lambda: dist.all_gather(outs, t))
            for j in range(P):
                CK.result(f"{label} from rank {j}", outs[j], inputs[j])


def check_all_gather_into_tensor():
    slot = 0
    for i, dt in enumerate(dtypes(EVERY)):
        for n in some(sizes(ARGS.light), 2 * i, 3):
            slot += 1
            mode = MODES[slot % 3]
            stack = slot % 2 == 0 and not backend_lacks("stacked")
            t = make(8000 + slot, RANK, (n, 3), dt)
            inputs = gathered(t)
            out = torch.zeros((P, n, 3) if stack else (P * n, 3), dtype=dt)
            label = f"all_gather_into_tensor {dt} in=({n}, 3) out={tuple(out.shape)}"
            run(label, mode, lambda a: dist.all_gather_into_tensor(out, t, async_op=a))
            want = np.stack(inputs) if stack else np.concatenate(inputs)
            CK.result(label + f" [{mode}]", out, want)
            CK.identical(label, out)  # (its future's value is not defined: gloo's is chunks)


def check_reduce_scatter():
    slot = 0
    light = ARGS.light
    for dt in dtypes(REAL):
        for op in ops_for(dt):
            slot += 1
            for form in some(("list", "tensor", "tensor stacked"), slot, 1):
                if form.endswith("stacked") and backend_lacks("stacked"):
                    continue
                n = sizes(light)[(slot + len(form)) % len(sizes(light))]
                mode = MODES[(slot + len(form)) % 3]
                if mode != "sync" and backend_lacks("reduce_scatter async"):
                    mode = "sync"  # gloo: no get_future, is_completed() False after wait()
                label = f"reduce_scatter ({form}) {dt} {op} block={n}"
                if form == "list":
                    ins = [make(9000 + slot, RANK * P + j, (n,), dt, op) for j in range(P)]
                    every = WORLD.allgather([to_np(x) for x in ins])
                    out = torch.zeros(n, dtype=dt)
                    run(label, mode, lambda a: dist.reduce_scatter(out, ins, op=getattr(R, op),
                                                                   async_op=a))
                    want = reduce_np([every[r][RANK] for r in range(P)], op, dt)
                    CK.check(all(to_np(x).tobytes() == every[RANK][j].tobytes()
                                 for j, x in enumerate(ins)), f"{label} [{mode}]: input modified")
                else:
                    shape = (P, n) if form.endswith("stacked") else (P * n,)
                    x = make(9500 + slot, RANK, shape, dt, op)
                    every = gathered(x)
                    out = torch.zeros(n, dtype=dt)
                    run(label, mode, lambda a: dist.reduce_scatter_tensor(
                        out, x, op=getattr(R, op), async_op=a))
                    want = reduce_np([e.reshape(P, n)[RANK] for e in every], op, dt)
                    CK.check(to_np(x).tobytes() == every[RANK].tobytes(),
                             f"{label} [{mode}]: input modified")
                CK.result(label + f" [{mode}]", out, want, op)


def split_size(src, dst, seed):
    return (src * 3 + dst * 5 + seed) % 4  # 0..3 rows, 0 included


def check_all_to_all():
    slot = 0
    for dt in dtypes(EVERY):
        for kind in some(("list even", "list uneven", "single even", "single uneven",
                          "single uneven 2-d"), slot, 3):
            slot += 1
            if kind == "list uneven" and backend_lacks("all_to_all list uneven"):
                continue
            mode = MODES[slot % 3]
            n = sizes(ARGS.light)[slot % len(sizes(ARGS.light))]
            label = f"all_to_all ({kind}) {dt}"
            if kind.startswith("list"):
                sz = [n if kind == "list even" else split_size(RANK, j, slot) for j in range(P)]
                ins = [make(10000 + slot, RANK * P + j, (sz[j],), dt) for j in range(P)]
                every = WORLD.allgather([to_np(x) for x in ins])
                outs = [torch.zeros(every[j][RANK].shape, dtype=dt) for j in range(P)]
                run(label, mode, lambda a: dist.all_to_all(outs, ins, async_op=a))
                for j in range(P):
                    CK.result(f"{label} [{mode}] from rank {j}", outs[j], every[j][RANK])
                continue
            row = (3,) if kind.endswith("2-d") else ()
            if kind == "single even":
                insp = outsp = None
                x = make(10500 + slot, RANK, (P * n,) + row, dt)
                out = torch.zeros((P * n,) + row, dtype=dt)
            else:
                insp = [split_size(RANK, j, slot) for j in range(P)]
                outsp = [split_size(j, RANK, slot) for j in range(P)]
                x = make(10500 + slot, RANK, (sum(insp),) + row, dt)
                out = torch.zeros((sum(outsp),) + row, dtype=dt)
            every = gathered(x)
            label += f" in_splits={insp} out_splits={outsp}"
            run(label, mode, lambda a: dist.all_to_all_single(out, x, outsp, insp, async_op=a))
            parts = []
            for j in range(P):
                sp = [split_size(j, k, slot) for k in range(P)] if insp else [n] * P
                start = sum(sp[:RANK])
                parts.append(every[j][start:start + sp[RANK]])
            CK.result(label + f" [{mode}]", out, np.concatenate(parts).reshape(out.shape))
            CK.check(to_np(x).tobytes() == every[RANK].tobytes(), f"{label} [{mode}]: input "
                     "modified")


def check_gather_scatter():
    slot = 0
    for dt in dtypes(EVERY):
        if dt in COMPLEX and backend_lacks("complex gather/scatter"):
            continue
        n = sizes(ARGS.light)[slot % len(sizes(ARGS.light))]
        for root in some(range(P), slot, 2):
            slot += 1
            mode = MODES[slot % 3]
            t = make(11000 + slot, RANK, (n,), dt)
            inputs = gathered(t)
            glist = [torch.zeros(n, dtype=dt) for _ in range(P)] if RANK == root else None
            label = f"gather {dt} n={n} dst={root}"
            run(label, mode, lambda a: dist.gather(t, gather_list=glist, dst=root, async_op=a))
            if RANK == root:
                for j in range(P):
                    CK.result(f"{label} [{mode}] from rank {j}", glist[j], inputs[j])
            CK.check(to_np(t).tobytes() == inputs[RANK].tobytes(), f"{label} [{mode}]: input "
                     "modified")
            slot += 1
            mode = MODES[slot % 3]
            slist = [make(11500 + slot, j, (n,), dt) for j in range(P)] if RANK == root else None
            everyl = WORLD.bcast([to_np(s) for s in slist] if RANK == root else None, root=root)
            out = torch.ones(n, dtype=dt)
            label = f"scatter {dt} n={n} src={root}"
            run(label, mode, lambda a: dist.scatter(out, scatter_list=slist, src=root,
                                                    async_op=a))
            CK.result(f"{label} [{mode}]", out, everyl[RANK])
            if RANK == root:
                CK.check(all(to_np(x).tobytes() == everyl[j].tobytes()
                             for j, x in enumerate(slist)), f"{label} [{mode}]: scatter_list "
                         "modified")


def check_barrier():
    """Rank r sleeps 0.03 r s before the barrier: nobody may leave before the last one entered
    (one machine, one clock)."""
    for mode in MODES:
        for _ in range(2):
            time.sleep(0.03 * RANK)
            enter = time.time()
            run("barrier", mode, lambda a: dist.barrier(async_op=a))
            leave = time.time()
            times = WORLD.allgather((enter, leave))
            last_in = max(e for e, _ in times)
            first_out = min(lv for _, lv in times)
            CK.check(first_out >= last_in, f"barrier [{mode}]: a rank left at {first_out:.4f}, "
                     f"before the last entered at {last_in:.4f}")


def check_p2p():
    if P == 1:  # no peer (tests/test_torch.py skips it)
        return
    nxt, prv = (RANK + 1) % P, (RANK - 1) % P
    # a message nobody received dies with its group: MPI may give the next group the freed
    # communicator's context, where it would match a receive (of the wrong size, here)
    for k in range(2):
        g = CK.attempt(f"new_group #{k}", lambda: dist.new_group(list(range(P))))
        if g is None:
            continue
        if k == 0 and RANK == 1:
            CK.attempt("send nobody receives", lambda: dist.send(torch.ones(10), 0, group=g))
        if k == 1:
            got = torch.zeros(1)
            if RANK == 1:
                CK.attempt("send in the next group", lambda: dist.send(torch.full((1,), 5.0),
                                                                       0, group=g))
            elif RANK == 0:
                CK.attempt("recv in the next group", lambda: dist.recv(got, 1, group=g))
                CK.check(got.tolist() == [5.0], f"recv in the next group got {got}")
        WORLD.Barrier()
        dist.destroy_process_group(g)
    slot = 0
    for dt in dtypes(EVERY):
        slot += 1
        n = [1, P + 1, 3001, 0][slot % 4]
        # blocking ring shift, with a tag; even ranks send first
        t = make(12000 + slot, RANK, (n,), dt)
        out = torch.zeros(n, dtype=dt)
        label = f"send/recv ring {dt} n={n} tag=7"

        def shift():
            if RANK % 2 == 0:
                dist.send(t, dst=nxt, tag=7)
                dist.recv(out, src=prv, tag=7)
            else:
                dist.recv(out, src=prv, tag=7)
                dist.send(t, dst=nxt, tag=7)
        CK.attempt(label, shift)
        inputs = WORLD.allgather(to_np(t))
        CK.result(label, out, inputs[prv])
        # isend/irecv, two tags received in the other order than sent
        a, b = make(12500 + slot, RANK, (n,), dt), make(12600 + slot, RANK, (n + 1,), dt)
        ga, gb = WORLD.allgather(to_np(a)), WORLD.allgather(to_np(b))
        oa, ob = torch.zeros(n, dtype=dt), torch.zeros(n + 1, dtype=dt)
        label = f"isend/irecv {dt} tags 1, 2 received as 2, 1"

        def tags():
            s1 = dist.isend(a, dst=nxt, tag=1)
            s2 = dist.isend(b, dst=nxt, tag=2)
            r2 = dist.irecv(ob, src=prv, tag=2)
            r1 = dist.irecv(oa, src=prv, tag=1)
            for w in (r2, r1, s1, s2):
                w.wait()
            return [w.is_completed() for w in (r2, r1, s1, s2)]
        done = CK.attempt(label, tags)
        CK.check(done == [True] * 4, f"{label}: is_completed {done}")
        CK.result(label + " tag 1", oa, ga[prv])
        CK.result(label + " tag 2", ob, gb[prv])
        # batch_isend_irecv: both directions at once
        c = make(12700 + slot, RANK, (n,), dt)
        gc = WORLD.allgather(to_np(c))
        from_prv, from_nxt = torch.zeros(n, dtype=dt), torch.zeros(n, dtype=dt)
        label = f"batch_isend_irecv {dt} n={n} both ways"

        def batch():
            ops = [dist.P2POp(dist.isend, c, nxt), dist.P2POp(dist.irecv, from_prv, prv),
                   dist.P2POp(dist.isend, c, prv), dist.P2POp(dist.irecv, from_nxt, nxt)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        CK.attempt(label, batch)
        CK.result(label + " from previous", from_prv, gc[prv])
        CK.result(label + " from next", from_nxt, gc[nxt])
    # several messages to one peer, one tag: received in the order sent (MPI's non-overtaking)
    xs = [make(12800 + i, RANK, (i + 1,), torch.int64) for i in range(3)]
    gx = [WORLD.allgather(to_np(x)) for x in xs]
    outs = [torch.zeros(i + 1, dtype=torch.int64) for i in range(3)]

    def ordered():
        sends = [dist.isend(x, dst=nxt, tag=5) for x in xs]
        for w in [dist.irecv(o, src=prv, tag=5) for o in outs] + sends:
            w.wait()
    CK.attempt("3 isends to one peer, one tag", ordered)
    for i in range(3):
        CK.result(f"3 isends to one peer, one tag: message {i}", outs[i], gx[i][prv])
    # a send posted before a collective, its receive after it (pipeline parallelism's pattern)
    x = make(12900, RANK, (7,), torch.float32)
    y = make(12901, RANK, (5,), torch.float32)
    gxs, gys = WORLD.allgather(to_np(x)), WORLD.allgather(to_np(y))
    out = torch.zeros(7)

    def interleaved():
        s = dist.isend(x, dst=nxt, tag=9)
        dist.all_reduce(y)
        r = dist.irecv(out, src=prv, tag=9)
        r.wait()
        s.wait()
    CK.attempt("isend, all_reduce, then irecv", interleaved)
    CK.result("isend, all_reduce, then irecv: the message", out, gxs[prv])
    CK.result("isend, all_reduce, then irecv: the all_reduce", y,
              reduce_np(gys, "SUM", torch.float32))
    # recv from any source (dist.recv without src, and irecv's Work._source_rank()): rank 0
    # takes one message from every other rank, in whatever order they come, each once, the
    # sender's rank returned and its data matching
    if P > 1:
        if RANK == 0:
            senders = []

            def from_anyone():
                for i in range(P - 1):
                    got = torch.full((3,), -1, dtype=torch.int64)
                    if i % 2 == 0:
                        src = dist.recv(got, tag=11)
                    else:
                        w = dist.irecv(got, tag=11)
                        w.wait()
                        src = w._source_rank()
                    senders.append(src)
                    CK.check(got.tolist() == [src, src * 2, 7],
                             f"recv from any source: {got.tolist()} from rank {src}")
            CK.attempt("recv from any source", from_anyone)
            CK.check(sorted(senders) == list(range(1, P)),
                     f"recv from any source: senders {senders}, want each of 1..{P - 1} once")
        else:
            CK.attempt("send to a receive from any source", lambda: dist.send(
                torch.tensor([RANK, RANK * 2, 7], dtype=torch.int64), dst=0, tag=11))


def obj(r):
    return ("rank", r, [r] * r, {"k": r * 1.5, "s": "é" * r}, b"\x00" * (r + 1))


def check_objects():
    out = [None] * P
    CK.attempt("all_gather_object", lambda: dist.all_gather_object(out, obj(RANK)))
    CK.check(out == [obj(j) for j in range(P)], f"all_gather_object: {out}")
    for root in range(P):
        lst = [obj(root), {"big": list(range(3000))}, None] if RANK == root else [0, 0, 0]
        CK.attempt("broadcast_object_list", lambda: dist.broadcast_object_list(lst, src=root))
        CK.check(lst == [obj(root), {"big": list(range(3000))}, None],
                 f"broadcast_object_list src={root}: {str(lst)[:200]}")
        glist = [None] * P if RANK == root else None
        CK.attempt("gather_object", lambda: dist.gather_object(obj(RANK), glist, dst=root))
        if RANK == root:
            CK.check(glist == [obj(j) for j in range(P)], f"gather_object dst={root}: {glist}")
        sin = [obj(10 * root + j) for j in range(P)] if RANK == root else None
        sout = [None]
        CK.attempt("scatter_object_list", lambda: dist.scatter_object_list(sout, sin, src=root))
        CK.check(sout == [obj(10 * root + RANK)], f"scatter_object_list src={root}: {sout}")


def check_noncontig():
    """Transposed and strided views: results as on contiguous copies, gaps untouched."""
    slot = 0
    for i, dt in enumerate((torch.float32, torch.int64, torch.bfloat16, torch.bool,
                            torch.complex64)):
        for mode in some(MODES, i, 1):
            slot += 1
            base = make(13000 + slot, RANK, (6, 5), dt)
            view = base.t()  # (5, 6), not contiguous
            contig = view.contiguous().clone()
            inputs = WORLD.allgather(to_np(view))
            label = f"all_reduce transposed {dt}"
            run(label, mode, lambda a: dist.all_reduce(view, async_op=a))
            CK.attempt(label + " contiguous", lambda: dist.all_reduce(contig))
            want = reduce_np(inputs, "SUM", dt)
            CK.result(label + f" [{mode}]", view, want)
            CK.result(label + f" [{mode}] vs the contiguous call", view, to_np(contig))
            CK.result(label + f" [{mode}] base", base, want.T)
            # a strided view: every other element of a 1-d tensor
            if not backend_lacks("strided"):
                flat = make(13100 + slot, RANK, (2 * (P + 3),), dt)
                gaps = to_np(flat)[1::2].copy()
                view = flat[::2]
                inputs = WORLD.allgather(to_np(view))
                label = f"all_reduce strided [::2] {dt}"
                run(label, mode, lambda a: dist.all_reduce(view, async_op=a))
                CK.result(label + f" [{mode}]", view, reduce_np(inputs, "SUM", dt))
                CK.check(to_np(flat)[1::2].tobytes() == gaps.tobytes(),
                         f"{label} [{mode}]: elements between the strided ones changed")
            for root in range(P):
                base = make(13200 + slot + root, RANK, (4, 7), dt)
                view = base.t()
                inputs = WORLD.allgather(to_np(view))
                label = f"broadcast transposed {dt} src={root}"
                run(label, mode, lambda a: dist.broadcast(view, src=root, async_op=a))
                CK.result(label + f" [{mode}]", view, inputs[root])
                CK.result(label + f" [{mode}] base", base, inputs[root].T)
            # all_gather: transposed input, strided output views into one buffer
            base = make(13300 + slot, RANK, (3, 4), dt)
            view = base.t()
            inputs = WORLD.allgather(to_np(view))
            buf = torch.zeros((P, 4, 6), dtype=dt)
            outs = [buf[j, :, ::2] for j in range(P)]  # (4, 3) views, stride 2
            label = f"all_gather transposed in, strided out {dt}"
            run(label, mode, lambda a: dist.all_gather(outs, view, async_op=a))
            cont = [torch.zeros((4, 3), dtype=dt) for _ in range(P)]
            CK.attempt(label + " contiguous", lambda: dist.all_gather(cont, view.contiguous()))
            for j in range(P):
                CK.result(f"{label} [{mode}] from rank {j}", outs[j], inputs[j])
                CK.result(f"{label} [{mode}] from rank {j} vs the contiguous call", outs[j],
                          to_np(cont[j]))
            CK.check(not to_np(buf[:, :, 1::2]).astype(bool).any(),
                     f"{label} [{mode}]: the gaps of the output buffer were written")
            # reduce_scatter_tensor into a strided output, all_to_all_single of a transposed input
            if not backend_lacks("strided"):
                x = make(13400 + slot, RANK, (P * 3,), dt)
                every = gathered(x)
                buf = torch.zeros(6, dtype=dt)
                label = f"reduce_scatter_tensor into a strided [::2] output {dt}"
                run(label, mode, lambda a: dist.reduce_scatter_tensor(buf[::2], x, async_op=a))
                CK.result(f"{label} [{mode}]", buf[::2],
                          reduce_np(every, "SUM", dt)[3 * RANK:3 * RANK + 3])
                CK.check(not to_np(buf[1::2]).astype(bool).any(),
                         f"{label} [{mode}]: the gaps of the output were written")
            if backend_lacks("all_to_all_single non-contiguous"):
                continue
            base = make(13500 + slot, RANK, (2, P * 2), dt)
            view = base.t()  # (2P, 2), rows 2r, 2r+1 go to rank r
            every = WORLD.allgather(to_np(view))
            out = torch.zeros((P * 2, 2), dtype=dt)
            label = f"all_to_all_single of a transposed input {dt}"
            run(label, mode, lambda a: dist.all_to_all_single(out, view, async_op=a))
            CK.result(f"{label} [{mode}]", out,
                      np.concatenate([e[2 * RANK:2 * RANK + 2] for e in every]))


def check_unsupported():
    """An op the dtype cannot take raises a clear error at the call (or its wait), on every rank
    alike, and the group works afterwards."""
    cases = [("BAND", torch.float32), ("BOR", torch.float16), ("BXOR", torch.float64),
             ("BAND", torch.bfloat16)]
    for op, dt in cases:
        for mode in ("sync", "wait"):
            t = torch.ones(5, dtype=dt)
            before = to_np(t)
            label = f"all_reduce {op} on {dt} [{mode}]"
            err, at, w = None, "the call", None
            try:
                w = dist.all_reduce(t, op=getattr(R, op), async_op=mode == "wait")
            except Exception as exc:  # noqa: BLE001
                err = exc
            if err is None and w is not None:
                try:
                    w.wait()
                except Exception as exc:  # noqa: BLE001
                    err, at = exc, "wait()"
            CK.check(err is not None, f"{label}: no error, result {to_np(t).tolist()}")
            if err is not None:
                CK.check(at == "the call" or backend_lacks("raise at the call"),
                         f"{label}: raised at {at}, not at the call")
                if ARGS.backend == "ringcoll":
                    import ringcoll

                    CK.check(isinstance(err, ringcoll.RingcollError) and isinstance(err, TypeError),
                             f"{label}: {type(err).__module__}.{type(err).__name__} is not "
                             f"ringcoll's InvalidTypeError-like error: {short(err)}")
                msg = str(err)
                CK.check(op in msg or op.lower() in msg.lower() or "bitwise" in msg.lower(),
                         f"{label}: message does not name the op: {type(err).__name__}: "
                         f"{short(err)}")
                CK.check(str(dt).split(".")[-1] in msg or "integ" in msg.lower()
                         or "float" in msg.lower(),
                         f"{label}: message does not name the dtype: {short(err)}")
            CK.check(to_np(t).tobytes() == before.tobytes(), f"{label}: tensor modified")
            every = WORLD.allgather(err is not None)
            CK.check(all(every) or not any(every), f"{label}: raised on ranks "
                     f"{[r for r, e in enumerate(every) if e]} only")
        t = torch.full((3,), RANK + 1, dtype=torch.int32)
        CK.attempt("all_reduce after the error", lambda: dist.all_reduce(t))
        CK.check(t.tolist() == [P * (P + 1) // 2] * 3, f"all_reduce after the error: {t}")


def check_subgroups():
    rev = list(reversed(range(P)))
    specs = [("even", list(range(0, P, 2)), True), ("[0]", [0], True),
             ("reversed", rev, True), ("reversed sort_ranks=False", rev, False)]
    if P > 1:
        specs.append(("odd reversed sort_ranks=False", list(reversed(range(1, P, 2))), False))
    made = []
    for name, ranks, sort in specs:
        g = CK.attempt(f"new_group {name}", lambda: dist.new_group(ranks, sort_ranks=sort))
        made.append((name, ranks if not sort else sorted(ranks), g))
    slot = 0
    for name, order, g in made:
        member = RANK in order
        label = f"group {name} {order}"
        # mpi4py, ordered like the group, for the oracle (every rank calls Split)
        sub = WORLD.Split(0 if member else MPI.UNDEFINED, order.index(RANK) if member else 0)
        if not member:
            CK.check(g is None or g == dist.GroupMember.NON_GROUP_MEMBER
                     or dist.get_rank(g) == -1, f"{label}: a non-member got a group rank")
            continue
        if g is None:  # new_group raised: recorded
            sub.Free()
            continue
        me = order.index(RANK)
        CK.check(dist.get_rank(g) == me, f"{label}: get_rank {dist.get_rank(g)}, expected {me}")
        CK.check(dist.get_world_size(g) == len(order), f"{label}: size {dist.get_world_size(g)}")
        CK.check(dist.get_process_group_ranks(g) == order,
                 f"{label}: ranks {dist.get_process_group_ranks(g)}, expected {order}")
        CK.check(dist.get_backend(g) == ARGS.backend, f"{label}: backend {dist.get_backend(g)}")
        for dt, op in ((torch.int64, "SUM"), (torch.float32, "MAX"), (torch.bfloat16, "SUM"),
                       (torch.uint8, "BXOR")):
            slot += 1
            mode = MODES[slot % 3]
            t = make(14000 + slot, RANK, (P + 5,), dt, op)
            inputs = sub.allgather(to_np(t))
            run(f"{label} all_reduce", mode,
                lambda a: dist.all_reduce(t, op=getattr(R, op), group=g, async_op=a))
            CK.result(f"{label} all_reduce {dt} {op} [{mode}]", t, reduce_np(inputs, op, dt), op)
            # all_gather: in group-rank order
            x = make(14500 + slot, RANK, (3,), dt)
            every = sub.allgather(to_np(x))
            outs = [torch.zeros(3, dtype=dt) for _ in order]
            run(f"{label} all_gather", mode, lambda a: dist.all_gather(outs, x, group=g,
                                                                       async_op=a))
            for j in range(len(order)):
                CK.result(f"{label} all_gather {dt} [{mode}] from group rank {j} (global "
                          f"{order[j]})", outs[j], every[j])
        for j, src in enumerate(order):  # src is a global rank
            x = make(14800 + j, RANK, (7,), torch.float64)
            every = sub.allgather(to_np(x))
            CK.attempt(f"{label} broadcast", lambda: dist.broadcast(x, src=src, group=g))
            CK.result(f"{label} broadcast src={src} (global)", x, every[j])
            x = make(14900 + j, RANK, (4,), torch.int32)
            every = sub.allgather(to_np(x))
            CK.attempt(f"{label} reduce", lambda: dist.reduce(x, dst=src, group=g))
            if RANK == src:
                CK.result(f"{label} reduce dst={src} (global)", x, reduce_np(every, "SUM",
                                                                              torch.int32))
        x = make(14990, RANK, (len(order) * 2,), torch.int64)
        every = sub.allgather(to_np(x))
        out = torch.zeros(2, dtype=torch.int64)
        CK.attempt(f"{label} reduce_scatter_tensor",
                   lambda: dist.reduce_scatter_tensor(out, x, group=g))
        CK.result(f"{label} reduce_scatter_tensor", out,
                  reduce_np(every, "SUM", torch.int64)[2 * me:2 * me + 2])
        CK.attempt(f"{label} barrier", lambda: dist.barrier(group=g))
        objs = [None] * len(order)
        CK.attempt(f"{label} all_gather_object", lambda: dist.all_gather_object(objs, obj(RANK),
                                                                                group=g))
        CK.check(objs == [obj(r) for r in order], f"{label} all_gather_object: {objs}")
        lst = [obj(order[-1])] if RANK == order[-1] else [None]
        CK.attempt(f"{label} broadcast_object_list", lambda: dist.broadcast_object_list(
            lst, src=order[-1], group=g))
        CK.check(lst == [obj(order[-1])], f"{label} broadcast_object_list src={order[-1]} "
                 f"(global): {lst}")
        sub.Free()
    # the default group still works after the sub-groups
    t = torch.ones(4, dtype=torch.int64)
    CK.attempt("world all_reduce after sub-groups", lambda: dist.all_reduce(t))
    CK.check(t.tolist() == [P] * 4, f"world all_reduce after sub-groups: {t.tolist()}")


def check_device_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    shape = (2, P // 2) if P % 2 == 0 else (P,)
    names = ("dp", "tp") if len(shape) == 2 else ("dp",)
    mesh = CK.attempt(f"init_device_mesh cpu {shape}",
                      lambda: init_device_mesh(DEVICE.type, shape, mesh_dim_names=names))
    if mesh is None:
        return
    grid = np.arange(P).reshape(shape)
    for dim, name in enumerate(names):
        g = CK.attempt(f"mesh.get_group({dim})", lambda: mesh.get_group(dim))
        if g is None:
            continue
        where = np.argwhere(grid == RANK)[0]
        line = grid[tuple(where[:dim])] if dim > 0 else grid[(slice(None),) + tuple(where[1:])]
        line = [int(v) for v in np.asarray(line).reshape(-1)]
        CK.check(dist.get_process_group_ranks(g) == line,
                 f"mesh dim {name}: ranks {dist.get_process_group_ranks(g)}, expected {line}")
        CK.check(dist.get_backend(g) == ARGS.backend, f"mesh dim {name}: {dist.get_backend(g)}")
        sub = WORLD.Split(int(where[1 - dim]) if len(shape) == 2 else 0, line.index(RANK))
        for dt, op in ((torch.float32, "SUM"), (torch.int64, "MAX")):
            t = make(15000 + dim, RANK, (P + 3,), dt, op)
            inputs = sub.allgather(to_np(t))
            CK.attempt(f"mesh dim {name} all_reduce",
                       lambda: dist.all_reduce(t, op=getattr(R, op), group=g))
            CK.result(f"mesh dim {name} {line} all_reduce {dt} {op}", t,
                      reduce_np(inputs, op, dt), op)
        x = make(15100 + dim, RANK, (2, 3), torch.float32)
        every = sub.allgather(to_np(x))
        out = torch.zeros((2 * len(line), 3))
        CK.attempt(f"mesh dim {name} all_gather_into_tensor",
                   lambda: dist.all_gather_into_tensor(out, x, group=g))
        CK.result(f"mesh dim {name} {line} all_gather_into_tensor", out, np.concatenate(every))
        import torch.distributed._functional_collectives as fc

        x = make(15200 + dim, RANK, (4,), torch.int64)
        every = sub.allgather(to_np(x))
        y = CK.attempt(f"mesh dim {name} funcol all_reduce",
                       lambda: fc.wait_tensor(fc.all_reduce(x, "sum", (mesh, dim))))
        CK.result(f"mesh dim {name} {line} funcol all_reduce group=(mesh, {dim})", y,
                  reduce_np(every, "SUM", torch.int64))
        sub.Free()


def check_functional():
    import torch.distributed._functional_collectives as fc

    world = dist.group.WORLD
    for dt in (torch.float32, torch.int64, torch.bfloat16):
        for n in (1, P + 1, 1001):
            x = make(16000 + n, RANK, (n,), dt)
            inputs = gathered(x)
            label = f"funcol all_reduce sum {dt} n={n}"
            y = CK.attempt(label, lambda: fc.wait_tensor(fc.all_reduce(x, "sum", world)))
            CK.result(label, y, reduce_np(inputs, "SUM", dt))
            CK.check(to_np(x).tobytes() == inputs[RANK].tobytes(), f"{label}: input modified")
            label = f"funcol all_reduce max {dt} n={n} (used as a tensor, no explicit wait)"
            y = CK.attempt(label, lambda: fc.all_reduce(x, "max", world) + 0)
            CK.result(label, y, reduce_np(inputs, "MAX", dt))
            x2 = make(16100 + n, RANK, (n, 2), dt)
            inputs = gathered(x2)
            label = f"funcol all_gather_tensor {dt} ({n}, 2) gather_dim=0"
            y = CK.attempt(label, lambda: fc.wait_tensor(fc.all_gather_tensor(x2, 0, world)))
            CK.result(label, y, np.concatenate(inputs))
            label = f"funcol all_gather_tensor {dt} ({n}, 2) gather_dim=1"
            y = CK.attempt(label, lambda: fc.wait_tensor(fc.all_gather_tensor(x2, 1, world)))
            CK.result(label, y, np.concatenate(inputs, axis=1))
            x3 = make(16200 + n, RANK, (P * n, 2), dt)
            inputs = gathered(x3)
            label = f"funcol reduce_scatter_tensor sum {dt} ({P * n}, 2)"
            y = CK.attempt(label, lambda: fc.wait_tensor(fc.reduce_scatter_tensor(x3, "sum", 0,
                                                                                  world)))
            CK.result(label, y, reduce_np(inputs, "SUM", dt)[RANK * n:(RANK + 1) * n])
    # with a list of ranks as the group
    x = make(16300, RANK, (5,), torch.float64)
    inputs = gathered(x)
    y = CK.attempt("funcol all_reduce group=list(range(P))",
                   lambda: fc.wait_tensor(fc.all_reduce(x, "sum", list(range(P)))))
    CK.result("funcol all_reduce group=list(range(P))", y, reduce_np(inputs, "SUM",
                                                                      torch.float64))


# -- DDP ---------------------------------------------------------------------------------------
DDP_STEPS, DDP_BATCH, DDP_TOL = 4, 24, 1e-5  # 24 rows: divisible by P = 1, 2, 3, 4


def ddp_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def ddp_data(steps):
    g = torch.Generator().manual_seed(123)  # on the host: the same data on any device
    x = torch.randn(steps * DDP_BATCH, 20, generator=g, device="cpu")
    y = torch.randn(steps * DDP_BATCH, 4, generator=g, device="cpu")
    return x.to(DEVICE), y.to(DEVICE)


def ddp_reference(accumulate):
    """One process, the whole global batch per step, no communication."""
    model = ddp_model(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = ddp_data(DDP_STEPS * (2 if accumulate else 1))
    k = 0
    for _ in range(DDP_STEPS):
        opt.zero_grad()
        for _ in range(2 if accumulate else 1):
            rows = slice(k * DDP_BATCH, (k + 1) * DDP_BATCH)
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
            k += 1
        opt.step()
    return model


def check_ddp():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    share = DDP_BATCH // P
    variants = [("plain", {}, None, False, DDP_TOL),
                ("gradient_as_bucket_view", {"gradient_as_bucket_view": True}, None, False,
                 DDP_TOL),
                ("small buckets", {"bucket_cap_mb": 0.001}, None, False, DDP_TOL),
                ("allreduce_hook", {}, default_hooks.allreduce_hook, False, DDP_TOL),
                # fp16 gradients: |error| of each gradient element <= 2^-11 |g|; 4 SGD steps of
                # lr 0.1, momentum 0.9: well below 1e-3 on these parameters (measured ~1e-5)
                ("fp16_compress_hook", {}, default_hooks.fp16_compress_hook, False, 1e-3),
                ("no_sync one micro-batch, then sync", {}, None, True, DDP_TOL)]
    if DEVICE.type != "cpu":  # the oracle the GPU run adds: DDP over gloo on the same tensors
        variants.append(("over gloo (oracle)", {"process_group": GLOO}, None, False, DDP_TOL))
    refs = {acc: ddp_reference(acc) for acc in (False, True)}
    for name, kwargs, hook, accumulate, tol in variants:
        label = f"DDP {name}"
        try:
            model = ddp_model(1 + RANK)  # different on purpose: DDP broadcasts rank 0's
            ddp = DDP(model, **kwargs)
            if hook is not None:
                ddp.register_comm_hook(dist.group.WORLD, hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
            x, y = ddp_data(DDP_STEPS * (2 if accumulate else 1))
            k = 0
            for _ in range(DDP_STEPS):
                opt.zero_grad()
                for micro in range(2 if accumulate else 1):
                    rows = slice(k * DDP_BATCH + RANK * share, k * DDP_BATCH + (RANK + 1) * share)
                    k += 1
                    if accumulate and micro == 0:
                        with ddp.no_sync():
                            torch.nn.functional.mse_loss(ddp(x[rows]), y[rows]).backward()
                    else:
                        torch.nn.functional.mse_loss(ddp(x[rows]), y[rows]).backward()
                opt.step()
        except Exception as exc:  # noqa: BLE001
            CK.check(False, f"{label}: raised {type(exc).__name__}: {short(exc, 600)}")
            continue
        mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        ref = torch.cat([p.detach().reshape(-1) for p in refs[accumulate].parameters()])
        diff = float((mine - ref).abs().max())
        moved = float((mine - torch.cat([p.detach().reshape(-1)
                                         for p in ddp_model(1).parameters()])).abs().max())
        CK.check(diff < tol and moved > 1e-3,
                 f"{label}: max |param - one-process reference| = {diff:.3g} (bound {tol:g}); "
                 f"params moved by {moved:.3g} in training")
        if RANK == 0:
            CK.note(f"{label}: max |param - one-process reference| = {diff:.3g} (bound {tol:g})")
            print(f"mpi_torch P={P} {label}: max |param - reference| = {diff:.3g}", flush=True)
        CK.identical(label + " replicas", mine)


def check_errors():
    """RINGCOLL_DEBUG=1: a rank whose call does not match the others' raises a ringcoll error
    on every rank (at the call or at wait()), within a deadline, and the group then works."""
    import ringcoll

    cases = [("all_reduce count", lambda: torch.ones(5 if RANK == 0 else 4),
              lambda t, a: dist.all_reduce(t, async_op=a)),
             ("all_reduce dtype", lambda: torch.ones(4, dtype=torch.float64 if RANK == 0
                                                     else torch.float32),
              lambda t, a: dist.all_reduce(t, async_op=a)),
             ("broadcast count", lambda: torch.ones(3 if RANK == P - 1 else 6),
              lambda t, a: dist.broadcast(t, src=0, async_op=a))]
    for name, make_t, call in cases if P > 1 else []:  # none at P=1 (skipped there)
        for mode in ("sync", "wait"):
            label = f"{name} mismatch [{mode}]"
            box = {"t": make_t()}

            def body():
                try:
                    w = call(box["t"], mode == "wait")
                    if w is not None:
                        w.wait()
                except BaseException as exc:  # noqa: BLE001
                    box["exc"] = exc
            th = threading.Thread(target=body, daemon=True)
            t0 = time.time()
            th.start()
            th.join(60)
            if th.is_alive():
                CK.check(False, f"{label}: hung for 60 s instead of raising")
                finish_and_exit(1)
            exc = box.get("exc")
            CK.check(exc is not None, f"{label}: no error on this rank after "
                     f"{time.time() - t0:.1f} s; the tensor holds {summary(to_np(box['t']))}")
            if exc is not None:
                CK.check(isinstance(exc, ringcoll.RingcollError),
                         f"{label}: {type(exc).__module__}.{type(exc).__name__} is not a "
                         f"ringcoll.RingcollError: {short(exc)}")
            every = WORLD.allgather(exc is not None)
            CK.check(all(every), f"{label}: raised only on ranks "
                     f"{[r for r, e in enumerate(every) if e]}")
            t = torch.full((3,), RANK + 1, dtype=torch.int64)
            CK.attempt(f"all_reduce after {label}", lambda: dist.all_reduce(t))
            CK.check(t.tolist() == [P * (P + 1) // 2] * 3,
                     f"all_reduce after {label}: {t.tolist()}")


# ---------------------------------------------------------------------------------------------
REPORT = {}


def sync(group, timeout):
    """Wait (at most timeout s) until every rank finished `group`; then rank 0 merges the
    group's checks and failures into the report file. A stuck rank aborts the job."""
    req = WORLD.Ibarrier()
    deadline = time.time() + timeout
    while not req.Test():
        if time.time() > deadline:
            print(f"rank {RANK}: other ranks did not finish group {group!r} within {timeout} s;"
                  f" failures so far: {CK.failures.get(group)}; aborting", file=sys.stderr,
                  flush=True)
            if RANK == 0 and group in CK.checks:
                REPORT[group] = {"checks": CK.checks[group], "seconds": None,
                                 "failures": CK.failures[group] + [
                                     f"[{group}] a rank did not finish within {timeout} s (hang)"]}
                write_report()
            WORLD.Abort(1)
        time.sleep(0.001)


def merge(group, seconds):
    every = WORLD.gather((CK.checks.get(group, 0), CK.failures.get(group, [])), root=0)
    if RANK == 0:
        REPORT[group] = {"checks": sum(c for c, _ in every),
                         "failures": [f for _, fl in every for f in fl], "seconds": seconds,
                         "notes": CK.notes.get(group, [])}
        write_report()


def write_report():
    if ARGS.report:
        tmp = ARGS.report + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(REPORT, fh, indent=1)
        os.replace(tmp, ARGS.report)


def finish_and_exit(code=None):
    """Merge what this rank has (also from a group cut short), print, exit (os._exit after a
    hang, so a stuck backend thread cannot keep the process alive)."""
    if CK.group is not None and CK.group not in REPORT:
        merge(CK.group, None)
    total = WORLD.allreduce(sum(len(f) for f in CK.failures.values()), op=MPI.SUM)
    if RANK == 0:
        for group, rep in REPORT.items():
            print(f"mpi_torch P={P} {group:24s} {rep['checks']:6d} checks "
                  f"{len(rep['failures']):4d} failures  {rep['seconds']} s", flush=True)
        for rep in REPORT.values():
            for f in rep["failures"][:25]:
                print("FAIL " + f, flush=True)
        if CK.skipped:
            print(f"mpi_torch P={P} skipped under --backend {ARGS.backend}: {CK.skipped}",
                  flush=True)
        print(f"mpi_torch P={P} backend={ARGS.backend}: "
              f"{sum(r['checks'] for r in REPORT.values())} checks, {total} failures", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    if code is not None:
        os._exit(code)
    return total


GLOO = None
DEVICE = torch.device("cpu")  # where the checks' tensors live (--device)


def init(backend):
    env_before = {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
                  if k in os.environ}
    if backend == "ringcoll":
        import ringcoll.torch  # noqa: F401 - registers the backend, fills MASTER_ADDR/PORT

        if ARGS.fake_device:
            from _fake_torch_cuda import install

            install()  # every ringcoll group's CPU tensors take the backend's GPU path
        dist.init_process_group("ringcoll")
    else:
        port = None
        if RANK == 0:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            s.close()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(WORLD.bcast(port)))
        dist.init_process_group("gloo", rank=RANK, world_size=P)
    global GLOO
    GLOO = dist.new_group(backend="gloo")
    return env_before


def use_gpu():
    """--device cuda: this rank on GPU (its rank on the node mod the GPUs), every tensor the
    checks make there (torch's default device; from_np moves NumPy-made inputs)."""
    global DEVICE
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device (a CPU-only torch build?)")
    local = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    gpu = local.Get_rank() % torch.cuda.device_count()
    local.Free()
    torch.cuda.set_device(gpu)
    import cupy

    cupy.cuda.Device(gpu).use()
    DEVICE = torch.device("cuda", gpu)
    torch.set_default_device(DEVICE)


def fake_views():
    """How many tensors --fake-device has viewed as device arrays so far (0 without it)."""
    if not ARGS.fake_device:
        return 0
    from _fake_torch_cuda import FakeCudaMemory

    return FakeCudaMemory.counts["arrays"]


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups")
    ap.add_argument("--report")
    ap.add_argument("--light", action="store_true")
    ap.add_argument("--fake-device", action="store_true")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--backend", default="ringcoll", choices=["ringcoll", "gloo"])
    ap.add_argument("--sync-timeout", type=float, default=60.0)
    ap.add_argument("--stall-timeout", type=float, default=30.0)
    ARGS = ap.parse_args()
    if ARGS.device == "cuda":
        use_gpu()
    threading.Thread(target=watchdog, args=(ARGS.stall_timeout,), daemon=True).start()
    groups = ARGS.groups.split(",") if ARGS.groups else GROUPS
    unknown = set(groups) - set(GROUPS) - set(ERROR_GROUPS)
    if unknown:
        raise SystemExit(f"unknown groups {sorted(unknown)}; choose from "
                         f"{GROUPS + ERROR_GROUPS}")
    runners = {g: globals()[f"check_{g}"] for g in GROUPS + ERROR_GROUPS}
    t0 = time.time()
    CK.start("init")
    try:
        env_before = init(ARGS.backend)
    except Exception as exc:  # noqa: BLE001 - nothing else can run: report it and stop
        CK.check(False, f"init_process_group({ARGS.backend!r}) raised {type(exc).__name__}: "
                 f"{short(exc, 800)}\n{traceback.format_exc()}")
        merge("init", round(time.time() - t0, 3))
        finish_and_exit(1)
    sync("setup", ARGS.sync_timeout)
    for group in groups:
        start = time.time()
        CK.start(group)
        views = fake_views()
        try:
            if group == "init":
                check_init(env_before)
            else:
                runners[group]()
        except Exception as exc:  # noqa: BLE001 - a bug in a check, or an unexpected raise
            CK.check(False, f"unexpected {type(exc).__name__}: {short(exc, 600)}\n"
                     f"{traceback.format_exc()}")
        if ARGS.fake_device and group not in ("init", "errors", "barrier") \
                and not (group == "p2p" and P == 1):  # (those pass no tensor)
            CK.check(fake_views() > views, f"--fake-device: [{group}] made no device view: "
                     "its tensors did not take the backend's GPU path")
        sync(group, ARGS.sync_timeout)
        merge(group, round(time.time() - start, 3))
    try:
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001
        CK.start("init")
        CK.check(False, f"destroy_process_group raised {type(exc).__name__}: {short(exc)}")
        merge("init", REPORT.get("init", {}).get("seconds"))
    total = finish_and_exit()
    if total:
        sys.exit(1)


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - never leave the other ranks hanging
        print(f"rank {RANK}/{P}: unexpected exception, aborting the job:\n"
              f"{traceback.format_exc()}", file=sys.stderr, flush=True)
        WORLD.Abort(1)
