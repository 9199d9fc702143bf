"""Where kvpack's bytes live: local paths, or any fsspec URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``,
``memory://``, ...).

    with open_read("s3://bucket/packs/doc.kvpack", {"endpoint_url": "http://127.0.0.1:9000"}) as f:
        f.seek(8); f.read(64)                          # one ranged GET per read, not a download of the file
    write_atomic("s3://bucket/packs/doc.kvpack", data) # never a partial object under the final name
    files = walk_files("s3://bucket/docs", (".txt",))  # [(url, ("sub", "a.txt")), ...], sorted

Local paths (and ``file://`` URLs) keep the plain-``os`` behaviour kvpack always had. Every other URL goes
through ``fsspec`` (the backend packages, e.g. ``s3fs`` or ``gcsfs``, are installed separately); the
``storage_options`` dict of each function is passed to the backend's filesystem unchanged, e.g.
``{"endpoint_url": ..., "key": ..., "secret": ...}`` for S3 or ``{"anon": True}`` for public buckets. fsspec also
reads ``FSSPEC_<PROTOCOL>_<KEY>`` environment variables (e.g. ``FSSPEC_S3_ENDPOINT_URL``).

**Atomic writes** (``write_atomic``), per backend:

* local paths: a temporary file ``<name>.tmp.<pid>.<random>`` in the same folder, flushed and fsynced, then
  ``os.replace`` over the final name (and the folder fsynced);
* object stores (``s3``, ``gs``/``gcs``, ``az``/``abfs``/``adl``, ``oss``, ...): one ``put`` of the whole object
  (``fs.pipe_file``). These stores have no cheap rename (a "move" is a copy plus a delete), but an object only
  becomes visible once its upload completes (a single PUT, or a multipart upload's final completion), so a reader
  never sees a partial pack under the final name;
* every other writable backend (``memory``, ``sftp``, ``ftp``, ``smb``, ``hdfs``, ``webdav``, ...): the bytes go to
  a temporary name beside the target, then ``fs.mv`` renames it over the final name (a rename there; for
  ``memory`` one dictionary assignment);
* ``http(s)`` is read-only: writing raises ``InputError``.

**Reads** (``open_read``) are ranged: a remote file is opened without read-ahead caching, so each ``read`` is one
range request of exactly the bytes asked for (a ``.kvpack`` header costs two small requests plus the size
lookup; the data is read in the requests the reader makes, never downloaded to disk first).
"""

from __future__ import annotations

import os
import posixpath
import re
import secrets
from pathlib import Path
from typing import Any, BinaryIO, Iterable

from . import settings as S
from .errors import InputError

__all__ = ["is_url", "as_path", "join", "parent_of", "name_of", "stem_of", "open_read", "read_bytes", "file_size",
           "is_file", "is_dir", "walk_files", "makedirs", "write_atomic", "write_method", "remove_stale_temps",
           "parse_storage_options"]

#: Protocols whose writes are one whole-object put (no cheap rename; objects appear only once complete).
OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2", "tos", "cos",
                           "oci", "boxfs"})
#: Read-only protocols: writing to them is refused.
READ_ONLY = frozenset({"http", "https", "github", "zip", "tar"})
#: Bytes per remote read request when the backend needs a positive block size to allow range requests.
_BLOCK_SIZE = 1 << 20


def is_url(path: Any) -> bool:
    """Whether ``path`` is a URL with a protocol other than ``file`` (``s3://b/k``, ``memory://x``, ...).

    Local paths, ``os.PathLike`` objects and ``file://`` URLs are not URLs here (they take the local code paths).
    """
    if not isinstance(path, str) or "://" not in path:
        return False
    protocol = path.split("://", 1)[0]
    return protocol.replace("+", "").replace("-", "").replace(".", "").isalnum() and protocol.lower() not in (
        "file", "local")


def _local(path: str | os.PathLike) -> str:
    """A local path: ``file://`` and ``local://`` URLs (any case, ``file://localhost/...`` too) without their
    prefix; anything else as given."""
    path = os.fspath(path)
    if not isinstance(path, str) or "://" not in path:
        return path
    protocol, rest = path.split("://", 1)
    if protocol.lower() not in ("file", "local"):
        return path
    return rest[len("localhost"):] if rest.lower().startswith("localhost/") else rest


def as_path(path: str | os.PathLike) -> str | Path:
    """``path`` as kvpack handles it: a URL string unchanged, anything else (``file://`` URLs included) a ``Path``."""
    return path if is_url(path) else Path(_local(path))


def join(base: str | os.PathLike, *parts: str) -> str | Path:
    """``base`` joined with ``parts``: a ``Path`` for a local base, a ``/``-joined URL string otherwise."""
    if is_url(base):
        return posixpath.join(base.rstrip("/"), *parts)
    return Path(_local(base), *parts)


def parent_of(path: str | os.PathLike) -> str | Path:
    """The folder holding ``path``: a URL string for a URL, else a ``Path``."""
    return posixpath.dirname(path.rstrip("/")) if is_url(path) else Path(_local(path)).parent


def name_of(path: str | os.PathLike) -> str:
    """The last component of a path or URL (``s3://b/docs/a.txt`` -> ``a.txt``)."""
    return posixpath.basename(path.rstrip("/")) if is_url(path) else Path(_local(path)).name


def stem_of(path: str | os.PathLike) -> str:
    """``name_of`` without its last suffix (``a.txt`` -> ``a``)."""
    return posixpath.splitext(name_of(path))[0]


def _fs(url: str, storage_options: dict | None):
    """``(filesystem, path inside it)`` for a URL; ``InputError`` for an unknown protocol or missing backend."""
    import fsspec

    protocol = url.split("://", 1)[0]
    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as exc:
        raise InputError(f"{url}: reading {protocol}:// URLs needs an fsspec backend that is not installed "
                         f"({_short(exc)}); install it, e.g. `pip install s3fs` for s3://, `pip install gcsfs` "
                         "for gs://, `pip install adlfs` for az://, `pip install aiohttp` for http(s)://") from None
    except ValueError as exc:
        raise InputError(f"{url}: unknown protocol {protocol!r} ({_short(exc)}); use a local path or an "
                         "fsspec URL such as s3://bucket/key") from None
    except TypeError as exc:
        raise InputError(f"{url}: bad storage options for {protocol}:// ({_short(exc)}); check the "
                         "--storage-option KEY=VALUE pairs") from None


def _backend_error(path: str, doing: str, exc: BaseException) -> InputError:
    """An ``InputError`` for an exception of an fsspec backend that is not an ``OSError`` (botocore's
    ``NoCredentialsError`` and ``EndpointConnectionError``, a ``TypeError`` for an option a lazily built session
    refuses, ...): each backend has its own types, and all of them are a problem of the URL, the credentials or
    the options, never of kvpack's input."""
    return InputError(f"cannot {doing} {path}: {type(exc).__name__}: {_short(exc)}; check the URL, the credentials "
                      "and the --storage-option values")


def _short(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__


def _os_problem(exc: BaseException) -> str:
    if isinstance(exc, FileNotFoundError):
        return "no such file or folder"
    if isinstance(exc, PermissionError):
        return "permission denied"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return _short(exc)


# ---------------------------------------------------------------------------------------------------------------
# reading


def open_read(path: str | os.PathLike, storage_options: dict | None = None) -> BinaryIO:
    """Open a file for binary, seekable, ranged reading; use it as a context manager.

    A local path gives an unbuffered ``open(path, "rb")``. A URL gives the backend's file object opened without
    read-ahead cache (``cache_type="none"``), so ``f.seek(o); f.read(n)`` fetches exactly bytes ``[o, o + n)`` in
    one range request; ``f.readinto(buffer)`` works too. The object has a ``size`` attribute (bytes) for URLs and
    ``name`` set to the URL.

    Raises:
        InputError: the file does not exist, is a folder, cannot be read, or the protocol's backend is missing.
    """
    if not is_url(path):
        local = _local(path)
        try:
            return open(local, "rb", buffering=0)
        except OSError as exc:
            raise InputError(f"cannot read {local}: {_os_problem(exc)}; check the path") from None
    fs, inner = _fs(path, storage_options)
    try:  # no isdir() first: on http(s) that would GET the whole page to look for links
        f = fs.open(inner, "rb", block_size=_BLOCK_SIZE, cache_type="none")
    except IsADirectoryError:
        raise InputError(f"cannot read {path}: it is a folder; give the URL of a file") from None
    except (OSError, ValueError, NotImplementedError) as exc:  # fsspec backends raise OSError subclasses
        raise InputError(f"cannot read {path}: {_os_problem(exc)}; check the URL, the credentials and the "
                         "--storage-option values") from None
    except Exception as exc:  # noqa: BLE001 - the backend's own error types (credentials, connection, options)
        raise _backend_error(path, "read", exc) from None
    try:  # readers name the file in their messages by ``name``; fsspec's objects have none
        f.name = path
    except AttributeError:
        pass
    return f


def read_bytes(path: str | os.PathLike, storage_options: dict | None = None) -> bytes:
    """The whole content of a file (bytes). Raises ``InputError`` as ``open_read``."""
    with open_read(path, storage_options) as f:
        try:
            return f.read()
        except OSError as exc:
            raise InputError(f"cannot read {path}: {_os_problem(exc)}; check the path") from None
        except Exception as exc:  # noqa: BLE001 - a remote backend's own error types
            if not is_url(path):
                raise
            raise _backend_error(path, "read", exc) from None


def file_size(path: str | os.PathLike, storage_options: dict | None = None) -> int:
    """Size in bytes of a file (a ``stat`` or one metadata request, no data read). Raises ``InputError``."""
    if not is_url(path):
        try:
            return os.stat(_local(path)).st_size
        except OSError as exc:
            raise InputError(f"cannot read {_local(path)}: {_os_problem(exc)}; check the path") from None
    fs, inner = _fs(path, storage_options)
    try:
        return int(fs.size(inner))
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {path}: {_os_problem(exc)}; check the URL") from None
    except Exception as exc:  # noqa: BLE001 - the backend's own error types
        raise _backend_error(path, "read", exc) from None


def is_file(path: str | os.PathLike, storage_options: dict | None = None) -> bool:
    """Whether ``path`` is an existing regular file (object). Raises ``InputError`` for a missing backend."""
    if not is_url(path):
        return os.path.isfile(_local(path))
    fs, inner = _fs(path, storage_options)
    try:
        return bool(fs.isfile(inner))
    except (OSError, ValueError):
        return False
    except Exception as exc:  # noqa: BLE001 - credentials, connection, options: not "no such file"
        raise _backend_error(path, "reach", exc) from None


def is_dir(path: str | os.PathLike, storage_options: dict | None = None) -> bool:
    """Whether ``path`` is an existing folder (for object stores: a prefix holding objects)."""
    if not is_url(path):
        return os.path.isdir(_local(path))
    fs, inner = _fs(path, storage_options)
    try:
        return bool(fs.isdir(inner))
    except (OSError, ValueError):
        return False
    except Exception as exc:  # noqa: BLE001 - credentials, connection, options: not "no such folder"
        raise _backend_error(path, "reach", exc) from None


def walk_files(folder: str | os.PathLike, suffixes: Iterable[str], storage_options: dict | None = None
               ) -> list[tuple[str | Path, tuple[str, ...]]]:
    """Files under ``folder`` whose suffix (case-insensitive) is in ``suffixes``, recursively.

    Entries whose name starts with ``.`` (files and folders) are skipped. Sorted by their path relative to
    ``folder`` (compared part by part).

    Returns:
        ``(path, relative parts)`` pairs; ``path`` is a ``Path`` for a local folder, a URL string otherwise.

    Raises:
        InputError: the folder cannot be listed.
    """
    suffixes = tuple(s.lower() for s in suffixes)

    def wanted(parts: tuple[str, ...]) -> bool:
        return not any(p.startswith(".") for p in parts) and posixpath.splitext(parts[-1])[1].lower() in suffixes

    found: list[tuple[str | Path, tuple[str, ...]]] = []
    if not is_url(folder):
        root = Path(_local(folder))
        for here, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for f in files:
                parts = (Path(here) / f).relative_to(root).parts
                if wanted(parts):
                    found.append((Path(here) / f, parts))
    else:
        fs, inner = _fs(folder, storage_options)
        try:
            listed = fs.find(inner, detail=True)
        except (OSError, ValueError) as exc:
            raise InputError(f"cannot list {folder}: {_os_problem(exc)}; check the URL") from None
        except Exception as exc:  # noqa: BLE001 - the backend's own error types
            raise _backend_error(folder, "list", exc) from None
        base = inner.rstrip("/")
        for key, entry in listed.items():
            if entry.get("type", "file") != "file" or not key.startswith(base + "/"):
                continue
            parts = tuple(p for p in key[len(base) + 1:].split("/") if p)
            if parts and wanted(parts):
                found.append((posixpath.join(folder.rstrip("/"), *parts), parts))
    return sorted(found, key=lambda item: item[1])


# ---------------------------------------------------------------------------------------------------------------
# writing


def write_method(path: str | os.PathLike, storage_options: dict | None = None) -> str:
    """How ``write_atomic`` writes to ``path``: ``"replace"`` (local temp file + ``os.replace``), ``"put"`` (one
    whole-object put) or ``"move"`` (temporary name + ``fs.mv``). Raises ``InputError`` for read-only protocols."""
    if not is_url(path):
        return "replace"
    protocol = path.split("://", 1)[0].lower()
    if protocol in READ_ONLY:
        raise InputError(f"cannot write {path}: {protocol}:// is read-only; write to a local folder or to an "
                         "object store (s3://, gs://, az://) instead")
    return "put" if protocol in OBJECT_STORES else "move"


def makedirs(path: str | os.PathLike, storage_options: dict | None = None) -> None:
    """Create the folder ``path`` and its parents if missing (object stores: nothing to create).

    Raises:
        InputError: it cannot be created, or it exists and is not a folder.
    """
    if not is_url(path):
        local = Path(_local(path))
        try:
            local.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InputError(f"cannot create the output folder {local}: {_os_problem(exc)}; pass another --out"
                             ) from None
        if not local.is_dir():
            raise InputError(f"the output path {local} is not a folder; pass another --out")
        return
    method = write_method(path, storage_options)
    if is_file(path, storage_options):
        raise InputError(f"the output path {path} is a file, not a folder; pass another --out")
    fs, inner = _fs(path, storage_options)
    if method == "put":
        return  # object stores have no folders: keys are written under the prefix directly
    try:
        fs.makedirs(inner, exist_ok=True)
    except (OSError, ValueError, NotImplementedError) as exc:
        raise InputError(f"cannot create the output folder {path}: {_os_problem(exc)}; pass another --out"
                         ) from None
    except Exception as exc:  # noqa: BLE001 - the backend's own error types
        raise _backend_error(path, "create the output folder", exc) from None


#: A temporary file of ``write_atomic``: ``<target>.tmp.<pid>.<8 hex digits>``.
_TEMP_NAME = re.compile(r".+" + re.escape(S.TEMP_INFIX) + r"([0-9]{1,10})\.[0-9a-f]{%d}" % (2 * S.TEMP_RANDOM_BYTES))


def _temp_name(target: str) -> str:
    return f"{target}{S.TEMP_INFIX}{os.getpid()}.{secrets.token_hex(S.TEMP_RANDOM_BYTES)}"


def write_atomic(path: str | os.PathLike, data: bytes | memoryview | list[bytes],
                 storage_options: dict | None = None) -> int:
    """Write ``data`` (bytes, or a list of byte chunks written in order) to ``path`` so that ``path`` never holds a
    partial file; return the bytes written.

    The method per backend is in the module docstring (``write_method``): locally a temporary file, fsync and
    ``os.replace`` (``_write_local``; stale temporaries of dead writers removed first), one whole-object put
    on object stores, temporary name + ``fs.mv`` elsewhere. On an error the temporary file is removed (best
    effort) and an existing ``path`` is left untouched.

    Raises:
        InputError: the file cannot be written (missing folder, no permission, disk full, read-only protocol,
            missing backend, bad credentials).
    """
    chunks = data if isinstance(data, list) else [data]
    method = write_method(path, storage_options)
    if method == "replace":
        return _write_local(_local(path), chunks)
    data = b"".join(chunks)
    fs, inner = _fs(path, storage_options)
    tmp = _temp_name(inner)
    try:
        if method == "put":
            fs.pipe_file(inner, bytes(data))
        else:
            fs.pipe_file(tmp, bytes(data))
            fs.mv(tmp, inner)
    except Exception as exc:  # noqa: BLE001 - OSError subclasses, or the backend's own types
        if method == "move":
            try:
                fs.rm_file(tmp)
            except Exception:  # noqa: BLE001 - best effort
                pass
        if not isinstance(exc, (OSError, ValueError, NotImplementedError)):
            raise _backend_error(path, "write", exc) from None
        raise InputError(f"cannot write {path}: {_os_problem(exc)}; check the URL, the permissions and the "
                         "--storage-option values") from None
    return len(data)


def _write_local(path: str | os.PathLike, chunks: list[bytes]) -> int:
    """Write ``chunks`` to the local file ``path`` atomically; return the bytes written.

    First removes the folder's stale temporary files (``remove_stale_temps``). The bytes go to
    ``<path>.tmp.<pid>.<random>`` in the same folder, are flushed and fsynced, and the file is renamed over ``path``
    (``os.replace``); on any error the temporary file is removed and an existing ``path`` is left untouched.

    Raises:
        InputError: not a path, or the file cannot be created or written (missing folder, permission, disk full).
    """
    try:
        target = os.fspath(path)
    except TypeError as exc:
        raise InputError(f"cannot save to {path!r}: expected a file path") from exc
    folder = os.path.dirname(os.path.abspath(target))
    remove_stale_temps(folder)
    tmp = _temp_name(target)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), S.TEMP_FILE_MODE)
    except OSError as exc:
        raise InputError(f"cannot save {target}: {exc.strerror or exc}; check that the folder exists and is "
                         "writable") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        try:
            os.remove(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise InputError(f"cannot save {target}: {exc.strerror or exc}; check the disk space and "
                             "permissions") from exc
        raise
    _fsync_folder(folder)
    return sum(len(c) for c in chunks)


def remove_stale_temps(folder: str | os.PathLike) -> list[str]:
    """Remove the temporary files of interrupted saves in ``folder``: names ``<target>.tmp.<pid>.<8 hex>`` whose
    writer process ``pid`` is gone (``os.kill(pid, 0)`` finds no such process). Files of live processes (this one
    included) are kept, so a concurrent writer never loses its file. Returns the removed paths; never raises."""
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for fname in names:
        m = _TEMP_NAME.fullmatch(fname)
        if m is None or _alive(int(m.group(1))):
            continue
        path = os.path.join(folder, fname)
        try:
            os.remove(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (or cannot be checked: then it is treated as alive)."""
    if pid == os.getpid():
        return True
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError, OverflowError):
        return True  # exists but belongs to someone else, or unknown: keep its file
    return True


def _fsync_folder(folder: str) -> None:
    """Best effort: make the rename durable (POSIX only)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------------------
# options


def parse_storage_options(pairs: Iterable[str]) -> dict[str, Any]:
    """``["KEY=VALUE", ...]`` (the CLI's ``--storage-option``) as a ``storage_options`` dict.

    A value that parses as JSON (``true``, ``3``, ``{"a": 1}``) is taken as that value, anything else as a string;
    a dotted key nests (``client_kwargs.region_name=eu-west-1`` -> ``{"client_kwargs": {"region_name": ...}}``).

    Raises:
        InputError: a pair has no ``=`` or an empty key, or a key is given twice.
    """
    import json

    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key or any(not k for k in key.split(".")):
            raise InputError(f"--storage-option {pair!r}: expected KEY=VALUE, e.g. endpoint_url=http://host:9000")
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: JSON nested too deeply to be an option
            value = raw
        *outer, last = key.split(".")
        node = options
        for k in outer:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise InputError(f"--storage-option {pair!r}: {k!r} was already given a value")
        if last in node:
            raise InputError(f"--storage-option {pair!r}: {key!r} is given twice; give each key once")
        node[last] = value
    return options
