"""Responses cut by `max_output_tokens`: status `incomplete` with
`incomplete_details.reason = max_output_tokens`, and a stream that ends with
`response.incomplete` (as OpenAI's), whole and streamed."""
import json

INPUT = "Write a long story about a dragon."


def test_whole_response_is_incomplete(client):
    r = client.responses.create(model="m", input=INPUT, max_output_tokens=3, temperature=0)
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3
    assert r.output_text


def test_stream_ends_with_response_incomplete(server):
    events = []
    with server.http() as h:
        body = {"model": "m", "input": INPUT, "max_output_tokens": 3, "temperature": 0, "stream": True}
        with h.stream("POST", "/v1/responses", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "response.incomplete"
    assert "response.completed" not in kinds
    final = events[-1]["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["usage"]["output_tokens"] == 3
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_stream_that_ends_is_completed(client):
    with client.responses.stream(model="m", input="Say OK.", max_output_tokens=200,
                                 temperature=0) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed"
    assert final.status == "completed" and final.incomplete_details is None
