"""Train the small real models that ship with stream-run (streamer/models/): a byte-level BPE tokenizer, a
Qwen3-MoE and a dense Qwen3, on the CPython standard library's own source, exported to GGUF Q8_0.

Regenerate everything (about 45 minutes on 2 cores; needs the `[train]` extra, torch on CPU):

    pip install -e '.[train]'
    nice -n 5 python -m streamer.train all --work /tmp/stream-run-train --out streamer/models

Each stage is resumable (checkpoints are written atomically every few minutes) and seeded; each step's batch
comes from its own seeded generator, so a resumed run draws the same batches. `all` trains the two models one
after the other; the committed files were trained side by side (`train --model moe` and `train --model dense`
in two processes, one thread each). torch is imported only here, never by the runtime.

How the committed files differ from a fresh run of this script, honestly: their schedules were shortened while
they ran, to finish within a time limit on a loaded machine. MoE: first cycle 550 -> 400 steps at step 45 (still
in warm-up, so no effect), second cycle 400 -> 300 steps at step 489 (steps 400-488 followed a 400-step
cosine). Dense: first cycle 600 -> 450 steps at step 81 (steps 50-80 followed a 600-step cosine). Everything
else (data order, seeds, the rest of the schedules) is what this script does.
"""
