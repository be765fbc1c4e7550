"""slime's private names (engine/slime/compat.py), one test per shape slime has had.

slime is not installed here (it needs Megatron and a GPU), so each test builds the module the
adapter reads, `slime.rollout.sglang_rollout` with a `GenerateState` made by a singleton
metaclass behaving as `slime.utils.misc.SingletonMeta` does in that range of versions:
- 0.1.0 to 0.2.3: the registry (`_instances`) lives on the metaclass alone;
- 0.2.4 to 0.3.1 and main (2026-08): `SingletonMeta.clear_instances(cls)` gives the class a
  registry of its own, which `__call__` then reads (`cls._instances`) and fills.
"""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from engine.slime import compat, slime_aborting


def _singleton_meta(with_clear: bool) -> type:
    class SingletonMeta(type):
        _instances: dict[type, Any] = {}

        def __call__(cls, *args: Any, **kwargs: Any) -> Any:
            registry = cls._instances  # the class's own registry once cleared, else the metaclass's
            if cls not in registry:
                registry[cls] = super().__call__(*args, **kwargs)
            return registry[cls]

    if with_clear:
        def clear_instances(cls: type) -> None:
            cls._instances = {}  # type: ignore[attr-defined]

        SingletonMeta.clear_instances = clear_instances  # type: ignore[attr-defined]
    return SingletonMeta


def _generate_state_class(meta: type) -> type:
    class GenerateState(metaclass=meta):  # type: ignore[misc]
        made = 0

        def __init__(self, args: Any) -> None:
            type(self).made += 1
            self.aborted = False

    return GenerateState


@pytest.fixture
def slime_module() -> Iterator[types.ModuleType]:
    module = types.ModuleType(compat.ROLLOUT_MODULE)
    saved = sys.modules.get(compat.ROLLOUT_MODULE)
    sys.modules[compat.ROLLOUT_MODULE] = module
    try:
        yield module
    finally:
        if saved is None:
            sys.modules.pop(compat.ROLLOUT_MODULE, None)
        else:
            sys.modules[compat.ROLLOUT_MODULE] = saved


def test_slime_not_loaded_is_not_aborting() -> None:
    assert compat.ROLLOUT_MODULE not in sys.modules
    assert compat.generate_state() is None and slime_aborting() is False


def test_slime_0_1_to_0_2_3_the_registry_on_the_metaclass(slime_module: types.ModuleType) -> None:
    cls = _generate_state_class(_singleton_meta(with_clear=False))
    slime_module.GenerateState = cls  # type: ignore[attr-defined]
    assert slime_aborting() is False and cls.made == 0  # looking never builds slime's state
    state = cls(object())
    assert compat.generate_state() is state and slime_aborting() is False
    state.aborted = True  # what slime's abort() does
    assert slime_aborting() is True and cls.made == 1


def test_slime_0_2_4_to_0_3_1_a_cleared_registry_is_the_class_own(slime_module: types.ModuleType) -> None:
    meta = _singleton_meta(with_clear=True)
    cls = _generate_state_class(meta)
    slime_module.GenerateState = cls  # type: ignore[attr-defined]
    stale = cls(object())
    meta.clear_instances(cls)  # type: ignore[attr-defined]
    assert compat.generate_state() is None  # the metaclass still holds `stale`: it is not slime's state any more
    fresh = cls(object())
    assert fresh is not stale and compat.generate_state() is fresh
    fresh.aborted = True
    assert slime_aborting() is True
    stale.aborted = False
    assert slime_aborting() is True


def test_a_slime_without_the_registry_is_named_once_not_guessed(slime_module: types.ModuleType,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    class GenerateState:
        aborted = True

    slime_module.GenerateState = GenerateState  # type: ignore[attr-defined]
    compat._warned.clear()
    with caplog.at_level(logging.WARNING, logger=compat.__name__):
        assert slime_aborting() is False
        assert slime_aborting() is False
    warnings = [r.getMessage() for r in caplog.records if r.name == compat.__name__]
    assert len(warnings) == 1 and "cannot see slime's abort" in warnings[0] and compat.CHECKED in warnings[0]
