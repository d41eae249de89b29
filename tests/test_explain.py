"""`ringcoll explain`: every collective and algorithm runs and checks itself against its trace;
the ring all-reduce's table and byte totals are the ones worked out by hand from the schedule
in ring.py's docstring (rank r sends block (r - s - 1) % p at reduce-scatter step s, block
(r - s) % p at all-gather step s, to rank r + 1).
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


def ring_rows(p, n):
    """The ring all-reduce's table rows, from the docstring's formulas and np.array_split."""
    blocks = np.array_split(np.arange(n), p)
    bounds = [(int(b[0]), int(b[-1]) + 1) if b.size else None for b in blocks]
    # rank r's element i is 10 r + i; after s + 1 reduce-scatter steps block (r - s - 1) % p
    # on rank r holds the sum over ranks r, r - 1, ..., r - s
    rows = [(0, "check", "r -> r+1", "-", "-", 48, "-",
             "checks count, dtype, op match")]
    for s in range(p - 1):
        for r in range(p):
            b = (r - s - 1) % p
            if bounds[b] is None:
                continue
            lo, hi = bounds[b]
            vals = [sum(10 * ((r - j) % p) + i for j in range(s + 1)) for i in range(lo, hi)]
            rows.append((1 + s, f"reduce-scatter {s}", f"{r} -> {(r + 1) % p}", f"b{b}",
                         f"[{lo}:{hi})", 8 * (hi - lo), "[" + " ".join(map(str, vals)) + "]",
                         f"reduce into b{b} (+ its input)"))
    for s in range(p - 1):
        for r in range(p):
            b = (r - s) % p
            if bounds[b] is None:
                continue
            lo, hi = bounds[b]
            vals = [10 * p * (p - 1) // 2 + p * i for i in range(lo, hi)]
            rows.append((p + s, f"all-gather {s}", f"{r} -> {(r + 1) % p}", f"b{b}",
                         f"[{lo}:{hi})", 8 * (hi - lo), "[" + " ".join(map(str, vals)) + "]",
                         f"copy into b{b}"))
    return rows


def explained(collective, algorithm, p, n, **kw):
    example = ex_mod.Example(collective, algorithm, p, n, **kw)
    lines = []
    M, states, trace = ex_mod.explain(example, out=lines.append)
    return M, states, trace, "\n".join(lines)


@pytest.mark.parametrize("p,n", [(4, 8), (5, 7), (5, 3)])
def test_ring_allreduce_table_is_the_docstring_schedule(p, n):
    M, _, _, text = explained("allreduce", "ring", p, n)
    assert ex_mod.schedule_rows(M) == ring_rows(p, n)
    if n < p:  # empty blocks send nothing: rank 0's first block, b4, is empty at n = 3
        assert "reduce-scatter 0  0 -> 1" not in text
    else:
        assert f"reduce-scatter 0  0 -> 1    b{p - 1}" in text


def test_ring_p4_rows_by_hand():
    """A few rows of p = 4, n = 8 written out: blocks of 2, rank r's element i is 10 r + i."""
    M, _, _, _ = explained("allreduce", "ring", 4, 8)
    rows = ex_mod.schedule_rows(M)
    assert rows[1] == (1, "reduce-scatter 0", "0 -> 1", "b3", "[6:8)", 16, "[6 7]",
                       "reduce into b3 (+ its input)")
    assert rows[5] == (2, "reduce-scatter 1", "0 -> 1", "b2", "[4:6)", 16, "[38 40]",
                       "reduce into b2 (+ its input)")  # 4 + 34, 5 + 35: ranks 0 and 3
    assert rows[12] == (3, "reduce-scatter 2", "3 -> 0", "b0", "[0:2)", 16, "[60 63]",
                        "reduce into b0 (+ its input)")  # ranks 1, 2, 3: rank 0 adds [0 1]
    assert rows[13] == (4, "all-gather 0", "0 -> 1", "b0", "[0:2)", 16, "[60 64]",
                        "copy into b0")
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
    _, _, trace, text = explained("allreduce", "ring", 4, 8)
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
    _, _, trace, text = explained("allreduce", "ring", 5, 7)
    assert [trace.bytes_sent(r) for r in range(5)] == sent
    assert [trace.bytes_received(r) for r in range(5)] == got
    assert byte_rows(text) == [(r, sent[r], sent[r], got[r], got[r], "ok") for r in range(5)]


def test_ring_cost_uses_the_default_cost_model():
    _, _, _, text = explained("allreduce", "ring", 4, 8)
    assert "2(p-1) a + 2(p-1)/p n b + (p-1)/p n g" in text
    assert "= 6 a + 96 B b + 48 B g" in text
    total = ex_mod.CostModel().allreduce("ring", 64, 4)
    assert f"= {total * 1e6:.4f} us" in text


def test_states_follow_the_sums():
    _, states, _, text = explained("allreduce", "ring", 4, 8)
    label, rows = states[2]  # after reduce-scatter 0
    assert label == "reduce-scatter 0"
    vals, masks, _ = rows[1]
    assert vals[6:8].tolist() == [22, 24] and set(masks[6:8].tolist()) == {0b11}
    assert "r1  [ 10 11 | 12 13 | 14 15 | 22 24 ]   b3=0+1" in text
    assert "b0=all  b1=all  b2=all  b3=all" in text


@pytest.mark.parametrize("change", ["payload", "destination", "missing"])
def test_a_wrong_schedule_fails_loudly(change):
    example = ex_mod.Example("allreduce", "ring", 4, 8)
    results, trace, logs = ex_mod.run(example)
    M, _ = ex_mod.build_model(example)
    s = next(s for s in M.sends if s.payload is not None)
    if change == "payload":
        s.payload = s.payload + 1
    elif change == "destination":
        s.dst = (s.dst + 1) % 4
    else:
        M.sends.remove(s)
    with pytest.raises(ex_mod.ExplainError):
        ex_mod.verify(example, M, results, trace, logs)


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
    assert "more rows (all checked against the trace)" in out
    assert "left out" in out and "p = 12 > 8" in err


def test_python_dash_m():
    proc = subprocess.run([sys.executable, "-m", "ringcoll", "explain", "reduce_scatter", "-p",
                           "3", "-n", "4"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "reduce_scatter (ring) on p = 3 ranks" in proc.stdout
