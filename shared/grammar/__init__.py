"""Structured outputs' grammars: a Constraint compiled for the model's tokenizer by llguidance
(bench/results/grammar-engines.md says why that engine), and the state of one sequence's output
under it, which masks the logits of the tokens that cannot continue a valid output."""
