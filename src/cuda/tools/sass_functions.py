"""Kernel-by-kernel comparison of two SASS dumps of `sass_compare.sh dump` (no GPU needed).

    python3 src/cuda/tools/sass_functions.py OLD_DUMP NEW_DUMP [--rename 'REGEX=>REPL' ...]

`sass_compare.sh cmp` compares whole translation units; after a change that deletes or renames
kernels (a template parameter that becomes a bool, a variant removed) the units differ although
the surviving kernels do not. This compares each kernel's code instead, keyed by listing (unit
and architecture: the same kernel can compile differently in another unit) and demangled name
(c++filt); --rename rewrites OLD's demangled names first (Python re.sub, applied in
order), so that e.g. `dkdv_ws_kernel_sm90<T, 128, false, 5>` can be matched with the new
`dkdv_ws_kernel_sm90<T, 128, false, true>`. The logits.cu anonymous-namespace hash is masked, and
runs of white space are collapsed (the column padding depends on the whole listing).
Prints the kernels
identical, different, only in OLD (deleted) and only in NEW; exit status 1 when any differ.
"""

import argparse
import hashlib
import re
import subprocess
import sys
from pathlib import Path

FUNC = re.compile(r"^\s*Function : (\S+)\s*$")
ANON = re.compile(r"_GLOBAL__N__[0-9a-f]{8}_")
SPACES = re.compile(r"\s+")


def kernels(dump: Path) -> dict[tuple[str, str], str]:
    """(listing, mangled name) -> the md5 of its code."""
    out: dict[tuple[str, str], str] = {}
    for f in sorted(dump.glob("*.sass")):
        arch = f.name.removesuffix(".sass")
        name: str | None = None
        body: list[str] = []
        for line in [*f.read_text().splitlines(), "Function : <end>"]:
            m = FUNC.match(line)
            if m:
                if name is not None:
                    code = ANON.sub("_GLOBAL__N__H_", "".join(body)).encode()
                    out[(arch, ANON.sub("_GLOBAL__N__H_", name))] = hashlib.md5(code).hexdigest()
                name, body = m.group(1), []
            elif name is not None:
                # cuobjdump pads the columns to the listing's widest instruction: spacing differs
                # between listings.
                body.append(SPACES.sub(" ", line.strip()) + "\n")
    return out


def demangle(names: list[str]) -> dict[str, str]:
    if not names:
        return {}
    res = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    return dict(zip(names, res.stdout.splitlines(), strict=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--rename", action="append", default=[], help="REGEX=>REPL on OLD's names")
    args = ap.parse_args()
    old, new = kernels(args.old), kernels(args.new)
    dm = demangle(sorted({n for _, n in old} | {n for _, n in new}))
    rules = [r.split("=>", 1) for r in args.rename]

    def rename(n: str) -> str:
        for pat, repl in rules:
            n = re.sub(pat, repl, n)
        return n

    o = {(a, rename(dm[n])): h for (a, n), h in old.items()}
    n_ = {(a, dm[n]): h for (a, n), h in new.items()}
    same = sorted(k for k in o if k in n_ and o[k] == n_[k])
    diff = sorted(k for k in o if k in n_ and k not in same)
    gone = sorted(k for k in o if k not in n_)
    added = sorted(k for k in n_ if k not in o)
    for title, keys in (("DIFFERENT", diff), ("only in old", gone), ("only in new", added)):
        for a, k in keys:
            print(f"{title}: {a} {k}")
    print(
        f"identical: {len(same)} kernels; different: {len(diff)}; "
        f"only in old (deleted): {len(gone)}; only in new: {len(added)}"
    )
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
