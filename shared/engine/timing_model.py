"""TimingModel: how long the real engine takes for one step, fitted from its measured profile.

A step's time is a linear function of what it computes (fitted by `bench/fit_timing.py`, which
runs the real ModelRunner over prompt chunks at several context lengths and decode batches at
several batch sizes and contexts, and saves the coefficients as JSON):

    base + prompt_rows * per_prompt_row + prompt_attention * per_prompt_attention
         + decode_rows * per_decode_row + decode_context * per_decode_context

where prompt_attention sums, over each prompt chunk, rows x the mean context they attend to
(in thousands of tokens: the quadratic part of a long prompt), and decode_context sums the
decode rows' contexts (thousands of tokens: the KV a decode step reads). The mock engine
(`MockRunner`) sleeps this long instead of computing.
"""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy

FEATURES = ("base", "prompt_row", "prompt_attention", "decode_row", "decode_context")
DEFAULT_PATH = Path(__file__).parent / "timing" / "smollm2-135m-cpu.json"


def features(prompts: list[tuple[int, int]], decodes: list[int]) -> list[float]:
    """A step's features: `prompts` (start, end) of each prompt chunk, `decodes` each decode
    row's context length (its sequence's tokens so far)."""
    attention = sum((end - start) * (start + end) / 2 for start, end in prompts) / 1024
    return [
        1.0,
        float(sum(end - start for start, end in prompts)),
        attention,
        float(len(decodes)),
        sum(decodes) / 1024,
    ]


@dataclass(frozen=True)
class TimingModel:
    coefficients: dict[str, float]  # seconds per unit of each of FEATURES
    source: str = ""  # what it was fitted on: model, dtype, CPU, threads
    fit: dict = field(default_factory=dict)  # how well: R^2, worst relative error, samples

    def step_s(self, prompts: list[tuple[int, int]], decodes: list[int]) -> float:
        values = features(prompts, decodes)
        return max(0.0, sum(self.coefficients[name] * v for name, v in zip(FEATURES, values)))

    @classmethod
    def load(cls, path: Path | str) -> "TimingModel":
        data = json.loads(Path(path).read_text())
        missing = [name for name in FEATURES if name not in data.get("coefficients", {})]
        if missing:
            raise ValueError(f"{path}: a timing model needs coefficients for {missing}")
        return cls(
            {k: float(data["coefficients"][k]) for k in FEATURES},
            data.get("source", ""),
            data.get("fit", {}),
        )

    def save(self, path: Path | str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def fitted(cls, samples: list[tuple[list[float], float]], source: str) -> "TimingModel":
        """Least squares over (features, seconds) samples, every coefficient kept >= 0 (a
        negative one is dropped and the rest fitted again): relative error is what is minimized,
        so short decode steps count as much as long prompt chunks."""
        x = numpy.array([f for f, _ in samples], dtype=float)
        y = numpy.array([s for _, s in samples], dtype=float)
        weights = 1.0 / y
        kept = list(range(len(FEATURES)))
        while True:
            solution, *_ = numpy.linalg.lstsq(
                x[:, kept] * weights[:, None], y * weights, rcond=None
            )
            if (solution >= 0).all() or len(kept) == 1:
                break
            kept.pop(int(numpy.argmin(solution)))
        coefficients = dict.fromkeys(FEATURES, 0.0)
        for index, value in zip(kept, solution):
            coefficients[FEATURES[index]] = max(0.0, float(value))
        model = cls(coefficients, source)
        predicted = numpy.array([model.step_s_of(f) for f, _ in samples])
        r2 = 1 - ((y - predicted) ** 2).sum() / ((y - y.mean()) ** 2).sum()
        worst = float((abs(predicted - y) / y).max())
        fit = {"r2": round(float(r2), 4), "worst_rel_error": round(worst, 3), "samples": len(y)}
        return cls(coefficients, source, fit)

    def step_s_of(self, values: list[float]) -> float:
        return sum(self.coefficients[name] * v for name, v in zip(FEATURES, values))
