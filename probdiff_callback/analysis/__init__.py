"""After (or during) a run: rank its checkpoints (`select`), check ProbDiff against independent measures
(`crosscheck`, `verdicts`, `disagreement`), draw it (`plot`), and the reports they print (`report`). All of it reads
a run through `run_files.read_run` and never imports torch."""
