"""Every kernel of the serving path, by family; each family's first module is its interface, and each kernel has a
torch oracle that its tests hold it to (docs/architecture.md):

    flashtrans.py         FlashTrans: copy scattered 656-byte latent rows host <-> GPU by index lists (UVA gather /
                          scatter); also the backend choice every family shares (`kernel_backend`, `compiled`)
                          oracle: plain indexing
    lru_step.py           the LRU step as one Triton kernel (`lru_update_fused`)
    lru_step_cuda.py      the same step as one CUDA kernel (sgl-kernel/csrc/lru_step.cu; `lru_update_cuda`)
                          oracle of both: ess.core.policy.lru_update, byte for byte
    indexer.py            the decode Lightning Indexer over FP8 index-K rows or SGLang's pages, and its top-k
                          (`indexer_topk_fp8`, `indexer_scores_pages`); its selects:
    topk_select.py        radix select over 32-bit keys, one program per row (`radix_topk`)
    topk_split.py         the same split across programs, its first histogram written by the indexer (`split_topk`)
                          oracle: ess.core.dsa_math (index_scores, select_topk)
    miss_attention.py     DA's Attn1 over the misses only, the misses' copy fused with it, and the log-sum-exp merge
                          oracle: ess.core.dsa_math's sparse attention
    residency_map.py      residency first's step glue: resident entries to their regions' rows (`premask`,
                          `map_result`, `physical`); oracle: its own torch backend

A family runs its Triton kernels on a GPU, Triton's interpreter where asked ("interpret"), and torch on a CPU; the
CPU tests check the interpreter against the oracle, bit for bit where the math is integer.
"""
