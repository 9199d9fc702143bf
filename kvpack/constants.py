"""Every fixed value of the ``.kvpack`` file format (``format/SPEC.md``). Reader and writer define none of their own.

A ``.kvpack`` file is a safetensors file whose JSON header is serialised canonically, so it always starts with
``MAGIC`` at byte ``MAGIC_OFFSET``. Version 2 adds quantized KV (``QUANT_TYPES``) and zstd-compressed tensors
(``CODEC_ZSTD``); a file declares the lowest version whose features it uses.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    "META_TENSOR_XXH3",
    "CHECKSUM_SHA256",
    "CHECKSUM_XXH3",
    "CHECKSUMS",
    "DEFAULT_CHECKSUM",
    "TENSOR_CHECKSUM_KEY",
    "CHECKSUM_HEX_LENGTH",
    "CHECKSUM_NAMES",
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
    "FORMAT_VERSION_PLAIN",
    "FORMAT_VERSION_V2",
    "FORMAT_VERSION_V3",
    "META_QUANT",
    "META_TENSOR_CODECS",
    "METADATA_KEYS_V2",
    "QuantType",
    "QUANT_NONE",
    "QUANT_TYPES",
    "QUANT_CHOICES",
    "GROUP_SIZES",
    "DEFAULT_GROUP_SIZE",
    "MAX_GROUP_SIZE",
    "QUANT_INFO_KEYS",
    "KEY_CODES",
    "KEY_SCALES",
    "KEY_MINS",
    "VALUE_CODES",
    "VALUE_SCALES",
    "VALUE_MINS",
    "QUANT_PARTS",
    "QUANT_INFO_KEYS_V4",
    "QUANT_LAYOUT_KIVI",
    "QUANT_LAYOUT_COMPACT",
    "QUANT_LAYOUTS",
    "DEFAULT_QUANT_LAYOUT",
    "KEY_BITS",
    "KEY_PARAMS",
    "VALUE_PARAMS",
    "QUANT_GRID",
    "COMPACT_PARTS",
    "MIN_KEY_BITS",
    "MAX_KEY_BITS",
    "ALLOCATED_KEY_BITS",
    "FORMAT_VERSION_V4",
    "FORMAT_VERSION_V5",
    "STACKED_PARTS",
    "QUANT_CODE_CODE",
    "QUANT_PARAM_CODE",
    "QUANT_PARAM_MAX",
    "CODEC_ZSTD",
    "FILTER_NONE",
    "FILTER_SHUFFLE",
    "FILTER_DELTA_SHUFFLE",
    "FILTERS",
    "CODEC_KEYS",
    "STORED_CODE",
    "ZSTD_MIN_LEVEL",
    "ZSTD_MAX_LEVEL",
    "DEFAULT_ZSTD_LEVEL",
    "SAVE_DEFAULT_ZSTD_LEVEL",
    "ZSTD_FRAME_MAGIC",
    "MAX_EXPANSION",
    "EXPANSION_FLOOR_BYTES",
]

# --- identity and versions -------------------------------------------------------------------------------------
#: Value of ``__metadata__["format"]``.
FORMAT_NAME = "kvpack"
#: The newest version this code writes (``__metadata__["format_version"]`` is its decimal string). A file
#: declares the *lowest* version whose features it uses: ``FORMAT_VERSION_PLAIN`` without quantization, zstd
#: and XXH3 checksums.
FORMAT_VERSION = 5
#: The newest version this code reads; newer files raise ``UnsupportedVersionError``.
MAX_READABLE_VERSION = 5
#: Version of a file with neither quantized layers nor encoded tensors (byte-identical to kvpack 0.1's files).
FORMAT_VERSION_PLAIN = 1
#: Version of a file that uses quantization (``META_QUANT``) or encoded tensors (``META_TENSOR_CODECS``).
FORMAT_VERSION_V2 = 2
#: Version of a file whose tensor checksums are XXH3-128 (``META_TENSOR_XXH3``) instead of SHA-256; it may also
#: use the version-2 features.
FORMAT_VERSION_V3 = 3
#: Version of a file whose quantized layers use the compact layout (``QUANT_LAYOUT_COMPACT``); it has XXH3-128
#: tensor checksums like version 3 and may use the version-2 features.
FORMAT_VERSION_V4 = 4
#: Version of a compact-layout file whose per-layer tensors are stacked over the layers: one tensor per part
#: (``STACKED_PARTS``, unprefixed names), each layer's rows following the previous layer's. Otherwise as version 4;
#: the compact layout is written as version 5 (version 4 files are still read).
FORMAT_VERSION_V5 = 5
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
#: v3: canonical JSON string mapping every tensor name to the XXH3-128 (32 hex digits) of its bytes; a version-3
#: file has this key instead of ``META_TENSOR_SHA256``.
META_TENSOR_XXH3 = "tensor_xxh3"
#: The ``__metadata__`` keys every file has, in serialised order (plus its tensor checksum key:
#: ``TENSOR_CHECKSUM_KEY``).
METADATA_KEYS = (META_FORMAT, META_FORMAT_VERSION, META_HEADER_SHA256, META_KVPACK)
#: v2, optional: canonical JSON ``{"group_size": G, "type": "int8"|"int4"}``; present iff the layers are quantized.
META_QUANT = "quant"
#: v2, optional: canonical JSON mapping each encoded tensor's name to its ``CODEC_KEYS`` object; present iff at
#: least one tensor is stored encoded (zstd).
META_TENSOR_CODECS = "tensor_codecs"
#: The optional ``__metadata__`` keys a v2 file may have (both sort after ``format``, so the magic is kept).
METADATA_KEYS_V2 = (META_QUANT, META_TENSOR_CODECS)
#: Key of the kvpack metadata that holds ``Pack.sink_tokens``.
SINK_TOKENS_KEY = "sink_tokens"
#: Keys of one tensor index entry (safetensors).
INDEX_DTYPE = "dtype"
INDEX_SHAPE = "shape"
INDEX_OFFSETS = "data_offsets"
INDEX_KEYS = (INDEX_OFFSETS, INDEX_DTYPE, INDEX_SHAPE)
SHA256_HEX_LENGTH = 64

# --- tensor checksums ------------------------------------------------------------------------------------------
#: Tensor checksum algorithms: SHA-256 (versions 1 and 2; cryptographic, ~2 GB/s) and XXH3-128 (version 3;
#: detects damage, not deliberate tampering, ~50 GB/s). The header checksum is always SHA-256.
CHECKSUM_SHA256 = "sha256"
CHECKSUM_XXH3 = "xxh3"
CHECKSUMS = (CHECKSUM_XXH3, CHECKSUM_SHA256)
#: What ``kvpack build`` and ``kvpack.save`` write unless told otherwise.
DEFAULT_CHECKSUM = CHECKSUM_XXH3
#: The ``__metadata__`` key holding the tensor checksums of each algorithm.
TENSOR_CHECKSUM_KEY = {CHECKSUM_SHA256: META_TENSOR_SHA256, CHECKSUM_XXH3: META_TENSOR_XXH3}
#: Lowercase hex digits of one tensor checksum of each algorithm.
CHECKSUM_HEX_LENGTH = {CHECKSUM_SHA256: SHA256_HEX_LENGTH, CHECKSUM_XXH3: 32}
#: Each algorithm's name in messages and ``kvpack info``.
CHECKSUM_NAMES = {CHECKSUM_SHA256: "SHA-256", CHECKSUM_XXH3: "XXH3-128"}

# --- tensors ---------------------------------------------------------------------------------------------------
TOKEN_IDS = "token_ids"
HEAD_LENGTHS = "head_lengths"
LAYER_PREFIX = "layers"
KEYS = "keys"
VALUES = "values"
POSITIONS = "positions"
LAYER_PARTS = (KEYS, VALUES, POSITIONS)
#: Temporary (until format 1.0): optional ``F32`` ``[entries of all layers]`` per-entry attention-logit biases,
#: layer 0's rows first, each layer in the row order of its positions; absent means all zero.
BIASES = "biases"


def layer_tensor_name(layer: int, part: str) -> str:
    """Name of tensor ``part`` (``keys``, ``values`` or ``positions``) of layer ``layer``, e.g. ``layers.3.keys``."""
    return f"{LAYER_PREFIX}.{layer}.{part}"


#: Sections reported by ``PackHeader.bytes_by_section`` (a layer tensor belongs to the section named by its part).
SECTION_HEADER = "header"
SECTIONS = (SECTION_HEADER, TOKEN_IDS, HEAD_LENGTHS, KEYS, VALUES, POSITIONS)

# --- dtypes ----------------------------------------------------------------------------------------------------
#: safetensors dtype code -> torch dtype, for every code an index may name.
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

# --- quantization (v2; KIVI, arXiv 2402.02750) -----------------------------------------------------------------


@dataclass(frozen=True)
class QuantType:
    """A quantization type: ``name``, ``bits`` per code and ``codes_per_byte`` (codes packed in one uint8)."""

    name: str
    bits: int
    codes_per_byte: int

    @property
    def levels(self) -> int:
        """Largest code, ``2**bits - 1`` (codes run over ``0 .. levels``)."""
        return (1 << self.bits) - 1


#: No quantization: keys and values are stored in the pack's float dtype (a v1 layout).
QUANT_NONE = "none"
#: Quantized types. int4: two codes per byte, the even channel in the low nibble, the odd one in the high nibble.
QUANT_TYPES = {
    "int8": QuantType("int8", 8, 1),
    "int4": QuantType("int4", 4, 2),
}
#: What ``--quant`` accepts.
QUANT_CHOICES = (QUANT_NONE, "int8", "int4")
#: Group sizes ``kvpack.compress`` and ``kvpack build --group-size`` accept; 32 is KIVI's default.
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 32
#: Largest group size a reader accepts (any integer in ``[1, MAX_GROUP_SIZE]`` is a valid file).
MAX_GROUP_SIZE = 65536
#: Keys of the ``META_QUANT`` object (versions 2 and 3: the KIVI layout).
QUANT_INFO_KEYS = ("group_size", "type")
#: Keys of the ``META_QUANT`` object of a version-4 file (``layout`` is ``QUANT_LAYOUT_COMPACT``).
QUANT_INFO_KEYS_V4 = ("group_size", "layout", "type")
#: Quantized layouts (``format/SPEC.md`` §5.4 and §5.6). KIVI: float16 group parameters, one code width, each head's
#: last partial key group in full precision (versions 2 and 3). Compact: per-channel key code widths, 8-bit group
#: parameters on per-layer grids, every non-sink row of a head with at least one group quantized (versions 4, 5).
QUANT_LAYOUT_KIVI = "kivi"
QUANT_LAYOUT_COMPACT = "compact"
QUANT_LAYOUTS = (QUANT_LAYOUT_COMPACT, QUANT_LAYOUT_KIVI)
#: What ``kvpack.compress`` and ``quantize_pack`` use unless told otherwise.
DEFAULT_QUANT_LAYOUT = QUANT_LAYOUT_COMPACT
#: Per-layer tensors of a quantized file (besides ``LAYER_PARTS``): codes are ``U8``, scales and mins ``F16``.
KEY_CODES = "key_codes"
KEY_SCALES = "key_scales"
KEY_MINS = "key_mins"
VALUE_CODES = "value_codes"
VALUE_SCALES = "value_scales"
VALUE_MINS = "value_mins"
QUANT_PARTS = (KEY_CODES, KEY_SCALES, KEY_MINS, VALUE_CODES, VALUE_SCALES, VALUE_MINS)
#: Per-layer tensors of a compact-layout file (besides ``LAYER_PARTS``), all ``U8`` but the grid (``F32``):
#: ``key_bits`` ``[kv_heads, head_dim]`` code widths; ``key_params`` ``[2, key groups, head_dim]`` and
#: ``value_params`` ``[2, rows, head_dim_v / Gv]`` min and scale codes; ``quant_grid`` ``[3, head_dim + head_dim_v
#: / Gv]`` each parameter column's min base, min step and scale base.
KEY_BITS = "key_bits"
KEY_PARAMS = "key_params"
VALUE_PARAMS = "value_params"
QUANT_GRID = "quant_grid"
COMPACT_PARTS = (KEY_CODES, KEY_BITS, KEY_PARAMS, VALUE_CODES, VALUE_PARAMS, QUANT_GRID)
#: The tensors of a version-5 file besides ``TOKEN_IDS`` and ``HEAD_LENGTHS``, each stacked over the layers:
#: rows (``positions``, ``keys``, ``values``, ``key_codes``, ``value_codes``), the group axis (``key_params``) or
#: the row axis (``value_params``) run layer after layer; ``key_bits`` and ``quant_grid`` gain a leading layer axis.
STACKED_PARTS = LAYER_PARTS + COMPACT_PARTS
#: Widths a compact key channel may have, in bits.
MIN_KEY_BITS, MAX_KEY_BITS = 1, 8
#: Widths the compact writer allocates from (``kvpack.compact.allocate_widths``).
ALLOCATED_KEY_BITS = (2, 8)
#: dtype code of the codes, and of the scales and mins.
QUANT_CODE_CODE = "U8"
QUANT_PARAM_CODE = "F16"
#: Scales and mins are clamped to the finite float16 range ``[-QUANT_PARAM_MAX, QUANT_PARAM_MAX]``.
QUANT_PARAM_MAX = 65504.0

# --- tensor codecs (v2) ----------------------------------------------------------------------------------------
#: The one codec: a single zstd frame (RFC 8878) with its content size in the frame header.
CODEC_ZSTD = "zstd"
#: Filters applied to the raw little-endian bytes before zstd (and undone after decompressing).
FILTER_NONE = "none"
#: Element size k > 1: byte j of every element first, for j = 0 .. k-1 (the HDF5/Blosc byte shuffle).
FILTER_SHUFFLE = "shuffle"
#: I32 only: element 0 kept, element i replaced by ``x[i] - x[i-1]`` (two's complement, wrapping), then shuffled.
FILTER_DELTA_SHUFFLE = "delta_shuffle"
FILTERS = (FILTER_NONE, FILTER_SHUFFLE, FILTER_DELTA_SHUFFLE)
#: Keys of one ``META_TENSOR_CODECS`` entry.
CODEC_KEYS = ("codec", "dtype", "filter", "level", "raw_bytes", "shape")
#: Index dtype code of an encoded tensor (its index shape is ``[stored bytes]``).
STORED_CODE = "U8"
#: zstd levels ``kvpack.save`` accepts; 0 means no compression.
ZSTD_MIN_LEVEL = 1
ZSTD_MAX_LEVEL = 22
#: ``kvpack build --zstd-level`` default.
DEFAULT_ZSTD_LEVEL = 3
#: ``kvpack.save`` / ``pack_to_bytes`` default: plain (v1 when unquantized) files, readable by every kvpack.
SAVE_DEFAULT_ZSTD_LEVEL = 0
#: The first 4 bytes of a zstd frame (0xFD2FB528 little-endian).
ZSTD_FRAME_MAGIC = b"\x28\xb5\x2f\xfd"
#: A reader refuses a file whose tensors decompress to more than
#: ``max(EXPANSION_FLOOR_BYTES, MAX_EXPANSION x file size)`` bytes in all (decompression-bomb guard).
MAX_EXPANSION = 1024
EXPANSION_FLOOR_BYTES = 1 << 26

# --- saving ----------------------------------------------------------------------------------------------------
#: ``save`` writes ``<target name>.tmp.<pid>.<random>`` first (matched by ``*.kvpack.tmp*`` in .gitignore).
TEMP_INFIX = ".tmp."
#: Random bytes (hex-encoded) in the temporary name, so concurrent writers never collide.
TEMP_RANDOM_BYTES = 4
#: Mode the temporary file is created with (before the umask), as for ``open(path, "wb")``.
TEMP_FILE_MODE = 0o666
