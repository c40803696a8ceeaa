"""SamplingDefaults: what an OpenAI request that leaves out temperature, top_p, top_k or
repetition_penalty gets.

A checkpoint's `generation_config.json` names the sampling its authors recommend (Qwen2.5
Instruct: temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05; Llama 3.1 Instruct: 0.6
and 0.9). As vLLM does
by default, the OpenAI-compatible API uses those for the fields a request omits; a field the
file does not set keeps OpenAI's default (temperature 1, top_p 1, no top-k). A value given in the
request always wins. The gRPC API takes its fields as sent (temperature 0 is greedy there).
"""

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from shared.control.rules import MAX_REPETITION_PENALTY

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    repetition_penalty: float = 1.0  # 1: off

    @classmethod
    def of(cls, model_dir: Path) -> "SamplingDefaults":
        """The defaults of the checkpoint in `model_dir` (OpenAI's where it sets none)."""
        path = Path(model_dir) / "generation_config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError):
            return cls()
        found = {
            name: config[name]
            for name in ("temperature", "top_p", "top_k", "repetition_penalty")
            if _usable(name, config.get(name))
        }
        if found:
            log.info("sampling defaults from %s: %s", path, found)
        return cls(**found)


OPENAI = SamplingDefaults()  # OpenAI's own: temperature 1, top_p 1, no top-k, no penalty


def _usable(name: str, value) -> bool:
    """Whether `value` is one the request validation would accept for `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    if name == "top_k":
        return isinstance(value, int) and value >= 0
    if name == "top_p":
        return 0 < value <= 1
    if name == "repetition_penalty":
        return 0 < value <= MAX_REPETITION_PENALTY
    return value >= 0
