# The two commands a newcomer needs: `make demo` and `make test`. Each creates .venv when missing.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo test lint verify slow bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt setup.py zephon/media/libjpeg_binding.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt -e '.[all,test,lint,docs,torchtitan,megatron]'
	# Megatron's own samplers and build_pretraining_data_loader for tests/test_integration_megatron.py
	# (megatron-core's wheel has no megatron.training). --no-deps: the tests load only its
	# self-contained megatron/bridge/data/samplers.py by file path; its declared dependencies
	# (transformer-engine, mamba-ssm, ... CUDA builds) are for the rest of Megatron-Bridge.
	$(PIP) install --quiet --no-deps megatron-bridge==0.3.1
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/zephon demo

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# ruff over the tree; mypy over the installed package layout (zephon/ + backends/ as zephon.backends +
# compat/ as zephon.compat), which build/typecheck/ mirrors with symlinks so mypy sees the real names.
lint: $(STAMP) typecheck-tree
	$(VENV)/bin/ruff check .
	MYPYPATH=build/typecheck $(VENV)/bin/mypy -p zephon

.PHONY: typecheck-tree
typecheck-tree:
	rm -rf build/typecheck && mkdir -p build/typecheck/zephon
	for f in zephon/*; do ln -s ../../../$$f build/typecheck/zephon/; done
	ln -s ../../../backends build/typecheck/zephon/backends
	ln -s ../../../compat build/typecheck/zephon/compat

# The guarantee: `zephon verify` over the demo pipelines (text, images, VLM), every configuration
# of its matrix against numpy at D=1, step by step; the report goes to build/verify.{json,png}.
verify: $(STAMP)
	$(VENV)/bin/zephon verify --steps 80 --cross-steps 10 --report build/verify

# The long test matrices (@pytest.mark.slow: tokenizer code-point sweeps, storage and process matrices).
slow: $(STAMP)
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

bench: $(STAMP)
	$(VENV)/bin/zephon bench
	cd benchmarks && ../$(VENV)/bin/python pack.py && ../$(VENV)/bin/python pretokens.py && ../$(VENV)/bin/python batch_resume.py && ../$(VENV)/bin/python tokenize_real.py
	cd benchmarks && ../$(VENV)/bin/python finite_end.py
	cd benchmarks && ../$(VENV)/bin/python startup.py && ../$(VENV)/bin/python telemetry.py
	cd benchmarks && ../$(VENV)/bin/python sft.py
	cd benchmarks && ../$(VENV)/bin/python storage.py && ../$(VENV)/bin/python storage_outage.py
	cd benchmarks && ../$(VENV)/bin/python shuffle_ab.py
	cd benchmarks && ../$(VENV)/bin/python vlm.py
	cd benchmarks && ../$(VENV)/bin/python images.py && ../$(VENV)/bin/python image_decoders.py
	cd benchmarks && ../$(VENV)/bin/python grain_read_ahead.py

.PHONY: experiment
# Elastic training: a tiny LM trained at D = 1, 2, 4, 8 ranks with three loaders (~13 min on 2 cores);
# writes benchmarks/results/elastic_training.{json,png}
experiment: $(STAMP)
	$(PY) benchmarks/elastic_training.py

.PHONY: shuffle-ab
# Block shuffle vs full shuffle: the elastic-training LM at equal steps, 2 seeds, default and small
# window (~5 min on 2 cores); writes benchmarks/results/shuffle_ab.{json,png}
shuffle-ab: $(STAMP)
	$(PY) benchmarks/shuffle_ab.py

.PHONY: soak
# Soak: (1) packed LM pipeline for several epochs on processes(2) with worker SIGKILLs and
# stop/resume across D (a few minutes); exact tokens, stream = uninterrupted one, RSS/FDs/shm sampled;
# writes benchmarks/results/soak.{json,png}. (2) the same pipeline uninterrupted for DURATION seconds
# (default 600): slopes of fds, memfds, memfd mappings and RSS after warm-up, exit 1 if one still
# rises; writes benchmarks/results/soak_steady.{json,png}. `make soak DURATION=120` for a short one.
DURATION ?= 600
soak: $(STAMP)
	$(PY) benchmarks/soak.py
	$(PY) benchmarks/soak_steady.py --duration $(DURATION)

clean:
	rm -rf $(VENV) build *.egg-info

.PHONY: dist docs
# The wheel and sdist (python -m build), then the wheel alone in a fresh venv with only the core
# dependencies: a numpy loader runs and the CLI answers --help (what `pip install zephon-loader` gives).
dist: $(STAMP)
	rm -rf dist build/smoke-venv && mkdir -p build
	$(PY) -m build --outdir dist . > build/dist.log 2>&1 || (cat build/dist.log; exit 1)
	$(PYTHON) -m venv build/smoke-venv
	build/smoke-venv/bin/python -m pip install --quiet -c constraints.txt dist/*.whl
	cd build && smoke-venv/bin/python ../tests/smoke_wheel.py
	build/smoke-venv/bin/zephon --help > /dev/null && echo "wheel smoke test: zephon --help ok"

# The docs site (MkDocs, Material theme, API reference from the docstrings), warnings as errors.
docs: $(STAMP) typecheck-tree
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site

.PHONY: compare
# Zephon beside Grain, torchdata, Mosaic Streaming and HF datasets (benchmarks/compare.py): elastic
# determinism at D = 1, 2, 4 and throughput, in its own venv (build/compare-venv): Streaming needs
# torchvision, whose only build that imports here is torch 2.14.1 + torchvision 0.29.1 (~5.5 GB).
compare: $(STAMP)
	test -x build/compare-venv/bin/python || $(PYTHON) -m venv build/compare-venv
	build/compare-venv/bin/python -m pip install --quiet torch==2.14.1 torchvision==0.29.1 mosaicml-streaming \
		datasets torchdata matplotlib -e '.[grain]'
	build/compare-venv/bin/python benchmarks/compare.py
