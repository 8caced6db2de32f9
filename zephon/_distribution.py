"""Which distribution installed this `zephon`: ours is `zephon-loader`.

`pip install zephon` installs another team's project with the same import name. When both are in
one environment, the later install overwrites files of the earlier one, and the failures that
follow (missing names, wrong behaviour) say nothing about why. One line at import says it instead.
"""

from __future__ import annotations

import warnings
from importlib import metadata

#: Our distribution's name on the package index.
DISTRIBUTION = "zephon-loader"
_OURS = "Elastically deterministic"


def version() -> str:
    """This install's version, or "unknown" when run from a tree that was never installed."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown"


def warn_if_shadowed() -> None:
    """Warns once when the other project's `zephon` distribution is installed here too."""
    try:
        other = metadata.distribution("zephon")
    except metadata.PackageNotFoundError:
        return
    # Before 0.3.0 this project was itself distributed as `zephon`; its own old metadata is not
    # the other project.
    if _OURS in (other.metadata["Summary"] or ""):
        return
    warnings.warn(
        f"another project named 'zephon' ({other.version}) is installed in this environment and "
        f"shares the import name; uninstall it (pip uninstall zephon) and reinstall "
        f"{DISTRIBUTION}.", RuntimeWarning, stacklevel=3)
