# Two commands for a newcomer: `make chat` talks to a model, `make test` runs every check.
# Both create .venv on first use, with the versions in .dev/requirements.lock. Nothing here needs a GPU.
VENV ?= .venv
BIN := $(VENV)/bin
LOCK := .dev/requirements.lock
STAMP := $(VENV)/.installed
NEWEST := .venv-newest

# Exactly the locked versions (--no-deps: nothing the lock does not name), the package itself built with the
# locked setuptools, then pip's own check that every dependency is there.
$(STAMP): pyproject.toml $(LOCK)
	@echo "== installing the locked dev environment ($(LOCK)) into $(VENV); the first time takes a few minutes"
	python3 -m venv $(VENV)
	$(BIN)/python -m pip install --no-deps --progress-bar on -r $(LOCK)
	$(BIN)/python -m pip install --no-deps --no-build-isolation --progress-bar on -e .
	$(BIN)/python -m pip check
	touch $(STAMP)

.PHONY: install chat serve test sync test-newest lock
install: $(STAMP)

chat: $(STAMP)  ## chat in the terminal (SmolLM2 on CPU, Qwen3-4B on a big enough GPU)
	$(BIN)/forge-engine chat

serve: $(STAMP)  ## the OpenAI-compatible server on 127.0.0.1:8000, browser chat at /
	$(BIN)/forge-engine serve

test: $(STAMP)  ## every check CI runs: notebooks in sync and clean, notebook tests, pytest (with headless Chromium)
	PYTHON=$(BIN)/python bash .dev/install_browser.sh
	PATH="$(CURDIR)/$(BIN):$$PATH" bash .dev/check.sh

sync: $(STAMP)  ## after editing nbs/_py/*.py: write the notebooks and export the package
	PATH="$(CURDIR)/$(BIN):$$PATH" bash .dev/sync_notebooks.sh

test-newest:  ## not in CI: every check on the newest versions pyproject.toml's ranges allow (in .venv-newest)
	python3 -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install --upgrade --upgrade-strategy eager -e ".[dev]"
	PYTHON=$(NEWEST)/bin/python bash .dev/install_browser.sh
	PATH="$(CURDIR)/$(NEWEST)/bin:$$PATH" bash .dev/check.sh

lock:  ## after `make test-newest` passes: pin what it installed as the new lock
	grep "^#" $(LOCK) > $(LOCK).new
	$(NEWEST)/bin/python -m pip freeze --all --exclude-editable >> $(LOCK).new
	mv $(LOCK).new $(LOCK)
