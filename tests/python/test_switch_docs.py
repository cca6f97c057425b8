"""The CUDA kernels' environment switches stay in step across the code that reads them
(src/cuda/api.cu's resolve_policy), the strict parser's table (src/cuda/env_switch.h), the docs
(docs/kernels.md's switch list, src/cuda/policy.h) and the scripts and test paths that set them: a
switch renamed or removed in one place but not the others would be silently ignored."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SWITCH = re.compile(r"\bDUALKV_[A-Z0-9_]+")
SWITCH_DOCS = "docs/kernels.md"  # the user-facing list of the switches
# Variables of the build (DUALKV_CUDA*, DUALKV_BUILD_*: CMake), the CPU backend, the tests and the
# veRL engine's packing (dualkv.integrations.verl_grouping.PACKING_ENV), not kernel switches.
BUILD_PREFIXES = ("DUALKV_CUDA", "DUALKV_BUILD_")
NOT_KERNEL_SWITCHES = {
    "DUALKV_CPU_NO_AVX2",
    "DUALKV_VERL_PACKING",
    "DUALKV_SEED",
    "DUALKV_LIBRARY",
    "DUALKV_SKIP_CUDA_COMPILE",
}


def read(rel: str) -> str:
    path = ROOT / rel
    if not path.exists():
        pytest.skip(f"{rel} is not in this checkout (installed package only)")
    return path.read_text()


def read_switches() -> set[str]:
    """The switches resolve_policy reads (`is("NAME", ...)`)."""
    names = set(re.findall(r'\bis\("(DUALKV_[A-Z0-9_]+)"', read("src/cuda/api.cu")))
    assert names, "no switch found in resolve_policy: the pattern no longer matches api.cu"
    return names


def table(name: str) -> set[str]:
    """The names in env_switch.h's table `name` (kEnvSwitches or kRemovedSwitches)."""
    src = read("src/cuda/env_switch.h")
    body = src[src.index(name + "[]") :]
    body = body[: body.index("};")]
    return set(re.findall(r'\{\s*"(DUALKV_[A-Z0-9_]+)"', body))


def settings() -> dict[str, str]:
    """kEnvSwitches as {name: the digits it accepts}."""
    src = read("src/cuda/env_switch.h")
    body = src[src.index("kEnvSwitches[]") :]
    body = body[: body.index("};")]
    return dict(re.findall(r'\{\s*"(DUALKV_[A-Z0-9_]+)",\s*"([0-9]+)"\s*\}', body))


def test_every_switch_read_is_in_the_parser_table_and_documented() -> None:
    names = read_switches()
    assert names == table("kEnvSwitches")
    docs, policy = read(SWITCH_DOCS), read("src/cuda/policy.h")
    for name in names:
        assert name in docs, f"{name} is not in {SWITCH_DOCS}'s switch list"
        assert name in policy, f"{name} is not described in src/cuda/policy.h"


def test_removed_switches_are_not_read_but_warned_about() -> None:
    removed = table("kRemovedSwitches")
    assert {"DUALKV_ATOMIC_DQ", "DUALKV_SM90_WS", "DUALKV_SM90_BWD_VARIANT"} <= removed
    assert not removed & read_switches()
    docs = read(SWITCH_DOCS)
    for name in removed:
        assert name in docs, f"{SWITCH_DOCS} does not say that {name} was removed"


def test_scripts_and_test_paths_set_only_switches_that_exist() -> None:
    names = read_switches()
    sources = ["tests/cuda/dualkv_cuda_test.cpp", "scripts/gpu_check.sh"]
    sources += [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests/cuda").glob("*.sh"))]
    sources += [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests/python").glob("test_*.py"))]
    for rel in sources:
        text = read(rel)
        if rel.endswith("test_switch_docs.py"):
            continue
        # Settings: NAME=value in scripts, setenv("NAME" / {"NAME" in tables and monkeypatch.
        set_here = set(re.findall(r"\b(DUALKV_[A-Z0-9_]+)=", text))
        set_here |= set(re.findall(r'"(DUALKV_[A-Z0-9_]+)"', text))
        unknown = {n for n in set_here if not n.startswith(BUILD_PREFIXES)}
        unknown -= names | NOT_KERNEL_SWITCHES | table("kRemovedSwitches")
        assert not unknown, f"{rel} sets {sorted(unknown)}, which resolve_policy does not read"


def test_values_set_by_test_paths_and_scripts_are_accepted() -> None:
    """A value the parser does not accept reads as unset: the path would test the default."""
    accepted = settings()
    assert set(accepted) == read_switches()
    paths = re.findall(
        r'\{"([a-z0-9-]+)",\s*"(DUALKV_[A-Z0-9_]+)",\s*"([^"]*)"',
        read("tests/cuda/dualkv_cuda_test.cpp"),
    )
    assert len(paths) >= 5, "kPaths no longer matches the pattern"
    found = [(f"kPaths {p}", n, v) for p, n, v in paths]
    rels = ["scripts/gpu_check.sh"] + [
        str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests/cuda").glob("*.sh"))
    ]
    for rel in rels:
        for n, v in re.findall(r"\b(DUALKV_[A-Z0-9_]+)=([0-9A-Za-z_]*)", read(rel)):
            if n in accepted and not n.startswith(BUILD_PREFIXES):
                found.append((rel, n, v))
    for where, name, value in found:
        assert len(value) == 1 and value in accepted[name], (
            f"{where}: {name}={value!r} is not a setting of {name} ({accepted[name]})"
        )
