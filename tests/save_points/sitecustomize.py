"""Loaded by every Python process of a run whose PYTHONPATH starts with this directory (the trainer, its Ray
workers, what they fork and spawn): arms ``tests.save_points.points`` where the run's environment names a
point. See tests/test_save_process_lifetime.py."""

import os

if os.environ.get("VERL_TEST_SAVE_POINT"):
    try:
        from tests.save_points import points
    except ImportError:  # a process that does not see the repository
        pass
    else:
        points.arm()
