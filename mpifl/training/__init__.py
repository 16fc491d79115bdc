"""Local training kernels below the algorithms: mini-batch SGD and evaluation, vectorized SGD, devices."""
