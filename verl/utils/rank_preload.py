"""What ``run_on_ranks``'s fork server runs once before it forks any rank (``verl.utils.distributed``).

Each rank then starts in well under a second instead of ~7 s: the heavy packages are imported (one that does not
import is left to the ranks, which then fail on it themselves); Hydra's plugin registry is scanned (each rank's first
compose would scan it again); and every object the garbage collector tracks at the end is moved out of its view
(``gc.freeze``), so a rank's collections, explicit (one per engine build) or automatic, walk only what the rank made,
not the ~500k objects of these imports.
"""

import contextlib
import importlib

from verl.utils.host_memory import freeze_long_lived_objects

PACKAGES = ("torch", "megatron.core", "megatron.core.models.gpt", "mbridge", "transformers", "verl.utils.megatron.cpu_runtime")

for _name in PACKAGES:
    with contextlib.suppress(ImportError):
        importlib.import_module(_name)
with contextlib.suppress(ImportError):
    from hydra.core.plugins import Plugins

    Plugins.instance()
freeze_long_lived_objects()  # collected first: what the imports left as garbage is freed, not frozen into every rank
