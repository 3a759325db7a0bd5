"""Each option is declared once: the engine's options (EngineConfig) and the router's
(RouterSettings) reach the serve YAML schema and the command-line flags with the same
default and the same bounds."""

import argparse
import dataclasses
import typing

import pytest

from radixray.cluster.config import ConfigError, EngineSection, RouterSection, ServeConfig
from radixray.cluster.routing import RouterSettings
from radixray.engine import options
from radixray.engine.config import EngineConfig

OPTION_SETS = [(EngineConfig, EngineSection, "engine"), (RouterSettings, RouterSection, "router")]


def _violations(m: dict, kind: type) -> list:
    """Values just outside each declared bound, and the edges that are inside."""
    step = 1 if kind is int else 0.5
    out = []
    if m["ge"] is not None:
        out.append((m["ge"] - step, False))
        out.append((m["ge"], True))
    if m["gt"] is not None:
        out.append((m["gt"], False))
    if m["le"] is not None:
        out.append((m["le"] + step, False))
        out.append((m["le"], True))
    if m["lt"] is not None:
        out.append((m["lt"], False))
    if m["choices"] is not None:
        out.append(("no-such-choice", False))
    return out


CASES = [(cls, section, key, f, kind) for cls, section, key in OPTION_SETS
         for f, kind, _ in options.spec(cls)]


@pytest.mark.parametrize("cls, section, key, f, kind", CASES,
                         ids=[f"{key}.{f.name}" for _, _, key, f, _ in CASES])
def test_the_yaml_schema_has_each_option_with_its_default_and_bounds(cls, section, key, f, kind):
    field = section.model_fields[f.name]
    assert field.default == f.default and field.description == f.metadata["help"]
    for value, ok in _violations(f.metadata, kind):
        if value == "no-such-choice" and f.name == "attention_backend":
            continue
        try:
            cls(**{f.name: value})
            dataclass_ok = True
        except ValueError:
            dataclass_ok = False
        try:
            ServeConfig.parse({key: {f.name: value}})
            schema_ok = True
        except ConfigError as exc:
            assert f"{key}.{f.name}" in str(exc) or f"{key}:" in str(exc)
            schema_ok = False
        assert dataclass_ok == schema_ok == ok, (f.name, value)


def test_the_sections_have_nothing_but_the_options():
    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(EngineSection.model_fields) == engine
    router = {f.name for f in dataclasses.fields(RouterSettings)}
    assert set(RouterSection.model_fields) - router == {"retry_max_attempts", "retry_backoff_s"}


def _parser(command: str) -> argparse.ArgumentParser:
    from radixray import cli
    from radixray.serve import serve_cli
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    serve_cli.add_parser(sub)
    cli._engine_args(sub.add_parser("generate"))
    return parser


def _flag_value(f, kind):
    """A legal value other than the default, as it is typed on the command line."""
    m = f.metadata
    if m["choices"]:
        value = next(c for c in reversed(m["choices"]) if c is not None and c != f.default)
    elif kind is bool:
        return [f"--{'no-' if f.default else ''}{f.name.replace('_', '-')}"], not f.default
    elif kind is str:
        value = "cuda:1" if f.name == "device" else "somewhere"
    elif typing.get_origin(kind) is tuple:  # a list option: one flag, several values
        value = ("a=/one", "b=/two")
        return [f"--{f.name.replace('_', '-')}", *value], value
    else:
        lo = m["ge"] if m["ge"] is not None else (m["gt"] or 0)
        value = kind(lo + (1 if kind is int else 0.25)) if m["lt"] is None else kind(m["lt"] / 2)
    return [f"--{f.name.replace('_', '-')}", str(value)], value


ENGINE = options.spec(EngineConfig)
NEEDS = {"quantize_lm_head": ["--quantization", "w8a8_int8"],  # checks that span options
         "hicache_size": ["--enable-hierarchical-cache"],
         "hicache_storage_backend": ["--enable-hierarchical-cache"]}


@pytest.mark.parametrize("f, kind", [(f, k) for f, k, _ in ENGINE], ids=[f.name for f, _, _ in ENGINE])
def test_every_engine_option_is_a_flag_of_serve_and_generate(f, kind):
    from radixray.serve.serve_cli import config_from_args
    argv, value = _flag_value(f, kind)
    argv = NEEDS.get(f.name, []) + argv
    serve = _parser("serve").parse_args(["serve", *argv])
    extra = {"server": {"worker_num_gpus": 1}} if f.name == "device" else {}
    if extra:  # a cuda device needs a GPU per worker: checked across sections
        with pytest.raises(ConfigError, match="worker_num_gpus"):
            config_from_args(serve)
    elif f.name == "disaggregation_mode":  # set per worker by the fleet's roles
        with pytest.raises(ConfigError, match="fleet.prefill_workers and fleet.decode_workers"):
            config_from_args(serve)
    else:
        assert getattr(config_from_args(serve).engine, f.name) == value
    assert getattr(_parser("serve").parse_args(["serve"]), f.name) is None  # YAML decides
    generate = _parser("generate").parse_args(["generate"])
    assert getattr(generate, f.name) == f.default
    parsed = getattr(_parser("generate").parse_args(["generate", *argv]), f.name)
    assert (tuple(parsed) if isinstance(parsed, list) else parsed) == value
