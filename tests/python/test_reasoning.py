"""Reasoning split: a chat template that opens <think> sends the model's text to
reasoning_content until </think>; enable_thinking / reasoning_effort close the block."""

MSG = [{"role": "user", "content": "What is 2 + 2?"}]


def reasoning_of(message):
    return (message.model_extra or {}).get("reasoning_content")


def test_prompt_that_opens_think_gives_reasoning(think_server):
    client = think_server.client()
    r = client.chat.completions.create(model="m", messages=MSG, max_tokens=16, temperature=0)
    msg = r.choices[0].message
    reasoning = reasoning_of(msg)
    assert reasoning, r
    # SmolLM2 never writes </think>: everything it wrote is reasoning
    assert msg.content == ""
    assert 0 < r.usage.completion_tokens <= 16

    text, streamed_reasoning, finish = "", "", None
    for chunk in client.chat.completions.create(model="m", messages=MSG, max_tokens=16, temperature=0,
                                                stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            streamed_reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            finish = c.finish_reason or finish
    assert streamed_reasoning == reasoning
    assert text == ""
    assert finish == r.choices[0].finish_reason


def test_thinking_off_gives_content(think_server):
    client = think_server.client()
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        r = client.chat.completions.create(model="m", messages=MSG, max_tokens=12, temperature=0,
                                           extra_body=extra)
        msg = r.choices[0].message
        assert msg.content, (extra, r)
        assert not reasoning_of(msg)


def test_reasoning_and_thinking_on(think_server):
    client = think_server.client()
    r = client.chat.completions.create(model="m", messages=MSG, max_tokens=8, temperature=0,
                                       reasoning_effort="high")
    assert reasoning_of(r.choices[0].message)


def test_default_template_has_no_reasoning(client):
    r = client.chat.completions.create(model="m", messages=MSG, max_tokens=8, temperature=0)
    assert not reasoning_of(r.choices[0].message)
    assert r.choices[0].message.content
