"""A prepared TFDS dataset (ArrayRecord file format) in a bucket: `TFDSSource(name, split,
data_dir="gs://..." or "s3://...")`.

TFDS itself reads gs:// only through TensorFlow or gcsfs, and s3:// not at all. This copies the
dataset's few small metadata files (dataset_info.json, features.json, label files) to a local
temp directory, lets TFDS build the dataset's info and features from them (no TensorFlow), and
reads the records of the split's shards through `ArrayRecordSource` over the shard URLs (ranged
reads, pinned versions), decoding each with the features' numpy decoder.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from ..errors import SourceError
from ..storage import list_objects, read_object


def _dataset_dir(name: str, data_dir: str) -> str:
    """`data_dir/name[/config]/version`, the version defaulting to the newest prepared one."""
    base, _, version = name.partition(":")
    prefix = f"{data_dir.rstrip('/')}/{base}/"
    if version:
        return prefix + version
    found = [url[len(prefix):].split("/")[0] for url, _ in list_objects(prefix)
             if url.endswith("/dataset_info.json") and url[len(prefix):].count("/") == 1]
    if not found:
        raise SourceError(f"TFDS dataset {name!r}: no prepared version under {prefix} (no "
                          "<version>/dataset_info.json). Prepare it with download_and_prepare("
                          "file_format='array_record') and copy its directory there.")
    return prefix + max(found, key=lambda v: tuple(int(p) for p in v.split(".") if p.isdigit()))


class RemoteTFDS:
    """What TFDSSource uses of `tfds.data_source`: len, __getitems__ and dataset_info."""

    def __init__(self, name: str, split: str, data_dir: str, decoders: Any = None) -> None:
        import tensorflow_datasets as tfds

        from .array_record import ArrayRecordSource

        ds_dir = _dataset_dir(name, data_dir)
        meta = [(url, size) for url, size in list_objects(ds_dir + "/")
                if ".array_record-" not in url and "/" not in url[len(ds_dir) + 1:]]
        if not any(url.endswith("/dataset_info.json") for url, _ in meta):
            raise SourceError(f"TFDS dataset {name!r}: {ds_dir}/dataset_info.json does not exist; "
                              "prepare the dataset and copy its whole directory there.")
        local = tempfile.mkdtemp(prefix="zephon-tfds-")
        for url, _ in meta:
            with open(os.path.join(local, url.rsplit("/", 1)[1]), "wb") as f:
                f.write(read_object(url))
        builder = tfds.builder_from_directory(local)
        if split not in builder.info.splits:
            raise SourceError(f"Unknown split {split!r} (the dataset has "
                              f"{sorted(builder.info.splits.keys())})")
        shards = [f"{ds_dir}/{os.path.basename(p)}" for p in builder.info.splits[split].filepaths]
        if not shards or ".array_record" not in shards[0]:
            raise SourceError(f"split {split!r} is not in the array_record file format")
        self.dataset_info = builder.info
        self._features = builder.info.features
        self._decoders = decoders
        self._records = ArrayRecordSource(shards)

    def __len__(self) -> int:
        return len(self._records)

    def __getitems__(self, keys: list[int]) -> list[dict[str, Any]]:
        import numpy as np

        raw = self._records.read(np.asarray(keys, dtype=np.int64))["bytes"]
        return [self._features.deserialize_example_np(r, decoders=self._decoders) for r in raw]

    def __getitem__(self, key: int) -> dict[str, Any]:
        return self.__getitems__([key])[0]
