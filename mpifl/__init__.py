"""mpifl: an MPI-based HPC simulator for federated learning with exact communication accounting."""

__version__ = "0.1.0"
