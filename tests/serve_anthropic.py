"""The official `anthropic` client against `sift serve`'s `/v1/messages`: one message whole and
one streamed (through the client's event stream, and its text stream), with a system prompt,
the key sent as the client sends it. The server samples greedily by default (`--temp 0`): the
client sends no temperature.

Usage: serve_anthropic.py BASE_URL SYSTEM MESSAGE MAX_TOKENS. Prints one JSON object with the
replies' text, stop reasons and token counts, for tests/serve_python.rs to compare with
`/v1/chat/completions`.
"""

import json
import sys

from anthropic import Anthropic


def main() -> None:
    base, system, message, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    client = Anthropic(base_url=base, api_key="sesame", max_retries=0, timeout=300)
    request = dict(
        model="gemma-3-270m-Q4_K_M",
        max_tokens=max_tokens,
        system=system,
        messages=[{"role": "user", "content": message}],
    )
    whole = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    print(
        json.dumps(
            {
                "whole": "".join(block.text for block in whole.content),
                "whole_stop": whole.stop_reason,
                "input_tokens": whole.usage.input_tokens,
                "output_tokens": whole.usage.output_tokens,
                "streamed": "".join(pieces),
                "streamed_pieces": len(pieces),
                "final": "".join(block.text for block in final.content),
                "final_stop": final.stop_reason,
                "final_output_tokens": final.usage.output_tokens,
            }
        )
    )


if __name__ == "__main__":
    main()
