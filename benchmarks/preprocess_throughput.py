"""Preprocessing throughput: ``rapidformer-preprocess`` with 1 and with 2 worker processes.

The corpus is built offline from the docstrings of the Python standard library (modules, their
classes and functions, and the classes' methods), one document per unique docstring, in a fixed
order; a GPT-2 byte-level BPE vocabulary is trained on it first (not timed). Each run then
tokenizes the jsonl corpus into a .bin/.idx pair with ``--append-eod``.

What is timed: :func:`rapidformer.data.preprocess.preprocess` from just before the worker pool
is created (its start-up is charged to the run) to the renaming of the finished output files;
building the tokenizer in the parent process and parsing flags are not timed. documents/s counts
input lines, MB/s the input's bytes (1 MB = 10^6 bytes).

Runs are interleaved (1 worker, 2 workers, then 2, 1, ...) after one discarded warm-up run of
each, so that drift in machine load (other jobs on the same two cores) hits both alike; the
medians and their ratio are reported. Each run's outputs are hashed: 1 and 2 workers must write
identical bytes.

    .venv/bin/python benchmarks/preprocess_throughput.py            # writes the result files
    .venv/bin/python benchmarks/preprocess_throughput.py --quick    # smoke test, writes nothing
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import importlib
import inspect
import io
import json
import os
import pkgutil
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from rapidformer.data.preprocess import build_parser, preprocess
from rapidformer.data.tokenizers import train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
RESULTS_JSON = ROOT / "benchmarks" / "results" / "preprocess_throughput.json"
RESULTS_MD = ROOT / "docs" / "results" / "preprocess_throughput.md"

VOCAB_SIZE = 8000
WORKERS = (1, 2)
# Modules with side effects on import (a browser, a window, printing) or that are not for here.
SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "ensurepip", "venv"}
SKIP |= {"lib2to3", "msilib", "msvcrt", "winreg", "winsound", "nt", "pydoc_data", "xxlimited"}


def _import_quietly(name: str) -> Any:
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - platform-specific, optional or deprecated modules
        return None


def stdlib_modules() -> list[str]:
    """Public standard-library modules and the public submodules of its packages, sorted."""
    names = set()
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIP:
            continue
        module = _import_quietly(name)
        if module is None:
            continue
        names.add(name)
        for info in pkgutil.iter_modules(getattr(module, "__path__", []), prefix=name + "."):
            last = info.name.rsplit(".", 1)[-1]
            if not last.startswith("_") and last not in SKIP and "test" not in info.name:
                names.add(info.name)
    return sorted(names)


def stdlib_docstrings(limit: int) -> list[str]:
    """Up to ``limit`` unique docstrings of standard-library objects, in a fixed order: each
    module's, then those of its classes, their methods and its functions, by name."""
    seen: set[str] = set()
    docs: list[str] = []

    def add(obj: object) -> None:
        doc = inspect.getdoc(obj)
        if doc and doc not in seen:
            seen.add(doc)
            docs.append(doc)

    for name in stdlib_modules():
        if len(docs) >= limit:
            break
        module = _import_quietly(name)
        if module is None:
            continue
        add(module)
        for _, member in sorted(vars(module).items()):
            if getattr(member, "__module__", None) not in (name, module.__name__):
                continue
            if inspect.isclass(member):
                add(member)
                for _, method in sorted(vars(member).items()):
                    if inspect.isroutine(method):
                        add(method)
            elif inspect.isroutine(member):
                add(member)
    return docs[:limit]


def sha256_of(paths: list[str]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()


def run_once(input_path: str, prefix: str, files: tuple[str, str | None], workers: int) -> dict:
    argv = ["--input", input_path, "--output-prefix", prefix, "--json-keys", "text"]
    argv += ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", files[0]]
    argv += ["--merge-file", str(files[1]), "--append-eod", "--workers", str(workers)]
    argv += ["--log-interval", str(10**9)]  # only the final line
    args = build_parser().parse_args(argv)
    with contextlib.redirect_stderr(io.StringIO()):
        result = preprocess(args)
    out = result.outputs["text"]
    return {
        "workers": workers,
        "seconds": result.seconds,
        "docs_per_s": result.docs_per_s,
        "mb_per_s": result.mb_per_s,
        "documents": result.documents["text"],
        "tokens": result.tokens["text"],
        "output_sha256": sha256_of([out + ".bin", out + ".idx"]),
    }


def summarize(runs: list[dict]) -> dict[str, Any]:
    docs = [r["docs_per_s"] for r in runs]
    mbs = [r["mb_per_s"] for r in runs]
    return {
        "median_docs_per_s": statistics.median(docs),
        "min_docs_per_s": min(docs),
        "max_docs_per_s": max(docs),
        "median_mb_per_s": statistics.median(mbs),
        "min_mb_per_s": min(mbs),
        "max_mb_per_s": max(mbs),
        "median_seconds": statistics.median(r["seconds"] for r in runs),
        "runs": runs,
    }


def write_markdown(result: dict[str, Any]) -> None:
    corpus, machine = result["corpus"], result["machine"]
    lines = [
        "# Preprocessing throughput",
        "",
        "`rapidformer-preprocess` (GPT2BPETokenizer, byte-level BPE with a "
        f"{result['vocab_size']}-token vocabulary trained on the corpus, `--append-eod`) on "
        f"{corpus['documents']} documents ({corpus['bytes'] / 1e6:.2f} MB of jsonl, "
        f"{result['tokens']} tokens): the unique docstrings of the Python "
        f"{machine['python']} standard library. {result['pairs']} interleaved runs per worker "
        "count after one warm-up run of each. Timed: tokenizing and writing, the worker "
        "pool's start-up included (see `benchmarks/preprocess_throughput.py`).",
        "",
        "| --workers | median documents/s | min | max | median MB/s | min | max | median run (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for workers in WORKERS:
        side = result[f"workers_{workers}"]
        lines.append(
            f"| {workers} | {side['median_docs_per_s']:.0f} | {side['min_docs_per_s']:.0f} "
            f"| {side['max_docs_per_s']:.0f} | {side['median_mb_per_s']:.2f} "
            f"| {side['min_mb_per_s']:.2f} | {side['max_mb_per_s']:.2f} "
            f"| {side['median_seconds']:.2f} |"
        )
    lines += [
        "",
        f"**Ratio 2 workers / 1 worker (medians of documents/s): {result['ratio']:.2f}**; "
        f"median of the per-pair ratios: {result['median_pair_ratio']:.2f}.",
        "",
        "With `--workers 2` the two tokenizing processes share the machine's two cores with "
        "the parent process, which reads the input, unpickles the results and writes the "
        "files; a ratio of 2 is out of reach on two cores.",
        "",
        "Outputs: every run wrote the same bytes (SHA-256 of .bin + .idx "
        f"`{result['output_sha256'][:16]}...`) whatever the worker count"
        + (": yes." if result["outputs_identical"] else ": NO, see the JSON."),
        "",
        f"- Machine: {machine['cpu_count']} CPU cores ({machine['cpu']}), Python "
        f"{machine['python']}, tokenizers {machine['tokenizers']}; load average "
        f"{machine['loadavg_start']} at the start, {machine['loadavg_end']} at the end (other "
        "engineers' jobs share the cores: compare the min/max spread).",
        f"- Date: {result['date']}",
        f"- Reproduce: `{result['command']}`",
        "",
    ]
    RESULTS_MD.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_MD.write_text("\n".join(lines))


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=6000, help="corpus size (documents)")
    parser.add_argument("--pairs", type=int, default=9, help="interleaved runs per worker count")
    parser.add_argument(
        "--quick", action="store_true", help="smoke test (500 documents, 1 pair); writes nothing"
    )
    args = parser.parse_args()
    n_docs, pairs = (500, 1) if args.quick else (args.documents, args.pairs)
    loadavg_start = os.getloadavg()

    docs = stdlib_docstrings(n_docs)
    with tempfile.TemporaryDirectory(prefix="rf-preprocess-bench-") as tmp:
        input_path = os.path.join(tmp, "corpus.jsonl")
        with open(input_path, "w", encoding="utf-8") as f:
            for doc in docs:
                f.write(json.dumps({"text": doc}) + "\n")
        corpus_bytes = os.path.getsize(input_path)
        start = time.perf_counter()
        files = train_tokenizer(docs, "GPT2BPETokenizer", os.path.join(tmp, "tok"), VOCAB_SIZE)
        train_s = time.perf_counter() - start
        print(f"corpus: {len(docs)} documents, {corpus_bytes / 1e6:.2f} MB; tokenizer trained "
              f"in {train_s:.1f} s", flush=True)  # fmt: skip

        prefix = os.path.join(tmp, "out")
        for workers in WORKERS:  # warm-up: page cache, imports, allocator growth
            run_once(input_path, prefix, files, workers)
        runs: dict[int, list[dict]] = {w: [] for w in WORKERS}
        for pair in range(pairs):
            order = WORKERS if pair % 2 == 0 else WORKERS[::-1]
            for workers in order:
                run = run_once(input_path, prefix, files, workers)
                runs[workers].append(run)
                print(
                    f"pair {pair + 1}/{pairs} workers={workers}: {run['docs_per_s']:8.0f} docs/s "
                    f"{run['mb_per_s']:6.2f} MB/s  ({run['seconds']:.2f} s)",
                    flush=True,
                )

    one, two = summarize(runs[1]), summarize(runs[2])
    hashes = {r["output_sha256"] for w in WORKERS for r in runs[w]}
    import tokenizers

    result = {
        "ratio": two["median_docs_per_s"] / one["median_docs_per_s"],
        "median_pair_ratio": statistics.median(
            b["docs_per_s"] / a["docs_per_s"] for a, b in zip(runs[1], runs[2], strict=True)
        ),
        "workers_1": one,
        "workers_2": two,
        "outputs_identical": len(hashes) == 1,
        "output_sha256": sorted(hashes)[0],
        "pairs": pairs,
        "vocab_size": VOCAB_SIZE,
        "tokens": runs[1][0]["tokens"],
        "tokenizer_train_s": train_s,
        "corpus": {"documents": len(docs), "bytes": corpus_bytes,
                   "source": "unique docstrings of the Python standard library (inspect.getdoc)",
                   "sha256": hashlib.sha256("\x00".join(docs).encode()).hexdigest()},
        "machine": {"cpu": cpu_name(), "cpu_count": os.cpu_count(),
                    "python": platform.python_version(), "tokenizers": tokenizers.__version__,
                    "loadavg_start": [round(x, 2) for x in loadavg_start],
                    "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([".venv/bin/python", "benchmarks/preprocess_throughput.py",
                             *sys.argv[1:]]),
    }  # fmt: skip
    print(
        f"1 worker: median {one['median_docs_per_s']:.0f} docs/s, "
        f"{one['median_mb_per_s']:.2f} MB/s; 2 workers: median {two['median_docs_per_s']:.0f} "
        f"docs/s, {two['median_mb_per_s']:.2f} MB/s; ratio {result['ratio']:.2f}; "
        f"outputs identical: {result['outputs_identical']}"
    )
    if args.quick:
        return
    RESULTS_JSON.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_JSON.write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(result)
    print(f"wrote {RESULTS_JSON.relative_to(ROOT)} and {RESULTS_MD.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
