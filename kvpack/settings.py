"""kvpack's application settings: the defaults and choices of its API and command line, and how it reads and writes.

None of them is a fact of the file format (those are in ``kvpack.constants``, which a reader of any implementation
needs): changing one changes what kvpack does by default or accepts, never which files are valid. Plain values, no
torch, so the command line can offer them without importing it.
"""

from __future__ import annotations

from . import constants as C

__all__ = ["DEFAULT_RATIO", "DEFAULT_CHUNK_SIZE", "DTYPES", "DEQUANTIZE", "QUANT_CHOICES", "GROUP_SIZES",
           "DEFAULT_GROUP_SIZE", "ALLOCATED_KEY_BITS", "DEFAULT_ZSTD_LEVEL", "SAVE_DEFAULT_ZSTD_LEVEL",
           "DEFAULT_CHECKSUM", "TEMP_INFIX", "TEMP_RANDOM_BYTES", "TEMP_FILE_MODE"]

#: Fraction of a context's KV entries a build keeps unless told otherwise (``--ratio``, ``kvpack.compress``).
DEFAULT_RATIO = 0.3
#: Tokens per prefill and scoring chunk (``--chunk-size``; bounds a build's memory).
DEFAULT_CHUNK_SIZE = 2048
#: Model dtypes the command line takes (``--dtype``; ``auto``: bfloat16 on CUDA, float32 on CPU).
DTYPES = ("auto", "float32", "bfloat16", "float16")
#: Where a quantized pack's body rows are dequantized: once when the cache is laid out, or at every attention call
#: (``kvpack ask --dequantize``, ``kvpack.load``).
DEQUANTIZE = ("at-load", "on-the-fly")

# --- what a build stores ---------------------------------------------------------------------------------------
#: What ``--quant`` accepts (a file may hold any of ``constants.QUANT_TYPES``).
QUANT_CHOICES = (C.QUANT_NONE, "int8", "int4")
#: Group sizes ``kvpack.compress`` and ``kvpack build --group-size`` accept (a file may hold any in
#: ``[1, constants.MAX_GROUP_SIZE]``); 32 is KIVI's default.
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 32
#: Key code widths the compact writer allocates from, in bits (``kvpack.compact.allocate_widths``; a file may hold
#: any in ``[constants.MIN_KEY_BITS, constants.MAX_KEY_BITS]``).
ALLOCATED_KEY_BITS = (2, 8)
#: ``kvpack build --zstd-level`` default.
DEFAULT_ZSTD_LEVEL = 3
#: ``kvpack.save`` / ``pack_to_bytes`` default: raw tensors (any safetensors tool reads them).
SAVE_DEFAULT_ZSTD_LEVEL = 0
#: The tensor checksum ``kvpack build`` and ``kvpack.save`` write unless told otherwise.
DEFAULT_CHECKSUM = C.CHECKSUM_XXH3

# --- saving ----------------------------------------------------------------------------------------------------
#: ``kvpack.storage.write_atomic`` writes ``<target name>.tmp.<pid>.<random>`` first (matched by ``*.kvpack.tmp*``
#: in .gitignore); the next save or build in that folder removes such files whose writer process is gone.
TEMP_INFIX = ".tmp."
#: Random bytes (hex-encoded) in the temporary name, so concurrent writers never collide.
TEMP_RANDOM_BYTES = 4
#: Mode the temporary file is created with (before the umask), as for ``open(path, "wb")``.
TEMP_FILE_MODE = 0o666
