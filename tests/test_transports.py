"""Choosing a state transfer's transport: a name that is none, or one whose package is missing, is a typed error
raised before anything is made (the transfer suite itself runs over each transport: tests/conftest.py)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

import mambacache as mc
from mambacache._handoff._reslice import ReslicingSender, StateLayout

from . import link
from .util import small_spec


def _manager() -> mc.CacheManager:
    return mc.CacheManager(mc.StatePool(small_spec(), 4), host_pool=mc.HostPool(small_spec(), 2))


@pytest.mark.parametrize("name", ["tcp", "", "NIXL", None, 1])
def test_an_unknown_transport_is_a_typed_error(name: Any) -> None:
    master = link.store()
    with _manager() as mgr, pytest.raises(mc.InvalidArgumentError, match="transport must be one of 'gloo', 'nixl'"):
        mc.StateTransfer(mgr, None, peer=1, store=master, rank=0, timeout=1.0, transport=name)
    with _manager() as mgr, pytest.raises(mc.InvalidArgumentError, match="transport must be one of"):
        ReslicingSender(mgr, None, [1], StateLayout.synthetic(small_spec()), transport=name)


@pytest.mark.parametrize(("name", "module"), [("nixl", "nixl_cu12"), ("mooncake", "mooncake")])
def test_a_transport_whose_package_is_missing_names_the_extra_to_install(
    name: str, module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == module else real(m, *a))
    master = link.store()
    with _manager() as mgr, pytest.raises(mc.TransportUnavailableError) as got:
        mc.StateTransfer(mgr, None, peer=1, store=master, rank=0, timeout=1.0, transport=name)
    assert isinstance(got.value, ImportError) and got.value.extra == name and got.value.transport == name
    assert f"pip install 'mambacache[{name}]'" in str(got.value)
    assert master.num_keys() == 0  # nothing was made: no key of a direction, an agent or a pair


@pytest.mark.parametrize(
    "args",
    [
        ["simulate", "--scenario", "pd", "--model", "toy", "--transport"],
        ["bench", "--transfer", "--quick", "--transport"],
    ],
    ids=["simulate", "bench"],
)
@pytest.mark.parametrize(("name", "module"), [("nixl", "nixl_cu12"), ("mooncake", "mooncake")])
def test_a_command_over_a_transport_whose_package_is_missing_is_one_line_and_exit_2(
    args: list[str], name: str, module: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mambacache._cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == module else real(m, *a))
    assert main([*args, name]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and f"pip install 'mambacache[{name}]'" in err, err
