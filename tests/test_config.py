"""Hydra composition into typed, frozen configs."""

import dataclasses

import pytest

from graphexec.batch.forward_mode import ForwardMode
from graphexec.config import EngineConfig, available_options
from graphexec.errors import ConfigError


def test_defaults_compose():
    cfg = EngineConfig.from_overrides([])
    assert cfg.model.name == "smollm2-135m" and cfg.model.source == "gguf"
    assert cfg.capture.name == "auto" and cfg.capture.background and cfg.capture.cache_dir
    assert cfg.capture.decode.backend == cfg.capture.idle.backend == "full_graph"
    assert cfg.capture.decode.options["keep"] == "faster"
    assert cfg.capture.extend.backend == cfg.capture.mixed.backend == "piecewise"
    # Prefill pieces only where they pay: on CUDA; the CPU runs extend and mixed eager.
    assert cfg.capture.for_mode(ForwardMode.EXTEND, "cpu").backend == "eager"
    cuda_extend = cfg.capture.for_mode(ForwardMode.MIXED, "cuda")
    assert cuda_extend.backend == "piecewise" and "devices" not in cuda_extend.options
    graph_first = EngineConfig.from_overrides(["capture=graph_first"])
    assert graph_first.capture.for_mode(ForwardMode.EXTEND, "cpu").backend == "piecewise"
    assert not graph_first.capture.background and graph_first.capture.cache_dir is None
    assert cfg.scheduler.max_prefill_tokens == max(cfg.capture.extend.options["buckets"])
    eager = EngineConfig.from_overrides(["capture=eager"])
    assert all(eager.capture.for_mode(m).backend == "eager" for m in ForwardMode)
    assert cfg.sampling.temperature == 0.0 and cfg.device == "cpu"


def test_overrides_reach_typed_fields():
    cfg = EngineConfig.from_overrides(
        ["model=tiny-qwen2", "scheduler.max_running_requests=7", "sampling.max_new_tokens=5", "cache.max_context=100"]
    )
    assert cfg.model.architecture["attention_bias"] is True
    assert cfg.scheduler.max_running_requests == 7
    assert cfg.sampling.max_new_tokens == 5
    assert cfg.cache.max_context == 100
    cfg = EngineConfig.from_overrides(["capture.decode.buckets=[1,2,4,8]", "capture.decode.compile.freezing=true"])
    assert list(cfg.capture.decode.options["buckets"]) == [1, 2, 4, 8]
    assert cfg.capture.idle.options["compile"]["freezing"] is True  # idle follows decode


def test_configs_are_frozen():
    cfg = EngineConfig.from_overrides(["model=tiny-llama"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.device = "cuda"
    with pytest.raises(TypeError):
        cfg.model.architecture["num_layers"] = 99
    with pytest.raises(TypeError):
        cfg.capture.decode.options["x"] = 1


def test_config_groups_exist():
    assert {"smollm2-135m", "tiny-llama", "tiny-qwen2"} <= set(available_options("model"))
    assert "eager" in available_options("capture")
    for group in ("scheduler", "cache", "sampling"):
        assert available_options(group)


@pytest.mark.parametrize(
    "override, option",
    [
        ("capture.background=maybe", "capture.background"),
        ("capture.idle_delay_s=-1", "capture.idle_delay_s"),
        ("capture.cache_dir=[1]", "capture.cache_dir"),
        ("capture.extend.devices=[tpu]", "capture.extend.devices"),
        ("++capture.colour=red", "capture.colour"),
    ],
)
def test_bad_plan_options_name_themselves(override, option):
    with pytest.raises(ConfigError, match=option.replace(".", r"\.")):
        EngineConfig.from_overrides([override])


@pytest.mark.parametrize("override, named", [
    ("capture.background=1", "capture.background must be true or false"),
    ("capture.compile_in_child=yes", "capture.compile_in_child must be true or false"),
    ("capture.compile_processes=0", "capture.compile_processes must be an integer >= 1"),
    ("capture.compile_processes=true", "capture.compile_processes must be an integer >= 1"),
    ("capture.idle_delay_s=-1", "capture.idle_delay_s must be a number of seconds >= 0"),
])
def test_a_bad_plan_option_is_refused_naming_it(override, named):
    with pytest.raises(ConfigError, match=named):
        EngineConfig.from_overrides([override])


def test_the_default_plan_compiles_in_two_processes_and_a_hand_made_one_in_one():
    assert EngineConfig.from_overrides([]).capture.compile_processes == 2
    assert EngineConfig.from_overrides(["capture=graph_first"]).capture.compile_processes == 1
