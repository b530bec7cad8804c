"""`serve --parallel`: requests decode together (continuous batching) over a tiny MoE whose experts stream through
a small cache, spoken to with the official `openai` client. Oracles: each request's greedy text from Generator
alone on a resident session (a request's tokens do not depend on what else is in the batch), its seeded
sampled text when it runs alone on the same server, and the server's own counters of slots and expert sharing."""

import threading

import httpx
import openai
import pytest
from serving import Running, greedy, metrics, open_resident, open_streamed, wait_idle

N_CTX, SLOTS, PARALLEL = 256, 24, 4
NO_CACHE = {"cache_prompt": False, "ignore_eos": True}
PROMPTS = [[5, 70, 71], [9, 300, 12, 44, 8], [100, 3], list(range(20, 48))]


@pytest.fixture(scope="module")
def path(synth_model):
    return synth_model("tiny-moe", "Q8_0")


@pytest.fixture(scope="module")
def resident(path):
    with open_resident(path, N_CTX) as s:
        yield s


@pytest.fixture(scope="module")
def srv(path, resident):
    s = open_streamed(path, resident, SLOTS, N_CTX)
    s.model.ubatch = 8  # a prompt of more than 8 tokens is prefilled in chunks, between decode steps
    r = Running(s, parallel=PARALLEL)
    r.wait_loaded()
    yield r
    r.stop()


@pytest.fixture
def oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def together(fn, args):
    """fn(arg) for every arg at once, each in its own thread; their results in order."""
    out, errors = [None] * len(args), []

    def run(i, a):
        try:
            out[i] = fn(a)
        except Exception as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return out


def test_concurrent_requests_get_what_they_get_alone(srv, oai, resident):
    n = 24
    want = [resident.tokenizer.decode(greedy(resident, p, n)) for p in PROMPTS]
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        before = metrics(http, srv.url)

        def complete(p):
            return oai.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0, extra_body=NO_CACHE)

        got = together(complete, PROMPTS)
        m = wait_idle(http, srv.url)
    assert [r.choices[0].text for r in got] == want
    assert all(r.usage.completion_tokens == n and r.choices[0].finish_reason == "length" for r in got)
    # the requests really decoded together: steps with several sequences shared expert reads
    assert m["streamrun_expert_shared_bytes_total"] > before["streamrun_expert_shared_bytes_total"]
    assert (m['streamrun_slots{state="busy"}'], m['streamrun_slots{state="idle"}']) == (0, PARALLEL)
    assert m['streamrun_expert_slots{state="in_use"}'] == 0  # every expert released
    assert m['streamrun_requests_total{outcome="error"}'] == 0


def test_sampling_settings_stay_per_request(oai, resident):
    """Three requests together: one sampled (temperature, seed), one greedy, one greedy cut by a stop string. Each
    keeps its own settings: the greedy ones give their text alone, the sampled one is not its prompt's greedy
    text. (A sampled reply's exact text may differ from the same seed's alone: prompts prefilled together take
    other kernels for the experts they share, and sampling follows the logits' last bits.)"""
    n = 16
    greedy_a = resident.tokenizer.decode(greedy(resident, [7, 8, 9], n))
    want_b = resident.tokenizer.decode(greedy(resident, PROMPTS[1], n))
    alone_c = resident.tokenizer.decode(greedy(resident, PROMPTS[2], n))
    stop = alone_c[6:9]
    cut = alone_c[: alone_c.find(stop)]

    def run(i):
        kw = dict(model="tiny", max_tokens=n, extra_body=NO_CACHE)
        if i == 0:
            return oai.completions.create(prompt=[7, 8, 9], temperature=0.9, seed=11, **kw)
        if i == 1:
            return oai.completions.create(prompt=PROMPTS[1], temperature=0, **kw)
        return oai.completions.create(prompt=PROMPTS[2], temperature=0, stop=[stop], **kw)

    a, b, c = (r.choices[0] for r in together(run, range(3)))
    assert b.text == want_b and b.finish_reason == "length"
    assert (c.text, c.finish_reason) == (cut, "stop")
    assert a.finish_reason == "length" and a.text != greedy_a


def test_a_disconnected_stream_leaves_its_slot_and_the_others_go_on(srv, oai, resident):
    n = 20
    want = resident.tokenizer.decode(greedy(resident, PROMPTS[1], n))

    def run(i):
        if i == 0:  # reads two chunks of a long stream, then hangs up
            stream = oai.completions.create(
                model="tiny", prompt=PROMPTS[0], max_tokens=200, temperature=0, stream=True, extra_body=NO_CACHE
            )
            for k, _ in enumerate(stream):
                if k == 1:
                    break
            stream.close()
            return None
        return (
            oai.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=n, temperature=0, extra_body=NO_CACHE)
            .choices[0]
            .text
        )

    assert together(run, range(2))[1] == want
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        m = wait_idle(http, srv.url)
    assert m['streamrun_slots{state="busy"}'] == 0 and m['streamrun_expert_slots{state="in_use"}'] == 0
    assert m['streamrun_requests_total{outcome="cancelled"}'] >= 1
    assert m["streamrun_tokens_predicted_total"] < 4 * 24 + 16 * 3 + 16 + n + 200  # the hung-up stream stopped early
