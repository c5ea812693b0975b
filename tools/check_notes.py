#!/usr/bin/env python3
"""Checks the Notes convention (STYLE: PyTorch's): a `Note [Name]` line with a `~~~~` line under
it, as long as the title, defines the Note once; every `Note [Name]` written elsewhere names one
that is defined. Comment markers (//, #) and indentation before either line are allowed.

    tools/check_notes.py              # the repository's tracked sources and docs
    tools/check_notes.py --self-test  # checks that planted mistakes are caught
"""

from __future__ import annotations

import collections
import pathlib
import re
import subprocess
import sys
import tempfile

_SUFFIXES = {".h", ".cpp", ".cu", ".py", ".md", ".sh", ".txt", ".cmake", ".toml"}
_LEAD = r"^\s*(?://|#)?\s*"
_TITLE = re.compile(_LEAD + r"Note \[([^\]]+)\]\s*$")
_TILDES = re.compile(_LEAD + r"(~{3,})\s*$")
_REF = re.compile(r"Note \[([^\]]+)\]")
_EXAMPLE = "Name"  # the convention's own wording in docs (`Note [Name]`)


def check(files: list[pathlib.Path], root: pathlib.Path) -> list[str]:
    defined: dict[str, list[str]] = collections.defaultdict(list)
    refs: dict[str, list[str]] = collections.defaultdict(list)
    errors = []
    for path in files:
        try:
            lines = path.read_text(encoding="utf-8").split("\n")
        except (OSError, UnicodeDecodeError):
            continue
        where = path.relative_to(root)
        for i, line in enumerate(lines):
            title = _TITLE.match(line)
            tildes = _TILDES.match(lines[i + 1]) if title and i + 1 < len(lines) else None
            if title and tildes:
                name = title.group(1)
                defined[name].append(f"{where}:{i + 1}")
                want = len(f"Note [{name}]")
                if len(tildes.group(1)) != want:
                    errors.append(
                        f"{where}:{i + 2}: the ~ line under Note [{name}] has "
                        f"{len(tildes.group(1))} ~, the title {want} characters"
                    )
                continue
            for name in _REF.findall(line):
                refs[name].append(f"{where}:{i + 1}")
    for name, places in sorted(defined.items()):
        if len(places) > 1:
            errors.append(f"Note [{name}] is defined {len(places)} times: {', '.join(places)}")
    for name, places in sorted(refs.items()):
        if name not in defined and name != _EXAMPLE:
            errors.append(f"{places[0]}: Note [{name}] is named but defined nowhere")
    return errors


def tracked(root: pathlib.Path) -> list[pathlib.Path]:
    """The sources git tracks; without git (a copied tree), every such file outside build
    folders and .deps."""
    try:
        out = subprocess.run(
            ["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        skip = ("build", ".deps", ".git", ".cache")
        out = [
            str(p.relative_to(root))
            for p in root.rglob("*")
            if p.is_file() and not p.relative_to(root).parts[0].startswith(skip)
        ]
    me = pathlib.Path(__file__).resolve()  # its own planted mistakes are not the repository's
    return [
        root / f
        for f in out
        if pathlib.Path(f).suffix in _SUFFIXES
        and not f.startswith("bench/results/")
        and (root / f).resolve() != me
    ]


def self_test() -> int:
    with tempfile.TemporaryDirectory() as d:
        root = pathlib.Path(d)
        (root / "a.h").write_text(
            "// Note [Good]\n// ~~~~~~~~~~~\n// text\n"
            "// Note [Twice]\n// ~~~~~~~~~~~~\n"
            "// Note [Short tildes]\n// ~~~~~\n"
            "// See Note [Good] and Note [Missing].\n"
        )
        (root / "b.py").write_text("# Note [Twice]\n# ~~~~~~~~~~~~\n")
        errors = check([root / "a.h", root / "b.py"], root)
    want = ["Note [Twice] is defined 2 times", "under Note [Short tildes]", "Note [Missing]"]
    missed = [w for w in want if not any(w in e for e in errors)]
    if missed or len(errors) != len(want):
        print(f"check_notes self-test FAILED: missed {missed}, got {errors}")
        return 1
    print(f"check_notes self-test: {len(want)} planted mistakes caught")
    return 0


def main() -> int:
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    root = pathlib.Path(__file__).resolve().parent.parent
    files = tracked(root)
    errors = check(files, root)
    for e in errors:
        print(e)
    if errors:
        return 1
    print(f"check_notes: {len(files)} files, every Note defined once and every one named defined")
    return 0


if __name__ == "__main__":
    sys.exit(main())
