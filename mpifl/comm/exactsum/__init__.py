"""Exact, order-independent sums Σᵢ wᵢ·rowᵢ: the same bits however the terms are ordered and grouped over ranks.

Each term x = RN(w·rowⱼ) is a float64. Every x is cut at fixed bit positions ("levels", W bits apart) into
integers, and integers add associatively; the total is rounded to float64 once, at the end, so the result is
the correctly rounded (to nearest, ties to even) exact sum Σx, whatever the order and grouping.

Each part changes for its own reason, so each is a module of its own:

- ``_grid``: where a term's bits sit (``Window``), the levels that cover them and the cut of floats into them;
- ``_accumulator``: one rank's running total (``ExactSum``) and the one-shot ``exact_sum``;
- ``_wire``: how totals travel between ranks (``words``) and how their sum is rounded (``round_sum``);
- ``_backends``: the array operations all of them run on, numpy on the host or torch on a tensor's device;
- ``distributed``: a summed message's sum over the ranks (``DistributedSum``): the whole protocol, on the
  transport's generic wait.

Memory: the accumulator holds levels + 1 (the carry) int64 per entry, the wire buffer ``words`` int64. The
float32 deltas of B1's MLP after local SGD, weighted 1/50, span about 75 bits: 2 levels of W = 50 (24 B per
entry) and 3 wire words (24 B; 2 words, 16 B, with fewer than 2^15 terms); deltas log-uniform over 1e-10..1e1
span about 105 bits: 3 levels (32 B).
The worst case, a float64 subnormal term beside terms near 1, spans 1,074 bits: 22 levels (184 B per entry).
The float64 result differs from a sequential float64 sum in the last bits where that sum rounded.
"""

from mpifl.comm.exactsum._accumulator import FOLDS_PER_NORMALISATION, WIDTH, ExactSum, exact_sum
from mpifl.comm.exactsum._backends import CHUNK, ROUND_SPAN, Array, host_copy
from mpifl.comm.exactsum._grid import EMPTY, LOWEST, MAX_EXPONENT, Window
from mpifl.comm.exactsum._wire import ANY_TERMS, FEW_TERMS, MAX_RANKS, WIRE_WIDTH, round_sum, words

__all__ = ["ANY_TERMS", "CHUNK", "EMPTY", "FEW_TERMS", "FOLDS_PER_NORMALISATION", "LOWEST", "MAX_EXPONENT",
           "MAX_RANKS", "ROUND_SPAN", "WIDTH", "WIRE_WIDTH", "Array", "ExactSum", "Window", "exact_sum", "host_copy",
           "round_sum", "words"]
