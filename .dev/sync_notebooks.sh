#!/usr/bin/env bash
# Twin (nbs/_py/X.py, what you edit) -> notebook (nbs/X.ipynb, formatted by ruff) -> module (forge_engine/).
# Usage: .dev/sync_notebooks.sh [NAME ...]   (names like 00_config; default: every twin)
# The direction is always twin -> notebook: jupytext --update keeps cell ids and outputs.
set -euo pipefail
cd "$(dirname "$0")/.."
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  for f in nbs/_py/*.py; do names+=("$(basename "$f" .py)"); done
fi
for n in "${names[@]}"; do
  if [ -f "nbs/$n.ipynb" ]; then upd=--update; else upd=; fi
  jupytext --quiet --to ipynb $upd -o "nbs/$n.ipynb" "nbs/_py/$n.py"
  ruff format --quiet "nbs/$n.ipynb"  # the notebook's code as the formatter writes it (make test checks)
  nbdev_clean --fname "nbs/$n.ipynb"
  # write the twin back from the notebook: jupytext normalises blank lines between cells
  jupytext --quiet --to py:percent -o "nbs/_py/$n.py" "nbs/$n.ipynb"
  nbdev_export --path "nbs/$n.ipynb"
done
