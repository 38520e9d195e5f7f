"""What `--model` names for the bench: a model file or directory, `stories260k` (the default model), or
one of the generated models (`smollm2-135m`, `llama-1b:Q4_K_M`, ...) that the peer harness builds
(benchmarks.models), where there is one (kvgen.bench.harness)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvgen.bench import harness

STORIES = "stories260k"
DEFAULT_WEIGHTS_SEED = 0


@dataclass(frozen=True)
class BenchModel:
    """A model under test: `path` is what kvgen loads; `gguf` is the same weights as GGUF, if known."""

    name: str
    path: Path
    gguf: Path | None = None

    @property
    def is_hf_dir(self) -> bool:
        return self.path.is_dir()


def resolve(model: str | None, seed: int = DEFAULT_WEIGHTS_SEED) -> BenchModel:
    """`--model` -> BenchModel: through the harness (which knows the generated names) where there is one,
    else a file, `stories260k` or None (the default model)."""
    if harness.available():
        return harness.harness("models", "a generated bench model").resolve(model, seed)
    return resolve_file(model)


def resolve_file(model: str | None) -> BenchModel:
    """`stories260k`, None (the default model) or a path -> BenchModel, with the GGUF beside it if any."""
    from kvgen.llm import default_model_path

    path = default_model_path() if model in (None, STORIES) else Path(model)
    gguf = path if path.suffix == ".gguf" else path.with_suffix(".gguf")
    return BenchModel(model or STORIES, path, gguf if gguf.is_file() else None)
