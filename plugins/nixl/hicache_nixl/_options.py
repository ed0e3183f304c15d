"""``NixlOptions``: the validated options of the ``nixl`` backend."""

from __future__ import annotations

import os
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hicache_core.config import expand_path

__all__ = ["CREDENTIAL_ENV", "NixlOptions", "default_root"]

# Credentials of the OBJ plugin: read from these environment variables when a store opens, passed
# to NIXL and to nothing else; never an option (options are logged, shown and written to files).
CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")

# S3 bucket names (the DNS-compatible rules): 3-63 of [a-z0-9.-], starting and ending alphanumeric.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_PREFIX = re.compile(r"[A-Za-z0-9._/-]{0,200}")
_REGION = re.compile(r"[a-z0-9-]{1,40}")


def default_root() -> str:
    """``<user cache dir>/hicache/nixl`` (for example ``~/.cache/hicache/nixl`` on Linux)."""
    import platformdirs

    return os.path.join(platformdirs.user_cache_dir("hicache", appauthor=False), "nixl")


class NixlOptions(BaseModel):
    """Options of the ``nixl`` backend (every field has a default).

    ``plugin``: the NIXL plugin pages move through: ``"posix"`` (files under ``root``) or
    ``"obj"`` (objects in an S3-compatible store).

    posix: ``root`` is the directory holding the index log and the segments (created if
    missing; resolved once at open, nothing below it is reached through a symlink); ``o_direct``
    opens a segment with ``O_DIRECT`` when every address and length of the components it holds
    is 4 KiB-aligned (others use the page cache); ``engine`` is NIXL's POSIX queue: ``"aio"`` (Linux AIO) or
    ``"uring"`` (io_uring, with a logged fallback to ``aio`` when the kernel refuses it);
    ``fsync``: fsync the segment, its directory and the index log before a page is reported
    stored.

    obj: ``endpoint`` is the store's URL (``http://127.0.0.1:9000``; ``None``: AWS S3 of
    ``region``); ``bucket`` must exist; ``prefix`` is prepended to every object name; the
    credentials come from ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (and
    ``AWS_SESSION_TOKEN``) in the environment only.

    ``timeout_s`` bounds one obj transfer and each existence request; such a transfer that has
    not finished by then is abandoned and its pages are reported failed. A posix transfer moves
    host pool memory directly and is waited for past it (logged), never abandoned.
    """

    model_config = ConfigDict(extra="forbid", defer_build=True)

    plugin: Literal["posix", "obj"] = Field("posix", description="NIXL plugin: posix (files) or obj (S3)")
    root: str | None = Field(None, description="posix: directory holding the index log and segments")
    o_direct: bool = Field(False, description="posix: O_DIRECT for 4 KiB-aligned pages")
    engine: Literal["aio", "uring"] = Field("aio", description="posix: NIXL POSIX queue (aio or io_uring)")
    fsync: bool = Field(False, description="posix: fsync files and directories before reporting success")
    endpoint: str | None = Field(None, description="obj: S3 endpoint URL (http[s]://host:port)")
    bucket: str | None = Field(None, description="obj: bucket (must exist)")
    region: str = Field("us-east-1", description="obj: region")
    prefix: str = Field("hicache/", description="obj: prefix of every object name")
    timeout_s: float = Field(60.0, gt=0, le=3600, description="bound of one NIXL transfer")

    @field_validator("root")
    @classmethod
    def _expand_root(cls, value: str | None) -> str | None:
        return None if value is None else expand_path(value, "root")

    @field_validator("endpoint")
    @classmethod
    def _check_endpoint(cls, value: str | None) -> str | None:
        if value is None:
            return None
        from urllib.parse import urlsplit

        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018 - raises ValueError for a bad port
        except ValueError as err:
            raise ValueError(f"endpoint is not a URL ({err}); write e.g. 'http://127.0.0.1:9000'") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                "endpoint must be an http:// or https:// URL with a host, e.g. 'http://127.0.0.1:9000'"
            )
        if parts.username or parts.password:
            raise ValueError(
                "endpoint must not carry credentials; set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY instead"
            )
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError("endpoint must be scheme://host[:port] only (the bucket is its own option)")
        return value.rstrip("/")

    @field_validator("bucket")
    @classmethod
    def _check_bucket(cls, value: str | None) -> str | None:
        if value is not None and (not _BUCKET.fullmatch(value) or ".." in value):
            raise ValueError(
                "bucket must be 3-63 characters of a-z, 0-9, '.' and '-', starting and ending alphanumeric"
            )
        return value

    @field_validator("prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        if not _PREFIX.fullmatch(value) or value.startswith("/") or "//" in value or ".." in value:
            raise ValueError(
                "prefix must be up to 200 characters of A-Z a-z 0-9 . _ - /, without '..', '//' or a leading '/'"
            )
        return value

    @field_validator("region")
    @classmethod
    def _check_region(cls, value: str) -> str:
        if not _REGION.fullmatch(value):
            raise ValueError("region must be an AWS-style region name such as 'us-east-1'")
        return value

    @model_validator(mode="after")
    def _obj_needs_bucket(self) -> NixlOptions:
        if self.plugin == "obj" and self.bucket is None:
            raise ValueError(
                "bucket: plugin 'obj' needs a bucket (create it first; hicache never creates buckets)"
            )
        return self

    def resolved_root(self) -> str:
        """``root`` or the default, as an absolute path."""
        return self.root if self.root is not None else default_root()
