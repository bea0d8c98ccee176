"""The Python peer of bench/dataloader/dataloader_bench.cpp: torch.utils.data.DataLoader
over the same Fashion-MNIST data, normalisation and per-example augmentation."""
import gzip
import json
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

DATA = "/usr/share/datasets/fashion-mnist"
MEAN, STD = 0.2860, 0.3530


def read_idx(path):
    with gzip.open(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


class Augmented(Dataset):
    def __init__(self):
        images = torch.from_numpy(read_idx(f"{DATA}/train-images-idx3-ubyte.gz").copy())
        self.images = ((images.float() / 255.0 - MEAN) / STD).unsqueeze(1).contiguous()
        self.labels = torch.from_numpy(read_idx(f"{DATA}/train-labels-idx1-ubyte.gz").astype(np.int64))

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        img = self.images[i]
        if ((i * 2654435761) >> 7) & 1:
            img = img.flip(2)
        dy, dx = i % 5, (i // 5) % 5
        img = F.pad(img, (2, 2, 2, 2))[:, dy:dy + 28, dx:dx + 28].contiguous()
        return img, self.labels[i]


def main():
    torch.set_num_threads(1)
    batches = int(sys.argv[1]) if len(sys.argv) > 1 else 450
    data = Augmented()
    for workers in (0, 1, 2):
        for persistent in (False, True):
            if workers == 0 and persistent:
                continue
            loader = DataLoader(data, batch_size=64, shuffle=True, drop_last=True, num_workers=workers,
                                persistent_workers=persistent, generator=torch.Generator().manual_seed(0))
            samples, first = 0, [0.0, 0.0]
            start = time.perf_counter()
            for epoch in range(2):
                epoch_start = time.perf_counter()
                for b, (x, _) in enumerate(loader):
                    if b == 0:
                        first[epoch] = (time.perf_counter() - epoch_start) * 1e3
                    samples += x.shape[0]
                    if b + 1 >= batches:
                        break
            seconds = time.perf_counter() - start
            case = f"w{workers}" + ("" if workers == 0 else ("_persistent" if persistent else "_fresh"))
            print(json.dumps({"impl": "torch DataLoader", "case": case, "samples_per_second": round(samples / seconds, 1),
                              "first_batch_ms": round(first[0], 3), "second_epoch_first_batch_ms": round(first[1], 3)}),
                  flush=True)
            del loader


if __name__ == "__main__":
    main()
