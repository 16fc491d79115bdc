"""mpifl's benchmarks, a regular package: an installed package named ``benchmarks`` (opacus ships one) cannot
shadow it, so ``from benchmarks.gpu_check import ...`` in the tests always means these files."""
