"""`stream-run presets` (alias `profiles`): the built-in runtime presets, one line each, with the settings they
give."""

from __future__ import annotations

import textwrap

from streamer.budget import DEFAULT_FRACTION, available_memory
from streamer.io import human, parse_size
from streamer.options import PRESET_KEYS, StreamOptions, available_presets, describe_preset


def _value(v) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else repr(v) if isinstance(v, str) else str(v)


def presets() -> None:
    """List the built-in runtime presets for --preset/--profile (name, description, settings) and how to write
    your own."""
    entries = [(name, *describe_preset(name)) for name in available_presets()]
    # share-of-memory presets first (by share), then the fixed budgets (by size)
    entries.sort(
        key=lambda e: (
            (0, e[2]["budget_fraction"])
            if "budget_fraction" in e[2]
            else (1, parse_size(e[2]["ram_budget"]) if "ram_budget" in e[2] else 0)
        )
    )
    avail = available_memory()
    width = max(len(e[0]) for e in entries)
    print("Built-in presets (--preset NAME, or --profile NAME; flags given explicitly win over a preset's settings):\n")
    for name, description, opts in entries:
        settings = " ".join(
            f"{k}={_value(v)}" + (f" (= {human(int(v * avail))} now)" if k == "budget_fraction" else "")
            for k, v in opts.items()
        )
        print(f"  {name:<{width}}  {description}")
        print(f"  {'':<{width}}  {settings}")
    d = StreamOptions()  # the defaults an unset key keeps, from the one place they are set
    print()
    print(
        textwrap.fill(
            f"Memory available now: {human(avail)} (the cgroup limit included). Your own preset: --preset "
            f'PATH.toml, a TOML file anywhere, with any of: {", ".join(PRESET_KEYS)}. ram_budget is a size ("7G"); '
            "budget_fraction (0 < f <= 1) is a share of the memory available when the model opens; give one or "
            f"the other. Unset keys keep the defaults (budget {DEFAULT_FRACTION:.0%} of available memory, prefetch "
            f"{_value(d.prefetch)}, expert_top_p {d.expert_top_p}, expert_skip {d.expert_skip}, "
            f"pin_share {d.pin_share}, readers {d.readers}).",
            100,
        )
    )
