"""The import rule of docs/architecture.md: data flows down, imports point down.

Every module of ringcoll is parsed (imports inside functions included, so a lazy upward
import fails too) and each import of another ringcoll module must go to the same layer or
one below. Also: the front-ends reach the core only through the facade's public methods.
"""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ringcoll"

#: lowest first; a module's layer is that of its first path component under ringcoll/
LAYERS = [
    {"errors", "config", "cache"},
    {"arrays", "kernels"},
    {"ops", "transport"},
    {"checks", "algorithms", "tuning"},
    {"sides", "runner"},
    {"group", "collectives"},
    {"messages"},
    {"communicator"},
    {"__init__", "__main__", "compat", "inprocess", "distributed", "checkpoint", "compression",
     "optim", "mesh", "parallel", "explain", "tune", "netsim", "tuning_default", "torch",
     "repartition", "straggler", "local_sgd", "async_sgd"},
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def modules():
    return sorted(p for p in PACKAGE.rglob("*.py"))


def dotted(path):
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return list(rel.parts)


def imported(path):
    """The ringcoll modules path imports, as lists of components after 'ringcoll'."""
    parts = dotted(path)
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name.split(".")[1:] for a in node.names
                      if a.name.split(".")[0] == "ringcoll"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "ringcoll":
                target = node.module.split(".")
            else:
                continue
            target = target[1:]  # drop "ringcoll"
            if node.module is None or not target:  # from . import x, y: each is a module
                found += [target + [a.name] for a in node.names]
            else:
                found.append(target)
    return [t for t in found if t]


def layer_of(components):
    return LAYER[components[0]]


def test_every_module_has_a_layer():
    missing = {dotted(p)[1] for p in modules()} - set(LAYER) - {"kernels"}
    assert not missing, f"give these a layer in LAYERS: {sorted(missing)}"


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_imports_point_down(path):
    own = dotted(path)[1:]
    if own[0] not in LAYER:  # kernels/ is mapped in by setup.py, not under ringcoll/
        return
    upward = [".".join(t) for t in imported(path)
              if t[0] in LAYER and layer_of(t) > layer_of(own)]
    assert not upward, f"{'.'.join(own)} (layer {layer_of(own)}) imports upward: {upward}"


@pytest.mark.parametrize("front_end", ["compat.py", "torch/process_group.py"])
def test_front_ends_use_the_facade_only(front_end):
    """The front-ends (compat.py for mpi4py, torch/ for torch.distributed) call the
    Communicator's public methods; they never build plans or touch transports, runners or
    sides."""
    source = (PACKAGE / front_end).read_text()
    for forbidden in (r"\._runner\b", r"\._g\b", r"\._messages\b", r"\._t\b", r"\bPlan\(",
                      "transport"):
        assert not re.search(forbidden, source), f"{front_end} mentions {forbidden!r}"
    assert [".".join(t) for t in imported(PACKAGE / front_end)] == [
        "arrays", "communicator", "errors"]
