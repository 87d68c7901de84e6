"""Hugging Face "auto" values in a DeepSpeed config: the ones zerocore fills in, as the Trainer would, and
one error naming the others.

Note [Hugging Face "auto" values]
---------------------------------
Hugging Face's published DeepSpeed configs use ``"auto"``, which its Trainer fills in before DeepSpeed sees
the config (transformers' ``HfTrainerDeepSpeedConfig``). zerocore fills in the ones the Trainer derives from
the model and the world, as it does: ``reduce_bucket_size`` = hidden^2, ``stage3_prefetch_bucket_size`` =
int(0.9 hidden^2), ``stage3_param_persistence_threshold`` = 10 hidden (hidden: the model's
``config.hidden_size``, else the largest of ``config.hidden_sizes``); the batch sizes from each other and the
world size by DeepSpeed's rule (an ``"auto"`` counts as absent; ``gradient_accumulation_steps`` is 1 when
only one batch size is given); ``scheduler.params.warmup_min_lr`` = 0 and ``warmup_max_lr`` = the optimizer's
lr. The rest come from the user's ``TrainingArguments``, which zerocore does not see: one ``ValueError`` names
every such key and the training argument it stands for. Any other ``"auto"`` in ``zero_optimization`` (and its
offload sections) the Trainer leaves as it is, and DeepSpeed's config models read it as the key's default: there
it counts as absent (_deepspeed_json.py), but for ``stage``, whose DeepSpeed default is no ZeRO at all.
A memory plan (``python -m zerocore.estimate``, the doctor) needs none of the training arguments but the
precision: ``for_planning`` stands placeholders in for the others, and the caller names the precision and,
for the bucket sizes, the hidden size.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._config_values import as_int

if TYPE_CHECKING:
    from .config import ZeroConfig

BATCH_KEYS = ("gradient_accumulation_steps", "train_batch_size", "train_micro_batch_size_per_gpu")


def hidden_size_of(model: Any) -> int | None:
    """The hidden size Hugging Face's Trainer derives ``"auto"`` bucket sizes from: the model's
    ``config.hidden_size``, else the largest of ``config.hidden_sizes``; None when the model has neither."""
    model_config = getattr(model, "config", None)
    hidden = getattr(model_config, "hidden_size", None)
    if hidden is None:
        sizes = getattr(model_config, "hidden_sizes", None)
        if isinstance(sizes, Sequence) and not isinstance(sizes, str) and len(sizes) > 0:
            hidden = max(sizes)
    return hidden


# Where the Hugging Face Trainer takes each "auto" it fills from TrainingArguments (its trainer_config_process /
# trainer_config_finalize): the argument named in zerocore's error.
_TRAINING_ARGUMENTS = {
    "optimizer.params.lr": "learning_rate",
    "optimizer.params.betas": "adam_beta1 and adam_beta2",
    "optimizer.params.eps": "adam_epsilon",
    "optimizer.params.weight_decay": "weight_decay",
    "gradient_clipping": "max_grad_norm",
    "fp16.enabled": "fp16",
    "bf16.enabled": "bf16",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "scheduler.params.warmup_max_lr": "learning_rate",
    "scheduler.params.warmup_num_steps": "warmup_steps (or warmup_ratio times the number of training steps)",
    "scheduler.params.total_num_steps": "max_steps (the number of training steps the Trainer computes)",
}
# "auto" bucket sizes the Trainer derives from the model's hidden size h.
FROM_HIDDEN = {"reduce_bucket_size": ("h^2", lambda h: h * h),
                "stage3_prefetch_bucket_size": ("0.9 h^2", lambda h: int(0.9 * h * h)),
                "stage3_param_persistence_threshold": ("10 h", lambda h: 10 * h)}


# The "auto" values a Hugging Face Trainer fills in from its TrainingArguments that change no byte a rank holds:
# a memory plan reads a Trainer's config as it is, these standing in (initialize() still asks for the real
# ones). The precision ("auto" bf16 / fp16) does change the bytes: the caller says which.
TRAINING_ONLY_PLACEHOLDERS: dict[str, Any] = {
    "optimizer.params.lr": 1e-3,
    "optimizer.params.betas": [0.9, 0.999],
    "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0,
    "gradient_clipping": 1.0,
    "gradient_accumulation_steps": 1,
    "scheduler.params.warmup_max_lr": 1e-3,
    "scheduler.params.warmup_num_steps": 1,
    "scheduler.params.total_num_steps": 1,
}
PRECISIONS = {"bf16": (True, False), "fp16": (False, True), "fp32": (False, False)}  # (bf16, fp16) enabled


def for_planning(data: Any, precision: str | None, hidden_size: int | None) -> Any:
    """For a memory plan (the estimate's and the doctor's): a copy of a DeepSpeed config with the Trainer's
    memory-neutral "auto" values filled in and ``precision`` ("bf16", "fp16", "fp32" or None) applied; a
    ValueError names what the caller must still say (the precision, the hidden size)."""
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)} or None, got {precision!r}")
    if not isinstance(data, dict):
        return data  # from_deepspeed names what is wrong with it
    data = copy.deepcopy(data)  # the caller's stays as it was
    for path, placeholder in TRAINING_ONLY_PLACEHOLDERS.items():
        *sections, key = path.split(".")
        section = data
        for name in sections:
            section = section.get(name) if isinstance(section, dict) else None
        if not isinstance(section, dict) or not _is_auto(section.get(key)):
            continue
        if key == "gradient_accumulation_steps" and any(
                isinstance(data.get(n), (int, float)) for n in ("train_batch_size", "train_micro_batch_size_per_gpu")):
            continue  # DeepSpeed's batch-size rule derives it (an inconsistent config must still fail)
        section[key] = placeholder
    problems = []
    if precision is not None:
        for name, enabled in zip(("bf16", "fp16"), PRECISIONS[precision]):
            section = data.get(name)
            data[name] = {**(section if isinstance(section, dict) else {}), "enabled": enabled}
    else:
        auto = [f"{name}.enabled" for name in ("bf16", "fp16")
                if isinstance(data.get(name), dict) and _is_auto(data[name].get("enabled"))]
        if auto:
            problems.append(f'{" and ".join(auto)}: "auto" (the Trainer\'s --bf16 / --fp16): pass --bf16, --fp16 or '
                            "--fp32 (precision=) to say which precision to plan")
    zero = data.get("zero_optimization")
    auto = [f"zero_optimization.{name}" for name in FROM_HIDDEN if isinstance(zero, dict) and _is_auto(zero.get(name))]
    if auto and hidden_size is None:
        problems.append(f'{", ".join(auto)}: "auto" (the Trainer derives them from the model\'s hidden size): pass '
                        "--hidden-size (hidden_size=; the model's config.hidden_size)")
    if problems:
        raise ValueError("; ".join(problems))
    return data


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


def fill_auto(*, plain: dict[str, Any], optimizer: dict[str, Any], params: dict[str, Any], fp16: dict[str, Any],
              bf16: dict[str, Any], zero: dict[str, Any], scheduler: dict[str, Any] | None,
              hidden_size: Any) -> None:
    """Fills in the ``"auto"`` values zerocore can derive, in place in these (fresh) section dicts, and raises
    one ``ValueError`` naming every other (Note [Hugging Face "auto" values])."""
    problems: list[str] = []
    reported: set[str] = set()

    def needs_value(path: str) -> None:
        if path in reported:
            return
        source = _TRAINING_ARGUMENTS.get(path)
        if source is None:
            problems.append(f'{path}: "auto" is a Hugging Face Trainer placeholder that the Trainer fills in before '
                            "DeepSpeed sees the config; zerocore needs the actual value")
        else:
            problems.append(f'{path}: "auto" is a Hugging Face Trainer placeholder, filled from TrainingArguments.'
                            f"{source}; zerocore does not see the training arguments, so give the value")

    # From the model's hidden size, as the Trainer does.
    for name, (formula, derive) in FROM_HIDDEN.items():
        if _is_auto(zero.get(name)):
            if hidden_size is None:
                problems.append(
                    f'zero_optimization.{name}: "auto" is a Hugging Face Trainer placeholder, derived from the '
                    f"model's hidden size h ({formula}), and no hidden size is known: the model has no "
                    "config.hidden_size (nor config.hidden_sizes) (ZeroConfig.from_deepspeed takes hidden_size=); "
                    "give an integer")
                reported.add(f"zero_optimization.{name}")
            else:
                zero[name] = derive(as_int(hidden_size, "hidden_size (the model's config.hidden_size)", 1))

    # Batch sizes: DeepSpeed's rule, an "auto" counting as absent; what needs the world size waits for it.
    auto_batch = [name for name in BATCH_KEYS if _is_auto(plain.get(name))]
    if auto_batch:
        for name in auto_batch:
            del plain[name]
        given = [name for name in ("train_batch_size", "train_micro_batch_size_per_gpu") if name in plain]
        if "gradient_accumulation_steps" in auto_batch:
            if len(given) == 2:
                auto_batch.remove("gradient_accumulation_steps")  # derived by derive_accumulation_steps
            elif len(given) == 1:
                plain["gradient_accumulation_steps"] = 1  # DeepSpeed's rule with one batch size given
            else:
                auto_batch.remove("gradient_accumulation_steps")
                problems.append(
                    'gradient_accumulation_steps: "auto" is a Hugging Face Trainer placeholder, filled from '
                    "TrainingArguments.gradient_accumulation_steps; zerocore derives it (DeepSpeed's rule) only "
                    "from a numeric train_batch_size or train_micro_batch_size_per_gpu, and neither is given: "
                    "give gradient_accumulation_steps, or the batch sizes")
        plain["auto_batch_sizes"] = tuple(auto_batch)

    # The scheduler's: warmup_min_lr is 0 and warmup_max_lr the optimizer's lr, as the Trainer sets them.
    if scheduler is not None:
        sched_params = scheduler["params"]
        if _is_auto(sched_params.get("warmup_min_lr")):
            sched_params["warmup_min_lr"] = 0.0
        lr = params.get("lr")
        if _is_auto(sched_params.get("warmup_max_lr")) and lr is not None and not _is_auto(lr):
            sched_params["warmup_max_lr"] = lr

    # Everything else: named, with the training argument it stands for.
    sections = [("", plain), ("optimizer.", optimizer), ("optimizer.params.", params), ("fp16.", fp16),
                ("bf16.", bf16), ("zero_optimization.", zero)]
    if scheduler is not None:
        sections += [("scheduler.", scheduler), ("scheduler.params.", scheduler["params"])]
    for prefix, section in sections:
        for key, value in section.items():
            if _is_auto(value):
                needs_value(prefix + key)
    if len(problems) > 1:
        problems.insert(0, f'{len(problems)} "auto" values that zerocore cannot fill in:')
    if problems:
        raise ValueError("\n".join(problems))


def fill_auto_batch_sizes(config: ZeroConfig, world: int) -> ZeroConfig:
    """DeepSpeed's batch-size rule for the keys given as ``"auto"``: ``train_batch_size = micro * gas *
    world``; ``micro = train_batch_size / (gas * world)``; neither is filled when both are ``"auto"``."""
    auto, gas = config.auto_batch_sizes, config.gradient_accumulation_steps
    batch, micro = config.train_batch_size, config.train_micro_batch_size_per_gpu
    if "train_batch_size" in auto and micro is not None:
        batch = micro * gas * world
    elif "train_micro_batch_size_per_gpu" in auto and batch is not None:
        if batch % (gas * world):
            raise ValueError(f'train_micro_batch_size_per_gpu: "auto" is train_batch_size ({batch}) / '
                             f"(gradient_accumulation_steps ({gas}) * world_size ({world})), which is not an "
                             "integer; give train_micro_batch_size_per_gpu, or a train_batch_size that divides")
        micro = batch // (gas * world)
    return dataclasses.replace(config, train_batch_size=batch, train_micro_batch_size_per_gpu=micro,
                               auto_batch_sizes=())
