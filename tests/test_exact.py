"""``ocache.bench.exact``: the comparison itself (pure), and proof that it bites on a wrong restored state.

The server tests restore a slot file that holds another conversation's state under this
conversation's token list (the server then reuses it in full, as it would a corrupted or
mislabelled file that passed every check), and assert that the exactness check fails; the same
restore of the right file passes it. Without the second half, a check loosened until it passes on
noise would look like a working one.
"""

from __future__ import annotations

import json
import random
import struct
import urllib.request
from pathlib import Path

import pytest
import xxhash

from ocache.bench.exact import TOL_NATS, Generation, compare, describe


def gen(tokens, margins, logprobs=None, top2=None):
    lps = logprobs or [-1.0] * len(tokens)
    top2 = top2 or [(t, -1) for t in tokens]
    return Generation(tuple(tokens), tuple(lps), tuple(margins), tuple(top2))


def test_equal_generations_are_exact_to_the_end():
    ref = gen([1, 2, 3], [1.0, 1.0, 1.0])
    v = compare(ref, gen([1, 2, 3], [1.0, 1.0, 1.0]))
    assert v.exact and v.compared == 3 and v.tie_at is None


def test_a_different_token_before_any_tie_fails():
    ref = gen([1, 2, 3], [1.0, 1.0, 1.0])
    v = compare(ref, gen([1, 9, 3], [1.0, 1.0, 1.0]))
    assert not v.exact and v.diverged_at == 1, describe(v)


def test_comparison_stops_where_a_near_tie_flipped():
    ref = gen([1, 2, 3, 4], [1.0, TOL_NATS / 2, 1.0, 1.0], top2=[(1, 0), (2, 7), (3, 0), (4, 0)])
    # a near-tie resolved the same way is compared through
    v = compare(ref, gen([1, 2, 3, 5], [1.0] * 4))
    assert not v.exact and v.diverged_at == 3, describe(v)
    # the tie flipped to the runner-up and everything after differs: still exact
    v = compare(ref, gen([1, 7, 8, 9], [1.0] * 4))
    assert v.exact and v.tie_at == 1 and v.compared == 2, describe(v)
    # but a token that is not one of the two best at the tie is wrong
    v = compare(ref, gen([1, 5, 8, 9], [1.0] * 4))
    assert not v.exact and v.diverged_at == 1, describe(v)


def test_log_probabilities_must_agree_within_the_tolerance():
    ref = gen([1, 2], [1.0, 1.0], logprobs=[-1.0, -2.0])
    assert compare(ref, gen([1, 2], [1.0, 1.0], logprobs=[-1.0, -2.0 + TOL_NATS / 2])).exact
    v = compare(ref, gen([1, 2], [1.0, 1.0], logprobs=[-1.0, -2.0 + 2 * TOL_NATS]))
    assert not v.exact and v.diverged_at == 1, describe(v)


def test_lengths_that_differ_without_a_tie_fail():
    assert not compare(gen([1, 2, 3], [1.0] * 3), gen([1, 2], [1.0] * 2)).exact
    # ... unless the shorter one is a stream's prefix (entries held back at its end)
    short = Generation((1, 2), (-1.0, -1.0), (1.0, 1.0), ((1, 0), (2, 0)), complete=False)
    assert compare(gen([1, 2, 3], [1.0] * 3), short).exact
    assert not compare(gen([1, 9, 3], [1.0] * 3), short).exact


def test_a_stream_with_fewer_entries_than_tokens_is_an_incomplete_prefix():
    entry = {"id": 5, "logprob": -0.5, "top_logprobs": [{"id": 5, "logprob": -0.5},
                                                          {"id": 6, "logprob": -1.5}]}
    ev = {"choices": [{"delta": {}, "logprobs": {"content": [entry]}}]}
    assert Generation.from_stream([ev], n_generated=1).complete
    assert not Generation.from_stream([ev], n_generated=3).complete


def test_parses_completion_and_chat_shapes():
    entry = {"id": 5, "logprob": -0.5, "top_logprobs": [{"id": 5, "logprob": -0.5},
                                                          {"id": 6, "logprob": -1.5}]}
    a = Generation.from_response({"completion_probabilities": [entry]})
    b = Generation.from_response({"choices": [{"logprobs": {"content": [entry]}}]})
    c = Generation.from_stream([{"choices": [{"delta": {}, "logprobs": {"content": [entry]}}]}])
    assert a == b == c and a.tokens == (5,) and a.margins == (1.0,) and a.top2 == ((5, 6),)
    assert Generation.from_response({"choices": [{"message": {}}]}) is None
    with pytest.raises(ValueError):
        Generation.from_entries([{"id": 1, "logprob": 0.0, "top_logprobs": [{"id": 1, "logprob": 0}]}])


# ------------------------------------------------------------------------------ against the server

WORDS = "alpha beta gamma delta read write file path test build cache slot token model".split()
N = 1200
SRV = dict(ctx_size=8192, ubatch=128, batch=512, ctx_checkpoints=32, checkpoint_min_step=256)


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def tokens_of(srv, seed: int) -> list[int]:
    text = " ".join(random.Random(seed).choice(WORDS) for _ in range(2 * N))
    toks = post(srv.url + "/tokenize", {"content": text})["tokens"]
    assert len(toks) >= N
    return toks[:N]


def complete(srv, prompt: list[int], n_predict: int, cache_prompt: bool = True) -> dict:
    return post(srv.url + "/completion", {"prompt": prompt, "n_predict": n_predict, "id_slot": 0,
                                          "cache_prompt": cache_prompt, "temperature": 0,
                                          "top_k": 1, "n_probs": 2, "return_tokens": True})


def relabel(src: Path, dst: Path, tokens: list[int]) -> None:
    """Copy a slot file, replacing its token list by ``tokens`` (same count), and its checkpoint
    sidecar, if any, with the tokens hash and header hash made to match (so the patch accepts it):
    the state inside is another conversation's, the labels say it is this one."""
    data = bytearray(src.read_bytes())
    magic, version, n_words = struct.unpack_from("<III", data, 0)
    words = struct.unpack_from(f"<{n_words}i", data, 12)
    assert (magic, version, words[0], words[1], words[2]) == (0x67677371, 3, -1, 1, len(tokens))
    struct.pack_into(f"<{len(tokens)}i", data, 12 + 12, *tokens)
    dst.write_bytes(bytes(data))
    ckpt = src.with_name(src.name + ".ckpt")
    if ckpt.exists():
        sc = bytearray(ckpt.read_bytes())
        hdr = struct.Struct("<4sIIQQII")
        fields = list(hdr.unpack_from(sc, 0))
        fields[3] = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tokens)}i", *tokens))
        hdr.pack_into(sc, 0, *fields)
        struct.pack_into("<Q", sc, hdr.size, xxhash.xxh3_64_intdigest(bytes(sc[:hdr.size])))
        dst.with_name(dst.name + ".ckpt").write_bytes(bytes(sc))


@pytest.mark.server
@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_a_wrong_restored_state_fails_the_check_and_the_right_one_passes(start_server, tmp_path,
                                                                         model):
    srv = start_server(model=model, n_parallel=1, **SRV)
    slots = tmp_path / "slots"
    a, b = tokens_of(srv, 1), tokens_of(srv, 2)
    assert a != b
    for name, prompt in (("a.bin", a), ("b.bin", b)):
        complete(srv, prompt, 0)
        assert post(srv.url + "/slots/0?action=save", {"filename": name})["n_saved"] == N
    relabel(slots / "a.bin", slots / "a-as-b.bin", b)
    srv.restart()
    cold = complete(srv, b, 12, cache_prompt=False)
    assert cold["timings"]["cache_n"] == 0
    ref = Generation.from_response(cold)
    verdicts = {}
    for name in ("b.bin", "a-as-b.bin"):
        srv.restart()
        post(srv.url + "/slots/0?action=restore", {"filename": name})
        res = complete(srv, b, 12)
        assert res["timings"]["cache_n"] >= N - SRV["ubatch"], (name, res["timings"])
        verdicts[name] = compare(ref, Generation.from_response(res))
    assert verdicts["b.bin"].exact, describe(verdicts["b.bin"])
    assert not verdicts["a-as-b.bin"].exact, describe(verdicts["a-as-b.bin"])
    assert verdicts["a-as-b.bin"].diverged_at == 0, describe(verdicts["a-as-b.bin"])
