"""The globals a checkpoint's pickles may name: what tensors, state dicts and the checkpoint
formats rapidformer reads are rebuilt from, and nothing that can run other code."""

from __future__ import annotations

_STORAGES = ("Float", "Double", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte", "Bool")
_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8")

TORCH_GLOBALS = frozenset(
    {
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_parameter",
        "torch._tensor._rebuild_from_type_v2",
        "torch.serialization._get_layout",
        "torch.Size",
        "torch.Tensor",
        "torch.bool",
        "collections.OrderedDict",
        *(f"torch.{kind}Storage" for kind in _STORAGES),
        *(f"torch.{dtype}" for dtype in _DTYPES),
    }
)
"""torch's tensor and storage rebuild functions, its storage types and dtypes, and
``OrderedDict`` (state dicts)."""

DCP_GLOBALS = frozenset(
    {
        "torch.distributed.checkpoint.metadata.Metadata",
        "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
        "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
        "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
        "torch.distributed.checkpoint.metadata.TensorProperties",
        "torch.distributed.checkpoint.metadata.MetadataIndex",
        "torch.distributed.checkpoint.metadata.StorageMeta",
        "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        "pathlib.PosixPath",
        "pathlib._local.PosixPath",  # Python 3.13 pickles it under this name
    }
)
"""torch.distributed.checkpoint's metadata classes (its ``.metadata`` file, which names the
checkpoint's path)."""

NUMPY_GLOBALS = frozenset(
    {
        "numpy.core.multiarray._reconstruct",
        "numpy._core.multiarray._reconstruct",
        "numpy.ndarray",
        "numpy.dtype",
        "_codecs.encode",
    }
)
"""numpy's RNG state array, which rapidformer's checkpoints held before they stored it as a
tensor (``_codecs.encode``: how pickle writes its bytes)."""

DEEPSPEED_GLOBALS = frozenset(
    {
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
)
"""What DeepSpeed's own files hold besides tensors: found by scanning the checkpoints
DeepSpeed writes for ZeRO-1/2/3, fp32 and bf16, with and without offload
(``tests/safe_load/test_loading_safely.py`` scans them again). An fp16 DeepSpeed checkpoint
(GPUs only) holds its dynamic loss scaler instead, not seen here: it is refused until
scanned."""

ALLOWED_GLOBALS = TORCH_GLOBALS | DCP_GLOBALS | NUMPY_GLOBALS | DEEPSPEED_GLOBALS
"""Every global a scanned pickle may name."""
