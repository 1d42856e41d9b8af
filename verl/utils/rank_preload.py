"""What ``run_on_ranks``'s fork server runs once before it forks any rank (``verl.utils.distributed``).

Each rank then starts in well under a second instead of ~7 s: the heavy packages are imported; Hydra's plugin
registry is scanned (each rank's first compose would scan it again); and every object alive at the end is moved out
of the garbage collector's view (``gc.freeze``), so a rank's collections, explicit (one per engine build) or
automatic, scan only what the rank made, not the ~500k objects of these imports, and leave their pages shared.
"""

import gc

import mbridge  # noqa: F401
import megatron.core  # noqa: F401
import megatron.core.models.gpt  # noqa: F401
import torch  # noqa: F401
import transformers  # noqa: F401
from hydra.core.plugins import Plugins

import verl.utils.megatron.cpu_runtime  # noqa: F401

Plugins.instance()
gc.freeze()
