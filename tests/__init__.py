"""mpifl's tests, a regular package: an installed package named ``tests`` cannot shadow it (a namespace package
loses to any regular one on sys.path), so ``from tests.conftest import ...`` always means these files."""
