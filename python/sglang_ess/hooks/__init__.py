"""ESS's hooks into SGLang 0.5.23, by concern (docs/plugin.md):
    registry.py  the table of every touch point and its registration through SGLang's HookRegistry (`install`)
    table.py     the table's row (`Hook`), shared by the CPU path's and the GPU rig's tables
    startup.py   the flags, the KV pool and its sizing, the device check, the runtime
    forward.py   a prefill batch's admission and staging, each forward and the DSA backend's calls, a request's
                 release, a disk-tier page lost, the state readout
    pd.py        PD disaggregation: warm-up metadata, the decode node's transfer queue, ordered sends, progress reports
    shared.py    what they share in one process (`state`)
"""
