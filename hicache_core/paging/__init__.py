"""Paging: chained page hashes and the storage-key scheme built on them."""

from .hashes import page_hashes
from .keys import KeyScheme, ValidHashes, check_key, check_keys, check_page_hash

__all__ = [
    "KeyScheme",
    "ValidHashes",
    "check_key",
    "check_keys",
    "check_page_hash",
    "page_hashes",
]
