"""The one-time, mechanical rename of issue 39: the project's top-level packages (core, kernels,
stages, flows, registry, benchmarks) become posttrain.core, posttrain.kernels, ... The folders stay
where they are; pyproject.toml maps them (setuptools package-dir). Run once from the repository
root on a clean tree:

    python scripts/rename_namespace.py [--dry-run]

What it rewrites, in every tracked text file but benchmarks/results/ (records of past runs) and
this script:
  * import statements: `import core.x`, `from flows import y`, `from stages.launch.config import z`;
  * dotted names anywhere else (module strings for `-m`, torchrun, Slurm and Kubernetes templates,
    monkeypatch targets, docs) when they name a real module of ours: the whole name, or a module
    deeper than the top package followed by attributes (`flows.pipeline.launch_stage`). A name
    whose only module is the top package itself (`registry.model_name`, `kernels.append`: config
    keys, local variables) is left alone, as is one preceded by a dot or a word character
    (`torch.kernels`, `cfg.registry.x`).
It prints every rewritten name outside import statements with its count, for review.

What it cannot see: `import kernels` bound the name `kernels`; `import posttrain.kernels` binds
`posttrain`. A later `kernels.f(...)` (an attribute of the top package itself, not a module) is
left as it was and fails with a NameError; pyflakes finds these in files (there were none), and one
was in a script held in a string (tests/kernels/test_without_triton.py), fixed by hand.
"""

from __future__ import annotations

import argparse
import re
import subprocess
from collections import Counter
from pathlib import Path

TOP = ("core", "kernels", "stages", "flows", "registry", "benchmarks")
NS = "posttrain"
SKIP = ("benchmarks/results/", "scripts/rename_namespace.py")
TEXT = (".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".j2", ".json", ".txt", ".cfg", ".ini", ".sql")
TEXT_NAMES = ("Makefile", "Dockerfile", "run", ".gitignore")


def modules(root: Path) -> set[str]:
    """Every module and package of ours, by dotted name."""
    out = set()
    for top in TOP:
        for f in (root / top).rglob("*.py"):
            parts = f.relative_to(root).with_suffix("").parts
            out.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


_MOD = rf"(?:{'|'.join(TOP)})(?:\.\w+)*"
FROM = re.compile(rf"^(\s*from\s+)({_MOD})(?=\s+import\b)", re.M)
IMPORT = re.compile(rf"^(\s*import\s+)({_MOD})(?=(?:\s+as\s+\w+)?\s*(?:[,;#]|$))", re.M)
DOTTED = re.compile(rf"(?<![\w./-])((?:{'|'.join(TOP)})(?:\.[A-Za-z_]\w*)+)")


def rewrite(text: str, mods: set[str], seen: Counter) -> str:
    for statement in (FROM, IMPORT):
        text = statement.sub(lambda m: f"{m.group(1)}{NS}.{m.group(2)}", text)

    def dotted(m: re.Match) -> str:
        name = m.group(1)
        parts = name.split(".")
        prefix = next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in mods), None)
        if prefix is None or "." not in prefix:
            return name
        seen[name] += 1
        return f"{NS}.{name}"

    return DOTTED.sub(dotted, text)


def files(root: Path) -> list[Path]:
    listed = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    return [root / f for f in listed if not f.startswith(SKIP)
            and (f.endswith(TEXT) or Path(f).name in TEXT_NAMES)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    root = Path.cwd()
    mods = modules(root)
    seen: Counter = Counter()
    changed = 0
    for f in files(root):
        old = f.read_text()
        new = rewrite(old, mods, seen)
        if new != old:
            changed += 1
            if not args.dry_run:
                f.write_text(new)
    for name, n in sorted(seen.items()):
        print(f"{n:4d}  {name}")
    print(f"{changed} files {'would change' if args.dry_run else 'changed'}")


if __name__ == "__main__":
    main()
