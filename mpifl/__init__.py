"""mpifl: an MPI-based HPC simulator for federated learning with exact communication accounting."""

from mpifl.cpukernels import pin

__version__ = "0.1.0"
pin()  # before torch computes anything: the same CPU code paths on every node (mpifl/cpukernels.py)
