.PHONY: install test test-fast lint format train

install:  ## torch first (a CPU wheel here; pick your CUDA build on a GPU machine), then the project
	pip install torch==2.13.0
	pip install -e ".[dev]"

test:  ## the whole suite (what CI runs)
	pytest -q

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
