#!/usr/bin/env bash
# Every check of `make test`, in order; exits non-zero on the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
scratch=$(mktemp -d); trap 'rm -rf "$scratch"' EXIT
stage() { echo "== $1 (at $((SECONDS / 60))m$((SECONDS % 60))s)"; }

stage "1. the package is what the notebooks export"
cp -r forge_engine "$scratch/lib_before"
nbdev_export
if ! diff -r -x __pycache__ -x _modidx.py "$scratch/lib_before" forge_engine; then
  echo "FAIL: forge_engine/ differs from the notebooks' export: edit nbs/_py, run make sync, commit all three"; exit 1
fi

stage "2. modules import only the layers below their own (pyproject.toml's contract)"
lint-imports --no-cache

stage "2b. ruff: the notebooks, tests and labs formatted (line length 100) and free of lint errors"
ruff format --check --quiet . || { echo "FAIL: run make sync (or ruff format FILE) and commit"; exit 1; }
ruff check --quiet .

stage "3. notebooks are clean"
cp -r nbs "$scratch/nbs_before"
nbdev_clean
if ! diff -r "$scratch/nbs_before" nbs; then
  echo "FAIL: nbdev_clean changed notebooks: run make sync and commit"; exit 1
fi

stage "4. every notebook has its jupytext twin, in sync"
for nb in nbs/*.ipynb; do
  name=$(basename "$nb" .ipynb)
  twin="nbs/_py/$name.py"
  [ -f "$twin" ] || { echo "FAIL: $nb has no twin $twin"; exit 1; }
  jupytext --quiet --to py:percent -o "$scratch/$name.py" "$nb"
  diff -u "$twin" "$scratch/$name.py" || { echo "FAIL: $twin and $nb differ: run .dev/sync_notebooks.sh $name"; exit 1; }
done
for twin in nbs/_py/*.py; do
  [ -f "nbs/$(basename "$twin" .py).ipynb" ] || { echo "FAIL: $twin has no notebook"; exit 1; }
done

# Without a GPU, Triton kernels run in its interpreter; that must be decided before anything imports triton.
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || export TRITON_INTERPRET=1

stage "5. every notebook runs (cells flagged gpu are skipped on CPU)"
# nbdev_test runs one notebook a core at a time: one thread each (two-thread pools on two cores spin against each other)
OMP_NUM_THREADS=1 nbdev_test --do_print --timing

stage "6. pytest"
python -m pytest -q -p no:cacheprovider --durations=15
