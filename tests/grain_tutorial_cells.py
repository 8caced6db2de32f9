# ruff: noqa: E501 - verbatim code cells of Grain's documentation (data, not Zephon code)
"""Code cells of Grain's own documentation, the compatibility bar of `zephon.compat.grain`.

Copied verbatim from google/grain at tag v0.2.18 (the installed Grain), `docs/tutorials/*.md`,
`docs/tutorials/data_sources/*.md` and `docs/data_loader/transformations.md`.
Copyright 2023 Google LLC, Apache License 2.0 (https://www.apache.org/licenses/LICENSE-2.0).
The cells are data here: `tests/grain_tutorials.py` runs each page with real Grain and, ported
(`port()`), with Zephon, and compares what every cell prints.

Only what needs the network or is not installable changes, and identically on both sides:
`tests/grain_tutorials.py` gives `tfds.data_source(...)` (mnist, pneumonia_mnist), torchvision's
FashionMNIST, the Hugging Face demo dataset and tokenizer, bagz's Reader/Writer (Apache Beam is
absent, so its cells fail on Grain too and are not counted), `cv2.resize` and the data loader page's
undefined `source` local stand-ins of the same record structure, drops `!`/`%` shell lines (`!rm -rf` becomes `shutil.rmtree`) and runs every
page in a fresh temporary directory. Cells that still cannot run offline are listed, with the
reason, in SKIPPED_CELLS / SKIPPED_PAGES.
"""

CELLS: dict[str, list[tuple[str, str]]] = {
    'dataset_basic': [
        ('FCZXw2YhhPyu', r'''from pprint import pprint
import grain'''),
        ('3z3Em5jC2iVz', r'''dataset = (
    # You can also use a shortcut grain.MapDataset.range for
    # range-like input.
    grain.MapDataset.source([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    .shuffle(seed=10)  # Shuffles globally.
    .map(lambda x: x + 1)  # Maps each element.
    .batch(batch_size=2)  # Batches consecutive elements.
)

pprint(dataset[0])
pprint(list(dataset))'''),
        ('592ut9AgiDCz', r'''# Note: Inheriting `grain.RandomAccessDataSource` is optional but recommended.
class MySource(grain.sources.RandomAccessDataSource):

  def __init__(self):
    self._data = [0, 1, 2, 3, 4, 5, 6, 7]

  def __getitem__(self, idx):
    return self._data[idx]

  def __len__(self):
    return len(self._data)'''),
        ('m8Cyn7gt6FYy', r'''source = MySource()

dataset = (
    grain.MapDataset.source(source)
    .shuffle(seed=10)  # Shuffles globally.
    .map(lambda x: x + 1)  # Maps each element.
    .batch(batch_size=2)  # Batches consecutive elements.
)

pprint(dataset[0])
pprint(list(dataset))'''),
        ('GSW1cJe06NEO', r'''# Prints the 3rd element of the second epoch.
pprint(dataset[len(dataset) + 2])'''),
        ('_o3wxb8k7XDY', r'''pprint(dataset[len(dataset) + 2] == dataset[2])'''),
        ('ai4zcltV7sSN', r'''filtered_dataset = dataset.filter(lambda e: (e[0] + e[1]) % 2 == 0)

pprint(f"Length of this dataset: {len(filtered_dataset)}")
pprint([filtered_dataset[i] for i in range(len(filtered_dataset))])'''),
        ('-fuS_OGS8x5Z', r'''shard_index = 0
shard_count = 2

sharded_dataset = dataset[shard_index::shard_count]
print(f"Sharded dataset length = {len(sharded_dataset)}")
pprint(sharded_dataset[0])
pprint(sharded_dataset[1])'''),
        ('FnWPIpce9aAJ', r'''iter_dataset = sharded_dataset.to_iter_dataset(
    grain.ReadOptions(num_threads=16, prefetch_buffer_size=500)
)

for element in iter_dataset:
  pprint(element)'''),
        ('AKJhIi0VGSCR', r'''ds = (
    grain.MapDataset.range(10)
    .filter(lambda x: x % 2 == 0)
    .to_iter_dataset()
    .batch(2)  # Calling `batch` before `to_iter_dataset` will raise an error.
)
pprint(list(ds))'''),
        ('DRgatGFX_nxL', r'''dataset_iter = iter(dataset)
pprint(isinstance(dataset_iter, grain.DatasetIterator))'''),
        ('dOCiJfSJ_vi4', r'''pprint(next(dataset_iter))

checkpoint = dataset_iter.get_state()

pprint(next(dataset_iter))

# Recover the iterator to the state after the first produced element.
dataset_iter.set_state(checkpoint)

pprint(next(dataset_iter))  # This should generate the same element as above'''),
    ],
    'dataset_advanced': [
        ('fwvOt8-cqcQn', r'''import grain
import numpy as np
import tensorflow_datasets as tfds
from pprint import pprint'''),
        ('Tf-4Ljd2l5_H', r'''ds = (
    grain.MapDataset.source(tfds.data_source("mnist", split="train"))
    .seed(seed=45)
    .shuffle()
    .to_iter_dataset()
)

num_steps = 4
ds_iter = iter(ds)

# Read some elements.
for i in range(num_steps):
  x = next(ds_iter)
  print(i, x["label"])'''),
        ('PGn-eSYil5_H', r'''import orbax.checkpoint as ocp

mngr = ocp.CheckpointManager("/tmp/orbax")

!rm -rf /tmp/orbax

# Save the checkpoint.
assert mngr.save(
    step=num_steps, args=grain.checkpoint.CheckpointSave(ds_iter), force=True
)
# Checkpoint saving in Orbax is asynchronous by default, so we'll wait until
# finished before examining checkpoint.
mngr.wait_until_finished()

# @test {"output": "ignore"}
!ls -R /tmp/orbax'''),
        ('HURK2viXl5_H', r'''# Read more elements and advance the iterator.
for i in range(4, 8):
  x = next(ds_iter)
  print(i, x["label"])'''),
        ('u92Vkn1Hl5_H', r'''# Restore iterator from the previously saved checkpoint.
mngr.restore(num_steps, args=grain.checkpoint.CheckpointRestore(ds_iter))
# Iterator should be set back to start from 4.
for i in range(4, 8):
  x = next(ds_iter)
  print(i, x["label"])'''),
        ('e8ROZXhtwOx3', r'''tfds.core.DatasetInfo.file_format = (
    tfds.core.file_adapters.FileFormat.ARRAY_RECORD
)
# This particular dataset mixes medical images with hand written numbers,
# probably not useful but allows to illustrate the API on small datasets.
source1 = tfds.data_source(name="pneumonia_mnist", split="train")
source2 = tfds.data_source(name="mnist", split="train")
ds1 = grain.MapDataset.source(source1).map(lambda features: features["image"])
ds2 = grain.MapDataset.source(source2).map(lambda features: features["image"])
ds = grain.MapDataset.mix([ds1, ds2], weights=[0.7, 0.3])
print(f"Mixed dataset length = {len(ds)}")
pprint(np.shape(ds[0]))'''),
        ('DTmUbvK4r8T8', r'''source1 = tfds.data_source(name="pneumonia_mnist", split="train")
source2 = tfds.data_source(name="mnist", split="train")
ds1 = (
    grain.MapDataset.source(source1)
    .filter(lambda features: int(features["label"]) == 1)
    .to_iter_dataset()
)
ds2 = (
    grain.MapDataset.source(source2)
    .filter(lambda features: int(features["label"]) > 4)
    .to_iter_dataset()
)

ds = grain.IterDataset.mix([ds1, ds2], weights=[0.7, 0.3]).map(
    lambda features: features["image"]
)
pprint(np.shape(next(iter(ds))))'''),
        ('JqetaYR36GUH', r'''source1 = tfds.data_source(name="pneumonia_mnist", split="train")
source2 = tfds.data_source(name="mnist", split="train")
ds1 = grain.MapDataset.source(source1).repeat()
ds2 = grain.MapDataset.source(source2).repeat()

ds = grain.MapDataset.mix([ds1, ds2], weights=[1, 2])
print(f"Mixed dataset length = {len(ds1)}")  # sys.maxsize
print(f"Mixed dataset length = {len(ds2)}")  # sys.maxsize
# Ds1 and ds2 are repeated to fill out the sys.maxsize with respect to weights.
print(f"Mixed dataset length = {len(ds)}")  # sys.maxsize'''),
        ('OTveP3UQE7xv', r'''source1 = tfds.data_source(name="pneumonia_mnist", split="train")
source2 = tfds.data_source(name="mnist", split="train")
ds1 = grain.MapDataset.source(source1).seed(42).shuffle().repeat()
ds2 = grain.MapDataset.source(source2).seed(43).shuffle().repeat()

ds = grain.MapDataset.mix([ds1, ds2], weights=[1, 2])
print(f"Mixed dataset length = {len(ds)}")  # sys.maxsize'''),
        ('Uq4EOb8DAMX6', r'''import grain
import jax
import tensorflow_datasets as tfds

cpu_buffer_size = 3
source = tfds.data_source(name="mnist", split="train")
ds = grain.MapDataset.source(source).to_iter_dataset()
ds.map(lambda x: x)  # Dummy map to illustrate the usage.
ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=cpu_buffer_size)
ds = ds.map(jax.device_put)'''),
        ('SAZz4YMMAPX5', r'''import grain
import jax
import numpy as np

cpu_buffer_size = 3
tpu_buffer_size = 2
source = tfds.data_source(name="mnist", split="train")
ds = grain.MapDataset.source(source).to_iter_dataset()
ds.map(lambda x: x)  # Dummy map to illustrate the usage.

devices = jax.devices()

mesh = jax.sharding.Mesh(np.array(devices), axis_names=('data',))
p = jax.sharding.PartitionSpec('data')
sharding = jax.sharding.NamedSharding(mesh, p)

ds = grain.experimental.device_put(
        ds=ds,
        device=sharding,
        cpu_buffer_size=cpu_buffer_size,
        device_buffer_size=tpu_buffer_size,
    )'''),
        ('qJLCdyXa76Oy', r'''import grain
import jax
import numpy as np

# If not set defaults to 16 threads and buffer 500.
read_options = grain.ReadOptions(num_threads=32, prefetch_buffer_size=400)

source = tfds.data_source(name="mnist", split="train")
ds = grain.MapDataset.source(source).to_iter_dataset(read_options=read_options)'''),
        ('RIgnPrak-4gl', r'''import grain
import jax
import numpy as np

source = tfds.data_source(name="mnist", split="train")
ds = grain.MapDataset.source(source)
performance_config = grain.experimental.pick_performance_config(
        ds=ds,
        ram_budget_mb=1024,
        max_workers=None,
        max_buffer_size=None
    )
ds = ds.to_iter_dataset(read_options=performance_config.read_options)'''),
        ('G80HqEJDCbZU', r'''import grain
import tensorflow_datasets as tfds

source = tfds.data_source(name="mnist", split="train")
ds = grain.MapDataset.source(source).to_iter_dataset()

prefetch_lazy_iter_ds = ds.mp_prefetch(
        grain.MultiprocessingOptions(num_workers=3, per_worker_buffer_size=10),
    )'''),
        ('wvEDL_b7M-S1', r'''import grain
import tensorflow_datasets as tfds

source = tfds.data_source(name="mnist", split="train")
ds = grain.MapDataset.source(source).to_iter_dataset()

performance_config = grain.experimental.pick_performance_config(
        ds=ds,
        ram_budget_mb=1024,
        max_workers=None,
        max_buffer_size=None
    )

prefetch_lazy_iter_ds = ds.mp_prefetch(
        performance_config.multiprocessing_options,
    )'''),
    ],
    'dataset_debugging': [
        ('4y89Wx7PsRKE', r'''# @test {"output": "ignore"}
import grain.python as grain

grain.config.update("py_dataset_visualization_output_dir", "")
ds = (
    grain.MapDataset.range(20)
    .seed(seed=42)
    .shuffle()
    .batch(batch_size=2)
    .map(lambda x: x)
    .to_iter_dataset()
)
it = iter(ds)

# Visualization graph is constructed once the dataset produces the first element
for _ in range(10):
  next(it)'''),
        ('bN45Z58E3jGS', r'''import time


# Define a dummy slow preprocessing function
def _dummy_slow_fn(x):
  time.sleep(10)
  return x'''),
    ],
    'data_loader': [
        ('EZ9EXOZKehes', r'''!pip install grain tfds-nightly opencv-python matplotlib orbax-checkpoint

import cv2
import orbax.checkpoint as ocp
import grain.python as grain
import matplotlib.pyplot as plt
import numpy as np

import os
os.environ.pop('TFDS_DATA_DIR', None)
import tensorflow_datasets as tfds'''),
        ('qk4MtXvXe1Bl', r'''# Setting `num_records` to 5 to limit results.
# For full dataset, set to `len(data_source)`.
index_sampler_example = grain.IndexSampler(
    num_records=5,
    num_epochs=2,
    shard_options=grain.ShardOptions(
        shard_index=0, shard_count=1, drop_remainder=True),
    shuffle=True,
    seed=0)

# Iterator is consumed.
for record_metadata in index_sampler_example:
  print(record_metadata)

# Create new iterator.
index_sampler = grain.IndexSampler(
    num_records=5,
    num_epochs=2,
    shard_options=grain.ShardOptions(
        shard_index=0, shard_count=1, drop_remainder=True),
    shuffle=True,
    seed=0)'''),
        ('lRKLPtMK8w1A', r'''class ResizeAndCrop(grain.MapTransform):

  def map(self, element: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    image = element["image"]
    image = cv2.resize(image, dsize=(256, 256), interpolation=cv2.INTER_LINEAR)
    image = image[:224, :224]
    element["image"] = image
    return element

transformations = [ResizeAndCrop()]'''),
        ('RhcG6Ehs9uVy', r'''data_loader = grain.DataLoader(
    data_source=source,
    operations=transformations,
    sampler=index_sampler,
    worker_count=0)'''),
        ('aXN-iffE94Qc', r'''for element in data_loader:
  fig = plt.figure
  plt.imshow(element["image"])
  plt.show()'''),
        ('irJix4sJkNcf', r'''data_iter = iter(data_loader)

num_steps = 5

# Read some elements.
for i in range(num_steps):
  x = next(data_iter)
  print(i, x["file_name"], x["label"])'''),
        ('qRoTuxBNl8DB', r'''mngr = ocp.CheckpointManager("/tmp/orbax")

!rm -rf /tmp/orbax

# Save the checkpoint
assert mngr.save(
    step=num_steps, args=grain.GrainCheckpointSave(data_iter), force=True)
# Checkpoint saving in Orbax is asynchronous by default, so we'll wait until
# finished before examining checkpoint.
mngr.wait_until_finished()

!ls -R /tmp/orbax'''),
        ('wT04O9cdlpPJ', r'''# Read more elements and advance the iterator
for i in range(5, 10):
  x = next(data_iter)
  print(i, x["file_name"], x["label"])'''),
        ('Js3hheiGnykN', r'''# Restore iterator from previously saved checkpoint
mngr.restore(num_steps, args=grain.GrainCheckpointRestore(data_iter))'''),
        ('X6NT-drgoaJk', r'''# Iterator should be set back to start from 5.
for i in range(5, 10):
  x = next(data_iter)
  print(i, x["file_name"], x["label"])'''),
        ('-0hJjr9UuNxR', r'''in_memory_datasource = grain.InMemoryDataSource(range(5))

print(in_memory_datasource)
print(f"First Record Read: {in_memory_datasource[0]}")'''),
        ('7aVz3km3_qAw', r'''data_loader = grain.DataLoader(
    data_source=in_memory_datasource,
    sampler=grain.IndexSampler(
      num_records=len(in_memory_datasource),
      num_epochs=2,
      shard_options=grain.NoSharding(),
      shuffle=True,
      seed=0),
    worker_count=5)

data_iter = iter(data_loader)

for i in range(len(in_memory_datasource) * 2):
  x = next(data_iter)
  print(x)'''),
        ('_W360gEYNLYW', r'''# Following configuration makes 8*10=80 threads reading data.
data_loader = grain.DataLoader(
    data_source=source,
    sampler=grain.IndexSampler(
      num_records=len(source),
      num_epochs=2,
      shard_options=grain.NoSharding(),
      shuffle=True,
      seed=0),
    worker_count=10,
    read_options=grain.ReadOptions(num_threads=8, prefetch_buffer_size=500))'''),
    ],
    'jax_training': [
        ('jx-imports', r'''import grain
import jax
import jax.numpy as jnp
import numpy as np
import tensorflow_datasets as tfds'''),
        ('jx-minimal-code', r'''source = tfds.data_source("mnist", split="train")

ds = (
    grain.MapDataset.source(source)
    .seed(42)
    .shuffle()
    .map(lambda r: {"image": r["image"].astype(np.float32) / 255.0,
                    "label": r["label"]})
    .batch(batch_size=128, drop_remainder=True)  # new leading dim
    .to_iter_dataset()
)

for batch in ds:
    batch = jax.device_put(batch)  # default device
    print(jax.tree.map(lambda x: (x.shape, x.dtype), batch))
    break'''),
        ('jx-repeat-code', r'''ds = (
    grain.MapDataset.source(source)
    .seed(42)
    .shuffle()
    .repeat()  # infinite stream
    .map(lambda r: {"image": r["image"].astype(np.float32) / 255.0,
                    "label": r["label"]})
    .batch(128, drop_remainder=True)
)
print("length:", len(ds))  # sys.maxsize'''),
        ('jx-collate-code', r'''def pad_collate(items):
    max_len = max(x["tokens"].shape[0] for x in items)
    tokens = np.stack([
        np.pad(x["tokens"], (0, max_len - x["tokens"].shape[0]))
        for x in items
    ])
    return {"tokens": tokens}

# Toy stream of variable-length token sequences.
ragged = grain.MapDataset.source(
    [{"tokens": np.arange(np.random.randint(2, 6))} for _ in range(16)]
)
ragged = ragged.batch(4, batch_fn=pad_collate, drop_remainder=True)
for i in range(3):
    print(ragged[i]["tokens"].shape)'''),
        ('jx-option-a-code', r'''ds = (
    grain.MapDataset.source(source)
    .seed(42).shuffle()
    .map(lambda r: {"image": r["image"].astype(np.float32) / 255.0,
                    "label": r["label"]})
    .batch(128, drop_remainder=True)
    .to_iter_dataset()
)

for step, batch in zip(range(2), ds):
    batch = jax.device_put(batch)
    print(step, batch["image"].shape, batch["image"].sharding)'''),
        ('jx-option-b-code', r'''ds = (
    grain.MapDataset.source(source)
    .seed(42).shuffle()
    .map(lambda r: {"image": r["image"].astype(np.float32) / 255.0,
                    "label": r["label"]})
    .batch(128, drop_remainder=True)
    .to_iter_dataset()
)
ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=4)
ds = ds.map(jax.device_put)  # transfer still on iter thread

for step, batch in zip(range(3), ds):
    print(step, batch["image"].shape, batch["image"].sharding)'''),
        ('jx-option-c-code', r'''ds = (
    grain.MapDataset.source(source)
    .seed(42).shuffle()
    .map(lambda r: {"image": r["image"].astype(np.float32) / 255.0,
                    "label": r["label"]})
    .batch(128, drop_remainder=True)
    .to_iter_dataset()
)

ds = grain.experimental.device_put(
    ds=ds,
    device=jax.devices()[0],     # or a Sharding (see below)
    cpu_buffer_size=4,           # batches buffered on host
    device_buffer_size=2,        # batches buffered on device
)

for step, batch in zip(range(2), ds):
    # `batch` is already a jax.Array on-device.
    print(step, batch["image"].sharding)'''),
        ('jx-shard-arrays-code', r'''devices = jax.devices()
mesh = jax.sharding.Mesh(np.array(devices), axis_names=("data",))
sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))

ds = (
    grain.MapDataset.source(source)
    .seed(42).shuffle().repeat()
    .map(lambda r: {"image": r["image"].astype(np.float32) / 255.0,
                    "label": r["label"]})
    .batch(128, drop_remainder=True)
    .to_iter_dataset()
)

ds = grain.experimental.device_put(
    ds=ds,
    device=sharding,
    cpu_buffer_size=4,
    device_buffer_size=2,
)

for step, batch in zip(range(3), ds):
    print(step, batch["image"].sharding)'''),
        ('jx-template-code', r'''BATCH_SIZE = 256
devices = jax.devices()
mesh = jax.sharding.Mesh(np.array(devices), axis_names=("data",))
sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))

def preprocess(r):
    return {"image": r["image"].astype(np.float32) / 255.0,
            "label": r["label"]}

ds = (
    grain.MapDataset.source(source)
    .seed(42).shuffle().repeat()
    .map(preprocess)
    .batch(BATCH_SIZE, drop_remainder=True)
    .to_iter_dataset()
)

ds = grain.experimental.device_put(
    ds=ds, device=sharding,
    cpu_buffer_size=4, device_buffer_size=2,
)

@jax.jit
def train_step(params, batch):
    # Replace with your real loss/update.
    return params + batch["image"].mean()

params = jnp.zeros(())
for step, batch in zip(range(3), ds):
  params = train_step(params, batch)
  print(step, " params:", params)'''),
    ],
    'pytorch': [
        ('cell1', r'''import grain
import matplotlib.pyplot as plt
import numpy as np
from PIL.Image import Image
import torch
# PyTorch imports
from torchvision import datasets
from torchvision.transforms import Lambda, ToTensor

rng = np.random.default_rng(0)'''),
        ('cell2', r'''fashion_mnist = datasets.FashionMNIST(root="data", train=True, download=True)
print(fashion_mnist)
print(fashion_mnist[0])
fashion_mnist[0][0]'''),
        ('cell3', r'''nrows, ncols = 4, 8
fig, axs = plt.subplots(nrows, ncols)
for x in range(ncols):
  for y in range(nrows):
    axs[y, x].imshow(fashion_mnist.data[rng.integers(len(fashion_mnist))])
    axs[y, x].set_axis_off()'''),
        ('cell4', r'''fashion_mnist_2 = datasets.FashionMNIST(
    root="data",
    train=True,
    download=True,
    transform=ToTensor(),
    target_transform=Lambda(
        lambda y: torch.zeros(10, dtype=torch.float).scatter_(
            0, torch.tensor(y), value=1
        )
    ),
)'''),
        ('cell5', r'''(fashion_mnist_2[0][0].size(), fashion_mnist_2[0][1])'''),
        ('cell6', r'''class ToTensorAndOneHot(grain.transforms.Map):
  to_tensor = ToTensor()

  def map(
      self, element: tuple[Image, int]
  ) -> tuple[torch.Tensor, torch.Tensor]:
    data = self.to_tensor(element[0])
    target = torch.zeros(10, dtype=torch.float).scatter_(
        0, torch.tensor(element[1]), value=1
    )
    return (data, target)


class KeepShoesOnly(grain.transforms.Filter):
  shoes_only = {5, 7, 9}  # Sandal, Sneaker, Ankle boot

  def filter(self, element: tuple[Image, int]) -> bool:
    return element[1] in self.shoes_only'''),
        ('cell7', r'''dataset = (
    grain.MapDataset.source(fashion_mnist)
    .shuffle(seed=42)
    .filter(KeepShoesOnly())  # leave only shoes
    .map(ToTensorAndOneHot())  # construct tensors and label one-hot encoding
    .to_iter_dataset()
    .batch(  # batches consecutive elements
        batch_size=5,
        batch_fn=lambda ts: tuple(torch.stack(t) for t in zip(*ts)),
    )
)'''),
        ('cell8', r'''iterator = iter(dataset)
batch_0 = next(iterator)
print(type(batch_0[0]), batch_0[0].shape)
print(batch_0[1])'''),
        ('cell9', r'''nrows, ncols = 4, 8
fig, axs = plt.subplots(nrows, ncols)
for x in range(ncols):
  data, _ = next(iterator)
  for y in range(nrows):
    axs[y, x].imshow(data[y, 0])
    axs[y, x].set_axis_off()'''),
    ],
    "huggingface": [
        ('cell1', r'''# Python standard library
from pprint import pprint
# HF imports
from datasets import load_dataset
from dateutil.parser import parse
import grain
import numpy as np
from transformers import AutoTokenizer'''),
        ('cell2', r'''hf_dataset = load_dataset("lhoestq/demo1")
hf_train, hf_test = hf_dataset["train"], hf_dataset["test"]
hf_dataset'''),
        ('cell3', r'''hf_train[0]'''),
        ('cell4', r'''def process_date(sample: dict) -> dict:
  sample["date"] = parse(sample["date"]).timestamp()
  return sample


def process_sample_to_np(sample: dict) -> np.ndarray:
  for name, value in sample.items():
    sample[name] = np.asarray(value)
  return sample'''),
        ('cell5', r'''dataset = (
    grain.MapDataset.source(hf_train)
    .shuffle(seed=42)  # shuffles globally
    .map(process_date)  # maps each element
    .map(process_sample_to_np)  # maps each element
)'''),
        ('cell6', r'''list(dataset)'''),
        ('cell7', r'''tokenizer = AutoTokenizer.from_pretrained("bert-base-uncased")
tokenizer'''),
        ('cell8', 'review = hf_train[0]["review"]\npprint(review)\nprint("\\n", tokenizer(review).keys(), "\\n")\npprint(np.asarray(tokenizer(review)["input_ids"]))'),
        ('cell9', r'''target_length = 70

def process_transformer(sample: dict) -> dict:
  tokenized = tokenizer(sample["review"])["input_ids"][:target_length]
  sample["review"] = np.pad(
      tokenized, pad_width=(0, target_length-len(tokenized)))
  return sample


dataset = (
    grain.MapDataset.source(hf_train)
    .shuffle(seed=42)
    .map(process_date)
    .map(process_transformer)
)'''),
        ('cell10', r'''dataset[2]'''),
        ('cell11', r'''dataset = (
    grain.MapDataset.source(hf_train)
    .shuffle(seed=42)
    .filter(lambda x: x["star"] > 3)  # filters samples
    .map(process_date)
    .map(process_transformer)
    .map(process_sample_to_np)
    .to_iter_dataset()
    .batch(batch_size=2)  # batches consecutive elements
)'''),
        ('cell12', r'''ds_iter = iter(dataset)
next(ds_iter)'''),
    ],
    "bagz": [
        ('cell1', r'''import grain
import bagz
from bagz.beam import bagzio
import numpy as np
import pathlib
import random
import apache_beam as beam'''),
        ('cell2', r'''assert np.__version__[0] == "1", "Apache Beam requires NumPy<2"'''),
        ('cell3', r'''with beam.Pipeline() as pipeline:
  data = ["record1", "record2", "record3"]
  _ = (
      pipeline
      | 'CreateData' >> beam.Create(data)
      | 'Capitalize' >> beam.Map(lambda x: x.upper())
      | 'Encode' >> beam.Map(lambda x: x.encode())
      | 'WriteData' >> bagzio.WriteToBagz('beam_data@*.bagz')
  )'''),
        ('cell4', r'''file = pathlib.Path("beam_data-00000-of-00001.bagz")
reader = bagz.Reader(file)
print(list(reader))'''),
        ('cell5', r'''random.seed(42)

records = list(f"Record: {random.randint(100, 1000)}" for _ in range(40))

file = pathlib.Path("data.bagz")

with bagz.Writer(file) as writer:
    for rec in records:
        writer.write(rec)'''),
        ('cell6', r'''reader = bagz.Reader(file)

print(len(reader))

print(reader[10])

print(list(reader[5:15]))'''),
        ('cell7', r'''dataset = (
    grain.MapDataset.source(reader)
    .shuffle(seed=42)
    .map(lambda x: x.decode())  # move from bytes to strings
    .filter(lambda x: x[-1] != "6")  # let's filter out some files
    .map(lambda x: x.upper())  # and capitalize them
    .to_iter_dataset()
)'''),
        ('cell8', r'''print(f"Filtered out: {len(reader) - len(list(dataset))} records.")

list(dataset)'''),
    ],
    'parquet': [
        ('dFnwN6NNw0Oe', r"""import pyarrow as pa
import pyarrow.parquet as pq

# Generate a sample PyArrow table containing email subjects and bodies.
table = pa.table({
    'email_subject': [
        "Meeting Reminder: Project X Update",
        "Important Announcement Regarding Company Policy",
        "FWD: Quick Question",
        "Your Order Confirmation #12345",
        "Invitation to Team Building Activity"
    ],
    'email_body': [
        "Hi team,\n\nJust a reminder about our Project X update meeting tomorrow at 10 AM PST. Please come prepared to discuss your progress and any roadblocks.\n\nSee you there,\n[Your Name]",
        "Dear employees,\n\nPlease be advised of a new company policy regarding remote work, effective May 1st, 2025. You can find the full details on the company intranet.\n\nRegards,\nManagement",
        "Hi [Name],\n\nForwarding you this email as you might have the answer to this quick question:\n\n[Original Email Content]",
        "Dear [Customer Name],\n\nThank you for your recent order! This email confirms your order #12345. You can view the details and track its shipment here: [Link]\n\nSincerely,\nThe [Company Name] Team",
        "Hello everyone,\n\nYou're invited to participate in our upcoming team building activity on Friday, April 28th. It will be a fun afternoon of [Activity]. Please RSVP by Wednesday.\n\nBest,\n[Organizer Name]"
    ]
})

# Write this table to a parquet file.
writer = pq.ParquetWriter('emails.parquet', table.schema)
writer.write_table(table)
writer.close()"""),
        ('nb5yPasvDwaj', r'''import grain
import pprint'''),
        ('62_D74LkdrQn', r'''ds = grain.experimental.ParquetIterDataset('./emails.parquet')'''),
        ('DlhbJX5zdrQo', r'''list(ds)[0]'''),
        ('PNPv8LEGdrQo', r'''class TokenizeText(grain.transforms.Map):
  """Tokenizes the text values within each element using a provided tokenizer."""
  def __init__(self, tokenizer):
    self._tokenizer = tokenizer

  def map(self, element):
    return [self._tokenizer.encode(item).tokens for item in element.values()]'''),
    ],
    'transformations': [
        ('cell0', r'''class PlusOne(grain.transforms.Map):

  def map(self, x: int) -> int:
    return x + 1'''),
        ('cell1', r'''class PlusOneWithIndexKey(grain.transforms.MapWithIndex):

  def map_with_index(self, i: int, x: int) -> tuple[int, int]:
    return (x + 1, i)'''),
        ('cell2', r'''class PlusRandom(grain.transforms.RandomMap):

  def random_map(self, x: int, rng: np.random.Generator) -> int:
    return x + rng.integers(100_000)'''),
        ('cell3', r'''class FlatMapTransformExample(grain.experimental.FlatMapTransform):
  max_fan_out: int

  def flat_map(self, element: int):
    for _ in range(self.max_fan_out):
      yield element'''),
        ('cell4', r'''class RemoveEvenElements(grain.transforms.Filter):

  def filter(self, element: int) -> bool:
    return element % 2'''),
    ],
}

SKIPPED_CELLS: dict[tuple[str, str], str] = {
    ('bagz', 'cell0'): 'installs packages',
    ('huggingface', 'cell0'): 'installs packages',
    ('dataset_basic', 'sHOibn5Q2GRt'): 'installs Grain',
    ('dataset_advanced', 'OFw1tjvkP3wb'): 'installs packages',
    ('dataset_advanced', 'Wb2y5VoTl5_H'): 'installs Orbax',
    ('dataset_advanced', 'F012QoCJl5_H'): "shell only: prints the checkpoint file (Zephon's state document by design)",
    ('dataset_debugging', 'xw_-jT1r6zNM'): 'installs Grain',
    ('dataset_debugging', 'bN45Z58E3jGS'): 'sleeps 10 s per element (minutes of sleeping; the same pipeline shape as the cell before)',
    ('data_loader', 'JVt1F3JbkWrz'): "shell only: prints the checkpoint file (Zephon's state document by design)",
    ('jax_training', 'jx-install'): 'installs packages',
    ('pytorch', 'cell0'): 'installs packages',
    ('parquet', 'fNIApmKT34ac'): 'installs Grain',
    ('parquet', '1qevksHMdrQo'): 'downloads a tokenizer from the Hugging Face Hub',
    ('parquet', 'O5vnwj7cek30'): 'needs the downloaded tokenizer',
    ('parquet', '46ZVbfmtek30'): 'needs the downloaded tokenizer',
}

SKIPPED_PAGES: dict[str, str] = {
    'arrayrecord': "downloads tfds 'bool_q' and a Hub tokenizer; the cells that remain only write and read an ArrayRecord file without Grain datasets",
    'readme': 'its one block is a fragment (the loop body is a comment)',
}
