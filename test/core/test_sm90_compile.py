"""The indexer's Triton kernels compiled for an H100 / H200 (sm_90) with no GPU: Triton's own compiler and ptxas, the
configurations the interpreter cannot vouch for (it runs the same source, but not Triton's type checks and lowering
of each constexpr branch). Compile only; what they compute is checked through the interpreter in
test_indexer_kernel.py and test_topk_select.py, and on a GPU by their CUDA tests."""

import pytest

from ess.core import layout
from ess.core.kernels import flashtrans, indexer, topk_select, topk_split

pytestmark = pytest.mark.skipif(not flashtrans.INTERPRETER_OK, reason="needs Triton >= 3.8 (the pinned torch's)")

SM90 = ("cuda", 90, 32)

SCORES_SIG = {"q_ptr": "*bf16", "w_ptr": "*fp32", "rows": "*u8", "loc": "*i32", "pos_ptr": "*i64", "out": "*fp32",
              "hist": "*i32", "T": "i32", "H": "i32", "row_n": "i64", "row_t": "i64", "loc_n": "i32", "loc_t": "i32"}
SCORES = dict(D=layout.INDEX_DIM, SCALE_OFFSET=layout.INDEX_SCALE_OFFSET, BLOCK_T=indexer.BLOCK_T, BLOCK_H=64,
              PAGED=False, KEYS=False, UPCAST=False, PRECISION=None, WORDS=False, HIST=False,
              HIST_STRIDE=topk_split.WORK, PAGE=0, STARTS=False, SPAN=indexer.SPAN)


def compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int = 4):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature) | {name: "constexpr" for name in constexprs}
    src = ASTSource(triton.jit(fn), sig, constexprs)
    return triton.compile(src, target=GPUTarget(*SM90), options={"num_warps": num_warps})


@pytest.mark.parametrize("name,change", [
    ("rows, fp32 scores", {}),
    ("rows, int64 keys", {"KEYS": True}),
    ("token table, 4-byte word loads", {"PAGED": True, "WORDS": True}),
    ("fused first histogram", {"HIST": True}),
    ("four blocks a program, fused histogram", {"SPAN": 4, "HIST": True}),
    ("four blocks a program, int64 keys", {"SPAN": 4, "KEYS": True}),
    ("SGLang's pages", {"PAGE": layout.INDEX_PAGE_TOKENS}),
    ("prefill's windows", {"STARTS": True}),
])
def test_the_indexer_kernel_compiles_for_sm90(name, change):
    sig = SCORES_SIG | ({"out": "*i64"} if change.get("KEYS") else {})
    assert compile_sm90(indexer._scores_kernel, sig, SCORES | change).asm["cubin"], name


def test_the_radix_selects_compile_for_sm90():
    compile_sm90(topk_select._select_kernel, {"scores": "*fp32", "pos_ptr": "*i64", "out": "*i64", "T": "i32",
                                              "K": "i32"}, {"BLOCK": topk_select.BLOCK})
    sig = {"scores": "*fp32", "pos_ptr": "*i64", "work": "*i32", "out": "*i64", "T": "i32", "K": "i32"}
    for p in range(topk_split.PASSES + 1):  # the passes, then the write
        compile_sm90(topk_split._pass_kernel, sig, {"PASS": p, "WRITE": p == topk_split.PASSES,
                                                    "WORK": topk_split.WORK, "CHUNK": topk_split.CHUNK,
                                                    "BLOCK": topk_split.BLOCK})
