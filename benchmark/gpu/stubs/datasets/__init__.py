"""A stand-in for Hugging Face `datasets` on the GPU machine (benchmark/gpu/server.sh puts it on the path):
sglang.benchmark.serving imports it at start for its MMMU dataset only; the server benchmark uses random-ids."""


def load_dataset(*args, **kwargs):
    raise NotImplementedError("datasets is not installed on the GPU machine (a stand-in for sglang.benchmark.serving's "
                              "import); use --dataset-name random-ids")
