"""The result tables of the README and docs/benchmarks.md are what the committed result files say, and every
committed result file is reported somewhere."""

import glob
import pathlib

import pytest

from forge_engine.bench_report import update_report_blocks

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/benchmarks.md"]


@pytest.mark.parametrize("doc", DOCS)
def test_result_tables_are_current(doc):
    # raises if the document has no block or a block's glob names no file
    assert not update_report_blocks(str(ROOT / doc), check=True), (
        f"stale tables: run forge-engine bench report {doc}"
    )


def test_every_result_file_is_reported():
    text = "\n".join((ROOT / doc).read_text() for doc in DOCS)
    results = glob.glob(str(ROOT / "docs/benchmarks/*/*.json"))
    assert results, "no committed result files"
    unreported = [r for r in results if pathlib.Path(r).name not in text]
    assert not unreported, (
        f"result files no table links to (delete them or report them): {unreported}"
    )
