"""Tiny random-weight models and a tiny tokenizer, built locally from configs (no hub, no download)."""

from __future__ import annotations

import contextlib
import functools

import torch

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text")

TEXT = (
    "The lighthouse keeper wrote in the log every evening. The weather was calm and the sea was grey. "
    "Ships passed at dawn, and the lamp was cleaned at noon. The secret code of Alice is 48213. "
    "In winter the keeper read old letters and mended the nets. A storm came in March and broke a window. "
    "Supplies arrived by boat once a month, with flour, oil and candles for the long nights."
)

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@functools.lru_cache(maxsize=None)
def tiny_tokenizer():
    """A byte-level BPE tokenizer (vocab 320) with a chat template, trained in well under a second."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|pad|>"]
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|end|>",
                                   pad_token="<|pad|>", chat_template=CHAT_TEMPLATE)


def tiny_config(arch: str, vocab_size: int):
    """A 2-3 layer config of ``arch`` with 4 query heads sharing 2 KV heads (GQA group 2)."""
    import transformers as tf

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
                  pad_token_id=5, num_hidden_layers=2)
    if arch == "llama":
        return tf.LlamaConfig(**common, head_dim=16)
    if arch == "mistral":
        return tf.MistralConfig(**common, head_dim=16, sliding_window=None)
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=16)
    if arch == "phi3":
        return tf.Phi3Config(**common, sliding_window=None)
    if arch == "gemma3_text":
        common["num_hidden_layers"] = 3
        return tf.Gemma3TextConfig(**common, head_dim=16, sliding_window=24,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    raise ValueError(arch)


@functools.lru_cache(maxsize=None)
def tiny_model(arch: str, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)``: a seeded random tiny model of ``arch`` in eval mode."""
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, len(tok)), attn_implementation="sdpa",
                                             dtype=dtype)
    # random init gives near-uniform attention; sharpen it so masking mistakes change the logits visibly
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "k_proj" in name or "q_proj" in name or "qkv_proj" in name:
                p.mul_(4.0)
    model.kvpack_name = f"tiny-{arch}"
    return model.eval(), tok


#: Texts the tiny head-score files are made from (not the test's ``TEXT``, as a user's would not be).
HEAD_TEXTS = (
    "Bees visit the orchard each spring. The apples ripen in autumn and are sold at the market in town.",
    "The train to the coast leaves at nine. Passengers bring bread and cheese, and the guard checks tickets.",
)


@functools.lru_cache(maxsize=None)
def tiny_heads_file(arch: str) -> str:
    """Path of a head-score file (``kvpack heads``) of ``tiny_model(arch)`` made from ``HEAD_TEXTS``, in a
    temporary folder removed at exit."""
    import atexit
    import shutil
    import tempfile

    from kvpack.heads import head_scores, save_head_scores

    folder = tempfile.mkdtemp(prefix="kvpack-heads-")
    atexit.register(shutil.rmtree, folder, True)
    model, tok = tiny_model(arch)
    path = f"{folder}/{arch}.safetensors"
    save_head_scores(head_scores(model, tok, list(HEAD_TEXTS), chunk_size=64), path)
    return path


def required_options(method: str, arch: str) -> dict:
    """Options a method cannot run without on ``tiny_model(arch)`` (kvzip-head: its head-score file)."""
    return {"heads": tiny_heads_file(arch)} if method == "kvzip-head" else {}


@contextlib.contextmanager
def attention_implementation(model, name: str):
    """Run the block with ``model`` on attention ``name`` (e.g. ``"eager"`` for ``output_attentions``), then put
    back the implementation it had: the tiny models are cached and shared by every test."""
    before = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation(before)
