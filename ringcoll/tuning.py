"""Tuning tables: the measured all-reduce choices that `auto` looks up before the cost model.

The alpha-beta-gamma cost model (ringcoll.CostModel) predicts the crossovers between the
algorithms from three numbers; on a real machine the crossovers also move with caches, MPI's
eager/rendezvous switch and whether the call is in place, which three numbers cannot capture.
So `python -m ringcoll.tune` measures every algorithm at every size on the machine and writes
down which one won: a tuning table. `auto` then decides like this:

  1. the table for exactly this process count p and node shape (how many ranks on each node,
     in rank order) if the file has one: the algorithm of the first range whose max_bytes is
     >= nbytes (the last range's algorithm beyond it), in-place calls (out=x) from "inplace",
     the others from "outofplace";
  2. otherwise the cost model: Communicator(cost_model=...) if given, else the alpha, beta,
     gamma the file fitted at the process count closest to p if that fit is marked
     "fallback": true (see below), else CostModel()'s defaults.

hierarchical is a candidate only when the ranks span more than one node and fewer than p
nodes, in a table (tune measures it only then) as in the cost model.

Where the table comes from (config.py reads the variable):

  Communicator(tuning=...)   a path, a Tuning, or False / "none" for no table at all;
  RINGCOLL_TUNING=path       the same for every communicator ("none": no table);
  neither                    the table shipped with ringcoll for this MPI library
                             (tuning_openmpi.json for Open MPI, else tuning_default.json,
                             measured with the embedded MPICH; both on its 2-core development
                             machine), used on the MPI transport only: thread-transport
                             timings are nothing like it.

The file (format "ringcoll-tuning", version 1) holds one entry per (p, node shape), so one file
serves every process count of a machine; re-running tune with the same -o replaces the entry of
its own p and node shape and keeps the others. An entry, of which only "p", "nodes" and one of
"inplace" / "outofplace" are needed in a hand-written file:

  {"p": 4, "nodes": [4],
   "outofplace": [[32768, "recursive_doubling"], [33554432, "rabenseifner"]],
   "inplace": [[131072, "recursive_doubling"], [2097152, "rabenseifner"], [33554432, "ring"]],
   "model": {"alpha": 1.5e-05, "beta": 3.6e-10, "gamma": 1.7e-10, "fallback": true, ...},
   "measured": {...the medians it was made from...}, "mpi_library": ..., "hosts": ..., ...}

A mode that is missing uses the other mode's ranges.

The other collectives (broadcast, reduce, allgather, gather, scatter, reduce_scatter, alltoall,
alltoallv, barrier, scan, exscan) choose between their own algorithm and the MPI
library's from an entry's optional "collectives", which bench/collectives_sweep.py
--write-tuning measures and writes (tune keeps it when it replaces the entry):

  "collectives": {"broadcast": [[512, "native"], [67108864, "tree"]],
                  "allgather": [[67108864, "native"]], ...}

nbytes is what every rank agrees on: the buffer (broadcast, reduce, scan, exscan), the input
(reduce_scatter, alltoall), the gathered or scattered rows (allgather, gather, scatter), all
that every rank sends (alltoallv), 0 for barrier. A collective the
entry does not list, or a p without an entry, runs its own algorithm (the first of its
ALGORITHMS) under auto. An entry may hold only "collectives", then the all-reduce uses the
cost model. "model" holds the fitted alpha (s per
message), beta (s per byte moved) and gamma (s per byte reduced), and where tune measured the
node tier its node_alpha (s per counter handoff) and node_beta (s per byte copied); tune sets "fallback" only
when the fit's picks were at least as good as CostModel()'s defaults on the entry's own
measurements (three numbers often cannot describe a machine where Python's per-step cost
differs between algorithms), and a fit with "fallback": false is a record, never used.
A hand-written model without "fallback" is used.
"""

import json
import math
import os
from dataclasses import dataclass
from importlib import resources

from .algorithms import ALLREDUCE, COLLECTIVE_ALGORITHMS, CostModel
from .errors import RingcollError

FORMAT = "ringcoll-tuning"
VERSION = 1
BUILTIN = "tuning_default.json"  # package data next to this module (measured with MPICH)
#: the built-in tables measured with other MPI libraries, by how their version string starts
BUILTIN_BY_LIBRARY = {"Open MPI": "tuning_openmpi.json"}
MODES = ("outofplace", "inplace")
OFF = ("none", "off", "false", "0")  # RINGCOLL_TUNING values that mean: no table
REGENERATE = "mpiexec -n P python -m ringcoll.tune -o FILE"


class TuningFileError(RingcollError, ValueError):
    """A tuning file that cannot be used: missing, not JSON, another format version, or an
    entry that does not make sense. The message names the file and how to fix it."""


def node_shape(nodes):
    """[ranks on each node] from a Communicator's nodes (lists of ranks), in rank order."""
    return [len(m) for m in nodes]


@dataclass(frozen=True)
class Table:
    """One entry of a tuning file: the measured winners at one p and node shape."""

    p: int
    nodes: tuple  # ranks per node, in rank order
    ranges: dict  # mode -> ((max_bytes, algorithm), ...) ascending in max_bytes
    model: CostModel | None  # the fitted model auto may fall back on (None: none, or not to)
    collectives: dict = None  # collective name -> ((max_bytes, algorithm), ...)

    def choose(self, nbytes, inplace):
        """The algorithm of the first range reaching nbytes; the last one beyond them all
        (None: the entry has no all-reduce ranges)."""
        ranges = self.ranges.get("inplace" if inplace else "outofplace")
        if not ranges:  # a hand-written entry with one mode: use it for both
            ranges = self.ranges.get("outofplace" if inplace else "inplace")
        return _lookup(ranges, nbytes) if ranges else None

    def choose_collective(self, collective, nbytes):
        """The measured algorithm of another collective at nbytes, or None (not measured)."""
        ranges = (self.collectives or {}).get(collective)
        return _lookup(ranges, nbytes) if ranges else None


def _lookup(ranges, nbytes):
    for max_bytes, name in ranges:
        if nbytes <= max_bytes:
            return name
    return ranges[-1][1]


class Tuning:
    """The tables of one tuning file (or dict), ready for `auto` to look up.

    Example::

        tuning = ringcoll.Tuning.load("tuning.json")
        tuning.choose(1 << 20, 4, [[0, 1, 2, 3]], inplace=False)   # 'rabenseifner' (or None)
        comm = ringcoll.Communicator(tuning=tuning)                # RINGCOLL_TUNING does the same
    """

    def __init__(self, tables, source="<memory>"):
        self.tables = list(tables)
        self.source = source
        self._by_shape = {(t.p, t.nodes): t for t in self.tables}

    # -- reading ------------------------------------------------------------------------------
    @classmethod
    def load(cls, path):
        """Read and check a tuning file; TuningFileError says what is wrong and the fix."""
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise TuningFileError(
                f"tuning file {path!r} does not exist; make it with `{REGENERATE}` (FILE = "
                "that path), or unset RINGCOLL_TUNING / tuning= to use the built-in table"
            ) from None
        except OSError as e:
            raise TuningFileError(f"tuning file {path!r} cannot be read ({e})") from None
        return cls.loads(text, path)

    @classmethod
    def loads(cls, text, source="<string>"):
        """Parse tuning JSON text; source names it in error messages."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise TuningFileError(
                f"tuning file {source!r} is not valid JSON ({e}); regenerate it with "
                f"`{REGENERATE}` or fix it by hand") from None
        return cls.from_dict(data, source)

    @classmethod
    def from_dict(cls, data, source="<dict>"):
        """Check a decoded tuning file and build its tables."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise TuningFileError(f"{source!r} is not a ringcoll tuning file (it needs "
                                  f'"format": "{FORMAT}"); make one with `{REGENERATE}`')
        if data.get("version") != VERSION:
            raise TuningFileError(
                f"tuning file {source!r} has format version {data.get('version')!r}; this "
                f"ringcoll reads version {VERSION}: regenerate it with `{REGENERATE}`")
        entries = data.get("entries")
        if not isinstance(entries, list):
            raise TuningFileError(f"tuning file {source!r} has no \"entries\" list")
        tables, seen = [], set()
        for i, entry in enumerate(entries):
            table = _table(entry, f"tuning file {source!r}, entry {i}")
            key = (table.p, table.nodes)
            if key in seen:
                raise TuningFileError(f"tuning file {source!r}, entry {i}: a second entry for "
                                      f"p={table.p}, nodes={list(table.nodes)}; keep one")
            seen.add(key)
            tables.append(table)
        return cls(tables, source)

    @classmethod
    def builtin(cls, library=""):
        """The table shipped with ringcoll for this MPI library (its version string, as
        MPITransport.library() gives it: Open MPI's own table, else the MPICH one), measured
        on ringcoll's development machine; no tables while the file is absent, as during its
        regeneration (see ringcoll.tune)."""
        name = next((f for start, f in BUILTIN_BY_LIBRARY.items() if library.startswith(start)),
                    BUILTIN)
        ref = resources.files(__package__).joinpath(name)
        if not ref.is_file():
            return cls([], f"ringcoll/{name} (absent)")
        return cls.loads(ref.read_text(encoding="utf-8"), f"ringcoll/{name}")

    # -- looking up ---------------------------------------------------------------------------
    def table(self, p, nodes):
        """The entry for exactly p ranks and this node shape (lists of ranks), or None."""
        return self._by_shape.get((p, tuple(node_shape(nodes))))

    def choose(self, nbytes, p, nodes, inplace=False):
        """The measured all-reduce algorithm for nbytes at p ranks on `nodes`, or None when the
        file has no table for this p and node shape (then the cost model decides)."""
        table = self.table(p, nodes)
        return None if table is None else table.choose(nbytes, inplace)

    def choose_collective(self, collective, nbytes, p, nodes):
        """The measured algorithm of collective (not the all-reduce) for nbytes at p ranks on
        `nodes`, or None (no entry, or it does not list this collective)."""
        table = self.table(p, nodes)
        return None if table is None else table.choose_collective(collective, nbytes)

    def cost_model(self, p):
        """The fitted CostModel of the entry whose p is closest to p (the smaller p on a tie),
        or None (CostModel()'s defaults then) if that entry has no fit marked as a fallback."""
        if not self.tables:
            return None
        return min(self.tables, key=lambda t: (abs(t.p - p), t.p)).model

    def __repr__(self):
        shapes = ", ".join(f"p={t.p} nodes={list(t.nodes)}" for t in self.tables)
        return f"<ringcoll.Tuning from {self.source}: {shapes or 'no tables'}>"


def resolve(tuning, builtin):
    """The Tuning a Communicator uses, from its tuning= option (or RINGCOLL_TUNING).

    None: the built-in table for the MPI library `builtin` names (its version string; ""
    for the MPICH table), or none where builtin is None (not an MPI transport: the tables
    were measured over MPI); False or "none": no table; a path: that file; a Tuning:
    itself; a dict: parsed.
    """
    if tuning is None:
        return None if builtin is None else Tuning.builtin(builtin)
    if tuning is False or (isinstance(tuning, str) and tuning.strip().lower() in OFF):
        return None
    if isinstance(tuning, Tuning):
        return tuning
    if isinstance(tuning, dict):
        return Tuning.from_dict(tuning)
    if isinstance(tuning, (str, os.PathLike)):
        return Tuning.load(tuning)
    raise TypeError(f"tuning= takes a path, a ringcoll.Tuning, a dict or False, "
                    f"not {type(tuning).__name__}")


# -- checking one entry -------------------------------------------------------------------------
def _table(entry, where):
    if not isinstance(entry, dict):
        raise TuningFileError(f"{where}: must be an object with p, nodes and ranges")
    p, nodes = entry.get("p"), entry.get("nodes")
    if not _is_int(p) or p < 1:
        raise TuningFileError(f"{where}: \"p\" must be a process count >= 1, got {p!r}")
    where = f"{where} (p={p})"
    if (not isinstance(nodes, list) or not nodes or not all(_is_int(k) and k >= 1 for k in nodes)
            or sum(nodes) != p):
        raise TuningFileError(f"{where}: \"nodes\" must list the ranks on each node, summing "
                              f"to p (e.g. [{p}] for one node), got {nodes!r}")
    ranges = {}
    for mode in MODES:
        if mode in entry:
            ranges[mode] = _ranges(entry[mode], p, nodes, f"{where}, {mode}")
    collectives = _collectives(entry.get("collectives"), p, nodes, f"{where}, collectives")
    if not ranges and not collectives:
        raise TuningFileError(f"{where}: needs \"outofplace\" or \"inplace\" ranges, "
                              "[[max_bytes, algorithm], ...], or \"collectives\"")
    return Table(p, tuple(nodes), ranges, _model(entry.get("model"), where), collectives)


def _collectives(found, p, nodes, where):
    """An entry's "collectives": {name: ranges} checked against each collective's algorithms."""
    if found is None:
        return {}
    if not isinstance(found, dict):
        raise TuningFileError(f"{where}: must map collective names to [[max_bytes, "
                              "algorithm], ...]")
    out = {}
    for name, ranges in found.items():
        if name not in COLLECTIVE_ALGORITHMS:
            raise TuningFileError(f"{where}: {name!r} is not a collective with choices here "
                                  f"(one of {sorted(COLLECTIVE_ALGORITHMS)}; the all-reduce "
                                  "has its own ranges)")
        out[name] = _ranges(ranges, p, nodes, f"{where}, {name}", COLLECTIVE_ALGORITHMS[name])
    return out


def _ranges(ranges, p, nodes, where, names=None):
    """Checked [[max_bytes, algorithm], ...] of the all-reduce (names None) or a collective."""
    hierarchical_ok = 1 < len(nodes) < p
    names = ALLREDUCE if names is None else names
    if not isinstance(ranges, list) or not ranges:
        raise TuningFileError(f"{where}: must be a non-empty list of [max_bytes, algorithm]")
    out, last = [], -1
    for item in ranges:
        if not (isinstance(item, list) and len(item) == 2 and _is_int(item[0])):
            raise TuningFileError(f"{where}: {item!r} is not [max_bytes, algorithm]")
        max_bytes, name = item
        if name not in names:
            raise TuningFileError(f"{where}: unknown algorithm {name!r}; use one of "
                                  f"{sorted(names)}")
        if name == "hierarchical" and not hierarchical_ok:
            raise TuningFileError(f"{where}: hierarchical needs ranks on more than one node "
                                  f"and fewer than p nodes; nodes={nodes}")
        if max_bytes <= last:
            raise TuningFileError(f"{where}: max_bytes must increase, {max_bytes} follows {last}")
        out.append((max_bytes, name))
        last = max_bytes
    return tuple(out)


def _model(model, where):
    """The entry's model as a CostModel, or None if it has none or it is not a fallback."""
    if model is None:
        return None
    values = {}
    for key in ("alpha", "beta", "gamma"):
        v = model.get(key) if isinstance(model, dict) else None
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise TuningFileError(f"{where}: model.{key} must be a number of seconds >= 0 "
                                  f"(per message, per byte moved, per byte reduced), got {v!r}")
        values[key] = float(v)
    for key in ("node_alpha", "node_beta"):  # optional: the node tier's own terms
        v = model.get(key)
        if v is None:
            continue
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise TuningFileError(f"{where}: model.{key} must be a number of seconds >= 0 "
                                  f"(per counter handoff, per byte copied) or absent, got {v!r}")
        values[key] = float(v)
    fallback = model.get("fallback", True)
    if not isinstance(fallback, bool):
        raise TuningFileError(f"{where}: model.fallback must be true or false, got {fallback!r}")
    return CostModel(**values) if fallback else None


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)
