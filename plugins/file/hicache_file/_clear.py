"""Removing one namespace's pages (``hicache_clear``): a walk of that namespace's directory only."""

from __future__ import annotations

import contextlib
import os

from . import _format as fmt

__all__ = ["clear_namespace"]


def clear_namespace(root_prefix: str, namespace: str) -> tuple[int, int, int, str]:
    """Delete the page files of keys starting with ``namespace + "."`` under ``root_prefix``.

    ``namespace`` is a checked key prefix; its first dot-separated field names the directory
    walked. Clearing a whole namespace (no dot) also removes its temp files and empty shard
    directories. Returns ``(pages removed, temp files removed, failures, first failure)``;
    files that vanish meanwhile are not failures.
    """
    first, dot, _ = namespace.partition(".")
    prefix = namespace + "."
    whole = not dot
    nsdir = root_prefix + first
    removed = temps = failed = 0
    first_error = ""
    for shard in _listdirs(nsdir):
        try:
            with os.scandir(shard) as it:
                names = [(e.name, e.path) for e in it]
        except OSError:
            continue  # removed meanwhile
        for name, path in names:
            temp = name.startswith(fmt.TEMP_PREFIX)
            if not (temp and whole) and not name.startswith(prefix):
                continue
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as err:
                failed += 1
                first_error = first_error or f"{path}: {err.strerror or err}"
                continue
            if temp:
                temps += 1
            else:
                removed += 1
        with contextlib.suppress(OSError):
            os.rmdir(shard)  # only if empty: a concurrent writer's files keep it
    if whole:
        with contextlib.suppress(OSError):
            os.rmdir(nsdir)
    return removed, temps, failed, first_error


def _listdirs(path: str) -> list[str]:
    try:
        with os.scandir(path) as it:
            return [e.path for e in it if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
