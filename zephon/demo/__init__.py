"""Demo and test data, not the library: generated corpora, real text from the standard library,
chat conversations and a BPE trained in-process.

The machines this project is built on have no network and no model hub, so `zephon demo`, the
examples, the benchmarks and the tests make their text here. Nothing in the loader imports it.
"""
