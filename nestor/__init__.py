"""nestor: train large Flax models with data, fsdp, tensor, pipeline and expert parallelism in one mesh.

The repository keeps its rooms as top-level folders (orchestrator, parallel,
models, cluster, configs, backend); an installed nestor holds them under this
one package (pyproject.toml maps them). A checkout on `sys.path` without an
install (a Ray job's uploaded working directory, the test suite) finds them
beside this folder.
"""

from pathlib import Path

_checkout = Path(__file__).resolve().parent.parent
if not (Path(__file__).resolve().parent / "orchestrator").is_dir() and (_checkout / "orchestrator").is_dir():
    __path__.append(str(_checkout))  # noqa: F821 (a package's __path__)
