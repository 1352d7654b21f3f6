"""Fixtures of the plugin tests.

SGLang's GPU kernels of the DSA path are the plugin's CPU path here (sglang_ess.cpu: on a machine without CUDA
SGLang's plugin loader installs it with the plugin's hooks), as in the real server on a CPU: SGLang's own FP8 row
writer and pools, its indexer metadata and top-k, FlashMLA's interface computed in torch. No kernel is replaced by
the tests themselves.
"""

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


@pytest.fixture(autouse=True)
def environment():
    """Resolving a `--device cpu` launch of a DSA model sets the environment of SGLang's CPU engine for the process's
    future children (as the launcher does for its scheduler processes): each test gets the environment back as it
    found it. (sgl_kernel's stand-in, which the same resolution puts on the import path where sgl_kernel cannot load,
    stays: importing sgl_kernel fails here without it.)"""
    env = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(env)
