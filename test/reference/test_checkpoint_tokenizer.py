"""The tiny checkpoint's tokenizer (ess.reference.checkpoint), loaded as SGLang loads it (transformers'
PreTrainedTokenizerFast from the written files): every id of the model's vocabulary, DeepSeek-V3.2's 129,280 at full
width, decodes to text of its own, appended to the text before it, so a serving benchmark sees every token."""

import random

import pytest

from ess.core import dsv32
from ess.reference import checkpoint

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("size", [checkpoint.VOCAB, dsv32.CONFIG["vocab_size"]])
def test_every_id_decodes_to_text_of_its_own(tmp_path, size):
    checkpoint.write_tokenizer(str(tmp_path), size, 4096)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == tok.vocab_size == size
    texts = tok.batch_decode([[i] for i in range(size)], skip_special_tokens=True)
    assert all(texts) and len(set(texts)) == size
    rng = random.Random(0)
    ids = [rng.randrange(size) for _ in range(64)]
    # what SGLang streams: each token's text appended to the text so far (no clean-up, no held-back bytes)
    assert all(tok.decode(ids[: n + 1]) == tok.decode(ids[:n]) + texts[ids[n]] for n in range(len(ids)))
    assert tok.decode(tok.encode("Hi, there!\n", add_special_tokens=False)) == "Hi, there!\n"
    assert tok.convert_ids_to_tokens(tok.encode("é", add_special_tokens=False)) == [checkpoint.UNK]


def test_the_checkpoint_s_tokenizer_is_its_vocabulary(tmp_path):
    checkpoint.write(str(tmp_path), seed=0)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == checkpoint.config()["vocab_size"] == checkpoint.VOCAB
