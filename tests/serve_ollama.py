"""The official `ollama` client against `sift serve`'s Ollama routes: the model listed and shown,
one chat whole and one streamed, one with log-probabilities, a generation, and an embedding,
with the key sent as a bearer token.

Usage: serve_ollama.py BASE_URL SYSTEM MESSAGE NUM_PREDICT. Prints one JSON object with the
replies' text, stop reasons and counts, for tests/serve_python.rs to compare with the OpenAI
routes.
"""

import json
import sys

from ollama import Client


def main() -> None:
    base, system, message, num_predict = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    client = Client(host=base, headers={"Authorization": "Bearer sesame"}, timeout=300)
    listed = client.list().models[0]
    shown = client.show(listed.model)
    options = {"temperature": 0, "num_predict": num_predict}
    messages = [{"role": "system", "content": system}, {"role": "user", "content": message}]
    whole = client.chat(model=listed.model, messages=messages, options=options)
    pieces = [part.message.content for part in client.chat(model=listed.model, messages=messages, options=options, stream=True)]
    with_logprobs = client.chat(model=listed.model, messages=messages, options=options, logprobs=True, top_logprobs=2)
    generated = client.generate(model=listed.model, prompt=message, system=system, options=options)
    embedded = client.embed(model=listed.model, input=[message])
    print(
        json.dumps(
            {
                "model": listed.model,
                "quantization": listed.details.quantization_level,
                "size": listed.size,
                "template": shown.template,
                "whole": whole.message.content,
                "whole_done": whole.done_reason,
                "prompt_eval_count": whole.prompt_eval_count,
                "eval_count": whole.eval_count,
                "streamed": "".join(pieces),
                "streamed_pieces": len(pieces),
                "logprobs": [
                    [entry.token, entry.logprob, [alt.token for alt in entry.top_logprobs]]
                    for entry in with_logprobs.logprobs
                ],
                "generated": generated.response,
                "embedding": list(embedded.embeddings[0]),
            }
        )
    )


if __name__ == "__main__":
    main()
