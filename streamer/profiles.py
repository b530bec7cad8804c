"""Runtime profiles: TOML presets in the top-level `profiles/` package (or any TOML file) giving defaults
for the streaming options. Command-line values win over a profile's; a profile wins over built-in defaults."""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path

from streamer.errors import StreamerError

KEYS = {"ram_budget": (str, int), "prefetch": (bool,), "expert_top_p": (float, int), "pin_share": (float, int),
        "readers": (int,)}


def available() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("profiles").iterdir() if p.name.endswith(".toml"))


def load_profile(name: str) -> dict:
    """A built-in profile by name (e.g. '8g') or a TOML file path -> validated options."""
    path = Path(name)
    if not path.suffix:
        res = resources.files("profiles") / f"{name}.toml"
        if not res.is_file():
            raise StreamerError(f"unknown profile '{name}' (built-in: {', '.join(available())}; or give a .toml file)")
        text, where = res.read_text(), f"profile '{name}'"
    else:
        try:
            text, where = path.read_text(), str(path)
        except OSError as e:
            raise StreamerError(f"cannot read profile {path}: {e.strerror or e}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise StreamerError(f"{where} is not valid TOML: {e}") from None
    for k, v in data.items():
        if k not in KEYS:
            raise StreamerError(f"{where}: unknown key '{k}' (known: {', '.join(KEYS)})")
        if not isinstance(v, KEYS[k]) or (isinstance(v, bool) and bool not in KEYS[k]):
            raise StreamerError(f"{where}: '{k}' has a bad value {v!r}")
    return data


def resolve(profile: str | None, **given) -> dict:
    """Merge: profile values, then every command-line value that was given (not None)."""
    opts = load_profile(profile) if profile else {}
    opts.update({k: v for k, v in given.items() if v is not None})
    return opts
