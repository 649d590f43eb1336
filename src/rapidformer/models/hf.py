"""Loading and saving pretrained Hugging Face models for fine-tuning.

Every ``from_pretrained`` of the fine-tuning path lives here: the model, its tokenizer and its
config (read alone, before any process group exists, by the parallelism rules). ``transformers``
fails with an ``OSError`` or ``ValueError`` that names a file or a class; these functions turn
it into a :class:`~rapidformer.errors.ConfigError` on ``--pretrained-model-name-or-path`` that
says what is wrong with the directory (no config.json, no weights, no head for the task, no
tokenizer) or that the hub cannot be reached, each with its fix.

:func:`save_model` writes the fine-tuned model back for ``from_pretrained`` from weights
gathered out of whatever holds their shards (FSDP2, DeepSpeed, tensor parallelism).
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rapidformer.distributed.tensors import is_dtensor
from rapidformer.errors import ConfigError
from rapidformer.hub import hub_unreachable
from rapidformer.safe_load import hugging_face_weights

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PRETRAINED_FLAG = "--pretrained-model-name-or-path"
"""The flag every error here names: where the pretrained model comes from."""

__all__ = [
    "PRETRAINED_FLAG",
    "check_vocabulary",
    "load_model",
    "load_tokenizer",
    "save_model",
    "tp_plan_of",
]


def _hub_error(name: str, what: str, exc: BaseException) -> ConfigError:
    return ConfigError.single(
        PRETRAINED_FLAG,
        name,
        f"is not a local directory, and loading its {what} from the hub failed (no network "
        f"access to the hub from this machine, or no such model: {type(exc).__name__})",
        "download the model where the hub is reachable (save_pretrained) and pass that "
        "local directory",
    )


def _check_local(name_or_path: str) -> bool:
    """True for a local model directory (checked to hold a model), False for a hub name."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            files = ", ".join(sorted(p.name for p in path.iterdir())[:10]) or "nothing"
            raise ConfigError.single(
                PRETRAINED_FLAG,
                name_or_path,
                f"holds no model: no config.json there (found: {files})",
                "pass a directory written by save_pretrained (config.json, model weights, "
                "tokenizer files)",
            )
        return True
    # A hub name is "org/model"; a name whose folder exists here, or that starts as paths do,
    # is a path: a missing one is said at once, never looked up on the hub.
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if path.exists() or looks_local or (len(path.parts) > 1 and path.parent.is_dir()):
        raise ConfigError.single(
            PRETRAINED_FLAG, name_or_path, "no such model directory", _closest(path)
        )
    return False


def _closest(path: Path) -> str:
    """A fix naming the directory beside ``path`` whose name is closest to it, if any."""
    parent = path.parent if path.parent != Path() else Path(".")
    if not parent.is_dir():
        return f"check the path ({parent} does not exist either)"
    siblings = [p.name for p in parent.iterdir() if p.is_dir()]
    close = difflib.get_close_matches(path.name, siblings, n=1, cutoff=0.8)
    return f"did you mean {parent / close[0]}?" if close else f"check the path (in {parent})"


def _probe_hub(local: bool) -> None:
    """Fail at once on a hub name when the hub is unreachable, instead of after minutes of
    retries inside ``transformers``."""
    if not local and hub_unreachable():
        raise ConnectionError("the hub did not answer a connection within 3 s")


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The fast tokenizer saved with a model (a local directory or a hub name); the
    directory's own Python code runs only with ``trust_remote_code`` (--trust-remote-code)."""
    from transformers import AutoTokenizer

    local = _check_local(name_or_path)
    try:
        _probe_hub(local)
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        _refuse_remote_code(name_or_path, exc)
        if not local:
            raise _hub_error(name_or_path, "tokenizer", exc) from exc
        raise _holds_no(name_or_path, "usable tokenizer", exc, SAVE_TOKENIZER) from exc
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token  # GPT-2 style tokenizers have no pad token
    return tokenizer


SAVE_TOKENIZER = "save the tokenizer next to the model with tokenizer.save_pretrained(dir)"
SAVE_MODEL = "pass a directory written by model.save_pretrained(dir)"


def _holds_no(name_or_path: str, what: str, exc: Exception, fix: str) -> ConfigError:
    """A local model directory that lacks ``what``, with the first line of the library's
    reason."""
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return ConfigError.single(PRETRAINED_FLAG, name_or_path, f"holds no {what} ({reason})", fix)


NEW_WEIGHTS = "rapidformer_new_weights"
"""Attribute of a model :func:`load_model_reporting` loaded: the names of the parameters it
initialised because the checkpoint lacked them."""


def load_model(
    name_or_path: str, auto_class: str, trust_remote_code: bool = False, **kwargs: Any
) -> nn.Module:
    """``transformers.<auto_class>.from_pretrained(name_or_path, **kwargs)`` with errors that
    say what is wrong with the directory. Its safetensors are preferred; without them its
    ``.bin`` files are scanned before transformers unpickles them
    (:func:`rapidformer.safe_load.hugging_face_weights`); its own Python code runs only
    with ``trust_remote_code`` (--trust-remote-code)."""
    return load_model_reporting(name_or_path, auto_class, trust_remote_code, **kwargs)[0]


def load_model_reporting(
    name_or_path: str, auto_class: str, trust_remote_code: bool = False, **kwargs: Any
) -> tuple[nn.Module, str]:
    """:func:`load_model`, and what the load did beyond copying weights in one line (the new
    tensors it initialised, e.g. a task's head, and the checkpoint's tensors it left unused):
    transformers' own LOAD REPORT table, in a line of the run's log."""
    transformers = importlib.import_module("transformers")
    local = _check_local(name_or_path)
    kwargs = {**hugging_face_weights(name_or_path), **kwargs, "output_loading_info": True}
    try:
        _probe_hub(local)
        model, info = getattr(transformers, auto_class).from_pretrained(
            name_or_path, trust_remote_code=trust_remote_code, **kwargs
        )
    except OSError as exc:
        if not local:
            raise _hub_error(name_or_path, "model", exc) from exc
        raise _holds_no(name_or_path, "loadable model weights", exc, SAVE_MODEL) from exc
    except ValueError as exc:  # e.g. the architecture has no head for this task
        _refuse_remote_code(name_or_path, exc)
        raise ConfigError.single(
            PRETRAINED_FLAG,
            name_or_path,
            f"cannot be loaded as {auto_class} ({str(exc).splitlines()[0]})",
            "pick a model whose architecture supports the task",
        ) from exc
    # Which weights the checkpoint did not hold (a task's head, a pooler an MLM checkpoint
    # lacks): adapters train them in full, since a frozen random layer cannot be reproduced.
    setattr(model, NEW_WEIGHTS, tuple(sorted(info.get("missing_keys") or ())))
    return model, loading_summary(model, info)


def loading_summary(model: nn.Module, info: dict[str, Any]) -> str:
    """``new: classifier.weight (4 x 64), classifier.bias (4), initialised; not used: 5
    tensors (cls.predictions.*)``, or "" when the checkpoint matched the model."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    missing = sorted(info.get("missing_keys") or ())
    unused = sorted(info.get("unexpected_keys") or ())
    parts = []
    if missing:
        listed = [f"{name} ({' x '.join(map(str, shapes.get(name, ())))})" for name in missing]
        parts.append("new: " + ", ".join(listed) + ", initialised")
    if unused:
        prefixes = sorted({".".join(name.split(".")[:2]) + ".*" for name in unused})
        parts.append(f"not used: {len(unused)} tensors ({', '.join(prefixes)})")
    return "; ".join(parts)


def tp_plan_of(name_or_path: str, trust_remote_code: bool = False) -> Any:
    """The tensor-parallel plan (``base_model_tp_plan``) the model's config.json ships, read
    without weights; None when it has none, or for a hub name (not fetched by validation)."""
    if not (Path(name_or_path).expanduser() / "config.json").is_file():
        return None
    transformers = importlib.import_module("transformers")
    try:
        config = transformers.AutoConfig.from_pretrained(
            name_or_path, trust_remote_code=trust_remote_code
        )
    except ValueError as exc:
        _refuse_remote_code(name_or_path, exc)
        raise
    return getattr(config, "base_model_tp_plan", None)


def _refuse_remote_code(name_or_path: str, exc: Exception) -> None:
    """transformers refused to run the directory's own code: say which flag allows it."""
    if "trust_remote_code" not in str(exc):
        return
    raise ConfigError.single(
        PRETRAINED_FLAG,
        name_or_path,
        "maps its model or tokenizer to Python code shipped with it (config.json auto_map), "
        "which runs only when allowed",
        "read that code, then pass --trust-remote-code if you trust it",
    ) from None


def check_vocabulary(model: nn.Module, tokenizer_size: int, path: str) -> None:
    """Refuse a tokenizer whose ids the model cannot embed (they would fail on the first batch
    holding one, as an IndexError naming nothing)."""
    get = getattr(model, "get_input_embeddings", None)
    embeddings = get() if callable(get) else None
    rows = getattr(embeddings, "num_embeddings", None)
    if isinstance(rows, int) and tokenizer_size > rows:
        raise ConfigError.single(
            PRETRAINED_FLAG,
            path,
            f"its tokenizer has {tokenizer_size} entries but the model embeds only {rows} "
            "(config.json vocab_size): they do not belong together",
            "save the tokenizer the model was trained with in that directory, or resize the "
            "model's embeddings (model.resize_token_embeddings) before fine-tuning",
        )


def save_model(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str | Path,
    state_dict: dict[str, Any] | None = None,
) -> None:
    """Write ``model`` and ``tokenizer`` into ``out_dir`` for ``from_pretrained``; one rank
    calls it. ``state_dict``, where given, is the whole model gathered from its shards (FSDP2,
    DeepSpeed, tensor parallelism) and is written in place of the module's own tensors."""
    while isinstance(model, DistributedDataParallel):
        model = model.module
    if state_dict is not None and any(is_dtensor(p) for p in model.parameters()):
        model = _plain_copy(model, state_dict, use_cache=getattr(model, _CACHE_SETTING, None))
    with generation_cache(model):  # config.json keeps the model's own setting
        model.save_pretrained(out_dir, state_dict=state_dict)  # type: ignore[operator]
    tokenizer.save_pretrained(str(out_dir))


def _plain_copy(
    model: nn.Module, state_dict: dict[str, Any], use_cache: bool | None = None
) -> nn.Module:
    """An ordinary (not tensor-parallel) copy of ``model`` holding ``state_dict``.

    ``save_pretrained`` of a model loaded with a tensor-parallel plan gathers its DTensors and
    waits at a barrier, collectives that here only the writing rank would enter, even when it
    is handed the whole ``state_dict``: so the copy is saved instead, built on the meta device
    (no memory until the gathered tensors are assigned)."""
    config: Any = copy.deepcopy(model.config)
    if hasattr(config, "distributed_config"):
        config.distributed_config = None  # its barrier would wait for rank 0 only
    if use_cache is not None:
        config.use_cache = use_cache
    with torch.device("meta"):
        plain = type(model)(config)
    plain.load_state_dict(state_dict, assign=True)
    plain.tie_weights()  # type: ignore[operator]
    return plain


_CACHE_SETTING = "rapidformer_use_cache"
"""The attribute that keeps a model's own ``config.use_cache`` while it trains without it."""


def disable_generation_cache(model: nn.Module) -> bool:
    """Train ``model`` without its generation cache: ``config.use_cache = False``, the original
    kept on the model (:func:`generation_cache` and :func:`save_model` put it back). In
    training the cache only costs memory and time, and under torch.compile every layer's cache
    object is a new guard, so the shared block graph recompiles per layer until dynamo's
    recompile limit sends the rest of the layers to eager. True when something changed."""
    config = getattr(model, "config", None)
    if not getattr(config, "use_cache", False) or hasattr(model, _CACHE_SETTING):
        return False
    setattr(model, _CACHE_SETTING, True)
    config.use_cache = False  # type: ignore[union-attr]
    return True


@contextlib.contextmanager
def generation_cache(model: nn.Module) -> Iterator[None]:
    """The model's own ``use_cache`` setting for the duration (generation, saving)."""
    original = getattr(model, _CACHE_SETTING, None)
    config = getattr(model, "config", None)
    if original is None or config is None:
        yield
        return
    config.use_cache = original
    try:
        yield
    finally:
        config.use_cache = False
