"""kvpack: compress an LLM's KV cache of a context once, save it as a ``.kvpack`` file, reuse it anywhere.

    model, tok = kvpack.load_model()                       # the embedded reference model
    pack = kvpack.compress(model, tok, text, method="kvzip", ratio=0.3)
    kvpack.save(pack, "doc.kvpack")
    cache = kvpack.load("doc.kvpack", model)
    print(kvpack.generate(model, tok, cache, "What is ...?"))
"""

__version__ = "0.1.0"

import sys  # noqa: E402
import types  # noqa: E402

from .errors import KvpackError  # noqa: E402

__all__ = ["__version__", "load_model", "compress", "save", "load", "generate", "Pack", "KvpackCache",
           "KvpackError", "head_scores", "save_head_scores", "load_head_scores"]

#: Where each public name lives: imported on first use, so ``import kvpack`` (and the CLI's commands that read only
#: headers) does not import torch.
_EXPORTS = {"KvpackCache": "cache", "compress": "compress", "save": "fileformat", "generate": "generation",
            "head_scores": "heads", "load_head_scores": "heads", "save_head_scores": "heads", "load": "loading",
            "load_model": "model", "Pack": "pack"}


class _Package(types.ModuleType):
    """``kvpack`` itself: a submodule of the same name as a public function (``kvpack.compress``) does not replace
    the function when it is first imported (as the package's eager imports used to ensure)."""

    def __setattr__(self, name, value):
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvpack' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
