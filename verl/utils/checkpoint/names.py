"""The older import path of the checkpoint names; ``verl.utils.checkpoint.layout`` defines them (and the rest)."""

from verl.utils.checkpoint.layout import (  # noqa: F401
    CONTENTS_FILENAME,
    INDEX_FILENAME,
    STEP_DIR_FORMAT,
    STEP_DIR_RE,
    TRACKER_FILENAME,
    TRANSFORMER_CONFIG_FILENAME,
)
