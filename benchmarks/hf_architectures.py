"""Which Hugging Face architectures fine-tune on which tasks, measured: the table of
docs/finetuning.md.

Ten families built tiny and offline (2 layers, hidden 32, a vocabulary of about 300 trained on
the generated grammar; rapidformer.testing.families) through every task each supports, on the
learnable data of rapidformer.testing.finetune (512 training and 128 validation rows), one
process, fp32. Each cell reports the task's metric against chance, and whether the saved model
reloads with transformers and predicts the same (max |logit difference|). The tests
(tests/templates/test_architectures.py) run the same cells and assert the bounds.

    .venv/bin/python benchmarks/hf_architectures.py          # all cells, writes the result files
    .venv/bin/python benchmarks/hf_architectures.py --quick  # BERT and Llama, writes nothing
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from pathlib import Path

import torch
from common import argument_parser, stamp, write_results

from rapidformer.templates.architectures import model_type_of, supported_tasks
from rapidformer.templates.tasks import TASKS
from rapidformer.testing.breadth import ARCHITECTURES, CASES, CellResult, run_cell
from rapidformer.testing.finetune import task_dataset, tiny_model

SHORT = {
    "sequence_classification": "seq. classification",
    "token_classification": "token classification",
    "question_answering": "question answering",
    "masked_lm": "masked LM",
    "causal_lm": "causal LM",
    "seq2seq_lm": "seq2seq LM",
}
UNIT = {"accuracy": "acc", "f1": "F1", "exact_match": "EM", "perplexity": "ppl"}


def _cell(result: CellResult | None) -> str:
    if result is None:
        return "refused"
    mark = "" if result.learned and result.reload_same_predictions else " ✗"
    value = f"{result.value:.3g}" if result.metric != "exact_match" else f"{result.value:.0f}"
    return f"{UNIT[result.metric]} {value} ({result.chance:.3g}){mark}"


def main() -> None:
    args = argument_parser(__doc__ or "", "BERT and Llama only").parse_args()
    torch.set_num_threads(2)
    logging.getLogger("rapidformer").setLevel(logging.WARNING)
    kinds = ("bert", "llama") if args.quick else ARCHITECTURES
    results: dict[str, dict[str, CellResult | None]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = {t: task_dataset(t, root / "data" / t, train=512, validation=128) for t in TASKS}
        for kind in kinds:
            model = tiny_model(kind, root / kind)
            model_type = model_type_of(model)
            assert model_type is not None
            supported = supported_tasks(model_type)
            results[kind] = {}
            for task in TASKS:
                if task not in supported:
                    results[kind][task] = None
                    continue
                result = run_cell(kind, task, model, data[task], root / "runs" / kind / task)
                results[kind][task] = result
                print(f"{kind:11s} {task:24s} {_cell(result)}  {result.seconds:.1f} s")
    cells = [r for row in results.values() for r in row.values() if r is not None]
    lines = [
        "# Hugging Face architectures x fine-tuning tasks",
        "",
        "Each cell: the task's validation metric after fine-tuning a tiny model of the family "
        "(2 layers, hidden 32) on one process, and in brackets what guessing scores (perplexity: "
        "the vocabulary size; EM: 33, one of three phrases). Every cell also reloaded its saved "
        "directory with transformers' Auto class and predicted the same (max |logit "
        f"difference| {max(r.reload_max_diff for r in cells):.1e} over all cells); ✗ marks a "
        "cell that did not learn past its bound or did not reload the same. *refused*: the "
        "flags are rejected before anything is built, naming the tasks the family supports.",
        "",
        "| family | " + " | ".join(SHORT[t] for t in TASKS) + " |",
        "|---|" + "---|" * len(TASKS),
    ]
    for kind, row in results.items():
        lines.append(f"| {kind} | " + " | ".join(_cell(row[t]) for t in TASKS) + " |")
    lines += [
        "",
        "Steps: " + "; ".join(f"{SHORT[t]} `{' '.join(c.flags)}`" for t, c in CASES.items()),
        f"(micro-batch 16, sequence length 64). {len(cells)} cells in "
        f"{sum(r.seconds for r in cells):.0f} s of training.",
    ]
    if args.quick:
        print("\n".join(lines))
        return
    result = stamp(
        {
            name: {t: dataclasses.asdict(r) if r else None for t, r in row.items()}
            for name, row in results.items()
        }
    )
    write_results("hf_architectures", result, lines)


if __name__ == "__main__":
    main()
