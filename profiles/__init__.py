"""Runtime presets (TOML) for `stream-run --preset NAME`: RAM budget, expert cache tiers, prefetch and
expert top-p per machine size. Installed as streamer.presets; streamer/options.py reads them. Values given on
the command line win over a preset's."""
