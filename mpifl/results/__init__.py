"""The results file: one HDF5 file per run, written by rank 0 only (its layout: :mod:`.layout`).

:mod:`.writing` creates and appends to it, :mod:`.reading` reads it back, :mod:`.summaries` condenses the ledger,
:mod:`.tables` holds rank 0's rows in memory until they are written.
"""

from mpifl.results.layout import APPENDED, KEPT, SHARDS, shard_dir
from mpifl.results.reading import Results, read_column_chunks, read_results, rows_up_to
from mpifl.results.summaries import ledger_summaries
from mpifl.results.tables import Table, flatten
from mpifl.results.writing import AppendOnlyFile, check_writable

__all__ = ["APPENDED", "KEPT", "SHARDS", "AppendOnlyFile", "Results", "Table", "check_writable", "flatten",
           "ledger_summaries", "read_column_chunks", "read_results", "rows_up_to", "shard_dir"]
