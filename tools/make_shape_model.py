#!/usr/bin/env python
"""Write a random-weight Hugging Face model folder with the exact layer shapes of a real model.

No model hub can be reached here, so speed and memory at real shapes are measured on stand-ins: the decoder
layers (hidden size, layers, query/KV heads, head_dim, intermediate size, RoPE theta and scaling, q/k-norm,
Gemma 3's sliding-window pattern, attention biases, tied embeddings, norm eps, activation) are the published
model's, taken from its ``config.json`` on the Hugging Face hub (URL in ``SHAPES``). The tokenizer is kvpack's
reference tokenizer (``kvpack/models/reference``), so the vocabulary is the reference's (4,096 tokens) and the
embedding and LM head are the only shapes that differ from the real model: ``[4096, hidden]`` instead of e.g.
``[151936, 896]``. For timing this means: kvpack's prefill asks for no context logits (``logits_to_keep=1``), so
prefill, build (KVzip's repeat passes included) and load times are the real model's; a decode step lacks the real
LM head's ``(vocab - 4096) x hidden`` multiply-adds, which are this share of the real model's per-token weight
work (the LM head over all weights used once per token): Qwen2.5-0.5B 28%, Gemma-3-1B 30%, Llama-3.2-1B 21%,
Qwen2.5-7B 8%, Llama-3.1-8B 7%. So whole-model decode steps here are up to that much cheaper than the real
model's (attention over the cache is not affected), and the weights take ``(vocab - 4096) x hidden`` fewer
parameters of RAM (twice that where untied).

Weights: every matrix (linear layers and the embedding) is drawn from N(0, std) with std the config's
``initializer_range`` (0.02 in every model here: what the models were initialised with before training; attention
logits then have a standard deviation of about 0.35 on the 0.5B shape: attention is spread out, each query's
largest probability about twice the uniform one, like an untrained model's; ``--init-std`` makes it sharper),
biases are 0, norm weights are the identity (1, or 0 for Gemma 3's ``x * (1 + w)`` norms). Each tensor has its own
generator seeded from ``--seed`` and the tensor's name, so a ``--layers N`` model's first N layers equal the full
model's. Tensors are generated one at a time (in row blocks) and written into safetensors shards of at most
``--shard-mib``, so building Llama-3.1-8B's shape needs about one shard of RAM, not the model's 16/32 GB. Never
pickled.

    python tools/make_shape_model.py qwen2.5-0.5b --out runs/shapes/qwen2.5-0.5b
    python tools/make_shape_model.py llama-3.1-8b --out runs/shapes/llama-3.1-8b --dtype bfloat16
    python tools/make_shape_model.py gemma-3-1b --out runs/shapes/gemma-3-1b-6l --layers 6
    python tools/make_shape_model.py --list
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvpack.errors import InputError  # noqa: E402
from kvpack.model import REFERENCE_MODEL_DIR  # noqa: E402

#: Published shapes, copied from each model's config.json on the Hugging Face hub (the URL in "source"). Keys are
#: those files' own (legacy rope_theta / rope_scaling / rope_local_base_freq / sliding_window_pattern included);
#: transformers' config classes convert them. Only vocab_size and the special-token ids are replaced (by the
#: reference tokenizer's). "params" is the published total parameter count (the hub's safetensors metadata), which
#: the test suite recomputes from these shapes with the real vocab.
SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": {
        "source": "https://huggingface.co/Qwen/Qwen2.5-0.5B/blob/main/config.json",
        "params": 494_032_768,
        "config": {
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
            "num_attention_heads": 14, "num_key_value_heads": 2,  # head_dim 896 / 14 = 64; q/k/v have biases
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "max_position_embeddings": 32768, "sliding_window": 32768, "use_sliding_window": False,
            "max_window_layers": 24, "tie_word_embeddings": True, "initializer_range": 0.02,
            "attention_dropout": 0.0, "vocab_size": 151936,
        },
    },
    "qwen2.5-7b": {
        "source": "https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json",
        "params": 7_615_616_512,
        "config": {
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
            "num_attention_heads": 28, "num_key_value_heads": 4,  # head_dim 3584 / 28 = 128; q/k/v biases
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "max_position_embeddings": 131072, "sliding_window": 131072, "use_sliding_window": False,
            "max_window_layers": 28, "tie_word_embeddings": False, "initializer_range": 0.02,
            "attention_dropout": 0.0, "vocab_size": 152064,
        },
    },
    "qwen3-0.6b": {
        "source": "https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json",
        "params": 596_049_920,
        "config": {
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,  # q/k-norm, no biases
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000,
            "max_position_embeddings": 40960, "sliding_window": None, "use_sliding_window": False,
            "max_window_layers": 28, "attention_bias": False, "tie_word_embeddings": True,
            "initializer_range": 0.02, "attention_dropout": 0.0, "vocab_size": 151936,
        },
    },
    "llama-3.2-1b": {
        "source": "https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json",
        "params": 1_235_814_400,
        "config": {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
            "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "max_position_embeddings": 131072, "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": True, "initializer_range": 0.02, "pretraining_tp": 1,
            "attention_dropout": 0.0, "vocab_size": 128256,
        },
    },
    "llama-3.1-8b": {
        "source": "https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json",
        "params": 8_030_261_248,
        "config": {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8,  # head_dim 4096 / 32 = 128
            "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "max_position_embeddings": 131072, "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": False, "initializer_range": 0.02, "pretraining_tp": 1,
            "attention_dropout": 0.0, "vocab_size": 128256,
        },
    },
    "gemma-3-1b": {
        "source": "https://huggingface.co/google/gemma-3-1b-pt/blob/main/config.json",
        "params": 999_885_952,
        "config": {
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,  # q/k-norm
            "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
            "rope_theta": 1000000, "rope_local_base_freq": 10000, "rope_scaling": None,
            "sliding_window": 512, "sliding_window_pattern": 6,  # layers 5, 11, 17, 23 global, the rest local
            "max_position_embeddings": 32768, "attention_bias": False, "attn_logit_softcapping": None,
            "final_logit_softcapping": None, "tie_word_embeddings": True, "initializer_range": 0.02,
            "attention_dropout": 0.0, "vocab_size": 262144,
        },
    },
}

#: Tokenizer files copied from the reference model folder.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
#: Elements generated per block (bounds the float32 scratch of one block to 256 MiB).
BLOCK_ELEMENTS = 1 << 26
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def shape_config(name: str, *, layers: int | None = None, dtype: str = "float32", vocab: str = "reference"):
    """The transformers config of shape ``name``.

    Args:
        name: a key of ``SHAPES``.
        layers: keep only the first ``layers`` decoder layers (``None``: all). Gemma 3's local/global pattern is
            the published one, truncated (a model of fewer than 6 layers has only sliding layers).
        dtype: ``"float32"`` or ``"bfloat16"`` (recorded as the config's dtype).
        vocab: ``"reference"`` (the reference tokenizer's vocabulary and special-token ids) or ``"real"`` (the
            published vocab_size, for parameter counts; such a config cannot be used with the tokenizer).

    Raises:
        InputError: unknown ``name``, ``layers`` outside 1..published layers, unknown ``dtype`` or ``vocab``.
    """
    from transformers import AutoConfig

    if name not in SHAPES:
        raise InputError(f"unknown shape {name!r}; choose one of {', '.join(SHAPES)}")
    if dtype not in _DTYPES:
        raise InputError(f"unknown dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")
    values = dict(SHAPES[name]["config"])
    full = values["num_hidden_layers"]
    if layers is not None:
        if not 1 <= layers <= full:
            raise InputError(f"--layers must be 1..{full} for {name} (got {layers})")
        values["num_hidden_layers"] = layers
        if "max_window_layers" in values:
            values["max_window_layers"] = min(values["max_window_layers"], layers)
    if vocab == "reference":
        ref = json.loads((REFERENCE_MODEL_DIR / "config.json").read_text(encoding="utf-8"))
        for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):
            values[key] = ref[key]
    elif vocab != "real":
        raise InputError(f"vocab must be 'reference' or 'real' (got {vocab!r})")
    model_type = values.pop("model_type")
    config = AutoConfig.for_model(model_type, **values)
    config.dtype = _DTYPES[dtype]
    return config


def _meta_model(config):
    """The model of ``config`` on the meta device (shapes only, no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=config.dtype)


def parameter_shapes(config) -> dict[str, tuple[torch.Size, str]]:
    """``{name: (shape, kind)}`` of every stored tensor, kind one of ``"matrix"``, ``"bias"``, ``"norm"``.

    Tied weights appear once (under the embedding's name), as transformers saves them.
    """
    model = _meta_model(config)
    linear_like = (torch.nn.Linear, torch.nn.Embedding)
    out = {}
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if isinstance(module, linear_like):
                kind = "matrix" if p_name == "weight" else "bias"
            else:
                kind = "norm"
            out[full] = (p.shape, kind)
    unique = {name for name, _ in model.named_parameters()}
    for name in {name for name, _ in model.named_parameters(remove_duplicate=False)} - unique:  # tied copies
        out.pop(name, None)
    return out


def _seed_for(seed: int, name: str) -> int:
    """A 63-bit generator seed from ``seed`` and a tensor name (stable across runs and platforms)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def make_tensor(name: str, shape: torch.Size, kind: str, *, std: float, seed: int, dtype: torch.dtype,
                norm_fill: float) -> torch.Tensor:
    """One tensor: N(0, std) in row blocks for matrices (float32 draws, cast), zeros for biases, ``norm_fill``
    for norm weights. Deterministic in ``(seed, name, shape)``."""
    if kind == "bias":
        return torch.zeros(shape, dtype=dtype)
    if kind == "norm":
        return torch.full(shape, norm_fill, dtype=dtype)
    out = torch.empty(shape, dtype=dtype)
    gen = torch.Generator().manual_seed(_seed_for(seed, name))
    flat = out.view(-1)
    for start in range(0, flat.numel(), BLOCK_ELEMENTS):
        stop = min(start + BLOCK_ELEMENTS, flat.numel())
        flat[start:stop] = torch.randn(stop - start, generator=gen, dtype=torch.float32).mul_(std)
    return out


def _shard_plan(shapes: dict, itemsize: int, shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped into shards of at most ``shard_bytes`` (a bigger tensor gets a shard of its own)."""
    shards, current, size = [], [], 0
    for name, (shape, _) in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        shards.append(current)
    return shards


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def make_shape_model(name: str, out: str | os.PathLike, *, dtype: str = "float32", layers: int | None = None,
                     seed: int = 0, shard_mib: int = 2048, init_std: float | None = None,
                     overwrite: bool = False) -> Path:
    """Write the random-weight model folder of shape ``name`` into ``out`` and return its path.

    The folder holds ``config.json``, ``generation_config.json``, ``model.safetensors`` (or
    ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``), the reference tokenizer
    files and a ``SHAPE.md`` saying what it is. Peak RAM is about one shard (``shard_mib``) plus one 256 MiB
    generation block.

    Args:
        name: a key of ``SHAPES``.
        out: the folder (created; must be empty or absent unless ``overwrite``).
        dtype: ``"float32"`` or ``"bfloat16"`` weights.
        layers: keep the first ``layers`` decoder layers (``None``: all).
        seed: weight seed (each tensor's generator is seeded from it and the tensor's name).
        shard_mib: the most bytes (MiB) per safetensors shard.
        init_std: standard deviation of the matrices (default: the config's ``initializer_range``).
        overwrite: replace an existing non-empty folder.

    Raises:
        InputError: unknown shape or dtype, bad ``layers``/``shard_mib``/``init_std``, or ``out`` is not empty.
    """
    from safetensors.torch import save_file

    if shard_mib < 1:
        raise InputError(f"--shard-mib must be >= 1 (got {shard_mib})")
    config = shape_config(name, layers=layers, dtype=dtype)
    std = config.initializer_range if init_std is None else init_std
    if not std > 0:
        raise InputError(f"--init-std must be > 0 (got {std})")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise InputError(f"{out} exists and is not empty; pass --overwrite or choose another --out")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)

    torch_dtype = _DTYPES[dtype]
    norm_fill = 0.0 if config.model_type.startswith("gemma") else 1.0
    shapes = parameter_shapes(config)
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    plan = _shard_plan(shapes, itemsize, shard_mib << 20)
    files = (["model.safetensors"] if len(plan) == 1 else
             [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))])
    weight_map, total = {}, 0
    for fname, names in zip(files, plan):
        shard = {n: make_tensor(n, shapes[n][0], shapes[n][1], std=std, seed=seed, dtype=torch_dtype,
                                norm_fill=norm_fill) for n in names}
        tmp = out / (fname + ".tmp")
        save_file(shard, str(tmp), metadata={"format": "pt"})
        os.chmod(tmp, 0o644)  # safetensors creates the file owner-only; a model folder is readable like any other
        os.replace(tmp, out / fname)
        total += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map.update({n: fname for n in names})
        del shard
    if len(plan) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _atomic_write_text(out / "model.safetensors.index.json", json.dumps(index, indent=2, sort_keys=True))

    config.save_pretrained(out)  # transformers writes config.json itself
    for fname in TOKENIZER_FILES + ("generation_config.json",):
        shutil.copyfile(REFERENCE_MODEL_DIR / fname, out / fname)
    spec = SHAPES[name]
    n_layers = config.num_hidden_layers
    _atomic_write_text(out / "SHAPE.md", (
        f"# Random-weight stand-in with the layer shapes of {name}\n\n"
        f"Made by `tools/make_shape_model.py {name} --dtype {dtype} --layers {n_layers} --seed {seed}`"
        f" (init std {std}). Shapes from {spec['source']}; {n_layers} of {spec['config']['num_hidden_layers']}"
        f" layers. Vocabulary: kvpack's reference tokenizer ({config.vocab_size} tokens instead of "
        f"{spec['config']['vocab_size']}), so the embedding and LM head are the only shapes that differ. "
        "Random weights: for speed and memory only, its text is noise.\n"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", nargs="?", choices=sorted(SHAPES), help="the real model whose shapes to copy")
    ap.add_argument("--out", help="output folder (created)")
    ap.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    ap.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-mib", type=int, default=2048, help="largest safetensors shard in MiB")
    ap.add_argument("--init-std", type=float, default=None, help="matrix std (default: initializer_range)")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    ap.add_argument("--list", action="store_true", help="print the shape table and exit")
    args = ap.parse_args(argv)
    if args.list:
        print("| name | layers | hidden | heads (q/kv) | head_dim | intermediate | tied | params | source |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, spec in SHAPES.items():
            c = spec["config"]
            hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
            print(f"| {name} | {c['num_hidden_layers']} | {c['hidden_size']} | {c['num_attention_heads']}/"
                  f"{c['num_key_value_heads']} | {hd} | {c['intermediate_size']} | {c['tie_word_embeddings']} | "
                  f"{spec['params']:,} | {spec['source']} |")
        return 0
    if args.name is None or args.out is None:
        ap.error("NAME and --out are required (or --list)")
    try:
        path = make_shape_model(args.name, args.out, dtype=args.dtype, layers=args.layers, seed=args.seed,
                                shard_mib=args.shard_mib, init_std=args.init_std, overwrite=args.overwrite)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
