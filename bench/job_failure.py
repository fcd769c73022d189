"""A sweep job that failed leaves ``error.json`` in its folder, so the sweep report,
gathered in the launching process after every job ended, can name it and say why."""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any

ERROR_FILE = "error.json"
"""The failure record's name inside a job's output folder."""


def record_failure(folder: Path, job: dict[str, Any], exc: BaseException) -> Path:
    """Write ``folder/error.json``: the job's ``job`` info (number, label, overrides),
    ``error`` (``"ExceptionType: message"``) and the ``traceback``; returns its path."""
    path = folder / ERROR_FILE
    record = {"job": job, "error": f"{type(exc).__name__}: {exc}",
              "traceback": "".join(traceback.format_exception(exc))}
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path
