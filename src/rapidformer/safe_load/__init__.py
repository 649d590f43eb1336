"""Loading never runs code from a checkpoint or a model directory.

A pickle names the Python callables that rebuild its objects, and unpickling calls them: a file
whose object reduces to ``os.system`` runs a command the moment it is loaded, before a single
tensor is read. A manifest's checksums do not help (whoever writes the files writes the
manifest). So every loader rapidformer calls reads pickles through an allowlist
(:mod:`.allowlist`): each file is scanned first, for a message that names the file and the
global (:mod:`.scan`), and the unpickling itself refuses anything else
(:mod:`.loaders`). ``--trust-checkpoint`` is the one way round (:func:`set_trust`).
"""

from rapidformer.safe_load.allowlist import ALLOWED_GLOBALS
from rapidformer.safe_load.loaders import (
    dcp_load_planner,
    dcp_reader,
    deepspeed_loading,
    hugging_face_weights,
    load_torch_file,
    scan_file,
    scan_files,
    set_trust,
    trusting,
)
from rapidformer.safe_load.scan import (
    RestrictedUnpickler,
    UnsafeCheckpointError,
    pickle_globals,
    torch_pickles,
)

__all__ = [
    "ALLOWED_GLOBALS",
    "RestrictedUnpickler",
    "UnsafeCheckpointError",
    "dcp_load_planner",
    "dcp_reader",
    "deepspeed_loading",
    "hugging_face_weights",
    "load_torch_file",
    "pickle_globals",
    "scan_file",
    "scan_files",
    "set_trust",
    "torch_pickles",
    "trusting",
]
