"""ESS as an SGLang plugin: `pip install ess[sglang]`, then `python -m sglang.launch_server ... --enable-ess`.

SGLang finds `register` through the entry-point group `sglang.srt.plugins` and calls it in the launcher and in every
scheduler process (sglang.srt.plugins.load_plugins); `SGLANG_PLUGINS=ess` restricts loading to this plugin.
"""


def register() -> None:
    from sglang_ess.hooks.registry import install

    install()
