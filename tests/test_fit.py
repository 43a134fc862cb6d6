"""Will it fit? Verdicts, suggestions checked by compiling, and `train` refusing a plan."""

import json

import pytest

from jaxspeed.config import load_config, resolve_batch
from jaxspeed.cost.fit import DoesNotFit, Fit, candidate_changes, check_fit
from jaxspeed.train.fit_check import compiled_device_bytes
from jaxspeed.train.loop import train

from test_cli import TINY, run_cli, write

MiB = 2**20


def fake_bytes(config):
    """A memory model: each ZeRO stage and remat step saves 10 MiB, offload 20 MiB."""
    used = 100 * MiB - 10 * MiB * config.zero_optimization.stage
    used -= 10 * MiB * (config.activation_checkpointing.policy == "full")
    offload = config.zero_optimization.offload_optimizer.device == "cpu"
    used -= 20 * MiB * offload
    return used, "model" if offload else "compiled"


def verdict(budget, *overrides):
    config = load_config(None, overrides=["mesh.data=8", "train_batch_size=16", *overrides])
    return check_fit(config, budget, batch=resolve_batch(config, 8), device_bytes=fake_bytes)


def test_a_plan_that_fits_says_so():
    v = verdict(200 * MiB)
    assert v.fit.fits and v.suggestion is None
    assert v.message().startswith("fits: 100.00 MiB of 200.00 MiB")


def test_the_cheapest_single_change_comes_first():
    v = verdict(85 * MiB)
    assert not v.fit.fits
    assert v.suggestion.overrides == ("zero_optimization.stage=2",)
    assert "over by 15.00 MiB" in v.message() and "--set zero_optimization.stage=2" in v.message()
    assert "device bytes: compiled" in v.message()


def test_a_modelled_suggestion_says_so():
    v = verdict(55 * MiB, "zero_optimization.offload_optimizer.device=cpu")
    assert v.fit.source == "model" and not v.fit.fits
    assert v.suggestion.source == "model" and "device bytes: model" in v.message()


def test_changes_are_stacked_when_no_single_one_fits():
    v = verdict(45 * MiB)
    assert v.suggestion is not None and v.suggestion.fits
    assert "activation_checkpointing.policy=full" in v.suggestion.overrides
    assert "zero_optimization.stage=3" in v.suggestion.overrides


def test_nothing_fits_says_what_else_to_do():
    v = verdict(1 * MiB)
    assert v.suggestion is None and v.tried > 5
    assert "smaller model" in v.message()


def test_candidates_are_valid_configs():
    config = load_config(None, overrides=["mesh.data=8", "train_batch_size=32"])
    batch = resolve_batch(config, 8)
    changes = candidate_changes(config, batch)
    assert changes[0] == ["zero_optimization.stage=1"]
    assert ["train_micro_batch_size_per_device=2", "gradient_accumulation_steps=2"] in changes
    for change in changes:
        resolve_batch(load_config(config, overrides=change), 8)


def test_stage3_layer_by_layer_is_a_candidate():
    config = load_config(None, overrides=["mesh.data=8", "zero_optimization.stage=3"])
    changes = candidate_changes(config, resolve_batch(config, 8))
    assert changes[0] == ["zero_optimization.max_live_parameters=0"]
    config = load_config(None, overrides=["mesh.data=8"])
    assert ["zero_optimization.stage=3", "zero_optimization.max_live_parameters=0"] in (
        candidate_changes(config, resolve_batch(config, 8)))


def test_fit_describes_both_ways():
    assert Fit(3 * MiB, 4 * MiB).describe() == "fits: 3.00 MiB of 4.00 MiB per device (75%)"
    assert "over by 1.00 MiB" in Fit(5 * MiB, 4 * MiB).describe()


# -- end to end: the compiled step of a real (tiny) GPT ---------------------------------------


@pytest.fixture(scope="module")
def tight_budget():
    """A budget between the ZeRO-0 and ZeRO-3 plans of the tiny config."""
    configs = [load_config(TINY, overrides=[f"zero_optimization.stage={s}"]) for s in (0, 3)]
    zero0, zero3 = (compiled_device_bytes(c) for c in configs)
    assert zero3 < zero0
    return (zero0 + zero3) // 2


def test_plan_says_does_not_fit_and_its_suggestion_fits(tmp_path, tight_budget):
    config = write(tmp_path, "tiny.json", TINY)
    proc = run_cli("plan", config, "--json", "--cpu-devices", "8", "--device-memory", str(tight_budget))
    assert proc.returncode == 0, proc.stderr
    fit = json.loads(proc.stdout.splitlines()[-1])["fit"]
    assert not fit["fit"]["fits"] and "does not fit" in fit["message"]
    suggested = fit["suggestion"]["overrides"]
    # Checked here again, independently of the plan's own compile.
    assert compiled_device_bytes(load_config(TINY, overrides=suggested)) <= tight_budget


def test_force_trains_anyway(tmp_path, tight_budget, capsys):
    config = load_config(TINY, overrides=[f"hardware.device_memory={tight_budget}"])
    with pytest.raises(DoesNotFit, match="does not fit(.|\n)*--force"):
        train(config, output_dir=tmp_path, steps=1, progress=False)
    assert not (tmp_path / "checkpoints").exists()
    record = train(config, output_dir=tmp_path, steps=1, progress=False, force=True)
    assert record["step"] == 1
    assert "starting anyway" in capsys.readouterr().err
