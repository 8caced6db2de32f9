"""Bytes from local files and object storage (`s3://`, `gs://`): ranged reads, pinned versions,
retries under a deadline, listing and atomic writes. See the README section "Object storage".
"""

from .blob import Blob, open_blob, read_blobs
from .client import STATS, credential_source, reset
from .errors import (
    ObjectChangedError,
    ObjectCorruptError,
    ObjectMissingError,
    ObjectPermissionError,
    ObjectUnavailableError,
)
from .objects import exists, glob, list_objects, put_atomic, read_object
from .retry import StoragePolicy, configure, policy
from .url import is_remote, local_path, parse

__all__ = [
    "STATS",
    "Blob",
    "ObjectChangedError",
    "ObjectCorruptError",
    "ObjectMissingError",
    "ObjectPermissionError",
    "ObjectUnavailableError",
    "StoragePolicy",
    "configure",
    "credential_source",
    "exists",
    "glob",
    "is_remote",
    "list_objects",
    "local_path",
    "open_blob",
    "parse",
    "policy",
    "put_atomic",
    "read_blobs",
    "read_object",
    "reset",
]
