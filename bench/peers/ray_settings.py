"""Ray Serve deployment options of the peer benchmark (no Ray import: the benchmark's own
process reads them for its report; ``ray_app.py`` applies them)."""

from __future__ import annotations

from typing import Any

# Options per setting. "default": Serve's defaults. "tuned": Serve's documented throughput
# knobs (max_ongoing_requests; @serve.batch for the model). "cold" / "burst": autoscaling from
# zero (min_replicas=0) with Serve's documented knobs for reacting at once.
SETTINGS: dict[str, dict[str, Any]] = {
    "default": {},
    "tuned": {"max_ongoing_requests": 128},
    "cold": {"autoscaling_config": {"min_replicas": 0, "initial_replicas": 0, "max_replicas": 1,
                                    "upscale_delay_s": 0, "downscale_delay_s": 1,
                                    "target_ongoing_requests": 1}},
    "burst": {"autoscaling_config": {"min_replicas": 0, "initial_replicas": 0, "max_replicas": 4,
                                     "upscale_delay_s": 0, "downscale_delay_s": 600,
                                     "target_ongoing_requests": 1, "metrics_interval_s": 0.5,
                                     "look_back_period_s": 1.0}},
}
BATCH = {"max_batch_size": 16, "batch_wait_timeout_s": 0.002}
"""@serve.batch of the tuned setting's model deployment."""
