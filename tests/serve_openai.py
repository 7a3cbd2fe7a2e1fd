"""The official `openai` client against `sift serve`: one chat completion whole, one streamed,
one held to a JSON Schema through `response_format` (given three times the tokens), the same
asked through the client's `parse` with a Pydantic model, as Python applications ask for it, and
a required call of a tool whose parameters are that schema, whole and streamed, and the
message's embedding, as the client asks for it by default (base64) and as floats.

Usage: serve_openai.py BASE_URL MESSAGE MAX_TOKENS SCHEMA. Prints one JSON object with the model
list, the model retrieved by name, and the replies' text, for tests/serve_python.rs to compare
with `sift run --chat` (and `--json-schema SCHEMA`).
"""

import json
import sys

from openai import OpenAI
from pydantic import BaseModel, Field


class Colours(BaseModel):
    colours: list[str] = Field(max_length=3)


def main() -> None:
    base, message, max_tokens, schema = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    client = OpenAI(base_url=base + "/v1", api_key="sesame", max_retries=0, timeout=300)
    models = [m.id for m in client.models.list()]
    retrieved = client.models.retrieve(models[0]).id
    request = dict(
        model=models[0],
        messages=[{"role": "user", "content": message}],
        temperature=0,
        max_tokens=max_tokens,
    )
    whole = client.chat.completions.create(**request)
    streamed = []
    finish = None
    for chunk in client.chat.completions.create(**request, stream=True):
        if chunk.choices:
            streamed.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    structured = client.chat.completions.create(
        **{**request, "max_tokens": 3 * max_tokens},
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": schema}},
    )
    parsed = client.chat.completions.parse(
        **{**request, "max_tokens": 3 * max_tokens},
        response_format=Colours,
    )
    tools = [{"type": "function", "function": {"name": "pick_colours", "parameters": schema}}]
    calling = {**request, "max_tokens": 3 * max_tokens, "tools": tools, "tool_choice": "required"}
    called = client.chat.completions.create(**calling, parallel_tool_calls=False)
    call = called.choices[0].message.tool_calls[0]
    # A stream's calls, put together from their deltas as clients do.
    streamed_call = {"name": "", "arguments": ""}
    for chunk in client.chat.completions.create(**calling, parallel_tool_calls=False, stream=True):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            streamed_call["name"] += delta.function.name or ""
            streamed_call["arguments"] += delta.function.arguments or ""
    embedded = client.embeddings.create(model=models[0], input=[message]).data[0].embedding
    floats = client.embeddings.create(model=models[0], input=message, encoding_format="float").data[0].embedding
    print(
        json.dumps(
            {
                "models": models,
                "retrieved": retrieved,
                "whole": whole.choices[0].message.content,
                "whole_finish": whole.choices[0].finish_reason,
                "completion_tokens": whole.usage.completion_tokens,
                "streamed": "".join(streamed),
                "streamed_chunks": len(streamed),
                "streamed_finish": finish,
                "structured": structured.choices[0].message.content,
                "parsed": parsed.choices[0].message.parsed.colours,
                "call": {"name": call.function.name, "arguments": call.function.arguments},
                "call_finish": called.choices[0].finish_reason,
                "streamed_call": streamed_call,
                "embedding": list(embedded),
                "embedding_floats": floats,
            }
        )
    )


if __name__ == "__main__":
    main()
