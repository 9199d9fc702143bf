"""Every compression method's parameters, once: typed dataclass fields with their defaults, checks and help.

A method's parameters are the fields of its ``...Params`` dataclass here; the method itself (``kvpack.methods.d2o``
and its neighbours: the scoring, which needs torch) inherits them. Everything that only needs to know a method's
parameters reads this module, which imports neither torch nor the methods:

- ``kvpack build``'s method options (``--sink``, ``--score``, ...) are made from the fields declared with
  ``option(...)`` (``command_line_options``; the flag is ``--`` + the field name with ``-`` for ``_``, unless
  ``option`` names another);
- ``kvpack bench --methods NAME[key=value;...]`` takes every parameter by its field name, each value read as the
  field's type (``parse_value``);
- ``kvpack ls`` names the parameters that differ from the defaults, and a build completes an older pack's recorded
  parameters with them.

So a new option is one field: ``window: int = option(64, "observation window in tokens", low=0)`` makes the
parameter, its default, the ``--window`` flag and its help, and ``NAME[window=...]``; its check goes in the class's
``__post_init__`` (a bad value raises ``InputError`` naming the method and the parameter). A field declared without
``option`` (``chunk_size = 2048``) is a parameter of the API and of ``--methods`` specs, not a ``build`` flag.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from ..errors import InputError

__all__ = ["Option", "option", "MethodParams", "PARAMS", "CommandLineOption", "command_line_options",
           "parameter_types", "parse_value", "SCOPES", "SCORINGS", "MERGE_MODES", "SELECTIONS",
           "UNFITTED_SELECTIONS", "VALUE_MODES",
           "REFERENCES", "SHIFTS", "RIDGE_TARGETS", "FIT_WEIGHTS", "BUDGETS", "SCORE_QUERIES", "MAX_QUERIES",
           "REFINE_MOVES", "REFINE_LR", "REFINE_QUERIES", "SELECT_QUERIES", "QUERY_SAMPLES",
           "check_int", "check_float", "check_choice", "check_bool"]

#: The top-k scopes of ``Method.select`` (``budget``): one top-k over everything, per layer, per KV head.
SCOPES = ("global", "layer", "head")
#: KVzip's scoring variants (``scoring``): ``attention`` (the paper's) and ``plus`` (KVzip+, ``kvzip_plus``).
SCORINGS = ("attention", "plus")
#: What D2O's merge changes (``merge``): keys and values (the paper's), values only, or nothing (eviction alone).
MERGE_MODES = ("keys+values", "values", "off")
#: Attention Matching's within-head selections (``selection``) and value modes (``values``).
SELECTIONS = ("kvzip", "rms", "kvzip+rms", "omp")
#: What a KV head that Attention Matching leaves unfitted keeps, with a ``selection`` other than ``kvzip``
#: (``unfitted_selection``): KVzip's top entries within its budget, or the entries ``selection`` chose (``same``).
UNFITTED_SELECTIONS = ("kvzip", "same")
VALUE_MODES = ("fit", "copy", "merge")
#: Sources of Attention Matching's reference queries (``reference``): KVzip's repeat pass, sampled
#: self-continuations, both of those, the model's answers to self-study prompts about the context
#: (``kvpack.methods.am_selfstudy``), self-study pooled with the repeat pass (the paper's ``ss-plus-repeat``), the
#: context's own prefill queries (the paper's ``context-prefill``, ``kvpack.methods.am_prefill``), or those pooled
#: with the repeat pass's.
REFERENCES = ("repeat", "continue", "both", "self-study", "self-study+repeat", "prefill", "prefill+repeat")
#: Attention Matching's per-head budget splits (``budgets``; ``kvpack.methods.budgets``): KVzip's global top-k,
#: the same with a per-head cap (``max_head_ratio``), an even split, or a per-model schedule file.
BUDGETS = ("global", "global-capped", "uniform", "schedule")
#: Whose queries score the context entries for Attention Matching's budget split and kept keys (``score_queries``):
#: KVzip's repeat pass, or the reference queries (``reference``), by KVzip's rule (each entry's largest attention).
SCORE_QUERIES = ("repeat", "reference")
#: Most reference queries per KV head (the paper fits with up to 50,000).
MAX_QUERIES = 50_000
#: Most ``--refine-steps`` (Attention Matching's gradient refinement).
MAX_REFINE_STEPS = 10_000
#: Widest ``select_pool`` window (tokens).
MAX_SELECT_POOL = 255
#: What the refinement moves (``refine_move``; ``kvpack.methods.am_refine``): the kept keys alone (the biases and
#: values stay the closed form's), or the keys, biases and values together.
REFINE_MOVES = ("keys", "keys+beta+values")
#: The refinement's Adam step before ``refine_lr`` existed (issue 28's thirty-first session), in units of the kept
#: keys' and values' RMS (logits for beta).
REFINE_LR = 0.005
#: Which reference queries the refinement fits (``refine_queries``): those at positions within the model's position
#: window (``max_position_embeddings``; KVzip's repeat pass is fed after the whole context, so on a context near the
#: window most of its queries sit past it), or all of them.
REFINE_QUERIES = ("in-window", "all")
#: Which reference queries the RMS selection averages over (``select_queries``): the fit's (``queries`` per KV
#: head, a subsample of the recorded ones on long contexts), or every recorded query but the held-out ones.
SELECT_QUERIES = ("fit", "all")
#: How the reference queries are subsampled to ``queries`` per KV head (``query_sample``): uniformly over the rows
#: (each row one query head's query at one position), or a row of every query position first (the heads of a GQA
#: group ask at the same positions).
QUERY_SAMPLES = ("uniform", "per-position")
#: Largest self-study sampling temperature accepted (above it the answers are noise) and largest seed (the
#: generators' seeds, ``seed * 1,000,003 + prompt``, stay within a 64-bit integer).
MAX_TEMPERATURE, MAX_SEED = 100.0, 2**32 - 1
#: Most self-study answers sampled per prompt (``self_study_samples``): each is one more row of every decode step.
MAX_SAMPLES = 64
#: Per-query shifts of Attention Matching's mass matching (``shift``; ``am_fit``'s module docstring).
SHIFTS = ("lse", "max")
#: What Attention Matching's values ridge shrinks them toward (``ridge_to``): zero (a plain ridge) or the selected
#: entries' own values.
RIDGE_TARGETS = ("zero", "selected")
#: How Attention Matching weighs its reference queries in the fit (``weights``; ``am_fit.fit_head``): alike (the
#: paper's), or by the share of each query's attention that falls on the context rather than the attention sink.
FIT_WEIGHTS = ("uniform", "share")


# ---------------------------------------------------------------------------------------------------------------
# declaring a parameter


@dataclass(frozen=True)
class Option:
    """How a method parameter appears as a ``kvpack build`` option.

    Attributes:
        help: what the parameter does, for ``build --help`` (the default is added there).
        flag: the option's name [default: ``--`` + the field name, ``_`` written ``-``].
        choices: the values the argument parser accepts (``click.Choice``); the method's own check may take fewer.
        low, high: bounds the argument parser enforces (exit status 2); bounds left to the method's
            ``__post_init__`` give its ``InputError`` (exit status 1) instead.
        metavar: the value's placeholder in the help (``FILE``, ``TEXT``).
    """

    help: str
    flag: str | None = None
    choices: tuple[str, ...] | None = None
    low: float | None = None
    high: float | None = None
    metavar: str | None = None


def option(default: Any, help: str, **how) -> Any:
    """A dataclass field holding a method parameter that is also a ``kvpack build`` option: ``default`` is the
    parameter's default, ``help`` and ``how`` (``flag``, ``choices``, ``low``, ``high``, ``metavar``) as
    ``Option``. Use it as the field's default: ``sink: int = option(4, "attention-sink tokens ...", low=0)``."""
    return field(default=default, metadata={"option": Option(help, **how)})


@dataclass
class MethodParams:
    """Base of the parameter classes: the fields of a subclass are a method's parameters.

    Class attributes:
        name: the method's registry name (``--method``).
        scopes: the values the method's ``budget`` field may take; empty when it has no ``budget`` field.
    """

    name: ClassVar[str] = ""
    scopes: ClassVar[tuple[str, ...]] = ()
    #: ``{parameter: value}`` a pack recorded before that parameter existed was built with, where that is not the
    #: parameter's default (a default changed with the parameter's arrival); ``recorded_defaults`` reads it.
    absent_means: ClassVar[dict[str, Any]] = {}

    def __post_init__(self):
        if self.scopes:
            check_choice(self.name, "budget", getattr(self, "budget", None), self.scopes)

    @classmethod
    def parameter_names(cls) -> tuple[str, ...]:
        """The method's parameters (its dataclass fields that ``__init__`` takes), in declaration order."""
        return tuple(f.name for f in fields(cls) if f.init)

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """``{parameter: default}`` of every parameter, read from the fields: nothing is instantiated."""
        return {f.name: f.default for f in fields(cls) if f.init and f.default is not dataclasses.MISSING}

    @classmethod
    def recorded_defaults(cls) -> dict[str, Any]:
        """What a pack that does not record a parameter was built with: the defaults, except ``absent_means``
        (a parameter whose default is not what packs from before it did)."""
        return {**cls.defaults(), **cls.absent_means}

    @classmethod
    def inert(cls, params: dict) -> dict[str, str]:
        """``{parameter: why}`` for the parameters that change nothing given the others' values in ``params`` (a
        complete ``{parameter: value}``, e.g. ``{"budgets": "global", "max_head_ratio": 0.9, ...}`` for ``am``,
        whose cap applies only to capped splits). Values may come from an untrusted header: only compared, never
        looked up. None by default. Raises nothing."""
        return {}

    @classmethod
    def canonical(cls, params: Any) -> Any:
        """``params`` (a complete ``{parameter: value}``) with every ``inert`` parameter at its default, so two
        builds that differ only there compare equal (``kvpack build``'s up-to-date check) and show alike
        (``kvpack info``, ``ls``). Anything but a dict is returned as given. Raises nothing."""
        if not isinstance(params, dict):
            return params
        inert, defaults = cls.inert(params), cls.defaults()
        return {k: defaults[k] if k in inert and k in defaults else v for k, v in params.items()}

    @classmethod
    def build_notes(cls, params: dict, stats: dict) -> list[str]:
        """Notes for the user about one pack just built with ``params`` (``Method.params()``), from its
        ``metadata["stats"]`` (``kvpack build`` prints them under its table): what the method did not do as asked.
        None by default. Raises nothing."""
        return []

    def params(self) -> dict:
        """The method's parameters as stored in the pack's metadata."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}


def _budget(choices: tuple[str, ...] = SCOPES) -> Any:
    return option("head", "scope of the top-k; global gives heads non-uniform budgets", choices=choices)


# ---------------------------------------------------------------------------------------------------------------
# the methods' parameters (the methods themselves: kvpack.methods.<name>)


@dataclass
class KVzipParams(MethodParams):
    """``kvzip`` (``kvpack.methods.kvzip.KVzip``)."""

    name: ClassVar[str] = "kvzip"
    chunk_size: int = 2048  # build's --chunk-size, a build setting
    tail_tokens: int = 8
    scoring: str = option("attention", "attention (the paper's) or plus (KVzip+: each probability weighted by the "
                                       "entry's output norm relative to the query's hidden state, as kvpress's "
                                       "KVzipPress)", flag="--score", choices=SCORINGS)
    max_head_ratio: float = option(1.0, "most of a KV head's own context entries its global top-k may keep (the "
                                        "surplus goes to the other heads by score); 1: no cap (the paper's)",
                                   low=0.0, high=1.0)

    def __post_init__(self):
        super().__post_init__()
        check_int(self.name, "chunk_size", self.chunk_size, 1)
        check_float(self.name, "max_head_ratio", self.max_head_ratio, 0.0, 1.0, low_open=True)
        self.max_head_ratio = float(self.max_head_ratio)
        check_int(self.name, "tail_tokens", self.tail_tokens, 0)
        check_choice(self.name, "scoring", self.scoring, SCORINGS)


@dataclass
class KVzipHeadParams(MethodParams):
    """``kvzip-head`` (``kvpack.methods.kvzip_head.KVzipHead``, which also requires ``heads``)."""

    name: ClassVar[str] = "kvzip-head"
    heads: str | None = option(None, "the model's head scores (made once by `kvpack heads`); required",
                               metavar="FILE")
    window: int = option(0, "recent context tokens also kept in dropped heads", low=0)

    def __post_init__(self):
        super().__post_init__()
        if self.heads is not None:
            if not isinstance(self.heads, (str, Path)):
                raise InputError(f"kvzip-head: heads must be a file path, got {self.heads!r}")
            self.heads = str(self.heads)
        check_int(self.name, "window", self.window, 0)


@dataclass
class AttentionMatchingParams(KVzipParams):
    """``am`` (``kvpack.methods.am.AttentionMatching``); KVzip's parameters drive its selection."""

    name: ClassVar[str] = "am"
    absent_means: ClassVar[dict[str, Any]] = {"budgets": "global", "max_head_ratio": 1.0, "recent": 0,
                                               "value_bound": 0.0, "weights": "uniform",
                                               "ridge_search": False, "score_queries": "repeat",
                                               # the defaults until issue 28's twenty-sixth session
                                               "selection": "kvzip", "reference": "repeat", "queries": 4096,
                                               "queries_per_entry": 2.0, "self_study_tokens": 64,
                                               # the defaults until issue 28's twenty-ninth session
                                               "self_study_temperature": 0.0, "self_study_samples": 1,
                                               # no refinement before issue 28's thirty-first session
                                               "refine_steps": 0,
                                               # no floor before issue 28's thirty-second session
                                               "head_floor": 0.0, "unfitted_selection": "same",
                                               # the refinement moved everything before issue 28's 34th session
                                               "refine_move": "keys+beta+values", "refine_lr": REFINE_LR,
                                               "refine_batch": 1024,
                                               # past-the-window queries refined on before the 35th session
                                               "refine_queries": "all",
                                               # the fit's queries alone before issue 28's 36th session
                                               "select_queries": "fit", "query_sample": "uniform",
                                               # no pooling before issue 28's fortieth session
                                               "select_pool": 1}
    max_head_ratio: float = option(0.75, "most of a KV head's own context entries it may keep with --budgets "
                                         "global-capped or schedule (the paper's --max-ratio-per-head)",
                                   low=0.0, high=1.0)
    budgets: str = option("global", "how --ratio is split over (layer, KV head): KVzip's global top-k, the same "
                                    "capped at --max-head-ratio (the paper's), an even split, or a --schedule "
                                    "file's fractions (capped)", choices=BUDGETS)
    # KVzip's global top-k sends most of a small budget to a few broad heads; a floor for every head lowered AM's
    # keep-0.05 loss on fourteen fresh SmolLM2 passages from 4.31x to 1.53x KVzip's keep-0.1 loss (BENCHMARKS.md,
    # "Issue 28, thirty-second session"); packs from before it read as 0
    head_floor: float = option(0.25, "share of the even per-head budget every head keeps first (its recent tokens "
                                     "included) before --budgets global or global-capped splits the rest by score "
                                     "(0: none; Ada-KV's safeguard, arXiv 2407.11550; not in the AM paper)",
                               low=0.0, high=1.0)
    schedule: str | None = option(None, "per-(layer, KV head) budget fractions for --budgets schedule (a "
                                        "kvpack.schedule safetensors file of this model)", metavar="FILE")
    score_queries: str = option("repeat", "whose queries score the context entries for the split over heads and "
                                          "the kept keys: KVzip's repeat pass, or the --reference queries (each "
                                          "entry's largest attention over them, KVzip's rule; with --reference "
                                          "continue the repeat pass is skipped)", choices=SCORE_QUERIES)
    recent: int = option(16, "last context tokens every head keeps (counted in its budget; not in the paper)",
                         low=0)
    selection: str = option("rms", "keys kept within a head: KVzip's score, RMS attention over the reference "
                                     "queries, half of each (kvzip+rms), or OMP (greedy mass matching; slower)",
                            flag="--select",
                            choices=SELECTIONS)
    select_queries: str = option("fit", "which reference queries --select rms (and kvzip+rms) averages over: the "
                                        "fit's --queries, or every recorded query but the held-out ones; the two "
                                        "differ only where the sources record more than --queries rows per KV head "
                                        "(the repeat pass records a GQA group's heads x the context's tokens), and "
                                        "all then attends the extra rows too",
                                 choices=SELECT_QUERIES)
    select_pool: int = option(1, "width in tokens (odd) of a max-pool over each head's selection scores along the "
                                 "context before --select rms or kvzip+rms picks its top entries, so a kept "
                                 "entry's neighbours rank with it and short spans (a number, a name) are kept "
                                 "whole (1: none; SnapKV's pooling, arXiv 2404.14469 §4, Listing 1, with max as its "
                                 "code's option; kvpack's for AM)", low=1, high=MAX_SELECT_POOL)
    unfitted_selection: str = option("same", "which entries a KV head keeps when it is left unfitted (it keeps "
                                             "more entries than its fit queries divided by --queries-per-entry): "
                                             "those --select chose (same), or KVzip's top-scored ones (kvzip), since "
                                             "the head is used as it is, as in KVzip; only with --select other than "
                                             "kvzip, --values fit and no --on-policy (kvpack's; the paper fits "
                                             "every head)", choices=UNFITTED_SELECTIONS)
    values: str = option("fit", "kept values fitted by least squares, copied, or D2O-merged", choices=VALUE_MODES)
    queries: int = option(8192, "reference queries per KV head", low=16, high=MAX_QUERIES)
    query_sample: str = option("uniform", "how the recorded reference queries are subsampled to --queries: uniformly "
                                          "over the rows, or one row (one head of the GQA group) of every query "
                                          "position first, then a second, and so on",
                               choices=QUERY_SAMPLES)
    queries_per_entry: float = option(8.0, "a KV head is fitted only where its fit queries (--queries less the "
                                            "held-out ones) number at least this many times its kept entries; "
                                            "other heads keep their selected entries as they are and show as "
                                            "unfitted in kvpack info (kvpack's guard: with few queries per entry "
                                            "least squares fits noise; the paper fits every head), 1 to 1e6",
                                      low=1.0, high=1e6)
    on_policy: bool = option(False, "recompute each layer's queries with the earlier layers compacted")
    # a head whose fit does worse than KVzip's own entries on held-out queries keeps KVzip's (the paper always fits):
    # on SmolLM2 at keep 0.1 the always-fit default answered a planted-fact question with an empty string, the
    # checked fits with the fact (BENCHMARKS.md, "Attention Matching on SmolLM2: the held-out check")
    held_out_check: bool = True
    shift: str = "lse"
    reference: str = option("self-study+repeat", "reference queries from KVzip's repeat pass, from 512 tokens the model "
                                      "samples after the context (slower: a decode step each), both, the "
                                      "model's answers to self-study prompts about the context, "
                                      "self-study+repeat, the context's own prefill queries (free), or "
                                      "prefill+repeat", choices=REFERENCES)
    continue_tokens: int = 512
    self_study_tokens: int = option(16, "answer tokens per self-study prompt at most (one decode step each; the "
                                        "paper's answers run to 2,048)", low=1)
    self_study_temperature: float = option(0.7, "self-study answers sampled at this temperature with top-k 20 and "
                                                "top-p 0.8, as the paper's code samples them (0.7 is its); 0: greedy",
                                           low=0.0, high=MAX_TEMPERATURE)
    self_study_seed: int = option(0, "seed of sampled self-study answers", low=0, high=MAX_SEED)
    self_study_samples: int = option(2, "answers sampled per self-study prompt (the paper samples many "
                                        "conversations per context); each prompt is computed once for all of them; "
                                        "greedy answers (--self-study-temperature 0) are one per prompt",
                                     low=1, high=MAX_SAMPLES)
    # least squares fitted to the reference queries can extrapolate far beyond the data, which other queries then
    # read: on a held-out SmolLM2 passage at keep 0.1 the unbounded fit lost +1.05 nats/token against KVzip's +0.14
    # (BENCHMARKS.md, "Issue 28, fifteenth session"); packs built before the bound read as value_bound=0
    value_bound: float = option(2.0, "a head whose fitted values leave this many times the largest |value| of its "
                                     "own context keeps its selected entries as they are (0: no bound; not in the "
                                     "paper)", low=0.0)
    ridge: float = option(0.0, "ridge of the values' least squares, as a share of the mean diagonal of the normal "
                               "equations (e.g. 0.001); 0 is the paper's plain least squares", low=0.0, high=1.0)
    ridge_to: str = option("zero", "what --ridge shrinks the fitted values toward: zero, or the kept entries' own "
                                   "values (the larger the ridge, the closer to --values copy)",
                           choices=RIDGE_TARGETS)
    ridge_search: bool = option(True, "per head, keep whichever of the selection as it is, the fitted biases "
                                       "with copied values, or a least-squares fit with a ridge (0 to 1) does best "
                                       "on the context's last 256 tokens' own queries (replaces --value-bound and "
                                       "the held-out check; not in the paper)")
    # 30 steps of the keys alone lowered AM's continuation loss by 17-38% on eight fresh SmolLM2 passages for 5% more
    # build time (BENCHMARKS.md, "Issue 28, thirty-fourth session"); packs from before read as 0
    refine_steps: int = option(30, "Adam steps that move each fitted head's kept keys (and with --refine-move "
                                  "keys+beta+values its biases and values) toward the full context's output on "
                                  "the reference queries, kept only where "
                                  "the validation queries agree (0: the closed form alone; kvpack's, not the "
                                  "paper's)", low=0, high=MAX_REFINE_STEPS)
    refine_batch: int = option(512, "reference queries per --refine-steps step, a fresh slice of a fixed "
                                  "permutation each step (0: all of them every step)", low=0, high=MAX_QUERIES)
    # moving the keys alone, at twice the step and half the batch, continued better than moving all three on eight
    # fresh SmolLM2 passages (BENCHMARKS.md, "Issue 28, thirty-fourth session"); packs from before read as the old
    refine_move: str = option("keys", "what --refine-steps moves: the kept keys alone (the biases and values stay "
                                      "the closed form's), or the keys, biases and values together",
                              choices=REFINE_MOVES)
    refine_lr: float = option(0.01, "Adam's step of --refine-steps, in units of the kept keys' (and values') RMS",
                              low=1e-6, high=1.0)
    # SmolLM2 at 7,680 tokens, where 3/4 of the repeat pass's queries sit past its 8,192 positions: refining on them
    # doubled AM's keep-0.1 loss (BENCHMARKS.md, "Issue 28, thirty-fifth session"); packs from before read as all
    refine_queries: str = option("in-window", "which reference queries --refine-steps fits: those at positions "
                                              "within the model's window (max_position_embeddings), a head refined "
                                              "only with --queries-per-entry of them per kept entry, or all",
                                 choices=REFINE_QUERIES)
    weights: str = option("uniform", "how the fit weighs each reference query: alike (the paper's), or by the share "
                                     "of its attention on the context rather than the attention sink (kvpack's)",
                          flag="--fit-weights", choices=FIT_WEIGHTS)

    @classmethod
    def inert(cls, params: dict) -> dict[str, str]:
        """The cap outside capped splits; the floor outside global splits; ``select_queries`` outside the RMS
        selections; ``unfitted_selection`` under KVzip's
        selection, unfitted values or on-policy queries; the fit's guards and ridge under the ridge search (which
        chooses among its own fits); the self-study settings without self-study queries (the seed and count with
        greedy answers); the sampled continuation's length without it (``AttentionMatching``'s docstring says where
        each is read)."""
        out = {}
        if params.get("budgets") not in ("global-capped", "schedule"):
            out["max_head_ratio"] = "it caps only --budgets global-capped and schedule"
        if params.get("budgets") not in ("global", "global-capped"):
            out["head_floor"] = "it applies only to --budgets global and global-capped"
        if params.get("selection") not in ("rms", "kvzip+rms"):
            out["select_queries"] = "it applies only to --select rms and kvzip+rms"
            out["select_pool"] = "it applies only to --select rms and kvzip+rms"
        if params.get("selection") == "kvzip" or params.get("values") != "fit" or params.get("on_policy") is True:
            out["unfitted_selection"] = ("it applies only where --select is not kvzip and --values fit leaves some "
                                         "heads unfitted, off-policy")
        if params.get("ridge_search") is True and params.get("values") == "fit":
            for k in ("value_bound", "held_out_check", "ridge", "ridge_to"):
                out[k] = "--ridge-search chooses each head's fit on validation queries instead"
        if params.get("refine_steps") and not (params.get("ridge_search") is True and params.get("values") == "fit"):
            why = ("it refines the candidate --ridge-search chooses, kept only where the validation queries agree: "
                   "it needs --ridge-search and --values fit")
            out["refine_steps"] = out["refine_batch"] = why
            out["refine_move"] = out["refine_lr"] = out["refine_queries"] = why
        elif not params.get("refine_steps"):
            out["refine_batch"] = out["refine_move"] = out["refine_lr"] = out["refine_queries"] = \
                "it applies only to --refine-steps"
        if params.get("reference") not in ("self-study", "self-study+repeat"):
            for k in ("self_study_tokens", "self_study_temperature", "self_study_seed", "self_study_samples"):
                out[k] = "it applies only to --reference self-study and self-study+repeat"
        elif params.get("self_study_temperature") == 0:
            out["self_study_seed"] = "greedy self-study answers (--self-study-temperature 0) draw nothing"
            out["self_study_samples"] = "greedy self-study answers (--self-study-temperature 0) are one per prompt"
        if params.get("reference") not in ("continue", "both"):
            out["continue_tokens"] = "it applies only to --reference continue and both"
        return out

    @classmethod
    def build_notes(cls, params: dict, stats: dict) -> list[str]:
        """One note when fewer than half the KV heads were fitted (``stats["fit"]["heads_unfitted"]`` of the
        compressed layers x KV heads, ``context_entries / context_tokens``): the others keep their selected entries
        as they are, as on long contexts at keep 0.3, where most heads keep more entries than ``queries /
        queries_per_entry``."""
        fit = stats.get("fit") if isinstance(stats, dict) else None
        entries, tokens = (stats.get("context_entries"), stats.get("context_tokens")) if fit else (None, None)
        if not isinstance(fit, dict) or not isinstance(entries, int) or not isinstance(tokens, int) or tokens < 1:
            return []
        heads = entries // tokens
        unfitted = fit.get("heads_unfitted")
        if not heads or not isinstance(unfitted, int) or 2 * unfitted <= heads:
            return []
        asked, per_entry = params.get("queries"), params.get("queries_per_entry")
        n_fit, held = fit.get("queries"), fit.get("held_out")
        limit = ""
        if all(type(x) is int for x in (asked, n_fit, held)) and isinstance(per_entry, float) and per_entry >= 1:
            limit = (f" (a head is fitted only up to its {n_fit:,} fit queries / --queries-per-entry {per_entry:g} "
                     f"= {int(n_fit // per_entry):,} kept entries; ")
            limit += ("a larger --queries fits more heads, at a cost that grows with it)" if n_fit + held >= asked
                      else f"this context gave fewer reference queries than --queries {asked}, so only a lower "
                           "--queries-per-entry fits more, with fewer queries per entry)")
        return [f"Attention Matching fitted {heads - unfitted} of {heads} KV heads; the other {unfitted} keep their "
                f"selected entries as they are{limit}"]

    def __post_init__(self):
        super().__post_init__()
        check_choice(self.name, "selection", self.selection, SELECTIONS)
        check_choice(self.name, "unfitted_selection", self.unfitted_selection, UNFITTED_SELECTIONS)
        check_choice(self.name, "select_queries", self.select_queries, SELECT_QUERIES)
        check_int(self.name, "select_pool", self.select_pool, 1)
        if self.select_pool % 2 == 0:
            raise InputError(f"am: select_pool (--select-pool) must be an odd number of tokens, so that the window "
                             f"is centred on each entry (1: no pooling; e.g. {self.select_pool - 1} or "
                             f"{self.select_pool + 1}), got {self.select_pool!r}")
        if self.select_pool > MAX_SELECT_POOL:
            raise InputError(f"am: select_pool (--select-pool) must be at most {MAX_SELECT_POOL}, got "
                             f"{self.select_pool!r}")
        check_choice(self.name, "query_sample", self.query_sample, QUERY_SAMPLES)
        check_choice(self.name, "weights", self.weights, FIT_WEIGHTS)
        check_bool(self.name, "ridge_search", self.ridge_search)
        check_int(self.name, "refine_steps", self.refine_steps, 0)
        check_int(self.name, "refine_batch", self.refine_batch, 0)
        if self.refine_steps > MAX_REFINE_STEPS or self.refine_batch > MAX_QUERIES:
            raise InputError(f"am: refine_steps (--refine-steps) must be <= {MAX_REFINE_STEPS} and refine_batch "
                             f"(--refine-batch) <= {MAX_QUERIES}, got {self.refine_steps!r} and {self.refine_batch!r}")
        check_choice(self.name, "refine_move", self.refine_move, REFINE_MOVES)
        check_float(self.name, "refine_lr", self.refine_lr, 1e-6, 1.0)
        check_choice(self.name, "refine_queries", self.refine_queries, REFINE_QUERIES)
        self.refine_lr = float(self.refine_lr)
        check_choice(self.name, "values", self.values, VALUE_MODES)
        check_int(self.name, "queries", self.queries, 16)
        check_float(self.name, "queries_per_entry", self.queries_per_entry, 1.0, 1e6)
        self.queries_per_entry = float(self.queries_per_entry)
        if self.queries > MAX_QUERIES:
            raise InputError(f"am: queries must be an integer <= {MAX_QUERIES}, got {self.queries!r}")
        check_choice(self.name, "budgets", self.budgets, BUDGETS)
        check_choice(self.name, "score_queries", self.score_queries, SCORE_QUERIES)
        check_float(self.name, "head_floor", self.head_floor, 0.0, 1.0)
        self.head_floor = float(self.head_floor)
        check_int(self.name, "recent", self.recent, 0)
        check_int(self.name, "self_study_tokens", self.self_study_tokens, 1)
        check_float(self.name, "self_study_temperature", self.self_study_temperature, 0.0, MAX_TEMPERATURE)
        self.self_study_temperature = float(self.self_study_temperature)
        check_int(self.name, "self_study_seed", self.self_study_seed, 0)
        if self.self_study_seed > MAX_SEED:
            raise InputError(f"am: self_study_seed (--self-study-seed) must be <= {MAX_SEED}, "
                             f"got {self.self_study_seed!r}")
        check_int(self.name, "self_study_samples", self.self_study_samples, 1)
        if self.self_study_samples > MAX_SAMPLES:
            raise InputError(f"am: self_study_samples (--self-study-samples) must be <= {MAX_SAMPLES}, "
                             f"got {self.self_study_samples!r}")
        if self.schedule is not None:
            if not isinstance(self.schedule, (str, Path)):
                raise InputError(f"am: schedule must be a file path, got {self.schedule!r}")
            self.schedule = str(self.schedule)
        if (self.budgets == "schedule") != (self.schedule is not None):
            raise InputError("am: --budgets schedule and --schedule FILE (budgets='schedule' and schedule='FILE' in "
                             f"the API) go together; got budgets={self.budgets!r}, schedule={self.schedule!r}; give "
                             "both, or neither")
        check_bool(self.name, "on_policy", self.on_policy)
        check_bool(self.name, "held_out_check", self.held_out_check)
        check_choice(self.name, "shift", self.shift, SHIFTS)
        check_choice(self.name, "reference", self.reference, REFERENCES)
        check_int(self.name, "continue_tokens", self.continue_tokens, 1)
        check_float(self.name, "value_bound", self.value_bound, 0.0, 1e6)
        self.value_bound = float(self.value_bound)
        check_float(self.name, "ridge", self.ridge, 0.0, 1.0)
        self.ridge = float(self.ridge)
        check_choice(self.name, "ridge_to", self.ridge_to, RIDGE_TARGETS)
        if self.ridge_to != "zero" and self.ridge == 0:
            raise InputError(f"am: --ridge-to {self.ridge_to} (ridge_to={self.ridge_to!r}) shrinks the fitted values "
                             "through the ridge, which is 0; give --ridge too (e.g. --ridge 1)")
        if self.on_policy and self.reference in ("prefill", "prefill+repeat"):
            raise InputError(f"am: --on-policy (on_policy) recomputes the reference queries with the earlier layers "
                             f"compacted, which the prefill's own queries cannot be (they are the prefill's); use it "
                             f"with another --reference than {self.reference} (reference={self.reference!r}), or "
                             "drop --on-policy")


@dataclass
class D2OParams(MethodParams):
    """``d2o`` (``kvpack.methods.d2o.D2O``)."""

    name: ClassVar[str] = "d2o"
    sink: int = option(4, "attention-sink tokens kept at the start of the context", low=0)
    recent_ratio: float = option(0.25, "recent window's share of a head's non-sink budget, M/(N+M) (0.25: N:M=3:1)")
    merge: str = option("keys+values", "what merging evicted entries into their nearest kept one changes: "
                                       "keys+values (the paper's), values only (kept keys stay as prefilled), or off "
                                       "(eviction alone)", choices=MERGE_MODES)
    beta: float = option(0.7, "EMA weight of the merge threshold, in [0, 1]")

    def __post_init__(self):
        super().__post_init__()
        check_int(self.name, "sink", self.sink, 0)
        check_float(self.name, "recent_ratio", self.recent_ratio, 0.0, 1.0)
        if isinstance(self.merge, bool):  # the earlier boolean option
            self.merge = "keys+values" if self.merge else "off"
        check_choice(self.name, "merge", self.merge, MERGE_MODES)
        check_float(self.name, "beta", self.beta, 0.0, 1.0)


@dataclass
class StreamingLLMParams(MethodParams):
    """``streaming`` (``kvpack.methods.streaming.StreamingLLM``)."""

    name: ClassVar[str] = "streaming"
    sink: int = option(4, "attention-sink tokens kept at the start of the context", low=0)

    def __post_init__(self):
        super().__post_init__()
        check_int(self.name, "sink", self.sink, 0)


@dataclass
class H2OParams(MethodParams):
    """``h2o`` (``kvpack.methods.h2o.H2O``)."""

    name: ClassVar[str] = "h2o"
    scopes: ClassVar[tuple[str, ...]] = SCOPES
    budget: str = _budget()


@dataclass
class SnapKVParams(MethodParams):
    """``snapkv`` (``kvpack.methods.snapkv.SnapKV``)."""

    name: ClassVar[str] = "snapkv"
    scopes: ClassVar[tuple[str, ...]] = SCOPES
    window: int = option(64, "observation window in tokens (the context's last ones)", low=0)
    kernel: int = 5
    pooling: str = "avg"
    question: str | None = option(None, "observe this question instead of the context's tail (query-aware)",
                                  metavar="TEXT")
    budget: str = _budget()
    max_head_ratio: float = option(1.0, "with --budget global: most of a KV head's own context entries it may keep "
                                        "(the surplus goes to the other heads by score); 1: no cap",
                                   low=0.0, high=1.0)

    def __post_init__(self):
        super().__post_init__()
        check_int(self.name, "window", self.window, 1)
        check_float(self.name, "max_head_ratio", self.max_head_ratio, 0.0, 1.0, low_open=True)
        self.max_head_ratio = float(self.max_head_ratio)
        check_int(self.name, "kernel", self.kernel, 1)
        if self.kernel % 2 == 0:
            raise InputError(f"{self.name}: kernel must be odd (the pooling keeps the length), got {self.kernel}")
        check_choice(self.name, "pooling", self.pooling, ("avg", "max"))
        if self.question is not None and (not isinstance(self.question, str) or not self.question.strip()):
            raise InputError(f"{self.name}: question must be a non-empty string or None, got {self.question!r}")


@dataclass
class PyramidKVParams(SnapKVParams):
    """``pyramidkv`` (``kvpack.methods.pyramidkv.PyramidKV``): SnapKV's parameters and a pyramid's steepness."""

    name: ClassVar[str] = "pyramidkv"
    scopes: ClassVar[tuple[str, ...]] = ("layer", "head")
    budget: str = _budget(("layer", "head"))
    beta: float = option(20.0, "pyramid steepness, >= 1 (1: equal layers)")

    def __post_init__(self):
        super().__post_init__()
        check_float(self.name, "beta", self.beta, 1.0, float("inf"))


@dataclass
class KNormParams(MethodParams):
    """``knorm`` (``kvpack.methods.knorm.KNorm``)."""

    name: ClassVar[str] = "knorm"
    scopes: ClassVar[tuple[str, ...]] = SCOPES
    budget: str = _budget()


@dataclass
class RandomScoresParams(MethodParams):
    """``random`` (``kvpack.methods.random.RandomScores``)."""

    name: ClassVar[str] = "random"
    scopes: ClassVar[tuple[str, ...]] = SCOPES
    seed: int = option(0, "seed of the random scores")
    budget: str = _budget()

    def __post_init__(self):
        super().__post_init__()
        check_int(self.name, "seed", self.seed, 0)


@dataclass
class NoCompressionParams(MethodParams):
    """``none`` (``kvpack.methods.none.NoCompression``): no parameters."""

    name: ClassVar[str] = "none"


#: Method name -> its parameters, in the order of ``kvpack.methods.METHODS``.
PARAMS: dict[str, type[MethodParams]] = {cls.name: cls for cls in (
    KVzipParams, KVzipHeadParams, AttentionMatchingParams, D2OParams, StreamingLLMParams, H2OParams, SnapKVParams,
    PyramidKVParams, KNormParams, RandomScoresParams, NoCompressionParams)}


# ---------------------------------------------------------------------------------------------------------------
# reading the declarations: command-line options and spec values


@dataclass(frozen=True)
class CommandLineOption:
    """One ``kvpack build`` method option, shared by the methods that have a parameter of that flag.

    Attributes:
        flag: ``--sink``.
        param: the parameter (field) name, ``sink``.
        type: ``int``, ``float``, ``bool`` (a flag without a value) or ``str``.
        choices: the values the parser accepts (the union over the methods), or ``None``.
        low, high: the bounds the parser enforces, or ``None``.
        metavar: the value's placeholder, or ``None``.
        uses: ``(method name, help, default, choices)`` for each method taking it, in registry order.
    """

    flag: str
    param: str
    type: type
    choices: tuple[str, ...] | None
    low: float | None
    high: float | None
    metavar: str | None
    uses: tuple[tuple[str, str, Any, tuple[str, ...] | None], ...]


def parameter_types(cls: type[MethodParams]) -> dict[str, type]:
    """``{parameter: int | float | bool | str}`` from the fields' annotations (``str | None`` gives ``str``).

    Raises:
        TypeError: a parameter of another type (a programming error: parameters are scalars stored as JSON).
    """
    hints = typing.get_type_hints(cls)
    out = {}
    for name in cls.parameter_names():
        hint = hints[name]
        args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        if len(args) != 1 or args[0] not in (int, float, bool, str):
            raise TypeError(f"{cls.__name__}.{name}: a method parameter must be int, float, bool or str "
                            f"(optionally | None), not {hint}")
        out[name] = args[0]
    return out


def command_line_options(params: dict[str, type[MethodParams]] | None = None) -> list[CommandLineOption]:
    """The ``kvpack build`` method options: one per flag declared with ``option`` (module docstring), in the order
    the methods (``PARAMS``) and their fields first declare them.

    Raises:
        TypeError: two methods declare one flag with another parameter, type or parser bounds (a programming
            error, caught by the tests).
    """
    found: dict[str, dict] = {}
    for method, cls in (params or PARAMS).items():
        types = parameter_types(cls)
        for f in fields(cls):
            opt = f.metadata.get("option")
            if opt is None or not f.init:
                continue
            flag = opt.flag or "--" + f.name.replace("_", "-")
            shape = (f.name, types[f.name], opt.low, opt.high, opt.metavar)
            entry = found.setdefault(flag, {"shape": shape, "choices": [], "uses": []})
            if entry["shape"] != shape:
                raise TypeError(f"{flag}: {method}.{f.name} is declared as {shape}, another method as "
                                f"{entry['shape']} (name, type, low, high, metavar)")
            entry["choices"] += [c for c in opt.choices or () if c not in entry["choices"]]
            entry["uses"].append((method, opt.help, f.default, opt.choices))
    return [CommandLineOption(flag, e["shape"][0], e["shape"][1], tuple(e["choices"]) or None, e["shape"][2],
                              e["shape"][3], e["shape"][4], tuple(e["uses"])) for flag, e in found.items()]


def parse_value(method: str, key: str, text: str) -> Any:
    """``text`` (a ``NAME[key=value]`` spec's value) as the type of ``method``'s parameter ``key``: ``int``,
    ``float``, ``true``/``false`` for ``bool``, ``str`` as it is. A key the method does not have is read as an
    integer, a float, a boolean or a string, whichever fits first (``get_method`` then names the parameters it
    takes).

    Raises:
        InputError: unknown method, or a value that is not of the parameter's type.
    """
    if method not in PARAMS:
        raise InputError(f"unknown method {method!r}; choose from: {', '.join(sorted(PARAMS))}")
    kind = parameter_types(PARAMS[method]).get(key)
    if kind is str:
        return text
    if kind is bool or kind is None:
        flag = {"true": True, "false": False}.get(text.lower())
        if flag is not None or kind is bool:
            if flag is None:
                raise InputError(f"{method}: {key} must be true or false, got {text!r}")
            return flag
    for k in ((kind,) if kind is not None else (int, float)):
        try:
            return k(text)
        except ValueError:
            if kind is not None:
                raise InputError(f"{method}: {key} must be {'an integer' if kind is int else 'a number'}, "
                                 f"got {text!r}") from None
    return text


# ---------------------------------------------------------------------------------------------------------------
# parameter checks (InputError naming the method and the parameter)


def check_int(method: str, field: str, value, low: int) -> None:
    """Raise ``InputError`` unless ``value`` is an integer ``>= low``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise InputError(f"{method}: {field} must be an integer >= {low}, got {value!r}")


def check_float(method: str, field: str, value, low: float, high: float, *, low_open: bool = False) -> None:
    """Raise ``InputError`` unless ``value`` is a number in ``[low, high]`` (``(low, high]`` if ``low_open``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value <= high and (
        value > low if low_open else value >= low)
    if not ok:
        raise InputError(f"{method}: {field} must be a number in {'(' if low_open else '['}{low}, {high}], "
                         f"got {value!r}")


def check_choice(method: str, field: str, value, choices: tuple[str, ...]) -> None:
    """Raise ``InputError`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise InputError(f"{method}: {field} must be one of {', '.join(choices)}, got {value!r}")


def check_bool(method: str, field: str, value) -> None:
    """Raise ``InputError`` unless ``value`` is ``True`` or ``False``."""
    if not isinstance(value, bool):
        raise InputError(f"{method}: {field} must be true or false, got {value!r}")
