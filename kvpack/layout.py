"""How a context and later questions are laid out as tokens (KVzip's context-dependent layout, arXiv 2505.23416 §3).

The context is the start of a user turn; a question continues that turn after a blank line, and the turn then
hands over to the assistant::

    [prefix = template up to the user's content]  [context]  ["\\n\\n" + question + end of turn + assistant header]

The prefix is the attention sink: it is kept in every head and never evicted. The cache holds
``prefix + context``; everything after it is fed at question time (or, while scoring, KVzip's repeat prompt).
Pieces are tokenized separately, so the context's tokens do not depend on the question.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InputError

__all__ = ["ChatLayout", "chat_layout"]

_CONTEXT = "KVPACKCONTEXTSENTINEL"
_QUESTION = "KVPACKQUESTIONSENTINEL"


@dataclass(frozen=True)
class ChatLayout:
    """The text pieces around a context.

    Attributes:
        prefix: text before the context (chat-template system prompt and user header, or the BOS token).
        separator: text between the context and a question (a blank line).
        turn_end: text after a question: end of the user turn and the assistant header.
        templated: whether the tokenizer's chat template produced the pieces.
    """

    prefix: str
    separator: str
    turn_end: str
    templated: bool

    def encode(self, tokenizer, text: str) -> list[int]:
        """Token ids of ``text`` with no special tokens added (special-token strings in it are recognised)."""
        return tokenizer.encode(text, add_special_tokens=False)

    def encode_text(self, tokenizer, text: str) -> list[int]:
        """Token ids of a document's ``text`` as plain text: special-token strings in it (``<|end|>``) are
        tokenized as the characters they are, never as control tokens."""
        return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)

    def prefix_ids(self, tokenizer) -> list[int]:
        """Token ids of the prefix (the attention sink)."""
        return self.encode(tokenizer, self.prefix) if self.prefix else []

    def question_ids(self, tokenizer, question: str) -> list[int]:
        """Token ids fed after the cached context to ask ``question``; generation continues after them.

        Special-token strings inside ``question`` are plain text (as in a document, ``encode_text``); the layout's
        own pieces keep their control tokens."""
        if not any(t in question for t in tokenizer.all_special_tokens):
            return self.encode(tokenizer, self.separator + question + self.turn_end)
        return self.encode(tokenizer, self.separator) + self.encode_text(tokenizer, question) + self.encode(
            tokenizer, self.turn_end)

    def to_dict(self) -> dict:
        """JSON-serialisable form, stored in the pack's metadata."""
        return {"prefix": self.prefix, "separator": self.separator, "turn_end": self.turn_end,
                "templated": self.templated}

    @classmethod
    def from_dict(cls, d: dict) -> "ChatLayout":
        """Inverse of ``to_dict``."""
        return cls(d["prefix"], d["separator"], d["turn_end"], bool(d["templated"]))


def chat_layout(tokenizer) -> ChatLayout:
    """Derive the layout from the tokenizer's chat template (one user turn holding context and question).

    Without a chat template the layout is ``BOS + context + "\\n\\nQuestion: " + question + "\\nAnswer:"``.
    Raises ``InputError`` if the template drops or reorders the user's content.
    """
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": f"{_CONTEXT}\n\n{_QUESTION}"}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        c, q = text.find(_CONTEXT), text.find(_QUESTION)
        if c < 0 or q < c:
            raise InputError("the tokenizer's chat template does not keep the user's message; pass a tokenizer "
                             "with a standard chat template")
        return ChatLayout(text[:c], text[c + len(_CONTEXT) : q], text[q + len(_QUESTION) :], True)
    bos = tokenizer.bos_token or ""
    return ChatLayout(bos, "\n\nQuestion: ", "\nAnswer:", False)
