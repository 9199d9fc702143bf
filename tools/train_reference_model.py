#!/usr/bin/env python
"""Train kvpack's embedded reference model: a small Llama (RoPE, RMSNorm, SwiGLU, GQA) on 2 CPU cores.

Data: the CPython documentation sources (reStructuredText), licensed under the PSF License Agreement, from
Debian's ``python3.11-doc`` package (``apt-get install python3.11-doc``; files under
``/usr/share/doc/python3.11/html/_sources``). Every tenth file (by SHA-1 of its relative path) is held out
from training and used for evaluation and for ``examples/``.

Training mix (weights change over the curriculum, see ``PHASES``):
  * plain next-token text;
  * repeat-the-context episodes laid out exactly as KVzip's reconstruction pass (arXiv 2505.23416 §3.2);
  * retrieval episodes: 1-8 "The secret code of <name> is <number>." facts planted at random depths,
    1-3 of them asked after the passage (``kvpack.tasks``);
  * synthetic copy episodes of random tokens (no n-gram statistics help, so induction must form).
Sequences grow from 256 to 4096 tokens (a short-to-long curriculum); retrieval and copying are measured on
held-out text every ``--eval-every`` steps. Checkpoints (model, optimizer, step, RNG) let a run resume.

    python tools/train_reference_model.py --workdir ~/.cache/kvpack-train          # train (resumes)
    python tools/train_reference_model.py --workdir ~/.cache/kvpack-train --export  # write kvpack/models/reference
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvpack import tasks  # noqa: E402

CORPUS_DIR = "/usr/share/doc/python3.11/html/_sources"
EXPORT_DIR = Path(__file__).resolve().parents[1] / "kvpack" / "models" / "reference"
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MODEL_SHAPE = dict(
    hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
    head_dim=32, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
)
ROPE_THETA = 100_000.0
# (first step, sequence length, batch size, mix weights: plain, repeat, retrieval, synthetic)
PHASES = [
    (0, 256, 16, (0.15, 0.35, 0.30, 0.20)),
    (2000, 512, 8, (0.15, 0.35, 0.40, 0.10)),
    (3000, 1024, 4, (0.15, 0.30, 0.50, 0.05)),
    (3800, 2048, 2, (0.15, 0.30, 0.55, 0.00)),
    (4400, 4096, 1, (0.15, 0.30, 0.55, 0.00)),
    # consolidation: every step draws its length from MIXED_LENGTHS (batch = 4096 tokens / length)
    (5000, 0, 0, (0.15, 0.30, 0.55, 0.00)),
]
MIXED_LENGTHS = (1024, 2048, 4096)
TOTAL_STEPS = 6000


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


# ----------------------------------------------------------------------------------------------- data
def read_corpus(corpus_dir: str) -> tuple[list[str], list[str]]:
    """Return (train documents, held-out documents); every tenth file by path hash is held out."""
    root = Path(corpus_dir)
    files = sorted(root.rglob("*.txt"))
    if not files:
        sys.exit(f"no corpus under {corpus_dir}: run `apt-get install python3.11-doc` or pass --corpus")
    train, held = [], []
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        text = "\n".join(line.rstrip() for line in text.splitlines())
        while "\n\n\n" in text:
            text = text.replace("\n\n\n", "\n\n")
        rel = str(f.relative_to(root))
        (held if is_held_out(rel) else train).append(text)
    return train, held


def is_held_out(relative_path: str) -> bool:
    return int(hashlib.sha1(relative_path.encode()).hexdigest(), 16) % 10 == 0


def train_tokenizer(docs: list[str], out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|end|>", pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.model_max_length = MODEL_SHAPE["max_position_embeddings"]
    fast.save_pretrained(out_dir)
    fast.model_max_length = 10**9  # the corpus is encoded in one piece
    return fast


class Episodes:
    """Builds training and evaluation sequences of exactly ``seq_len`` tokens."""

    def __init__(self, tokenizer, docs: list[str], rng: random.Random):
        self.tok = tokenizer
        self.rng = rng
        self.enc = lambda s: tokenizer.encode(s, add_special_tokens=False)
        ids = []
        for d in docs:
            ids.extend(self.enc(d))
            ids.append(tokenizer.convert_tokens_to_ids("<|end|>"))
        self.stream = np.asarray(ids, dtype=np.int64)
        # a boundary is a token index right after a token that ends a sentence or a line
        ends = np.zeros(len(tokenizer), dtype=bool)
        for tid in range(len(tokenizer)):
            s = tokenizer.decode([tid])
            ends[tid] = s.endswith((".\n", ". ", "\n", ".")) or s.endswith("?")
        self.boundary = np.flatnonzero(ends[self.stream]) + 1
        sp = lambda t: tokenizer.convert_tokens_to_ids(t)
        self.bos, self.end, self.user, self.asst = sp("<|bos|>"), sp("<|end|>"), sp("<|user|>"), sp("<|assistant|>")
        self.nl, self.nl2 = self.enc("\n"), self.enc("\n\n")
        self.n_regular = len(tokenizer) - len(SPECIAL_TOKENS)

    def window(self, n: int) -> list[int]:
        """n corpus tokens starting at a sentence boundary."""
        starts = self.boundary[self.boundary < len(self.stream) - n]
        s = int(starts[self.rng.randrange(len(starts))])
        return self.stream[s : s + n].tolist()

    def user_prefix(self) -> list[int]:
        return [self.bos, self.user] + self.nl

    def turn_end(self) -> list[int]:
        return [self.end] + self.nl

    def assistant_header(self) -> list[int]:
        return [self.asst] + self.nl

    def plain(self, T: int):
        ids = [self.bos] + self.window(T - 1)
        return ids, [1.0] * T

    def synthetic(self, T: int):
        """Random tokens, a separator, the same tokens again (pure induction)."""
        n = (T - 1) // 2
        seq = [self.rng.randrange(self.n_regular) + len(SPECIAL_TOKENS) for _ in range(n)]
        seq = [min(t, len(self.tok) - 1) for t in seq]
        ids = [self.bos] + seq + [self.end] + seq
        ids = (ids + [self.end] * T)[:T]
        w = [0.0] * (n + 2) + [1.0] * (T - n - 2)
        return ids, w

    def repeat(self, T: int):
        """KVzip's reconstruction layout: context, repeat prompt, assistant copies (all or from a point)."""
        tail = self.turn_end()
        if self.rng.random() < 0.5:
            prompt = self.nl2 + self.enc(tasks.REPEAT_PROMPT)
            n = (T - len(self.user_prefix()) - len(prompt) - len(tail) - len(self.assistant_header()) - 2) // 2
            ctx = self.window(n)
            copy = ctx
        else:
            budget = T - len(self.user_prefix()) - len(tail) - len(self.assistant_header()) - 40
            n = (budget * 2) // 3
            ctx = self.window(n)
            m = budget - n
            s = self.rng.randrange(8, n - m) if n - m > 8 else 8
            prompt = self.nl2 + self.enc(tasks.repeat_from_prompt(self.tok.decode(ctx[s - 8 : s])))
            copy = ctx[s : s + m]
        head = self.user_prefix() + ctx + prompt + tail + self.assistant_header()
        ids = head + copy + tail
        w = [1.0] * len(head) + [2.0] * (len(copy) + 1) + [1.0] * (len(tail) - 1)
        return self._fit(ids, w, T)

    def retrieval(self, T: int, n_facts: int | None = None, depths=None, n_questions: int | None = None):
        """Facts planted in a passage, asked after it; answers weighted up."""
        rng = self.rng
        n_facts = n_facts or rng.randint(1, max(1, min(8, T // 128)))
        n_questions = n_questions or rng.randint(1, min(3, n_facts))
        facts, used = [], set()
        for _ in range(n_facts):
            f = tasks.random_fact(rng, used)
            used.add(f.name)
            facts.append(f)
        asked = rng.sample(facts, n_questions)
        qa = []
        for i, f in enumerate(asked):
            q = (self.nl2 if i == 0 else self.user_prefix()[1:]) + self.enc(tasks.fact_question(f))
            qa.append((q + self.turn_end() + self.assistant_header(), self.enc(tasks.fact_answer(f)) + self.turn_end()))
        fact_ids = [self.enc(" " + tasks.fact_sentence(f)) for f in facts]
        overhead = len(self.user_prefix()) + sum(len(a) + len(b) for a, b in qa) + sum(map(len, fact_ids))
        n = T - overhead
        ctx = self.window(max(n, 8))
        depths = depths or [rng.random() for _ in facts]
        local = [b for b in range(1, len(ctx)) if self._is_boundary(ctx[b - 1])] or [0]
        cuts = sorted((min(local, key=lambda c: abs(c - d * len(ctx))), i) for i, d in enumerate(depths))
        passage, last = [], 0
        for c, i in cuts:
            passage += ctx[last:c] + fact_ids[i]
            last = c
        passage += ctx[last:]
        ids = self.user_prefix() + passage
        w = [1.0] * len(ids)
        for q, a in qa:
            ids += q + a
            w += [1.0] * len(q) + [5.0] * len(a)
        return self._fit(ids, w, T)

    def _is_boundary(self, tid: int) -> bool:
        s = self.tok.decode([tid])
        return s.endswith((".", "\n", "?"))

    def _fit(self, ids, w, T):
        if len(ids) >= T:
            return ids[-T:] if len(ids) > T else ids, w[-T:]
        pad = T - len(ids)
        return ids + [self.end] * pad, w + [0.0] * pad

    def batch(self, T: int, B: int, mix):
        kinds = [self.plain, self.repeat, self.retrieval, self.synthetic]
        rows, weights = [], []
        for _ in range(B):
            fn = self.rng.choices(kinds, weights=mix)[0]
            ids, w = fn(T)
            rows.append(ids[:T])
            weights.append(w[:T])
        return torch.tensor(rows), torch.tensor(weights, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------- model
def build_model(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        **MODEL_SHAPE,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def phase_at(step: int):
    current = PHASES[0]
    for p in PHASES:
        if step >= p[0]:
            current = p
    return current


def lr_at(step: int, peak: float, total: int, warmup: int = 50) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


@torch.no_grad()
def eval_retrieval(model, tokenizer, docs: list[str], length: int, trials: int, seed: int = 1234) -> float:
    """Greedy retrieval accuracy at ``length`` tokens on held-out text (single fact, depths spread 0-100%)."""
    from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()
    ep = Episodes.__new__(Episodes)
    ep_rng = random.Random(seed)
    model.eval()
    hits = 0
    for t in range(trials):
        depth = t / max(1, trials - 1)
        fact = tasks.random_fact(ep_rng)
        prompt_ids = retrieval_prompt(tokenizer, docs, fact, depth, length, ep_rng)
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=tasks.ANSWER_MAX_NEW_TOKENS, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        answer = tokenizer.decode(out[0, len(prompt_ids):], skip_special_tokens=True)
        hits += tasks.answer_matches(answer, fact)
    model.train()
    del ep
    return hits / trials


def retrieval_prompt(tokenizer, docs, fact, depth, length, rng) -> list[int]:
    """A held-out passage of about ``length`` tokens with ``fact`` at ``depth``, and its question, as a chat."""
    text = "\n\n".join(docs)
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)
    approx_chars = int(length * 3.2)
    start = rng.randrange(0, max(1, len(text) - approx_chars * 2))
    passage = text[start : start + approx_chars * 2]
    ids = enc(passage)[: max(16, length - 40)]
    passage = tokenizer.decode(ids)
    passage = tasks.plant_facts(passage, [fact], [depth])
    msgs = [{"role": "user", "content": passage + "\n\n" + tasks.fact_question(fact)}]
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=os.path.expanduser("~/.cache/kvpack-train"))
    ap.add_argument("--corpus", default=CORPUS_DIR)
    ap.add_argument("--steps", type=int, default=TOTAL_STEPS)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--ckpt-every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--export", action="store_true", help="write the latest checkpoint to --export-dir")
    ap.add_argument("--export-dir", default=str(EXPORT_DIR), help="where the final weights go (default: the package)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    tok_dir = work / "tokenizer"

    train_docs, held_docs = read_corpus(args.corpus)
    from transformers import AutoTokenizer

    if (tok_dir / "tokenizer.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(tok_dir, model_max_length=10**9)
    else:
        log(f"training tokenizer on {len(train_docs)} documents")
        tokenizer = train_tokenizer(train_docs, tok_dir)
    model = build_model(tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    ckpt = work / "checkpoint.pt"
    step, wall = 0, 0.0
    rng = random.Random(args.seed)
    history = []
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)  # our own checkpoint file, never one received from elsewhere
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, wall, history = state["step"], state["wall"], state["history"]
        rng.setstate(state["rng"])
        log(f"resumed at step {step} ({wall / 60:.1f} min trained)")

    if args.export:
        export(model, tokenizer, work, history, n_params, step, wall, args)
        return

    episodes = Episodes(tokenizer, train_docs, rng)
    log(f"model {n_params / 1e6:.2f}M params; corpus {len(episodes.stream)} train tokens")
    model.train()
    t_last = time.time()
    while step < args.steps:
        _, T, B, mix = phase_at(step)
        if T == 0:
            T = rng.choice(MIXED_LENGTHS)
            B = MIXED_LENGTHS[-1] // T
        ids, w = episodes.batch(T, B, mix)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.lr, args.steps)
        logits = model(input_ids=ids).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="none")
        wt = w[:, 1:].reshape(-1)
        loss = (nll * wt).sum() / wt.sum().clamp_min(1.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        now = time.time()
        wall += now - t_last
        t_last = now
        if step % 10 == 0:
            log(f"step {step} T={T} B={B} loss {loss.item():.3f} lr {lr_at(step, args.lr, args.steps):.2e} ({wall / 60:.1f} min)")
        if step % args.eval_every == 0 or step == args.steps:
            lengths = {2048, 4096} if phase_at(step)[1] == 0 else {T, min(4096, 2 * T)}
            accs = {L: eval_retrieval(model, tokenizer, held_docs, L, 20) for L in sorted(lengths)}
            history.append({"step": step, "T": T, "loss": round(loss.item(), 4), "minutes": round(wall / 60, 1),
                            "retrieval": {str(k): v for k, v in accs.items()}})
            log(f"eval step {step}: retrieval {accs}")
            t_last = time.time()
        if step % args.ckpt_every == 0 or step == args.steps:
            tmp = work / "checkpoint.pt.tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "wall": wall,
                        "history": history, "rng": rng.getstate()}, tmp)
            os.replace(tmp, ckpt)
    log("training done")
    export(model, tokenizer, work, history, n_params, step, wall, args)


def export(model, tokenizer, work: Path, history, n_params, step, wall, args) -> None:
    out = Path(args.export_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.config._attn_implementation = "sdpa"
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    info = {"steps": step, "train_minutes": round(wall / 60, 1), "params": n_params, "seed": args.seed,
            "lr": args.lr, "history": history, "phases": PHASES}
    (out / "training_log.json").write_text(json.dumps(info, indent=1) + "\n")
    log(f"exported to {out}")


if __name__ == "__main__":
    main()
