"""The one Registry (sluice/common/registry.py) behind every named extension point."""

from __future__ import annotations

import pytest

from sluice.common.registry import Registry


def test_a_name_is_registered_once_and_found_by_it_or_its_alias() -> None:
    reg: Registry[int] = Registry("thing")
    reg.add("b", 2)
    assert reg.register("a")(1) == 1
    reg.alias("z", "b")
    assert (reg.get("a"), reg.get("b"), reg.get("z")) == (1, 2, 2)
    assert reg.canonical("z") == "b" and reg.canonical("a") == "a"
    assert reg.names() == ["a", "b"] and list(reg) == ["a", "b"]
    assert reg.choices() == ["a", "b", "z"]
    assert "z" in reg and "c" not in reg
    with pytest.raises(ValueError, match="registered twice"):
        reg.add("a", 3)
    with pytest.raises(ValueError, match="registered twice"):
        reg.add("z", 3)
    with pytest.raises(KeyError, match="alias 'y' names unknown 'c'"):
        reg.alias("y", "c")


def test_an_unknown_name_is_refused_naming_the_choices() -> None:
    reg: Registry[int] = Registry("thing")
    reg.add("a", 1)
    reg.alias("z", "a")
    with pytest.raises(KeyError, match="unknown thing 'c'; known: a, z"):
        reg.get("c")


def test_every_extension_point_uses_it() -> None:
    from scheduler_service.core.policy import POLICIES
    from scheduler_service.costmodel.base import COST_MODELS
    from scheduler_service.routers.base import ROUTERS
    from scheduler_service.sim.slo_profiles import SLO_PROFILES
    from scheduler_service.workloads import SYNTHETIC_WORKLOADS
    from scheduler_service.workloads.base import TRACE_FORMATS
    from sluice_vllm.policies import POLICIES as PLUGIN_POLICIES
    from worker_service.engines import ENGINES

    every = (POLICIES, COST_MODELS, ROUTERS, SLO_PROFILES, SYNTHETIC_WORKLOADS, TRACE_FORMATS, PLUGIN_POLICIES, ENGINES)
    assert all(isinstance(reg, Registry) for reg in every)
