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


def test_the_offline_table_names_what_its_modules_have() -> None:
    """docs/index.md's "Without internet": every name in the call column is in its module."""
    import importlib
    import re

    page = (FEATURES.parent / "index.md").read_text()
    table = page.split("## Without internet", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| ")]
    checked = 0
    for _, call, module in rows[1:]:  # the header row first
        names = re.findall(r"\b([A-Za-z_]\w*)\(|`([A-Z]\w+)`", call)
        imported = importlib.import_module(module.strip().strip("`"))
        for name in (a or b for a, b in names):
            assert hasattr(imported, name), f"{module}: no {name}"
            checked += 1
    assert checked >= 8


def test_every_chart_opens_at_full_size_on_a_click() -> None:
    """A chart in the docs is shown at the text column's width: each image is a link to
    its own file, and the home and feature pages carry one."""
    import re

    docs = FEATURES.parent
    images = 0
    for page in docs.rglob("*.md"):
        text = page.read_text()
        for match in re.finditer(r"!\[[^\]]*\]\(([^)]+)\)", text):
            target = match.group(1)
            before = text[: match.start()]
            after = text[match.end() :]
            assert before.endswith("[") and after.startswith(f"]({target})"), (
                f"{page.relative_to(docs)}: {match.group(0)} is not a link to {target}"
            )
            assert (page.parent / target).is_file(), f"{page.relative_to(docs)}: no {target}"
            images += 1
    assert images >= 13
    assert "results/loss_parity.png" in (docs / "index.md").read_text()
    assert "](results/" in FEATURES.read_text().split("| feature |", 1)[0]


def test_the_parity_chart_counts_float32_steps_of_the_loss() -> None:
    """The home page's chart: each step's distance from one process in float32 rounding
    steps of the loss, on a hand-made result and on the committed one (whose table states
    the largest absolute differences)."""
    import json
    import sys

    import numpy as np

    root = FEATURES.parents[1]
    sys.path.insert(0, str(root / "benchmarks"))
    try:
        from charts import float32_distances
    finally:
        sys.path.remove(str(root / "benchmarks"))
    one = {"1": 6.0, "2": 0.625, "3": 1.0}
    ulp = {k: float(np.spacing(np.float32(v))) for k, v in one.items()}  # 4.8e-7, 6e-8, 1.2e-7
    shifted = {"1": 6.0 - 2 * ulp["1"], "2": 0.625, "3": 1.0 + ulp["3"]}
    result = {"one_process": {"train": one}, "layouts": {"a": {"train": shifted}}}
    assert float32_distances(result) == {"a": [2, 0, 1]}

    committed = json.loads((root / "benchmarks/results/loss_parity.json").read_text())
    distances = float32_distances(committed)
    assert distances["dp2 (DDP)"] == [0] * 300
    for name, layout in committed["layouts"].items():
        # Every difference is a few float32 steps: no layout drifts from one process.
        assert max(distances[name]) <= 3, name
        assert (max(distances[name]) == 0) == (layout["max_abs_diff"] == 0), name
