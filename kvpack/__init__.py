"""kvpack: compress an LLM's KV cache of a context once, save it as a ``.kvpack`` file, reuse it anywhere.

    model, tok = kvpack.load_model()                       # the embedded reference model
    pack = kvpack.compress(model, tok, text, method="kvzip", ratio=0.3)
    kvpack.save(pack, "doc.kvpack")
    cache = kvpack.load("doc.kvpack", model)
    print(kvpack.generate(model, tok, cache, "What is ...?"))
"""

__version__ = "0.1.0"

from .cache import KvpackCache  # noqa: E402
from .compress import compress  # noqa: E402
from .errors import KvpackError  # noqa: E402
from .fileformat import save  # noqa: E402
from .generation import generate  # noqa: E402
from .heads import head_scores, load_head_scores, save_head_scores  # noqa: E402
from .loading import load  # noqa: E402
from .model import load_model  # noqa: E402
from .pack import Pack  # noqa: E402

__all__ = ["__version__", "load_model", "compress", "save", "load", "generate", "Pack", "KvpackCache",
           "KvpackError", "head_scores", "save_head_scores", "load_head_scores"]
