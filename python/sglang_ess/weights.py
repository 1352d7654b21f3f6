"""The bytes a checkpoint's weights take, read from its safetensors headers before anything loads, for the launch's
device-memory check (sglang_ess.sizing.check_device_budget; docs/plugin.md, "Sizing").

A safetensors file starts with an 8-byte little-endian header length and a JSON header that gives each tensor's
`data_offsets` (the format's own specification); the header alone is read, a few kB per file, never the tensors."""

from __future__ import annotations

import glob
import json
import os
import re
import struct

HEADER_LENGTH = struct.Struct("<Q")
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class CheckpointError(ValueError):
    """A weights file that is not a safetensors file; the message names it."""


def tensor_bytes(path: str) -> dict[str, int]:
    """Each tensor of one safetensors file and the bytes its data takes."""
    with open(path, "rb") as f:
        head = f.read(HEADER_LENGTH.size)
        size = os.fstat(f.fileno()).st_size
        if len(head) < HEADER_LENGTH.size or HEADER_LENGTH.unpack(head)[0] > size - HEADER_LENGTH.size:
            raise CheckpointError(f"{path}: not a safetensors file (its header length does not fit the file)")
        try:
            header = json.loads(f.read(HEADER_LENGTH.unpack(head)[0]))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: not a safetensors file (its header is not JSON: {e})") from e
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
        except (TypeError, KeyError, ValueError) as e:
            raise CheckpointError(f"{path}: tensor {name!r} has no data_offsets [begin, end]") from e
        out[name] = int(end) - int(begin)
    return out


def checkpoint_weight_bytes(model_path: str, num_layers: int, with_mtp: bool) -> int | None:
    """Bytes of the weights a launch loads from model_path's safetensors files: every tensor but the MTP layers'
    (`model.layers.N.` with N >= num_layers, which only a speculative MTP launch loads). None where model_path is not
    a local directory of safetensors files (a hub name: the weights are not on this disk before the download)."""
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors"))) if os.path.isdir(model_path) else []
    if not files:
        return None
    total = 0
    for path in files:
        for name, n in tensor_bytes(path).items():
            layer = LAYER.match(name)
            if with_mtp or layer is None or int(layer.group(1)) < num_layers:
                total += n
    return total
