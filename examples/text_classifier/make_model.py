"""Write a small Hugging Face text classifier (random weights) to a directory.

Any directory that ``save_pretrained`` wrote serves the same way: ``config.json`` naming a
``*ForSequenceClassification`` architecture, ``model.safetensors`` (or
``pytorch_model.bin``) and the tokenizer files. This one is built here because this
machine reaches no model hub.

    python examples/text_classifier/make_model.py ./sentiment-model
"""

import sys

from flashpoint.models.tiny_hf import make_text_classifier

if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "sentiment-model"
    print(make_text_classifier(out, size="tiny", labels=("negative", "positive")))
