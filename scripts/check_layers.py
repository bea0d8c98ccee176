#!/usr/bin/env python3
"""Fails (exit 1) when a dtrain source includes a layer above its own.

The library is layered (docs/architecture.md, "Layers"): each layer may
include its own files and those of the layers listed for it below, never a
layer above, and tools/ includes only public headers (no ../../src). The
build runs this before compiling libdtrain (src/CMakeLists.txt, target
dtrain_layer_check), so an include that goes up a layer fails the build,
naming the file, the line and both layers.

    scripts/check_layers.py [ROOT]

Both include forms are checked: "dtrain/<layer>/..." (public headers) and
relative ones ("../core/torch_compat.h"), resolved from the including file.
"""
import pathlib
import re
import sys

# Layer -> the layers it may include (besides itself). "core" is
# include/dtrain/*.h and src/core/.
ALLOWED = {
    "core": set(),
    "comm": {"core"},
    "dist": {"core", "comm"},
    "amp": {"core", "comm"},
    "data": {"core", "comm"},
    "elastic": {"core", "comm"},
    "nn": {"core", "comm", "dist", "amp"},
    "checkpoint": {"core", "comm", "dist", "data"},
    "parallel": {"core", "comm", "dist", "amp", "nn", "data", "checkpoint"},
    "plan": {"core", "comm", "parallel"},
    "trainer": {"core", "comm", "dist", "amp", "nn", "data", "checkpoint", "parallel", "plan", "elastic"},
    "tools": {"core", "comm", "dist", "amp", "nn", "data", "checkpoint", "parallel", "plan", "elastic", "trainer"},
}
# The umbrella header includes everything by design.
UMBRELLA = "include/dtrain/dtrain.h"
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def layer_of(rel: pathlib.PurePosixPath):
    """The layer of a repository-relative path, or None outside the library."""
    parts = rel.parts
    if parts[:2] == ("include", "dtrain"):
        return "core" if len(parts) == 3 else parts[2]
    if parts[:1] == ("src",) and len(parts) >= 3:
        return parts[1]
    if parts[:1] == ("tools",):
        return "tools"
    return None


def main() -> int:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent)
    root = root.resolve()
    errors = []
    files = [p for d in ("include/dtrain", "src", "tools") for p in (root / d).rglob("*")
             if p.suffix in (".h", ".hpp", ".cpp") and p.is_file()]
    for path in sorted(files):
        rel = pathlib.PurePosixPath(path.relative_to(root).as_posix())
        if str(rel) == UMBRELLA:
            continue
        own = layer_of(rel)
        if own not in ALLOWED:
            errors.append(f"{rel}: not in a known layer ({own}); add it to scripts/check_layers.py")
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            match = INCLUDE.match(line)
            if not match:
                continue
            name = match.group(1)
            if name.startswith("dtrain/"):
                target = pathlib.PurePosixPath("include") / name
            else:
                resolved = (path.parent / name).resolve()
                if not resolved.is_relative_to(root):
                    continue
                target = pathlib.PurePosixPath(resolved.relative_to(root).as_posix())
                if own == "tools" and target.parts[:1] == ("src",):
                    errors.append(f"{rel}:{number}: tools include a private library header ({name}); "
                                  "use a public header under include/dtrain")
                    continue
            theirs = layer_of(target)
            if theirs is None or theirs == own:
                continue
            if theirs not in ALLOWED.get(own, set()):
                errors.append(f"{rel}:{number}: the {own} layer includes {name}, of the {theirs} layer above it "
                              f"({own} may include: {', '.join(sorted(ALLOWED[own])) or 'nothing else'})")
    for e in errors:
        print(f"check_layers: {e}", file=sys.stderr)
    if errors:
        print("check_layers: move the code to the lower layer, or pass what it needs down "
              "(docs/architecture.md, \"Layers\")", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
