"""Stream a chat completion from a Flashpoint function with the official openai client.

    python examples/generation/chat.py [--url http://127.0.0.1:8080] [--model chat-fn]
"""

import argparse

from openai import OpenAI

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--model", default="chat-fn")
    ap.add_argument("--api-key", default="none", help="an API key, when the cluster has them")
    args = ap.parse_args()
    client = OpenAI(base_url=f"{args.url}/v1", api_key=args.api_key)
    stream = client.chat.completions.create(
        model=args.model, messages=[{"role": "user", "content": "Say hello"}],
        max_tokens=16, temperature=0.0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()
