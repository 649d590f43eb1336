"""The feature table tells the truth about which switches work."""

from __future__ import annotations

from pathlib import Path

from rapidformer.config.fields import all_fields
from rapidformer.config.validate import NOT_AVAILABLE

FEATURES = Path(__file__).resolve().parents[1] / "docs" / "features.md"


def _rows() -> dict[str, str]:
    """Each flag named in the table's flags column -> that row's status."""
    status_by_flag: dict[str, str] = {}
    for line in FEATURES.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[1].startswith("`"):
            continue
        for flag in cells[1].split("`")[1::2]:
            status_by_flag[flag.split()[0]] = cells[2]
    return status_by_flag


def test_every_switch_is_in_the_feature_table_with_its_true_status() -> None:
    rows = _rows()
    for spec in all_fields():
        if spec.name in NOT_AVAILABLE:
            assert rows.get(spec.flag, "").startswith("not available yet"), spec.flag
    for flag in (
        "--mixed-precision",
        "--checkpoint-activations",
        "--sharding",
        "--recompute-granularity",
        "--global-batch-size",
        "--save",
        "--load",
        "--precision",
    ):
        assert rows[flag].startswith("works"), flag


def test_reliability_page_lists_every_exit_code() -> None:
    from rapidformer.errors import EXIT_CODES

    page = (FEATURES.parent / "reliability.md").read_text()
    for code in EXIT_CODES.values():
        assert f"| {code} |" in page, code
