"""Teacher-forced logits of a fixed prompt: a prefill of its first tokens, then one token at a time; for
comparing two ways of running one model bit for bit."""

import numpy as np

PROMPT = np.array([3, 77, 120, 9, 201, 45, 45, 18, 160, 2, 99, 64], dtype=np.int64)


def run(session, n_prefill=5):
    """Every position's logits: PROMPT[:n_prefill] as one prefill, then each later token alone."""
    c = session.model.new_state()
    out = [session.model.forward(PROMPT[:n_prefill], c, all_logits=True)]
    out += [session.model.forward(PROMPT[i : i + 1], c, all_logits=True) for i in range(n_prefill, len(PROMPT))]
    return np.concatenate(out)
