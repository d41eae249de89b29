"""The README's mpi4py drop-in examples and its PyTorch example run as they stand, under
mpiexec at 1 and 3 ranks; so do docs/checkpoints.md's examples, docs/torch.md's
re-partitioning example and docs/node_tier.md's example, at the rank counts their first lines
name.

Every ```python block of the "mpi4py code" section that asserts something is written to a file
and launched; each must exit 0 (a failed assert on any rank fails the launch).
"""

import re

import pytest

import _mpirun as mpirun

pytestmark = mpirun.needs_mpi


def examples():
    text = (mpirun.ROOT / "README.md").read_text()
    start = text.index("### mpi4py code")
    section = text[start:text.index("\n### ", start + 1)]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    return [b for b in blocks if "assert" in b]


def test_the_section_has_one_example_per_family():
    firsts = [b.splitlines()[0] for b in examples()]
    assert [f.split(":")[0] for f in firsts] == [
        "# reductions", "# data movement", "# non-blocking", "# passed through to mpi4py"]


@pytest.mark.parametrize("nprocs", [1, 3])
@pytest.mark.parametrize("index", range(4))
def test_readme_example_runs(index, nprocs, tmp_path):
    code = examples()[index]
    script = tmp_path / "example.py"
    script.write_text(code)
    rc, out, secs = mpirun.launch(nprocs, [str(script)], env={"RINGCOLL_TIMEOUT": "30"},
                                  timeout=120)
    assert rc == 0, f"README example {code.splitlines()[0]!r} at -n {nprocs}:\n{out[-3000:]}"


def torch_example():
    text = (mpirun.ROOT / "README.md").read_text()
    start = text.index("### PyTorch: the `torch.distributed` backend")
    section = text[start:text.index("\n### ", start + 1)]
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", section, re.S) if "assert" in b]
    return block


@pytest.mark.parametrize("nprocs", [1, 3])
def test_readme_torch_example_runs(nprocs, tmp_path):
    pytest.importorskip("torch", reason="the README's PyTorch example needs torch: pip install "
                        "-e '.[torch]'")
    script = tmp_path / "example.py"
    script.write_text(torch_example())
    rc, out, secs = mpirun.launch(nprocs, [str(script)], env={"RINGCOLL_TIMEOUT": "30"},
                                  timeout=120)
    assert rc == 0, f"README PyTorch example at -n {nprocs}:\n{out[-3000:]}"


def doc_examples(page):
    """(ranks, code) of each ```python block of docs/<page> that starts with
    '# mpiexec -n N python this.py'."""
    text = (mpirun.ROOT / "docs" / page).read_text()
    found = []
    for code in re.findall(r"```python\n(.*?)```", text, re.S):
        first = re.match(r"# mpiexec -n (\d+) python this\.py", code)
        if first:
            found.append((int(first.group(1)), code))
    return found


def test_the_checkpoint_page_has_its_examples():
    assert [n for n, _ in doc_examples("checkpoints.md")] == [2, 4]


def run_doc_example(page, index, tmp_path, mpi_timings=None):
    """Launch example `index` of docs/<page> at the rank count its first line names, in
    tmp_path; assert it exited 0."""
    nprocs, code = doc_examples(page)[index]
    script = tmp_path / "example.py"
    script.write_text(code)
    rc, out, secs = mpirun.launch(nprocs, [str(script)], env={"RINGCOLL_TIMEOUT": "30"},
                                  timeout=120, cwd=tmp_path)
    if mpi_timings is not None:
        mpi_timings[f"docs/{page} example {index} -n {nprocs}"] = secs
    assert rc == 0, f"docs/{page} example {index} at -n {nprocs}:\n{out[-3000:]}"


@pytest.mark.parametrize("index", range(2))
def test_checkpoint_page_example_runs(index, tmp_path):
    run_doc_example("checkpoints.md", index, tmp_path)


def test_the_torch_page_has_its_example():
    assert [n for n, _ in doc_examples("torch.md")] == [2]


def test_torch_page_example_runs(tmp_path, mpi_timings):
    pytest.importorskip("torch", reason="docs/torch.md's example needs torch: pip install -e "
                        "'.[torch]'")
    run_doc_example("torch.md", 0, tmp_path, mpi_timings)


def test_the_node_tier_page_has_its_example():
    assert [n for n, _ in doc_examples("node_tier.md")] == [4]


def test_node_tier_page_example_runs(tmp_path, mpi_timings):
    run_doc_example("node_tier.md", 0, tmp_path, mpi_timings)
