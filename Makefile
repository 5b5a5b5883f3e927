# Two commands for a newcomer: `make chat` talks to a model, `make test` runs every check.
# Both create .venv on first use. Nothing here needs a GPU.
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

.PHONY: install chat serve test sync
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
