.PHONY: install test test-fast lint format train

install:  ## torch first (as the README's first line: the CPU wheel without a GPU), then the project
	pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/$$(nvidia-smi -L >/dev/null 2>&1 && echo cu130 || echo cpu)
	pip install -e ".[dev]"

test:  ## the whole suite as CI runs it: the one-process tests two at a time, then the multi-process ones
	pytest -q -n 2 -m "not distributed"
	pytest -q -m distributed

test-fast:  ## skip the slow and multi-process tests
	pytest -q -m "not slow and not distributed"

lint:  ## ruff, then mypy: the type check catches calls that CI's CPU tests never run (GPU code)
	ruff check .
	ruff format --check .
	mypy

format:
	ruff format .
	ruff check --fix .

train:  ## the default run: tiny model on the bundled plays
	python train.py
