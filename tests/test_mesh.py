"""ringcoll.Mesh on thread ranks: coordinates, groups and sub-communicators against a grid
enumerated independently (tests/_parallel_cases.check_mesh), the picture, and bad sizes."""

import pytest

import ringcoll

import _parallel_cases as C

TIMEOUT = 20

SHAPES = [  # (ranks, dp, tp, pp)
    (1, 1, 1, 1), (2, 2, 1, 1), (2, 1, 2, 1), (2, 1, 1, 2), (4, 2, 2, 1), (4, 4, 1, 1),
    (4, 1, 4, 1), (4, 2, 1, 2), (4, 1, 2, 2), (6, 3, 2, 1), (6, 1, 3, 2), (8, 2, 2, 2),
    (12, 3, 2, 2), (8, None, 2, 2), (6, None, 3, 1),
]


@pytest.mark.parametrize("p,dp,tp,pp", SHAPES)
def test_groups_and_sub_communicators(p, dp, tp, pp):
    texts = ringcoll.run_threads(p, lambda comm: C.check_mesh(comm, dp, tp, pp), timeout=TIMEOUT)
    assert len(set(texts)) == 1


@pytest.mark.parametrize("order", [("dp", "pp", "tp"), ("tp", "dp", "pp"), ("pp", "tp", "dp")])
def test_other_axis_orders(order):
    ringcoll.run_threads(8, lambda comm: C.check_mesh(comm, 2, 2, 2, order), timeout=TIMEOUT)


def test_tp_ranks_are_consecutive_by_default():
    groups = ringcoll.run_threads(8, lambda comm: ringcoll.Mesh(comm, dp=2, tp=2, pp=2)
                                  .groups("tp"), timeout=TIMEOUT)[0]
    assert groups == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_the_picture():
    text = ringcoll.run_threads(8, lambda comm: str(ringcoll.Mesh(comm, dp=2, tp=2, pp=2)),
                                timeout=TIMEOUT, local_size=4)[0]
    assert text == """\
ringcoll.Mesh: 8 ranks = pp 2 x dp 2 x tp 2 (outer to inner; tp ranks are consecutive)

             tp 0   tp 1
pp 0 dp 0       0      1    node 0
pp 0 dp 1       2      3    node 0
pp 1 dp 0       4      5    node 1
pp 1 dp 1       6      7    node 1

tp groups (layers split; all-reduce in every layer): [0 1] [2 3] [4 5] [6 7]
dp groups (replicas; all-reduce gradients each step): [0 2] [1 3] [4 6] [5 7]
pp groups (stages; activations and gradients point-to-point): [0 4] [1 5] [2 6] [3 7]"""


def test_tensor_parallel_across_nodes_is_pointed_out():
    text = ringcoll.run_threads(4, lambda comm: ringcoll.Mesh(comm, tp=4).describe(),
                                timeout=TIMEOUT, local_size=2)[0]
    assert "note: tp group(s) [[0, 1, 2, 3]] span nodes" in text


@pytest.mark.parametrize("kwargs,text", [
    (dict(dp=2, tp=2, pp=2), "dp=2 x tp=2 x pp=2 = 8 ranks, but the communicator has 4; "
                             "choose sizes whose product is 4"),
    (dict(dp=3), "dp=3 x tp=1 x pp=1 = 3 ranks, but the communicator has 4"),
    (dict(tp=3), "tp=3 x pp=1 = 3 does not divide the communicator's 4 ranks"),
    (dict(tp=0), "tp=0 must be a positive integer"),
    (dict(pp=1.5), "pp=1.5 must be a positive integer"),
    (dict(order=("dp", "tp")), "must name each of ('pp', 'dp', 'tp') once"),
])
def test_bad_sizes_are_refused_on_every_rank(kwargs, text):
    def body(comm):
        with pytest.raises(ringcoll.InvalidArgumentError, match="ringcoll rank") as info:
            ringcoll.Mesh(comm, **kwargs)
        assert text in str(info.value), str(info.value)
        return True

    assert ringcoll.run_threads(4, body, timeout=TIMEOUT) == [True] * 4
