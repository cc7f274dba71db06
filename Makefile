# Two commands on a fresh machine: `make build` (set up, then build every zoo entry) and `make test`.
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.requirements.sha256
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup build test clean

setup:
	@PYTHON=$(PYTHON) bash scripts/setup.sh

build: setup
	$(VENV)/bin/doit build

test: setup
	$(VENV)/bin/python -m pytest -q tests

clean:
	rm -rf build .doit.db*
