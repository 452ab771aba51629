"""The method: queries and their chat prompts, the reproducible sampler, decoding, scoring, ProbDiff's metric and the
reference metrics, the settings, and the evaluator that runs answer -> revise -> score with a generation engine (HF
`generate` or vLLM). Nothing here knows about the Trainer or a run's files."""
