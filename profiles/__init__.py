"""Runtime presets (TOML) for `stream-run --profile NAME`: RAM budget, expert cache tiers, prefetch and
expert top-p per machine size. Values given on the command line win over a profile's."""
