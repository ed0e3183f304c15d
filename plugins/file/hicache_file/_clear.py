"""Removing one namespace's pages (``hicache_clear``): a walk of that namespace's directory only."""

from __future__ import annotations

import contextlib
import os

from . import _format as fmt
from ._dirs import DirTree, describe, open_dir

__all__ = ["clear_namespace"]


def clear_namespace(tree: DirTree, namespace: str) -> tuple[int, int, int, str]:
    """Delete the page files of keys starting with ``namespace + "."`` below ``tree``'s root.

    ``namespace`` is a checked key prefix; its first dot-separated field names the directory
    walked. Clearing a whole namespace (no dot) also removes the temp files older versions left
    in its shard directories, and the emptied directories. Every directory is opened relative to
    its parent's fd with ``O_NOFOLLOW`` and every file is removed with ``unlinkat`` in it: a
    symlink is never descended into (a symlinked shard is skipped; for a namespace that is not
    a directory the reason comes back as the last item, with nothing removed), so nothing
    outside the root is ever deleted. Returns ``(pages removed, temp files removed, failures,
    first failure)``; files that vanish meanwhile are not failures.
    """
    first, dot, _ = namespace.partition(".")
    prefix = namespace + "."
    whole = not dot
    removed = temps = failed = 0
    first_error = ""
    rfd = tree.refresh(tree.top, False)
    try:
        nsfd = open_dir(first, rfd)
    except FileNotFoundError:
        return 0, 0, 0, ""
    except OSError as err:
        return 0, 0, 0, str(describe(err, f"{tree.root}/{first}", first, rfd))
    try:
        for shard in _listdirs(nsfd):
            try:
                sfd = open_dir(shard, nsfd)
            except OSError:
                continue  # removed meanwhile, or replaced by a symlink: never followed
            try:
                with os.scandir(sfd) as it:
                    names = [e.name for e in it]
                for name in names:
                    temp = name.startswith(fmt.TEMP_PREFIX)
                    if not (temp and whole) and not name.startswith(prefix):
                        continue
                    try:
                        os.unlink(name, dir_fd=sfd)
                    except FileNotFoundError:
                        continue
                    except OSError as err:
                        failed += 1
                        first_error = (
                            first_error or f"{tree.root}/{first}/{shard}/{name}: {err.strerror or err}"
                        )
                        continue
                    if temp:
                        temps += 1
                    else:
                        removed += 1
            except OSError:
                continue  # removed meanwhile
            finally:
                os.close(sfd)
            with contextlib.suppress(OSError):
                os.rmdir(shard, dir_fd=nsfd)  # only if empty: a concurrent writer's files keep it
    finally:
        os.close(nsfd)
    if whole:
        with contextlib.suppress(OSError):
            os.rmdir(first, dir_fd=rfd)
    return removed, temps, failed, first_error


def _listdirs(dfd: int) -> list[str]:
    try:
        with os.scandir(dfd) as it:
            return [e.name for e in it if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
