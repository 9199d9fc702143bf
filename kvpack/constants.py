"""Every fixed value of the ``.kvpack`` file format 1.0 (``format/SPEC.md``). Reader and writer define none of their own.

A ``.kvpack`` file is a safetensors file whose JSON header is serialised canonically, so it always starts with
``MAGIC`` at byte ``MAGIC_OFFSET``. Format 1.0 is the only version: plain or compact-quantized KV, optionally
zstd-compressed tensors and per-entry attention biases.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "FORMAT_MAJOR",
    "FILE_SUFFIX",
    "LENGTH_PREFIX_BYTES",
    "MAGIC_OFFSET",
    "MAGIC",
    "HEADER_ALIGNMENT",
    "HEADER_PAD_BYTE",
    "MAX_HEADER_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_RANK",
    "MAX_TENSORS",
    "MAX_METADATA_KEYS",
    "MAX_LAYERS",
    "MAX_KV_HEADS",
    "MAX_TOTAL_HEADS",
    "MAX_HEAD_DIM",
    "MAX_LAYOUT_CHARS",
    "JSON_DUMPS_KWARGS",
    "METADATA_KEY",
    "META_FORMAT",
    "META_FORMAT_VERSION",
    "META_HEADER_SHA256",
    "META_KVPACK",
    "META_TENSOR_SHA256",
    "META_TENSOR_XXH3",
    "METADATA_KEYS",
    "META_QUANT",
    "META_TENSOR_CODECS",
    "SINK_TOKENS_KEY",
    "INDEX_DTYPE",
    "INDEX_SHAPE",
    "INDEX_OFFSETS",
    "INDEX_KEYS",
    "SHA256_HEX_LENGTH",
    "CHECKSUM_SHA256",
    "CHECKSUM_XXH3",
    "CHECKSUMS",
    "TENSOR_CHECKSUM_KEY",
    "CHECKSUM_HEX_LENGTH",
    "CHECKSUM_NAMES",
    "TOKEN_IDS",
    "HEAD_LENGTHS",
    "KEYS",
    "VALUES",
    "POSITIONS",
    "ATTN_BIAS",
    "MAX_ATTN_BIAS",
    "LAYER_PARTS",
    "SECTION_HEADER",
    "SECTIONS",
    "ITEMSIZE_BY_CODE",
    "FLOAT_CODES",
    "KV_DTYPE_NAMES",
    "INDEX_INT_CODE",
    "F32_CODE",
    "INT32_MAX",
    "QuantType",
    "QUANT_NONE",
    "QUANT_TYPES",
    "MAX_GROUP_SIZE",
    "QUANT_INFO_KEYS",
    "QUANT_LAYOUT_COMPACT",
    "KEY_CODES",
    "KEY_BITS",
    "KEY_PARAMS",
    "VALUE_CODES",
    "VALUE_PARAMS",
    "QUANT_GRID",
    "COMPACT_PARTS",
    "MIN_KEY_BITS",
    "MAX_KEY_BITS",
    "QUANT_CODE_CODE",
    "CODEC_ZSTD",
    "FILTER_NONE",
    "FILTER_SHUFFLE",
    "FILTER_DELTA_SHUFFLE",
    "FILTERS",
    "CODEC_KEYS",
    "STORED_CODE",
    "ZSTD_MIN_LEVEL",
    "ZSTD_MAX_LEVEL",
    "ZSTD_FRAME_MAGIC",
    "MAX_EXPANSION",
    "EXPANSION_FLOOR_BYTES",
    "ENTRY_TENSORS",
    "READ_CHUNK_BYTES",
]

# --- identity and version --------------------------------------------------------------------------------------
#: Value of ``__metadata__["format"]``.
FORMAT_NAME = "kvpack"
#: ``__metadata__["format_version"]``: ``"<major>.<minor>"``. This code writes and reads major 1; a reader refuses
#: another major (``UnsupportedVersionError``) and reads any minor of its major (a minor only adds ``__metadata__``
#: keys that older readers ignore; ``format/SPEC.md`` §9).
FORMAT_VERSION = "1.0"
FORMAT_MAJOR = 1
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
#: Largest N a reader accepts: 1 MiB. A real header is a few KB to a few tens of KB (12 tensors at most, the
#: metadata with per-layer statistics); the cap bounds what parsing a hostile header costs (a JSON text parses to at
#: most ~25x its size in Python objects, and every check is linear in it).
MAX_HEADER_BYTES = 1 << 20
#: Deepest nesting of ``[`` / ``{`` a reader accepts in the header and in each JSON text inside it, checked by a
#: byte scan before any parsing (so the verdict never depends on the parser's stack).
MAX_JSON_DEPTH = 32
#: Largest rank of a tensor in the index.
MAX_RANK = 4
#: Most tensors an index may name (format 1.0 defines 12), and most ``__metadata__`` keys (it defines 7).
MAX_TENSORS = 64
MAX_METADATA_KEYS = 64
#: Most layers and KV heads per layer a file may declare, and the largest key/value head size.
MAX_LAYERS = 4096
MAX_KV_HEADS = 4096
#: Most (layer, KV head) pairs a file may declare: ``layers x kv_heads`` (a 128-layer, 128-head model has 16384).
MAX_TOTAL_HEADS = 1 << 20
MAX_HEAD_DIM = 65536
#: Longest string in the ``layout`` metadata (a chat-template piece), in characters.
MAX_LAYOUT_CHARS = 65536
#: Canonical JSON serialisation, used for the header and for the JSON texts inside it.
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
#: Canonical JSON string mapping every tensor name to the SHA-256 (hex) of its stored bytes.
META_TENSOR_SHA256 = "tensor_sha256"
#: Canonical JSON string mapping every tensor name to the XXH3-128 (32 hex digits) of its stored bytes. A file has
#: exactly one of ``META_TENSOR_SHA256`` and this key.
META_TENSOR_XXH3 = "tensor_xxh3"
#: The ``__metadata__`` keys every file has, in serialised order (plus its tensor checksum key).
METADATA_KEYS = (META_FORMAT, META_FORMAT_VERSION, META_HEADER_SHA256, META_KVPACK)
#: Optional: canonical JSON ``{"group_size": G, "type": "int8"|"int4"}``; present iff the KV is quantized.
META_QUANT = "quant"
#: Optional: canonical JSON mapping each encoded tensor's name to its ``CODEC_KEYS`` object; present iff at
#: least one tensor is stored encoded (zstd).
META_TENSOR_CODECS = "tensor_codecs"
#: Key of the kvpack metadata that holds ``Pack.sink_tokens``.
SINK_TOKENS_KEY = "sink_tokens"
#: Keys of one tensor index entry (safetensors).
INDEX_DTYPE = "dtype"
INDEX_SHAPE = "shape"
INDEX_OFFSETS = "data_offsets"
INDEX_KEYS = (INDEX_OFFSETS, INDEX_DTYPE, INDEX_SHAPE)
SHA256_HEX_LENGTH = 64

# --- tensor checksums ------------------------------------------------------------------------------------------
#: Tensor checksum algorithms: XXH3-128 (default; detects damage, not deliberate tampering, ~50 GB/s) and SHA-256
#: (cryptographic, ~2 GB/s). The header checksum is always SHA-256.
CHECKSUM_SHA256 = "sha256"
CHECKSUM_XXH3 = "xxh3"
CHECKSUMS = (CHECKSUM_XXH3, CHECKSUM_SHA256)
#: The ``__metadata__`` key holding the tensor checksums of each algorithm.
TENSOR_CHECKSUM_KEY = {CHECKSUM_SHA256: META_TENSOR_SHA256, CHECKSUM_XXH3: META_TENSOR_XXH3}
#: Lowercase hex digits of one tensor checksum of each algorithm.
CHECKSUM_HEX_LENGTH = {CHECKSUM_SHA256: SHA256_HEX_LENGTH, CHECKSUM_XXH3: 32}
#: Each algorithm's name in messages and ``kvpack info``.
CHECKSUM_NAMES = {CHECKSUM_SHA256: "SHA-256", CHECKSUM_XXH3: "XXH3-128"}

# --- tensors ---------------------------------------------------------------------------------------------------
#: Every tensor holds all layers, layer 0's part first (``format/SPEC.md`` §5).
TOKEN_IDS = "token_ids"
HEAD_LENGTHS = "head_lengths"
KEYS = "keys"
VALUES = "values"
POSITIONS = "positions"
#: Optional: float32 ``[entries]`` additive attention-logit bias of each kept entry (Attention Matching's beta,
#: arXiv 2602.16284), in the row order of ``positions``; absent means all zero.
ATTN_BIAS = "attn_bias"
#: Attention biases must be finite and lie in ``[-MAX_ATTN_BIAS, MAX_ATTN_BIAS]`` (exp(30) ~ 1e13: any larger
#: bias would swamp every other logit in float16/bfloat16 arithmetic).
MAX_ATTN_BIAS = 30.0
#: A loaded key or value must be finite and at most this in magnitude (float16's largest finite value, so every KV
#: dtype a file may use holds every accepted entry; real caches stay orders of magnitude below it). Larger or
#: non-finite entries would only turn attention into NaN (``kvpack.loading.check_kv_range``).
MAX_KV_ABS = 65504.0
LAYER_PARTS = (KEYS, VALUES, POSITIONS)
#: Sections reported by ``PackHeader.bytes_by_section``.
SECTION_HEADER = "header"
SECTIONS = (SECTION_HEADER, TOKEN_IDS, HEAD_LENGTHS, KEYS, VALUES, POSITIONS)

# --- dtypes ----------------------------------------------------------------------------------------------------
#: safetensors dtype code -> bytes per element, for every code an index may name.
ITEMSIZE_BY_CODE = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4, "I64": 8, "U8": 1}
#: ``DTYPE_BY_CODE`` (code -> torch dtype, for the same codes) and ``CODE_BY_DTYPE`` (its inverse) are made on first
#: use by ``__getattr__`` below: they import torch, which reading a header never needs.
_TORCH_DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "I32": "int32", "I64": "int64",
                      "U8": "uint8"}
#: Codes allowed for keys and values.
FLOAT_CODES = ("F32", "F16", "BF16")
#: The dtype names (``--kv-dtype``) of the float codes.
KV_DTYPE_NAMES = {code: _TORCH_DTYPE_NAMES[code] for code in FLOAT_CODES}
#: Code of token_ids, head_lengths and positions.
INDEX_INT_CODE = "I32"
#: Code of ``ATTN_BIAS`` and of ``QUANT_GRID``.
F32_CODE = "F32"
INT32_MAX = 2**31 - 1

# --- quantization (the compact layout; grouping after KIVI, arXiv 2402.02750) -----------------------------------


@dataclass(frozen=True)
class QuantType:
    """A quantization type: ``name``, ``bits`` per code and ``codes_per_byte`` (value codes packed in one uint8)."""

    name: str
    bits: int
    codes_per_byte: int

    @property
    def levels(self) -> int:
        """Largest code, ``2**bits - 1`` (codes run over ``0 .. levels``)."""
        return (1 << self.bits) - 1


#: No quantization: keys and values are stored in the pack's float dtype.
QUANT_NONE = "none"
#: Quantized types. int4: two value codes per byte, the even channel in the low nibble, the odd one in the high one.
QUANT_TYPES = {
    "int8": QuantType("int8", 8, 1),
    "int4": QuantType("int4", 4, 2),
}
#: Largest group size a reader accepts (any integer in ``[1, MAX_GROUP_SIZE]`` is a valid file).
MAX_GROUP_SIZE = 65536
#: Keys of the ``META_QUANT`` object.
QUANT_INFO_KEYS = ("group_size", "type")
#: The one quantized layout (``format/SPEC.md`` §5.4): per-channel key code widths, 8-bit group parameters on
#: per-layer grids, every non-sink row of a head with at least one group quantized.
QUANT_LAYOUT_COMPACT = "compact"
#: Tensors of a quantized file besides ``LAYER_PARTS``, all ``U8`` but the grid (``F32``), each over all layers:
#: ``key_bits`` ``[layers, kv_heads, head_dim]`` code widths; ``key_codes`` ``[Q, head_dim x bits / 8]`` and
#: ``value_codes`` ``[Q, head_dim_v x bits / 8]``; ``key_params`` ``[2, key groups, head_dim]`` and
#: ``value_params`` ``[2, Q, head_dim_v / Gv]`` min and scale codes; ``quant_grid`` ``[layers, 3, head_dim +
#: head_dim_v / Gv]`` each parameter column's min base, min step and scale base.
KEY_CODES = "key_codes"
KEY_BITS = "key_bits"
KEY_PARAMS = "key_params"
VALUE_CODES = "value_codes"
VALUE_PARAMS = "value_params"
QUANT_GRID = "quant_grid"
COMPACT_PARTS = (KEY_CODES, KEY_BITS, KEY_PARAMS, VALUE_CODES, VALUE_PARAMS, QUANT_GRID)
#: Widths a compact key channel may have, in bits.
MIN_KEY_BITS, MAX_KEY_BITS = 1, 8
#: dtype code of the codes and of the 8-bit group parameters.
QUANT_CODE_CODE = "U8"

# --- tensor codecs ---------------------------------------------------------------------------------------------
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
#: The first 4 bytes of a zstd frame (0xFD2FB528 little-endian).
ZSTD_FRAME_MAGIC = b"\x28\xb5\x2f\xfd"
#: Decompression-bomb guard (``format/SPEC.md`` §6): an encoded tensor other than ``ENTRY_TENSORS`` may decode to at
#: most ``max(EXPANSION_FLOOR_BYTES, MAX_EXPANSION x its stored bytes)``. Real KV compresses far less: the largest
#: ratio measured (``tools/zstd_ratios.py``, BENCHMARKS.md "Reliability") is 2.06x (bfloat16 values, level 19),
#: token ids 4.2x; the writer stores a tensor that would exceed the limit raw instead.
MAX_EXPANSION = 8
EXPANSION_FLOOR_BYTES = 1 << 20
#: Tensors with one element per entry (``positions`` compresses 15x at keep 0.3 and over 1,000x at keep 1.0, its
#: deltas being 1): exempt from ``MAX_EXPANSION``, their size is bounded by the rows of ``keys`` and ``key_codes``.
ENTRY_TENSORS = (POSITIONS, ATTN_BIAS)

# --- reading ---------------------------------------------------------------------------------------------------
#: Bytes a reader holds at once while checksumming or decoding a tensor (``verify``'s whole working buffer).
READ_CHUNK_BYTES = 8 << 20

#: Longest string accepted in the short metadata fields (method, version, source name and hash), in characters
#: (``kvpack.rules.metadata_problem``; ``kvpack.compress`` refuses a longer ``source_name``).
MAX_SHORT_TEXT = 1024


def __getattr__(name: str):
    """``DTYPE_BY_CODE`` and ``CODE_BY_DTYPE`` (torch dtypes), made when code that builds tensors first asks."""
    if name in ("DTYPE_BY_CODE", "CODE_BY_DTYPE"):
        import torch

        by_code = {code: getattr(torch, dtype) for code, dtype in _TORCH_DTYPE_NAMES.items()}
        globals().update(DTYPE_BY_CODE=by_code, CODE_BY_DTYPE={dtype: code for code, dtype in by_code.items()})
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
