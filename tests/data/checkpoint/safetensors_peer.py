"""Python's side of the safetensors tests (tests/unit/safetensors_test.cpp).

  safetensors_peer.py roundtrip IN OUT REPORT   load IN with safetensors.torch,
      save it again as OUT with Python's writer (same metadata), and describe
      every tensor in REPORT
  safetensors_peer.py make FILE DIR REPORT      write tensors of every dtype
      (seeded) as FILE and as a sharded folder DIR (index + shards, made by
      hand the way transformers lays them out), and describe them in REPORT
  safetensors_peer.py readdir DIR REPORT        read a sharded folder through
      its index with safetensors alone, and describe it

A description is {"metadata": {...}, "tensors": {name: {"dtype": "F32",
"shape": [...], "crc32": n}}}: CRC32 of the tensor's raw bytes, so C++ checks
each side bit for bit without a second reader.
"""
import json
import os
import sys
import zlib

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.complex64: "C64", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}


def describe(tensors, metadata):
    out = {}
    for name, t in tensors.items():
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        out[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "crc32": zlib.crc32(raw)}
    return {"metadata": metadata or {}, "tensors": out}


def write(report, description):
    with open(report, "w") as f:
        json.dump(description, f)


def random_bits(g, dtype, shape):
    """Any bit pattern of the dtype (NaN payloads, -0, subnormals); bools 0/1."""
    n = 1
    for s in shape:
        n *= s
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), generator=g, dtype=torch.uint8)
    if dtype == torch.bool:
        return (raw & 1).view(torch.bool).reshape(shape)
    return raw.view(dtype).reshape(shape)


def main():
    cmd = sys.argv[1]
    if cmd == "roundtrip":
        src, dst, report = sys.argv[2:5]
        with safe_open(src, "pt") as f:
            metadata = f.metadata()
        tensors = load_file(src)
        save_file(tensors, dst, metadata=metadata)
        write(report, describe(tensors, metadata))
    elif cmd == "make":
        file, folder, report = sys.argv[2:5]
        g = torch.Generator().manual_seed(26)
        shapes = [[3, 5], [7], [], [0, 4], [2, 3, 4]]
        tensors = {}
        for i, dtype in enumerate(NAMES):
            tensors[f"t.{NAMES[dtype].lower()}"] = random_bits(g, dtype, shapes[i % len(shapes)])
        metadata = {"format": "pt", "written_by": "python"}
        save_file(tensors, file, metadata=metadata)
        os.makedirs(folder, exist_ok=True)
        names = sorted(tensors)
        shards = [names[0::3], names[1::3], names[2::3]]
        weight_map, total = {}, 0
        for s, part in enumerate(shards):
            shard = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: tensors[n] for n in part}, os.path.join(folder, shard), metadata=metadata)
            for n in part:
                weight_map[n] = shard
                total += tensors[n].numel() * tensors[n].element_size()
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        write(report, describe(tensors, metadata))
    elif cmd == "readdir":
        folder, report = sys.argv[2:4]
        with open(os.path.join(folder, "model.safetensors.index.json")) as f:
            index = json.load(f)
        tensors, metadata = {}, None
        for shard in sorted(set(index["weight_map"].values())):
            path = os.path.join(folder, shard)
            with safe_open(path, "pt") as f:
                metadata = metadata or f.metadata()
            tensors.update(load_file(path))
        assert set(tensors) == set(index["weight_map"]), "index and shards disagree"
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        assert index["metadata"]["total_size"] == total, (index["metadata"], total)
        write(report, describe(tensors, metadata))
    else:
        sys.exit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
