"""The screenshots of docs/trackers.md: a 60-step tiny run reported to TensorBoard and MLflow,
each UI started locally and photographed by a headless Chromium.

Needs what the project does not install: a Chromium (``apt-get install chromium``) and
Playwright's Python package in any environment (``pip install playwright``; it drives the
system's Chromium, nothing is downloaded). Run from the repository root, with
``PLAYWRIGHT_PYTHON`` naming a Python that has Playwright (default: this one):

    .venv/bin/python benchmarks/tracker_screenshots.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "docs" / "images"
FLAGS = [
    "--user-script", str(ROOT / "tests" / "scripts" / "deterministic_trainer.py"),
    "--lr", "3e-3", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "24", "--max-position-embeddings", "32", "--train-iters", "60",
    "--micro-batch-size", "4", "--log-interval", "2", "--eval-interval", "10", "--eval-iters", "2",
    "--report-to", "tensorboard,jsonl,mlflow", "--run-name", "demo-run",
]  # fmt: skip
SHOOT = """
import sys, time
from playwright.sync_api import sync_playwright
with sync_playwright() as p:
    browser = p.chromium.launch(executable_path="/usr/bin/chromium",
                                args=["--no-sandbox", "--disable-gpu", "--disable-webgl"])
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(sys.argv[1])
    time.sleep(12)  # the charts load after the page
    page.screenshot(path=sys.argv[2])
    browser.close()
"""


def main() -> None:
    bin_dir = Path(sys.executable).parent
    shooter = os.environ.get("PLAYWRIGHT_PYTHON", sys.executable)
    with tempfile.TemporaryDirectory() as tmp:
        save = Path(tmp) / "demo-run"
        subprocess.run(
            [sys.executable, "-m", "rapidformer", *FLAGS, "--save", str(save)], check=True
        )
        database = f"sqlite:///{save / 'mlflow.db'}"
        servers = [
            subprocess.Popen([str(bin_dir / "tensorboard"), "--logdir", str(save / "tensorboard"),
                              "--port", "6006", "--host", "127.0.0.1"]),
            subprocess.Popen([str(bin_dir / "mlflow"), "ui", "--backend-store-uri", database,
                              "--port", "5055", "--host", "127.0.0.1"]),
        ]  # fmt: skip
        try:
            time.sleep(20)
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=database)
            experiment = client.get_experiment_by_name("rapidformer")
            assert experiment is not None
            run = client.search_runs([experiment.experiment_id])[0].info.run_id
            pages = {
                "trackers_tensorboard.png": "http://127.0.0.1:6006/#timeseries",
                "trackers_mlflow.png": f"http://127.0.0.1:5055/#/experiments/"
                f"{experiment.experiment_id}/runs/{run}/model-metrics",
            }
            for name, url in pages.items():
                subprocess.run([shooter, "-c", SHOOT, url, str(IMAGES / name)], check=True)
                print(f"wrote {IMAGES / name}")
        finally:
            for server in servers:
                server.terminate()


if __name__ == "__main__":
    main()
