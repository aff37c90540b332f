"""A tiny linear classifier as a Flashpoint handler bundle (see flashpoint.toml).

preprocess normalizes each request's features with the mean and std in the weights file
(request arrays, numpy); predict runs the linear layer on the batch (torch tensors on the
model's device); postprocess turns a request's logits into its label (argmax).
"""

import numpy as np
import torch

MEAN = np.array([5.8, 3.0, 3.8, 1.2], dtype=np.float32)
STD = np.array([0.8, 0.4, 1.8, 0.8], dtype=np.float32)


class LinearClassifier:
    def load(self, weights, device):
        self.weight = weights["fc.weight"]  # views of the blob: no copy on CPU
        self.bias = weights["fc.bias"]

    def preprocess(self, inputs):
        x = np.asarray(inputs["x"], dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != 4:
            raise ValueError(f"x must be [batch, 4], got {list(x.shape)}")
        return {"x": (x - MEAN) / STD}

    def predict(self, batch):
        return {"logits": torch.nn.functional.linear(batch["x"], self.weight, self.bias)}

    def postprocess(self, outputs):
        logits = outputs["logits"]
        return {"label": np.argmax(logits, axis=-1).astype(np.int64), "logits": logits}
