"""stream-run: Qwen3 / Qwen3-MoE GGUF runner that streams experts from disk under a RAM budget."""

import importlib.util
import sys
from pathlib import Path

from streamer.errors import StreamerError

__all__ = ["StreamerError"]


def _source_checkout_names() -> None:
    """Installed, the repository's cli/ and profiles/ are the subpackages streamer.cli and streamer.presets
    (pyproject's package-dir). In a source checkout they sit beside this package: when the checkout itself is
    imported (e.g. `python -m pytest` from the repository root), give them the same names."""
    here = Path(__file__).resolve().parent
    for name, folder in (("cli", "cli"), ("presets", "profiles")):
        init = here.parent / folder / "__init__.py"
        if (here / name).exists() or f"{__name__}.{name}" in sys.modules or not init.is_file():
            continue
        spec = importlib.util.spec_from_file_location(
            f"{__name__}.{name}", init, submodule_search_locations=[str(init.parent)]
        )
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        setattr(sys.modules[__name__], name, module)


_source_checkout_names()
