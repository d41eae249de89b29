"""ringcoll: collective communication from scratch in Python over MPI."""

from setuptools import setup

setup(
    name="ringcoll",
    version="0.1.0",
    description="Ring, recursive-doubling, Rabenseifner and hierarchical collectives "
    "in Python over mpi4py point-to-point",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=["ringcoll", "ringcoll.algorithms", "ringcoll.collectives", "ringcoll.parallel",
              "ringcoll.torch",
              "ringcoll.transport",
              "ringcoll.kernels"],
    package_dir={"ringcoll.kernels": "kernels"},
    package_data={"ringcoll": ["tuning_default.json"]},  # auto's built-in tuning table
    entry_points={"console_scripts": ["ringcoll = ringcoll.__main__:main"]},  # ringcoll tune
    install_requires=["numpy>=1.23", "mpi4py>=4"],
    extras_require={
        "mpich": ["mpich"],
        "test": ["pytest>=7", "pytest-timeout", "ml_dtypes", "hypothesis", "scikit-learn",
                 "matplotlib"],
        "bench": ["matplotlib"],
        "examples": ["scikit-learn"],
        # the PyTorch backend (ringcoll.torch) and its tests: the CPU-only build, from
        # https://download.pytorch.org/whl/cpu where the package index lacks it (docs/torch.md)
        "torch": ["torch==2.13.0+cpu"],
        "cuda": ["cupy"],  # CuPy from source (builds against the local CUDA toolkit)
        "gpu": ["cupy-cuda13x"],  # CuPy wheels for a CUDA 13 driver (docs/gpu.md)
        "gpu-cuda12": ["cupy-cuda12x"],  # ... for a CUDA 12 driver
    },
    license="MIT",
)
