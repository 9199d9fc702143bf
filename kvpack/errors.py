"""The one error family of kvpack. Every message names the problem and, where there is one, the fix.

The CLI prints ``KvpackError`` messages without a traceback and exits with status 1.
"""

from __future__ import annotations

__all__ = [
    "KvpackError",
    "InputError",
    "MemoryBudgetError",
    "ModelLoadError",
    "UnsupportedModelError",
    "ModelMismatchError",
    "PackFormatError",
    "NotAKvpackFileError",
    "TruncatedFileError",
    "CorruptFileError",
    "ChecksumMismatchError",
    "UnsupportedVersionError",
]


class KvpackError(Exception):
    """Base class of every error kvpack raises on purpose."""


class InputError(KvpackError, ValueError):
    """A bad argument or input document (unknown method, ratio outside (0, 1], unreadable file, empty text)."""


class MemoryBudgetError(InputError):
    """Loading a pack would take more memory than allowed (``kvpack.load(max_bytes=)``, ``kvpack ask
    --max-memory``; by default the memory available): checked from the header's declared sizes, before decoding."""


class ModelLoadError(KvpackError):
    """The model or tokenizer could not be loaded (missing folder, no network for a hub id, bad config)."""


class UnsupportedModelError(KvpackError):
    """The model's architecture or attention variant is not supported by kvpack."""


class ModelMismatchError(KvpackError):
    """A pack was built for another model than the one it is being loaded into."""


class PackFormatError(KvpackError):
    """Base class of the errors about a ``.kvpack`` file's bytes."""


class NotAKvpackFileError(PackFormatError):
    """The file does not start with a kvpack header (wrong magic): it is some other file."""


class TruncatedFileError(PackFormatError):
    """The file is shorter than its header says: an interrupted copy or download."""


class CorruptFileError(PackFormatError):
    """The header or the tensor index is malformed or inconsistent (offsets, shapes, dtypes, lengths)."""


class ChecksumMismatchError(PackFormatError):
    """A section's bytes do not match their recorded checksum (SHA-256 or XXH3-128): the file was altered or damaged."""


class UnsupportedVersionError(PackFormatError):
    """The file uses another major format version than this kvpack reads (or a pre-1.0 draft)."""
