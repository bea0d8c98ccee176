#!/usr/bin/env python3
"""Converts between dtrain's full training state and Python's distributed
checkpoints (torch.distributed.checkpoint, DCP). Needs only torch; no build.

    # dtrain -> DCP (then dcp.load into any FSDP2 world size)
    dtrain ckpt convert --to torch ckpt/ full.pt        # or to_fsdp_state_dict + save_torch_file
    python python/dtrain_dcp.py to-dcp full.pt dcp/

    # DCP (e.g. written by FSDP2 on any world size) -> dtrain
    python python/dtrain_dcp.py from-dcp dcp/ full.pt
    #   C++: load_zero_full_state(sdp, optimizer, from_fsdp_state_dict(load_torch_file("full.pt")))

The torch.save file on dtrain's side holds get_state_dict(model, optimizer)'s
structure, whole: {"model": {name: tensor}, "optim": {"state": {name: {"step",
"exp_avg", ...}}, "param_groups": [{..., "params": [names]}]}}, which is what
FSDP2 programs save with dcp.save({"model": msd, "optim": osd}) (DCP's
tutorial layout). Other top-level keys are carried along unchanged.

Why Python: a DCP checkpoint's .metadata file is a pickle of torch's own
dataclasses (Metadata, TensorStorageMetadata, _StorageInfo, ...), private and
changing between torch versions; only torch writes and reads it soundly.
The conversion runs in one process (no process group): DCP records each
tensor as one chunk, and dcp.load reshards it onto any world size.
"""
import argparse
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def check_structure(state, where):
    """Raises ValueError unless `state` has the structure described above."""
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise ValueError(f"{where}: no dict under 'model' (expected {{'model': ..., 'optim': ...}})")
    bad = [k for k, v in state["model"].items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise ValueError(f"{where}: model entries that are not tensors: {bad[:5]}")
    optim = state.get("optim")
    if optim is None:
        return
    if not isinstance(optim, dict) or "state" not in optim or "param_groups" not in optim:
        raise ValueError(f"{where}: 'optim' is not an optimizer state dict (state, param_groups)")
    names = {n for g in optim["param_groups"] for n in g.get("params", [])}
    unknown = sorted(n for n in list(optim["state"]) + list(names) if n not in state["model"])
    if unknown:
        raise ValueError(f"{where}: optimizer entries for parameters the model lacks: {unknown[:5]} "
                         "(the optimizer state must be keyed by parameter names, as get_state_dict gives it)")


def to_dcp(torch_file, dcp_dir):
    state = torch.load(torch_file, weights_only=True, map_location="cpu")
    check_structure(state, torch_file)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=dcp_dir, no_dist=True)
    return state


def from_dcp(dcp_dir, torch_file):
    dcp_to_torch_save(dcp_dir, torch_file)
    state = torch.load(torch_file, weights_only=True, map_location="cpu")
    check_structure(state, dcp_dir)
    return state


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("to-dcp", help="a torch.save file of the full state -> a DCP folder")
    a.add_argument("src")
    a.add_argument("dst")
    b = sub.add_parser("from-dcp", help="a DCP folder -> a torch.save file of the full state")
    b.add_argument("src")
    b.add_argument("dst")
    args = parser.parse_args(argv)
    try:
        state = (to_dcp if args.command == "to-dcp" else from_dcp)(args.src, args.dst)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"dtrain_dcp: {e}", file=sys.stderr)
        return 1
    n_state = len(state.get("optim", {}).get("state", {}))
    print(f"wrote {args.dst}: {len(state['model'])} parameters, optimizer state of {n_state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
