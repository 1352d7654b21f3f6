import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def plugin():
    """SGLang's own plugin loader, restricted to ESS: its hooks then wrap the real sglang classes."""
    pytest.importorskip("sglang")
    os.environ["SGLANG_PLUGINS"] = "ess"
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang_ess import hooks

    return hooks
