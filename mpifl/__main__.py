"""``python -m mpifl``: the command line, once it is sure that ``mpifl`` is this package.

``-m`` puts the folder Python was started from first on the import path, so a folder named ``mpifl`` there (the
clone's parent holds the clone; an empty one; one whose ``results/`` or ``plugins/`` are not these) is imported as
``mpifl`` in place of this package, whose modules an editable install then finds one by one: the rest fails with
``ImportError: cannot import name 'Results' from 'mpifl.results'``, or runs without this package's ``__init__``
(the CPU kernels it pins). Only the standard library is used until the check has passed.
"""

import os
import sys


def _shadowing_folder() -> str | None:
    """The folder Python imported as ``mpifl`` if it is not this package's, else None."""
    import mpifl

    here = os.path.dirname(os.path.realpath(__file__))
    where = getattr(mpifl, "__file__", None)
    folders = [os.path.dirname(where)] if where else list(getattr(mpifl, "__path__", []))
    if any(os.path.realpath(folder) == here for folder in folders):
        return None
    return folders[0] if folders else "?"


def _refuse(folder: str) -> int:
    """One line that names the folder and the cure (said once under a launcher: by rank 0), exit code 2."""
    parent = os.path.dirname(os.path.realpath(folder))
    if parent == os.path.realpath(os.getcwd()):
        why = "the folder python was started from, which -m puts first on the import path"
        cure = "run it from another folder"
        if sys.version_info >= (3, 11):
            cure += ", or with python -P -m mpifl (or PYTHONSAFEPATH=1), which leaves that folder off the path"
    else:
        why = f"{parent}, which comes before the package on Python's import path (sys.path: PYTHONPATH?)"
        cure = f"take {parent} off PYTHONPATH, or rename the folder"
    rank = next((os.environ[v] for v in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
                 if v in os.environ), "0")
    if rank == "0":
        sys.stderr.write(f"mpifl: error: the folder {folder} is not the mpifl package but shadows it: Python imports "
                         f"it as mpifl because it lies in {why}; {cure}\n")
    else:  # the launcher ends the job at the first rank's exit: rank 0's line first (its exit ends this one)
        import time

        time.sleep(5)
    return 2


if __name__ == "__main__":
    shadow = _shadowing_folder()
    if shadow is not None:
        raise SystemExit(_refuse(shadow))
    from mpifl.cli import main

    raise SystemExit(main())
