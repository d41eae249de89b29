"""The package list, found from the tree so that no module can be left out of a wheel.

Everything else (name, version, dependencies, extras, the `ringcoll` command) is in
pyproject.toml. kernels/ sits at the top of the tree (the design's layout) and installs as
ringcoll.kernels, which pyproject.toml's package finder cannot express. scripts/check_dist.py
checks a built wheel and sdist against the tree.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["ringcoll", "ringcoll.*"])
    + ["ringcoll.kernels"] + [f"ringcoll.kernels.{name}" for name in find_packages("kernels")],
    package_dir={"ringcoll.kernels": "kernels"},
)
