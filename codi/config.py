"""Typed, frozen configuration: one dataclass per params.yaml section, loaded and validated once.

    from codi.config import load_params
    params = load_params("params.yaml")      # Params: .extract, .precompute, .model, .sft, ...
    params.codi.latent_steps, params.gamma

Every key must be known, present, of the declared type and in range; a bad value fails before any work,
naming its dotted key (`params.yaml: sft.lr = -0.001: expected a float > 0`). Floats such as `1e-3` are
floats, as DVC (YAML 1.2) reads them; PyYAML's YAML 1.1 resolver alone would read them as strings.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml


class ConfigError(ValueError):
    """A params file or value that does not match the schema."""


def _f(doc: str, **checks: Any) -> Any:
    """A dataclass field with a one-line doc and range checks (ge, gt, le, lt, choices, nonempty).

    No defaults: params.yaml is the one place a value is set (a default here could disagree with it)."""
    return field(metadata={"doc": doc, **checks})


SOURCE_NAMES = ("synthetic", "humaneval", "mbpp", "pyx", "cruxeval")
# codi.sources.synthetic_templates.TEMPLATE_NAMES (a test holds them equal; the schema imports no source)
SYNTHETIC_TEMPLATES = ("arith_chain", "branch", "early_return", "ternary", "for_range", "while_loop",
                       "list_accumulate", "list_build", "list_ops", "string_loop", "string_ops", "dict_count",
                       "dict_map", "helper_call", "scan_best", "recursion_int", "recursion_list", "recursion_str",
                       "nested_range", "nested_lists", "chain", "chain_const")


# --------------------------------------------------------------------------------------- extract
@dataclass(frozen=True)
class SyntheticConfig:
    """The built-in generator of small programs (the embedded default's main training data)."""

    n_programs: int = _f("number of distinct programs (problems)", ge=1)
    calls_per_program: int = _f("calls (samples) per program, each with fresh inputs", ge=1)
    difficulty: int = _f("1 = straight-line code, 2 = +loops/branches/helpers, 3 = +recursion/nesting", ge=1, le=3)
    max_int: int = _f("largest free integer argument (0..max_int; loop bounds keep their own ranges)", ge=1, le=99)
    canonical_names: bool = _f("name variables a, b, c ... in order and the entry f (less to copy: tiny models)")
    operators: list[str] = _f("integer operations the templates may draw (copy: a line that copies a value)",
                              choices=("+", "-", "*", "//", "%", "max", "min", "abs", "copy"), nonempty=True)
    templates: list[str] = _f("template families to draw from; [] = every one of level <= difficulty",
                              choices=SYNTHETIC_TEMPLATES)
    chain_steps: list[int] = _f("[lo, hi]: assignment lines of the straight-line templates (arith_chain, chain)")
    value_range: list[int] = _f("[lo, hi]: every integer a call holds (locals, items, result); a call outside is "
                                "drawn again")
    add_max: int = _f("largest constant of a drawn + or - (`c + 1` .. `c + add_max`)", ge=1, le=9)
    seed: int = _f("generator seed; the same seed gives the same programs")

    def __post_init__(self) -> None:
        for key, (lo, hi), bounds in (("chain_steps", (1, 10), self.chain_steps), ("value_range", (-999, 999),
                                                                                      self.value_range)):
            if len(bounds) != 2 or not lo <= bounds[0] <= bounds[1] <= hi:
                raise ConfigError(f"extract.synthetic.{key} = {bounds}: expected [lo, hi] with "
                                  f"{lo} <= lo <= hi <= {hi}")


@dataclass(frozen=True)
class SourcePathsConfig:
    """Where the file-backed sources live: a local path, or `hf:<dataset id>[:<split>]` (needs network)."""

    mbpp: str = _f("MBPP jsonl (task_id, text, code, test_list, test_setup_code, challenge_test_list)")
    pyx: str = _f("SemCoder PyX jsonl (nl, fwd_mnl, bwd_mnl, response)")
    cruxeval: str = _f("CRUXEval-style jsonl (code, input, output, id)")


@dataclass(frozen=True)
class TraceConfig:
    """What a trace may contain."""

    max_frames: int = _f("frames per trace; a longer run is kept with status `truncated`", ge=1)
    max_repr_chars: int = _f("characters per repr; a longer one is cut and ends in a visible marker", ge=8)
    diff_locals: bool = _f("write a value unchanged since the previous frame of the same scope as \"..\"")


@dataclass(frozen=True)
class SandboxConfig:
    """Per-sample isolation limits (see codi/tracing/sandbox.py)."""

    wall_timeout_s: float = _f("wall-clock limit per sample; the whole process group is killed", gt=0)
    cpu_time_s: int = _f("RLIMIT_CPU per sample", ge=1)
    memory_mb: int = _f("RLIMIT_AS per sample", ge=64)
    max_file_mb: int = _f("RLIMIT_FSIZE per sample (files written in its private temp dir)", ge=1)
    max_processes: int = _f("RLIMIT_NPROC for the sample's (unprivileged, per-worker) uid", ge=1)
    max_output_bytes: int = _f("stdout/stderr bytes kept per sample; the rest is discarded", ge=0)
    max_result_bytes: int = _f("bytes of JSON a sample may send back; more is a `truncated`/`error` row", ge=4096)


@dataclass(frozen=True)
class DaskConfig:
    """The Dask cluster of `extract.executor: dask` (codi/tracing/cluster.py)."""

    address: str = _f("scheduler address (tcp://host:8786); \"\" = a LocalCluster on 127.0.0.1 started by the stage")
    local_workers: int = _f("worker processes of that LocalCluster", ge=1)
    shard_size: int = _f("samples per Dask task; the shard of a worker that dies reruns whole", ge=1)


@dataclass(frozen=True)
class ExtractConfig:
    """`extract`: trace programs from the chosen sources inside the sandbox."""

    sources: list[str] = _f("sources to trace, in order", choices=SOURCE_NAMES, nonempty=True)
    paths: SourcePathsConfig = _f("file-backed sources")
    skip_bad_lines: bool = _f("count and skip a malformed dataset line instead of failing the stage")
    workers: int = _f("sandboxed worker processes (per Dask worker under dask); 0 = one per CPU core", ge=0)
    executor: Literal["local", "dask"] = _f("local: one sandbox pool here; dask: shards over a Dask cluster")
    dask: DaskConfig = _f("the Dask cluster (executor dask)")
    synthetic: SyntheticConfig = _f("synthetic generator")
    trace: TraceConfig = _f("trace content limits")
    sandbox: SandboxConfig = _f("isolation limits")


# ------------------------------------------------------------------------------------ precompute
@dataclass(frozen=True)
class PrecomputeConfig:
    """`precompute`: tokenize, locate locals spans, split by problem, write the cache."""

    max_seq_len: int = _f("drop examples whose prompt + trace tokens exceed this", ge=1)
    max_frames: int = _f("drop examples with more frames than this", ge=1)
    val_fraction: float = _f("share of problems in the val split", ge=0.0, lt=1.0)
    test_fraction: float = _f("share of problems in the test split", ge=0.0, lt=1.0)
    split_salt: str = _f("salt of the stable problem-id hash that assigns splits")
    holdout_sources: list[str] = _f("sources kept whole for evaluation only (split `holdout`)", choices=SOURCE_NAMES)
    batch_size: int = _f("examples per fast-tokenizer batch", ge=1)

    def __post_init__(self) -> None:
        if self.val_fraction + self.test_fraction >= 1.0:
            raise ConfigError(
                f"precompute.val_fraction + precompute.test_fraction = {self.val_fraction + self.test_fraction}: "
                "expected < 1 (some problems must remain for training)"
            )


@dataclass(frozen=True)
class TinyModelConfig:
    """The embedded default base model: a from-scratch Qwen2-style decoder and a byte-level BPE."""

    vocab_size: int = _f("BPE vocabulary incl. the 256 byte symbols and the special tokens", ge=300)
    tokenizer_min_frequency: int = _f("minimum pair frequency for a BPE merge", ge=1)
    split_digits: bool = _f("tokenize numbers digit by digit; false = BPE merges frequent numbers into one token")
    hidden_size: int = _f("model width", ge=8)
    num_layers: int = _f("decoder layers", ge=1)
    num_heads: int = _f("attention heads", ge=1)
    num_kv_heads: int = _f("key/value heads (grouped-query attention); must divide num_heads", ge=1)
    intermediate_size: int = _f("MLP width", ge=8)
    max_position_embeddings: int = _f("longest sequence the rotary embedding is set up for", ge=16)
    rope_theta: float = _f("rotary base", gt=0)
    tie_word_embeddings: bool = _f("share input embeddings and lm_head")
    seed: int = _f("weight-initialisation seed")

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"model.tiny.hidden_size = {self.hidden_size}: expected a multiple of model.tiny.num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"model.tiny.num_kv_heads = {self.num_kv_heads}: expected a divisor of model.tiny.num_heads ({self.num_heads})")


@dataclass(frozen=True)
class ModelConfig:
    """`model`: the base LM every training stage starts from."""

    base: str = _f("`tiny` (embedded default), a local HF folder, or a hub id (needs network)", nonempty=True)
    revision: str = _f("hub revision when `base` is a hub id")
    trust_remote_code: bool = _f("allow custom modelling code from the hub")
    tiny: TinyModelConfig = _f("used when base = tiny")


# -------------------------------------------------------------------------------------- training
@dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of a training stage (the `sft` and `sft_direct` sections; `codi` extends it)."""

    max_steps: int = _f("optimizer steps; -1 = use epochs", ge=-1)
    epochs: float = _f("passes over the train split when max_steps = -1", gt=0)
    lr: float = _f("peak learning rate", gt=0)
    lr_schedule: Literal["cosine", "linear", "constant", "constant_with_warmup"] = _f("learning-rate schedule")
    warmup_ratio: float = _f("share of steps spent warming up", ge=0.0, lt=1.0)
    weight_decay: float = _f("AdamW weight decay", ge=0.0)
    batch_size: int = _f("examples per device per step", ge=1)
    grad_accum: int = _f("micro-batches accumulated per optimizer step", ge=1)
    max_grad_norm: float = _f("gradient clipping norm; 0 = off", ge=0.0)
    eval_batch_size: int = _f("examples per device per validation step", ge=1)
    eval_steps: int = _f("validate every this many steps (and at the end)", ge=1)
    save_steps: int = _f("checkpoint every this many steps (and at the end)", ge=1)
    logging_steps: int = _f("log every this many steps", ge=1)
    save_total_limit: int = _f("checkpoints kept on disk; 0 = all", ge=0)
    keep: Literal["best", "last"] = _f("final model: lowest validation loss, or the last step")
    optimizer: Literal["auto", "adamw_torch", "paged_adamw_8bit", "adafactor", "sgd"] = _f(
        "auto = paged 8-bit AdamW on a GPU with bitsandbytes, AdamW otherwise")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = _f("auto = bf16 where the GPU supports it, fp32 on CPU")
    gradient_checkpointing: bool = _f("recompute activations in backward (saves memory); codi: the teacher's CE pass")
    group_by_length: bool = _f("batch examples of similar length together (less padding: ~2x faster here)")
    torch_threads: int = _f("torch intra-op threads on CPU; 0 = torch's default (1 is fastest for tiny models)", ge=0)
    cpu_processes: int = _f("data-parallel CPU processes (gloo) when there is no GPU; global batch = "
                                "batch_size x processes x grad_accum", ge=1)
    seed: int = _f("seed of weights-independent randomness (data order, dropout)")

    def __post_init__(self) -> None:
        if self.keep == "best" and self.save_steps % self.eval_steps:
            raise ConfigError(f"save_steps = {self.save_steps} with keep = 'best': expected a multiple of "
                              f"eval_steps ({self.eval_steps}); the best model must have been saved")


@dataclass(frozen=True)
class SftConfig(TrainConfig):
    """`sft` (stage 1): the training hyperparameters plus the weighting of the trace's tokens."""

    computed_weight: float = _f("loss weight of the tokens the trace computes (the locals a LINE frame does not copy "
                                "from the frame before, return/exception VALUEs) against the rest; 1 = plain CE", gt=0)


@dataclass(frozen=True)
class CodiConfig(TrainConfig):
    """`codi` (stage 2b): the reference design's options plus the training hyperparameters."""

    latent_steps: int = _f("recurrent latents per LINE frame (between latent_start and latent_end)", ge=0)
    kd_layers: list[int] | None = _f("hidden-state layers KD aligns (index into hidden_states: 0 = embeddings, "
                                      "-1 = last); null = all layers (frozen teacher or logit KD: the last)")
    frozen_teacher: str = _f("path of a frozen teacher model; \"\" = the shared-weight teacher")
    kd_target: Literal["hidden", "logit"] = _f("hidden: smooth L1 on hidden states; logit: KL on lm_head logits")
    kd_temp: float = _f("temperature of logit KD", gt=0)
    single_anchor: bool = _f("KD on the last frame only (vanilla CODI ablation)")
    ss_prob: float = _f("scheduled sampling: final probability of feeding a post-latent segment's own argmax", ge=0.0, le=1.0)
    ss_ramp_frac: float = _f("share of steps over which ss_prob ramps up linearly from 0", gt=0.0, le=1.0)
    kd_norm: Literal["none", "teacher_std"] = _f("none (the reference) | teacher_std: each KD layer's smooth-L1 term "
                                                 "divided by the detached std of the teacher's hidden states at that "
                                                 "layer over the micro-batch's anchors (CODI's public code)")
    kd_positions: Literal["action_sep", "action_line"] = _f("KD anchors of a latent frame: its <|action_sep|> (the "
                                                            "reference) | action_line: also every token of its line")
    recon_weight: float = _f("weight of the step-level reconstruction loss (SIM-CoT): a decoder reads a LINE frame's "
                             "latents and must write its locals; 0 = off", ge=0.0)
    recon_decoder: Literal["shared", "copy"] = _f("the reconstruction decoder: the model's own weights | an auxiliary "
                                                  "copy of the sft model, trained alongside and dropped at inference")
    latent_curriculum_frac: float = _f("the share of latent LINE frames (the first ones of each example) ramps from 0 "
                                       "to 1 over this share of the steps; 0 = all latent from step 0", ge=0.0, le=1.0)
    mix_explicit_prob: float = _f("share of each example's LINE frames (the last ones) kept explicit after the ramp",
                                  ge=0.0, lt=1.0)
    val_accuracy_samples: int = _f("val examples decoded with latents at each evaluation (output accuracy); 0 = off", ge=0)


# ------------------------------------------------------------------------------------- evaluate
@dataclass(frozen=True)
class EvaluateConfig:
    """`evaluate`: explicit-trace vs latent vs no-trace decoding on held-out problems."""

    modes: list[str] = _f("decoders to compare",
                          choices=("explicit", "latent", "direct"), nonempty=True)
    splits: list[str] = _f("cache splits to evaluate on", choices=("train", "val", "test", "holdout"), nonempty=True)
    max_examples: int = _f("examples per split; 0 = all", ge=0)
    batch_size: int = _f("examples decoded together", ge=1)
    max_new_tokens: int = _f("generated positions (tokens + latents) per example", ge=1)
    max_frames: int = _f("generated frames per example", ge=1)
    constrain_actions: bool = _f("explicit/latent: after <|action_sep|> write only one of the program's "
                                 "lines (the model still picks which); false = free decoding")
    torch_threads: int = _f("torch intra-op threads on CPU; 0 = torch's default", ge=0)
    bootstrap_samples: int = _f("resamples of the percentile bootstrap over problems behind every interval", ge=100)
    bootstrap_seed: int = _f("seed of the bootstrap (fixed: a rerun gives the same intervals)")
    ci_level: float = _f("confidence level of the intervals", gt=0.5, lt=1.0)


# --------------------------------------------------------------------------------- logging / ops
@dataclass(frozen=True)
class WandbConfig:
    """Where training runs log. Not a DVC dependency: changing where logs go never retrains."""

    mode: Literal["offline", "online", "disabled"] = _f("offline runs sync later with `wandb sync`; WANDB_MODE overrides")
    project: str = _f("wandb project", nonempty=True)
    entity: str = _f("wandb entity (team); \"\" = your default")


@dataclass(frozen=True)
class PipelineConfig:
    """The Prefect deployment (pipelines/): schedule and retries. Not a DVC dependency."""

    cron: str = _f("schedule of the served pipeline deployment", nonempty=True)
    retries: int = _f("retries of a stage that failed transiently", ge=0)
    retry_delay_s: float = _f("seconds before a retry", ge=0)


@dataclass(frozen=True)
class Params:
    """The whole params.yaml."""

    alpha: float = _f("weight of the teacher CE (L = alpha*Lt + beta*Ls + gamma*Lkd)", ge=0.0)
    beta: float = _f("weight of the student CE", ge=0.0)
    gamma: float = _f("weight of the KD loss", ge=0.0)
    extract: ExtractConfig = _f("stage extract")
    precompute: PrecomputeConfig = _f("stage precompute")
    model: ModelConfig = _f("the base model")
    sft: SftConfig = _f("stage sft")
    sft_direct: TrainConfig = _f("stage sft_direct")
    codi: CodiConfig = _f("stage codi")
    evaluate: EvaluateConfig = _f("stage evaluate")
    wandb: WandbConfig = _f("wandb logging")
    pipeline: PipelineConfig = _f("the Prefect deployment")


# --------------------------------------------------------------------------------------- loading
class _Loader(yaml.SafeLoader):
    """SafeLoader that reads YAML 1.2 floats (`1e-3`, `.5e2`) as floats, as DVC does."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                |[-+]?\.(?:inf|Inf|INF)
                |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def read_yaml(path: str | Path) -> Any:
    """Parse a YAML file with the project's float rules; a syntax error names the file and line."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read params file: {e.strerror}") from None
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - SafeLoader subclass
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None


def load_params(path: str | Path = "params.yaml") -> Params:
    """Load and validate the whole params file."""
    raw = read_yaml(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {type(raw).__name__}")
    return build(Params, raw, prefix="", source=str(path))


def params_from_dict(raw: dict[str, Any], source: str = "<params>") -> Params:
    """Validate an in-memory params mapping (tests, notebooks)."""
    return build(Params, raw, prefix="", source=source)


def build(cls: type, raw: Any, prefix: str, source: str) -> Any:
    """Build dataclass `cls` from `raw`, checking keys, types and ranges; every field must be present."""
    where = prefix.rstrip(".") or "top level"
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {where} = {raw!r}: expected a mapping")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"{source}: unknown key {prefix}{unknown[0]}: expected one of {sorted(fields)}")
    missing = [n for n in fields if n not in raw]
    if missing:
        raise ConfigError(f"{source}: missing key {prefix}{missing[0]} ({_type_name(hints[missing[0]])}): "
                          f"every parameter must be set in the params file")
    values = {}
    for name, value in raw.items():
        values[name] = _convert(hints[name], value, f"{prefix}{name}", source, fields[name].metadata)
    try:
        return cls(**values)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is list:
        return f"list[{_type_name(get_args(tp)[0])}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, key: str, source: str, meta: typing.Mapping[str, Any]) -> Any:
    def fail(expected: str) -> typing.NoReturn:
        raise ConfigError(f"{source}: {key} = {value!r}: expected {expected}")

    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, prefix=f"{key}.", source=source)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, key, source, meta)
    if origin is Literal:
        if value not in get_args(tp):
            fail(f"one of {', '.join(repr(a) for a in get_args(tp))}")
        return value
    if origin is list:
        if not isinstance(value, list):
            fail(f"a list of {_type_name(get_args(tp)[0])}")
        item_tp = get_args(tp)[0]
        items = [_convert(item_tp, v, f"{key}[{i}]", source, {}) for i, v in enumerate(value)]
        if meta.get("nonempty") and not items:
            fail("a non-empty list")
        if "choices" in meta:
            bad = [v for v in items if v not in meta["choices"]]
            if bad:
                fail(f"items from {list(meta['choices'])} (bad: {bad[0]!r})")
        if len(set(map(repr, items))) != len(items):
            fail("a list without repeated items")
        return items
    if tp is bool:
        if not isinstance(value, bool):
            fail("true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail("an integer" + _range_text(meta))
    elif tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail("a float" + _range_text(meta))
        value = float(value)
        if value != value:
            fail("a float, not nan")
    elif tp is str:
        if not isinstance(value, str):
            fail("a string")
        if meta.get("nonempty") and not value:
            fail("a non-empty string")
    else:  # pragma: no cover - schema error, not user error
        raise TypeError(f"unsupported config type {tp} for {key}")
    _check_range(value, meta, fail)
    return value


def _range_text(meta: typing.Mapping[str, Any]) -> str:
    parts = [f"{op} {meta[k]}" for k, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if k in meta]
    return (" " + " and ".join(parts)) if parts else ""


def _check_range(value: Any, meta: typing.Mapping[str, Any], fail: Any) -> None:
    kind = "an integer" if isinstance(value, int) else "a float"
    if ("ge" in meta and value < meta["ge"]) or ("gt" in meta and value <= meta["gt"]) \
            or ("le" in meta and value > meta["le"]) or ("lt" in meta and value >= meta["lt"]):
        fail(kind + _range_text(meta))


def to_dict(obj: Any) -> Any:
    """A config (or part) as plain YAML-able data (for logging, wandb config and manifests)."""
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """{"codi": {"lr": 1e-3}} -> {"codi.lr": 1e-3}: nested mappings as dotted keys; lists stay values."""
    if not isinstance(data, dict):
        return {prefix.rstrip("."): data} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in data.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def describe(cls: type = Params, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, type, doc) for every field: the reference table of params.yaml."""
    rows = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(describe(tp, f"{prefix}{f.name}."))
        else:
            rows.append((f"{prefix}{f.name}", _type_name(tp), f.metadata.get("doc", "")))
    return rows
