"""Ray's private switch (engine/local/ray_compat.py), on the Ray that is installed.

The `ray` extra allows Ray >= 2.9; this runs on whichever Ray the environment holds (CI: the
version pip resolves) and checks what the test cluster relies on: that the switch exists, that
Ray's own choice of this node's address follows it, and that both copies are put back.
"""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed")

from engine.local import ray_compat  # noqa: E402


def test_the_switch_puts_this_node_on_loopback_and_is_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray._private import ray_constants, services

    assert not ray.is_initialized()  # the address is then Ray's choice, made from the switch
    monkeypatch.delenv(ray_compat.SWITCH_ENV, raising=False)
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    with ray_compat.clusters_disabled():
        assert services.get_node_ip_address() == "127.0.0.1"
        assert os.environ[ray_compat.SWITCH_ENV] == "0" and ray_constants.ENABLE_RAY_CLUSTER is False
    assert ray_constants.ENABLE_RAY_CLUSTER is True and ray_compat.SWITCH_ENV not in os.environ


def test_a_ray_without_the_switch_is_refused_by_version(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray._private import ray_constants

    monkeypatch.delattr(ray_constants, "ENABLE_RAY_CLUSTER")
    monkeypatch.setenv(ray_compat.SWITCH_ENV, "1")
    with pytest.raises(RuntimeError, match=f"Ray {ray.__version__} has no ray_constants.ENABLE_RAY_CLUSTER"):
        with ray_compat.clusters_disabled():
            pass
    assert os.environ[ray_compat.SWITCH_ENV] == "1"  # nothing changed
