"""The SGLang plugin of ESS (`--enable-ess`). A stub until its issue: the ESS core lives in the `ess` package."""
