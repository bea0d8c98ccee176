"""transformers' side of the GPT's Hugging Face export/import tests
(tests/unit/gpt_hf_test.cpp).

  hf_peer.py check DIR   GPT2LMHeadModel.from_pretrained(DIR) must report no
      missing, unexpected or mismatched keys and log no warning; its logits on
      DIR/reference.safetensors' batch must equal dtrain's there (rtol 1e-5),
      and its greedy continuation of the prompt the same tokens
  hf_peer.py make DIR    a random GPT2LMHeadModel (gelu_new, perturbed
      biases and norms, no download) saved with save_pretrained, with its
      logits on a batch in DIR/reference.safetensors
  hf_peer.py train DIR   the same model saved to DIR, then 5 AdamW steps on
      the batches in DIR/batches.safetensors (written here), the trained model
      saved to DIR/trained; the same steps on each batch's two halves with
      their gradients averaged saved to DIR/trained_halves
"""
import logging
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())


def greedy(model, prompt, steps, block):
    out = prompt
    for _ in range(steps):
        logits = model(out[:, -block:]).logits
        out = torch.cat([out, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out


def check(d):
    collect = Collect()
    hf_logging.get_logger("transformers").addHandler(collect)
    model, info = GPT2LMHeadModel.from_pretrained(d, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"loading info: {problems}"
    assert not collect.records, f"transformers warned: {collect.records}"
    model.eval()
    ref = load_file(f"{d}/reference.safetensors")
    with torch.no_grad():
        logits = model(ref["idx"]).logits
        diff = (logits - ref["logits"]).abs().max().item()
        assert torch.allclose(logits, ref["logits"], rtol=1e-5, atol=1e-6), f"logits differ by {diff}"
        tokens = greedy(model, ref["prompt"], ref["greedy"].shape[1] - ref["prompt"].shape[1],
                        model.config.n_positions)
    assert torch.equal(tokens, ref["greedy"]), (tokens, ref["greedy"])
    print(f"transformers: logits max |diff| {diff:.3g}, greedy tokens equal")


def random_gpt2():
    torch.manual_seed(5)
    config = GPT2Config(vocab_size=65, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for p in model.parameters():  # biases and norms away from 0 and 1, so a misplaced one shows
            p.add_(torch.randn_like(p) * 0.05)
    return model


TRAIN_STEPS, TRAIN_BATCH = 5, 4


def train(d):
    """5 steps of AdamW (lr 1e-3, betas (0.9, 0.95), weight decay 0.1 on every
    parameter) on cross-entropy over all positions: gpt_hf_test.cpp runs the
    same steps in dtrain under ZeRO-3."""
    model = random_gpt2()
    model.save_pretrained(d)
    gen = torch.Generator().manual_seed(9)
    batches = {}
    for s in range(TRAIN_STEPS):
        batches[f"x{s}"] = torch.randint(0, 65, (TRAIN_BATCH, 16), generator=gen)
        batches[f"y{s}"] = torch.randint(0, 65, (TRAIN_BATCH, 16), generator=gen)
    save_file(batches, f"{d}/batches.safetensors")
    # The reference on the whole batch, and the same steps with each batch in
    # two halves whose gradients are averaged (the arithmetic of 2 data-parallel
    # ranks): their spread is how far two exact-in-theory orders of summation
    # drift apart in 5 Adam steps, the test's allowance beyond its rtol.
    for halves, out in ((1, "trained"), (2, "trained_halves")):
        model = random_gpt2()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
        model.train()
        for s in range(TRAIN_STEPS):
            opt.zero_grad()
            for x, y in zip(batches[f"x{s}"].chunk(halves), batches[f"y{s}"].chunk(halves)):
                logits = model(x).logits
                (torch.nn.functional.cross_entropy(logits.reshape(-1, 65), y.reshape(-1)) / halves).backward()
            opt.step()
        model.save_pretrained(f"{d}/{out}")
    print(f"transformers: trained {TRAIN_STEPS} steps")


def make(d):
    model = random_gpt2()
    model.eval()
    model.save_pretrained(d)
    idx = torch.randint(0, 65, (3, 16))
    with torch.no_grad():
        save_file({"idx": idx, "logits": model(idx).logits.contiguous()}, f"{d}/reference.safetensors")


if __name__ == "__main__":
    hf_logging.disable_progress_bar()
    {"check": check, "make": make, "train": train}[sys.argv[1]](sys.argv[2])
