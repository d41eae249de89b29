"""`ringcoll explain`: every collective and algorithm runs and its table is read off the run.

Oracles, not the explainer's own reading: the ring all-reduce's rows must be the ones worked
out from the schedule in ring.py's docstring (rank r sends block (r - s - 1) % p at
reduce-scatter step s, block (r - s) % p at all-gather step s, to rank r + 1); every rank's
final buffer must be NumPy's result on the inputs; each message must carry what its sender
held at that step for those elements; per-rank bytes must be the closed form.
"""

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ringcoll import explain as ex_mod
from ringcoll.__main__ import main as ringcoll_main
from ringcoll.arrays import Partition

ROOT = Path(__file__).resolve().parent.parent
CASES = [(c, a) for c, (algos, _) in ex_mod.COLLECTIVES.items() for a in algos if a != "auto"]


def run_cli(*argv):
    """(exit status, stdout, stderr) of `ringcoll explain ARGV`, in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = ringcoll_main(["explain", *map(str, argv)])
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("collective,algorithm", CASES)
def test_every_collective_runs_and_matches_its_trace(collective, algorithm):
    for p in (1, 2, 3, 4, 5, 7):
        sizes = (p, 2 * p, 3 * p) if collective == "alltoall" else (1, p - 1 or 1, p + 2, 2 * p)
        for n in sorted(set(sizes)):
            extra = [[]]
            if algorithm == "hierarchical":
                extra = [[], ["--local-size", 1], ["--local-size", 2], ["--local-size", 3]]
            if collective in ("broadcast", "reduce"):
                extra = [[], ["--root", p - 1]]
            for more in extra:
                rc, out, err = run_cli(collective, "-a", algorithm, "-p", p, "-n", n, *more)
                assert rc == 0, (collective, algorithm, p, n, more, err)
                assert "Result" in out and "ok" in out or p == 1


def test_auto_names_its_pick():
    rc, out, _ = run_cli("allreduce", "-a", "auto", "-p", 5, "-n", 3)
    assert rc == 0
    assert "auto picks" in out


def explained(collective, algorithm, p, n, **kw):
    example = ex_mod.Example(collective, algorithm, p, n, **kw)
    lines = []
    result = ex_mod.explain(example, out=lines.append)
    return example, result, "\n".join(lines)


def ring_rows(p, n):
    """The ring all-reduce's table rows, from the docstring's formulas and np.array_split."""
    blocks = np.array_split(np.arange(n), p)
    bounds = [(int(b[0]), int(b[-1]) + 1) if b.size else None for b in blocks]

    def who(ranks):
        return "all" if len(ranks) == p else "+".join(map(str, sorted(ranks)))

    # rank r's element i is 10 r + i; after s + 1 reduce-scatter steps block (r - s - 1) % p
    # on rank r holds the sum over ranks r, r - 1, ..., r - s. A rank skips its empty blocks,
    # so its k-th message of a phase is the k-th block it has to send.
    rows = [(0, "check", "r -> r+1", "-", "-", 48, "-", "checks count, dtype, op match")]
    for phase, first in (("reduce-scatter", 1), ("all-gather", p)):
        sent = [0] * p
        for s in range(p - 1):
            for r in range(p):
                b = (r - s - 1) % p if phase == "reduce-scatter" else (r - s) % p
                if bounds[b] is None:
                    continue
                lo, hi = bounds[b]
                ranks = [(r - j) % p for j in range(s + 1)] if first == 1 else list(range(p))
                vals = [sum(10 * j + i for j in ranks) for i in range(lo, hi)]
                frm = "x" if first == 1 and s == 0 else "out"
                does = (f"reduce into b{b} (+ its input)" if first == 1 else f"copy into b{b}")
                rows.append((first + s, f"{phase} {sent[r]}", f"{r} -> {(r + 1) % p}",
                             f"b{b}={who(ranks)}", f"{frm}[{lo}:{hi}) -> out[{lo}:{hi})",
                             8 * (hi - lo), "[" + " ".join(map(str, vals)) + "]", does))
                sent[r] += 1
    return rows


@pytest.mark.parametrize("p,n", [(4, 8), (5, 7), (5, 3), (3, 9)])
def test_ring_allreduce_table_is_the_docstring_schedule(p, n):
    ex, result, text = explained("allreduce", "ring", p, n)
    assert ex_mod.schedule_rows(ex, result.steps) == ring_rows(p, n)
    if n < p:  # empty blocks send nothing: rank 0's first block, b4, is empty at n = 3
        assert not any(s.src == 0 and s.column == 1 for s in result.steps)


def test_ring_p4_rows_by_hand():
    """A few rows of p = 4, n = 8 written out: blocks of 2, rank r's element i is 10 r + i."""
    ex, result, _ = explained("allreduce", "ring", 4, 8)
    rows = ex_mod.schedule_rows(ex, result.steps)
    assert rows[1] == (1, "reduce-scatter 0", "0 -> 1", "b3=0", "x[6:8) -> out[6:8)", 16,
                       "[6 7]", "reduce into b3 (+ its input)")
    assert rows[5] == (2, "reduce-scatter 1", "0 -> 1", "b2=0+3", "out[4:6) -> out[4:6)", 16,
                       "[38 40]", "reduce into b2 (+ its input)")  # 4 + 34, 5 + 35
    assert rows[12] == (3, "reduce-scatter 2", "3 -> 0", "b0=1+2+3", "out[0:2) -> out[0:2)",
                        16, "[60 63]", "reduce into b0 (+ its input)")  # rank 0 adds [0 1]
    assert rows[13] == (4, "all-gather 0", "0 -> 1", "b0=all", "out[0:2) -> out[0:2)", 16,
                        "[60 64]", "copy into b0")
    assert len(rows) == 1 + 2 * 3 * 4


def byte_rows(text):
    start = text.index("rank  sent (trace)")
    rows = []
    for line in text[start:].splitlines()[1:]:
        parts = line.split()
        if not parts or not parts[0].isdigit():
            break
        rows.append(tuple(int(x) for x in parts[:5]) + (parts[5],))
    return rows


def test_ring_byte_totals_p4():
    # 2(p-1)/p n = 2 * 3/4 * 64 B = 96 B each way, plus the 48-byte header
    _, result, text = explained("allreduce", "ring", 4, 8)
    trace = result.values.trace
    assert [trace.bytes_sent(r) for r in range(4)] == [144] * 4
    assert [trace.bytes_received(r) for r in range(4)] == [144] * 4
    assert byte_rows(text) == [(r, 144, 144, 144, 144, "ok") for r in range(4)]


def test_ring_byte_totals_p5_uneven():
    # n = 7 on 5 ranks: blocks of 2, 2, 1, 1, 1 elements. Rank r sends every block but r
    # in the reduce-scatter and every block but r + 1 in the all-gather: 2n - c[r] - c[r+1]
    # elements; receives every block but r - 1, then every block but r.
    c = [2, 2, 1, 1, 1]
    sent = [48 + 8 * (14 - c[r] - c[(r + 1) % 5]) for r in range(5)]
    got = [48 + 8 * (14 - c[(r - 1) % 5] - c[r]) for r in range(5)]
    assert sent == [128, 136, 144, 144, 136] and got == [136, 128, 136, 144, 144]
    _, result, text = explained("allreduce", "ring", 5, 7)
    trace = result.values.trace
    assert [trace.bytes_sent(r) for r in range(5)] == sent
    assert [trace.bytes_received(r) for r in range(5)] == got
    assert byte_rows(text) == [(r, sent[r], sent[r], got[r], got[r], "ok") for r in range(5)]


def test_ring_cost_uses_the_default_cost_model():
    _, _, text = explained("allreduce", "ring", 4, 8)
    assert "2(p-1) a + 2(p-1)/p n b + (p-1)/p n g" in text
    assert "= 6 a + 96 B b + 48 B g" in text
    total = ex_mod.CostModel().allreduce("ring", 64, 4)
    assert f"= {total * 1e6:.4f} us" in text


def test_states_follow_the_sums():
    _, result, text = explained("allreduce", "ring", 4, 8)
    vals, masks = result.buffers.after(1, 1)  # rank 1 after reduce-scatter 0 (step 1)
    assert vals[6:8].tolist() == [22, 24] and masks[6:8].tolist() == [0b11, 0b11]
    assert "r1  [ 10 11 | 12 13 | 14 15 | 22 24 ]   b3=0+1" in text
    assert "b0=all  b1=all  b2=all  b3=all" in text


def _numpy(ex):
    """Every rank's result by NumPy on the example's inputs (None where it returns None)."""
    xs, p, part = ex.inputs(), ex.p, Partition.even(ex.n, ex.p)
    total = np.sum(xs, axis=0)
    return {"allreduce": [total] * p,
            "reduce_scatter": [total[part.slices[r]] for r in range(p)],
            "reduce": [total if r == ex.root else None for r in range(p)],
            "allgather": [np.concatenate(xs)] * p, "broadcast": [xs[ex.root]] * p,
            "alltoall": [np.concatenate([x[part.slices[r]] for x in xs]) for r in range(p)],
            }[ex.collective]


SHAPES = [("allreduce", a, {}) for a in ("ring", "recursive_doubling", "rabenseifner",
                                         "bruck")] + [
    ("allreduce", "hierarchical", dict(nodes=[[0, 1, 2], [3, 4]], inner=i))
    for i in ("ring", "recursive_doubling", "rabenseifner", "bruck")] + [
    ("reduce_scatter", "ring", {}), ("allgather", "ring", {}), ("alltoall", "pairwise", {}),
    ("broadcast", "tree", dict(root=2)), ("reduce", "tree", dict(root=3))]


@pytest.mark.parametrize("collective,algorithm,kw", SHAPES)
def test_buffers_end_as_numpy_and_messages_carry_the_senders_state(collective, algorithm, kw):
    """Against independent oracles, at p = 5 on n = 10 (uneven blocks for p' = 4 and L = 3):
    - every rank's last buffer is NumPy's result (a reduce_scatter's: its block; a reduce's
      non-root ranks hold no complete sum);
    - every data message's values are its labels' sums of the inputs (NumPy on the labelled
      ranks' inputs), and equal what its sender held for those elements and ranks before
      sending it: the buffer it shows (or for Bruck's slots, ranks it had heard from);
    - every rank's bytes are the closed form's."""
    ex, result, _ = explained(collective, algorithm, 5, 10, **kw)
    xs = ex.inputs()
    last = max(s.column for s in result.steps)
    for r, want in enumerate(_numpy(ex)):
        got = result.buffers.after(r, last)[0].tolist()
        if collective == "reduce_scatter":
            got = got[Partition.even(ex.n, ex.p).slices[r]]
        if want is not None:
            assert got == want.tolist(), (r, got, want)
        assert (result.values.results[r] is None) == (want is None)
    full = [x if x.size == ex.n else np.r_[np.zeros(ex.owned(j).start, int), x,
                                           np.zeros(ex.n - ex.owned(j).stop, int)]
            for j, x in enumerate(xs)]  # allgather: each rank's block in place
    for s in result.steps:
        if s.cells is None:
            continue
        elements, masks = s.cells
        for v, i, mask in zip(s.values.tolist(), elements.tolist(), masks.tolist()):
            assert v == sum(full[j][i] for j in range(ex.p) if mask >> j & 1)
        if collective == "alltoall":  # sent straight from x, untouched
            name, lo = s.frm
            assert name == "x" and s.values.tolist() == xs[s.src][lo:][:s.values.size].tolist()
        elif algorithm == "bruck" or kw.get("inner") == "bruck":
            assert all(m & result.knows[s.column][s.src] == m for m in masks.tolist())
        else:
            vals, held = result.buffers.after(s.src, s.column - 1)
            assert vals[elements].tolist() == s.values.tolist(), s
            assert held[elements].tolist() == masks.tolist(), s
    text, rows = ex_mod.byte_formula(ex)
    trace = result.values.trace
    assert [(trace.bytes_sent(r), trace.bytes_received(r)) for r in range(ex.p)] == rows


def test_steps_are_read_off_the_run():
    """Steps come from what each rank waited for: recursive doubling at p = 4 is two exchange
    steps; a binomial broadcast from root 2 of 5 ranks takes three rounds, the root sending
    in each (v = 4 first, the largest subtree) while v = 2 passes it on in the last."""
    _, rd, _ = explained("allreduce", "recursive_doubling", 4, 4)
    assert sorted((s.column, s.phase, s.src, s.dst) for s in rd.steps) == [
        (k, f"exchange {k}", r, r ^ (1 << k)) for k in (0, 1) for r in range(4)]
    _, tree, _ = explained("broadcast", "tree", 5, 3, root=2)
    assert sorted((s.column, s.phase, s.src, s.dst) for s in tree.steps) == [
        (0, "round 0", 2, 1), (1, "round 1", 2, 4), (2, "round 2", 2, 3), (2, "round 2", 4, 0)]


def test_scratch_is_named_honestly():
    """Rabenseifner reduces in scratch after its first halving; Bruck keeps other ranks'
    inputs in scratch and says so in the state table."""
    _, rab, _ = explained("allreduce", "rabenseifner", 4, 8)
    second = [s for s in rab.steps if s.phase == "halving 1"]
    assert len(second) == 4 and all(s.frm is None and s.to is None for s in second)
    _, _, text = explained("allreduce", "bruck", 3, 2)
    assert "r0  [  0  1 ]   has rank 1's input in scratch, not yet added" in text


@pytest.mark.parametrize("change", ["payload", "destination", "result"])
def test_a_wrong_run_fails_loudly(change, monkeypatch):
    """A message carrying a wrong sum, the two runs disagreeing, or a wrong result: each is
    an ExplainError (exit status 1), never a silently wrong table."""
    real = ex_mod.run

    def tampered(ex, labels, snapshots):
        run = real(ex, labels, snapshots)
        if not labels:
            m = next(m for m in run.trace.messages if m.tag == "ring_reduce_scatter")
            if change == "payload":
                m.payload = m.payload + 1
            elif change == "destination":
                m.dst = (m.dst + 1) % ex.p
            else:
                run.results[0] = run.results[0] + 1
        return run

    monkeypatch.setattr(ex_mod, "run", tampered)
    with pytest.raises(ex_mod.ExplainError):
        ex_mod.explain(ex_mod.Example("allreduce", "ring", 4, 8), out=lambda line: None)
    rc, _, err = run_cli("allreduce", "-p", 4, "-n", 8)
    assert rc == 1 and "disagrees" in err


def test_no_private_communicator_internals():
    source = Path(ex_mod.__file__).read_text()
    assert "._t" not in source and "_swap_transport" not in source


def test_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "ring.png"
    rc, out, err = run_cli("allreduce", "-p", 4, "-n", 8, "--png", path)
    assert rc == 0, err
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {path}" in out


def test_png_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rc, _, err = run_cli("allreduce", "-p", 3, "--png", tmp_path / "x.png")
    assert rc == 2
    assert "pip install -e '.[bench]'" in err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("argv,words", [
    (("alltoall", "-p", 3, "-n", 4), "multiple of p = 3"),
    (("allreduce", "-a", "tree"), "no algorithm 'tree'"),
    (("broadcast", "-p", 3, "--root", 3), "--root"),
    (("allreduce", "-p", 0), "-p must be"),
    (("allreduce", "--local-size", 2), "hierarchical"),
])
def test_bad_arguments(argv, words):
    rc, _, err = run_cli(*argv)
    assert rc == 2 and words in err


def test_many_ranks_abbreviate():
    rc, out, err = run_cli("allreduce", "-p", 12, "-n", 30)
    assert rc == 0
    assert "more rows (all checked)" in out
    assert "left out" in out and "p = 12 > 8" in err


def test_python_dash_m():
    proc = subprocess.run([sys.executable, "-m", "ringcoll", "explain", "reduce_scatter", "-p",
                           "3", "-n", "4"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "reduce_scatter (ring) on p = 3 ranks" in proc.stdout
