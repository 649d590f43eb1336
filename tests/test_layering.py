"""The house rules a maintainer relies on, checked on the code itself.

* Imports flow one way, down the tiers of :data:`TIERS` (config -> distributed -> state ->
  step -> accel -> engine -> templates ...), counting imports inside functions and under
  TYPE_CHECKING; no module imports itself through others; an import inside a function sits
  only where :data:`LAZY_IMPORTS` says why; adapters are named only in their package (and in
  the schema, the order and the accel package's table). The engine and the Trainer's loop
  hold no backend-specific branches:
  backends arrive through the train state's slots, registered in engine/order.py only.
* Each acceleration refuses only its own flags (what it cannot run with is in its own
  module), and every flag has at most one owner.
* Only the engine drives the step guard.
* Tests mirror ``src/``; no test module imports from another test module.
"""

from __future__ import annotations

import ast
import importlib
import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rapidformer import RapidformerConfig
from rapidformer.config.validate import Feature, RunContext
from rapidformer.engine.order import BACKENDS, FEATURES
from rapidformer.engine.validation import parallel_dims
from rapidformer.errors import Violation

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "rapidformer"
TESTS = ROOT / "tests"


def _files(folder: str) -> list[Path]:
    return sorted((SRC / folder).rglob("*.py")) if (SRC / folder).is_dir() else [SRC / folder]


TIERS: tuple[tuple[str, ...], ...] = (
    ("errors", "quiet", "seeding", "hardware", "log", "labels", "hub", "loaded"),
    ("config", "own_files"),
    ("distributed",),
    ("threads", "schedules", "memory", "launcher", "fatal", "safe_load", "reliability"),
    ("workers", "models", "data"),
    ("flops", "step_io"),
    ("trackers", "state"),
    ("step",),
    ("accel", "checkpoint"),
    ("engine",),
    ("templates",),
    ("dryrun", "export", "compat"),
    ("__init__",),
    ("cli", "testing"),
    ("__main__",),
)
"""Every package and top-level module of ``src/rapidformer``, bottom first. An import runs to a
strictly lower tier or stays inside its own place: two places of one tier never import each
other, and nothing imports upward."""

LAZY_IMPORTS: dict[str, str] = {
    "cli.py": "`rapidformer --help` and a mistyped flag answer before torch is imported",
    "workers.py": "the launcher's flags are checked before torch.distributed is imported",
    "fatal.py": "it runs while another error is reported: a launch variable it cannot read, "
    "or a store it cannot reach, must not raise a second error at import",
    "launcher.py": "a notebook imports `launch` without torch.distributed",
    "templates/families/base.py": "transformers is imported only when a model is exported",
    "testing/": "each helper for tests, demos and benchmarks loads only what it needs",
}
"""Where an import of rapidformer's own code may sit inside a function, and why (imports of
optional packages, such as deepspeed or torchao, are not counted)."""


def _module(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(p): p for p in SRC.rglob("*.py")}


@dataclass(frozen=True)
class Import:
    """One import of rapidformer's code: the module it names, where, and whether it runs when
    the module is imported (an ``if TYPE_CHECKING`` block counts as top level)."""

    target: str
    line: int
    top_level: bool


def _resolve(name: str) -> str:
    """The module ``name`` lives in (``rapidformer.a.b.Name`` -> ``rapidformer.a.b``)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(source: str, module: str, is_package: bool = False) -> list[Import]:
    """Every import of rapidformer's code in ``source`` (the text of ``module``): at the top,
    under ``if TYPE_CHECKING``, or inside a function."""
    tree = ast.parse(source)
    scoped = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    top = {id(n) for node in tree.body if not isinstance(node, scoped) for n in ast.walk(node)}
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            if name == "rapidformer" or name.startswith("rapidformer."):
                found.append(Import(_resolve(name), node.lineno, id(node) in top))
    return found


def _graph() -> dict[str, list[Import]]:
    graph = {}
    for module, path in MODULES.items():
        found = imports_of(path.read_text(), module, path.name == "__init__.py")
        graph[module] = [i for i in found if i.target != module]
    return graph


def _place(module: str) -> str:
    """The package or top-level module ``module`` belongs to (``__init__``: the package's
    own face)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _tier(place: str) -> int:
    return next(i for i, tier in enumerate(TIERS) if place in tier)


def test_every_place_has_one_tier() -> None:
    places = {_place(m) for m in MODULES}
    tiered = [place for tier in TIERS for place in tier]
    assert len(tiered) == len(set(tiered)), "a place stands in two tiers"
    assert places == set(tiered), f"untiered: {places - set(tiered)}, gone: {set(tiered) - places}"


def test_every_import_runs_down_the_tiers() -> None:
    """Function-level and TYPE_CHECKING imports included: an import that runs late still ties
    the two places together."""
    upward = [
        f"{MODULES[module].relative_to(SRC)}:{i.line} imports {i.target}"
        for module, found in _graph().items()
        for i in found
        if _place(i.target) != _place(module) and _tier(_place(i.target)) >= _tier(_place(module))
    ]
    assert not upward, "\n".join(upward)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_through_others() -> None:
    """No circle between modules, inside a place or across places, function-level imports
    included."""
    graph = {module: {i.target for i in found} for module, found in _graph().items()}
    assert circles(graph) == []


def test_the_import_checks_see_what_they_claim_to_see() -> None:
    """The checks above would catch a late import, an upward one and a circle (they are not
    vacuous)."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from rapidformer.state import TrainState\n"
        "def f():\n    from rapidformer.engine import order\n"
    )
    found = imports_of(source, "rapidformer.models.gpt")
    assert sorted((i.target, i.top_level) for i in found) == [
        ("rapidformer.engine.order", False),
        ("rapidformer.state", True),
    ]
    assert _tier(_place("rapidformer.engine.order")) > _tier(_place("rapidformer.models.gpt"))
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_rapidformer_imports_sit_inside_functions_only_where_listed() -> None:
    """Imports run at the top of a module, where the reader looks for them, unless the file
    is listed with the reason it must import late."""

    def listed(path: str) -> bool:
        return any(path == item or (item.endswith("/") and path.startswith(item))
                   for item in LAZY_IMPORTS)  # fmt: skip

    late = [
        f"{path}:{i.line} imports {i.target}"
        for module, found in _graph().items()
        if not listed(path := MODULES[module].relative_to(SRC).as_posix())
        for i in found
        if not i.top_level
    ]
    assert not late, "\n".join(late)


@pytest.mark.parametrize(
    "leaf",
    ["config/schema.py", "distributed/dims.py", "errors.py", "log.py", "labels.py", "hub.py"],
)
def test_leaves_import_nothing_of_rapidformer(leaf: str) -> None:
    path = SRC / leaf
    assert imports_of(path.read_text(), _module(path)) == []


ADAPTERS_NAMED = {"config/schema.py", "engine/order.py", "accel/__init__.py"}
"""Files outside ``accel/lora/`` that may name LoRA: the schema of its flags, its place in the
order (and the export registry there), and the accel package's table of its features."""


def test_adapters_live_in_their_package() -> None:
    """Everything else reaches adapters through the frozen base's slot
    (:class:`rapidformer.state.BaseAdditions`) and the export registry, never by name."""
    naming = {
        path.relative_to(SRC).as_posix()
        for path in SRC.rglob("*.py")
        if "lora" not in path.relative_to(SRC).parts and "lora" in path.read_text().lower()
    }
    assert naming <= ADAPTERS_NAMED, sorted(naming - ADAPTERS_NAMED)


def test_the_engine_and_the_loop_name_no_backend_except_where_they_are_chosen() -> None:
    """Backends are chosen once, in engine/order.py; the rest of the engine and the loop
    reach them only through the train state's slots."""
    pattern = re.compile(r"deepspeed|onnx|_ort", re.IGNORECASE)
    files = [p for p in _files("engine") if p.name != "order.py"]
    for path in [*files, SRC / "templates" / "trainer.py"]:
        for number, line in _code_lines(path):
            assert not pattern.search(line), f"{path.relative_to(SRC)}:{number}: {line.strip()}"


def _code_lines(path: Path, skip_functions: tuple[str, ...] = ()) -> list[tuple[int, str]]:
    """``path``'s lines that are code (comments and docstrings dropped, and the bodies of
    the functions named in ``skip_functions``)."""
    tree = ast.parse(path.read_text())
    dropped = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                dropped.update(range(body[0].lineno, (body[0].end_lineno or 0) + 1))
        if isinstance(node, ast.FunctionDef) and node.name in skip_functions:
            dropped.update(range(node.lineno, (node.end_lineno or 0) + 1))
    lines = path.read_text().splitlines()
    return [
        (number, line.split("#")[0])
        for number, line in enumerate(lines, 1)
        if number not in dropped and line.split("#")[0].strip()
    ]


def test_no_accel_module_asks_which_backend_another_one_is() -> None:
    """Only DeepSpeed's own package (its slots and rules) reads --zero-backend; the native
    steps are simply not in DeepSpeed's order, and a switch DeepSpeed cannot run says so in
    its feature (``refused_on``), which engine/order.py reads."""
    for path in _files("accel"):
        if "deepspeed" in path.relative_to(SRC).parts:
            continue
        for number, line in _code_lines(path):
            assert "zero_backend" not in line, f"{path.relative_to(SRC)}:{number}: {line.strip()}"


def test_only_the_pipeline_slot_knows_it_is_a_pipeline() -> None:
    """What precision, data parallelism and checkpoints need from a pipeline they ask the
    forward-backward slot (``forward_modules``, ``averaged_by``, ``holds_whole_model``):
    nobody else inspects the slot's type or its private members. Validation rules may read
    the pipeline degree: they run before any slot exists."""
    pattern = re.compile(
        r"PipelineForwardBackward|forward_backward\.(modules|model|_)|dims\.pp > 1"
    )
    # sharding decides FSDP2's resharding by the pp degree.
    allowed = {"sharding.py"}
    for folder in ("accel", "step", "checkpoint", "templates", "engine"):
        for path in _files(folder):
            if path.name in allowed or "pipeline" in path.relative_to(SRC).parts:
                continue
            for number, line in _code_lines(path, skip_functions=("rules", "native_rules")):
                assert not pattern.search(line), f"{path.relative_to(SRC)}:{number}: {line}"


def test_the_engine_never_branches_on_moe() -> None:
    """MoE bookkeeping is a slot whose default does nothing (``state.moe``)."""
    for path in _files("engine"):
        for number, line in _code_lines(path):
            assert "moe is" not in line and "moe:" not in line.replace(" ", ""), (
                f"{path.relative_to(SRC)}:{number}: {line.strip()}"
            )


def test_one_helper_takes_a_tensors_local_part() -> None:
    """``rapidformer.distributed.tensors.local_part`` is the only DTensor-to-local helper."""
    pattern = re.compile(r"to_local\(\) if isinstance|def _?local\(")
    for path in [*SRC.rglob("*.py"), *TESTS.rglob("*.py")]:
        if path.name in ("tensors.py", "test_layering.py"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not pattern.search(line), f"{path.relative_to(ROOT)}:{number}: {line.strip()}"


@pytest.mark.parametrize(
    ("path", "limit"),
    [
        ("engine/engine.py", 400),
        ("templates/finetuner.py", 400),
        ("templates/trainer.py", 400),
        ("accel/pipeline/schedule.py", 400),
    ],
)
def test_the_busiest_files_stay_small(path: str, limit: int) -> None:
    lines = len((SRC / path).read_text().splitlines())
    assert lines <= limit, f"{path} has {lines} lines (at most {limit}): split it"


def test_no_source_file_passes_480_lines() -> None:
    long = {
        str(p.relative_to(SRC)): n
        for p in SRC.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 480
    }
    assert not long, f"split these files: {long}"


def test_the_pretrainer_names_no_model_family() -> None:
    """Model families are objects (templates/families/): adding one must not touch the
    Pretrainer."""
    for number, line in _code_lines(SRC / "templates" / "pretrainer.py"):
        assert not re.search(r"""["'](gpt|bert)["']""", line), f"pretrainer.py:{number}: {line}"


def test_the_finetuner_loads_nothing_itself() -> None:
    """Hugging Face loading, its error mapping and saving live in rapidformer.models."""
    for number, line in _code_lines(SRC / "templates" / "finetuner.py"):
        assert "from_pretrained" not in line, f"finetuner.py:{number}: {line.strip()}"


# ---- each acceleration refuses only its own flags ------------------------------------------

SWITCHES: dict[str, dict[str, object]] = {
    "moe": {"num_experts": 4, "moe_router_load_balancing_type": "global_aux_loss"},
    "ep": {"num_experts": 4, "expert_model_parallel_size": 2, "moe_use_upcycling": True},
    "pp": {"pipeline_model_parallel_size": 2, "pipeline_schedule": "ZBV"},
    "tp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "zero1": {"sharding": "zero1"},
    "zero3": {"sharding": "zero3", "cpu_offload": True},
    "offload": {"cpu_offload": True},
    "compile": {"torch_compile": True, "torch_compile_scope": "model"},
    "recompute": {
        "recompute_granularity": "selective",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    },
    "fused": {"fused_lm_loss": True},
    "fp8": {"precision": "fp8", "fp8_recipe": "rowwise"},
    "fp16": {"precision": "fp16"},
    "liger": {"liger_kernel": True},
    "ort": {"onnx_runtime_training": True},
    "lamb": {"optimizers": "apex_lamb"},
    "deepspeed": {"zero_backend": "deepspeed"},
    # Flags that only mean something beside a switch, given without it.
    "strays": {
        "fp8_recipe": "rowwise",
        "torch_compile_mode": "max-autotune",
        "pipeline_layer_split": "1,1",
        "moe_router_topk": 1,
        "recompute_num_layers": 2,
    },
}
"""Settings that switch each acceleration on (or misuse its flags); every pair is checked."""


def _violations_by_owner(
    config: RapidformerConfig, context: RunContext
) -> Iterator[tuple[Feature | str, Violation]]:
    """Each feature's violations under ``config``, with their owner; the backend's refusals
    are owned by the feature they name (engine/order.py builds them from ``refused_on``)."""
    for feature in FEATURES:
        for violation in feature.rules(config, context):
            yield feature, violation
    chosen = BACKENDS[config.memory.zero_backend]
    for violation in chosen._refusals(config, context):
        yield "refusal", violation


def _foreign(feature: Feature | str, violation: Violation) -> bool:
    if isinstance(feature, Feature):
        return violation.flag not in feature.flags
    return not any(violation.flag == f.flags[0] for f in FEATURES)


def _matrix() -> Iterator[tuple[str, RapidformerConfig, RunContext]]:
    for (a, one), (b, other) in itertools.combinations_with_replacement(SWITCHES.items(), 2):
        settings = {"train_iters": 1, "lr": 1e-3, "num_layers": 4, **one, **other}
        config = RapidformerConfig.from_dict(settings)
        dims = parallel_dims(config, world_size=8)
        for runs_loop, here in ((True, True), (False, False)):
            yield f"{a}+{b}", config, RunContext(dims, runs_loop=runs_loop, on_this_machine=here)


def test_no_accel_module_refuses_another_features_flag() -> None:
    """Where a switch cannot run with another, its own rules refuse its own flag and name
    the other in the text: adding a switch never edits another switch's rules."""
    foreign, refusals = [], 0
    for name, config, context in _matrix():
        for owner, violation in _violations_by_owner(config, context):
            refusals += 1
            if _foreign(owner, violation):
                label = owner.name if isinstance(owner, Feature) else owner
                foreign.append(f"{name}: {label} refused {violation}")
    assert not foreign, "\n".join(foreign[:10])
    assert refusals > 200, refusals  # the matrix reaches the rules (the check is not vacuous)


def test_the_ownership_check_catches_a_foreign_refusal() -> None:
    """The check above would see a feature that refuses another's flag."""

    def meddling(config: RapidformerConfig, context: RunContext) -> Iterator[Violation]:
        yield Violation("--pipeline-model-parallel-size", 2, "not with me", "drop it")

    feature = Feature("meddling", flags=("--fused-lm-loss",), rules=meddling)
    config = RapidformerConfig()
    context = RunContext(parallel_dims(config, 1))
    assert all(_foreign(feature, v) for v in feature.rules(config, context))


def test_every_flag_has_at_most_one_owner_and_every_rule_a_feature() -> None:
    owners: dict[str, str] = {}
    for feature in FEATURES:
        for flag in feature.flags:
            assert flag not in owners, f"{flag} is owned by {owners[flag]} and {feature.name}"
            owners[flag] = feature.name
    registered = {feature.rules for feature in FEATURES}
    for path in _files("accel"):
        module = ".".join(path.relative_to(SRC.parent).with_suffix("").parts)
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.FunctionDef) and n.name == "rules" for n in tree.body):
            rules = importlib.import_module(module).rules
            assert rules in registered, f"{module}.rules belongs to no registered FEATURE"


def test_refusals_name_literal_flags_of_their_own_feature() -> None:
    """Statically too: a ``Violation("--flag", ...)`` written in an accel module names a flag
    of the feature that module (or its package) declares."""
    for path in _files("accel"):
        module = ".".join(path.relative_to(SRC.parent).with_suffix("").parts)
        owned = _owned_flags(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", "")) == "Violation"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                flag = node.args[0].value
                assert flag in owned, f"{module}:{node.lineno} refuses {flag}, not its own"


def _owned_flags(module: str) -> set[str]:
    """The flags of the FEATURE ``module`` declares, or its package does."""
    feature = getattr(importlib.import_module(module), "FEATURE", None)
    if feature is None and module.count(".") > 2:  # a helper inside a feature's package
        feature = getattr(importlib.import_module(module.rsplit(".", 1)[0]), "FEATURE", None)
    return set(feature.flags) if isinstance(feature, Feature) else set()


# ---- only the engine drives the guard ------------------------------------------------------


def test_only_the_engine_drives_the_step_guard() -> None:
    """Steppers are handed the guard's decision; templates ask the engine (judge_skipped_steps,
    resume_at, stop_signal). No one else holds the guard or calls it."""
    calls = re.compile(
        r"\bStepGuard\b|\.guard\b|\.(decide|read_now|judge_read|step_done|judge_pending|"
        r"observe_loss)\("
    )
    for path in SRC.rglob("*.py"):
        if path.relative_to(SRC).as_posix() in ("engine/engine.py", "reliability/guard.py"):
            continue
        for number, line in _code_lines(path):
            if line.lstrip().startswith(("from ", "import ")):
                continue  # the Decision type a stepper is handed
            assert not calls.search(line), f"{path.relative_to(SRC)}:{number}: {line.strip()}"


# ---- tests mirror src/ and share helpers in one place -------------------------------------

TEST_ONLY_FOLDERS = {"helpers", "scripts", "gpu"}
"""Folders of tests/ that mirror nothing: shared helpers, scripts the tests run, CUDA tests."""


def test_tests_mirror_the_source_tree() -> None:
    """tests/X/Y/ exists only where src/rapidformer/X/Y/ does; a top-level test is about a
    top-level module or cuts across packages, never about one package's code."""
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    for folder in TESTS.rglob("*"):
        relative = folder.relative_to(TESTS)
        if not folder.is_dir() or "__pycache__" in relative.parts:
            continue
        if relative.parts[0] in TEST_ONLY_FOLDERS:
            continue
        assert (SRC / relative).is_dir(), f"tests/{relative} mirrors no src/rapidformer/{relative}"
    for path in TESTS.glob("test_*.py"):
        topic = path.stem.removeprefix("test_")
        owner = next((p for p in packages if topic == p or topic.startswith(p + "_")), None)
        assert owner is None, f"tests/{path.name} is about {owner}/: move it to tests/{owner}/"


def _test_imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every ``from tests...`` / ``import tests...`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tests"):
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("tests")]
    return found


def test_no_test_module_imports_another_test_module() -> None:
    """Shared helpers live in tests/helpers/ (or rapidformer.testing); no test module reaches
    into another one, or into conftest.py, and none imports a private name."""
    for path in TESTS.rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        for module, names in _test_imports(path):
            where = f"tests/{path.relative_to(TESTS)} imports {module}"
            assert module.startswith("tests.helpers"), f"{where}: use tests/helpers/"
            private = [name for name in names if name.startswith("_")]
            assert not private, f"{where}: private {private}"
