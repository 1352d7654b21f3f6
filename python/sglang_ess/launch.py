"""ESS's settings of one launch (EssLaunch: the flags and what the launch checks resolved), carried on SGLang's
ServerArgs record into every process, and `ess_launch`, the one way to read them.

    parsed    ServerArgs.from_cli_args, in the launcher (`attach_flags`, from its hook): the ESS flags -> EssArgs
              (sglang_ess.args)
    resolved  SGLang's argument resolution, in the launcher (`resolution_step`, around its handle_other_validations):
              the checks against the model and the rest of the launch -> EssFacts (sglang_ess.validate)
    carried   ServerArgs is a msgspec Struct with a fixed field set, so ESS keeps its EssLaunch in one bookkeeping
              attribute, `server_args._ess`, which ServerArgs.__reduce__ pickles along to the scheduler processes
    read      `ess_launch(server_args)`, by every reader: the KV cache configurator's hooks (the pool's sizing), the
              device check before the load, the runtime
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from sglang_ess.args import EssArgs, from_namespace
from sglang_ess.validate import EssFacts, check_device_capacity, validate_model

ATTR = "_ess"


@dataclasses.dataclass(frozen=True)
class EssLaunch:
    args: EssArgs = EssArgs()  # the flags as parsed
    facts: EssFacts | None = None  # what the launch checks resolved; None while ESS is off, and before SGLang resolves

    @property
    def on(self) -> bool:
        return self.args.enable


OFF = EssLaunch()


def ess_launch(server_args: Any) -> EssLaunch:
    """ESS's settings of a ServerArgs record. ESS is off (`on` False) unless it was launched with --enable-ess: OFF
    for a record built elsewhere (Engine(...), which takes no ESS flag). SGLang resolves a record in the launcher,
    before any scheduler process receives it, so there an ESS launch has its facts."""
    return getattr(server_args, ATTR, None) or OFF


def attach_flags(server_args: Any, namespace: argparse.Namespace) -> None:
    """SGLang made the record from a command line: its ESS flags ride on it."""
    setattr(server_args, ATTR, EssLaunch(from_namespace(namespace)))


def validate_server_args(server_args: Any) -> EssFacts | None:
    """The launch checks of a record, against its model and its resolved settings; None when ESS is off."""
    launch = ess_launch(server_args)
    if not launch.on:
        return None
    from sglang.srt.arg_groups.overrides import model_config_of, resolving_view

    return validate_model(launch.args, resolving_view(server_args), model_config_of(server_args).hf_config)


def resolution_step(server_args: Any, previous) -> None:
    """Registered around SGLang's `handle_other_validations`: the launch's checks, once, in the launcher; their facts
    ride on the record from here on."""
    previous(server_args)
    facts = validate_server_args(server_args)
    if facts is None:
        return
    setattr(server_args, ATTR, dataclasses.replace(ess_launch(server_args), facts=facts))
    if facts.role != "pd-prefill":
        from sglang.srt.arg_groups.overrides import resolving_view

        check_device_capacity(resolving_view(server_args), facts)
