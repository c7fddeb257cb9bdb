"""Flags and SLUICE_* variables come from the config dataclasses, parsed by the fields' types,
with one precedence: defaults < file < environment < flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import pytest

from scheduler_service import policies  # noqa: F401  (registration)
from scheduler_service.core.policy import POLICIES, build_policy
from scheduler_service.routers import RouterContext, build_router
from sluice.common.config import add_config_arguments, config_from, opt, parse_value


@dataclass
class Example:
    port: int = opt(50051, "port")
    ratio: float | None = opt(None, "a ratio")
    verbose: bool = opt(False, "talk more")
    worker: list[str] = opt(default_factory=list, help="addresses")
    num_workers: int = opt(1, "workers", cli="workers")
    hidden: str = opt("x", "not a flag", flag=False)
    limit: int | None = opt(256, "a bound; none: unbounded")


def parse(argv: list[str], environ: dict[str, str] | None = None, file: Path | None = None) -> Example:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, Example)
    return config_from(Example, parser.parse_args(argv), file=file, environ=environ or {})


def test_flags_are_named_and_typed_by_the_fields() -> None:
    argv = ["--port", "7", "--ratio", "0.5", "--verbose", "--worker", "a:1,b:2", "--worker", "c:3", "--workers", "4"]
    cfg = parse(argv)
    assert cfg == Example(port=7, ratio=0.5, verbose=True, worker=["a:1", "b:2", "c:3"], num_workers=4)
    assert parse(["--ratio", "none", "--no-verbose"]) == Example()


def test_none_given_on_the_command_line_overrides_a_default_that_is_not_none(tmp_path: Path) -> None:
    assert parse([]).limit == 256
    assert parse(["--limit", "none"]).limit is None
    file = tmp_path / "c.toml"
    file.write_text("limit = 5\n")
    assert parse(["--limit", "none"], {"SLUICE_LIMIT": "7"}, file).limit is None
    assert parse([], {"SLUICE_LIMIT": "none"}, file).limit is None


def test_environment_sits_between_the_file_and_the_flags(tmp_path: Path) -> None:
    file = tmp_path / "c.toml"
    file.write_text("port = 1\nratio = 0.25\nnum_workers = 9\n")
    env = {"SLUICE_PORT": "2", "SLUICE_WORKER": "x:1,y:2", "SLUICE_WORKERS": "3", "SLUICE_HIDDEN": "ignored"}
    cfg = parse(["--port", "3"], env, file)
    assert (cfg.port, cfg.ratio, cfg.worker, cfg.num_workers, cfg.hidden) == (3, 0.25, ["x:1", "y:2"], 3, "x")


def test_bad_values_name_where_they_came_from(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        parse(["--port", "many"])
    with pytest.raises(ValueError, match="SLUICE_VERBOSE: not a boolean"):
        parse([], {"SLUICE_VERBOSE": "perhaps"})
    file = tmp_path / "c.json"
    file.write_text('{"prot": 1}')
    with pytest.raises(ValueError, match="prot"):
        parse([], file=file)


def test_parse_value_covers_every_field_type_of_every_policy() -> None:
    """Every policy option is parseable from text (the `--policy name:key=value` path)."""
    from sluice.common.config import field_types

    for name in POLICIES.names():
        for key, tp in field_types(POLICIES.get(name).config_cls).items():
            parse_value("1", tp, key)  # raises TypeError for a field type no option could set


def test_policy_options_are_parsed_by_type_and_name_the_option() -> None:
    from scheduler_service.core.policy import PolicyContext

    ctx = PolicyContext(0, 16, 64, 64, 4096, 64, 4096)
    policy = build_policy("sarathi:budget=256,tbt_slo_s=none,allocate_whole_prompt=off", ctx)
    assert (policy.config.budget, policy.config.tbt_slo_s, policy.config.allocate_whole_prompt) == (256, None, False)
    with pytest.raises(ValueError, match="option 'budget': not an integer: 'abc'"):
        build_policy("sarathi:budget=abc", ctx)
    with pytest.raises(ValueError, match="no option 'budjet'"):
        build_policy("sarathi:budjet=1", ctx)
    with pytest.raises(ValueError, match="option 'xi': not a number"):
        build_router("scls:xi=half", RouterContext(cost_model=_cost_model()))


def _cost_model():  # type: ignore[no-untyped-def]
    from scheduler_service.costmodel.factory import build_cost_model

    return build_cost_model("analytic", "llama-2-7b", "a100-80g")
