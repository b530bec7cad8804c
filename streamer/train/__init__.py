"""Train the small real models that ship with stream-run (streamer/models/): a byte-level BPE tokenizer, a
Qwen3-MoE and a dense Qwen3, on the CPython standard library's own source, exported to GGUF Q8_0.

Regenerate everything (about 45 minutes on 2 cores; needs the `[train]` extra, torch on CPU):

    pip install -e '.[train]'
    nice -n 5 python -m streamer.train all --work /tmp/stream-run-train --out streamer/models

Each stage is resumable (checkpoints are written atomically every few minutes) and seeded. torch is imported
only here, never by the runtime.
"""
