"""Fixtures of the plugin tests."""

import os

import pytest


@pytest.fixture(scope="session")
def plugin():
    """SGLang's own plugin loader, restricted to ESS: its hooks then wrap the real sglang classes."""
    pytest.importorskip("sglang")
    os.environ["SGLANG_PLUGINS"] = "ess"
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang_ess import hooks

    return hooks
