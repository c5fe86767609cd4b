"""User-facing errors: one line naming the thing at fault and the fix; the CLI exits with code 2."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

USER_ERROR_EXIT_CODE = 2


class UserError(Exception):
    """An error the user caused and can fix; its message is printed as one line."""


@contextlib.contextmanager
def atomic_output_dir(final: str | os.PathLike, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary folder beside `final`; rename it to `final` only if the block succeeds.

    A failure (any exception) removes the temporary folder, so no half-written output is left.
    """
    final = Path(final)
    if final.exists() and not overwrite:
        raise UserError(f"{final}: output folder already exists; remove it or choose another --output")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)


def read_json(path: Path, what: str, fix: str) -> Any:
    """A JSON file the user pointed at; a missing or malformed one is a UserError naming it and `fix`."""
    if not path.is_file():
        raise UserError(f"{path}: {what} not found; {fix}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: {what} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
