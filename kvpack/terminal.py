"""Text kvpack prints on a terminal: header strings escaped (``printable``, ``json_text``), tables and key-value rows.

Everything printed from a file, a file name or the model passes through ``printable`` (or ``json_text`` for JSON):
a hostile pack cannot clear a screen or reorder a line. Plain Python, no torch.
"""

from __future__ import annotations

import json
import unicodedata
from typing import Any

__all__ = ["printable", "json_text", "pairs", "table"]


#: Bidirectional controls: they reorder what a terminal shows (a name can display as another).
_BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _acts_on_terminal(c: str) -> bool:
    return unicodedata.category(c) in ("Cc", "Cs", "Zl", "Zp") or c in _BIDI_CONTROLS


def printable(text: Any, keep: str = "") -> str:
    """``str(text)`` with every character a terminal could act on written as its Python escape (``\\x1b``,
    ``\\u202e``): control characters (ESC, BEL, DEL, the C1 codes, newlines too unless in ``keep``), surrogates,
    line and paragraph separators and the bidirectional controls. Header strings are untrusted and must not clear a
    screen, retitle a window or reorder a line; other text (accents, CJK, no-break spaces, emoji sequences) is left
    as it is. ``keep``: characters left as they are (``"\\n\\t"`` for a generated answer's lines). Raises
    nothing."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c.encode("unicode_escape", "backslashreplace").decode("ascii")
                   if c not in keep and _acts_on_terminal(c) else c for c in text)


def json_text(obj: Any, **dumps_kwargs) -> str:
    """``json.dumps(obj, ensure_ascii=False, **dumps_kwargs)`` with the characters ``printable`` escapes that JSON
    leaves raw (the C1 controls, DEL, surrogates, line and paragraph separators, bidirectional controls) written as
    ``\\uXXXX``: the same JSON value, safe to print on a terminal, other text still readable. Raises what
    ``json.dumps`` raises."""
    out = json.dumps(obj, **{**dumps_kwargs, "ensure_ascii": False})
    if out.isascii():
        return out
    return "".join(f"\\u{ord(c):04x}" if ord(c) >= 0x7f and _acts_on_terminal(c) else c for c in out)


def pairs(rows) -> str:
    """``key  value`` lines, keys padded to one width; every key and value through ``printable``."""
    rows = [(printable(k), printable(v)) for k, v in rows]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def table(headers, rows, *, right=(), indent: str = "") -> str:
    """A plain-text table: ``headers`` then ``rows``, columns padded (those in ``right`` right-aligned) to their
    width on a terminal (East Asian wide characters count two columns); every cell through ``printable``."""
    headers = [printable(h) for h in headers]
    rows = [[printable(c) for c in r] for r in rows]
    cols = list(zip(headers, *rows))
    widths = [max(_width(str(c)) for c in col) for col in cols]

    def cell(i: int, c, w: int) -> str:
        pad = " " * (w - _width(str(c)))
        return pad + str(c) if i in right else str(c) + pad

    def line(cells):
        return (indent + "  ".join(cell(i, c, w) for i, (c, w) in enumerate(zip(cells, widths)))).rstrip()

    return "\n".join([line(headers)] + [line(r) for r in rows])


def _width(text: str) -> int:
    """Terminal columns of ``text``: wide and full-width characters take two."""
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)
