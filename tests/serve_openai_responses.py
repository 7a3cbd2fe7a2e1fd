"""The official `openai` client against `sift serve`'s `/v1/responses`: one response whole, one
streamed (the raw events), one held to a JSON Schema through the client's stream helper (its
final response assembled from the events), and a required function call.

Usage: serve_openai_responses.py BASE_URL SYSTEM MESSAGE MAX_OUTPUT_TOKENS SCHEMA. Prints one
JSON object with the replies, for tests/serve_python.rs to compare with `/v1/chat/completions`.
"""

import json
import sys

from openai import OpenAI


def main() -> None:
    base, system, message, limit, schema = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    schema = json.loads(schema)
    client = OpenAI(base_url=base + "/v1", api_key="sesame", max_retries=0, timeout=300)
    request = dict(model="gemma-3-270m-Q4_K_M", instructions=system, input=message, max_output_tokens=limit, temperature=0)
    whole = client.responses.create(**request)
    events = list(client.responses.create(**request, stream=True))
    structured = dict(model="gemma-3-270m-Q4_K_M", input=message, max_output_tokens=60, temperature=0)
    text = {"format": {"type": "json_schema", "name": "colours", "schema": schema, "strict": True}}
    with client.responses.stream(**structured, text=text) as stream:
        pieces = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    tool = {"type": "function", "name": "pick_colours", "description": "Pick colours", "parameters": schema}
    called = client.responses.create(
        **structured, tools=[tool], tool_choice={"type": "function", "name": "pick_colours"}, parallel_tool_calls=False
    )
    call = called.output[0]
    print(
        json.dumps(
            {
                "whole": whole.output_text,
                "whole_status": whole.status,
                "input_tokens": whole.usage.input_tokens,
                "output_tokens": whole.usage.output_tokens,
                "streamed": "".join(e.delta for e in events if e.type == "response.output_text.delta"),
                "last_event": events[-1].type,
                "last_text": events[-1].response.output_text,
                "structured": final.output_text,
                "structured_pieces": "".join(pieces),
                "structured_status": final.status,
                "call": {"type": call.type, "name": call.name, "arguments": call.arguments},
            }
        )
    )


if __name__ == "__main__":
    main()
