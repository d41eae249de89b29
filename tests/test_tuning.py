"""Tuning tables: how `auto` reads them, the errors a bad file gives, and the tuner itself.

Selection logic runs on the thread transport (ringcoll.run_threads), which only uses a table
when one is passed explicitly (tuning= or RINGCOLL_TUNING); the tuner's arithmetic (crossovers,
the fit, merging files) is tested as plain functions; and two real mpiexec launches check that
`python -m ringcoll.tune --quick` writes a file that loads and that `auto` follows a
hand-written table under MPI, in place and out of place.
"""

import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import _mpirun as mpirun

import ringcoll
from ringcoll import tune
from ringcoll.algorithms import FLAT, CostModel
from ringcoll.tuning import FORMAT, VERSION, Tuning, TuningFileError

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 20  # seconds a thread rank may wait for a message
LAUNCH_TIMEOUT = 120  # seconds per mpiexec launch: a hang fails the test instead


def tuning_file(*entries):
    return {"format": FORMAT, "version": VERSION, "entries": list(entries)}


def entry(p, nodes=None, **modes):
    return {"p": p, "nodes": nodes or [p], **modes}


def run(p, fn, **options):
    options.setdefault("timeout", TIMEOUT)
    return ringcoll.run_threads(p, fn, **options)


def debug_choices(capsys):
    """The algorithms rank 0's debug log says each allreduce ran, in order."""
    err = capsys.readouterr().err
    return [line.rsplit("-> ", 1)[1] for line in err.splitlines() if "allreduce" in line]


# -- looking up a table --------------------------------------------------------------------------
FOUR = entry(4, outofplace=[[1024, "recursive_doubling"], [1 << 20, "rabenseifner"],
                            [1 << 30, "ring"]],
             inplace=[[64, "ring"], [4096, "recursive_doubling"]])


def test_lookup_uses_the_first_range_that_reaches_nbytes_and_the_last_beyond_them():
    t = Tuning.from_dict(tuning_file(FOUR))
    one_node = [[0, 1, 2, 3]]
    expect = {8: "recursive_doubling", 1024: "recursive_doubling", 1025: "rabenseifner",
              1 << 20: "rabenseifner", (1 << 20) + 4: "ring", 1 << 34: "ring"}
    for nbytes, name in expect.items():
        assert t.choose(nbytes, 4, one_node, inplace=False) == name, nbytes
    assert [t.choose(n, 4, one_node, inplace=True) for n in (8, 64, 65, 4096, 1 << 30)] == [
        "ring", "ring", "recursive_doubling", "recursive_doubling", "recursive_doubling"]


def test_lookup_needs_the_exact_process_count_and_node_shape():
    t = Tuning.from_dict(tuning_file(FOUR, entry(4, [2, 2], outofplace=[[8, "hierarchical"]])))
    assert t.choose(8, 3, [[0, 1, 2]]) is None  # no table for p=3
    assert t.choose(8, 4, [[0, 1], [2, 3]]) == "hierarchical"
    assert t.choose(8, 4, [[0, 1, 2], [3]]) is None  # same p, another node shape


def test_a_mode_missing_from_a_hand_written_entry_uses_the_other():
    t = Tuning.from_dict(tuning_file(entry(2, outofplace=[[8, "ring"]]),
                                     entry(3, inplace=[[8, "rabenseifner"]])))
    assert t.choose(100, 2, [[0, 1]], inplace=True) == "ring"
    assert t.choose(100, 3, [[0, 1, 2]], inplace=False) == "rabenseifner"


def test_the_fallback_model_is_the_fit_at_the_closest_process_count():
    model = {"alpha": 1e-6, "beta": 0.0, "gamma": 0.0}
    t = Tuning.from_dict(tuning_file(
        entry(2, outofplace=[[8, "ring"]], model=model),
        entry(4, outofplace=[[8, "ring"]], model={**model, "alpha": 4e-6}),
        entry(8, outofplace=[[8, "ring"]]),  # no fit: the defaults
        entry(16, outofplace=[[8, "ring"]], model={**model, "fallback": False})))  # a record
    assert t.cost_model(2).alpha == 1e-6
    assert t.cost_model(3).alpha == 1e-6  # a tie between 2 and 4: the smaller
    assert t.cost_model(5).alpha == 4e-6
    assert t.cost_model(7) is None and t.cost_model(64) is None
    assert Tuning.from_dict(tuning_file()).cost_model(2) is None


# -- the Communicator follows the table -----------------------------------------------------------
def test_auto_follows_the_table_in_place_and_out_of_place(capsys, tmp_path):
    table = entry(3, outofplace=[[64, "rabenseifner"], [1 << 30, "ring"]],
                  inplace=[[64, "ring"], [1 << 30, "rabenseifner"]])
    path = tmp_path / "t.json"
    path.write_text(json.dumps(tuning_file(table)))

    def fn(comm):
        x = np.arange(8, dtype=np.float64) + comm.rank  # 64 B
        y = comm.allreduce(x)
        comm.allreduce(x, out=x)
        big = np.ones(1000)  # 8000 B
        comm.allreduce(big)
        comm.allreduce(big, out=big)
        return y, x, big, comm.auto_algorithm(64), comm.auto_algorithm(64, inplace=True)

    for tuning in (str(path), path, Tuning.load(path), tuning_file(table)):
        capsys.readouterr()
        results = run(3, fn, debug=True, tuning=tuning)
        assert debug_choices(capsys) == ["rabenseifner", "ring", "ring", "rabenseifner"]
        expect = 3 * np.arange(8) + 3
        for y, x, big, out_pick, in_pick in results:
            assert y.tolist() == expect.tolist() and x.tolist() == expect.tolist()
            assert big.tolist() == [3.0] * 1000
            assert (out_pick, in_pick) == ("rabenseifner", "ring")


def test_tuning_from_the_environment_and_the_keyword_wins(monkeypatch, capsys, tmp_path):
    forced = tmp_path / "forced.json"
    forced.write_text(json.dumps(tuning_file(entry(4, outofplace=[[8, "ring"]]))))
    monkeypatch.setenv("RINGCOLL_TUNING", str(forced))

    def fn(comm):
        comm.allreduce(np.ones(2))
        return comm.tuning

    capsys.readouterr()
    assert run(4, fn, debug=True)[0].source == str(forced)
    assert debug_choices(capsys) == ["ring"]  # the cost model says recursive_doubling here
    run(4, fn, debug=True, tuning=False)
    assert debug_choices(capsys) == ["recursive_doubling"]
    monkeypatch.setenv("RINGCOLL_TUNING", "none")
    assert run(4, fn, debug=True) == [None] * 4
    assert debug_choices(capsys) == ["recursive_doubling"]


def test_the_thread_transport_gets_no_built_in_table():
    assert run(2, lambda comm: comm.tuning) == [None, None]
    assert run(2, lambda comm: comm.cost_model) == [CostModel(), CostModel()]


def test_without_a_table_for_p_the_cost_model_decides(capsys):
    latency = {"alpha": 1.0, "beta": 0.0, "gamma": 0.0}  # only steps count (no Bruck at 1 MiB)
    tuning = tuning_file(entry(2, outofplace=[[8, "ring"]], model=latency))

    def fn(comm):
        comm.allreduce(np.ones(1 << 17))  # 1 MiB: the default model says ring at p=3
        return comm.cost_model

    capsys.readouterr()
    assert run(3, fn, debug=True, tuning=tuning)[0] == CostModel(**latency)
    assert debug_choices(capsys) == ["recursive_doubling"]
    mine = CostModel(alpha=0.0, beta=1.0, gamma=1.0)  # an explicit cost_model= wins
    assert run(3, fn, debug=True, tuning=tuning, cost_model=mine)[0] == mine
    assert debug_choices(capsys) == ["node"]  # bytes only: the tier copies each byte once
    assert run(3, fn, debug=True, tuning=tuning, cost_model=mine, node_tier=False)[0] == mine
    assert debug_choices(capsys) == ["ring"]


def test_explicit_algorithm_and_ringcoll_algo_win_over_the_table(monkeypatch, capsys):
    tuning = tuning_file(entry(2, outofplace=[[1 << 30, "ring"]]))

    def fn(comm):
        comm.allreduce(np.ones(4), algorithm="rabenseifner")
        comm.allreduce(np.ones(4))

    capsys.readouterr()
    run(2, fn, debug=True, tuning=tuning)
    assert debug_choices(capsys) == ["rabenseifner", "ring"]
    monkeypatch.setenv("RINGCOLL_ALGO", "recursive_doubling")
    run(2, fn, debug=True, tuning=tuning)
    assert debug_choices(capsys) == ["rabenseifner", "recursive_doubling"]


def test_hierarchical_tables_apply_across_nodes_only(capsys):
    tuning = tuning_file(entry(4, [2, 2], outofplace=[[1 << 30, "hierarchical"]]),
                         entry(4, outofplace=[[1 << 30, "rabenseifner"]]))

    def fn(comm):
        return comm.allreduce(np.array([comm.rank]))

    capsys.readouterr()
    assert [y.tolist() for y in run(4, fn, debug=True, tuning=tuning, local_size=2)] == [[6]] * 4
    assert run(4, fn, debug=True, tuning=tuning)[0].tolist() == [6]
    assert debug_choices(capsys) == ["hierarchical", "rabenseifner"]


def test_the_bench_labels_auto_with_the_in_place_choice():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from allreduce import SPEC
    finally:
        sys.path.remove(str(ROOT / "bench"))
    tuning = tuning_file(entry(2, outofplace=[[8, "ring"]], inplace=[[8, "rabenseifner"]]))
    picks = run(2, lambda comm: (SPEC.picked(comm, 8, False), SPEC.picked(comm, 8, True)),
                tuning=tuning)
    assert picks == [("ring", "rabenseifner")] * 2


# -- bad files ------------------------------------------------------------------------------------
def write(tmp_path, text):
    path = tmp_path / "bad.json"
    path.write_text(text if isinstance(text, str) else json.dumps(text))
    return path


@pytest.mark.parametrize("content, message", [
    ("{not json", "is not valid JSON"),
    ({"entries": []}, "is not a ringcoll tuning file"),
    ({"format": FORMAT, "version": 99, "entries": []}, "has format version 99"),
    ({"format": FORMAT, "version": VERSION}, 'no "entries" list'),
    (tuning_file(entry(2, outofplace=[[8, "bogus"]])), "unknown algorithm 'bogus'"),
    (tuning_file(entry(2, outofplace=[[8, "native"]])), "unknown algorithm 'native'"),
    (tuning_file(entry(2, outofplace=[[64, "ring"], [8, "ring"]])), "max_bytes must increase"),
    (tuning_file(entry(2, outofplace=[[8, "hierarchical"]])), "hierarchical needs ranks"),
    (tuning_file(entry(4, [1, 1, 1, 1], outofplace=[[8, "hierarchical"]])),
     "hierarchical needs ranks"),
    (tuning_file(entry(4, [2, 1], outofplace=[[8, "ring"]])), "summing to p"),
    (tuning_file(entry(0, [1], outofplace=[[8, "ring"]])), "process count >= 1"),
    (tuning_file(entry(2)), 'needs "outofplace" or "inplace"'),
    (tuning_file(entry(2, outofplace=[[8, "ring"]]), entry(2, inplace=[[8, "ring"]])),
     "a second entry for p=2"),
    (tuning_file(entry(2, outofplace=[[8, "ring"]], model={"alpha": -1, "beta": 0, "gamma": 0})),
     "model.alpha must be a number of seconds >= 0"),
    (tuning_file(entry(2, outofplace=[["8", "ring"]])), "is not [max_bytes, algorithm]"),
    (tuning_file(entry(2, outofplace=[[8, "ring"]],
                       model={"alpha": 0, "beta": 0, "gamma": 0, "fallback": "yes"})),
     "model.fallback must be true or false"),
])
def test_a_bad_file_names_itself_and_the_problem(tmp_path, content, message):
    path = write(tmp_path, content)
    with pytest.raises(TuningFileError, match=None) as info:
        Tuning.load(path)
    text = str(info.value)
    assert message in text and str(path) in text, text
    with pytest.raises(TuningFileError):  # the Communicator refuses it, on every rank
        run(2, lambda comm: None, tuning=str(path))


def test_a_missing_file_says_how_to_make_one(tmp_path, monkeypatch):
    missing = tmp_path / "nope.json"
    with pytest.raises(TuningFileError, match="does not exist.*python -m ringcoll.tune"):
        Tuning.load(missing)
    monkeypatch.setenv("RINGCOLL_TUNING", str(missing))
    with pytest.raises(ringcoll.RingcollError, match="nope.json"):
        run(2, lambda comm: None)
    with pytest.raises(ValueError):  # TuningFileError is a ValueError too
        Tuning.load(missing)
    with pytest.raises(TypeError, match="tuning= takes a path"):
        run(2, lambda comm: None, tuning=42)


def test_the_built_in_table_loads_and_was_measured_by_tune():
    builtin = Tuning.builtin()
    assert {t.p for t in builtin.tables} >= {2, 3, 4}
    for table in builtin.tables:
        assert table.nodes == (table.p,), "the shipped tables are for one node"
        assert set(table.ranges) == {"outofplace", "inplace"}
    # the installed copy (package data), which is what Tuning.builtin() read
    shipped = json.loads((Path(ringcoll.__file__).parent / "tuning_default.json").read_text())
    for e in shipped["entries"]:
        assert {"model", "measured", "mpi_library", "command"} <= set(e), e["p"]


def test_each_mpi_library_gets_the_table_measured_with_it():
    """The built-in table follows the MPI library's version string: Open MPI's own table for
    Open MPI, the MPICH one for MPICH and any other; both shipped, both measured by tune (and
    the collectives by bench/collectives_sweep.py) with the library they are for."""
    ompi = Tuning.builtin("Open MPI v5.0.11, package: Open MPI user Distribution")
    mpich = Tuning.builtin("MPICH Version: 5.0.2")
    assert ompi.source.endswith("tuning_openmpi.json") and {t.p for t in ompi.tables} >= {2, 3, 4}
    assert mpich.source.endswith("tuning_default.json")
    assert Tuning.builtin("Intel(R) MPI Library 2021").source == mpich.source
    folder = Path(ringcoll.__file__).parent
    for name, start in (("tuning_openmpi.json", "Open MPI"), ("tuning_default.json", "MPICH")):
        entries = json.loads((folder / name).read_text())["entries"]
        assert entries and all(e["mpi_library"].startswith(start) for e in entries), name
        assert all("collectives" in e for e in entries if e["p"] in (2, 3, 4)), name


# -- the tuner's arithmetic -----------------------------------------------------------------------
def test_crossovers_pick_within_the_slack_with_the_fewest_switches():
    sizes = [8, 32, 128, 512, 2048, 8192]
    times = {"recursive_doubling": [1.0, 1.0, 1.0, 5.0, 9.0, 9.0],
             "ring": [2.0, 0.97, 2.0, 4.0, 3.0, 2.0],  # 3% ahead at 32 B: noise, no crossover
             "rabenseifner": [3.0, 3.0, 3.0, 3.5, 3.5, 2.05]}  # 2.5% behind ring at 8 KiB
    assert tune.crossovers(sizes, times) == [[128, "recursive_doubling"], [512, "rabenseifner"],
                                             [8192, "ring"]]
    # fewest switches first: rabenseifner stays on through 8 KiB, if allowed 5% there
    times["rabenseifner"][4] = 3.14
    assert tune.crossovers(sizes, times) == [[128, "recursive_doubling"],
                                             [8192, "rabenseifner"]]
    # no slack: the fastest at every size, however small its lead
    assert tune.crossovers(sizes, times, slack=0.0) == [
        [8, "recursive_doubling"], [32, "ring"], [128, "recursive_doubling"],
        [512, "rabenseifner"], [8192, "ring"]]


def test_crossovers_stay_within_the_slack_everywhere():
    rng = np.random.default_rng(7)
    sizes = list(range(40))
    for _ in range(50):
        times = {name: list(rng.uniform(1.0, 1.3, len(sizes))) for name in ("a", "b", "c")}
        ranges = tune.crossovers(sizes, times)
        assert ranges[-1][0] == sizes[-1]
        for i in sizes:
            pick = next(name for top, name in ranges if i <= top)
            assert times[pick][i] <= 1.05 * min(t[i] for t in times.values())


@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_the_fit_recovers_a_model_from_its_own_predictions(p):
    truth = CostModel(alpha=8e-6, beta=0.03e-9, gamma=0.2e-9)
    sizes = tune.make_sizes(8, 64 << 20, 4)
    times = {name: [truth.allreduce(name, n, p) for n in sizes]
             for name in ("ring", "recursive_doubling", "rabenseifner")}
    model, rms = tune.fit(sizes, times, p)
    assert rms < 1e-6
    for key in ("alpha", "beta", "gamma"):
        assert getattr(model, key) == pytest.approx(getattr(truth, key), rel=1e-6)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_the_fit_recovers_the_node_tier_terms(p):
    truth = CostModel(alpha=8e-6, beta=0.03e-9, gamma=0.2e-9, node_alpha=2e-6,
                      node_beta=0.3e-9)
    sizes = tune.make_sizes(8, 64 << 20, 4)
    names = ("ring", "recursive_doubling", "rabenseifner", "node")
    times = {name: [truth.allreduce(name, n, p) for n in sizes] for name in names}
    model, rms = tune.fit(sizes, times, p)
    assert rms < 1e-6
    for key in tune.FITTED:
        assert getattr(model, key) == pytest.approx(getattr(truth, key), rel=1e-6), key
    # without node measurements the tier's terms stay unfitted (None: derived from beta)
    del times["node"]
    assert tune.fit(sizes, times, p)[0].node_beta is None


def test_a_fitted_node_beta_moves_the_model_off_the_tier():
    """Derived terms price a byte through the tier at beta / 2, so the tier wins every large
    size; a fitted node_beta above beta (MPICH's single-copy sends) hands them to the ring."""
    derived = CostModel(alpha=3e-6, beta=0.1e-9, gamma=0.05e-9)
    fitted = CostModel(alpha=3e-6, beta=0.1e-9, gamma=0.05e-9, node_alpha=3e-6,
                       node_beta=0.2e-9)
    nodes = [[0, 1]]
    assert derived.choose_allreduce(64 << 20, 2, nodes, tier=True) == "node"
    assert fitted.choose_allreduce(64 << 20, 2, nodes, tier=True) == "ring"
    assert fitted.allreduce("node", 64 << 20, 2) > fitted.allreduce("ring", 64 << 20, 2)


def test_ties_go_to_the_algorithm_faster_at_p4_too():
    sizes = [1024, 2048, 4096]
    times = {"ring": [1.00, 1.00, 1.00], "node": [1.03, 0.99, 1.04], "rabenseifner": [2, 2, 2]}
    assert tune.crossovers(sizes, times) == [[4096, "ring"]]
    # at p = 4 the tier was 20% ahead at every size: within 5% here, so take it
    reference = {n: {"ring": 1.2, "node": 1.0, "rabenseifner": 3.0} for n in sizes}
    assert tune.crossovers(sizes, times, reference=reference) == [[4096, "node"]]
    # the reference never overrides a clear winner here (rabenseifner best at p=4, 2x here)
    reference = {n: {"ring": 1.2, "node": 1.1, "rabenseifner": 0.5} for n in sizes}
    assert tune.crossovers(sizes, times, reference=reference) == [[4096, "node"]]
    # sizes the reference lacks keep every near candidate: the tier, forced at 1 KiB, then
    # stays on (fewest switches), 4% behind at 4 KiB
    assert tune.crossovers(sizes, times, reference={1024: {"node": 1.0, "ring": 2.0}}) == \
        [[4096, "node"]]
    times["node"][2] = 1.2  # unless it falls out of the slack there
    assert tune.crossovers(sizes, times, reference={1024: {"node": 1.0, "ring": 2.0}}) == \
        [[2048, "node"], [4096, "ring"]]


def test_the_tie_break_reference_comes_from_the_files_p4_entry():
    measured = {"sizes": [8, 16], "outofplace": {"ring": [5.0, None], "node": [4.0, 6.0]}}
    p4 = {**entry(4, outofplace=[[8, "ring"]]), "measured": measured}
    data = tuning_file(p4, entry(2, outofplace=[[8, "ring"]]))
    ref = tune.tie_break_reference(data, 2, [[0, 1]], "outofplace")
    assert ref == {8: {"ring": 5e-6, "node": 4e-6}, 16: {"ring": math.inf, "node": 6e-6}}
    assert tune.tie_break_reference(data, 4, [[0, 1, 2, 3]], "outofplace") is None  # itself
    assert tune.tie_break_reference(data, 2, [[0], [1]], "outofplace") is None  # two nodes
    assert tune.tie_break_reference(data, 2, [[0, 1]], "inplace") is None  # not measured
    assert tune.tie_break_reference(None, 2, [[0, 1]], "outofplace") is None


def test_accumulate_takes_the_median_over_launches():
    sizes = [8, 16]
    like = {"outofplace": {"ring": [0, 0], "node": [0, 0]},
            "inplace": {"ring": [0, 0], "node": [0, 0]}}
    runs = [{m: {"ring": [1.0, 9.0], "node": [2.0, 3.0]} for m in ("outofplace", "inplace")},
            {m: {"ring": [3.0, 1.0], "node": [2.0, math.inf]} for m in ("outofplace", "inplace")},
            {m: {"ring": [2.0, 2.0], "node": [7.0, 4.0]} for m in ("outofplace", "inplace")}]
    med = tune.median_of(runs, sizes)
    assert med["outofplace"] == {"ring": [2.0, 2.0], "node": [2.0, 4.0]}
    stored = {"sizes": sizes, "launches": [tune.seconds_to_us(r) for r in runs[:2]]}
    data = tuning_file({**entry(2, outofplace=[[8, "ring"]]), "measured": stored})
    back = tune.earlier_launches(data, 2, [[0, 1]], sizes, like)
    assert back[1]["inplace"]["node"] == [2.0, math.inf] and len(back) == 2  # seconds again
    # other sizes, another p or another set of algorithms: start afresh
    assert tune.earlier_launches(data, 2, [[0, 1]], [8, 32], like) == []
    assert tune.earlier_launches(data, 3, [[0, 1, 2]], sizes, like) == []
    fewer = {m: {"ring": [0, 0]} for m in ("outofplace", "inplace")}
    assert tune.earlier_launches(data, 2, [[0, 1]], sizes, fewer) == []


def test_a_files_node_terms_reach_the_fallback_model():
    e = entry(3, outofplace=[[8, "ring"]])
    e["model"] = {"alpha": 1e-6, "beta": 1e-10, "gamma": 0.0, "node_beta": 2e-10}
    model = Tuning.from_dict(tuning_file(e)).cost_model(3)
    assert model.node_beta == 2e-10 and model.node_alpha is None
    e["model"]["node_alpha"] = -1.0
    with pytest.raises(TuningFileError, match="node_alpha"):
        Tuning.from_dict(tuning_file(e))


def test_the_fit_never_goes_negative():
    a = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]])
    b = np.array([3.0, 2.0, 1.0])  # a falling line: unconstrained slope -1
    x = tune._nonnegative_least_squares(a, b)
    assert x[1] == 0 and x[0] == pytest.approx(2.0)


def test_make_sizes_and_parse_size():
    assert tune.make_sizes(8, 64 << 20, 4)[:3] == [8, 32, 128]
    assert tune.make_sizes(8, 64 << 20, 4)[-1] == 32 << 20
    assert tune.make_sizes(1, 10, 2) == [4, 8]  # whole float32 elements, no repeats
    assert [tune.parse_size(s) for s in ("8", "64K", "64M", "1G", "2kb")] == [
        8, 64 << 10, 64 << 20, 1 << 30, 2 << 10]


def test_merge_replaces_its_own_entry_and_keeps_the_others():
    old = tuning_file(entry(3, outofplace=[[8, "ring"]]), entry(2, outofplace=[[8, "ring"]]))
    new = entry(2, outofplace=[[8, "rabenseifner"]])
    merged = tune.merge(old, new)
    assert [(e["p"], e["outofplace"][0][1]) for e in merged["entries"]] == [
        (2, "rabenseifner"), (3, "ring")]
    Tuning.from_dict(merged)
    assert tune.merge(None, new)["entries"] == [new]


def test_write_atomic_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "t.json"
    tune.write_atomic(str(path), tuning_file(entry(2, outofplace=[[8, "ring"]])))
    assert Tuning.load(path).choose(8, 2, [[0, 1]]) == "ring"
    assert os.listdir(tmp_path) == ["t.json"]


# -- real mpiexec launches ------------------------------------------------------------------------
needs_mpi = mpirun.needs_mpi


def launch(nprocs, args, env_extra=None, timeout=LAUNCH_TIMEOUT):
    """mpiexec -n nprocs python args; returns (returncode or None on a hang, output)."""
    rc, out, _ = mpirun.launch(nprocs, args, env=env_extra, timeout=timeout)
    return rc, out


@needs_mpi
def test_tune_quick_writes_a_file_that_loads_and_keeps_other_entries(tmp_path):
    out = tmp_path / "tuning.json"
    other = entry(3, outofplace=[[8, "ring"]])
    out.write_text(json.dumps(tuning_file(other)))
    start = time.time()
    rc, log = launch(2, ["-m", "ringcoll.tune", "--quick", "-q", "-o", str(out)])
    assert rc == 0, log
    assert time.time() - start < LAUNCH_TIMEOUT
    assert "fitted cost model" in log and "crossovers" in log, log
    tuning = Tuning.load(out)
    table = tuning.table(2, [[0, 1]])
    assert table is not None and set(table.ranges) == {"outofplace", "inplace"}
    assert tuning.table(3, [[0, 1, 2]]) is not None, "the p=3 entry must survive"
    data = json.loads(out.read_text())
    mine = next(e for e in data["entries"] if e["p"] == 2)
    assert mine["nodes"] == [2] and mine["mpi_library"] and mine["hosts"]
    assert set(mine["measured"]["outofplace"]) == set(FLAT) | {"node"}  # one node: the tier
    assert all(v > 0 for v in mine["measured"]["inplace"]["ring"])
    assert [n for n in os.listdir(tmp_path)] == ["tuning.json"]


@needs_mpi
def test_tune_refuses_to_overwrite_a_file_that_is_not_a_tuning_file(tmp_path):
    precious = tmp_path / "notes.json"
    precious.write_text('{"mine": 1}')
    rc, log = launch(2, ["-m", "ringcoll.tune", "--quick", "-q", "-o", str(precious)])
    assert rc == 2 and "not a usable tuning file" in log, log
    assert precious.read_text() == '{"mine": 1}'


SCRIPT = """
import numpy as np, ringcoll
from mpi4py import MPI
comm = ringcoll.Communicator()
x = np.ones(256, np.float32)            # 1 KiB
y = comm.allreduce(x)
comm.allreduce(x, out=x)
assert y[0] == comm.size and x[0] == comm.size, (y[0], x[0])
picks = MPI.COMM_WORLD.gather((comm.auto_algorithm(1024), comm.auto_algorithm(1024, True)))
if comm.rank == 0:
    print("picked", picks, flush=True)  # one line from one rank: no interleaving
"""


@needs_mpi
def test_auto_follows_a_hand_written_table_under_mpi(tmp_path):
    table = tmp_path / "forced.json"
    table.write_text(json.dumps(tuning_file(
        entry(2, outofplace=[[512, "ring"], [4096, "rabenseifner"]], inplace=[[1 << 30, "ring"]]))))
    script = tmp_path / "check.py"
    script.write_text(SCRIPT)
    rc, log = launch(2, [str(script)], {"RINGCOLL_TUNING": str(table), "RINGCOLL_DEBUG": "1"})
    assert rc == 0, log
    assert "picked [('rabenseifner', 'ring'), ('rabenseifner', 'ring')]" in log, log
    assert "shape=[256], in_place=False) on 2 ranks -> rabenseifner" in log, log
    assert "shape=[256], in_place=True) on 2 ranks -> ring" in log, log


# -- the other collectives' ranges (bench/collectives_sweep.py --write-tuning) -------------------
def test_collective_ranges_are_looked_up_per_collective_and_checked():
    t = Tuning.from_dict(tuning_file(entry(2, collectives={
        "broadcast": [[512, "native"], [1 << 20, "tree"]], "scan": [[64, "native"]]})))
    two = [[0, 1]]
    assert [t.choose_collective("broadcast", n, 2, two) for n in (8, 512, 513, 1 << 30)] == [
        "native", "native", "tree", "tree"]
    assert t.choose_collective("scan", 1 << 20, 2, two) == "native"  # the last range beyond
    assert t.choose_collective("reduce", 8, 2, two) is None  # not measured: its own algorithm
    assert t.choose_collective("broadcast", 8, 3, [[0, 1, 2]]) is None  # no entry for p=3
    assert t.choose(8, 2, two) is None  # an entry of collectives only: the cost model decides
    for bad, message in [({"broadcast": [[8, "ring"]]}, "unknown algorithm 'ring'"),
                         ({"allreduce": [[8, "ring"]]}, "the all-reduce has its own ranges"),
                         ({"frobnicate": [[8, "tree"]]}, "'frobnicate' is not a collective"),
                         ({"reduce": [[8, "native"], [4, "tree"]]}, "max_bytes must increase")]:
        with pytest.raises(TuningFileError, match=message):
            Tuning.from_dict(tuning_file(entry(2, collectives=bad)))


def test_tune_keeps_the_collectives_ranges_of_the_entry_it_replaces():
    old = tuning_file(entry(2, outofplace=[[8, "ring"]], collectives={"barrier": [[0, "native"]]}))
    merged = tune.merge(old, entry(2, outofplace=[[8, "rabenseifner"]]))
    (e,) = merged["entries"]
    assert e["outofplace"] == [[8, "rabenseifner"]] and e["collectives"] == {
        "barrier": [[0, "native"]]}


def test_thread_ranks_never_run_a_measured_native():
    """A table that says native where the transport has no MPI (threads): the collective runs
    its own algorithm, correctly, instead of failing."""
    table = Tuning.from_dict(tuning_file(entry(3, collectives={
        "broadcast": [[1 << 30, "native"]], "scan": [[1 << 30, "native"]],
        "allgather": [[1 << 30, "native"]], "barrier": [[0, "native"]]})))

    def body(comm):
        x = np.arange(4.0) if comm.rank == 0 else np.zeros(4)
        comm.broadcast(x)
        comm.barrier()
        s = comm.scan(np.ones(2))
        g = comm.allgather(np.full(2, comm.rank))
        return x.tolist(), s.tolist(), g.tolist()

    for rank, (x, s, g) in enumerate(run(3, body, tuning=table)):
        assert x == [0, 1, 2, 3] and s == [rank + 1] * 2 and g == [0, 0, 1, 1, 2, 2]


COLLECTIVES_SCRIPT = """
import numpy as np, ringcoll
comm = ringcoll.Communicator()
x = np.arange(64.0)                     # 512 B
comm.broadcast(x); comm.broadcast(np.arange(512.0))
y = comm.scan(x); z = comm.exscan(np.arange(512.0))
g = comm.allgather(x); comm.barrier()
assert (y == x * (comm.rank + 1)).all() and (g == np.tile(x, comm.size)).all()
assert comm.rank == 0 or (z == np.arange(512.0) * comm.rank).all()
# x inside out (FSDP's all_gather_into_tensor): MPI forbids aliasing, so ringcoll's ring runs
out = np.zeros(4 * comm.size)
mine = out[4 * comm.rank:4 * comm.rank + 4]
mine[...] = comm.rank
comm.allgather(mine, out=out)
assert (out == np.repeat(np.arange(comm.size), 4)).all(), out
rs = np.arange(8.0 * comm.size)
comm.reduce_scatter(rs, out=rs[:8])  # out inside x
assert (rs[:8] == comm.size * (np.arange(8.0) + 8 * comm.rank)).all(), rs[:8]
"""


@needs_mpi
def test_auto_follows_hand_written_collective_ranges_under_mpi(tmp_path):
    table = tmp_path / "forced.json"
    table.write_text(json.dumps(tuning_file(entry(2, collectives={
        "broadcast": [[512, "native"], [1 << 30, "tree"]], "scan": [[512, "native"]],
        "exscan": [[512, "native"], [1 << 30, "recursive_doubling"]],
        "allgather": [[4096, "native"], [1 << 30, "ring"]], "barrier": [[0, "native"]],
        "reduce_scatter": [[1 << 30, "native"]]}))))
    script = tmp_path / "check.py"
    script.write_text(COLLECTIVES_SCRIPT)
    rc, log = launch(2, [str(script)], {"RINGCOLL_TUNING": str(table), "RINGCOLL_DEBUG": "1"})
    assert rc == 0, log
    for want in ["broadcast #1 (dtype=float64, shape=[64], root=0) on 2 ranks -> native",
                 "broadcast #2 (dtype=float64, shape=[512], root=0) on 2 ranks -> tree",
                 "scan #3 (op=sum, dtype=float64, shape=[64]) on 2 ranks -> native",
                 "exscan #4 (op=sum, dtype=float64, shape=[512]) on 2 ranks -> "
                 "recursive_doubling", "allgather #5", "-> auto", "barrier #6 () on 2 ranks "
                 "-> native"]:
        assert want in log, (want, log)


SATURATION_SCRIPT = """
import sys
import numpy as np, ringcoll
comm = ringcoll.Communicator()
p = comm.size
for dtype in (np.int8, np.uint8, np.int16, np.float32):
    x = np.full(128 * p, 100, dtype=dtype)  # 100 * p: past int8's range, wraps like C
    want = (x.astype(np.int64) * p).astype(dtype)
    r = comm.reduce(x, root=0)
    assert comm.rank != 0 or (r == want).all(), (dtype, r[:4], want[:4])
    rs = comm.reduce_scatter(x)
    assert (rs == want[:128]).all(), (dtype, rs[:4])
    s = comm.scan(x)
    assert (s == (x.astype(np.int64) * (comm.rank + 1)).astype(dtype)).all(), (dtype, s[:4])
"""


@needs_mpi
def test_auto_never_hands_open_mpis_avx_a_small_integer_sum(tmp_path):
    """Open MPI 5's op/avx saturates 8/16-bit integer sums instead of wrapping them: where the
    table says native, auto runs ringcoll's own algorithm for those types under Open MPI (and
    still MPI's call for float32, and for everything under MPICH, which wraps). The launch
    turns op/avx on (OMPI_MCA_op=avx), whatever the lane's default."""
    table = tmp_path / "native.json"
    table.write_text(json.dumps(tuning_file(entry(2, collectives={
        "reduce": [[1 << 30, "native"]], "reduce_scatter": [[1 << 30, "native"]],
        "scan": [[1 << 30, "native"]]}))))
    script = tmp_path / "check.py"
    script.write_text(SATURATION_SCRIPT)
    rc, log = launch(2, [str(script)], {"RINGCOLL_TUNING": str(table), "RINGCOLL_DEBUG": "1",
                                        "OMPI_MCA_op": "avx"})
    assert rc == 0, log
    open_mpi = mpirun.library()[0] == "Open MPI"
    for name in ("reduce", "reduce_scatter", "scan"):
        for dtype in ("int8", "uint8", "int16"):
            chosen = [line.rsplit("-> ", 1)[1] for line in log.splitlines()
                      if f"{name} #" in line and f"dtype={dtype}," in line]
            assert chosen and all((c == "native") != open_mpi for c in chosen), (
                name, dtype, chosen, log)
        f32 = [line for line in log.splitlines() if f"{name} #" in line and "float32" in line]
        assert f32 and all(line.endswith("-> native") for line in f32), (name, log)
