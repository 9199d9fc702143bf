"""Loading models, the embedded reference model, and what kvpack needs to know about an architecture."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import InputError, ModelLoadError, UnsupportedModelError

__all__ = ["REFERENCE_MODEL_DIR", "load_model", "resolve_device", "resolve_dtype", "ModelSpec", "model_spec"]

#: The embedded reference model shipped inside the package (see its MODEL_CARD.md).
REFERENCE_MODEL_DIR = Path(__file__).resolve().parent / "models" / "reference"

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


def load_model(name_or_path: str | os.PathLike | None = None, *, device=None, dtype=None):
    """Load a causal LM and its tokenizer, ready for ``kvpack.compress`` and ``kvpack.load``.

    Args:
        name_or_path: a local Hugging Face model folder, a hub id (only where the hub can be reached), or
            ``None`` for the embedded reference model (no network needed; ``HF_HUB_OFFLINE`` does not matter).
        device: ``"auto"`` (default: CUDA if available), ``"cpu"``, ``"cuda"`` or a ``torch.device``.
        dtype: ``"auto"`` (default: bfloat16 on CUDA, float32 on CPU), ``"float32"``, ``"bfloat16"``,
            ``"float16"`` or a ``torch.dtype``.

    Returns:
        ``(model, tokenizer)``; the model is in eval mode on ``device``.

    Raises:
        ModelLoadError: the folder is missing or incomplete, or a hub id cannot be fetched.
        UnsupportedModelError: the architecture is not one kvpack supports (see ``SUPPORTED_MODEL_TYPES``).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    path = REFERENCE_MODEL_DIR if name_or_path is None else name_or_path
    local = Path(path).is_dir()
    if not local and (Path(path).exists() or str(path).startswith((".", "/", "~"))):
        raise ModelLoadError(f"no model folder at {str(path)!r}; pass a folder holding config.json, the weights and "
                             "the tokenizer (or a hub id where the hub can be reached)")
    if name_or_path is None and not (REFERENCE_MODEL_DIR / "config.json").exists():
        raise ModelLoadError(
            f"the embedded reference model is missing from {REFERENCE_MODEL_DIR}; reinstall kvpack "
            "or pass --model PATH to a local Hugging Face model folder"
        )
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = _declared_backend(path) or AutoTokenizer.from_pretrained(path, local_files_only=local)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dt, local_files_only=local, attn_implementation="sdpa"
        )
    except (OSError, ValueError, KeyError) as exc:
        hint = "check the folder holds config.json, the weights and the tokenizer files" if local else (
            "pass a local model folder; hub ids need network access"
        )
        raise ModelLoadError(f"could not load model {str(path)!r}: {exc}. Fix: {hint}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    model_spec(model)  # refuse unsupported architectures early
    model.to(dev).eval()
    model.kvpack_name = "kvpack-reference" if name_or_path is None else str(name_or_path)
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
        raise UnsupportedModelError(
            f"model type {model_type!r} ({type(model).__name__}) is not supported; kvpack supports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} text decoders (for Gemma 3 load the text-only Gemma3ForCausalLM)"
        )
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
