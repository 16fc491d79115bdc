"""mpifl's plug-in example: one algorithm, one model and one dataset from outside mpifl."""
