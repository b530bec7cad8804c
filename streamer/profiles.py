"""Runtime profiles: TOML presets in the top-level `profiles/` package (or any TOML file) giving defaults
for the streaming options. Command-line values win over a profile's; a profile wins over built-in defaults.

The RAM budget is either absolute (`ram_budget = "7G"`) or a share of the memory available when the model
is opened (`budget_fraction = 0.5`: of what the OS reports available, capped by the cgroup limit), never
both. resolve() turns a fraction into bytes, so callers only ever see `ram_budget`."""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path

from streamer.errors import StreamerError

KEYS = {"description": (str,), "ram_budget": (str, int), "budget_fraction": (float, int), "prefetch": (bool,),
        "expert_top_p": (float, int), "pin_share": (float, int), "readers": (int,)}
INFO_KEYS = ("description",)  # shown by `stream-run profiles`, not options


def available() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("streamer.presets").iterdir() if p.name.endswith(".toml"))


def load_profile(name: str) -> dict:
    """A built-in profile by name (e.g. '8g') or a TOML file path -> validated options."""
    path = Path(name)
    if not path.suffix:
        res = resources.files("streamer.presets") / f"{name}.toml"
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
    if "ram_budget" in data and "budget_fraction" in data:
        raise StreamerError(f"{where}: give ram_budget or budget_fraction, not both")
    if "budget_fraction" in data and not 0.0 < data["budget_fraction"] <= 1.0:
        raise StreamerError(f"{where}: budget_fraction must be in (0, 1], got {data['budget_fraction']}")
    return data


def describe(name: str) -> tuple[str, dict]:
    """(description, option values) of a built-in profile or TOML file, for listing."""
    data = load_profile(name)
    return data.pop("description", ""), data


def resolve(profile: str | None, **given) -> dict:
    """Merge: profile values, then every command-line value that was given (not None). A profile's
    budget_fraction becomes ram_budget in bytes of the memory available now, unless a ram_budget was given."""
    opts = load_profile(profile) if profile else {}
    for k in INFO_KEYS:
        opts.pop(k, None)
    given = {k: v for k, v in given.items() if v is not None}
    fraction = opts.pop("budget_fraction", None)
    if fraction is not None and "ram_budget" not in given:
        from streamer.budget import available_memory
        opts["ram_budget"] = int(fraction * available_memory())
    opts.update(given)
    return opts
