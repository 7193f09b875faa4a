"""`Registry`: one entry per name, and an unknown name is an error that lists the registered ones."""

from __future__ import annotations

import pytest

from legorl_jax.core.registry import Registry, UnknownNameError


def test_register_get_and_names() -> None:
    colours: Registry[int] = Registry("colour")
    colours.add("red", 1)
    assert colours.register("blue")(2) == 2
    assert colours.get("red") == 1 and colours.get("blue") == 2
    assert colours.names() == ["blue", "red"]


def test_a_name_registers_once() -> None:
    colours: Registry[int] = Registry("colour")
    colours.add("red", 1)
    with pytest.raises(ValueError, match="colour 'red' is already registered"):
        colours.add("red", 2)
    assert colours.get("red") == 1


def test_an_unknown_name_lists_the_registered_ones_in_the_registry_error() -> None:
    class UnknownColour(ValueError):
        pass

    plain: Registry[int] = Registry("colour")
    plain.add("red", 1)
    with pytest.raises(UnknownNameError) as caught:
        plain.get("green")
    assert str(caught.value) == "unknown colour 'green'; registered: red"  # unquoted, unlike a KeyError

    own: Registry[int] = Registry("colour", error=UnknownColour)
    with pytest.raises(UnknownColour, match="registered: $"):
        own.get("green")
