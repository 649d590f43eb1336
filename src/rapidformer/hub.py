"""Whether the Hugging Face hub can be reached, asked before a model or a data set is looked up
there: a machine without network gets a clear error at once instead of minutes of retries."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

_OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def hub_unreachable() -> bool:
    """True when the hub cannot be reached (a 3 s connection probe). Never true under
    ``HF_HUB_OFFLINE=1`` / ``HF_DATASETS_OFFLINE=1``, where the libraries read their local
    cache and fail fast themselves."""
    if any(os.environ.get(v, "0").lower() in ("1", "true", "yes") for v in _OFFLINE):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.create_connection((host or "huggingface.co", 443), timeout=3.0).close()
    except OSError:
        return True
    return False
