"""Write a small causal language model (Llama-style, random weights, a chat template).

Any ``save_pretrained`` directory of a ``*ForCausalLM`` (GPT-2, Llama...) serves the same
way: its config says it generates, so neither push nor deploy needs a flag.

    python examples/generation/make_model.py ./tiny-llama
"""

import sys

from flashpoint.models.tiny_hf import make_causal_lm

if __name__ == "__main__":
    print(make_causal_lm(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama", family="llama"))
