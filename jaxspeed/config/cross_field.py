"""The rules across config sections, each naming both keys; every broken one is reported.

`Config`'s validator runs them all and raises one error listing each broken rule. When a
section itself is invalid, `load_config` still runs the rules that read only valid sections
(`cross_field_errors(..., skip=...)`), so one message names every error of a config.

`untrainable_errors` are the combinations a config may describe but `initialize` refuses:
`calibrate`'s probe, for one, rewrites such a config (a 1-bit optimizer under ZeRO-3) into one
it can time, so they are not errors of the config itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from jaxspeed.config.optimizer import ONEBIT_TYPES, clips_logits

#: a `jaxspeed.config.Config` (this module sits below `schema`, whose validator runs the rules)
Config = Any


def _half_precision(config: Config) -> Iterator[str]:
    if config.bf16.enabled and config.fp16.enabled:
        yield "bf16.enabled and fp16.enabled are both true; enable at most one"


def _sequence_fits(config: Config) -> Iterator[str]:
    if config.data.seq_len > config.model.max_seq_len:
        yield (f"data.seq_len={config.data.seq_len} is longer than "
               f"model.max_seq_len={config.model.max_seq_len}")


def _sampling_decodes(config: Config) -> Iterator[str]:
    moe = config.model.moe
    if config.logging.sample_every_n_steps and moe is not None and moe.routing == "expert_choice":
        yield ("logging.sample_every_n_steps needs decoding, which model.moe.routing="
               "expert_choice cannot do (each expert picks from the whole group, later tokens "
               "included); set logging.sample_every_n_steps=0")


def _expert_tensor_splits(config: Config) -> Iterator[str]:
    moe = config.model.moe
    if moe is not None and moe.parallelism == "expert_tensor" and config.mesh.tensor == 1:
        yield ("model.moe.parallelism=expert_tensor keeps each expert's hidden units split over "
               "the tensor axis (Tutel's sharding degree is mesh.tensor), and mesh.tensor=1 "
               "splits nothing; set mesh.tensor > 1, or parallelism=expert")


def _fp8_all_gather(config: Config) -> Iterator[str]:
    fp8, zero = config.fp8, config.zero_optimization
    if zero.fp8_all_gather and not (fp8.enabled and fp8.recipe == "tensorwise"
                                    and zero.stage == 3):
        yield ("zero_optimization.fp8_all_gather gathers the weights cast to FP8 with one scale "
               "per tensor: it needs fp8.enabled with fp8.recipe=tensorwise and "
               f"zero_optimization.stage=3 (got fp8.enabled={fp8.enabled}, "
               f"fp8.recipe={fp8.recipe}, stage {zero.stage})")


def _fp8_carried(config: Config) -> Iterator[str]:
    """The FP8 combinations that do not work together, each naming both keys."""
    fp8, moe = config.fp8, config.model.moe
    if not fp8.enabled:
        return
    experts = moe is not None and "experts" not in fp8.skip
    if experts and not moe.drop_tokens:
        yield ("fp8.enabled with model.moe.drop_tokens=false: the dropless experts' grouped "
               "matmuls have no FP8 path; add 'experts' to fp8.skip or drop tokens")
    if fp8.recipe != "delayed":
        return
    for key, used in (("model.moe", experts), ("mesh.pipe", config.mesh.pipe > 1),
                      (f"optimizer.type={config.optimizer.type}",
                       config.optimizer.type in ONEBIT_TYPES)):
        if used:
            yield (f"fp8.recipe=delayed keeps amax histories as train state, which {key} "
                   f"does not carry yet; use fp8.recipe=tensorwise or rowwise"
                   + (" (or add 'experts' to fp8.skip)" if key == "model.moe" else ""))


def _bias_uncompressed(config: Config) -> Iterator[str]:
    moe = config.model.moe
    if moe is not None and moe.balance == "bias" and config.optimizer.type in ONEBIT_TYPES:
        yield (f"model.moe.balance=bias does not go with optimizer.type={config.optimizer.type}: "
               f"the 1-bit exchange would compress the expert load the bias moves by; use "
               f"balance=aux_loss or an uncompressed optimizer")


#: Each rule: the top-level sections it reads, and the messages of what it finds broken.
RULES: tuple[tuple[frozenset[str], Callable[[Config], Iterator[str]]], ...] = (
    (frozenset({"bf16", "fp16"}), _half_precision),
    (frozenset({"data", "model"}), _sequence_fits),
    (frozenset({"logging", "model"}), _sampling_decodes),
    (frozenset({"model", "mesh"}), _expert_tensor_splits),
    (frozenset({"fp8", "zero_optimization"}), _fp8_all_gather),
    (frozenset({"fp8", "model", "mesh", "optimizer"}), _fp8_carried),
    (frozenset({"model", "optimizer"}), _bias_uncompressed),
)


def cross_field_errors(config: Config, *, skip: frozenset[str] = frozenset()) -> list[str]:
    """Every broken rule's message, in `RULES`' order; rules reading a section of `skip` (one
    that did not validate, so `config` holds its defaults) are not run."""
    return [message for sections, rule in RULES if not sections & skip
            for message in rule(config)]


def _onebit_alone(config: Config) -> Iterator[str]:
    """A 1-bit optimizer with what it does not combine with: one message naming each, and why."""
    if config.optimizer.type not in ONEBIT_TYPES:
        return
    problems = []
    zero = config.zero_optimization
    if zero.stage != 0:
        problems.append(
            f"zero_optimization.stage={zero.stage}: each worker updates the whole momentum with "
            f"its local gradient before the compressed all-reduce, so optimizer state and "
            f"gradients cannot be sharded (use stage 0)"
        )
    if zero.offload_optimizer.device != "none" or zero.offload_param.device != "none":
        problems.append("offload: the compressed all-reduce runs on the device state")
    if config.fp16.enabled:
        problems.append("fp16: dynamic loss scaling is not wired into the 1-bit step (use bf16)")
    if problems:
        yield f"optimizer.type {config.optimizer.type} cannot be used with " + "; ".join(problems)


def _pipelined(config: Config) -> Iterator[str]:
    pipe = config.mesh.pipe
    if pipe == 1:
        return
    for name, used in (("model.moe", config.model.moe is not None),
                       (f"optimizer.type={config.optimizer.type}",
                        config.optimizer.type in ONEBIT_TYPES),
                       ("optimizer.params.qk_clip", clips_logits(config.optimizer))):
        if used:
            yield (f"{name} with pipeline parallelism (mesh.pipe={pipe}) is not available in "
                   f"this version of jaxspeed; use mesh.pipe=1")


def untrainable_errors(config: Config) -> list[str]:
    """Combinations whose config keys exist but which do not train together (`initialize`
    refuses them: never faked), every one."""
    return [*_onebit_alone(config), *_pipelined(config)]
