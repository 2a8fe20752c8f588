"""``PipelineSpec``: one spec of a pipeline, which ``PipelineTrainer``'s keyword arguments and the
command line's ``PipelineConfig`` both map onto, validated once; its errors name the Python
argument, and the command line's the flag (``errors.OptionError``, no rewriting of the text)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from raytrain_mp.errors import OptionError, UsageError
from raytrain_mp.pipeline.config import FLAG_OF_ARGUMENT, PipelineConfig
from raytrain_mp.pipeline.layouts import PLACEMENT_STRATEGIES
from raytrain_mp.pipeline.spec import PipelineSpec
from raytrain_mp.pipeline.trainer import PipelineTrainer


def test_the_trainers_keyword_arguments_are_the_spec_fields_with_the_same_defaults():
    parameters = dict(inspect.signature(PipelineTrainer.__init__).parameters)
    assert [name for name in parameters if name not in {"self", "model", "sample_input", "data"}] == list(
        PipelineSpec.field_names()
    )
    for field in dataclasses.fields(PipelineSpec):
        default = field.default if field.default is not dataclasses.MISSING else inspect.Parameter.empty
        assert parameters[field.name].default == default, field.name


def test_the_command_line_maps_its_flags_onto_the_spec():
    cfg = PipelineConfig(
        stages=3, replicas=2, microbatches=8, precision="bf16", placement="SPREAD", balance="none", balance_trials=2
    )
    spec = cfg.pipeline_spec(0.25)
    assert (spec.num_stages, spec.num_replicas, spec.num_microbatches, spec.lr) == (3, 2, 8, 0.25)
    assert spec.autocast_bf16 and spec.placement_strategy == "SPREAD"
    assert spec.balance is None and spec.balance_trials == 0  # trials only with --balance time
    split = PipelineConfig(split_points=["layer3"], balance="time", balance_trials=2).pipeline_spec(0.1)
    assert split.split_points == ["layer3"] and split.balance is None and split.balance_trials == 0
    assert PipelineConfig(balance_trials=2).pipeline_spec(0.1).balance_trials == 2


def test_one_list_of_placement_strategies():
    choices = next(f for f in dataclasses.fields(PipelineConfig) if f.name == "placement").metadata["choices"]
    assert tuple(choices) == PLACEMENT_STRATEGIES
    PipelineConfig(placement="STRICT_SPREAD").validate()


@pytest.mark.parametrize(
    "spec, python, flag",
    [
        (
            PipelineSpec(2, clip_grad_norm=-1.0),
            "clip_grad_norm: must be > 0, got -1.0",
            "--clip-grad-norm: must be > 0",
        ),
        (PipelineSpec(2, virtual_stages=0), "virtual_stages: must be >= 1, got 0", "--virtual-stages: must be >= 1"),
        (
            PipelineSpec(4, schedule="1f1b", num_microbatches=2),
            "num_microbatches: 1F1B over 4 stages needs at least 4 micro-batches, got 2",
            "--microbatches: 1F1B over 4 stages",
        ),
    ],
)
def test_a_check_names_the_argument_and_the_command_line_the_flag(spec, python, flag):
    with pytest.raises(OptionError) as info:
        spec.check_settings()
    assert str(info.value).startswith(python)
    assert str(info.value.named(FLAG_OF_ARGUMENT)).startswith(flag)


def test_the_command_line_says_the_flags_of_the_options_an_error_mentions():
    error = OptionError(
        "cpus_per_stage",
        "2 stages need 3 CPU (2/1 by stage: loader processes (data.loader_workers) count)",
        mentions=("data.loader_workers",),
    )
    assert (
        str(error) == "cpus_per_stage: 2 stages need 3 CPU (2/1 by stage: loader processes (data.loader_workers) count)"
    )
    named = error.named(FLAG_OF_ARGUMENT)
    assert type(named) is UsageError
    assert (
        str(named) == "--cpus-per-stage: 2 stages need 3 CPU (2/1 by stage: loader processes (--loader-workers) count)"
    )
    assert str(OptionError("p2p_timeout_s", "must be > 0 seconds, got 0").named(FLAG_OF_ARGUMENT)).startswith(
        "p2p_timeout_s:"
    )  # no flag: the Python name stays
