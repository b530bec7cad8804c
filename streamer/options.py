"""The memory and streaming options of a run as one frozen, validated object, and the runtime presets that
give their defaults: TOML files shipped as streamer.presets' data (the repository's profiles/), or any TOML
file. Command-line values win over a preset's; a preset wins over the built-in defaults.

A preset's RAM budget is either absolute (`ram_budget = "7G"`) or a share of the memory available when the
options are built (`budget_fraction = 0.5`: of what the OS reports available, capped by the cgroup limit),
never both; StreamOptions only ever holds bytes."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from enum import StrEnum
from importlib import resources
from pathlib import Path

from streamer import budget
from streamer.errors import StreamerError
from streamer.io import parse_size

# Parallel expert reads. 8, not 4: a cold first token reads each layer's 8 routed experts (3 parts each) at once,
# and random O_DIRECT reads ran faster 8 deep (a cold 1-token run took 0.69-0.83x the time). Reads land in
# cache slots: more readers cost threads, not memory.
READERS = 8


class IoMode(StrEnum):
    """How expert reads bypass the page cache: O_DIRECT, buffered + POSIX_FADV_DONTNEED, or direct where the
    filesystem allows it."""

    AUTO = "auto"
    DIRECT = "direct"
    BUFFERED = "buffered"

    @property
    def direct(self) -> bool | None:
        return {IoMode.AUTO: None, IoMode.DIRECT: True, IoMode.BUFFERED: False}[self]


@dataclass(frozen=True)
class StreamOptions:
    """Validated on construction (a bad value is refused before any file is opened, dense models included)."""

    ram_budget: int | None = None  # bytes for everything resident (a size string is parsed); None: a default share
    stream: bool = True  # False: all experts used in place from the mapping (--no-stream)
    expert_top_p: float = 1.0  # per token, drop routed experts beyond this cumulative weight (1.0: off)
    prefetch: bool = True  # router-lookahead expert prefetch
    learn: bool = True  # load and save the learned expert-usage file
    io: IoMode = IoMode.AUTO
    readers: int = READERS  # parallel expert reads
    pin_share: float = 0.5  # at most this share of the expert cache is pinned to learned hot experts
    expert_cache_bytes: int | None = None  # size the expert cache exactly, instead of planning it from the budget
    mmap: bool = True  # False: the whole file read into the process's memory (--no-mmap; implies stream=False)
    expert_skip: float = 0.0  # per token, drop uncached routed experts below this weight share (0: off)
    n_seq: int = 1  # sequences decoded together (serve and bench --parallel): the budget holds each one's state

    def __post_init__(self) -> None:
        if isinstance(self.ram_budget, str):
            object.__setattr__(self, "ram_budget", parse_size(self.ram_budget))
        if self.io not in set(IoMode):
            raise StreamerError(f"--io must be auto, direct or buffered, got {self.io!r}")
        object.__setattr__(self, "io", IoMode(self.io))
        if not self.mmap:  # every expert is in the copy: nothing to stream
            object.__setattr__(self, "stream", False)
        checks = (
            (self.ram_budget is not None and self.ram_budget <= 0, "--ram-budget must be positive", self.ram_budget),
            (not 0.0 < self.expert_top_p <= 1.0, "--expert-top-p must be in (0, 1]", self.expert_top_p),  # NaN too
            (not 0.0 <= self.expert_skip < 1.0, "--expert-skip must be in [0, 1)", self.expert_skip),
            (self.readers < 1, "readers must be at least 1", self.readers),
            (self.n_seq < 1, "--parallel must be at least 1", self.n_seq),
            (not 0.0 <= self.pin_share <= 1.0, "pin_share must be in [0, 1]", self.pin_share),
            (
                self.expert_cache_bytes is not None and self.expert_cache_bytes <= 0,
                "the expert cache size must be positive",
                self.expert_cache_bytes,
            ),
        )
        for bad, message, value in checks:
            if bad:
                raise StreamerError(f"{message}, got {value}")

    @classmethod
    def build(cls, preset: str | None = None, **given) -> StreamOptions:
        """A preset's values (none: the defaults), then every given value that is not None. A preset's
        budget_fraction becomes ram_budget in bytes of the memory available now, unless a ram_budget is given."""
        values = load_preset(preset) if preset else {}
        values.pop("description", None)
        given = {k: v for k, v in given.items() if v is not None}
        fraction = values.pop("budget_fraction", None)
        if fraction is not None and "ram_budget" not in given:
            values["ram_budget"] = int(fraction * budget.available_memory())
        return cls(**{**values, **given})


# preset keys -> the TOML types they take (a preset sets these options only; description is for listings)
PRESET_KEYS = {
    "description": (str,),
    "ram_budget": (str, int),
    "budget_fraction": (float, int),
    "prefetch": (bool,),
    "expert_top_p": (float, int),
    "expert_skip": (float, int),
    "pin_share": (float, int),
    "readers": (int,),
}


def available_presets() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("streamer.presets").iterdir() if p.name.endswith(".toml"))


def load_preset(name: str) -> dict:
    """A built-in preset by name (e.g. '8g') or a TOML file path -> its validated keys (unknown ones refused)."""
    path = Path(name)
    if not path.suffix:
        res = resources.files("streamer.presets") / f"{name}.toml"
        if not res.is_file():
            raise StreamerError(
                f"unknown preset '{name}' (built-in: {', '.join(available_presets())}; or give a .toml file)"
            )
        text, where = res.read_text(), f"preset '{name}'"
    else:
        try:
            text, where = path.read_text(), str(path)
        except OSError as e:
            raise StreamerError(f"cannot read preset {path}: {e.strerror or e}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise StreamerError(f"{where} is not valid TOML: {e}") from None
    for k, v in data.items():
        if k not in PRESET_KEYS:
            raise StreamerError(f"{where}: unknown key '{k}' (known: {', '.join(PRESET_KEYS)})")
        if not isinstance(v, PRESET_KEYS[k]) or (isinstance(v, bool) and bool not in PRESET_KEYS[k]):
            raise StreamerError(f"{where}: '{k}' has a bad value {v!r}")
    if "ram_budget" in data and "budget_fraction" in data:
        raise StreamerError(f"{where}: give ram_budget or budget_fraction, not both")
    if "budget_fraction" in data and not 0.0 < data["budget_fraction"] <= 1.0:
        raise StreamerError(f"{where}: budget_fraction must be in (0, 1], got {data['budget_fraction']}")
    try:
        StreamOptions.build(None, **{k: v for k, v in data.items() if k not in ("description", "budget_fraction")})
    except StreamerError as e:  # a value out of range: say which file
        raise StreamerError(f"{where}: {e}") from None
    return data


def describe_preset(name: str) -> tuple[str, dict]:
    """(description, option values) of a built-in preset or TOML file, for listing."""
    data = load_preset(name)
    return data.pop("description", ""), data
