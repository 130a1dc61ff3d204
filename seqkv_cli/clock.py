"""The `created` time written into captures, archives and reports.

Honours SOURCE_DATE_EPOCH (https://reproducible-builds.org/specs/source-date-epoch/): with
it set, the same inputs give byte-identical files, which is how a user (or
bench/gpu/check.sh) proves that two machines or devices wrote the same archive.
"""

from __future__ import annotations

import datetime as dt
import os

from seqkv_cli.errors import SeqkvError

_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def created_utc() -> str:
    """Now (or SOURCE_DATE_EPOCH) as UTC ISO 8601 to the second."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if epoch is None or epoch == "":
        return dt.datetime.now(dt.UTC).strftime(_FORMAT)
    if not epoch.isdigit() or len(epoch) > 11:  # the spec: an integer count of seconds
        raise SeqkvError(f"SOURCE_DATE_EPOCH must be a count of seconds, got {epoch[:40]!r}")
    return dt.datetime.fromtimestamp(int(epoch), dt.UTC).strftime(_FORMAT)
