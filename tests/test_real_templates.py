"""The tiny models served with the chat templates users run (the pinned source's
``models/templates/``), beside ocache's own append-only one (issue 26).

``serve_template`` starts a tiny model with ``--chat-template-file``; the tests here show the
history rewrite that makes a new user message re-prefill a whole agent loop on those templates and
not on ocache's. The measurement of that loop with the server's own generations is
``scripts/measure-align``.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from ocache.toolchain import engine

#: the thinking template each tiny model is served with (both in the pinned source)
TEMPLATES = {"hybrid": "Qwen3.5-4B.jinja", "dense": "Qwen-Qwen3-0.6B.jinja"}


@pytest.fixture
def serve_template(start_server):
    """Factory: ``serve_template(model, template=None, **LlamaServer fields)``: ``start_server``
    with ``--chat-template-file`` of the pinned source's ``models/templates/<template>`` (default:
    ``TEMPLATES[model]``); ``template="ocache"`` serves the model's own template."""
    def _serve(model: str = "hybrid", template: str | None = None, **kw):
        name = template or TEMPLATES[model]
        args = list(kw.pop("args", []))
        if name != "ocache":
            args += ["--chat-template-file", str(engine.chat_template_file(name))]
        return start_server(model, args=args, **kw)
    return _serve


def _post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _render(url: str, messages: list[dict]) -> str:
    return _post(url, "/apply-template", {"messages": messages})["prompt"]


CONVERSATION = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Read the proxy."},
    {"role": "assistant", "content": "", "reasoning_content": "I should read the file first.",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "read", "arguments": "{\"filePath\": \"ocache/proxy.py\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "import asyncio\n"},
    {"role": "assistant", "content": "It relays requests.", "reasoning_content": "The file is short."},
]


@pytest.mark.parametrize("model", ["hybrid", "dense"])
def test_a_new_user_message_rewrites_the_loop_on_the_real_template_only(serve_template, model):
    """On Qwen3.5's and Qwen3's templates the prompt of a new user message no longer holds the
    previous turn's prompt: the reasoning of every assistant turn since the last user message is
    dropped (``loop.index0 > ns.last_query_index``), so the prompt parts at the first of them. On
    ocache's template it is a byte extension. The served template is the file's (``/props``)."""
    name = TEMPLATES[model]
    srv = serve_template(model)
    with urllib.request.urlopen(srv.url + "/props", timeout=30) as r:
        props = json.loads(r.read())
    assert props["chat_template"] == engine.chat_template_file(name).read_text()
    before = _render(srv.url, CONVERSATION[:-1])
    after = _render(srv.url, CONVERSATION + [{"role": "user", "content": "Thanks."}])
    assert "I should read the file first." in before
    assert "I should read the file first." not in after
    assert not after.startswith(before)
    # where the two part: inside the first assistant turn after the user message
    common = next(i for i, (a, b) in enumerate(zip(before, after)) if a != b)
    assert before[:common].endswith("Read the proxy.<|im_end|>\n<|im_start|>assistant\n<t")

    own = serve_template(model, template="ocache")
    before = _render(own.url, CONVERSATION[:-1])
    after = _render(own.url, CONVERSATION + [{"role": "user", "content": "Thanks."}])
    assert after.startswith(before.removesuffix("<|im_start|>assistant\n<think>\n"))
