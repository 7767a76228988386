"""The training stage's user error (one line at the CLI, exit 2: data.cli.cli_main), shared by train/*.py.

    from train.errors import TrainError
    raise TrainError("train.batch_size 0: must be >= 1")
"""

from __future__ import annotations

from data.cli import UserError


class TrainError(UserError, ValueError):
    """The run cannot start as configured; the message names the setting."""
