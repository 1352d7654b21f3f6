"""ESS across PD disaggregation (docs/pd.md, "LRU-Warmup with PD" and "Progressive PD transfer"):
    warmup.py    LRU-Warmup over the wire: the warm-up state a prefill node sends in the request's metadata
    sending.py   progressive transfer, the prefill node: a request's last chunk in ordered parts, each reported
    landing.py   progressive transfer, the decode node: a request joins once its warm-up pages landed, a step waits
                 for the rows it reads
    engines.py   the transfer engines behind one interface (SGLang's Mooncake and NIXL), and ESS's messages on them
    state.py     what the PD code of one process shares across SGLang's threads, behind one lock
SGLang reaches these through ESS's hooks (sglang_ess.hooks.pd).
"""
