"""Every fixed value of the ``.kvpack`` file format (``format/SPEC.md``). Reader and writer define none of their own.

A ``.kvpack`` v1 file is a safetensors file whose JSON header is serialised canonically, so it always starts with
``MAGIC`` at byte ``MAGIC_OFFSET``.
"""

from __future__ import annotations

import torch

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_READABLE_VERSION",
    "FILE_SUFFIX",
    "LENGTH_PREFIX_BYTES",
    "MAGIC_OFFSET",
    "MAGIC",
    "HEADER_ALIGNMENT",
    "HEADER_PAD_BYTE",
    "MAX_HEADER_BYTES",
    "JSON_DUMPS_KWARGS",
    "METADATA_KEY",
    "META_FORMAT",
    "META_FORMAT_VERSION",
    "META_HEADER_SHA256",
    "META_KVPACK",
    "META_TENSOR_SHA256",
    "METADATA_KEYS",
    "SINK_TOKENS_KEY",
    "INDEX_DTYPE",
    "INDEX_SHAPE",
    "INDEX_OFFSETS",
    "INDEX_KEYS",
    "SHA256_HEX_LENGTH",
    "TOKEN_IDS",
    "HEAD_LENGTHS",
    "LAYER_PREFIX",
    "KEYS",
    "VALUES",
    "POSITIONS",
    "LAYER_PARTS",
    "layer_tensor_name",
    "SECTION_HEADER",
    "SECTIONS",
    "DTYPE_BY_CODE",
    "CODE_BY_DTYPE",
    "FLOAT_CODES",
    "INDEX_INT_CODE",
    "INT32_MAX",
    "TEMP_INFIX",
    "TEMP_RANDOM_BYTES",
    "TEMP_FILE_MODE",
]

# --- identity and versions -------------------------------------------------------------------------------------
#: Value of ``__metadata__["format"]``.
FORMAT_NAME = "kvpack"
#: The version this code writes (``__metadata__["format_version"]`` is its decimal string).
FORMAT_VERSION = 1
#: The newest version this code reads; newer files raise ``UnsupportedVersionError``.
MAX_READABLE_VERSION = 1
#: Conventional file name suffix.
FILE_SUFFIX = ".kvpack"

# --- byte layout -----------------------------------------------------------------------------------------------
#: Bytes 0..7 hold N, the header length, as a little-endian unsigned 64-bit integer.
LENGTH_PREFIX_BYTES = 8
#: The magic starts right after the length prefix.
MAGIC_OFFSET = LENGTH_PREFIX_BYTES
#: The first bytes of every canonical kvpack header: ``__metadata__`` sorts before every tensor name and
#: ``format`` sorts before every other ``__metadata__`` key.
MAGIC = b'{"__metadata__":{"format":"kvpack",'
#: N is a multiple of this, so the data buffer starts 8-byte aligned.
HEADER_ALIGNMENT = 8
#: The header JSON is right-padded with this byte up to a multiple of ``HEADER_ALIGNMENT``.
HEADER_PAD_BYTE = b" "
#: Largest N a reader accepts (the same cap as safetensors, so safetensors can open every valid file).
MAX_HEADER_BYTES = 100_000_000
#: Canonical JSON serialisation, used for the header and for the kvpack metadata string.
JSON_DUMPS_KWARGS = {"sort_keys": True, "separators": (",", ":"), "ensure_ascii": True, "allow_nan": False}

# --- header keys -----------------------------------------------------------------------------------------------
#: The safetensors string->string metadata map.
METADATA_KEY = "__metadata__"
META_FORMAT = "format"
META_FORMAT_VERSION = "format_version"
#: SHA-256 (hex) of the canonical header with this one key removed.
META_HEADER_SHA256 = "header_sha256"
#: The kvpack metadata (``Pack.metadata`` plus ``sink_tokens``) as one canonical JSON string.
META_KVPACK = "kvpack"
#: Canonical JSON string mapping every tensor name to the SHA-256 (hex) of its bytes.
META_TENSOR_SHA256 = "tensor_sha256"
#: The ``__metadata__`` keys of a v1 file, in serialised order.
METADATA_KEYS = (META_FORMAT, META_FORMAT_VERSION, META_HEADER_SHA256, META_KVPACK, META_TENSOR_SHA256)
#: Key of the kvpack metadata that holds ``Pack.sink_tokens``.
SINK_TOKENS_KEY = "sink_tokens"
#: Keys of one tensor index entry (safetensors).
INDEX_DTYPE = "dtype"
INDEX_SHAPE = "shape"
INDEX_OFFSETS = "data_offsets"
INDEX_KEYS = (INDEX_OFFSETS, INDEX_DTYPE, INDEX_SHAPE)
SHA256_HEX_LENGTH = 64

# --- tensors ---------------------------------------------------------------------------------------------------
TOKEN_IDS = "token_ids"
HEAD_LENGTHS = "head_lengths"
LAYER_PREFIX = "layers"
KEYS = "keys"
VALUES = "values"
POSITIONS = "positions"
LAYER_PARTS = (KEYS, VALUES, POSITIONS)


def layer_tensor_name(layer: int, part: str) -> str:
    """Name of tensor ``part`` (``keys``, ``values`` or ``positions``) of layer ``layer``, e.g. ``layers.3.keys``."""
    return f"{LAYER_PREFIX}.{layer}.{part}"


#: Sections reported by ``PackHeader.bytes_by_section`` (a layer tensor belongs to the section named by its part).
SECTION_HEADER = "header"
SECTIONS = (SECTION_HEADER, TOKEN_IDS, HEAD_LENGTHS, KEYS, VALUES, POSITIONS)

# --- dtypes ----------------------------------------------------------------------------------------------------
#: safetensors dtype code -> torch dtype, for every code a v1 index may name.
DTYPE_BY_CODE = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "I64": torch.int64,
    "U8": torch.uint8,
}
CODE_BY_DTYPE = {dtype: code for code, dtype in DTYPE_BY_CODE.items()}
#: Codes allowed for keys and values.
FLOAT_CODES = ("F32", "F16", "BF16")
#: Code of token_ids, head_lengths and positions.
INDEX_INT_CODE = "I32"
INT32_MAX = 2**31 - 1

# --- saving ----------------------------------------------------------------------------------------------------
#: ``save`` writes ``<target name>.tmp.<pid>.<random>`` first (matched by ``*.kvpack.tmp*`` in .gitignore).
TEMP_INFIX = ".tmp."
#: Random bytes (hex-encoded) in the temporary name, so concurrent writers never collide.
TEMP_RANDOM_BYTES = 4
#: Mode the temporary file is created with (before the umask), as for ``open(path, "wb")``.
TEMP_FILE_MODE = 0o666
