"""The algorithms: one module each, found by name through :mod:`mpifl.registry`."""
