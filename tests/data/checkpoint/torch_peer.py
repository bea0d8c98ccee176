"""Python's side of the torch.save tests (tests/unit/torch_file_test.cpp).

  torch_peer.py write DIR      torch.save's of a model.state_dict() (an
      OrderedDict with _metadata), of tensors of every dtype with views sharing
      a storage, non-contiguous ones and nested containers, and of a pickle
      naming a forbidden global; a description of each beside it (JSON)
  torch_peer.py check DIR      torch.load(weights_only=True) the files C++
      wrote there: the state dict of every dtype (against C++'s description)
      and the full checkpoint, which is loaded into a Python model and AdamW
      (load_state_dict: the structure is Python's) that then take one more
      step; the parameters after it are saved for C++ to compare with its own
      step. `write` also saves Python AdamW and SGD checkpoints after two
      steps and the parameters after a third, for C++ to resume.
"""
import json
import os
import pickle
import sys
import zlib

import torch

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.uint16, torch.uint32, torch.uint64]


def crc(t):
    return zlib.crc32(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def describe(tensors):
    return {name: {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape), "crc32": crc(t)}
            for name, t in tensors.items()}


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2))


def batch():
    return torch.linspace(-1, 1, 20).reshape(5, 4)


def write(d):
    m = model()
    torch.save(m.state_dict(), os.path.join(d, "state_dict.pt"))
    json.dump(describe(m.state_dict()), open(os.path.join(d, "state_dict.json"), "w"))

    g = torch.Generator().manual_seed(26)
    tensors = {}
    for dtype in DTYPES:
        raw = torch.randint(0, 256, (24 * torch.empty((), dtype=dtype).element_size(),), generator=g,
                            dtype=torch.uint8)
        if dtype == torch.bool:
            raw = raw & 1
        tensors[str(dtype).replace("torch.", "")] = raw.view(dtype).reshape(4, 6)
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors["view.transposed"] = base.t()             # non-contiguous
    tensors["view.row"] = base[2]                     # offset into a shared storage
    tensors["view.strided"] = base[:, ::2]
    tensors["scalar"] = torch.tensor(3.5)
    tensors["empty"] = torch.empty(0, 3)
    torch.save(tensors, os.path.join(d, "dtypes.pt"))
    json.dump(describe(tensors), open(os.path.join(d, "dtypes.json"), "w"))

    nested = {"step": 7, "lr": 0.25, "name": "gpt", "flags": [True, False, None], "betas": (0.9, 0.95),
              "big": 2**40, "neg": -3, "state": {0: {"t": torch.ones(2)}, 1: {"t": torch.zeros(1)}}}
    torch.save(nested, os.path.join(d, "nested.pt"))

    # Python training checkpoints for C++ to resume: AdamW and SGD (momentum,
    # nesterov) after two steps, and the parameters after a third.
    for name, make_opt in (("adamw", lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1)),
                           ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True))):
        m = model()
        opt = make_opt(m.parameters())
        for step in range(3):
            if step == 2:
                torch.save({"model": m.state_dict(), "optimizer": opt.state_dict()},
                           os.path.join(d, f"py_{name}_checkpoint.pt"))
            opt.zero_grad()
            m(batch()).square().sum().backward()
            opt.step()
        torch.save(m.state_dict(), os.path.join(d, f"py_{name}_after_third.pt"))

    class Evil:  # what weights_only refuses: an arbitrary class
        def __reduce__(self):
            return (os.system, ("echo should never run",))
    torch.save({"w": torch.ones(1), "x": Evil()}, os.path.join(d, "forbidden.pt"), pickle_module=pickle)


def check(d):
    sd = torch.load(os.path.join(d, "cpp_dtypes.pt"), weights_only=True)
    assert type(sd) is dict, type(sd)
    expected = json.load(open(os.path.join(d, "cpp_dtypes.json")))
    assert describe(sd) == expected, (describe(sd), expected)

    ckpt = torch.load(os.path.join(d, "cpp_checkpoint.pt"), weights_only=True)
    assert set(ckpt) == {"model", "optimizer", "step"}, set(ckpt)
    m = model()
    m.load_state_dict(ckpt["model"])  # strict: every name, every shape
    opt = torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1)
    opt.load_state_dict(ckpt["optimizer"])
    assert opt.state_dict()["param_groups"][0]["lr"] == 0.01
    assert float(opt.state_dict()["state"][0]["step"]) == ckpt["step"]
    opt.zero_grad()
    m(batch()).square().sum().backward()
    opt.step()
    torch.save(dict(m.state_dict()), os.path.join(d, "py_after_step.pt"))


if __name__ == "__main__":
    {"write": write, "check": check}[sys.argv[1]](sys.argv[2])
